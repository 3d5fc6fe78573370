"""A worker's first registration (``worker/registration.py``) against a real manager on 127.0.0.1:
a manager that answers UNAVAILABLE (not listening yet; busy with a step waiting on the workers) is
asked again with backoff, one log line per wait, until it registers the worker; a refusal ends the
start at once with the manager's message. (``kvpager worker`` checks the manager's health before
Ray starts, so there the busy manager, or one restarting after the check, is the transient case.)
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import grpc
import pytest

from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.worker import registration
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.model import preset
from kvpager.worker.registration import ManagerRegistration

from ..conftest import running_server
from . import test_workers
from .test_workers import BLOCK, register

CONFIG = ManagerConfig(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=8, watermark=0.0,
                       worker_heartbeat_timeout=60.0, worker_plan_timeout=10.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _waits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvpager.worker" and "asking again" in r.getMessage()]


def test_a_worker_started_before_its_manager_registers_once_it_listens(caplog):
    port = _free_port()
    worker = CacheWorker(WorkerConfig(model=preset("tiny"), block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=8,
                                      device="cpu", manager_address=f"127.0.0.1:{port}"))
    started: dict[str, object] = {}

    def start() -> None:
        try:
            started["address"] = worker.start()
        except Exception as err:  # noqa: BLE001 - the test checks what it was
            started["error"] = err

    with caplog.at_level(logging.WARNING, logger="kvpager.worker"):
        starting = threading.Thread(target=start)
        starting.start()
        deadline = time.monotonic() + 20
        while not _waits(caplog) and time.monotonic() < deadline:   # UNAVAILABLE: nothing listens yet
            time.sleep(0.05)
        server, _, service, _ = create_server(CONFIG, f"127.0.0.1:{port}")   # bound here: it listens from now
        server.start()
        try:
            starting.join(30)
            assert not starting.is_alive() and "error" not in started, started
            assert [w.address for w in service.registry.workers()] == [started["address"]]
            assert worker.worker_id == service.registry.workers()[0].worker_id
        finally:
            worker.stop()
            server.stop(None)
            service.close()
    waits = _waits(caplog)
    assert waits and all("UNAVAILABLE" in w and "\n" not in w for w in waits), waits


gated_worker = test_workers.gated_worker   # its fixture: a worker whose plans wait for a gate


def test_a_manager_busy_with_a_waiting_step_is_asked_again(gated_worker, caplog, monkeypatch):
    """The manager waits for the step until shortly before the worker's deadline (half of a 2 s
    one), then answers UNAVAILABLE ("steps still wait on the workers"); asked again once the step
    is done, it registers the worker."""
    worker, address = gated_worker
    monkeypatch.setattr(registration, "REGISTER_DEADLINE_S", 2.0)   # a 1 s wait: half of a short deadline is kept
    request = pb.RegisterWorkerRequest(address=address, rank=0, tensor_parallel_size=1, num_gpu_blocks=16,
                                       num_cpu_blocks=8, block_size=BLOCK, cache_id="c0")
    with running_server(CONFIG) as (client, service):
        register(client, address, gpu=16, cpu=8, cache_id="c0")
        client.allocate("v", num_tokens=2 * BLOCK)
        swap = threading.Thread(target=client.swap_out, args=(["v"],))
        swap.start()                     # its plan waits at the worker: the step is tentative
        assert worker.entered.wait(10)
        threading.Timer(2.5, worker.gate.set).start()
        again = ManagerRegistration(client.target, None, lambda: request, lambda worker_id: None, retry_for=30)
        with caplog.at_level(logging.WARNING, logger="kvpager.worker"):
            again.start()
        again.stop()
        swap.join(10)
        assert [w.worker_id for w in service.registry.workers()] == [again.worker_id]
    waits = _waits(caplog)
    assert waits and all("UNAVAILABLE" in w and "still wait on the workers" in w for w in waits), waits


def test_a_refusal_ends_the_start_at_once(caplog):
    request = pb.RegisterWorkerRequest(address="127.0.0.1:1", rank=0, tensor_parallel_size=1, num_gpu_blocks=16,
                                       num_cpu_blocks=8, block_size=BLOCK * 2)
    with running_server(CONFIG) as (client, service):
        refused = ManagerRegistration(client.target, None, lambda: request, lambda worker_id: None, retry_for=30)
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvpager.worker"), pytest.raises(grpc.RpcError) as err:
            refused.start()
        assert time.monotonic() - began < 5
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block size 8 differs from the manager's 4" in err.value.details()
        assert not service.registry.workers()
    assert not _waits(caplog)
