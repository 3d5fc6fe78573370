"""The deployment files (deploy/): compose file, images, Prometheus and Grafana configuration.

There is no Docker engine on these machines, so the compose file is checked by Debian's
docker-compose 1.29 (`config` parses, validates and interpolates without an engine), and the
Dockerfiles by reading them. The dashboard's PromQL is checked twice: each metric name against
the catalog (docs/metrics.md), and each expression by a real Prometheus (Debian's), whose query
API answers a syntax error with errorType "bad_data". Debian's packages are installed on demand
(tests/support/debian.py); the tests skip only where that is impossible (not root, no apt-get).
The security properties of every configuration are checked against the credentials that the
compose file's own certs command makes here (assert_secure).
tests/integration/test_deploy_smoke.py runs the services themselves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from grpc_health.v1 import health_pb2

from kvpager import devcerts
from kvpager.manager import ManagerConfig
from kvpager.manager.service import SERVICE_NAME, create_server
from tests.support.debian import Unavailable, ensure_program
from tests.support.prometheus import PromQLError, PrometheusServer
from tests.support.promql import dashboard_queries, documented_metric_names, grafana_to_promql, metric_names

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvpager.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvpager.yml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
CATALOG = ROOT / "docs" / "metrics.md"

GPU_SERVICES = {"ray-head", "worker"}
CPU_SERVICES = {"ray-head-cpu", "worker-cpu"}
COMMON_SERVICES = {"certs", "manager", "prometheus", "grafana"}
GRPC_SERVICES = {"manager", "worker", "worker-cpu"}
WORKER_SERVICES = {"worker", "worker-cpu"}
RAY_SERVICES = {"ray-head", "ray-head-cpu", "worker", "worker-cpu"}
SECRETS = "/run/secrets/kvpager"


# -- docker-compose --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def compose_bin() -> str:
    try:
        return ensure_program("docker-compose")
    except Unavailable as why:
        pytest.skip(str(why))


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without KVPAGER_*, COMPOSE_* and RAY_* (so the host's settings
    cannot leak into the checks), plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPAGER_", "COMPOSE_", "RAY_"))}
    env.update(overrides)
    return env


def compose(compose_bin: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([compose_bin, "-f", str(COMPOSE), *args], capture_output=True, text=True, timeout=60,
                          env=clean_env(**env), cwd=ROOT)


def compose_config(compose_bin: str, **env: str) -> dict:
    out = compose(compose_bin, "config", **env)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_compose_file_is_valid_with_defaults(compose_bin):
    cfg = compose_config(compose_bin)
    services = cfg["services"]
    assert set(services) == COMMON_SERVICES | GPU_SERVICES | CPU_SERVICES
    for name in GPU_SERVICES:
        assert services[name]["profiles"] == ["gpu"], name
    for name in CPU_SERVICES:
        assert services[name]["profiles"] == ["cpu"], name
    for name in COMMON_SERVICES:
        assert "profiles" not in services[name], name
    # Every published port binds loopback unless KVPAGER_BIND_ADDRESS says otherwise.
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published and all(str(p).startswith("127.0.0.1:") for p in published), published
    # State that must outlive the containers lives in named volumes.
    assert {"prometheus-data", "grafana-data"} <= set(cfg["volumes"])
    assert "prometheus-data:/prometheus:rw" in services["prometheus"]["volumes"]
    assert "grafana-data:/var/lib/grafana:rw" in services["grafana"]["volumes"]


def test_compose_services_wiring(compose_bin):
    services = compose_config(compose_bin)["services"]
    manager = services["manager"]
    assert manager["command"][:2] == ["kvpager", "manager"]
    assert {"--host=0.0.0.0", "--port=50051", "--metrics-host=0.0.0.0", "--metrics-port=9400"} <= set(manager["command"])
    for var in ("KVPAGER_BLOCK_SIZE", "KVPAGER_NUM_GPU_BLOCKS", "KVPAGER_NUM_CPU_BLOCKS", "KVPAGER_WATERMARK",
                "KVPAGER_ENABLE_PREFIX_CACHING", "KVPAGER_WORKER_HEARTBEAT_TIMEOUT", "KVPAGER_WORKER_PLAN_TIMEOUT"):
        assert var in manager["environment"], var
    assert manager["environment"]["KVPAGER_NUM_GPU_BLOCKS"] == "0"  # sized from the workers
    # Health checks go through the gRPC health protocol (over TLS).
    assert manager["healthcheck"]["test"][:5] == ["CMD", "python", "-m", "kvpager.healthcheck", "127.0.0.1:50051"]
    assert "--tls-ca" in manager["healthcheck"]["test"]
    for name in ("worker", "worker-cpu"):
        assert "kvpager.healthcheck manager:50051" in services[name]["healthcheck"]["test"][1]

    worker = services["worker"]
    assert worker["command"][:3] == ["kvpager", "worker", "--join"]
    assert {"--manager=manager:50051", "--ray-address=ray-head:6379", "--tensor-parallel-size=1",
            "--device=cuda"} <= set(worker["command"])
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "1", "capabilities": ["gpu"]}]
    assert {"--device=cpu", "--tensor-parallel-size=2", "--ray-address=ray-head:6379"} <= set(services["worker-cpu"]["command"])
    assert "deploy" not in services["worker-cpu"]
    # The CPU Ray head answers to the same name as the GPU one.
    assert services["ray-head-cpu"]["networks"]["default"]["aliases"] == ["ray-head"]
    for name in ("ray-head", "ray-head-cpu"):
        head = services[name]
        assert head["environment"]["RAY_AUTH_MODE"] == "token"
        assert "ray start --head --block --port=6379" in head["command"][2]
        assert head["healthcheck"]["test"][:3] == ["CMD", "ray", "health-check"]
    # Ray needs one image (same Ray and Python) per flavour for head and workers.
    assert services["ray-head"]["image"] == services["worker"]["image"]
    assert services["ray-head-cpu"]["image"] == services["worker-cpu"]["image"]

    conditions = {name: {dep: spec["condition"] for dep, spec in s.get("depends_on", {}).items()}
                  for name, s in services.items()}
    after_certs = {"certs": "service_completed_successfully"}
    assert conditions["worker"] == {**after_certs, "manager": "service_healthy", "ray-head": "service_healthy"}
    assert conditions["worker-cpu"] == {**after_certs, "manager": "service_healthy", "ray-head-cpu": "service_healthy"}
    assert conditions["grafana"] == {**after_certs, "prometheus": "service_healthy"}


def test_compose_settings_follow_variables(compose_bin):
    services = compose_config(
        compose_bin, KVPAGER_GPUS="4", KVPAGER_MANAGER_PORT="6001", KVPAGER_MANAGER_METRICS_PORT="6002",
        KVPAGER_RAY_PORT="6003", KVPAGER_PROMETHEUS_PORT="6004", KVPAGER_GRAFANA_PORT="6005",
        KVPAGER_BIND_ADDRESS="0.0.0.0", KVPAGER_RAY_HEAD_IP="10.1.2.3", KVPAGER_RAY_NODE_IP="10.1.2.4",
        KVPAGER_RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="secret", KVPAGER_NUM_GPU_BLOCKS="1000")["services"]
    worker = services["worker"]
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "4"
    assert {"--tensor-parallel-size=4", "--manager=manager:6001", "--ray-address=ray-head:6003"} <= set(worker["command"])
    assert worker["environment"]["KVPAGER_RAY_NODE_IP"] == "10.1.2.4"
    assert worker["environment"]["RAY_AUTH_TOKEN"] == "secret"
    assert worker["environment"]["RAY_AUTH_MODE"] == "token"
    assert services["ray-head"]["environment"]["RAY_NODE_IP_ADDRESS"] == "10.1.2.3"
    assert services["manager"]["environment"]["KVPAGER_NUM_GPU_BLOCKS"] == "1000"
    assert {"--port=6001", "--metrics-port=6002"} <= set(services["manager"]["command"])
    assert "0.0.0.0:6001:6001/tcp" in services["manager"]["ports"]
    prometheus_cmd = services["prometheus"]["entrypoint"][2]
    assert "s/manager:9400/manager:6002/g" in prometheus_cmd and "--web.listen-address=0.0.0.0:6004" in prometheus_cmd
    assert services["grafana"]["environment"]["KVPAGER_PROMETHEUS_URL"] == "http://prometheus:6004"
    assert services["grafana"]["environment"]["GF_SERVER_HTTP_PORT"] == "6005"


def test_optional_worker_settings_stay_unset(compose_bin):
    """Optional worker settings pass through only when set, never as empty strings (an empty
    value would be a bad value for the worker's typed flags)."""
    env = compose_config(compose_bin)["services"]["worker"]["environment"]
    for var in ("KVPAGER_RAY_NODE_IP", "KVPAGER_WORKER_NUM_GPU_BLOCKS", "KVPAGER_WORKER_MEMORY_FRACTION",
                "KVPAGER_WORKER_NUM_CPU_BLOCKS", "RAY_AUTH_TOKEN"):
        assert env[var] is None, var


# (ids spelled so that no test is named "gpu": tests/conftest.py skips those without CUDA)
@pytest.mark.parametrize("profiles", [None, "gpu", "cpu"], ids=["from-env-file", "COMPOSE_PROFILES=gpu",
                                                                  "COMPOSE_PROFILES=cpu"])
def test_compose_profiles(compose_bin, profiles):
    """`config --services` works with and without COMPOSE_PROFILES (1.29 lists every service
    whatever the profile; Compose v2 lists the active ones), and docker-compose's own code reads
    the default profile, gpu, from deploy/.env and picks the services `up` would start."""
    env = {} if profiles is None else {"COMPOSE_PROFILES": profiles}
    out = compose(compose_bin, "config", "--services", **env)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) >= COMMON_SERVICES | (CPU_SERVICES if profiles == "cpu" else GPU_SERVICES)

    # docker-compose is a Python program: ask its library which profiles are enabled here.
    interpreter = Path(compose_bin).read_text().splitlines()[0].removeprefix("#!").split()
    probe = ("import json, sys; from compose.cli.command import get_profiles_from_options; "
             "from compose.config.environment import Environment; "
             "print(json.dumps(get_profiles_from_options({}, Environment.from_env_file(sys.argv[1]))))")
    done = subprocess.run([*interpreter, "-c", probe, str(DEPLOY)], capture_output=True, text=True, timeout=60,
                          env=clean_env(**env))
    assert done.returncode == 0, done.stderr
    enabled = json.loads(done.stdout)
    assert enabled == [profiles or "gpu"]
    services = compose_config(compose_bin, **env)["services"]
    started = {name for name, s in services.items() if not s.get("profiles") or set(s["profiles"]) & set(enabled)}
    assert started == COMMON_SERVICES | (CPU_SERVICES if profiles == "cpu" else GPU_SERVICES)


