"""Benchmark of the block manager: its operations in process, how they scale with the number of
live sequences, and one scheduler Step over gRPC against an empty RPC.

    .venv/bin/python benchmarks/manager_bench.py [--quick] [--json PATH] [--profile]

Parts 1 and 2, in process (``kvpager.manager.BlockManager``, no gRPC). Two managers are built,
one with 1,000 and one with 100,000 live sequences (prompts of 24 to 32 token ids, prefix
caching on, both pools with the same 50,000 blocks of headroom), and every operation is timed
one call at a time with ``time.perf_counter_ns``, after a warm-up, in rounds that alternate
between the two managers so that drift of the machine hits both alike. Appends and forks go
to live sequences taken in a shuffled order, so the large manager is measured with its data
out of the CPU caches, as a scheduler's batch would find it. A sequence that grew past its
next block boundary is freed and allocated again (untimed), which keeps the population
steady. The operations:

- append, one token with its id, in three kinds: into the same block; the one that fills a
  block (it hashes and registers the block for prefix caching); the one that crosses a block
  boundary (it takes a new block);
- allocate+free of a 128-token prompt nobody has seen (prefix lookups all miss);
- prefix hit: allocate+free of a 128-token prompt whose blocks are all cached;
- fork+free of a live sequence (2-3 blocks);
- a Step of 256 appends (one token each, to 256 live sequences).

Python's garbage collector stays on; how often it ran and what one full collection costs with
both managers alive are printed too (full collections are what the p99/max columns catch).

Part 3, over gRPC on loopback: a real server in a subprocess (the ``main()`` of ``python -m
kvpager.manager --port 0``, with its Step handler wrapped by timers, see ``serve_timed``), so
client and server do not share a GIL; ``--server inprocess`` runs ``create_server`` in this
process instead (no server-side timings then). Steps appending one token to each of 1, 64,
256 and 1,024 sequences (prompts of 64 tokens, re-allocated every 32 rounds so contexts stay
between 64 and 96 tokens) and the empty ``Ping`` RPC are called in a shuffled order each
round, so they share the same conditions; round trips are timed around the stub call
(request serialization and response parsing included, building the request message not).
The server-side timings split each Step into decode (``wire.step_ops``), manager
(``BlockManager.step``), encode (``wire.step_pb``) and what lies outside the handler (gRPC,
protobuf parsing and serialization, the client).

Part 3b, the same Step path without gRPC, stage by stage, in this process: serialize the
request, parse it (server), ``wire.step_ops``, ``BlockManager.step``, ``wire.step_pb``,
serialize the answer, parse it (client). ``--profile`` adds a cProfile of that path for
Step(256).

Percentiles are nearest-rank. Timings are wall-clock on a possibly shared machine: the load
average is printed (and written to --json) with the results.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import os
import platform
import pstats
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc
import google.protobuf
from google.protobuf.internal import api_implementation

from kvpager.client import BlockManagerClient, allocate_op, free_op
from kvpager.manager import BlockManager, ManagerConfig
from kvpager.manager import wire
from kvpager.manager.operations import AllocateOp, AppendBatchOp
from kvpager.manager.service import create_server
from kvpager.numeric import ceil_div, percentile
from kvpager.v1 import block_manager_pb2 as pb

BLOCK_SIZE = 16
LIVE_PROMPT = 24          # tokens of a live sequence's prompt (2 blocks); it then grows to 33 and starts over
OP_PROMPT = 128           # tokens of the prompts of allocate+free and prefix hit: 8 blocks
HEADROOM_BLOCKS = 50_000  # free blocks beyond the live sequences' needs, the same in both managers
STEP_APPENDS = 256        # appends in the in-process Step row
GRPC_PROMPT = 64          # tokens of the prompts of the sequences the gRPC Steps append to
GRPC_RESET_EVERY = 32     # re-allocate those sequences every this many rounds
GRPC_SIZES = (1, 64, 256, 1024)
STEP_TARGET = 3.0         # Step(256) round trip <= this many Ping round trips
SCALING_TARGET = 1.3      # per-operation cost with 100,000 live <= this many times that with 1,000

perf_ns = time.perf_counter_ns


# ---- statistics ---------------------------------------------------------------------------------
def summarize(samples_ns: list[int]) -> dict:
    """p50, p99, largest and mean of nanosecond samples, in microseconds."""
    return {"p50_us": percentile(samples_ns, 50) / 1000, "p99_us": percentile(samples_ns, 99) / 1000,
            "max_us": max(samples_ns) / 1000, "mean_us": statistics.fmean(samples_ns) / 1000, "n": len(samples_ns)}


def prompt(tag: int, length: int) -> list[int]:
    """A prompt of ``length`` token ids, distinct for each tag (its first token), so that no two
    tags share a prefix block."""
    return [tag] + list(range(1, length))


# ---- parts 1 and 2: in process ----------------------------------------------------------------
APPEND_SAME, APPEND_FILL, APPEND_NEW = "append (same block)", "append (fills a block: hash)", "append (new block)"
ALLOC_FREE = f"allocate+free ({OP_PROMPT} tok, miss)"
PREFIX_HIT = f"prefix hit: allocate+free ({OP_PROMPT} tok)"
FORK_FREE = "fork+free (2-3 blocks)"
STEP_ROW = f"step: {STEP_APPENDS} appends"
INPROCESS_ROWS = (APPEND_SAME, APPEND_FILL, APPEND_NEW, ALLOC_FREE, PREFIX_HIT, FORK_FREE, STEP_ROW)


class LiveManager:
    """A BlockManager holding ``live`` running sequences, and the state the timed operations need.

    Every ``time_*`` method runs its operation ``count`` times and appends one sample (ns)
    per call to ``samples[row]``.
    """

    def __init__(self, live: int, seed: int) -> None:
        # A live sequence holds 2 blocks, 3 once an append crossed into its third one.
        config = ManagerConfig(block_size=BLOCK_SIZE, num_gpu_blocks=3 * live + HEADROOM_BLOCKS,
                               num_cpu_blocks=16, enable_prefix_caching=True)
        self.live = live
        self.mgr = BlockManager(config)
        self.samples: dict[str, list[int]] = {row: [] for row in INPROCESS_ROWS}
        self._tag = 0
        self.ids = [f"live-{i}" for i in range(live)]
        # Each sequence grows until it has crossed into its next block, then starts over from
        # LIVE_PROMPT tokens. Their lengths start spread evenly over that cycle, so that every
        # kind of append comes up at its steady-state rate however few appends each one gets.
        self.reset_at = (LIVE_PROMPT // BLOCK_SIZE + 1) * BLOCK_SIZE + 1
        cycle = self.reset_at - LIVE_PROMPT
        self.lengths = [LIVE_PROMPT + i % cycle for i in range(live)]
        for start in range(0, live, 1000):  # one step per 1,000 allocations: quicker to build
            ops = [AllocateOp(self.ids[i], self._prompt(self.lengths[i])) for i in range(start, min(live, start + 1000))]
            result = self.mgr.step(ops, all_or_nothing=True, batch=False)
            assert result.applied, result.outcomes
        self.order = list(range(live))
        random.Random(seed).shuffle(self.order)
        self._cursor = 0
        # The prompt of prefix hits: allocated once and freed, so all its blocks are cached.
        self.hot_prompt = self._prompt(OP_PROMPT)
        self.mgr.allocate("hot", self.hot_prompt)
        self.mgr.free("hot")

    def _prompt(self, length: int) -> list[int]:
        self._tag += 1
        return prompt(self._tag, length)

    def _next_live(self) -> int:
        index = self.order[self._cursor % self.live]
        self._cursor += 1
        return index

    def _grew(self, index: int) -> None:
        """Count one appended token; start the sequence over once it passed a block boundary."""
        self.lengths[index] += 1
        if self.lengths[index] >= self.reset_at:
            sid = self.ids[index]
            self.mgr.free(sid)
            self.mgr.allocate(sid, self._prompt(LIVE_PROMPT))
            self.lengths[index] = LIVE_PROMPT

    def time_appends(self, count: int) -> None:
        """``count`` single-token appends; each sample goes to the row of its kind."""
        mgr, B = self.mgr, BLOCK_SIZE
        for _ in range(count):
            index = self._next_live()
            sid, n = self.ids[index], self.lengths[index]
            row = APPEND_NEW if n % B == 0 else APPEND_FILL if (n + 1) % B == 0 else APPEND_SAME
            token = [n]
            t0 = perf_ns()
            mgr.append(sid, token)
            t1 = perf_ns()
            self.samples[row].append(t1 - t0)
            self._grew(index)

    def time_allocate_free(self, count: int) -> None:
        mgr, out = self.mgr, self.samples[ALLOC_FREE]
        for _ in range(count):
            tokens = self._prompt(OP_PROMPT)
            t0 = perf_ns()
            mgr.allocate("fresh", tokens)
            mgr.free("fresh")
            t1 = perf_ns()
            out.append(t1 - t0)

    def time_prefix_hit(self, count: int) -> None:
        mgr, out, tokens = self.mgr, self.samples[PREFIX_HIT], self.hot_prompt
        for _ in range(count):
            t0 = perf_ns()
            result = mgr.allocate("hit", tokens)
            mgr.free("hit")
            t1 = perf_ns()
            out.append(t1 - t0)
        assert result.num_cached_tokens == OP_PROMPT - BLOCK_SIZE, "the hot prompt fell out of the cache"

    def time_fork_free(self, count: int) -> None:
        mgr, out = self.mgr, self.samples[FORK_FREE]
        for i in range(count):
            parent, child = self.ids[self._next_live()], f"child-{i}"
            t0 = perf_ns()
            mgr.fork(parent, child)
            mgr.free(child)
            t1 = perf_ns()
            out.append(t1 - t0)

    def time_steps(self, count: int) -> None:
        out = self.samples[STEP_ROW]
        for _ in range(count):
            indices = list(dict.fromkeys(self._next_live() for _ in range(STEP_APPENDS)))
            op = AppendBatchOp([self.ids[i] for i in indices], [self.lengths[i] for i in indices])
            t0 = perf_ns()
            result = self.mgr.step([op])
            t1 = perf_ns()
            out.append(t1 - t0)
            assert not result.outcomes[0].result.failures, "an append of the step failed"
            for i in indices:
                self._grew(i)

    def clear_samples(self) -> None:
        for samples in self.samples.values():
            samples.clear()


def run_inprocess(live_counts: tuple[int, int], reps: int, step_reps: int, rounds: int, log) -> dict:
    """Time every operation on two managers (few and many live sequences), round by round."""
    managers = []
    for live in live_counts:
        t0 = time.perf_counter()
        managers.append(LiveManager(live, seed=live))
        log(f"  built a manager with {live:,} live sequences in {time.perf_counter() - t0:.1f} s")
    gc.collect()

    # Each round takes 1/rounds of every row's samples, on both managers in turn. Only one
    # append in (reset_at - LIVE_PROMPT) crosses into a new block, so appends run that many
    # times more often, for that row to get its `reps` samples too.
    appends_per_new = managers[0].reset_at - LIVE_PROMPT
    work: list[tuple[Callable[[LiveManager, int], None], int]] = [
        (LiveManager.time_appends, appends_per_new * reps),
        (LiveManager.time_allocate_free, reps),
        (LiveManager.time_prefix_hit, reps),
        (LiveManager.time_fork_free, reps),
        (LiveManager.time_steps, step_reps),
    ]

    def one_round(fraction: float, flip: bool) -> None:
        for timer, total in work:
            for m in (managers[::-1] if flip else managers):
                timer(m, max(1, round(total * fraction)))

    one_round(0.05, flip=False)  # warm-up, not recorded
    for m in managers:
        m.clear_samples()
    collections_before = [g["collections"] for g in gc.get_stats()]
    t0 = time.perf_counter()
    for r in range(rounds):
        one_round(1 / rounds, flip=bool(r % 2))
    log(f"  timed {rounds} rounds in {time.perf_counter() - t0:.1f} s")
    # Python's cyclic garbage collector runs during the timed calls like it would in a server; a
    # full (generation 2) collection walks every tracked object, the managers' included.
    collections = [g["collections"] - before for g, before in zip(gc.get_stats(), collections_before)]
    t0 = perf_ns()
    gc.collect()
    gc_info = {"collections_during_timing": collections, "tracked_objects": len(gc.get_objects()),
               "full_collection_ms": (perf_ns() - t0) / 1e6}
    for m in managers:
        m.mgr.check_invariants()

    results = {}
    small, large = managers
    for row in INPROCESS_ROWS:
        a, b = summarize(small.samples[row]), summarize(large.samples[row])
        results[row] = {str(small.live): a, str(large.live): b,
                        "ratio_p50": b["p50_us"] / a["p50_us"], "ratio_p99": b["p99_us"] / a["p99_us"]}
    return {"operations": results, "gc": gc_info}


# ---- part 3: Step round trips over gRPC -----------------------------------------------------------
@dataclass
class Server:
    address: str
    # One row per Step served: (operations, handler ns, decode ns, manager ns, encode ns);
    # filled in when a subprocess server exits (see ``serve_timed``), empty otherwise.
    step_rows: list[list[int]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def manager_process(cmd: list[str]) -> Iterator[str]:
    """Run a manager command that prints "listening on ADDRESS" first; yield the address;
    SIGTERM it on exit (killed after 20 s)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        match = re.search(r"listening on (\S+)", line)
        if match is None:
            raise RuntimeError(f"the manager did not start: {line!r} (exit code {proc.poll()})")
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def manager_server(config: ManagerConfig, mode: str) -> Iterator[Server]:
    """A block manager server on 127.0.0.1, stopped on exit."""
    if mode == "inprocess":
        server, port, service, _ = create_server(config, "127.0.0.1:0")
        server.start()
        try:
            yield Server(f"127.0.0.1:{port}")
        finally:
            server.stop(0).wait()
            service.close()
        return
    with tempfile.TemporaryDirectory(prefix="manager_bench-") as tmp:
        timings_path = os.path.join(tmp, "step_timings.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--serve-timed", timings_path,
               "--insecure", "--port", "0", "--grace", "1", "--block-size", str(config.block_size),
               "--num-gpu-blocks", str(config.num_gpu_blocks), "--num-cpu-blocks", str(config.num_cpu_blocks)]
        with manager_process(cmd) as address:
            server = Server(address)
            yield server
        if os.path.exists(timings_path):
            with open(timings_path) as f:
                server.step_rows = json.load(f)


