"""deploy/docker-compose.yml as docker-compose reads it: valid, wired, driven by its variables,
with the profiles and the multinode override doing what docs/deploy.md says, secure by default.

`docker-compose config` (tests/deploy/compose.py) parses, validates and interpolates the file
without a Docker engine; tests/deploy/test_compose_stack.py runs the services themselves.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from .compose import (COMMON_SERVICES, COMPOSE, CPU_SERVICES, DEPLOY, GPU_SERVICES, ROOT, clean_env, compose,
                      compose_config)
from .secure import assert_secure

pytestmark = pytest.mark.deploy


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
def test_compose_profiles(compose_bin, unpacked_tools, profiles):
    """`config --services` works with and without COMPOSE_PROFILES (1.29 lists every service
    whatever the profile; Compose v2 lists the active ones), and docker-compose's own code reads
    the default profile, gpu, from deploy/.env and picks the services `up` would start."""
    env = {} if profiles is None else {"COMPOSE_PROFILES": profiles}
    out = compose(compose_bin, "config", "--services", **env)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) >= COMMON_SERVICES | (CPU_SERVICES if profiles == "cpu" else GPU_SERVICES)

    # docker-compose is a Python program: ask its library which profiles are enabled here.
    interpreter = unpacked_tools.require("compose-python")
    probe = ("import json, sys; from compose.cli.command import get_profiles_from_options; "
             "from compose.config.environment import Environment; "
             "print(json.dumps(get_profiles_from_options({}, Environment.from_env_file(sys.argv[1]))))")
    done = subprocess.run([interpreter, "-c", probe, str(DEPLOY)], capture_output=True, text=True, timeout=60,
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


def test_every_compose_variable_is_documented():
    """The comment block at the top of the compose file lists every variable it reads."""
    text = COMPOSE.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    used = set(re.findall(r"(?<!\$)\$\{(\w+)", body))
    used |= {m for m in re.findall(r"^\s+(\w+):\s*$", body, re.M) if m.isupper()}  # passed through
    for name in sorted(used):
        assert re.search(rf"^#\s+{name}\s", header, re.M), f"{name} is not documented at the top of {COMPOSE.name}"


def test_built_services_use_dockerfiles_of_this_repository(compose_bin):
    """Every service compose builds names a Dockerfile that exists, with the repository as the
    build context (the Dockerfiles copy paths relative to its root)."""
    builds = [s["build"] for s in compose_config(compose_bin)["services"].values() if "build" in s]
    assert builds
    for build in builds:
        assert Path(build["context"]) == ROOT, build
        assert (ROOT / build["dockerfile"]).is_file(), build
