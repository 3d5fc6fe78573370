"""A manager-only load: the reference scheduler serving a simulated workload, over gRPC, with no model.

No model and no workers: the block manager runs at scheduler speed (``make demo`` runs the whole
system). Run: ``.venv/bin/python benchmarks/manager_load.py [--requests N] [--gpu-blocks N]``.

Starts the block manager server in-process on a loopback port and serves the requests with the
production scheduler (``kvpager.scheduler.Scheduler``: admission, forks for n samples, appends,
swap-out preemption and swap-in, all its own), whose runner is a stand-in for the model: for
every sequence a step computes it answers one token id drawn from a seeded generator (a greedy
step's answer), so a run is the same on every machine and no token ends a sample early (each
runs to its ``max_new_tokens``).

A few hundred requests arrive over time: Poisson arrivals (seeded), counted in scheduler
iterations; each is given to the scheduler (``Scheduler.add``) before the iteration it arrives
at (``Scheduler.step``). Many start with one of a handful of shared system prompts (so prefix
caching hits), and some ask for n = 2..4 parallel samples (forked from the prompt, so their first
appends copy the shared last block). A GPU pool too small for the load makes the scheduler
preempt by swapping out.

Prints a progress bar on stderr, a summary on stdout, then checks that every request got its
tokens, that everything was freed and that the manager's invariants hold (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvpager import client as C
from kvpager.commands.progress import Progress
from kvpager.errors import ManagerError
from kvpager.manager.config import ManagerConfig
from kvpager.manager.service import BlockManagerService, create_server
from kvpager.numeric import percentile
from kvpager.scheduler import Request, RequestOutput, SamplingParams, Scheduler
from kvpager.step import StepInput
from kvpager.v1 import block_manager_pb2 as pb

VOCAB = 32000
ARRIVALS_PER_ITERATION = 2.0  # Poisson arrival rate, in requests per scheduler iteration
CPU_BLOCKS = 4096


@dataclass(frozen=True, slots=True)
class Arrival:
    iteration: int        # the scheduler iteration it arrives at
    request: Request


def make_workload(num: int, rng: random.Random) -> list[Arrival]:
    """``num`` requests in arrival order: 70% start with one of six shared system prompts,
    25% ask for 2..4 samples, each generates 8..200 tokens."""
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(64, 256))] for _ in range(6)]
    arrivals, t = [], 0.0
    for i in range(num):
        t += rng.expovariate(ARRIVALS_PER_ITERATION)
        system = rng.choice(systems) if rng.random() < 0.7 else []
        user = rng.randint(8, 144) if system else rng.randint(16, 400)
        prompt = system + [rng.randrange(VOCAB) for _ in range(user)]
        n = rng.randint(2, 4) if rng.random() < 0.25 else 1
        params = SamplingParams(max_new_tokens=rng.randint(8, 200), n=n)
        arrivals.append(Arrival(int(t), Request(f"req{i:04d}", prompt, params)))
    return arrivals


class RandomTokenRunner:
    """The stand-in model: checks each step's inputs and answers, for every sequence that
    computes tokens, one token id from a seeded generator (greedy steps: ids, not logits)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, step: StepInput) -> torch.Tensor:
        step.check()
        if not step.greedy:
            raise ValueError(f"step {step.step_id} samples: the stand-in runner answers greedy steps only")
        rows = sum(q > 0 for q in step.query_lens)
        return torch.randint(VOCAB, (rows,), generator=self.generator)


@dataclass(slots=True)
class Load:
    """What the run measured, besides the scheduler's own ``SchedulerStats``."""
    iterations: int = 0
    wall: float = 0.0
    util: list[float] = field(default_factory=list)  # GPU utilization after each iteration
    frag: list[float] = field(default_factory=list)  # internal fragmentation after each iteration


def serve(sched: Scheduler, arrivals: list[Arrival], client: C.BlockManagerClient, progress: Progress) -> Load:
    """Give each request to the scheduler as its iteration comes and step until all are served."""
    pending, load, idle = deque(arrivals), Load(), 0
    start = time.perf_counter()
    while pending or sched.has_work:
        if not sched.has_work:  # idle: skip ahead to the next arrival
            load.iterations = max(load.iterations, pending[0].iteration)
        while pending and pending[0].iteration <= load.iterations:
            sched.add(pending.popleft().request)
        idle = 0 if sched.step() else idle + 1
        if idle > 3:
            raise RuntimeError("no progress: the GPU pool is too small for the requests that remain")
        load.iterations += 1
        stats = client.get_stats()
        load.util.append(stats.gpu_utilization)
        load.frag.append(stats.internal_fragmentation)
        running = sum(len(g.unfinished()) for g in sched.running)
        progress.update(sched.stats.requests_finished, f"running {running}  swapped {len(sched.swapped)}  "
                                                       f"waiting {len(sched.waiting)}  util {stats.gpu_utilization:.0%}")
    load.wall = time.perf_counter() - start
    return load