def serve_timed(timings_path: str, server_argv: list[str]) -> int:
    """The benchmark's server process: the main() of ``python -m kvpager.manager`` itself, with the
    Step handler and its three stages (wire.step_ops, BlockManager.step, wire.step_pb) wrapped
    by timers. On exit it writes one row per Step to ``timings_path`` (see ``Server.step_rows``)."""
    from kvpager.manager import __main__ as manager_main
    from kvpager.manager import service as service_mod

    rows: list[list[int]] = []
    stage_ns: dict[str, int] = {}

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = perf_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                stage_ns[name] = perf_ns() - t0
        return wrapper

    # The servicer calls these through the module and the class, so the wrappers are seen.
    wire.step_ops = timed("decode", wire.step_ops)
    wire.step_pb = timed("encode", wire.step_pb)
    BlockManager.step = timed("manager", BlockManager.step)
    handler = service_mod.BlockManagerService.Step

    def timed_handler(self, request, context):
        stage_ns.clear()
        t0 = perf_ns()
        reply = handler(self, request, context)
        rows.append([len(request.operations), perf_ns() - t0,
                     stage_ns.get("decode", 0), stage_ns.get("manager", 0), stage_ns.get("encode", 0)])
        return reply

    service_mod.BlockManagerService.Step = timed_handler
    code = manager_main.main(server_argv)
    with open(timings_path, "w") as f:
        json.dump(rows, f)
    return code


