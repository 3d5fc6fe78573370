"""deploy/docker-compose.yml run without Docker: each service's own command, as a local process.

There is no Docker engine on these machines. This test takes the compose file as docker-compose
1.29 interpolates it (`config`, with every port variable set to a free port and the cpu
profile) and starts the one-shot certs service, the manager, the CPU Ray head, the CPU worker
and Prometheus from their own command (entrypoint + command) and environment, as local
processes:

- service hostnames become loopback addresses, one per service (manager 127.0.0.1, the Ray
  head 127.0.0.2, the worker 127.0.0.3, Prometheus 127.0.0.4), and a service's own 0.0.0.0
  and 127.0.0.1 become its address. Ray's CLI takes 127.0.0.1 for the machine's external
  address, so the Ray nodes get other loopback addresses through the variables the compose
  file exposes for that (KVPAGER_RAY_HEAD_IP, KVPAGER_RAY_NODE_IP);
- container paths become temporary files: Prometheus's mounted configuration is a copy of
  deploy/prometheus/prometheus.yml with the hostnames and paths replaced (and its scrape and
  discovery intervals shortened to 1 s: the test checks that it scrapes, not how often), its storage a
  temporary folder; each named volume is a temporary folder, mapped at the path where each
  service mounts it (the credentials volumes: secrets-*). The worker advertises its loopback
  address, which the certificates name through KVPAGER_CERT_SANS (as the multinode override
  adds a machine's address);
- `kvpager`, `ray` and `python` are the ones of this virtual environment; `prometheus`,
  docker-compose and `wget` (Prometheus's health check) are Debian's, unpacked by `make tools`
  (tests/support/fetch_tools.py) and found first on every service's PATH, never the machine's.

Services start in depends_on order, each waiting for the compose file's own health check of
the services it depends on (certs: its exit status). Then: the manager is healthy (its gRPC
health check, over TLS), refuses plaintext and calls without a token, a worker group
registered (the worker's health check, GetStats with the generated scheduler token),
Prometheus scraped the manager and every worker rank over HTTPS (found through the manager's
/sd/workers) and the manager's /metrics refuses a scrape without the metrics token, the Ray
cluster runs with token authentication, and `kvpager demo` served requests through the
deployment, run with the worker's environment and the generated scheduler token as `docker
compose exec` would.

Grafana cannot run here (no binary, none can be installed): only its service's mounts are
checked against the repository. Every wait is bounded; teardown is SIGTERM, then SIGKILL of
what is left of each process's session; `ray stop` is never used (it would stop every Ray
cluster on the machine).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Optional

import pytest
import yaml

from kvpager.client import BlockManagerClient
from kvpager import errors
from kvpager.metrics_http import fetch
from tests.support.prometheus import PrometheusAPI

from .compose import COMPOSE, DEPLOY, ROOT

pytestmark = [pytest.mark.deploy, pytest.mark.slow]

BIN = Path(sys.executable).parent

# One loopback address per service (and for the names it answers to).
ADDRESSES = {"certs": "127.0.0.1", "manager": "127.0.0.1", "ray-head": "127.0.0.2", "ray-head-cpu": "127.0.0.2",
             "worker-cpu": "127.0.0.3", "prometheus": "127.0.0.4", "grafana": "127.0.0.5"}
PORT_VARIABLES = ["KVPAGER_MANAGER_PORT", "KVPAGER_MANAGER_METRICS_PORT", "KVPAGER_RAY_PORT",
                  "KVPAGER_WORKER_METRICS_PORT", "KVPAGER_PROMETHEUS_PORT", "KVPAGER_GRAFANA_PORT"]
TP_SIZE = 2  # the worker-cpu default, KVPAGER_CPU_WORKERS

# Bounds (seconds); the whole test stays well under 3 minutes on 2 cores.
HEALTHY_TIMEOUT = 60
WORKERS_TIMEOUT = 90
SCRAPE_TIMEOUT = 30
DEMO_TIMEOUT = 120
STOP_TIMEOUT = {"worker-cpu": 40}  # for a graceful stop; 15 s for the others
# Prometheus's intervals, 5 s in the deployment, here 1 s: saves waiting ~10 s for discovery.
PROMETHEUS_INTERVALS = re.compile(r"^(\s*(?:scrape_interval|scrape_timeout|evaluation_interval|refresh_interval):\s*)\S+$",
                                  re.M)


def free_ports(count: int, host: str = "0.0.0.0", consecutive: int = 1) -> list[int]:
    """``count`` distinct free ports, each the first of ``consecutive`` free ones."""
    found: list[int] = []
    while len(found) < count:
        with socket.socket() as sock:
            sock.bind((host, 0))
            base = sock.getsockname()[1]
        span = range(base, base + consecutive)
        if base + consecutive > 65535 or any(p in found or p - 1 in found for p in span):
            continue
        try:
            socks = []
            for port in span:
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        found.append(base)
    return found


class Localizer:
    """Rewrites a service's strings from the compose network to this machine."""

    def __init__(self, tmp: Path, services: Optional[dict] = None) -> None:
        names = sorted(ADDRESSES, key=len, reverse=True)
        self._host = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, names)) + r")(?=:\d)")
        self.paths = {  # container path -> local path (longest first when applied)
            "/etc/prometheus/prometheus.yml": str(tmp / "prometheus-mounted.yml"),
            "/prometheus/kvpager-prometheus.yml": str(tmp / "kvpager-prometheus.yml"),
            "/prometheus": str(tmp / "prometheus-data"),
        }
        # Each service's named volumes (other than Prometheus's storage): a folder per volume,
        # at the path where that service mounts it.
        # A folder that a service names itself and mounts volumes in (the certs service writes
        # /secrets/manager, /secrets/worker, ... given /secrets) becomes a folder of links.
        self.volumes: dict[str, Path] = {}
        self.mounts: dict[str, dict[str, str]] = {}
        for name, service in (services or {}).items():
            argv = set(service.get("entrypoint") or []) | set(service.get("command") or [])
            for volume in service.get("volumes", []):
                source, target = volume.split(":")[:2]
                if not source.startswith(("/", ".")) and target not in self.paths:
                    folder = self.volumes.setdefault(source, tmp / "volumes" / source)
                    folder.mkdir(parents=True, exist_ok=True)
                    self.mounts.setdefault(name, {})[target] = str(folder)
                    parent = os.path.dirname(target)
                    if parent != "/" and parent in argv:
                        local = tmp / "fs" / name / parent.lstrip("/")
                        local.mkdir(parents=True, exist_ok=True)
                        (local / os.path.basename(target)).symlink_to(folder, target_is_directory=True)
                        self.mounts[name][parent] = str(local)

    def hosts(self, text: str) -> str:
        return self._host.sub(lambda m: ADDRESSES[m.group(1)], text)

    def paths_of(self, text: str, service: str) -> str:
        paths = {**self.paths, **self.mounts.get(service, {})}
        pattern = "(" + "|".join(map(re.escape, sorted(paths, key=len, reverse=True))) + r")(?![\w-])"
        return re.sub(pattern, lambda m: paths[m.group(0)], text)

    def __call__(self, text: str, service: str) -> str:
        own = ADDRESSES[service]
        text = text.replace("$$", "$")  # `config` prints $ escaped
        text = re.sub(r"(?<![\d.])(0\.0\.0\.0|127\.0\.0\.1)(?![\d])", own, text)
        text = self.hosts(text)
        return self.paths_of(text, service)


