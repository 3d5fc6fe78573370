"""The decode Step RPC of a serving-sized batch, against an empty RPC, over gRPC on loopback.

    .venv/bin/python benchmarks/step_rpc.py [--seqs 110] [--steps 1000] [--server subprocess|inprocess]
                                            [--layouts both,padded,padded_packed,none] [--stages] [--profile]
                                            [--json PATH]

The shape of the H100 serving benchmark's 8B decode steps (docs/performance.md, "Serving
real-model shapes"): ``--seqs`` sequences (110) with prompts of 128 to 2,422 tokens, evenly spread
(mean 1,275, about 80 blocks of 16 tokens each; the longest, 152 blocks, makes the padded block
tables 110 x 152 = ~17K entries), distinct token ids, prefix caching on. A real manager serves
them on 127.0.0.1 (``python -m kvpager.manager`` in a subprocess by default, so it has its own
GIL; ``--server inprocess``: ``create_server`` in this process, as ``kvpager.embedded`` runs it).

Each round calls, in a shuffled order, the empty ``Ping`` RPC and one decode Step per table
layout asked for: one AppendBatch operation appending one token to every sequence, built and
sent as ``kvpager.scheduler.engine`` does (``client.append_batch_op`` and ``client.step``, request
id and all), then turned into the workers' ``StepInput`` (``StepInput.from_step_reply``).
Sequences grow by one token per Step (every layout's Step appends), and are freed and
allocated again (untimed) before they grew by more than ``--reset-every`` tokens, so the shape
stays steady. Printed:
p50/p99 of the Ping round trip, of the Step round trip (``client.step``), of Step plus
StepInput, and their ratio to Ping; the reply's size.

``--stages``: the same decode Steps in this process, without gRPC's transport, timed stage by
stage (p50 µs): building and serializing the request, parsing it, ``BlockManagerService.Step``
(decoding, the manager, encoding, the request-id cache), serializing the reply, parsing it,
``StepInput.from_step_reply``.

``--profile``: cProfile of the server side (request parsing, ``BlockManagerService.Step`` with
its request-id cache, reply serialization: everything but gRPC's transport, in this process)
and of the client side (building the operation, serializing the request, parsing the reply,
``StepInput.from_step_reply``) for the same decode steps.

Table layouts (``--layouts``): only when the manager's protocol has ``StepRequest.table_layout``
(older trees: one Step row, both layouts, as they always answer). Percentiles are nearest-rank;
the load average is printed with the results (the machine may be shared).

Before/after comparisons: run the script from outside the checkout (``cd /tmp``), with
``PYTHONPATH`` naming the tree to measure (e.g. a ``git worktree add /tmp/before HEAD``). The
manager subprocess is ``python -m kvpager.manager``, and ``-m`` puts the current directory first
on its path: started from the repository root it imports that checkout's ``kvpager`` whatever
``PYTHONPATH`` says (the ``--stages`` and ``--profile`` parts run in this process and are not
affected).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from kvpager import client as C
from kvpager.manager import ManagerConfig
from kvpager.numeric import ceil_div, percentile
from kvpager.step import StepInput
from kvpager.v1 import block_manager_pb2 as pb

BLOCK_SIZE = 16
SHORTEST, LONGEST = 128, 2_422   # prompt lengths, evenly spread between these (mean 1,275)
ALLOCATE_CHUNK = 8               # sequences allocated per setup Step (keeps replies under max_reply_bytes)
HAS_LAYOUTS = hasattr(pb, "TableLayout")
LAYOUTS = ("both", "padded", "csr", "none", "padded_packed")

perf_ns = time.perf_counter_ns


# ---- statistics: manager_bench's (this script's folder is on sys.path when it runs) -------------------
from manager_bench import machine, manager_process, summarize  # noqa: E402


# ---- the decode batch -----------------------------------------------------------------------------
@dataclass
class Batch:
    """The sequences a decode Step appends to, and what a scheduler knows of them."""

    seq_ids: list[str]
    prompts: list[list[int]]
    lengths: list[int]  # tokens of each sequence now

    @classmethod
    def build(cls, n: int) -> "Batch":
        """n sequences with prompts evenly spread over [SHORTEST, LONGEST] tokens. O(total tokens)."""
        lengths = [SHORTEST + (LONGEST - SHORTEST) * i // max(1, n - 1) for i in range(n)]
        prompts = [[i + 1000] + [(i * 7919 + t) % 30_000 for t in range(1, length)] for i, length in enumerate(lengths)]
        return cls([f"seq-{i}" for i in range(n)], prompts, list(lengths))

    def pool_blocks(self, growth: int) -> int:
        """GPU blocks that hold every sequence grown by ``growth`` tokens, plus slack."""
        return sum(ceil_div(len(p) + growth, BLOCK_SIZE) + 1 for p in self.prompts) + 1024

    def setup_requests(self, free_first: bool) -> list[pb.StepRequest]:
        """Steps that (free and) allocate every sequence with its prompt, a few per Step."""
        requests = []
        for start in range(0, len(self.seq_ids), ALLOCATE_CHUNK):
            ops = []
            for sid, tokens in zip(self.seq_ids[start:start + ALLOCATE_CHUNK], self.prompts[start:start + ALLOCATE_CHUNK]):
                if free_first:
                    ops.append(C.free_op(sid))
                ops.append(C.allocate_op(sid, tokens))
            requests.append(pb.StepRequest(operations=ops, all_or_nothing=True))
        self.lengths = [len(p) for p in self.prompts]
        return requests


# ---- the server ------------------------------------------------------------------------------------
@contextlib.contextmanager
def manager_server(config: ManagerConfig, mode: str) -> Iterator[tuple[str, object]]:
    """(address, in-process service or None) of a manager on 127.0.0.1, stopped on exit."""
    if mode == "inprocess":
        from kvpager.manager.service import create_server

        server, port, service, _ = create_server(config, "127.0.0.1:0")
        server.start()
        try:
            yield f"127.0.0.1:{port}", service
        finally:
            server.stop(0).wait()
            service.close()
        return
    cmd = [sys.executable, "-m", "kvpager.manager", "--insecure", "--port", "0", "--grace", "1",
           "--block-size", str(config.block_size), "--num-gpu-blocks", str(config.num_gpu_blocks),
           "--num-cpu-blocks", str(config.num_cpu_blocks)]
    with manager_process(cmd) as address:
        yield address, None


# ---- one decode step, as the scheduler does it -------------------------------------------------------
def step_kwargs(layout: str) -> dict:
    """The ``client.step`` arguments that ask for a table layout (none on trees without the field)."""
    if not HAS_LAYOUTS or layout == "default":
        return {}
    return {"table_layout": getattr(pb, f"TABLE_LAYOUT_{layout.upper()}")}


def decode_step(client: C.BlockManagerClient, batch: Batch, layout: str) -> tuple[int, int, pb.StepResponse]:
    """One decode Step and its StepInput; returns (ns of the RPC, ns of RPC + op + StepInput, reply)."""
    kwargs = step_kwargs(layout)
    t0 = perf_ns()
    op = C.append_batch_op(batch.seq_ids, [7] * len(batch.seq_ids))
    t1 = perf_ns()
    reply = client.step([op], **kwargs)
    t2 = perf_ns()
    tokens = [7] * len(batch.seq_ids)
    positions = batch.lengths
    if layout in ("default", "both", "padded", "padded_packed"):
        StepInput.from_step_reply(reply, tokens, positions, greedy=True)
    t3 = perf_ns()
    if len(reply.batch.seq_ids) != len(batch.seq_ids) or any(r.code for r in reply.results) \
            or reply.results[0].append_batch.failed_indices:
        raise RuntimeError(f"a decode step failed: {reply.results}")
    batch.lengths = [n + 1 for n in batch.lengths]
    return t2 - t1, (t1 - t0) + (t3 - t1), reply


def run(address: str, batch: Batch, layouts: list[str], steps: int, warmup: int, reset_every: int, seed: int,
        log: Callable[[str], None]) -> dict:
    """Interleaved Ping and decode Steps (one per layout) each round; samples per kind."""
    kinds = ["ping"] + layouts
    rpc: dict[str, list[int]] = {k: [] for k in kinds}
    full: dict[str, list[int]] = {k: [] for k in layouts}
    sizes: dict[str, int] = {}
    rng = random.Random(seed)
    with C.BlockManagerClient(address, timeout=60) as client:
        client.wait_ready(timeout=30)
        for request in batch.setup_requests(free_first=False):
            assert client.stub.Step(request, timeout=60).applied
        t0 = time.perf_counter()
        grown = 0  # tokens appended to each sequence since it was allocated
        for r in range(warmup + steps):
            if grown + len(layouts) > reset_every:
                for request in batch.setup_requests(free_first=True):
                    assert client.stub.Step(request, timeout=60).applied
                grown = 0
            grown += len(layouts)
            rng.shuffle(kinds)
            for kind in kinds:
                if kind == "ping":
                    s = perf_ns()
                    client.ping()
                    e = perf_ns()
                    if r >= warmup:
                        rpc[kind].append(e - s)
                    continue
                rpc_ns, full_ns, reply = decode_step(client, batch, kind)
                sizes[kind] = reply.ByteSize()
                if r >= warmup:
                    rpc[kind].append(rpc_ns)
                    full[kind].append(full_ns)
        log(f"  {warmup + steps} rounds of {len(kinds)} calls in {time.perf_counter() - t0:.1f} s")
        padded = len(reply.batch.block_tables) or len(batch.seq_ids) * reply.batch.max_blocks
    ping = summarize(rpc["ping"])
    out = {"ping": ping, "padded_entries": padded}
    for kind in layouts:
        s = summarize(rpc[kind])
        f = summarize(full[kind])
        out[kind] = {"step_rpc": s, "step_and_stepinput": f, "reply_bytes": sizes[kind],
                     "ratio_p50_vs_ping": s["p50_us"] / ping["p50_us"]}
    return out


# ---- profiles -----------------------------------------------------------------------------------------
class _Context:
    """The little of a gRPC ServicerContext that the servicer uses on success."""

    def abort(self, code, details):  # pragma: no cover - only on errors
        raise RuntimeError(f"{code}: {details}")


STAGES = ("client: build + serialize request", "server: parse request", "server: BlockManagerService.Step",
          "server: serialize reply", "client: parse reply", "client: StepInput.from_step_reply")


def in_process_service(batch: Batch, growth: int):
    """A BlockManagerService (no server) holding the batch's sequences, and a context for it."""
    from kvpager.manager.service import BlockManagerService

    service = BlockManagerService(ManagerConfig(block_size=BLOCK_SIZE, num_gpu_blocks=batch.pool_blocks(growth),
                                                num_cpu_blocks=16))
    ctx = _Context()
    for request in batch.setup_requests(free_first=False):
        assert service.Step(request, ctx).applied
    return service, ctx