class DecodeBatches:
    """Sequences to append to, one set per Step size, each sequence with a GRPC_PROMPT-token prompt.

    ``requests[n]`` is the StepRequest appending one token to each of the n sequences of set n
    (built once; the client sends the same bytes every round). ``allocate_steps()`` gives the
    StepRequests that allocate every sequence (freeing it first when ``free_first``), to start
    over once contexts got long."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self.ids = {n: [f"step{n}-{i}" for i in range(n)] for n in sizes}
        self._tag = 0
        self.requests = {
            n: decode_step(ids)
            for n, ids in self.ids.items()
        }

    def pool_blocks(self) -> int:
        longest = GRPC_PROMPT + GRPC_RESET_EVERY + 1
        return sum(self.sizes) * (ceil_div(longest, BLOCK_SIZE) + 1) + HEADROOM_BLOCKS // 5

    def allocate_steps(self, free_first: bool) -> list[pb.StepRequest]:
        ops = []
        for ids in self.ids.values():
            for sid in ids:
                self._tag += 1
                if free_first:
                    ops.append(free_op(sid))
                ops.append(allocate_op(sid, prompt(self._tag, GRPC_PROMPT)))
        return [pb.StepRequest(operations=ops[i:i + 512], all_or_nothing=True) for i in range(0, len(ops), 512)]


def decode_step(seq_ids: list[str]) -> pb.StepRequest:
    """A decode step as a scheduler sends it: one AppendBatch with a token for each sequence.
    (With --per-op-appends: one Append operation per sequence instead.)"""
    if PER_OP_APPENDS:
        return pb.StepRequest(operations=[pb.Operation(append=pb.AppendRequest(seq_id=sid, token_ids=[7]))
                                          for sid in seq_ids])
    return pb.StepRequest(operations=[pb.Operation(append_batch=pb.AppendBatchRequest(
        seq_ids=seq_ids, token_ids=[7] * len(seq_ids)))])


PER_OP_APPENDS = False
SERVER_STAGES = ("handler", "wire.step_ops", "BlockManager.step", "wire.step_pb")


def run_grpc(sizes: tuple[int, ...], reps: int, warmup: int, mode: str, seed: int, log) -> dict:
    batches = DecodeBatches(sizes)
    config = ManagerConfig(block_size=BLOCK_SIZE, num_gpu_blocks=batches.pool_blocks(), num_cpu_blocks=16)
    kinds = ["ping"] + [f"step{n}" for n in sizes]
    samples: dict[str, list[int]] = {k: [] for k in kinds}
    rng = random.Random(seed)
    with manager_server(config, mode) as server, BlockManagerClient(server.address, timeout=60) as client:
        client.wait_ready(timeout=30)
        stub = client.stub

        def send_all(requests: list[pb.StepRequest]) -> None:
            for request in requests:
                reply = stub.Step(request, timeout=60)
                if not reply.applied:
                    raise RuntimeError(f"setup step failed: {[r.message for r in reply.results if r.code][:1]}")

        send_all(batches.allocate_steps(free_first=False))
        calls = {"ping": lambda: stub.Ping(pb.PingRequest(), timeout=60)}
        batch_sizes = {f"step{n}": n for n in sizes}
        for n in sizes:
            calls[f"step{n}"] = lambda request=batches.requests[n]: stub.Step(request, timeout=60)
        for n in sizes:  # every append of the first Step of each size succeeds
            reply = calls[f"step{n}"]()
            assert all(r.code == 0 for r in reply.results) and len(reply.batch.seq_ids) == n

        t0 = time.perf_counter()
        for r in range(1, warmup + reps + 1):
            if r % GRPC_RESET_EVERY == 0:
                send_all(batches.allocate_steps(free_first=True))
            rng.shuffle(kinds)
            for kind in kinds:
                call = calls[kind]
                start = perf_ns()
                reply = call()
                end = perf_ns()
                if r > warmup:
                    samples[kind].append(end - start)
                if kind in batch_sizes and len(reply.batch.seq_ids) != batch_sizes[kind]:
                    raise RuntimeError(f"{kind}: an append failed: {[x.message for x in reply.results if x.code][:1]}")
        log(f"  {warmup + reps} rounds of {len(kinds)} calls in {time.perf_counter() - t0:.1f} s ({mode} server)")
        sizes_bytes = {f"step{n}": {"request_bytes": batches.requests[n].ByteSize(),
                                    "response_bytes": calls[f"step{n}"]().ByteSize()} for n in sizes}

    server_rows = server.step_rows  # complete now that the server has exited
    ping = summarize(samples["ping"])
    results = {"ping": ping}
    for n in sizes:
        s = summarize(samples[f"step{n}"])
        s["ratio_p50_vs_ping"] = s["p50_us"] / ping["p50_us"]
        s.update(sizes_bytes[f"step{n}"])
        rows = [row[1:] for row in server_rows if row[0] == n]  # warm-up rounds included: p50 only
        if rows:
            s["server_p50_us"] = {name: percentile(column, 50) / 1000
                                  for name, column in zip(SERVER_STAGES, zip(*rows))}
        results[f"step{n}"] = s
    return results


# ---- part 3b: the Step path stage by stage, without gRPC ---------------------------------------------
STAGES = ("client: serialize request", "server: parse request", "server: wire.step_ops",
          "server: BlockManager.step", "server: wire.step_pb", "server: serialize response",
          "client: parse response")


class StepPath:
    """The server's Step path run in this process on a manager set up like the benchmark server's."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.batches = DecodeBatches(sizes)
        self.mgr = BlockManager(ManagerConfig(block_size=BLOCK_SIZE, num_gpu_blocks=self.batches.pool_blocks(),
                                              num_cpu_blocks=16))
        self.refill(free_first=False)
        self.rounds = 0

    def refill(self, free_first: bool) -> None:
        for request in self.batches.allocate_steps(free_first):
            assert self.mgr.step(wire.step_ops(request), all_or_nothing=True).applied

    def serve(self, data: bytes) -> bytes:
        """What the servicer does for one Step, minus the lock and gRPC."""
        request = pb.StepRequest.FromString(data)
        ops = wire.step_ops(request)
        return wire.step_pb(ops, self.mgr.step(ops, request.all_or_nothing)).SerializeToString()

    def staged(self, n: int) -> list[int]:
        """One Step of n appends; returns the nanoseconds of each stage (STAGES order)."""
        t = [perf_ns()]
        data = self.batches.requests[n].SerializeToString()
        t.append(perf_ns())
        request = pb.StepRequest.FromString(data)
        t.append(perf_ns())
        ops = wire.step_ops(request)
        t.append(perf_ns())
        result = self.mgr.step(ops, request.all_or_nothing)
        t.append(perf_ns())
        response = wire.step_pb(ops, result)
        t.append(perf_ns())
        out = response.SerializeToString()
        t.append(perf_ns())
        pb.StepResponse.FromString(out)
        t.append(perf_ns())
        assert len(response.batch.seq_ids) == n
        return [b - a for a, b in zip(t, t[1:])]

    def next_round(self) -> None:
        self.rounds += 1
        if self.rounds % GRPC_RESET_EVERY == 0:
            self.refill(free_first=True)


