"""End to end: the manager (gRPC), cache workers and the reference scheduler generate, token
for token, what the same model generates with a plain contiguous cache.

Requests share prompt prefixes, use parallel sampling (forks, so copy-on-write), and the GPU
pool is small enough that preemption by swap happens. One test runs workers in-process; the
others run a real local Ray cluster with two tensor-parallel CPU workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import time

import grpc
import pytest
import torch

from kvpager import client as C
from kvpager import errors
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.scheduler import Request, SamplingParams, Scheduler
from kvpager.scheduler.reference import generate_contiguous
from kvpager.v1 import worker_pb2, worker_pb2_grpc, plan_pb2
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.kv_cache import CacheSpec
from kvpager.worker.model import Decoder, ModelConfig

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=128, seed=3)
BLOCK = 4


def make_requests(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    requests = []
    for i in range(count):
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + [
            rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(1, 10))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 14), n=rng.choice([1, 1, 2, 3]))
        requests.append(Request(f"req{i}", prompt, params))
    return requests


@contextlib.contextmanager
def manager_sized_by_workers(heartbeat_timeout: float = 5.0, block_size: int = BLOCK):
    config = ManagerConfig(block_size=block_size, num_gpu_blocks=0, num_cpu_blocks=0, watermark=0.0,
                           worker_heartbeat_timeout=heartbeat_timeout)
    server, port, service, _ = create_server(config, "127.0.0.1:0")
    server.start()
    client = C.BlockManagerClient(f"127.0.0.1:{port}")
    try:
        yield client, service
    finally:
        client.close()
        server.stop(None)
        service.close()


def check_against_reference(client, service, runner, requests, model: ModelConfig = MODEL, block_size: int = BLOCK,
                            overlap: bool = False):
    scheduler = Scheduler(client, runner, block_size=block_size, overlap=overlap)
    outputs = scheduler.run(requests)
    expected = generate_contiguous(Decoder(model), requests)
    for request in requests:
        assert outputs[request.request_id].samples == expected[request.request_id], request.request_id
    with service.lock:
        service.manager.check_invariants()
    stats = client.get_stats()
    assert stats.running_sequences == stats.swapped_sequences == stats.gpu.used_blocks == 0
    return scheduler, stats


def test_generation_matches_contiguous_cache_in_process():
    with manager_sized_by_workers() as (client, service):
        worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=37, num_cpu_blocks=64,
                                          manager_address=client.target))
        worker.start()
        try:
            assert client.get_stats().gpu.total_blocks == 36  # the worker's capacity less the null block
            scheduler, stats = check_against_reference(client, service, worker.execute_model, make_requests(30, 1))
            assert scheduler.stats.preemptions > 0 and stats.blocks_swapped_in > 0
            assert stats.cow_copies > 0 and stats.prefix_hit_tokens > 0
            mem = worker.memory_stats()
            assert mem.blocks_copied == stats.cow_copies and mem.blocks_swapped_out == stats.blocks_swapped_out
            assert mem.attention_backend == "reference"  # a CPU cache
        finally:
            worker.stop()


class ComputedAtSubmit:
    """A runner with ``submit`` (overlap) that computes the step when it is submitted and hands
    its rows back when they are waited for: overlap's bookkeeping without a thread."""

    def __init__(self, run) -> None:
        self.run = run

    def __call__(self, step):
        return self.run(step)

    def submit(self, step):
        rows = self.run(step)
        return lambda: rows