def stages(batch: Batch, layout: str, reps: int) -> dict[str, float]:
    """p50 µs of each stage (STAGES) of ``reps`` decode Steps served in this process."""
    service, ctx = in_process_service(batch, reps + 1)
    kwargs = step_kwargs(layout)
    rows = []
    for _ in range(reps):
        t = [perf_ns()]
        op = C.append_batch_op(batch.seq_ids, [7] * len(batch.seq_ids))
        data = pb.StepRequest(operations=[op], request_id=os.urandom(16).hex(), **kwargs).SerializeToString()
        t.append(perf_ns())
        request = pb.StepRequest.FromString(data)
        t.append(perf_ns())
        reply = service.Step(request, ctx)
        t.append(perf_ns())
        reply_bytes = reply.SerializeToString()
        t.append(perf_ns())
        reply = pb.StepResponse.FromString(reply_bytes)
        t.append(perf_ns())
        if layout in ("default", "both", "padded", "padded_packed"):
            StepInput.from_step_reply(reply, [7] * len(batch.seq_ids), batch.lengths, greedy=True)
        t.append(perf_ns())
        batch.lengths = [n + 1 for n in batch.lengths]
        rows.append([b - a for a, b in zip(t, t[1:])])
    out = {name: percentile(column, 50) / 1000 for name, column in zip(STAGES, zip(*rows))}
    out["sum of the stages"] = percentile([sum(row) for row in rows], 50) / 1000
    return out