def run_breakdown(sizes: tuple[int, ...], reps: int) -> dict:
    path = StepPath(sizes)
    stages = {n: [[] for _ in STAGES] for n in sizes}
    build = {n: [] for n in sizes}
    for r in range(reps + 5):
        for n in sizes:
            ids = path.batches.ids[n]
            t0 = perf_ns()  # what a scheduler pays to build the request (not part of the round trip)
            decode_step(ids)
            t1 = perf_ns()
            times = path.staged(n)
            if r >= 5:
                build[n].append(t1 - t0)
                for column, ns in zip(stages[n], times):
                    column.append(ns)
        path.next_round()
    out = {}
    for n in sizes:
        p50 = {name: percentile(col, 50) / 1000 for name, col in zip(STAGES, stages[n])}
        totals = [sum(parts) for parts in zip(*stages[n])]
        out[f"step{n}"] = {"stages_p50_us": p50, "total_p50_us": percentile(totals, 50) / 1000,
                           "client_build_request_p50_us": percentile(build[n], 50) / 1000}
    return out


def profile_step(n: int, reps: int, top: int) -> str:
    """cProfile of the server's Step(n) path (parse, decode, step, encode, serialize)."""
    path = StepPath((n,))
    data = path.batches.requests[n].SerializeToString()
    profiler = cProfile.Profile()
    for _ in range(reps):
        profiler.enable()
        path.serve(data)
        profiler.disable()
        path.next_round()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    return f"cProfile of the server's Step({n}) path, {reps} calls (times are totals over all calls):\n" + \
        text.getvalue()