def test_on_stage_reports_every_step_rpc_and_model_step_and_changes_no_token():
    """The hook benchmarks/serving.py times the scheduler with: each Step RPC's round trip (the
    same seconds as stats.step_latencies), each model call (plain) or each submit and its one
    wait (overlap), with the step it ran; the tokens are those of the reference either way."""
    with manager_sized_by_workers() as (client, service):
        worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=64,
                                          manager_address=client.target))
        worker.start()
        try:
            requests = make_requests(8, 2)
            expected = generate_contiguous(Decoder(MODEL), requests)
            for overlap, runner in ((False, worker.execute_model), (True, ComputedAtSubmit(worker.execute_model))):
                stages = []
                scheduler = Scheduler(client, runner, BLOCK, overlap=overlap,
                                      on_stage=lambda name, seconds, step: stages.append((name, seconds, step)))
                outputs = scheduler.run(requests)
                assert {r: o.samples for r, o in outputs.items()} == expected
                rpcs = [seconds for name, seconds, step in stages if name == "step_rpc"]
                assert rpcs == scheduler.stats.step_latencies and all(s > 0 for s in rpcs)
                assert all(step is None for name, _, step in stages if name == "step_rpc")
                steps = [step for name, _, step in stages if name in ("model", "submit")]
                assert sum(len(step.token_ids) for step in steps) == scheduler.stats.tokens_computed
                if overlap:
                    assert {name for name, _, _ in stages} == {"step_rpc", "submit", "wait"}
                    waited = [step for name, _, step in stages if name == "wait"]
                    assert sorted(map(id, waited)) == sorted(map(id, steps))   # each submitted step waited once
                else:
                    assert {name for name, _, _ in stages} == {"step_rpc", "model"}
        finally:
            worker.stop()


def test_generation_with_an_fp8_cache_matches_the_contiguous_cache_of_the_same_values():
    """KV stored as float8_e4m3fn with a scale (a quarter of the float32 cache's bytes): the
    tokens equal those of the contiguous cache holding the same quantized-then-dequantized K/V."""
    model = dataclasses.replace(MODEL, kv_cache_dtype="fp8_e4m3", kv_scale=0.25)
    with manager_sized_by_workers() as (client, service):
        worker = CacheWorker(WorkerConfig(model=model, block_size=BLOCK, num_gpu_blocks=37, num_cpu_blocks=64,
                                          manager_address=client.target))
        worker.start()
        try:
            assert worker.cache.blocks.dtype == torch.float8_e4m3fn
            fp32_block = CacheSpec(MODEL.num_layers, MODEL.num_kv_heads, MODEL.head_dim, BLOCK, torch.float32)
            assert worker.memory_stats().block_bytes * 4 == fp32_block.block_bytes
            scheduler, stats = check_against_reference(client, service, worker.execute_model, make_requests(30, 2),
                                                       model)
            assert scheduler.stats.preemptions > 0 and stats.blocks_swapped_in > 0 and stats.cow_copies > 0
        finally:
            worker.stop()


def test_worker_rejects_a_bad_plan_whole():
    worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=8, num_cpu_blocks=4))
    worker.start()
    try:
        before = worker.cache.blocks.clone()
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.CacheWorkerStub(channel)
            plan = plan_pb2.ExecutionPlan(step_id=7, blocks_to_copy=plan_pb2.BlockMapping(src=[0], dst=[8]))
            with pytest.raises(grpc.RpcError) as info:
                stub.ExecutePlan(worker_pb2.ExecutePlanRequest(plan=plan))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in info.value.details()
            assert stub.GetMemoryStats(worker_pb2.GetMemoryStatsRequest()).plans_executed == 0
        assert worker.cache.blocks.equal(before)
    finally:
        worker.stop()


def test_missed_heartbeats_drop_the_worker_and_health_says_so():
    with manager_sized_by_workers(heartbeat_timeout=0.5) as (client, service):
        worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=8,
                                          manager_address=client.target))
        worker.start()
        client.allocate("a", num_tokens=5)
        client.fork("a", "b")
        assert client.health() == "SERVING"
        worker._registration.stop()  # heartbeats stop; the worker itself stays up
        deadline = time.monotonic() + 10
        while client.health() == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.health() == "NOT_SERVING"
        with pytest.raises(errors.Unavailable, match=r"rank\(s\) \[0\]"):
            client.append("a", num_tokens=1)  # copy-on-write of the shared last block: needs the worker
        assert client.get_block_table("a").num_tokens == 5  # nothing applied
        with service.lock:
            service.manager.check_invariants()
        worker.stop()


