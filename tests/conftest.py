"""Shared fixtures: a real block-manager gRPC server on a loopback port, per test."""

from __future__ import annotations

import contextlib

import pytest

from kvpager.client import BlockManagerClient
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from tests.support import tools


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def running_server(config: ManagerConfig, max_workers: int = 16):
    """Start a server on 127.0.0.1:0; yield (client, service); check invariants and stop it."""
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