# ---- output ---------------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
            cpu = names[0] if names else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "grpcio": grpc.__version__, "protobuf": f"{google.protobuf.__version__} ({api_implementation.Type()})",
            "platform": platform.platform()}


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def print_inprocess(results: dict, live_counts: tuple[int, int]) -> None:
    a, b = (f"{n:,} live" for n in live_counts)
    print(f"\nIn process, µs per operation ({a} vs {b}; ratio = {b} / {a} at p50, target <= {SCALING_TARGET})")
    print(f"{'operation':<38} {a + ' p50':>14} {'p99':>9} {b + ' p50':>16} {'p99':>9} {'ratio':>7}")
    for row, r in results.items():
        x, y = r[str(live_counts[0])], r[str(live_counts[1])]
        print(f"{row:<38} {x['p50_us']:>14.1f} {x['p99_us']:>9.1f} {y['p50_us']:>16.1f} {y['p99_us']:>9.1f} "
              f"{r['ratio_p50']:>7.2f}")


def print_grpc(results: dict, sizes: tuple[int, ...]) -> None:
    ping = results["ping"]
    print(f"\nOver gRPC on loopback, round trip in µs ({ping['n']} calls each, interleaved)")
    print(f"{'call':<22} {'p50':>9} {'p99':>9} {'p50 / Ping':>11} {'request B':>10} {'response B':>11}")
    print(f"{'Ping (empty RPC)':<22} {ping['p50_us']:>9.0f} {ping['p99_us']:>9.0f} {1:>11.2f}")
    for n in sizes:
        r = results[f"step{n}"]
        print(f"{f'Step({n} appends)':<22} {r['p50_us']:>9.0f} {r['p99_us']:>9.0f} {r['ratio_p50_vs_ping']:>11.2f} "
              f"{r['request_bytes']:>10,} {r['response_bytes']:>11,}")


