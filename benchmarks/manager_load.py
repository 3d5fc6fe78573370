"""A manager-only load: a simulated LLM serving run against the block manager, over gRPC.

No model and no workers: it exercises the manager alone at scheduler speed (``make demo``
runs the whole system). Run: ``.venv/bin/python benchmarks/manager_load.py [--requests N]``.

Starts the block manager server in-process on a loopback port and drives it only through
``kvpager.client.BlockManagerClient``, as a continuous-batching scheduler would. A few hundred
requests arrive over time (Poisson, seeded); many start with one of a handful of shared
system prompts (so prefix caching hits), and some ask for n = 2..4 parallel samples, forked
right after the prompt is allocated (their first decodes copy the shared last block).

Each iteration is at most three ``Step`` RPCs:
  A. swap-ins of preempted groups, oldest admission first; then, once none are left on CPU,
     admissions (Allocate with the prompt's token ids; RESOURCE_EXHAUSTED keeps them waiting);
  B. forks of newly admitted groups, one decoded token appended to every running sequence,
     frees of finished ones;
  C. only when appends failed with RESOURCE_EXHAUSTED and the next iteration would still be
     short: swap out whole groups (parent and forks together), latest admitted first (vLLM).
Blocks freed in a step are reusable only from the next one, hence the split.

Prints a progress bar on stderr, a summary on stdout, then checks that everything was
freed and that the manager's invariants hold (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from kvpager import client as C
from kvpager.commands.progress import Progress
from kvpager.manager.config import ManagerConfig
from kvpager.errors import ManagerError, ResourceExhausted
from kvpager.manager.service import create_server
from kvpager.numeric import ceil_div, percentile
from kvpager.v1 import block_manager_pb2 as pb

VOCAB = 32000
ARRIVALS_PER_ITERATION = 2.0  # Poisson arrival rate, in requests per scheduler iteration
MAX_RUNNING_SEQS = 256        # like vLLM's max_num_seqs
MAX_ADMIT_PER_STEP = 16
CPU_BLOCKS = 4096


@dataclass(slots=True)
class Seq:
    seq_id: str
    num_tokens: int
    remaining: int              # tokens still to generate
    shares_tail: bool = False   # forked and not yet appended: the next append copies the last block


@dataclass(slots=True)
class Group:
    """One request: a prompt and its n samples (the parent sequence and n - 1 forks)."""

    index: int
    arrival: int                # iteration it arrives at
    prompt: list[int]
    system_len: int             # tokens of the shared system prompt it starts with (0: none)
    out_lens: list[int]         # tokens to generate, one per sample
    seqs: list[Seq] = field(default_factory=list)  # live sequences (not yet freed)
    order: int = -1             # admission order, kept across swaps
    forked: bool = False

    @property
    def seq_id(self) -> str:
        return f"req{self.index:04d}"


def make_workload(num: int, rng: random.Random) -> list[Group]:
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(64, 256))] for _ in range(6)]
    groups, t = [], 0.0
    for i in range(num):
        t += rng.expovariate(ARRIVALS_PER_ITERATION)
        system = rng.choice(systems) if rng.random() < 0.7 else []
        user = rng.randint(8, 144) if system else rng.randint(16, 400)
        prompt = system + [rng.randrange(VOCAB) for _ in range(user)]
        n = rng.randint(2, 4) if rng.random() < 0.25 else 1
        groups.append(Group(i, int(t), prompt, len(system), [rng.randint(8, 200) for _ in range(n)]))
    return groups


class Scheduler:
    def __init__(self, client: C.BlockManagerClient, groups: list[Group], rng: random.Random) -> None:
        self.client, self.rng = client, rng
        stats = client.get_stats()
        self.B, self.watermark = stats.block_size, stats.watermark_blocks
        self.available = stats.gpu.free_blocks + stats.gpu.cached_blocks  # after the last step
        self.pending = list(reversed(groups))  # not yet arrived; next arrival last
        self.waiting: list[Group] = []
        self.running: list[Group] = []         # by admission order
        self.swapped: list[Group] = []         # by admission order
        self.total, self.done, self.tokens = len(groups), 0, 0
        self.iterations, self.preemptions, self.refused, self.reused = 0, 0, 0, 0
        self.next_order = 0
        self.preempted_last = False
        self.latencies: list[float] = []
        self.util: list[float] = []
        self.frag: list[float] = []

    def _step(self, ops: list[pb.Operation]) -> list[pb.OperationResult]:
        start = time.perf_counter()
        reply = self.client.step(ops)
        self.latencies.append(time.perf_counter() - start)
        self.available = reply.gpu_blocks_available
        return list(reply.results)

    def _blocks(self, g: Group) -> int:
        """GPU blocks the group holds: its full prompt blocks are shared by all its samples."""
        full = len(g.prompt) // self.B
        return full + sum(ceil_div(s.num_tokens, self.B) - full for s in g.seqs)

    def _growth(self) -> int:
        """Blocks the running sequences' next appends may take (a new block or a CoW copy)."""
        return sum(s.remaining > 0 and (s.num_tokens % self.B == 0 or s.shares_tail)
                   for g in self.running for s in g.seqs)

    def run(self, progress: Progress) -> None:
        while self.done < self.total:
            if not (self.waiting or self.running or self.swapped):
                self.iterations = max(self.iterations, self.pending[-1].arrival)  # idle: skip ahead
            while self.pending and self.pending[-1].arrival <= self.iterations:
                self.waiting.append(self.pending.pop())
            self.schedule()
            self.decode()
            stats = self.client.get_stats()
            self.util.append(stats.gpu_utilization)
            self.frag.append(stats.internal_fragmentation)
            self.iterations += 1
            progress.update(self.done, f"running {sum(len(g.seqs) for g in self.running)}  swapped "
                                       f"{len(self.swapped)}  util {stats.gpu_utilization:.0%}")
            if self.iterations > 100 * self.total + 10_000:
                raise RuntimeError("no progress: the GPU pool is too small for the workload")

    def schedule(self) -> None:
        """Step A: swap groups back in while they fit, then admit waiting requests (FCFS)."""
        budget = self.available - self.watermark
        ops: list[pb.Operation] = []
        groups: list[Group] = []
        if not self.preempted_last:  # the room a preemption made goes to the stalled appends first
            room = budget - self._growth()
            for g in self.swapped:
                if self._blocks(g) > room:
                    break
                room -= self._blocks(g)
                ops.append(C.swap_in_op([s.seq_id for s in g.seqs]))
                groups.append(g)
            budget = room
        if len(groups) == len(self.swapped):
            seqs = sum(len(g.out_lens) for g in self.running)
            for g in self.waiting[:MAX_ADMIT_PER_STEP]:
                need = ceil_div(len(g.prompt), self.B)  # less when its prefix is cached
                if need > budget + g.system_len // self.B or seqs + len(g.out_lens) > MAX_RUNNING_SEQS:
                    break
                budget, seqs = budget - need, seqs + len(g.out_lens)
                ops.append(C.allocate_op(g.seq_id, g.prompt))
                groups.append(g)
        self.preempted_last = False
        if not ops:
            return
        for op, g, result in zip(ops, groups, self._step(ops)):
            err = C.result_error(result)
            if isinstance(err, ResourceExhausted):
                self.refused += op.WhichOneof("op") == "allocate"
                continue  # stays swapped out / waiting
            if err is not None:
                raise err
            if op.WhichOneof("op") == "swap_in":
                self.swapped.remove(g)
                self.reused += result.swap_in.num_blocks_reused  # still cached on the GPU: no copy
            else:
                self.waiting.remove(g)
                g.order, self.next_order = self.next_order, self.next_order + 1
                g.seqs = [Seq(g.seq_id, len(g.prompt), g.out_lens[0])]
            self.running.append(g)
        self.running.sort(key=lambda g: g.order)

    def decode(self) -> None:
        """Step B: forks, one token per running sequence, frees; then step C if appends ran short."""
        ops: list[pb.Operation] = []
        targets: list[tuple[Group, Seq]] = []
        for g in self.running:
            if not g.forked and len(g.out_lens) > 1:
                parent = g.seqs[0]
                parent.shares_tail = True
                for k, out_len in enumerate(g.out_lens[1:], 1):
                    child = Seq(f"{g.seq_id}/{k}", parent.num_tokens, out_len, shares_tail=True)
                    ops.append(C.fork_op(parent.seq_id, child.seq_id))
                    targets.append((g, child))
                    g.seqs.append(child)
            g.forked = True
            for s in g.seqs:
                if s.remaining == 0:
                    ops.append(C.free_op(s.seq_id))
                else:
                    ops.append(C.append_op(s.seq_id, [self.rng.randrange(VOCAB)]))
                targets.append((g, s))
        if not ops:
            return
        stalled = False
        for op, (g, s), result in zip(ops, targets, self._step(ops)):
            kind, err = op.WhichOneof("op"), C.result_error(result)
            if isinstance(err, ResourceExhausted) and kind == "append":
                stalled = True  # retried next iteration, after frees (and perhaps preemption)
            elif err is not None:
                raise err
            elif kind == "append":
                s.num_tokens, s.remaining, s.shares_tail = s.num_tokens + 1, s.remaining - 1, False
                self.tokens += 1
            elif kind == "free":
                g.seqs.remove(s)
                if not g.seqs:
                    self.running.remove(g)
                    self.done += 1
        if stalled:
            self.preempt(self._growth() - self.available)

    def preempt(self, deficit: int) -> None:
        """Step C: swap out the latest admitted groups until about ``deficit`` blocks come free."""
        ops: list[pb.Operation] = []
        victims: list[Group] = []
        for g in reversed(self.running):
            if deficit <= 0:
                break
            # Its system prompt's blocks may stay on the GPU, held by other requests.
            deficit -= self._blocks(g) - g.system_len // self.B
            ops.append(C.swap_out_op([s.seq_id for s in g.seqs]))
            victims.append(g)
        if not ops:
            return
        for g, result in zip(victims, self._step(ops)):
            err = C.result_error(result)
            if isinstance(err, ResourceExhausted):
                continue  # the CPU pool is full: it keeps running and stalling until room returns
            if err is not None:
                raise err
            self.running.remove(g)
            self.swapped.append(g)
            self.preemptions += 1
            self.preempted_last = True
        self.swapped.sort(key=lambda g: g.order)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/manager_load.py", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests to serve (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="workload random seed (default 0)")
    parser.add_argument("--gpu-blocks", type=int, default=1100, help="GPU pool size in blocks (default 1100)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be >= 1")

    rng = random.Random(args.seed)
    groups = make_workload(args.requests, rng)
    config = ManagerConfig(block_size=args.block_size, num_gpu_blocks=args.gpu_blocks, num_cpu_blocks=CPU_BLOCKS)
    server, port, service, _ = create_server(config, "127.0.0.1:0")
    server.start()
    progress = Progress(args.requests, quiet=args.quiet)
    try:
        with C.BlockManagerClient(f"127.0.0.1:{port}") as client:
            client.wait_ready()
            sched = Scheduler(client, groups, rng)
            start = time.perf_counter()
            try:
                sched.run(progress)
            finally:
                progress.close()
            wall = time.perf_counter() - start
            stats = client.get_stats()
    finally:
        server.stop(None)
        service.close()

    expected = sum(sum(g.out_lens) for g in groups)
    hit = stats.prefix_hit_tokens / max(1, stats.prefix_query_tokens)
    lat = [1000 * t for t in sched.latencies]
    print(f"kvpager manager load: {args.requests} requests (seed {args.seed}), block size {args.block_size}, "
          f"{args.gpu_blocks} GPU / {CPU_BLOCKS} CPU blocks")
    rows = [
        ("requests completed", f"{sched.done}  ({sum(len(g.out_lens) > 1 for g in groups)} with n > 1; "
                               f"{sched.refused} admissions refused and retried)"),
        ("tokens generated", f"{sched.tokens}  ({sched.tokens / wall:,.0f} tokens/s)"),
        ("steps", f"{len(lat)} Step RPCs over {sched.iterations} iterations"),
        ("wall time", f"{wall:.2f} s"),
        ("GPU utilization", f"peak {max(sched.util):.1%}  mean {sum(sched.util) / len(sched.util):.1%}"),
        ("internal fragmentation", f"{sum(sched.frag) / len(sched.frag):.2%}  (mean over steps)"),
        ("prefix-cache hit rate", f"{hit:.1%}  ({stats.prefix_hit_tokens} of {stats.prefix_query_tokens} "
                                  f"prompt tokens)"),
        ("swaps", f"{sched.preemptions} preemptions: {stats.blocks_swapped_out} blocks out, "
                  f"{stats.blocks_swapped_in} in (+{sched.reused} found still cached on the GPU)"),
        ("copy-on-write copies", f"{stats.cow_copies}"),
        ("Step latency", f"p50 {percentile(lat, 50):.2f} ms  p99 {percentile(lat, 99):.2f} ms"),
    ]
    for name, value in rows:
        print(f"  {name:<24}{value}")

    problems = []
    if sched.tokens != expected:
        problems.append(f"generated {sched.tokens} tokens, the requests asked for {expected}")
    if stats.running_sequences or stats.swapped_sequences:
        problems.append(f"{stats.running_sequences} running and {stats.swapped_sequences} swapped sequences remain")
    if stats.gpu.used_blocks or stats.cpu.used_blocks:
        problems.append(f"{stats.gpu.used_blocks} GPU and {stats.cpu.used_blocks} CPU blocks still in use")
    try:
        with service.lock:
            service.manager.check_invariants()
    except ManagerError as err:
        problems.append(f"invariant violated: {err}")
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    print("invariants: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
