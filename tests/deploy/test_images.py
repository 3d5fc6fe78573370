"""The images: what the Dockerfiles copy, install and run, and the programs the containers run
(the manager without torch or Ray, the gRPC health check, the kernel build's refusal).

There is no Docker engine here, so the Dockerfiles are read, not built.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from kvpager.manager import ManagerConfig
from kvpager.manager.service import SERVICE_NAME, create_server

from .compose import DEPLOY, ROOT

pytestmark = pytest.mark.deploy


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
    for path in ("pyproject.toml", "README.md", "kvpager/commands/cli.py", "kernels/csrc/launch.cu", "deploy/build_kernels.py"):
        assert not dockerignored(path), path


def pip_installs(path: Path) -> list[str]:
    return [cmd for inst, args in dockerfile_instructions(path) if inst == "RUN"
            for cmd in re.split(r"&&|\|\|", args) if "pip install" in cmd]


def test_manager_image_installs_no_torch_or_ray():
    instructions = dockerfile_instructions(DEPLOY / "manager.Dockerfile")
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
    assert ("FROM", "${BASE_IMAGE}") in instructions
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
    script = BLOCK_HEAVY + "from kvpager.commands.cli import main; sys.exit(main(sys.argv[1:]))"
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
    plain = healthcheck(f"127.0.0.1:{port}", "--tls-cert", "cert.pem", "--tls-key", "key.pem")   # no --tls-ca
    assert plain.returncode == 1 and plain.stderr.count("\n") == 1 and "--tls-cert needs --tls-ca" in plain.stderr