class Stack:
    """The services as local processes, each in its own session (for a clean teardown)."""

    def __init__(self, config: dict, tmp: Path, env: dict[str, str]) -> None:
        self.services = config["services"]
        self.tmp = tmp
        self.base_env = env
        self.localize = Localizer(tmp, self.services)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def argv(self, name: str) -> list[str]:
        service = self.services[name]
        argv = list(service.get("entrypoint") or []) + list(service.get("command") or [])
        if os.geteuid() != 0:  # the certs service gives folders to the containers' users: root only
            argv = [a for a in argv if not a.startswith("--owner=")]
        return [self.localize(a, name) for a in argv]

    def run_once(self, name: str, timeout: float) -> None:
        """A one-shot service (depends_on condition service_completed_successfully): run it to the end."""
        self.start(name)
        try:
            code = self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish in {timeout:.0f} s:\n{self.log(name)}")
        assert code == 0, f"{name} exited with {code}:\n{self.log(name)}"

    def environment(self, name: str) -> dict[str, str]:
        env = dict(self.base_env)
        for key, value in (self.services[name].get("environment") or {}).items():
            if value is not None:  # passed through only when set
                env[key] = self.localize(str(value), name)
        return env

    def start(self, name: str) -> None:
        self.logs[name] = self.tmp / f"{name}.log"
        with open(self.logs[name], "wb") as log:
            self.procs[name] = subprocess.Popen(self.argv(name), env=self.environment(name), cwd=self.tmp,
                                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True)

    def healthcheck(self, name: str) -> subprocess.CompletedProcess:
        """The compose file's own health check of ``name``, run as that service would."""
        check = self.services[name]["healthcheck"]["test"]
        kind, args = check[0], [self.localize(a, name) for a in check[1:]]
        argv = ["sh", "-c", args[0]] if kind == "CMD-SHELL" else args
        try:
            return subprocess.run(argv, env=self.environment(name), capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired as err:
            return subprocess.CompletedProcess(argv, 124, "", f"health check timed out: {err}")

    def wait_healthy(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for started, proc in self.procs.items():
                if proc.poll() is not None and not self.one_shot(started):
                    pytest.fail(f"{started} exited with {proc.returncode} while waiting for {name}:\n{self.log(started)}")
            last = self.healthcheck(name)
            if last.returncode == 0:
                return
            time.sleep(1)
        pytest.fail(f"{name} not healthy after {timeout:.0f} s: {last.stdout}{last.stderr}\n{self.log(name)}")

    def one_shot(self, name: str) -> bool:
        return self.services[name].get("restart") == "no"

    def log(self, name: str, chars: int = 3000) -> str:
        try:
            return f"--- {name} log ---\n" + self.logs[name].read_text(errors="replace")[-chars:]
        except (KeyError, OSError):
            return ""

    def stop(self) -> None:
        """SIGTERM to each service, the last started first (the worker stops its actors and the
        Ray node it started), then SIGKILL to whatever is left of their process trees and
        sessions (the worker starts its Ray node in a session of its own)."""
        roots = [proc.pid for proc in self.procs.values()]
        seen = descendants(roots)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            seen |= descendants([proc.pid])
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT.get(name, 15))
                except subprocess.TimeoutExpired:
                    pass
        ours = {os.getsid(0)}
        sessions = set()
        for pid in seen | set(roots):
            try:
                sessions.add(os.getsid(pid))
            except (ProcessLookupError, PermissionError):
                pass
        leftovers = (seen | descendants(roots) | {pid for sid in sessions - ours for pid in session_members(sid)})
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.wait(timeout=10)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pids: list[int]) -> set[int]:
    """Every process below ``pids`` now."""
    tree, found, todo = _children(), set(), list(pids)
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def session_members(sid: int) -> list[int]:
    """Processes of the session ``sid``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    members.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return members


@pytest.fixture(scope="module")
def tools(unpacked_tools):
    """The programs the services run: docker-compose's path, and the folder of the unpacked
    prometheus and wget (put before the machine's PATH)."""
    missing = [p for p in ("kvpager", "ray") if not (BIN / p).exists()]
    assert not missing, f"{missing} missing from {BIN}: install the package (pip install -e .[ray,metrics])"
    for program in ("prometheus", "wget"):  # wget: Prometheus's health check in the compose file
        unpacked_tools.require(program)
    return {"docker-compose": unpacked_tools.require("docker-compose"), "bin": str(unpacked_tools.bin_dir)}


def test_compose_stack_serves_requests(tools, tmp_path):
    ports = dict(zip(PORT_VARIABLES, free_ports(len(PORT_VARIABLES), consecutive=TP_SIZE)))
    variables = {**{k: str(v) for k, v in ports.items()}, "COMPOSE_PROFILES": "cpu",
                 "KVPAGER_RAY_HEAD_IP": ADDRESSES["ray-head"], "KVPAGER_RAY_NODE_IP": ADDRESSES["worker-cpu"],
                 "KVPAGER_WORKER_ADVERTISE_HOST": ADDRESSES["worker-cpu"],
                 "KVPAGER_CERT_SANS": ADDRESSES["worker-cpu"]}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVPAGER_", "COMPOSE_", "RAY_"))}
    out = subprocess.run([tools["docker-compose"], "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                         timeout=60, env={**clean, **variables}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)

    # Grafana cannot run here: check that its service exists and mounts files of this repository.
    grafana = config["services"]["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("/"):
            assert Path(source).exists() and Path(source).is_relative_to(DEPLOY), volume

    # The deployment as the compose file runs it: credentials on, nothing --insecure.
    assert not any("--insecure" in str(a) for s in config["services"].values() for a in s.get("command") or [])

    # Ray's files in a short private folder (its socket paths must stay under 108 bytes).
    ray_tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
    path = os.pathsep.join([str(BIN), tools["bin"], clean.get("PATH", "")])
    env = {**clean, "PATH": path, "RAY_TMPDIR": ray_tmp,
           "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    stack = Stack(config, tmp_path, env)
    # Prometheus's mounted configuration, with the compose network's names and paths made local
    # and its intervals shortened.
    localize = stack.localize
    mounted = {v.split(":")[1]: v.split(":")[0] for v in config["services"]["prometheus"]["volumes"]}
    Path(localize.paths["/etc/prometheus/prometheus.yml"]).write_text(
        PROMETHEUS_INTERVALS.sub(r"\g<1>1s", localize.paths_of(
            localize.hosts(Path(mounted["/etc/prometheus/prometheus.yml"]).read_text()), "prometheus")))
    Path(localize.paths["/prometheus"]).mkdir()
    client_files = localize.volumes["secrets-client"]
    try:
        # depends_on order, each dependency's own health check first (certs: run to the end).
        stack.run_once("certs", HEALTHY_TIMEOUT)
        scheduler_token = (client_files / "scheduler.token").read_text().strip()
        ca = str(client_files / "ca.pem")
        stack.start("manager")
        stack.wait_healthy("manager", HEALTHY_TIMEOUT)
        stack.start("prometheus")
        stack.start("ray-head-cpu")
        stack.wait_healthy("ray-head-cpu", HEALTHY_TIMEOUT)
        # Ray runs with token authentication: a client with another token is turned away.
        ray_head = f"{ADDRESSES['ray-head']}:{ports['KVPAGER_RAY_PORT']}"
        assert stack.environment("ray-head-cpu")["RAY_AUTH_MODE"] == "token"
        wrong = subprocess.run([str(BIN / "ray"), "health-check", "--address", ray_head], capture_output=True,
                               text=True, timeout=60, env={**env, "RAY_AUTH_MODE": "token",
                                                           "RAY_AUTH_TOKEN": "not-the-token-0123456789abcdef"})
        assert wrong.returncode != 0, wrong.stdout + wrong.stderr
        stack.start("worker-cpu")
        stack.wait_healthy("worker-cpu", WORKERS_TIMEOUT)  # the manager has every rank; rank 0 serves metrics
        stack.wait_healthy("prometheus", HEALTHY_TIMEOUT)

        manager = f"{ADDRESSES['manager']}:{ports['KVPAGER_MANAGER_PORT']}"
        with BlockManagerClient(manager, timeout=10, token=scheduler_token, root_certificates=ca) as client:
            assert client.health() == "SERVING"
            stats = client.get_stats()
        assert stats.workers_expected == TP_SIZE and stats.workers_registered == TP_SIZE, stats
        # No way in without the credentials: no token, or plaintext.
        with BlockManagerClient(manager, timeout=5, retries=0, root_certificates=ca) as anonymous:
            with pytest.raises(errors.ManagerError) as refused:
                anonymous.get_stats()
            assert refused.value.code == "UNAUTHENTICATED"
        with BlockManagerClient(manager, timeout=5, retries=0, token=scheduler_token) as plaintext:
            with pytest.raises(errors.ManagerError) as refused:
                plaintext.get_stats()
            assert refused.value.code == "UNAVAILABLE"
        metrics_url = f"https://{ADDRESSES['manager']}:{ports['KVPAGER_MANAGER_METRICS_PORT']}/metrics"
        with pytest.raises(urllib.error.HTTPError) as unauthorized:
            fetch(metrics_url, 5, ca)
        assert unauthorized.value.code == 401

        prom = PrometheusAPI(f"http://{ADDRESSES['prometheus']}:{ports['KVPAGER_PROMETHEUS_PORT']}")
        prom.wait_for('up{job="kvpager-manager"} == 1', SCRAPE_TIMEOUT)
        ranks = prom.wait_for('up{job="kvpager-workers"} == 1', SCRAPE_TIMEOUT,
                              predicate=lambda result: len(result) == TP_SIZE)
        assert sorted(r["metric"]["rank"] for r in ranks) == [str(r) for r in range(TP_SIZE)]
        assert all(r["metric"]["instance"].startswith(ADDRESSES["worker-cpu"] + ":") for r in ranks)

        # A request mix through the deployment, as `docker compose exec worker-cpu kvpager demo ...`.
        demo_env = stack.environment("worker-cpu")
        try:
            worker_secrets = stack.localize.paths_of("/run/secrets/kvpager", "worker-cpu")
            demo = subprocess.run([str(BIN / "kvpager"), "demo", "--manager", manager, "--ray-address", ray_head,
                                   "--requests", "4", "--auth-token", f"{worker_secrets}/scheduler.token",
                                   "--tls-ca", f"{worker_secrets}/ca.pem"], capture_output=True, text=True,
                                  timeout=DEMO_TIMEOUT, env=demo_env, cwd=tmp_path)
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"kvpager demo did not finish in {DEMO_TIMEOUT} s: {err.stdout}{err.stderr}")
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:] + stack.log("worker-cpu")

        # The served requests reached the manager's metrics as Prometheus sees them, and the
        # pools table of docs/deploy.md's health checks reads the manager.
        prom.wait_for("sum(kvpager_operations_total) > 0", SCRAPE_TIMEOUT)
        table = subprocess.run([str(BIN / "kvpager"), "stats", "--manager", manager, "--once", "--auth-token",
                                str(client_files / "admin.token"), "--tls-ca", ca], capture_output=True,
                               text=True, timeout=30, env=demo_env)
        assert table.returncode == 0 and "gpu" in table.stdout.lower(), table.stdout + table.stderr
    finally:
        stack.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