def test_multinode_override(compose_bin, tmp_path, monkeypatch):
    """The override puts the Ray head and the local worker on the host's network and refuses to
    start without the head's address."""
    files = ["-f", str(DEPLOY / "docker-compose.multinode.yml")]
    missing = compose(compose_bin, *files, "config")
    assert missing.returncode != 0 and "KVPAGER_RAY_HEAD_IP" in missing.stderr
    out = compose(compose_bin, *files, "config", KVPAGER_RAY_HEAD_IP="10.0.0.1", KVPAGER_GPUS="2")
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert services["ray-head"]["network_mode"] == "host"
    assert services["ray-head"]["environment"]["RAY_NODE_IP_ADDRESS"] == "10.0.0.1"
    worker = services["worker"]
    assert worker["network_mode"] == "host" and worker["environment"]["KVPAGER_RAY_NODE_IP"] == "10.0.0.1"
    assert {"--manager=10.0.0.1:50051", "--ray-address=10.0.0.1:6379", "--tensor-parallel-size=2"} <= set(worker["command"])
    assert "kvpager.healthcheck 10.0.0.1:50051" in worker["healthcheck"]["test"][1]
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "2"
    # Still secured across machines: Ray's token, TLS and tokens, certificates that name the
    # address the workers dial and advertise.
    assert_secure(services, tmp_path, monkeypatch)
    assert worker["environment"]["KVPAGER_WORKER_ADVERTISE_HOST"] == "10.0.0.1"
    assert "10.0.0.1" in services["certs"]["environment"]["KVPAGER_CERT_SANS"].split(",")


