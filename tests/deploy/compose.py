"""The deployment's files and `docker-compose config` over them, shared by the deploy tests.

docker-compose is Debian's 1.29, unpacked by `make tools` (tests/support/fetch_tools.py):
`config` parses, validates and interpolates the compose file without a Docker engine, which
these machines do not have. Every call runs with the host's KVPAGER_*, COMPOSE_* and RAY_*
variables removed, so that only what a test sets reaches the file.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path

import yaml

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
    """The configuration `config` prints with ``env`` set: a fresh copy for the caller to read
    or change, from one run of docker-compose per distinct environment (each run costs over
    half a second of Python start-up)."""
    return copy.deepcopy(_compose_config(compose_bin, tuple(sorted(env.items()))))


@functools.lru_cache(maxsize=None)
def _compose_config(compose_bin: str, env: tuple[tuple[str, str], ...]) -> dict:
    out = compose(compose_bin, "config", **dict(env))
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)