# ---- a real local Ray cluster (tests/conftest.py's ray_cluster) ---------------------------------------
def test_ray_tensor_parallel_workers_generate_and_survive_a_replacement(ray_cluster):
    from kvpager.worker.ray_group import RayWorkerGroup

    with manager_sized_by_workers() as (client, service):
        config = WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=41, num_cpu_blocks=64,
                              manager_address=client.target)
        group = RayWorkerGroup(config, tensor_parallel_size=2, use_gpu=False)
        try:
            scheduler, stats = check_against_reference(client, service, group, make_requests(24, 2))
            assert scheduler.stats.preemptions > 0 and stats.cow_copies > 0
            for mem in group.memory_stats():  # every rank executed the same plans
                assert mem.blocks_copied == stats.cow_copies and mem.blocks_swapped_in == stats.blocks_swapped_in

            # Rank 1 dies: a step that needs it fails UNAVAILABLE and changes nothing.
            client.allocate("x", num_tokens=6)
            client.fork("x", "y")
            group.kill(1)
            # (the client retries UNAVAILABLE: its last attempt finds rank 1 unregistered)
            with pytest.raises(errors.Unavailable, match=r"rank(\(s\) \[)? ?1"):
                client.append("y", num_tokens=1)  # copy-on-write: a plan for the workers
            assert client.get_block_table("y").num_tokens == 6
            assert client.health() == "NOT_SERVING"
            with service.lock:
                service.manager.check_invariants()
            client.free("x")
            client.free("y")
        finally:
            group.stop()

        # A replacement group registers (same ranks) and is used.
        group = RayWorkerGroup(config, tensor_parallel_size=2, use_gpu=False)
        try:
            assert client.health() == "SERVING"
            check_against_reference(client, service, group, make_requests(8, 3))
        finally:
            group.stop()


class OutstandingSteps:
    """A runner passing steps to ``group``, counting the most submitted and not yet waited for."""

    def __init__(self, group) -> None:
        self.group, self.feeds_back = group, group.feeds_back
        self.outstanding = self.most = self.prefetches = 0

    def __call__(self, step):
        return self.submit(step)()

    def submit(self, step):
        wait = self.group.submit(step)
        self.outstanding += 1
        self.most = max(self.most, self.outstanding)

        def result():
            self.outstanding -= 1
            return wait()
        def prefetch():
            self.prefetches += 1
            wait.prefetch()

        result.prefetch = prefetch
        return result


def test_overlapped_steps_generate_what_the_plain_loop_generates(ray_cluster):
    """With overlap, each Step RPC runs while the previous step computes on a Ray worker: the
    tokens are the contiguous cache's, also when samples stop early on stop tokens (a slot was
    already reserved for them), fork (copy-on-write) and get preempted (those steps wait for
    the one in flight); seeded sampling gives the plain loop's tokens."""
    from kvpager.worker.ray_group import RayWorkerGroup

    rng = random.Random(7)
    stops = tuple(rng.sample(range(MODEL.vocab_size), 12))
    requests = [dataclasses.replace(r, params=dataclasses.replace(r.params, stop_token_ids=stops,
                                                                   n=1 if i % 4 else r.params.n))
                for i, r in enumerate(make_requests(28, 5))]
    sampled = [Request(f"s{i}", r.prompt, SamplingParams(max_new_tokens=10, temperature=0.9, seed=i,
                                                         stop_token_ids=stops))
               for i, r in enumerate(make_requests(6, 6))]
    with manager_sized_by_workers() as (client, service):
        config = WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=26, num_cpu_blocks=64,
                              manager_address=client.target)
        group = RayWorkerGroup(config, tensor_parallel_size=1, use_gpu=False)
        try:
            counting = OutstandingSteps(group)
            scheduler, stats = check_against_reference(client, service, counting, requests, overlap=True)
            assert scheduler.stats.overlapped_steps >= 5 and scheduler.stats.preemptions > 0
            assert scheduler.stats.fed_steps >= 5   # greedy on one rank: tokens fed back on the worker
            # Between iterations two steps are out (one computing, the next queued behind it); the
            # next is sent before the oldest's tokens are taken.
            assert counting.most == Scheduler.PIPELINE_DEPTH + 1 and counting.prefetches > 0
            assert stats.cow_copies > 0
            assert any(out.finish_reasons[0] == "stop" for out in scheduler.outputs.values())
            plain = Scheduler(client, group, block_size=BLOCK).run(sampled)
            overlapped = Scheduler(client, group, block_size=BLOCK, overlap=True)
            assert overlapped.run(sampled) == plain
            assert overlapped.stats.overlapped_steps > 0
            with service.lock:
                service.manager.check_invariants()
        finally:
            group.stop()