def print_server_split(results: dict, sizes: tuple[int, ...]) -> None:
    if not all("server_p50_us" in results[f"step{n}"] for n in sizes):
        return
    print("\nWhere the Step round trip goes, p50 µs (handler stages timed inside the server during the run above)")
    print(f"{'':<44}" + "".join(f"{f'Step({n})':>12}" for n in sizes))
    rows = [("server: wire.step_ops (decode)", lambda r: r["server_p50_us"]["wire.step_ops"]),
            ("server: BlockManager.step", lambda r: r["server_p50_us"]["BlockManager.step"]),
            ("server: wire.step_pb (encode)", lambda r: r["server_p50_us"]["wire.step_pb"]),
            ("server: rest of the handler (p50 difference)", lambda r: r["server_p50_us"]["handler"] - sum(
                r["server_p50_us"][k] for k in SERVER_STAGES[1:])),
            ("server handler in all", lambda r: r["server_p50_us"]["handler"]),
            ("outside the handler: gRPC + protobuf", lambda r: r["p50_us"] - r["server_p50_us"]["handler"]),
            ("round trip", lambda r: r["p50_us"])]
    for name, value in rows:
        print(f"{name:<44}" + "".join(f"{value(results[f'step{n}']):>12.0f}" for n in sizes))
    print(f"{'(Ping round trip)':<44}" + "".join(f"{results['ping']['p50_us']:>12.0f}" for _ in sizes))