def print_stages(results: dict[str, dict[str, float]]) -> None:
    layouts = list(results)
    print("\nThe same decode Steps in this process, no gRPC transport: p50 µs per stage")
    print(f"{'stage':<38}" + "".join(f"{layout:>15}" for layout in layouts))
    for stage in (*STAGES, "sum of the stages"):
        print(f"{stage:<38}" + "".join(f"{results[layout][stage]:>15.0f}" for layout in layouts))


def profile(batch: Batch, layout: str, reps: int, top: int) -> str:
    """cProfile of the server side and of the client side of ``reps`` decode steps, in this process."""
    service, ctx = in_process_service(batch, reps + 1)
    server, client = cProfile.Profile(), cProfile.Profile()
    kwargs = step_kwargs(layout)
    for _ in range(reps):
        client.enable()
        op = C.append_batch_op(batch.seq_ids, [7] * len(batch.seq_ids))
        request = pb.StepRequest(operations=[op], request_id=os.urandom(16).hex(), **kwargs)
        data = request.SerializeToString()
        client.disable()
        server.enable()
        reply_bytes = service.Step(pb.StepRequest.FromString(data), ctx).SerializeToString()
        server.disable()
        client.enable()
        reply = pb.StepResponse.FromString(reply_bytes)
        if layout in ("default", "both", "padded", "padded_packed"):
            StepInput.from_step_reply(reply, [7] * len(batch.seq_ids), batch.lengths, greedy=True)
        client.disable()
        batch.lengths = [n + 1 for n in batch.lengths]
    parts = []
    for name, prof in (("server", server), ("client", client)):
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(top)
        parts.append(f"cProfile, {name} side of {reps} decode Steps ({layout} tables):\n{text.getvalue()}")
    return "\n".join(parts)