def test_a_refused_launch_is_raised_and_never_fetched(ray_cluster):
    """A rank that refuses a step at launch (here: a plan it has not applied): ``prefetch`` asks
    for nothing, and waiting for the step raises the launch's own error."""
    from kvpager.step import PlanNotApplied, StepInput
    from kvpager.worker.ray_group import RayWorkerGroup

    @ray_cluster.remote(num_cpus=0)
    class Rank:
        def __init__(self) -> None:
            self.fetched = 0

        def launch_model(self, step, ticket):
            raise PlanNotApplied(f"step {step.step_id}: refused")

        def fetch_output(self, ticket):
            self.fetched += 1

        def fetches(self) -> int:
            return self.fetched

    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group._ray, group._owned, group.step_timeout_s = ray_cluster, False, 30.0
    group._caller, group._tickets = "test", itertools.count(1)
    group.actors = [Rank.remote()]
    step = StepInput(step_id=3, plan_step_id=3, token_ids=[1], positions=[0], slot_mapping=[0], query_lens=[1],
                     context_lens=[1], block_tables=[0], max_blocks=1)
    submitted = group.submit(step)
    ray_cluster.wait(submitted._launches, timeout=30)
    submitted.prefetch()
    with pytest.raises(PlanNotApplied, match="step 3: refused"):
        submitted()
    assert ray_cluster.get(group.actors[0].fetches.remote()) == 0
    ray_cluster.kill(group.actors[0])


def test_a_taken_rendezvous_port_starts_the_group_again(ray_cluster, monkeypatch):
    """The tensor-parallel rendezvous port is picked on the driver and bound by rank 0's TCPStore
    seconds later, after its actor starts; another process may take it in between (CI saw
    EADDRINUSE once). The group then kills both ranks (rank 1 would wait on the rendezvous for
    ever) and starts them again on a fresh port: here the first port offered is held by a
    listening socket. The started group serves: both ranks answer, on the second port."""
    import socket

    from kvpager.worker import ray_group

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        held = taken.getsockname()[1]
        offered = [held]
        real = ray_group._free_port
        monkeypatch.setattr(ray_group, "_free_port", lambda: offered.pop() if offered else real())
        config = WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=8, num_cpu_blocks=8)
        group = ray_group.RayWorkerGroup(config, tensor_parallel_size=2, use_gpu=False)
        try:
            assert not offered
            assert group.configs[0].dist_init_method != f"tcp://127.0.0.1:{held}"
            assert len({c.dist_init_method for c in group.configs}) == 1
            assert len(group.addresses) == 2 and all(stats.blocks_copied == 0 for stats in group.memory_stats())
        finally:
            group.stop()


def test_a_stuck_rank_fails_the_model_step_at_its_deadline(ray_cluster):
    """A rank that never finishes its step (stopped, or waiting in a collective): the group's
    call raises WorkerDied at its deadline, naming the rank, instead of blocking forever."""
    from kvpager.step import StepInput
    from kvpager.worker.ray_group import RayWorkerGroup, WorkerDied

    @ray_cluster.remote(num_cpus=0)
    class Rank:
        def __init__(self, delay: float) -> None:
            self.delay = delay

        def launch_model(self, step, ticket):
            pass

        def fetch_output(self, ticket):   # the step never finishes on a stuck rank's device
            time.sleep(self.delay)
            return torch.zeros(1)

        def ready(self) -> bool:
            return True

    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group._ray, group._owned, group.step_timeout_s = ray_cluster, False, 1.0
    group._caller, group._tickets = "test", itertools.count(1)
    group.actors = [Rank.remote(0.0), Rank.remote(30.0)]
    ray_cluster.get([a.ready.remote() for a in group.actors])   # started: only rank 1 is slow
    step = StepInput(step_id=7, plan_step_id=0, token_ids=[1], positions=[0], slot_mapping=[0], query_lens=[1],
                     context_lens=[1], block_tables=[0], max_blocks=1)
    started = time.monotonic()
    with pytest.raises(WorkerDied, match=r"rank\(s\) \[1\] did not finish model step 7 within 1 s"):
        group(step)
    assert time.monotonic() - started < 10
    for actor in group.actors:
        ray_cluster.kill(actor)


