"""Where a short decode kernel's time goes: a per-block timeline of one launch, read from the GPU's
own clock (%globaltimer) in a build of the extension with ``-DKVPAGER_DECODE_TIMELINE=1``
(kernels/csrc/decode_timeline.cuh; this script asks for that build, in its own directory). For
each shape and kernel instance it prints, in microseconds from the first block's entry:

- entry:  when blocks start (the launch's spread over the SMs);
- first:  how long after its item's start warp 0 first had K/V to use (prologue + load latency);
- end:    when items end (10th/50th/90th percentile and last), and the last item end per SM;
- merge:  when the merge kernel's blocks got past their wait and when the last one ended;
- the whole span against the time the K/V bytes take at the copy ceiling, the items' own rates
  (an item's bytes over its end minus its first data) summed, and the read rate over the launch in
  2 us bins (from each item's first, middle and end marks).

One launch per (shape, instance, flush), after a warm-up; its merge kernel prints the records once
the decode grid is done (decode_timeline.cuh), so the decode kernel runs without device printf,
and the merge's own times after its wait are the printing's. Thread 0's marks cost a few global
stores a block, and the build's registers may differ a little from the default's: the launch event
time printed is this build's. Launches without a merge (grid plans of one split) print nothing.

    python3 benchmarks/decode_timeline.py
    python3 benchmarks/decode_timeline.py --shapes 8x4096,1x32768 --kinds list,mma16,fp8 --flush clean
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import defaultdict

import kernels as bench  # benchmarks/kernels.py: shapes, flush, ceiling
import torch

from kvpager.kernels import cuda, debug

TIMELINE_FLAG = "-DKVPAGER_DECODE_TIMELINE=1"

KINDS = ("list", "grid", "mma16", "fp8")
FP8_SCALE = 0.05


class CapturedStdout:
    """File descriptor 1 sent to a temporary file (device printf writes there at a synchronize)."""

    def __enter__(self):
        sys.stdout.flush()
        self.file = tempfile.TemporaryFile(mode="w+")
        self.saved = os.dup(1)
        os.dup2(self.file.fileno(), 1)
        return self

    def clear(self) -> None:
        torch.cuda.synchronize()
        self.file.truncate(0)
        self.file.seek(0)

    def lines(self) -> list[str]:
        torch.cuda.synchronize()
        self.file.flush()
        self.file.seek(0)
        return self.file.read().splitlines()

    def __exit__(self, *exc):
        os.dup2(self.saved, 1)
        os.close(self.saved)
        self.file.close()


def runner(kind: str, c: bench.DecodeLayer):
    """(callable, bytes read) of one decode launch of ``kind`` over the layer ``c``."""
    scale = bench.D ** -0.5
    if kind == "list":
        return c.decode, c.nbytes
    if kind == "grid":
        plan = cuda.plan_decode_grid(c.q, c.k, c.v, c.tables, c.lens)
        return (lambda: cuda.paged_decode_grid_run(plan, c.q, c.k, c.v, c.tables, c.lens, scale, out=c.out)), c.nbytes
    if kind == "mma16":
        step = bench.work_step(c.lens.tolist(), debug.decode_work_geometry(c.q, c.k, mma=True))
        return (lambda: cuda.paged_decode_run(step, c.q, c.k, c.v, c.tables, c.lens, scale, out=c.out)), c.nbytes
    if kind == "fp8":
        k8 = (c.k.float() / FP8_SCALE).to(torch.float8_e4m3fn)
        v8 = (c.v.float() / FP8_SCALE).to(torch.float8_e4m3fn)
        step = bench.work_step(c.lens.tolist(), cuda.decode_work_geometry(c.q, k8))
        return (lambda: cuda.paged_decode_run(step, c.q, k8, v8, c.tables, c.lens, scale, out=c.out,
                                              k_scale=FP8_SCALE, v_scale=FP8_SCALE)), c.nbytes // 2
    raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(lines: list[str], nbytes: int, ceiling: float, event_us: float) -> str:
    items, merges = [], []
    for line in lines:
        f = line.split()
        if len(f) >= 13 and f[:2] == ["KVTL", "d"]:
            items.append([int(x) for x in f[2:]])
        elif len(f) >= 8 and f[:2] == ["KVTL", "m"]:
            merges.append([int(x) for x in f[2:]])
    if not items:
        return "no timeline lines (a launch without a merge kernel prints none)"
    newest = max(it[5] for it in items)
    items = [it for it in items if newest - it[5] < 5_000_000]   # older launches' records: > 5 ms before
    t0 = min(it[5] for it in items)
    us = lambda t: (t - t0) / 1e3  # noqa: E731
    entries = [us(it[5]) for it in items if it[4] == 0]
    firsts = [(it[7] - it[6]) / 1e3 for it in items if it[7]]
    ends = [us(it[8]) for it in items]
    last_by_sm = defaultdict(float)
    for it in items:
        last_by_sm[it[0]] = max(last_by_sm[it[0]], us(it[8]))
    sm_ends = list(last_by_sm.values())
    durations = [(it[8] - it[7]) / 1e3 for it in items if it[7]]
    # Each item's bytes over its time from first data to end, summed: the rate while all stream.
    total_tokens = sum(it[9] for it in items)
    rate = sum(nbytes * it[9] / total_tokens / ((it[8] - it[7]) * 1e-9) for it in items if it[7] and it[8] > it[7])
    span_end = max(ends)
    out = [f"{len(items)} items on {len(entries)} blocks, {len(last_by_sm)} SMs; launch event {event_us:.1f} us, "
           f"K/V at the copy ceiling {nbytes / ceiling * 1e6:.1f} us",
           f"  entry  median {statistics.median(entries):5.1f}  p90 {pct(entries, 0.9):5.1f}  last {max(entries):5.1f}",
           f"  first  median {statistics.median(firsts):5.1f}  p90 {pct(firsts, 0.9):5.1f}  max {max(firsts):5.1f} "
           f"(item start to warp 0's first scores)",
           f"  item   median {statistics.median(durations):5.1f} us from first data to end; items' own rates summed "
           f"{100 * rate / ceiling:4.1f}% of the ceiling",
           f"  end    p10 {pct(ends, 0.1):5.1f}  median {statistics.median(ends):5.1f}  p90 {pct(ends, 0.9):5.1f}  "
           f"last {span_end:5.1f}; an SM's last: first {min(sm_ends):5.1f}, p10 {pct(sm_ends, 0.1):5.1f}, "
           f"median {statistics.median(sm_ends):5.1f}",
           ]
    blocks_on = defaultdict(set)
    for it in items:
        blocks_on[it[0]].add((it[1], it[2], it[3]))
    by_load = defaultdict(list)
    for sm, last in last_by_sm.items():
        by_load[len(blocks_on[sm])].append(last)
    out.append("  SMs by blocks held: " + ", ".join(
        f"{n} blocks: {len(v)} SMs done by {statistics.median(v):5.1f} (median)" for n, v in sorted(by_load.items())))
    if merges:
        live = [m for m in merges if m[4]]
        m_end = max(us(m[5]) for m in merges)
        m_wait = [us(m[4]) for m in live] or [0.0]
        out.append(f"  merge  {len(merges)} blocks ({len(live)} waited): entry first {min(us(m[3]) for m in merges):5.1f}, "
                   f"past the wait {min(m_wait):5.1f}-{max(m_wait):5.1f}, last end {m_end:5.1f}")
        span_end = max(span_end, m_end)
    out.append(f"  span   {span_end:5.1f} us: {100 * nbytes / (span_end * 1e-6) / ceiling:4.1f}% of the ceiling")
    out.append("  rate   % of the ceiling per 2 us from the first entry: " +
               " ".join(f"{r:.0f}" for r in rate_profile(items, nbytes, ceiling, t0, 2.0)))
    return "\n".join(out)


def rate_profile(items: list[list[int]], nbytes: int, ceiling: float, t0: int, width_us: float) -> list[float]:
    """The K/V read rate over the launch, in bins of width_us, as % of the ceiling: each item's
    bytes spread evenly, half between its first data and its middle mark, half from there to its end
    (what arrived before its first data, one iteration's, is left out)."""
    total_tokens = sum(it[9] for it in items)
    bins = [0.0] * (int(max((it[8] - t0) / 1e3 for it in items) / width_us) + 2)
    for it in items:
        first, mid, end = it[7], it[10], it[8]
        if not first or not mid or not first <= mid <= end:
            continue
        half = nbytes * it[9] / total_tokens / 2
        for a, b in ((first, mid), (mid, end)):
            lo, hi = (a - t0) / 1e3 / width_us, (b - t0) / 1e3 / width_us
            if hi <= lo:
                bins[int(lo)] += half
                continue
            for k in range(int(lo), int(hi) + 1):
                overlap = min(hi, k + 1) - max(lo, k)
                if overlap > 0:
                    bins[k] += half * overlap / (hi - lo)
    return [100 * b / (width_us * 1e-6) / ceiling for b in bins]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x4096,1x32768,32x2048,64x4096", help="batch x context, comma-separated")
    ap.add_argument("--kinds", default="list,grid,mma16,fp8", help=f"instances: {', '.join(KINDS)}")
    ap.add_argument("--flush", default="write,clean", help="L2 flushes before the launch: write, clean")
    args = ap.parse_args()
    # The timeline build, in its own directory (read when the extension first loads, below).
    if TIMELINE_FLAG not in os.environ.get("KVPAGER_EXT_CUDA_FLAGS", ""):
        os.environ["KVPAGER_EXT_CUDA_FLAGS"] = f"{os.environ.get('KVPAGER_EXT_CUDA_FLAGS', '')} {TIMELINE_FLAG}".strip()
        os.environ["KVPAGER_EXT_DIR"] = os.path.join(tempfile.gettempdir(), "kvpager_variant_timeline")
    ceiling = bench.copy_ceiling()
    gen = torch.Generator(device="cuda").manual_seed(2)
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s; extension flags {os.environ['KVPAGER_EXT_CUDA_FLAGS']}", flush=True)
    for spec in args.shapes.split(","):
        batch, ctx = (int(x) for x in spec.split("x"))
        c = bench.decode_layer(batch, ctx, gen)
        bench.warm_up(c.sdpa, 0.2)
        sdpa = {mode: bench.timed(c.sdpa, reps=7, flush=mode) for mode in args.flush.split(",")}
        print(f"\n{batch} x {ctx}: SDPA (contiguous) " + ", ".join(
            f"{mode} flush {t * 1e6:.1f} us = {100 * c.nbytes / t / ceiling:.1f}%" for mode, t in sdpa.items()), flush=True)
        for kind in args.kinds.split(","):
            fn, nbytes = runner(kind, c)
            for mode in args.flush.split(","):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with CapturedStdout() as cap:
                    bench.warm_up(fn, 0.2)
                    bench.flush_l2(mode)
                    cap.clear()
                    start.record()
                    fn()
                    stop.record()
                    lines = cap.lines()
                print(f"\n{batch} x {ctx}, {kind}, {mode} flush: "
                      f"{summarize(lines, nbytes, ceiling, start.elapsed_time(stop) * 1e3)}", flush=True)
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