def problems(arrivals: list[Arrival], outputs: dict[str, RequestOutput], stats: pb.GetStatsResponse,
             service: BlockManagerService) -> list[str]:
    """What is wrong at the end: a request without all its tokens, sequences or blocks left in
    the manager, a broken invariant. Empty when all is well."""
    found = []
    for arrival in arrivals:
        request = arrival.request
        out = outputs.get(request.request_id)
        want = [request.params.max_new_tokens] * request.params.n
        if out is None or [len(s) for s in out.samples] != want:
            got = None if out is None else [len(s) for s in out.samples]
            found.append(f"{request.request_id} asked for {want} tokens, got {got}")
    if stats.running_sequences or stats.swapped_sequences:
        found.append(f"{stats.running_sequences} running and {stats.swapped_sequences} swapped sequences remain")
    if stats.gpu.used_blocks or stats.cpu.used_blocks:
        found.append(f"{stats.gpu.used_blocks} GPU and {stats.cpu.used_blocks} CPU blocks still in use")
    try:
        with service.lock:
            service.manager.check_invariants()
    except ManagerError as err:
        found.append(f"invariant violated: {err}")
    return found


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/manager_load.py", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests to serve (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="workload and token random seed (default 0)")
    parser.add_argument("--gpu-blocks", type=int, default=1100, help="GPU pool size in blocks (default 1100)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be >= 1")

    arrivals = make_workload(args.requests, random.Random(args.seed))
    config = ManagerConfig(block_size=args.block_size, num_gpu_blocks=args.gpu_blocks, num_cpu_blocks=CPU_BLOCKS)
    server, port, service, _ = create_server(config, "127.0.0.1:0")
    server.start()
    progress = Progress(args.requests, quiet=args.quiet)
    try:
        with C.BlockManagerClient(f"127.0.0.1:{port}") as client:
            client.wait_ready()
            sched = Scheduler(client, RandomTokenRunner(args.seed), args.block_size)
            try:
                load = serve(sched, arrivals, client, progress)
            finally:
                progress.close()
            stats = client.get_stats()
        found = problems(arrivals, sched.outputs, stats, service)
    finally:
        server.stop(None)
        service.close()

    s = sched.stats
    hit = stats.prefix_hit_tokens / max(1, stats.prefix_query_tokens)
    lat = [1000 * t for t in s.step_latencies]
    print(f"kvpager manager load: {args.requests} requests (seed {args.seed}), block size {args.block_size}, "
          f"{args.gpu_blocks} GPU / {CPU_BLOCKS} CPU blocks")
    rows = [
        ("requests completed", f"{s.requests_finished}  ({sum(a.request.params.n > 1 for a in arrivals)} with n > 1)"),
        ("tokens generated", f"{s.tokens_generated}  ({s.tokens_generated / load.wall:,.0f} tokens/s; "
                             f"{s.tokens_computed} computed, prompts included)"),
        ("steps", f"{s.steps} Step RPCs over {load.iterations} iterations"),
        ("wall time", f"{load.wall:.2f} s"),
        ("GPU utilization", f"peak {max(load.util):.1%}  mean {sum(load.util) / len(load.util):.1%}"),
        ("internal fragmentation", f"{sum(load.frag) / len(load.frag):.2%}  (mean over iterations)"),
        ("prefix-cache hit rate", f"{hit:.1%}  ({stats.prefix_hit_tokens} of {stats.prefix_query_tokens} "
                                  f"prompt tokens)"),
        ("swaps", f"{s.preemptions} preemptions: {stats.blocks_swapped_out} blocks out, "
                  f"{stats.blocks_swapped_in} in; {s.restarts} restarts (no CPU room)"),
        ("copy-on-write copies", f"{stats.cow_copies}"),
        ("Step latency", f"p50 {percentile(lat, 50):.2f} ms  p90 {percentile(lat, 90):.2f} ms  "
                         f"p99 {percentile(lat, 99):.2f} ms"),
    ]
    for name, value in rows:
        print(f"  {name:<24}{value}")
    if found:
        for problem in found:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    print("invariants: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
