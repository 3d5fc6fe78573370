"""A cache worker's Prometheus metrics: a real worker registered with a real manager executes
real plans (over its gRPC service) and model steps, and its /metrics, scraped over HTTP, says
exactly what was done. The metric names, types and labels are read from the Worker table of
docs/metrics.md, so the catalog and the code cannot drift apart.

CPU only; the CUDA bookkeeping (timing events read once the device has passed them) is
checked with stand-in events.
"""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
import torch

from kvpager.kernels import ops
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.step import StepInput
from kvpager.v1 import plan_pb2, worker_pb2, worker_pb2_grpc
from kvpager.worker import metrics as worker_metrics
from kvpager.worker.block_plan import BlockMoves, BlockPlan
from kvpager.worker.addresses import advertised_host, host_port
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.memory_stats import MemoryStats
from kvpager.worker.metrics import DeviceClock
from kvpager.worker.model import ModelConfig
from kvpager.worker.ray_group import _rank_metrics_port
from tests.support.catalog import check_exports, scrape_families

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8,
                    intermediate_size=64, vocab_size=64, seed=1)
BLOCK = 4


def value(families, name: str, sample: str = "", **labels: str) -> float:
    family = families[name]
    matches = [s.value for s in family.samples
               if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, sample, labels, family.samples)
    return matches[0]


def execute(stub, step_id: int, swap_out=((), ()), swap_in=((), ()), copy=((), ())) -> None:
    def mapping(pairs):
        return plan_pb2.BlockMapping(src=list(pairs[0]), dst=list(pairs[1]))

    plan = plan_pb2.ExecutionPlan(step_id=step_id, blocks_to_swap_out=mapping(swap_out),
                                  blocks_to_swap_in=mapping(swap_in), blocks_to_copy=mapping(copy))
    stub.ExecutePlan(worker_pb2.ExecutePlanRequest(plan=plan), timeout=10)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def registered_worker(request):
    """A manager (pools sized by the worker) and a worker (on the CPU, and on CUDA where there
    is a device: its plan and attention times come from CUDA events) registered with it,
    serving metrics on a free port. Yields (worker, manager service)."""
    config = ManagerConfig(block_size=BLOCK, num_gpu_blocks=0, num_cpu_blocks=0, watermark=0.0)
    server, port, service, _ = create_server(config, "127.0.0.1:0")
    server.start()
    worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=12, num_cpu_blocks=6,
                                      manager_address=f"127.0.0.1:{port}", metrics_port=0, device=request.param))
    worker.start()
    try:
        yield worker, service
    finally:
        worker.stop()
        server.stop(None)
        service.close()


