"""Where a short decode call's event time goes outside its kernels: our work-list decode (the
planner's instance, and with ``--fp8`` over an e4m3 copy of the cache) and torch SDPA over the
contiguous cache, each call after the L2 flush, traced with CUPTI (torch.profiler) while CUDA events
time the same calls. Per run and flush, medians over the calls, in microseconds:

- event:   the CUDA-event time of the call (what decode_turns.py and the targets count);
- lead:    from the flush's last kernel end to the call's first kernel start (launch latency, or the
  GPU waiting for the host);
- kernels: each kernel's own duration, by name;
- span:    from the call's first kernel start to its last kernel end (a programmatic dependent
  launch, our merge, overlaps the kernel before it, so the span can be less than the sum);
- tail:    event minus lead minus span (the end event after the last kernel, and what the start
  event adds before the lead).

    python3 benchmarks/decode_gaps.py
    python3 benchmarks/decode_gaps.py --shapes 8x4096,1x32768 --fp8 --mma --sequential

Tracing adds its own cost to each launch, so ``event`` here may differ a little from an untraced
run's; the ratios of ours to SDPA are read from decode_turns.py, this script says where the
difference lies.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes, flush and timers
import torch
from torch.profiler import ProfilerActivity, profile

from decode_turns import FP8_SCALE, fp8_views

from kvpager.kernels import cuda, debug

CALLS = 15


def cuda_kernels(prof) -> list:
    """The profile's kernels (no copies or memsets), by start time."""
    return sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                   and not e.name.startswith(("Memcpy", "Memset"))), key=lambda e: e.time_range.start)


def traced(fn, flush: str) -> dict:
    """fn's calls after the L2 flush, traced and event-timed: ``summarize`` of them."""
    with profile(activities=[ProfilerActivity.CUDA]) as flush_only:
        bench.flush_l2(flush)
        torch.cuda.synchronize()
    flush_names = {e.name for e in cuda_kernels(flush_only)}
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    bench.warm_up(fn, 0.1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s, e in zip(starts, ends):
            bench.flush_l2(flush)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
    kernels = [(k.name, k.time_range.start, k.time_range.end) for k in cuda_kernels(prof)]
    return summarize(kernels, flush_names, [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


def summarize(kernels: list[tuple[str, float, float]], flush_names: set[str], events: list[float]) -> dict:
    """Medians over the calls of lead, span, tail, event and each kernel's duration (us), from the
    trace's kernels (name, start, end in us, by start) and the calls' event times: a call is the
    kernels between two flushes (kernels named in ``flush_names``), its lead from the flush's last
    kernel end to its first kernel start, its span from there to its last kernel end."""
    calls, current, flush_end = [], None, None
    for name, start, end in kernels:
        if name in flush_names:
            if current is not None:
                calls.append(current)
                current = None
            flush_end = end
        elif flush_end is None:
            raise ValueError(f"kernel {name} before any flush")
        else:
            if current is None:
                current = (flush_end, [])
            current[1].append((name, start, end))
    if current is not None:
        calls.append(current)
    if len(calls) != len(events):
        raise RuntimeError(f"{len(calls)} calls traced, {len(events)} timed")
    leads, spans, durations = [], [], defaultdict(list)
    for after, ks in calls:
        leads.append(ks[0][1] - after)
        spans.append(max(end for _, _, end in ks) - ks[0][1])
        for name, start, end in ks:
            durations[name].append(end - start)
    lead, span, event = statistics.median(leads), statistics.median(spans), statistics.median(events)
    return {"event": event, "lead": lead, "span": span, "tail": event - lead - span,
            "kernels": {name: statistics.median(d) for name, d in durations.items()}}


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameters."""
    return name.split("<")[0].split("(")[0].replace("void ", "")[:60]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x4096,1x32768", help="batch x context, comma-separated")
    ap.add_argument("--mma", action="store_true", help="also the other instance over the bf16 cache")
    ap.add_argument("--fp8", action="store_true", help="also our decode over an e4m3 copy of the cache")
    ap.add_argument("--flush", default="clean,write", help="L2 flushes, comma-separated")
    ap.add_argument("--sequential", action="store_true", help="also ours over the same cache through block "
                    "tables in order (sequence s's blocks s * W .. s * W + W - 1), not shuffled")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(2)
    for spec in args.shapes.split(","):
        batch, ctx = (int(x) for x in spec.split("x"))
        c = bench.decode_layer(batch, ctx, gen)
        scale = c.q.shape[-1] ** -0.5
        runs = {"ours": c.decode, "SDPA": c.sdpa}
        if args.mma:
            geometry = debug.decode_work_geometry(c.q, c.k, mma=not c.step.geometry.mma)
            step, out = bench.work_step(c.lens.tolist(), geometry), torch.empty_like(c.out)
            runs["ours, other instance"] = lambda: cuda.paged_decode_run(step, c.q, c.k, c.v, c.tables, c.lens, scale,
                                                                         out=out)
        if args.fp8:
            k8, v8 = fp8_views(c.k, c.v)
            step8, out8 = bench.work_step(c.lens.tolist(), cuda.decode_work_geometry(c.q, k8)), torch.empty_like(c.out)
            runs["ours, fp8"] = lambda: cuda.paged_decode_run(step8, c.q, k8, v8, c.tables, c.lens, scale, out=out8,
                                                              k_scale=FP8_SCALE, v_scale=FP8_SCALE)
        if args.sequential:
            in_order = torch.arange(c.tables.numel(), dtype=torch.int32, device="cuda").view_as(c.tables)
            out_s = torch.empty_like(c.out)
            runs["ours, sequential tables"] = lambda: cuda.paged_decode_run(c.step, c.q, c.k, c.v, in_order, c.lens,
                                                                            scale, out=out_s)
        for mode in args.flush.split(","):
            for name, fn in runs.items():
                r = traced(fn, mode)
                kernels = ", ".join(f"{short(n)} {d:.1f}" for n, d in r["kernels"].items())
                print(f"{batch} x {ctx} {mode} {name}: event {r['event']:.1f}  lead {r['lead']:.1f}  "
                      f"span {r['span']:.1f}  tail {r['tail']:.1f}  kernels: {kernels}", flush=True)
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
