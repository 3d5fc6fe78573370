"""How the manager treats its workers, against a real manager on 127.0.0.1 (``running_server``):

- a plan the worker rejects (a real CPU ``CacheWorker`` behind its gRPC service) is a manager bug:
  INTERNAL naming the rank, the step and the worker's reason; the step rolled back, the worker's
  cache untouched, the worker still registered and serving the next plan;
- a registration arriving while a step waits on the workers answers within the deadline the
  worker gave it (UNAVAILABLE, nothing registered) or succeeds once the step is done;
- a worker whose cache a newer process of its rank superseded cannot take the rank back
  (FAILED_PRECONDITION), in memory and after a restart from the state directory, and that
  worker stops asking to register;
- pools sized from the workers' capacity are bounded: a worker reporting more blocks than
  ``max_pool_blocks_from_workers`` is refused before anything is built.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from kvpager import client as C
from kvpager import errors
from kvpager.manager import ManagerConfig
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import worker_pb2_grpc
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.model import preset
from tests.support.state import served_fingerprint

from ..conftest import running_server
from ..support.plan_workers import GatedWorker
from .test_durability import serving

BLOCK = 4


def register(client: C.BlockManagerClient, address: str, gpu: int, cpu: int, cache_id: str = "", rank: int = 0,
             tp: int = 1, timeout: float = 5) -> pb.RegisterWorkerResponse:
    """RegisterWorker as a worker sends it (``worker/registration.py``)."""
    return client.stub.RegisterWorker(pb.RegisterWorkerRequest(
        address=address, rank=rank, tensor_parallel_size=tp, num_gpu_blocks=gpu, num_cpu_blocks=cpu,
        block_size=BLOCK, cache_id=cache_id), timeout=timeout)


# ---- a plan the worker rejects ------------------------------------------------------------------------
@pytest.fixture
def cpu_worker():
    """A real worker (the tiny model on the CPU: 16 cache blocks, 8 swap blocks) serving its
    CacheWorker gRPC service on 127.0.0.1, not registered anywhere yet."""
    worker = CacheWorker(WorkerConfig(model=preset("tiny"), block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=8,
                                      device="cpu"))
    worker.start()
    yield worker
    worker.stop()


def test_a_plan_the_worker_rejects_is_internal_and_keeps_the_worker(cpu_worker):
    """The manager believes the worker has 64 cache blocks (the bug: its record of the worker is
    wrong); the worker has 16 and rejects a swap-out of blocks 16 and 17 whole."""
    config = ManagerConfig(block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=8, watermark=0.0)
    with running_server(config) as (client, service):
        worker_id = register(client, cpu_worker.address, gpu=64, cpu=8, cache_id=cpu_worker.cache_id).worker_id
        client.allocate("low", num_tokens=4 * BLOCK)      # blocks 1-4
        client.allocate("mid", num_tokens=11 * BLOCK)     # blocks 5-15
        client.allocate("high", num_tokens=2 * BLOCK)     # blocks 16-17: outside the worker's cache
        assert list(client.get_block_table("high").block_ids) == [16, 17]
        manager_before = served_fingerprint(service)
        cache_before = cpu_worker.cache.blocks.clone(), cpu_worker.cache.swap_space.clone()

        with pytest.raises(errors.InvariantViolation) as bug:
            client.swap_out(["high"])
        message = str(bug.value)
        assert "worker rank 0" in message and "rejected the plan" in message and "a manager bug" in message
        assert "INVALID_ARGUMENT" in message and "source block 16 out of range [0, 16)" in message
        step_id = int(message.split("step ", 1)[1].split(":", 1)[0])
        assert step_id > 0 and f"step {step_id}: worker rank 0 at {cpu_worker.address}" in message

        assert served_fingerprint(service) == manager_before            # the step rolled back whole
        assert torch.equal(cpu_worker.cache.blocks, cache_before[0])     # the worker moved nothing
        assert torch.equal(cpu_worker.cache.swap_space, cache_before[1])
        assert cpu_worker.memory_stats().plans_executed == 0
        assert [w.worker_id for w in service.registry.workers()] == [worker_id]   # still registered
        assert client.health() == "SERVING"
        client.swap_out(["low"])                                         # and it serves the next plan
        assert cpu_worker.memory_stats().plans_executed == 1
        assert client.get_block_table("low").tier == pb.TIER_CPU


# ---- a registration while a step waits on the workers ----------------------------------------------------
@pytest.fixture
def gated_worker():
    """A GatedWorker behind a real gRPC server on 127.0.0.1: (worker, address)."""
    worker = GatedWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_CacheWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield worker, f"127.0.0.1:{port}"
    worker.gate.set()
    server.stop(None)


def test_a_registration_while_a_step_waits_answers_within_the_workers_deadline(gated_worker):
    """The manager would wait up to plan_timeout + 1 s (11 s) for the waiting step; the worker's
    RegisterWorker deadline is 7 s. It answers UNAVAILABLE before that deadline, registering
    nothing (so the worker never misses a registration the manager made), and succeeds at once
    when the step finishes while it waits."""
    from kvpager.manager.registration import REGISTRATION_WORK_S

    worker, address = gated_worker
    deadline = REGISTRATION_WORK_S + 2
    config = ManagerConfig(block_size=BLOCK, num_gpu_blocks=32, num_cpu_blocks=16, watermark=0.0,
                           worker_plan_timeout=10.0, worker_heartbeat_timeout=60.0)
    assert config.worker_plan_timeout + 1 > deadline
    with running_server(config) as (client, service):
        first = register(client, address, gpu=32, cpu=16, cache_id="c0").worker_id
        for name in ("v", "w"):
            client.allocate(name, num_tokens=2 * BLOCK)
        for name in ("v", "w"):
            swap = threading.Thread(target=client.swap_out, args=([name],))
            swap.start()                      # its plan waits at the worker: the step is tentative
            assert worker.entered.wait(10)
            worker.entered.clear()
            started = time.monotonic()
            if name == "v":
                with pytest.raises(grpc.RpcError) as refused:
                    register(client, address, gpu=32, cpu=16, cache_id="c0", timeout=deadline)
                took = time.monotonic() - started
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
                assert "still wait on the workers" in refused.value.details()
                assert 1.5 < took < deadline, took
                assert [w.worker_id for w in service.registry.workers()] == [first]   # nothing registered
            else:                             # the step finishes while the registration waits
                threading.Timer(0.5, worker.gate.set).start()
                again = register(client, address, gpu=32, cpu=16, cache_id="c0", timeout=deadline)
                assert time.monotonic() - started < deadline - REGISTRATION_WORK_S
                assert [w.worker_id for w in service.registry.workers()] == [again.worker_id]
            worker.gate.set()
            swap.join(15)
            worker.gate.clear()
        assert client.get_block_table("v").tier == client.get_block_table("w").tier == pb.TIER_CPU


# ---- a worker whose cache a newer process superseded -----------------------------------------------------
def zombie_returns(client: C.BlockManagerClient, service) -> None:
    """Rank 0's process with cache "A" was replaced by one with cache "B" (epoch 1), which holds
    sequence "y" now; the old process comes back with "A" (its heartbeats resumed: it registers
    again, as ``worker/registration.py`` does when the manager forgot it). It is refused; "B"
    keeps the rank and "y"."""
    replacement = [w.worker_id for w in service.registry.workers()]
    with pytest.raises(grpc.RpcError) as refused:
        register(client, "127.0.0.1:1", gpu=32, cpu=16, cache_id="A")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
    details = refused.value.details()
    assert "rank 0" in details and "'A'" in details and "stop this worker" in details, details
    stats = client.get_stats()
    assert (stats.epoch, stats.lost_sequences, stats.running_sequences) == (1, 0, 1)
    assert client.get_block_table("y").num_tokens == 6
    assert [w.worker_id for w in service.registry.workers()] == replacement
    register(client, "127.0.0.1:2", gpu=32, cpu=16, cache_id="B")   # the live one, again: nothing lost
    assert client.get_stats().epoch == 1 and client.get_block_table("y").num_tokens == 6


def replace_rank_0(client: C.BlockManagerClient) -> None:
    register(client, "127.0.0.1:1", gpu=32, cpu=16, cache_id="A")
    client.allocate("x", num_tokens=6)
    register(client, "127.0.0.1:2", gpu=32, cpu=16, cache_id="B")   # a new process: "x" lost
    assert client.get_stats().epoch == 1
    client.free("x")
    client.allocate("y", num_tokens=6)


ZOMBIE_CONFIG = dict(block_size=BLOCK, num_gpu_blocks=32, num_cpu_blocks=16, worker_heartbeat_timeout=60.0)


def test_a_superseded_cache_cannot_take_its_rank_back():
    with running_server(ManagerConfig(**ZOMBIE_CONFIG)) as (client, service):
        replace_rank_0(client)
        zombie_returns(client, service)


def test_a_superseded_cache_cannot_take_its_rank_back_after_a_restart(tmp_path):
    config = ManagerConfig(**ZOMBIE_CONFIG, state_dir=str(tmp_path / "state"))
    with serving(config) as (client, _):
        replace_rank_0(client)
    with serving(config) as (client, service):      # replayed from the log ("worker_cache" events)
        zombie_returns(client, service)
    with serving(config) as (client, service):      # from the snapshot the last start took
        zombie_returns(client, service)


def test_a_superseded_worker_stops_asking_to_register(caplog):
    """The zombie's own side (``worker/registration.py``): its heartbeats learn that the manager
    forgot it, its registration is refused FAILED_PRECONDITION, and it stops asking (instead of
    being refused again at every beat) and says why."""
    from kvpager.worker.registration import ManagerRegistration

    config = ManagerConfig(**{**ZOMBIE_CONFIG, "worker_heartbeat_timeout": 1.0})   # a beat every 0.2 s
    request = pb.RegisterWorkerRequest(address="127.0.0.1:1", rank=0, tensor_parallel_size=1, num_gpu_blocks=32,
                                       num_cpu_blocks=16, block_size=BLOCK, cache_id="A")
    with running_server(config) as (client, service):
        zombie = ManagerRegistration(client.target, None, lambda: request, lambda worker_id: None)
        with caplog.at_level(logging.WARNING):
            zombie.start()
            try:
                register(client, "127.0.0.1:2", gpu=32, cpu=16, cache_id="B")   # a newer process takes rank 0
                zombie._heartbeat.join(5)
                assert not zombie._heartbeat.is_alive()
            finally:
                zombie.stop()
        assert [w.address for w in service.registry.workers()] in ([], ["127.0.0.1:2"])  # B: no beats, may be dropped
    refusals = [r for r in caplog.records if "refused the worker" in r.getMessage()]
    assert len(refusals) == 1 and "superseded" in refusals[0].getMessage()
    stopped = [r.getMessage() for r in caplog.records if r.name == "kvpager.worker" and r.levelno == logging.ERROR]
    assert len(stopped) == 1 and "stops asking" in stopped[0] and "stop this worker" in stopped[0], stopped


# ---- pools sized from the workers' capacity are bounded ------------------------------------------------
@pytest.mark.parametrize("gpu, cpu", [(1025, 16), (64, 1025)])
def test_a_capacity_above_the_pool_limit_is_refused_before_anything_is_built(gpu, cpu):
    config = ManagerConfig(block_size=BLOCK, num_gpu_blocks=0, num_cpu_blocks=0, max_pool_blocks_from_workers=1024)
    with running_server(config) as (client, service):
        with pytest.raises(grpc.RpcError) as refused:
            register(client, "127.0.0.1:1", gpu=gpu, cpu=cpu, cache_id="A")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "above the 1024 blocks per pool" in refused.value.details()
        assert "--max-pool-blocks-from-workers" in refused.value.details()
        assert service.manager is None and not service.registry.workers()
        assert service.registry.tensor_parallel_size is None and not service.caches.ranks
        register(client, "127.0.0.1:1", gpu=1024, cpu=1024, cache_id="A")     # at the limit: built
        assert (service.manager.gpu.num_blocks, service.manager.cpu.num_blocks) == (1024, 1024)


def test_a_worker_reporting_2_31_blocks_is_refused_at_once():
    """The default limit: a worker reporting 2**31-1 blocks (~50 minutes and ~350 GiB to build
    under the state lock) is refused in well under a second, and the manager keeps serving."""
    with running_server(ManagerConfig(block_size=BLOCK, num_gpu_blocks=0, num_cpu_blocks=0)) as (client, service):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            register(client, "127.0.0.1:1", gpu=2**31 - 1, cpu=16, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert time.monotonic() - started < 1
        assert service.manager is None and client.get_stats().workers_registered == 0
        register(client, "127.0.0.1:1", gpu=64, cpu=16)
        assert service.manager.gpu.num_blocks == 64