def test_worker_metrics_count_what_the_worker_did(registered_worker):
    worker, service = registered_worker
    assert worker.metrics_address.startswith("127.0.0.1:") and not worker.metrics_address.endswith(":0")
    assert worker.endpoints() == dict(grpc=worker.address, metrics=worker.metrics_address)

    # The manager got the metrics endpoint and the block size in bytes with the registration.
    (record,) = service.registry.workers()
    assert record.worker_id == worker.worker_id != ""
    assert record.metrics_address == worker.metrics_address
    assert record.block_bytes == worker.cache.spec.block_bytes > 0

    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.CacheWorkerStub(channel)
        execute(stub, 1, swap_out=([1, 2], [0, 1]))
        execute(stub, 2, swap_in=([0], [5]))
        execute(stub, 3, swap_out=([0], [2]), copy=([3, 4], [6, 7]))
        # The servicer turns the worker's plain MemoryStats into the wire message, field for field.
        wire = stub.GetMemoryStats(worker_pb2.GetMemoryStatsRequest(), timeout=10)
        stats = worker.memory_stats()
        assert isinstance(stats, MemoryStats)
        assert {f.name: getattr(wire, f.name) for f in wire.DESCRIPTOR.fields} == dataclasses.asdict(stats)
        assert (stats.plans_executed, stats.blocks_swapped_out, stats.blocks_swapped_in, stats.blocks_copied,
                stats.last_step_id) == (3, 3, 1, 2, 3)
    moved = {"gpu_to_cpu": 3, "cpu_to_gpu": 1, "gpu_to_gpu": 2}
    parts = {"swap_out": 2, "swap_in": 1, "copy": 1}

    # A prefill of two sequences (5 and 3 tokens), then one decode token for each.
    prefill = StepInput(step_id=4, plan_step_id=0, token_ids=[3, 1, 4, 1, 5, 9, 2, 6],
                        positions=[0, 1, 2, 3, 4, 0, 1, 2], slot_mapping=[0, 1, 2, 3, 4, 8, 9, 10],
                        query_lens=[5, 3], context_lens=[5, 3], block_tables=[0, 1, 2, 0], max_blocks=2)
    decode = StepInput(step_id=5, plan_step_id=0, token_ids=[7, 8], positions=[5, 3], slot_mapping=[5, 11],
                       query_lens=[1, 1], context_lens=[6, 4], block_tables=[0, 1, 2, 0], max_blocks=2)
    for inp in (prefill, decode):
        logits = worker.execute_model(inp)
        assert logits.shape == (2, MODEL.vocab_size) and torch.isfinite(logits).all()
    # Timing changes nothing: the same step without a timer (rewriting the same K/V) gives the same logits.
    assert torch.equal(worker.model.forward_paged(decode, worker.cache.layer).cpu(), logits)

    m = scrape_families(worker.metrics_address)
    assert not [name for name in m if name.endswith("_created")], "kvpager.metrics_http turns _created series off"
    assert value(m, "kvpager_worker_plans_total") == 3
    for direction, blocks in moved.items():
        assert value(m, "kvpager_worker_moved_blocks_total", direction=direction) == blocks
        assert value(m, "kvpager_worker_moved_bytes_total", direction=direction) == \
            blocks * worker.cache.spec.block_bytes
    for kind, count in parts.items():
        name = "kvpager_worker_plan_duration_seconds"
        assert value(m, name, name + "_count", kind=kind) == count
        assert value(m, name, name + "_sum", kind=kind) > 0
    assert value(m, "kvpager_worker_model_steps_total") == 2
    assert value(m, "kvpager_worker_computed_tokens_total") == 10
    for name in ("kvpager_worker_model_step_duration_seconds", "kvpager_worker_attention_duration_seconds"):
        assert value(m, name, name + "_count") == 2 and value(m, name, name + "_sum") > 0
    step_sum = value(m, "kvpager_worker_model_step_duration_seconds", "kvpager_worker_model_step_duration_seconds_sum")
    assert value(m, "kvpager_worker_attention_duration_seconds", "kvpager_worker_attention_duration_seconds_sum") \
        < step_sum
    # The device idled between the two steps (this test's Python ran in between), and each step's
    # timing is kept for the benchmark, in order, the first without a gap.
    assert value(m, "kvpager_worker_device_idle_seconds_total") > 0
    timings = worker.step_timings()
    assert [(t.step_id, t.tokens) for t in timings] == [(4, 8), (5, 2)]
    assert timings[0].gap is None and timings[1].gap > 0 and all(t.busy > 0 for t in timings)

    cache = worker.cache
    assert value(m, "kvpager_worker_cache_blocks", tier="gpu") == 12
    assert value(m, "kvpager_worker_cache_blocks", tier="cpu") == 6
    assert value(m, "kvpager_worker_cache_bytes", tier="gpu") == cache.blocks.nbytes == 12 * cache.spec.block_bytes
    assert value(m, "kvpager_worker_cache_bytes", tier="cpu") == cache.swap_space.nbytes == 6 * cache.spec.block_bytes
    allocated = value(m, "kvpager_worker_device_memory_allocated_bytes")
    reserved = value(m, "kvpager_worker_device_memory_reserved_bytes")
    if cache.device.type == "cuda":  # the allocator holds at least the cache tensor
        assert cache.blocks.nbytes <= allocated <= reserved
        # Our CUDA kernels serve only some head sizes; the others run the torch reference.
        device, backend = str(cache.blocks.device), ops.backend(cache.blocks[:, 0, 0])
    else:
        assert allocated == reserved == 0
        device, backend = "cpu", "reference"
    info = dict(rank="0", tensor_parallel_size="1", device=device,
                attention_backend=backend, kv_cache_dtype="float32")
    assert value(m, "kvpager_worker_info", **info) == 1
    assert value(m, "process_resident_memory_bytes") > 0

    # The catalog's Worker table, both ways: each row exists with its type and labels, and
    # the worker exports no kvpager_ series the catalog does not list.
    check_exports(m, "Worker")