@pytest.mark.parametrize("kill", ["before_compute", "after_compute"])
def test_scheduler_restarts_the_live_requests_when_a_worker_dies_mid_run(ray_cluster, kill):
    """Rank 1 of a tensor-parallel group is killed in the middle of a run, right before a model
    step (the runner raises WorkerDied) or right after one (the next Step that needs the workers
    fails UNAVAILABLE, or the next model step raises): the scheduler gets a replacement group
    through ``recover``, frees every live sequence and restarts the unfinished requests; the
    outputs still equal the reference."""
    from kvpager.worker.ray_group import RayWorkerGroup

    with manager_sized_by_workers() as (client, service):
        config = WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=41, num_cpu_blocks=64,
                              manager_address=client.target)
        groups = [RayWorkerGroup(config, tensor_parallel_size=2, use_gpu=False)]
        calls = 0

        def runner(inp):
            nonlocal calls
            calls += 1
            if calls == 8 and kill == "before_compute":
                groups[-1].kill(1)        # rank 1 dies; rank 0 would block in its all-reduce
            logits = groups[-1](inp)
            if calls == 8 and kill == "after_compute":
                groups[-1].kill(1)
            return logits

        def recover():
            groups[-1].abort()
            groups.append(RayWorkerGroup(config, tensor_parallel_size=2, use_gpu=False))
            return groups[-1]

        try:
            requests = make_requests(24, 4)
            streamed: dict[tuple[str, int], list[int]] = {}
            scheduler = Scheduler(client, runner, block_size=BLOCK, recover=recover,
                                  on_token=lambda rid, i, token, _: streamed.setdefault((rid, i), []).append(token))
            outputs = scheduler.run(requests)
            expected = generate_contiguous(Decoder(MODEL), requests)
            for request in requests:
                assert outputs[request.request_id].samples == expected[request.request_id], request.request_id
                # The stream of a restarted request carries on: each token once, as in the output.
                for i, sample in enumerate(expected[request.request_id]):
                    assert streamed[(request.request_id, i)] == sample, request.request_id
            assert scheduler.stats.recoveries == 1 and scheduler.stats.restarts > 0 and len(groups) == 2
            with service.lock:
                service.manager.check_invariants()
            stats = client.get_stats()
            assert stats.running_sequences == stats.swapped_sequences == stats.gpu.used_blocks == 0
            assert client.health() == "SERVING"
        finally:
            for group in groups:
                group.stop()


def test_seeded_sampling_is_reproducible_and_samples_differ():
    with manager_sized_by_workers() as (client, service):
        worker = CacheWorker(WorkerConfig(model=MODEL, block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=16,
                                          manager_address=client.target))
        worker.start()
        try:
            def run(seed: int):
                request = Request(f"s{seed}-{time.monotonic_ns()}", list(range(20, 31)),
                                  SamplingParams(max_new_tokens=12, n=3, temperature=1.0, seed=seed))
                return Scheduler(client, worker.execute_model, block_size=BLOCK).run([request])[request.request_id]

            first, again, other = run(11), run(11), run(12)
            assert first.samples == again.samples
            assert len({tuple(s) for s in first.samples}) > 1  # the n samples are not copies
            assert first.samples != other.samples
            with service.lock:
                service.manager.check_invariants()
        finally:
            worker.stop()