# ---- output ----------------------------------------------------------------------------------------------
# machine(): manager_bench's (imported above)


def print_results(results: dict, layouts: list[str], seqs: int) -> None:
    ping = results["ping"]
    print(f"\nDecode Step of {seqs} sequences ({results['padded_entries']:,} padded table entries) vs Ping, "
          f"µs, {ping['n']} calls each, interleaved")
    print(f"{'call':<26} {'p50':>8} {'p99':>8} {'p50/Ping':>9} {'+StepInput p50':>15} {'p99':>8} {'reply B':>9}")
    print(f"{'Ping (empty RPC)':<26} {ping['p50_us']:>8.0f} {ping['p99_us']:>8.0f} {1:>9.2f}")
    for kind in layouts:
        r = results[kind]
        s, f = r["step_rpc"], r["step_and_stepinput"]
        print(f"{f'Step ({kind} tables)':<26} {s['p50_us']:>8.0f} {s['p99_us']:>8.0f} {r['ratio_p50_vs_ping']:>9.2f} "
              f"{f['p50_us']:>15.0f} {f['p99_us']:>8.0f} {r['reply_bytes']:>9,}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=110, help="sequences in the decode batch (default 110)")
    parser.add_argument("--steps", type=int, default=1000, help="timed rounds (default 1000)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--reset-every", type=int, default=128,
                        help="tokens a sequence grows by before it is allocated again (default 128)")
    parser.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess")
    parser.add_argument("--layouts", default="both,padded,padded_packed,none" if HAS_LAYOUTS else "default",
                        help=f"comma-separated table layouts to time, of {', '.join(LAYOUTS)} "
                             "(default both,padded,padded_packed,none)")
    parser.add_argument("--stages", action="store_true", help="also time the Step path stage by stage in this process")
    parser.add_argument("--stage-reps", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="also print cProfiles of the server and client sides")
    parser.add_argument("--profile-reps", type=int, default=200)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",") if HAS_LAYOUTS else ["default"]
    for layout in layouts:
        if layout not in LAYOUTS + ("default",):
            parser.error(f"unknown layout {layout!r}: choose from {', '.join(LAYOUTS)}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, grpcio {info['grpcio']}, "
          f"protobuf {info['protobuf']}; server: {args.server}")
    print(f"load average at start: {os.getloadavg()}")
    batch = Batch.build(args.seqs)
    config = ManagerConfig(block_size=BLOCK_SIZE, num_cpu_blocks=16,
                           num_gpu_blocks=batch.pool_blocks(args.reset_every + 2 * len(layouts)))
    with manager_server(config, args.server) as (address, _):
        results = run(address, batch, layouts, args.steps, args.warmup, args.reset_every, args.seed, log)
    print_results(results, layouts, args.seqs)
    print(f"load average at end: {os.getloadavg()}")
    if args.stages:
        results["stages"] = {layout: stages(Batch.build(args.seqs), layout, args.stage_reps) for layout in layouts}
        print_stages(results["stages"])
    if args.profile:
        for layout in layouts:
            print("\n" + profile(Batch.build(args.seqs), layout, args.profile_reps, 20))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["benchmarks/step_rpc.py"] + (argv if argv is not None else sys.argv[1:])),
                       "machine": info, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