def print_breakdown(breakdown: dict, grpc_results: dict | None, sizes: tuple[int, ...]) -> None:
    print("\nStep path without gRPC, p50 µs per stage (in this process)")
    print(f"{'stage':<30}" + "".join(f"{f'Step({n})':>12}" for n in sizes))
    for stage in STAGES:
        print(f"{stage:<30}" + "".join(f"{breakdown[f'step{n}']['stages_p50_us'][stage]:>12.0f}" for n in sizes))
    print(f"{'sum of the p50s':<30}" + "".join(
        f"{sum(breakdown[f'step{n}']['stages_p50_us'].values()):>12.0f}" for n in sizes))
    if grpc_results:
        ping = grpc_results["ping"]["p50_us"]
        print(f"{'gRPC round trip - Ping (p50)':<30}" + "".join(
            f"{grpc_results[f'step{n}']['p50_us'] - ping:>12.0f}" for n in sizes))
    print(f"{'(client: build request)':<30}" + "".join(
        f"{breakdown[f'step{n}']['client_build_request_p50_us']:>12.0f}" for n in sizes))


# ---- main ---------------------------------------------------------------------------------------------------
@dataclass
class Settings:
    live: tuple[int, int] = (1_000, 100_000)
    reps: int = 5_000         # samples per in-process row and manager
    step_reps: int = 100      # samples of the in-process Step row
    rounds: int = 10          # the in-process samples are taken in this many alternating rounds
    grpc_reps: int = 300      # round trips per gRPC call kind
    grpc_warmup: int = 20
    breakdown_reps: int = 100
    sizes: tuple[int, ...] = GRPC_SIZES


