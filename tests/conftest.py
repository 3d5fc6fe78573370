"""Shared fixtures (a real block-manager gRPC server on a loopback port, per test; a private Ray
cluster per module; the unpacked tools), the GPU tests' skip without CUDA, and the order and units
in which `make test`'s two workers take the tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time

import pytest

from kvpager.manager import ManagerConfig
from tests.support import tools


# ---- what the tests start stays theirs ---------------------------------------------------------------
RAY_TMPDIR = pytest.StashKey[str]()


def pytest_configure(config):
    """Ray's files go to a folder of this run, removed after it (pytest_unconfigure): every Ray cluster
    the tests start (in pytest's processes or in the commands they run, which inherit the variable)
    writes its sessions and its address file there, not under /tmp/ray, where a later ``ray.init()``
    or ``ray status`` on this machine would find the address. Made once, by the first process (the
    workers of `make test` inherit it). The variable also marks every process the tests start:
    pytest_sessionfinish looks for those still running."""
    if "RAY_TMPDIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="kvray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
        os.environ["RAY_TMPDIR"] = path
        config.stash[RAY_TMPDIR] = path


def _started_by_this_run(marker: bytes) -> list[tuple[int, str]]:
    """(pid, command line) of each other process whose environment carries ``marker``, but
    multiprocessing's helpers of this process (its resource tracker ends when this process does)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):  # gone meanwhile, or not ours to read
                continue
            if not (parent == os.getpid() and "from multiprocessing." in cmdline):
                found.append((int(entry), cmdline[:160]))
    return found


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session):
    """After the last test (and after the workers of `make test` stopped): no process the tests
    started may still run (servers, Ray nodes, Prometheus). Those left after 30 s are named, ended
    (SIGKILL, by pid) and fail the run."""
    result = yield
    path = session.config.stash.get(RAY_TMPDIR, None)
    if path is None or not os.path.isdir("/proc"):
        return result
    marker = f"RAY_TMPDIR={path}".encode()
    deadline = time.monotonic() + 30
    while (left := _started_by_this_run(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write("\n")  # after the progress line
        for pid, cmdline in left:
            if reporter is not None:
                reporter.write_line(f"FAILED: the tests left this process running (ended now): {pid} {cmdline}",
                                    red=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result


def pytest_unconfigure(config):
    path = config.stash.get(RAY_TMPDIR, None)
    if path is not None:
        os.environ.pop("RAY_TMPDIR", None)
        shutil.rmtree(path, ignore_errors=True)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# ---- scheduling: `make test` runs the tests on two workers (pytest-xdist, --dist loadfile) ---------------
# The modules that take longest, longest first (seconds in one serial run on two cores busy with other
# work, 2026-11-25; on idle cores about half). A worker takes one module at a time, in collection order:
# started first, the long ones end together with the rest instead of after it. Only the order changes:
# every test runs either way, and a module not listed keeps its place after these.
LONGEST_FIRST = (
    # ~290 s on CI's cores (2026-11-28): six g++ -fsyntax-only runs over torch's headers, one thread
    # at the lowest priority, so it may run beside the Ray tests (unlike nvcc, LAST below).
    "tests/unit/test_torch_bindings_compile.py",
    "tests/integration/test_cli.py",               # 91: Ray heads, managers and workers as processes
    "tests/integration/test_hf_generation.py",     # 66
    "tests/integration/test_generation.py",        # 62
    "tests/integration/test_generate_cli.py",      # 51
    "tests/unit/test_serving_bench.py",            # 38
    "tests/unit/test_cli.py",                      # 31
    "tests/deploy/test_compose_stack.py",          # 27
    "tests/integration/test_prometheus.py",        # 16
    "tests/integration/test_durability.py",        # 16
)


# Last, so that it runs (nearly) alone: nvcc (180-200 s, two GPU targets per source, both cores) beside
# the Ray and latency tests starved them past their waits and limits on CI's 2 cores (three fresh-clone
# runs on 2026-11-25 each failed one such test, each passing alone).
LAST = ("tests/unit/test_kernel_sources_compile.py",)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    rank |= {path: len(LONGEST_FIRST) + 1 + i for i, path in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FIRST)))  # stable: a module stays whole
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadfile``, the unit of work is a test module (its module fixtures are set up
    once, in one worker), but tests/gpu is one unit: its tests share the one device, and some
    measure its free memory, so two of them never run at once."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndTheDevice(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/gpu" if nodeid.startswith("tests/gpu/") else nodeid.split("::", 1)[0]

    return ModulesAndTheDevice(config, log)


@contextlib.contextmanager
def running_server(config: ManagerConfig, max_workers: int = 16):
    """Start a server on 127.0.0.1:0; yield (client, service); check invariants and stop it."""
    # Imported here, not at the top: the kernel tests then collect where the gRPC extras (health
    # checking, reflection) are not installed, as on the lent GPU machines' image.
    from kvpager.client import BlockManagerClient
    from kvpager.manager.service import create_server

    server, port, service, _ = create_server(config, "127.0.0.1:0", max_workers=max_workers)
    server.start()
    client = BlockManagerClient(f"127.0.0.1:{port}", timeout=10)
    try:
        yield client, service
        with service.lock:
            service.manager.check_invariants()
    finally:
        client.close()
        server.stop(None)
        service.close()


@pytest.fixture
def small_config() -> ManagerConfig:
    # 17 GPU blocks: block 0 is the null block (never handed out), so 16 are usable.
    return ManagerConfig(block_size=4, num_gpu_blocks=17, num_cpu_blocks=8, watermark=0.0)


@pytest.fixture
def served(small_config):
    with running_server(small_config) as pair:
        yield pair


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local Ray cluster on loopback for the module's tests (4 CPUs), shut down after them."""
    ray = pytest.importorskip("ray")
    from kvpager.worker.ray_group import init_local_ray

    init_local_ray(num_cpus=4)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def unpacked_tools() -> tools.UnpackedTools:
    """The programs `make tools` unpacked from Debian's packages (prometheus, promtool,
    docker-compose, wget): ``unpacked_tools.require(name)`` is a path, or skips the test saying
    why the program could not be fetched here. Nothing is installed on the machine."""
    return tools.unpacked_tools()