# -- secure by default ------------------------------------------------------------------------

def _strings(service: dict) -> list[str]:
    """Every string a service runs with: entrypoint, command, environment values, health check."""
    out = [str(a) for a in (service.get("entrypoint") or []) + (service.get("command") or [])]
    out += [str(v) for v in (service.get("environment") or {}).values() if v is not None]
    out += [str(a) for a in (service.get("healthcheck") or {}).get("test", [])]
    return out


def _flags(service: dict) -> dict[str, str]:
    return dict(a.split("=", 1) if "=" in a else (a, "") for a in service.get("command") or [] if a.startswith("--"))


def _san_names(cert_path: Path) -> set[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in sans}


def _verifies(cert_path: Path, ca_path: Path) -> bool:
    from cryptography import x509

    try:
        x509.load_pem_x509_certificate(cert_path.read_bytes()).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca_path.read_bytes()))
    except Exception:  # noqa: BLE001
        return False
    return True


def assert_secure(services: dict, tmp_path: Path, monkeypatch) -> None:
    """The security properties of a compose configuration (as `config` prints it):

    - nothing runs --insecure; every gRPC server has TLS and requires tokens, and the workers
      accept plans only from the manager; metrics beyond loopback are HTTPS;
    - the certs service runs first, and what every service reads under /run/secrets is a file
      that its command (python -m kvpager.devcerts, run here) makes, in a volume the service
      mounts read-only; the CA's key is in a volume only certs mounts;
    - the certificates verify against the CA and name the hosts they are dialed at;
    - every Ray node runs with token authentication and publishes no port;
    - Grafana has no anonymous access and its admin password comes from the generated file."""
    certs = services["certs"]
    assert certs["command"][:3] == ["python", "-m", "kvpager.devcerts"]
    # Run the certs service's own command (less --owner: that needs root) into a local folder.
    root = tmp_path / "certs-root"
    container_root = certs["command"][3]
    monkeypatch.setenv("KVPAGER_CERT_SANS", certs.get("environment", {}).get("KVPAGER_CERT_SANS") or "")
    assert devcerts.main([str(root), *[a for a in certs["command"][4:] if not a.startswith("--owner")]]) == 0
    volume_folder = {}
    for volume in certs["volumes"]:
        source, target = volume.split(":")[:2]
        assert target.startswith(container_root + "/"), volume
        volume_folder[source] = root / target[len(container_root) + 1:]

    for name, service in services.items():
        strings = _strings(service)
        assert not any("--insecure" in a for a in strings), name
        assert (service.get("environment") or {}).get("KVPAGER_INSECURE") in (None, "", "false", "0"), name
        if name == "certs":
            continue
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        mounts = {}
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            if source.startswith("secrets-"):
                assert source != "secrets-ca", f"{name} mounts the CA's private key"
                assert mode == ["ro"], f"{name} mounts {source} writable"
                mounts[target] = volume_folder[source]
        paths = [p for a in strings for p in re.findall(r"/run/secrets/[\w./-]+\w", a)]
        for path in paths:
            target = max((t for t in mounts if path.startswith(t + "/")), key=len, default=None)
            assert target, f"{name} reads {path}, which no secrets volume it mounts holds"
            assert (mounts[target] / path[len(target) + 1:]).is_file(), f"{name}: certs makes no {path}"

        def local(path: str) -> Path:
            target = max(t for t in mounts if path.startswith(t + "/"))
            return mounts[target] / path[len(target) + 1:]

        flags = _flags(service)
        if name in GRPC_SERVICES:
            assert {"--tls-cert", "--tls-key"} <= set(flags), name
            assert _verifies(local(flags["--tls-cert"]), local(next(p for p in paths if p.endswith("ca.pem"))))
        if name == "manager":
            assert {"--auth-tokens", "--worker-tls-ca", "--worker-service-token", "--metrics-token"} <= set(flags)
            assert "manager" in _san_names(local(flags["--tls-cert"]))
        if name in WORKER_SERVICES:
            assert {"--auth-token", "--tls-ca"} <= set(flags) and ({"--manager-token", "--tls-client-ca"} & set(flags))
            names = _san_names(local(flags["--tls-cert"]))
            assert service["environment"]["KVPAGER_WORKER_ADVERTISE_HOST"] in names, name  # what the manager dials
            manager_host = flags["--manager"].rsplit(":", 1)[0]
            manager_cert = volume_folder["secrets-manager"] / "tls.pem"
            assert manager_host in _san_names(manager_cert), f"{name} dials {manager_host}"
        if name in RAY_SERVICES:
            env = service["environment"]
            assert env["RAY_AUTH_MODE"] == "token", name
            assert local(env["RAY_AUTH_TOKEN_PATH"]).read_text().strip(), name
        if name.startswith("ray-head"):
            assert not service.get("ports"), f"{name} publishes Ray's ports"
        if name == "grafana":
            env = service["environment"]
            assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
            assert "GF_SECURITY_ADMIN_PASSWORD" not in env
            assert len(local(env["GF_SECURITY_ADMIN_PASSWORD__FILE"]).read_text()) >= 16
        if name == "prometheus":
            assert any(v.startswith("secrets-prometheus:") for v in service["volumes"])