def test_a_worker_that_registers_again_keeps_its_series(registered_worker):
    """The manager gives a new worker id at each registration; no series carries it, so a worker
    registering again (here: the manager forgot it, and its next heartbeat says so) exports the
    same series as before, not a new set per registration."""
    worker, service = registered_worker

    def series() -> set[tuple[str, tuple]]:
        return {(s.name, tuple(sorted(s.labels.items())))
                for family in scrape_families(worker.metrics_address).values() for s in family.samples}

    before, first_id = series(), worker.worker_id
    service.registry.unregister(first_id)
    deadline = time.monotonic() + 30
    while worker.worker_id == first_id:
        assert time.monotonic() < deadline, "the worker did not register again"
        time.sleep(0.05)
    assert series() == before
    assert not [key for key in before if "worker_id" in dict(key[1])]


def test_a_worker_without_metrics_port_serves_none():
    worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=4, num_cpu_blocks=2,
                                      device="cpu"))
    worker.start()
    try:
        assert worker.metrics is None and worker.endpoints() == dict(grpc=worker.address, metrics="")
        worker.execute_plan(1, BlockPlan(swap_out=BlockMoves(src=[0], dst=[0])))
        assert worker.memory_stats().plans_executed == 1
    finally:
        worker.stop()


def test_advertised_addresses():
    assert advertised_host("0.0.0.0", "worker-3.example") == "worker-3.example"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("0.0.0.0") not in ("0.0.0.0", "::", "")  # this node's address
    assert host_port("10.0.0.7", 9500) == "10.0.0.7:9500"
    assert host_port("fd00::7", 9500) == "[fd00::7]:9500"


def test_ranks_of_a_group_get_consecutive_metrics_ports():
    assert [_rank_metrics_port(9500, rank) for rank in range(3)] == [9500, 9501, 9502]
    assert [_rank_metrics_port(0, rank) for rank in range(3)] == [0, 0, 0]        # a free port each
    assert [_rank_metrics_port(None, rank) for rank in range(3)] == [None] * 3    # off


class FakeEvent:
    """Stands in for torch.cuda.Event on one in-order stream: an event has completed once the
    test moves ``FakeEvent.reached`` (the device's progress) to or past its record time."""

    clock = 0.0    # the host records events at ticks 1, 2, 3, ...
    reached = 0.0  # the device has run everything recorded up to this tick

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = 0.0
        self.synchronized = False

    def record(self, stream=None) -> None:
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.at <= FakeEvent.reached

    def synchronize(self) -> None:
        self.synchronized = True
        FakeEvent.reached = max(FakeEvent.reached, self.at)

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "read before the device got there"
        return (end.at - self.at) * 1000.0  # one tick: one second, in ms


def test_device_timings_are_read_only_once_the_device_passed_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "clock", 0.0)
    monkeypatch.setattr(FakeEvent, "reached", 0.0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    clock = DeviceClock("cpu")
    clock.on_cuda = True  # the CUDA bookkeeping, with stand-in events
    seen: list[float] = []

    span = clock.span(seen.append)
    with span:           # ticks 1 -> 2
        pass
    with span:           # ticks 3 -> 4
        pass
    marks = list(span._marks)
    span.submit()
    assert seen == [] and clock.pending == 1   # the device has not got there yet: nothing observed
    FakeEvent.reached = 3                      # part of the way: still nothing
    clock.poll()
    assert seen == [] and clock.pending == 1
    FakeEvent.reached = 4
    clock.poll()
    assert seen == [2.0] and clock.pending == 0  # two intervals of one second each
    reused = clock.mark(None)
    assert any(reused is event for event in marks)  # events are recycled

    # A backlog past the cap waits for the oldest instead of growing without bound.
    monkeypatch.setattr(DeviceClock, "MAX_PENDING", 2)
    spans = [clock.span(seen.append) for _ in range(3)]
    for s in spans:
        with s:
            pass
    oldest_end = spans[0]._marks[-1]
    for s in spans:
        s.submit()
    assert oldest_end.synchronized and clock.pending == 2


def test_cpu_spans_observe_wall_time_at_once():
    seen: list[float] = []
    span = DeviceClock("cpu").span(seen.append)
    span.submit()                      # no interval: no observation
    assert seen == []
    with span:
        sum(range(1000))
    span.submit()
    assert len(seen) == 1 and 0 < seen[0] < 1
    assert worker_metrics.PLAN_KINDS == tuple(worker_metrics.DIRECTIONS)
