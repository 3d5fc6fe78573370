"""`kvpager` as an operator runs it, in real processes (``python -m kvpager ...``): the manager with
its metrics endpoint, `stats` against it, `worker` registering a Ray worker group and stopping on
SIGTERM, the embedded demo, and the demo against a running deployment (a Ray head, a manager
and `kvpager worker`, each its own process).

Every address is on loopback. Ray turns 127.0.0.1 into the machine's own address, so Ray nodes
here advertise 127.0.0.2. The Ray head gets its own temp dir and ports, so it is never taken for
another test's cluster (and `ray stop`, which would stop every cluster here, is never run).
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
import threading
import time
import urllib.request

import pytest

from kvpager.client import BlockManagerClient

RAY_NODE_IP = "127.0.0.2"
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_")},
       "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


class Proc:
    """A child process whose output is read as it comes, so a test can wait for a line."""

    def __init__(self, *argv: str) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.out: list[str] = []
        self.err: list[str] = []
        self._new = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @classmethod
    def kvpager(cls, *args: str) -> "Proc":
        return cls(sys.executable, "-m", "kvpager", *args)

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._new:
                lines.append(line.rstrip("\n"))
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float, stream: str = "out") -> re.Match:
        """The first line of stdout (or stderr) matching ``pattern``; fails if the process exits first."""
        lines = self.out if stream == "out" else self.err
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                for line in lines:
                    if match := re.search(pattern, line):
                        return match
                if self.proc.poll() is not None and not any(r.is_alive() for r in self._readers):
                    pytest.fail(f"{self.argv[2:4]} exited with {self.proc.returncode} before {pattern!r}:\n"
                                f"{self.transcript()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"no {pattern!r} from {self.argv[2:4]} within {timeout} s:\n{self.transcript()}")
                self._new.wait(0.2)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it is still there after ``timeout``; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(f"{self.argv[2:4]} ignored SIGTERM for {timeout} s:\n{self.transcript()}")
        for reader in self._readers:
            reader.join(5)
        return self.proc.returncode

    def transcript(self) -> str:
        return "\n".join(["--- stdout", *self.out[-40:], "--- stderr", *self.err[-40:]])


def run_kvpager(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpager", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def pool_total_is(total: int, configured: int) -> bool:
    """Whether GetStats' GPU total fits a pool of ``configured`` blocks: all of them, or all but
    the null block where the pool reserves one (padding of block tables; manager/block_pool.py)."""
    return total in (configured, configured - 1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@pytest.fixture
def start_manager():
    """Start `kvpager manager --port 0 ARGS`; returns (process, host:port); stopped after the test."""
    started: list[Proc] = []

    def start(*args: str) -> tuple[Proc, str]:
        proc = Proc.kvpager("manager", "--insecure", "--port", "0", *args)
        started.append(proc)
        return proc, proc.wait_for(r"^listening on (\S+)$", 30).group(1)

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def ray_head():
    """A Ray head (`ray start --head --block`) on 127.0.0.2 with its own temp dir and ports; its GCS address."""
    temp_dir = tempfile.mkdtemp(prefix="kvray", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port(RAY_NODE_IP)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    head = Proc(ray, "start", "--head", "--block", f"--port={port}", f"--node-ip-address={RAY_NODE_IP}",
                "--num-cpus=4", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
                f"--temp-dir={temp_dir}", f"--ray-client-server-port={free_port(RAY_NODE_IP)}",
                f"--dashboard-agent-listen-port={free_port(RAY_NODE_IP)}")
    try:
        head.wait_for("Ray runtime started", 60)
        yield f"{RAY_NODE_IP}:{port}"
    finally:
        head.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_manager_serves_health_and_metrics_and_stats_shows_its_pools(start_manager):
    manager, target = start_manager("--metrics-port", "0", "--block-size", "8", "--num-gpu-blocks", "64",
                                    "--num-cpu-blocks", "32")
    metrics = manager.wait_for(r"^metrics on (\S+)$", 10).group(1)
    with BlockManagerClient(target) as client:
        assert client.health() == "SERVING"
        client.allocate("a", num_tokens=20)
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        assert reply.status == 200 and b"kvpager_kv_cache_capacity_blocks" in reply.read()

    once = run_kvpager("stats", "--manager", target, "--once")
    assert once.returncode == 0, once.stderr
    gpu = next(line for line in once.stdout.splitlines() if line.startswith("gpu"))
    total, used = map(int, gpu.split()[1:3])
    assert pool_total_is(total, 64) and used == 3  # 20 tokens in blocks of 8
    assert "1 running (GPU)" in once.stdout and "\x1b[" not in once.stdout  # not a terminal: no escapes

    twice = run_kvpager("stats", "--manager", target, "--count", "2", "--interval", "0.2")
    assert twice.returncode == 0 and twice.stdout.count("kvpager manager ") == 2
    assert "\n\nkvpager manager " in twice.stdout  # blocks separated by a blank line
    assert manager.stop() == 0


def test_worker_registers_its_group_and_stops_on_sigterm(start_manager):
    _, target = start_manager("--num-gpu-blocks", "0", "--num-cpu-blocks", "0")  # pools sized from the workers
    worker = Proc.kvpager("worker", "--insecure", "--manager", target, "--tensor-parallel-size", "1", "--device", "cpu",
                          "--num-gpu-blocks", "64", "--num-cpu-blocks", "16", "--node-ip", RAY_NODE_IP,
                          "--metrics-port", "0")
    try:
        rank = worker.wait_for(r"^rank 0: grpc ([^\s,]+), metrics ([^\s,]+), cache 64 blocks on cpu", 90)
        worker.wait_for(r"^workers ready", 30)
        with BlockManagerClient(target) as client:
            stats = client.get_stats()
        assert (stats.workers_registered, stats.workers_expected) == (1, 1)
        assert pool_total_is(stats.gpu.total_blocks, 64) and stats.cpu.total_blocks == 16
        with urllib.request.urlopen(f"http://{rank.group(2)}/metrics", timeout=10) as reply:
            assert reply.status == 200
        assert worker.stop() == 0
        with socket.socket() as sock:  # the rank's gRPC server went with it
            host, port = rank.group(1).rsplit(":", 1)
            assert sock.connect_ex((host, int(port))) != 0
    finally:
        worker.stop()


def test_the_readme_manager_and_worker_work_together_with_their_defaults(start_manager):
    """`kvpager manager --insecure` and `kvpager worker --insecure --manager ...` with nothing else:
    the worker's CPU cache stays modest, fits the manager's default pools, and it says where the
    Ray cluster it started is."""
    _, target = start_manager()
    worker = Proc.kvpager("worker", "--insecure", "--manager", target)
    try:
        ray = worker.wait_for(r"^Ray: started a local cluster at ([^\s,]+)", 90).group(1)
        cache = worker.wait_for(r"^rank 0: .*, cache (\d+) blocks on cpu \((\d+) MiB\) \+ (\d+) swap blocks", 90)
        worker.wait_for(r"^workers ready: tensor parallel 1 on CPU, model tiny, block size 16", 30)
        device_blocks, device_mib, swap_blocks = map(int, cache.groups())
        assert device_mib <= 256 and device_blocks >= 4096 and swap_blocks == 4096
        host, port = ray.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5):  # the printed address is Ray's GCS
            pass
        with BlockManagerClient(target) as client:
            stats = client.get_stats()
        # The manager's pools are sized from the worker's cache (its default --num-gpu-blocks 0).
        assert (stats.workers_registered, stats.cpu.total_blocks) == (1, swap_blocks)
        assert pool_total_is(stats.gpu.total_blocks, device_blocks)
        assert worker.stop() == 0
        assert worker.out[-1] == "workers stopped" and not any("Traceback" in line for line in worker.err)
        assert not any("Started a local Ray instance" in line for line in worker.err)  # Ray's line, said above
    finally:
        worker.stop()


def test_a_second_worker_joins_the_ray_cluster_the_first_one_printed(start_manager):
    _, first_manager = start_manager()
    _, second_manager = start_manager()
    first = Proc.kvpager("worker", "--insecure", "--manager", first_manager)
    second = None
    try:
        ray = first.wait_for(r"^Ray: started a local cluster at ([^\s,]+)", 90).group(1)
        first.wait_for(r"^workers ready", 90)
        second = Proc.kvpager("worker", "--insecure", "--manager", second_manager, "--ray-address", ray, "--join",
                              "--node-ip", "127.0.0.3", "--namespace", "second")
        second.wait_for(rf"^Ray: on the cluster at {re.escape(ray)}, through this machine's node 127\.0\.0\.3", 90)
        second.wait_for(r"^workers ready: .* registered with " + re.escape(second_manager), 90)
        assert second.stop() == 0, second.transcript()
        assert first.proc.poll() is None  # leaving stops only the joined node
        assert first.stop() == 0, first.transcript()
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_a_worker_with_another_block_size_is_refused_at_once(start_manager):
    _, target = start_manager("--block-size", "8")
    started = time.monotonic()
    proc = run_kvpager("worker", "--insecure", "--manager", target)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"kvpager worker: block size mismatch: the block manager at {target} uses --block-size 8, these workers "
        "--block-size 16: start both with the same --block-size (KVPAGER_BLOCK_SIZE)")
    assert time.monotonic() - started < 30


def test_a_manager_waiting_for_its_workers_refuses_another_block_size_before_ray_starts(start_manager):
    """A manager whose pools wait for the workers still shows its block size: a worker with
    another one ends with the one line before it starts Ray (the refusal at registration, for a
    manager that shows no stats, is the same line: test_the_worker_says_when_its_manager_goes...)."""
    _, target = start_manager("--block-size", "8", "--num-gpu-blocks", "0")
    proc = run_kvpager("worker", "--insecure", "--manager", target, "--node-ip", RAY_NODE_IP, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"kvpager worker: block size mismatch: the block manager at {target} uses --block-size 8, these workers "
        "--block-size 16: start both with the same --block-size (KVPAGER_BLOCK_SIZE)"], proc.stderr
    assert "Ray: started" not in proc.stdout, proc.stdout  # refused before Ray started


def test_the_worker_says_when_its_manager_goes_and_ends_when_it_comes_back_incompatible():
    port = free_port()
    target = f"127.0.0.1:{port}"
    manager = Proc.kvpager("manager", "--insecure", "--port", str(port))
    worker = None
    try:
        manager.wait_for(r"^listening on ", 30)
        worker = Proc.kvpager("worker", "--insecure", "--manager", target)
        worker.wait_for(r"^workers ready", 90)
        assert manager.stop() == 0
        worker.wait_for(rf"cannot reach the block manager at {re.escape(target)}: .*; the ranks register again "
                        "once it answers", 30, stream="err")
        manager = Proc.kvpager("manager", "--insecure", "--port", str(port), "--block-size", "8")
        worker.wait_for(rf"the block manager at {re.escape(target)} answers again", 30, stream="err")
        assert worker.proc.wait(60) == 1
        worker.stop()
        assert worker.err[-1] == (f"kvpager worker: block size mismatch: the block manager at {target} uses "
                                  "--block-size 8, these workers --block-size 16: start both with the same "
                                  "--block-size (KVPAGER_BLOCK_SIZE)"), worker.transcript()
    finally:
        if worker is not None:
            worker.stop()
        manager.stop()


def test_demo_runs_embedded_without_ray():
    proc = run_kvpager("demo", "--requests", "6", "--no-ray", "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6/6 requests equal the contiguous-cache reference" in proc.stdout
    assert "invariants         OK" in proc.stdout


def test_demo_against_a_running_deployment(ray_head, start_manager):
    _, target = start_manager("--num-gpu-blocks", "0", "--num-cpu-blocks", "0")
    worker = Proc.kvpager("worker", "--insecure", "--manager", target, "--ray-address", ray_head, "--node-ip", RAY_NODE_IP,
                          "--tensor-parallel-size", "1", "--device", "cpu", "--num-gpu-blocks", "48",
                          "--num-cpu-blocks", "64")
    try:
        rank = worker.wait_for(r"^rank 0: grpc ([^\s,]+)", 90)
        worker.wait_for(r"^workers ready", 30)
        demo = run_kvpager("demo", "--manager", target, "--ray-address", ray_head, "--node-ip", RAY_NODE_IP,
                           "--requests", "6", "--quiet")
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "on 1 remote Ray CPU worker(s)" in demo.stdout
        assert "48 GPU / 64 CPU blocks" in demo.stdout or "47 GPU / 64 CPU blocks" in demo.stdout  # null block
        assert "6/6 requests equal the contiguous-cache reference" in demo.stdout
        assert "nothing left over" in demo.stdout
        # The demo only attached to the workers: they still serve, and still belong to `kvpager worker`.
        assert worker.proc.poll() is None
        with BlockManagerClient(rank.group(1)) as channel:
            assert channel.health() == "SERVING"
        assert worker.stop() == 0
    finally:
        worker.stop()