QUICK = Settings(live=(1_000, 10_000), reps=500, step_reps=10, rounds=2, grpc_reps=30, grpc_warmup=3,
                 breakdown_reps=10)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-timed"]:  # the server subprocess of part 3 (internal)
        return serve_timed(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (~15 s): 1,000 vs 10,000 live sequences, few repetitions")
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    parser.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess",
                        help="where the gRPC server runs (default: a subprocess, so it has its own GIL)")
    parser.add_argument("--parts", default="inprocess,grpc,breakdown",
                        help="comma-separated parts to run: inprocess, grpc, breakdown (default: all)")
    parser.add_argument("--live", type=int, nargs=2, metavar=("FEW", "MANY"), help="live sequences of the two managers")
    parser.add_argument("--reps", type=int, help="samples per in-process operation and manager")
    parser.add_argument("--grpc-reps", type=int, help="round trips per gRPC call kind")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of the server's Step(256) path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-op-appends", action="store_true",
                        help="send a decode step as one Append operation per sequence instead of one AppendBatch")
    args = parser.parse_args(argv)
    global PER_OP_APPENDS
    PER_OP_APPENDS = args.per_op_appends

    overrides = {"live": tuple(args.live) if args.live else None, "reps": args.reps, "grpc_reps": args.grpc_reps}
    settings = dataclasses.replace(QUICK if args.quick else Settings(),
                                   **{k: v for k, v in overrides.items() if v is not None})
    parts = set(args.parts.split(","))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    report = {"command": " ".join(["benchmarks/manager_bench.py"] + argv),
              "machine": machine(), "load_average_start": load_average(),
              "settings": dataclasses.asdict(settings)}
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, Python "
          f"{report['machine']['python']}, grpcio {report['machine']['grpcio']}, protobuf {report['machine']['protobuf']}")
    print(f"load average at start: {report['load_average_start']}")
    started = time.perf_counter()

    if "inprocess" in parts:
        log("in process:")
        report["inprocess"] = run_inprocess(settings.live, settings.reps, settings.step_reps, settings.rounds, log)
        print_inprocess(report["inprocess"]["operations"], settings.live)
        over = [row for row, r in report["inprocess"]["operations"].items() if r["ratio_p50"] > SCALING_TARGET]
        print(f"scaling target (ratio <= {SCALING_TARGET} at p50): "
              f"{'met by every operation' if not over else 'NOT met by ' + ', '.join(over)}")
        gc_info = report["inprocess"]["gc"]
        print(f"garbage collections (gen 0/1/2) while timing: {'/'.join(map(str, gc_info['collections_during_timing']))}; "
              f"a full collection with both managers alive ({gc_info['tracked_objects']:,} tracked objects) "
              f"takes {gc_info['full_collection_ms']:.0f} ms")
    if "grpc" in parts:
        log("over gRPC:")
        report["grpc"] = run_grpc(settings.sizes, settings.grpc_reps, settings.grpc_warmup, args.server, args.seed, log)
        print_grpc(report["grpc"], settings.sizes)
        print_server_split(report["grpc"], settings.sizes)
        if 256 in settings.sizes:
            ratio = report["grpc"]["step256"]["ratio_p50_vs_ping"]
            report["grpc"]["step256_target_met"] = ratio <= STEP_TARGET
            print(f"Step(256) / Ping at p50 = {ratio:.1f} (target <= {STEP_TARGET:g}): "
                  f"{'met' if ratio <= STEP_TARGET else 'NOT met'}")
    if "breakdown" in parts:
        log("Step path stage by stage:")
        report["breakdown"] = run_breakdown(settings.sizes, settings.breakdown_reps)
        print_breakdown(report["breakdown"], report.get("grpc"), settings.sizes)
    if args.profile:
        print("\n" + profile_step(256, 10 if args.quick else 200, 25))

    report["load_average_end"] = load_average()
    report["seconds"] = time.perf_counter() - started
    print(f"\nload average at end: {report['load_average_end']}; took {report['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