@pytest.mark.parametrize("profiles", ["gpu", "cpu"], ids=["COMPOSE_PROFILES=default", "COMPOSE_PROFILES=cpu"])
def test_compose_is_secure_by_default(compose_bin, profiles, tmp_path, monkeypatch):
    assert_secure(compose_config(compose_bin, COMPOSE_PROFILES=profiles)["services"], tmp_path, monkeypatch)


def test_compose_secrets_go_to_the_users_that_read_them(compose_bin):
    """The certs service gives each volume to the user its readers run as (0700 folders, 0600
    secrets): the manager and worker images' kvpager (10001), Prometheus's nobody, Grafana's 472."""
    services = compose_config(compose_bin)["services"]
    owners = dict(a.removeprefix("--owner=").split("=") for a in services["certs"]["command"] if a.startswith("--owner="))
    assert owners == {"manager": "10001:10001", "worker": "10001:10001", "client": "10001:10001",
                      "prometheus": "65534:65534", "grafana": "472:0"}
    assert services["certs"]["network_mode"] == "none" and services["certs"]["restart"] == "no"
    for name in ("manager.Dockerfile", "worker.Dockerfile"):
        assert "--uid 10001" in (DEPLOY / name).read_text()


def test_anonymous_grafana_only_when_asked(compose_bin):
    on = compose_config(compose_bin, KVPAGER_GRAFANA_ANONYMOUS="true")["services"]["grafana"]["environment"]
    assert on["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and on["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_env_file_sets_project_and_profile():
    values = dict(line.split("=", 1) for line in (DEPLOY / ".env").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert values == {"COMPOSE_PROJECT_NAME": "kvpager", "COMPOSE_PROFILES": "gpu"}


def test_every_compose_variable_is_documented():
    """The comment block at the top of the compose file lists every variable it reads."""
    text = COMPOSE.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    used = set(re.findall(r"(?<!\$)\$\{(\w+)", body))
    used |= {m for m in re.findall(r"^\s+(\w+):\s*$", body, re.M) if m.isupper()}  # passed through
    for name in sorted(used):
        assert re.search(rf"^#\s+{name}\s", header, re.M), f"{name} is not documented at the top of {COMPOSE.name}"


# -- images ----------------------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        current += raw.rstrip("\\").strip() + " " if raw.rstrip().endswith("\\") else raw.strip()
        if not raw.rstrip().endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                lines.append((word.upper(), rest.strip()))
            current = ""
    return lines


def _docker_pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (anchored at the context root; ``**/`` is any depth) as a regex."""
    regex = re.escape(pattern.strip("/")).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    return re.compile(regex)


def dockerignored(relpath: str) -> bool:
    """Whether .dockerignore keeps ``relpath`` out of the build context: the last rule matching
    it or one of its parent folders wins, a ``!`` rule lets it back in."""
    parts = relpath.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for rule in (ROOT / ".dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        pattern = _docker_pattern(rule.lstrip("!"))
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            ignored = not rule.startswith("!")
    return ignored


@pytest.mark.parametrize("name", ["manager.Dockerfile", "worker.Dockerfile"])
def test_dockerfiles_copy_files_that_exist_and_reach_the_context(name):
    copies = [args.split() for inst, args in dockerfile_instructions(DEPLOY / name) if inst == "COPY"]
    assert copies
    for args in copies:
        for src in (a for a in args[:-1] if not a.startswith("--")):
            assert (ROOT / src).exists(), f"{name} copies {src}, which does not exist"
            assert not dockerignored(src), f"{name} copies {src}, which .dockerignore leaves out of the context"


@pytest.mark.parametrize("name", ["manager.Dockerfile", "worker.Dockerfile"])
def test_dockerfile_shell_commands_parse(name):
    for inst, args in dockerfile_instructions(DEPLOY / name):
        if inst == "RUN" or (inst in ("CMD", "HEALTHCHECK") and not args.lstrip().startswith(("[", "CMD ["))):
            command = args.split("CMD", 1)[1] if inst == "HEALTHCHECK" else args
            done = subprocess.run(["sh", "-n", "-c", command], capture_output=True, text=True, timeout=10)
            assert done.returncode == 0, f"{name}: {inst} {args}: {done.stderr}"


def test_dockerignore_keeps_the_context_small():
    for path in (".git", ".venv", "tests", "docs", "build", "kvpager/__pycache__", "kvpager/v1/x.pyc",
                 "deploy/docker-compose.yml", "kvpager.egg-info"):
        assert dockerignored(path), path
    for path in ("pyproject.toml", "README.md", "kvpager/cli.py", "kernels/csrc/launch.cu", "deploy/build_kernels.py"):
        assert not dockerignored(path), path


def test_old_dockerfile_is_gone_and_compose_builds_the_new_ones(compose_bin):
    assert not (DEPLOY / "Dockerfile").exists()
    services = compose_config(compose_bin)["services"]
    built = {s["build"]["dockerfile"] for s in services.values() if "build" in s}
    assert built == {"deploy/manager.Dockerfile", "deploy/worker.Dockerfile"}
    for s in services.values():
        if "build" in s:
            assert Path(s["build"]["context"]) == ROOT


def pip_installs(path: Path) -> list[str]:
    return [cmd for inst, args in dockerfile_instructions(path) if inst == "RUN"
            for cmd in re.split(r"&&|\|\|", args) if "pip install" in cmd]


def test_manager_image_installs_no_torch_or_ray():
    instructions = dockerfile_instructions(DEPLOY / "manager.Dockerfile")
    assert instructions[0] == ("ARG", "PYTHON_IMAGE=python:3.11-slim")
    assert ("FROM", "${PYTHON_IMAGE}") in instructions
    installs = pip_installs(DEPLOY / "manager.Dockerfile")
    assert installs, "the manager image installs nothing?"
    for cmd in installs:
        extras = set(re.findall(r"\[([^\]]*)\]", cmd)[0].split(",")) if "[" in cmd else set()
        assert extras <= {"metrics"}, cmd
        assert not re.search(r"\b(torch|ray|nvidia|cuda)\b", cmd.replace("kvpager", "")), cmd
    assert ("USER", "kvpager") in instructions
    assert any(inst == "HEALTHCHECK" and "kvpager.healthcheck" in args for inst, args in instructions)


def test_worker_image_is_cuda_pytorch_with_ray_and_builds_the_kernels():
    instructions = dockerfile_instructions(DEPLOY / "worker.Dockerfile")
    base = dict(a.split("=", 1) for i, a in instructions if i == "ARG" and "=" in a)["BASE_IMAGE"]
    assert base.startswith("pytorch/pytorch:") and "cuda" in base and base.endswith("-devel")  # nvcc for the kernels
    assert instructions[1] == ("FROM", "${BASE_IMAGE}")
    installs = pip_installs(DEPLOY / "worker.Dockerfile")
    kvpager_install = [c for c in installs if "-e" in c.split()]
    assert len(kvpager_install) == 1 and '".[ray,metrics,models]"' in kvpager_install[0]
    assert "torch" not in kvpager_install[0]
    runs = " ".join(args for inst, args in instructions if inst == "RUN")
    assert "python deploy/build_kernels.py" in runs
    env = " ".join(args for inst, args in instructions if inst == "ENV")
    assert "KVPAGER_EXT_DIR=" in env and "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" in env
    assert ("USER", "kvpager") in instructions


def test_build_kernels_refuses_without_an_arch_list():
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CUDA_ARCH_LIST",)}
    done = subprocess.run([sys.executable, str(DEPLOY / "build_kernels.py")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 2 and "TORCH_CUDA_ARCH_LIST" in done.stderr


BLOCK_HEAVY = "import sys; sys.modules['torch'] = None; sys.modules['ray'] = None; "


def test_manager_runs_without_torch_or_ray(tmp_path):
    """What the manager image runs, `kvpager manager` with metrics, works with torch and Ray
    unimportable (as in that image)."""
    script = BLOCK_HEAVY + "from kvpager.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", script, "manager", "--insecure", "--host", "127.0.0.1", "--port", "0",
                             "--metrics-host", "127.0.0.1", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        seen = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("listening on"):
                break
        assert any(line.startswith("listening on") for line in seen), "".join(seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    assert proc.returncode == 0, "".join(seen) + rest
    assert "ModuleNotFoundError" not in rest and "ImportError" not in rest


# -- the gRPC health check the containers run ------------------------------------------------

def healthcheck(*args: str) -> subprocess.CompletedProcess:
    script = BLOCK_HEAVY + "from kvpager.healthcheck import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=30)


def test_healthcheck_exit_codes():
    server, port, service, health_servicer = create_server(ManagerConfig(num_gpu_blocks=8, num_cpu_blocks=8),
                                                           "127.0.0.1:0")
    server.start()
    try:
        ok = healthcheck(f"127.0.0.1:{port}")
        assert ok.returncode == 0 and ok.stderr == "", ok.stderr
        assert healthcheck(f"127.0.0.1:{port}", "--service", SERVICE_NAME).returncode == 0

        unknown = healthcheck(f"127.0.0.1:{port}", "--service", "no.such.Service")
        assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1 and "unknown service" in unknown.stderr

        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        down = healthcheck(f"127.0.0.1:{port}")
        assert down.returncode == 1 and down.stderr.count("\n") == 1 and "NOT_SERVING" in down.stderr
    finally:
        server.stop(None)
        service.close()
    gone = healthcheck(f"127.0.0.1:{port}", "--timeout", "1")
    assert gone.returncode == 1 and gone.stderr.count("\n") == 1 and "UNAVAILABLE" in gone.stderr


# -- Prometheus configuration ----------------------------------------------------------------

def test_prometheus_config():
    """Every scrape and the service discovery go over HTTPS, checked against the deployment's CA
    (never insecure_skip_verify); the manager's endpoints with the metrics token."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert cfg["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert jobs["kvpager-manager"]["static_configs"] == [{"targets": ["manager:9400"]}]
    sd = jobs["kvpager-workers"]["http_sd_configs"][0]
    assert sd["url"] == "https://manager:9400/sd/workers"
    for where in (jobs["kvpager-manager"], jobs["kvpager-workers"], sd):
        assert where.get("scheme", "https") == "https"
        assert where["tls_config"]["ca_file"].startswith(SECRETS + "/")
        assert not where["tls_config"].get("insecure_skip_verify", False)
    for where in (jobs["kvpager-manager"], sd):
        assert where["authorization"]["credentials_file"].startswith(SECRETS + "/")


def prometheus_config_with_credentials(tmp_path: Path) -> Path:
    """prometheus.yml with the credentials paths pointing at files devcerts made, as the
    Prometheus container sees its volume."""
    devcerts.ensure(tmp_path / "credentials")
    folder = tmp_path / "credentials" / "prometheus"
    copy = tmp_path / "prometheus.yml"
    copy.write_text(PROMETHEUS_YML.read_text().replace(SECRETS + "/", f"{folder}/"))
    return copy


def test_promtool_accepts_prometheus_config(tmp_path):
    try:
        promtool = ensure_program("promtool", "prometheus")
    except Unavailable as why:
        pytest.skip(str(why))
    done = subprocess.run([promtool, "check", "config", str(prometheus_config_with_credentials(tmp_path))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# -- Grafana provisioning and the dashboard --------------------------------------------------

def test_grafana_provisioning_points_at_the_dashboard(compose_bin):
    grafana = compose_config(compose_bin)["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = source
    provisioning = Path(mounts["/etc/grafana/provisioning"])
    assert provisioning == DEPLOY / "grafana" / "provisioning"

    providers = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert len(providers) == 1 and providers[0]["type"] == "file"
    folder = providers[0]["options"]["path"]
    assert Path(mounts[folder]) == DASHBOARD.parent  # the provider reads the mounted dashboards
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(folder + "/") and (DASHBOARD.parent / home[len(folder) + 1:]).is_file()

    sources = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus" and sources[0]["isDefault"]
    variable = re.fullmatch(r"\$\{(\w+)\}", sources[0]["url"]).group(1)
    assert grafana["environment"][variable] == "http://prometheus:9090"  # the compose network's address


def panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    assert dashboard["uid"] == "kvpager" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid and target["expr"].strip(), panel["title"]


def test_dashboard_covers_the_issue():
    """KV utilization per tier, blocks by state, prefix hit rate, swap traffic, preemptions,
    Step latency percentiles, worker health, worker plan and attention time."""
    exprs = " ".join(expr for _, expr in dashboard_queries(DASHBOARD))
    for needle in ("kvpager_kv_cache_usage_ratio", "kvpager_kv_cache_blocks",
                   "kvpager_prefix_cache_hit_tokens_total", "kvpager_prefix_cache_queried_tokens_total",
                   "kvpager_swapped_bytes_total", "kvpager_worker_moved_bytes_total", "kvpager_preemptions_total",
                   'kvpager_rpc_duration_seconds_bucket{method="Step"}', "histogram_quantile(0.5,",
                   "histogram_quantile(0.9,", "histogram_quantile(0.99,", "kvpager_workers_registered",
                   "kvpager_workers_healthy", "kvpager_workers_expected", 'up{job="kvpager-workers"}',
                   "kvpager_worker_plan_duration_seconds_bucket", "kvpager_worker_attention_duration_seconds_bucket"):
        assert needle in exprs, needle


def test_metric_name_tokenizer():
    assert metric_names('histogram_quantile(0.99, sum by (le, kind) (rate(a_seconds_bucket{method="Step"}[$__rate_interval])))') \
        == {"a_seconds_bucket"}
    assert metric_names('sum(rate(x_total[5m] offset 1h)) by (job) / on (rank) group_left (tier) y + 1e-9 > bool z') \
        == {"x_total", "y", "z"}
    assert metric_names('up{job="kvpager-workers", instance=~"a.*"} == 1 and on() vector(1)') == {"up"}
    assert metric_names('count(max_over_time(kvpager_sequences{state="running"}[1h:1m]))') == {"kvpager_sequences"}


def test_dashboard_metrics_exist():
    """Every metric a dashboard query reads is in the catalog, docs/metrics.md (histograms as
    _bucket/_sum/_count), or is a series Prometheus adds itself (up)."""
    known = documented_metric_names(CATALOG)
    assert "kvpager_rpc_duration_seconds_bucket" in known and "kvpager_steps_total" in known
    missing = {}
    for title, expr in dashboard_queries(DASHBOARD):
        names = metric_names(expr)
        assert names, f"{title}: {expr} reads no metric"
        if names - known:
            missing[f"{title}: {expr}"] = sorted(names - known)
    assert not missing, missing


def test_dashboard_jobs_match_the_scrape_config():
    jobs = {job["job_name"] for job in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]}
    used = {job for _, expr in dashboard_queries(DASHBOARD) for job in re.findall(r'job="([^"]+)"', expr)}
    assert used and used <= jobs


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    try:
        ensure_program("prometheus")
    except Unavailable as why:
        pytest.skip(str(why))
    with PrometheusServer("global:\n  scrape_interval: 5s\nscrape_configs: []\n",
                          tmp_path_factory.mktemp("promql")) as server:
        yield server


def test_dashboard_promql_parses(prometheus):
    """Prometheus itself evaluates every query (a syntax error is errorType bad_data)."""
    with pytest.raises(PromQLError) as bad:
        prometheus.query("sum by (le (rate(x[5m]))")
    assert bad.value.error_type == "bad_data"
    failures = {}
    for title, expr in dashboard_queries(DASHBOARD):
        try:
            prometheus.query(grafana_to_promql(expr))
        except PromQLError as err:
            failures[f"{title}: {expr}"] = str(err)
    assert not failures, failures
