"""Where a decode step of the workers' model goes: host wall time against GPU kernel time, and
the top kernels and host-side ops, for a batch of ragged contexts over the paged cache.

    python benchmarks/model_step.py --checkpoint DIR [--batch 110] [--context 1430] [--steps 5]
    python benchmarks/model_step.py --model 1b --launch-cost 32,64,128,256   # issue 13's launch target

Runs ``worker.model.Decoder.forward_paged`` in this process (no Ray, no manager) on one CUDA
device, in the checkpoint's dtype (bf16 by default), with random block tables; prints the step's
wall time, the sum of its GPU kernel times, their ratio (how launch-bound the step is) and its
HBM roofline (weights plus K/V bytes over a measured device copy ceiling). A tool for finding
what to fix; the serving figures come from benchmarks/serving.py.

``--launch-cost B1,B2,..`` measures instead, per batch size, a decode step's CPU launch cost against
its GPU time, the way the worker runs it (``DecodeGraphs.run``: host inputs, the work list planned
on the host, the uploads into the graph's buffers, one replay, the logits): with the GPU idle
first, the host time of that call (it returns without waiting for the device), of the same call
for a step whose tokens are all fed from the previous step's ids (serving's steady state: the
graph's own ids, passed back in place), of ``graph.replay()`` alone, and of the eager
``forward_paged`` launch for contrast, against the step's device time from CUDA events; then the
fed call's host time by phase. ``--model 1b`` / ``8b`` builds (once, under ``--workdir``) the
random checkpoint that benchmarks/serving.py uses.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import os
import random
import statistics
import time
import types

import numpy as np
import torch

from kvpager.numeric import ceil_div
from kvpager.step import StepInput
from kvpager.worker.decode_graphs import DecodeGraphs
from kvpager.worker.kv_cache import CacheSpec, KVCache
from kvpager.worker.model import Decoder, ModelConfig

# Launch-cost calls run untimed first, per batch size (2026-11-26 on an H100 host, with 3 of them:
# batch 32, measured first, cost more per fed call than batch 128 measured later, 0.30 vs 0.24 ms).
WARMUP = 10


def copy_ceiling(device: torch.device) -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write counted once each)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def random_step(cfg: ModelConfig, lens: list[int], width: int, block: int, tables_from: list[int],
                rng: random.Random) -> StepInput:
    """A decode step over ``lens`` with random tokens and tables drawn from ``tables_from``, the
    tables as the int32 array ``StepInput.from_step_reply`` gives the worker."""
    tables = []
    for n in lens:
        row = [tables_from.pop() for _ in range(ceil_div(n, block))]
        tables.append(row + [0] * (width - len(row)))
    step = StepInput(step_id=1, plan_step_id=0, token_ids=[rng.randrange(cfg.vocab_size) for _ in lens],
                     positions=[n - 1 for n in lens], slot_mapping=[t[(n - 1) // block] * block + (n - 1) % block
                                                                  for t, n in zip(tables, lens)],
                     query_lens=[1] * len(lens), context_lens=lens,
                     block_tables=np.asarray([b for t in tables for b in t], dtype="<i4"), max_blocks=width, greedy=True)
    return step


def launch_cost(model: Decoder, cfg: ModelConfig, batches: list[int], context: int, block: int, reps: int) -> None:
    """Per batch: host time of the graph step's launch call, of the replay alone and of the eager
    launch (each with the GPU idle before it), against the step's device time (CUDA events); and
    of the same step with every token fed from the previous step's ids (serving's steady state,
    the GPU idle before it too)."""
    from kvpager.kernels import cuda

    if not cuda.available():   # the graphs need our decode kernel
        raise SystemExit(cuda.load_error() or "the CUDA extension is not available")
    dev = torch.device("cuda")
    rng = random.Random(1)
    all_lens = {b: [rng.randint(context // 4, context * 7 // 4) for _ in range(b)] for b in batches}
    width = max(ceil_div(max(lens), block) for lens in all_lens.values())
    num_blocks = max(sum(ceil_div(n, block) for n in lens) for lens in all_lens.values()) + 1
    cache = KVCache(CacheSpec(cfg.num_layers, model.kv_heads, cfg.head_dim, block, cfg.cache_dtype), num_blocks, 1, dev)
    cache.blocks.normal_()
    graphs = DecodeGraphs(model, cache, max_batch=max(batches), max_blocks=width)
    captured = graphs.capture_all()
    print(f"launch cost of a decode step, {cfg.num_layers} layers, hidden {cfg.hidden_size}; {captured} graphs "
          f"captured; contexts uniform in [{context // 4}, {context * 7 // 4}]; p50 of {reps} steps, the GPU idle "
          "before each launch")
    hdr = (f"{'batch':>5} | {'GPU ms':>7} | {'graph launch ms':>15} {'% of GPU':>8} | {'fed launch ms':>13} "
           f"{'%':>5} | {'replay ms':>9} {'%':>5} | {'eager launch ms':>15} {'%':>5}")
    print(hdr)
    print("-" * len(hdr))
    fed_steps = {}
    for b in batches:
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        step = random_step(cfg, all_lens[b], width, block, free, rng)
        # The serving loop's steady state: every token taken from the previous step's ids (the
        # graph's own argmax where DecodeGraphs keeps it: the worker passes those back in place).
        previous = (graphs.last_ids(b) if hasattr(graphs, "last_ids")
                    else torch.randint(cfg.vocab_size, (b,), device=dev))
        rows = list(range(b))
        rng.shuffle(rows)
        fed = dataclasses.replace(step, feedback_rows=rows, feedback_step=1)
        fed_steps[b] = (fed, previous)
        graph_host, fed_host, replay_host, eager_host, device = [], [], [], [], []
        bucket = graphs.batch_buckets[bisect.bisect_left(graphs.batch_buckets, b)]
        graph = graphs._graphs[(bucket, graphs.max_blocks)]
        for _ in range(reps + WARMUP):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            graphs.run(step)
            graph_host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            device.append(start.elapsed_time(end) / 1e3)
            t0 = time.perf_counter()
            graphs.run(fed, previous)
            fed_host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            replay_host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.forward_paged(step, cache.layer)
            eager_host.append(time.perf_counter() - t0)
        gpu, launch, fed_launch, replay, eager = (statistics.median(x[WARMUP:]) * 1e3
                                                  for x in (device, graph_host, fed_host, replay_host, eager_host))
        print(f"{b:>5} | {gpu:7.2f} | {launch:15.3f} {100 * launch / gpu:7.1f}% | {fed_launch:13.3f} "
              f"{100 * fed_launch / gpu:4.1f}% | {replay:9.3f} {100 * replay / gpu:4.1f}% | "
              f"{eager:15.2f} {100 * eager / gpu:4.0f}%")
    # Where the graph launch's host time goes, at the last batch size (GPU idle before each call).
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(reps):
        torch.cuda.synchronize()
        prof.enable()
        graphs.run(fed, previous)
        prof.disable()
    torch.cuda.synchronize()
    print(f"\nhost profile of DecodeGraphs.run (fed) at batch {batches[-1]} ({reps} calls), by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    for b in sorted({min(batches), max(batches)}):
        launch_phases(graphs, model, *fed_steps[b], reps)


def launch_phases(graphs: DecodeGraphs, model: Decoder, step: StepInput, previous: torch.Tensor, reps: int) -> None:
    """Host time of ``graphs.run(step, previous)`` split by phase (the GPU idle before each call):
    the host planner, the pinned buffer's reservation, the replay, the logits, the rest (numpy
    fills and the copies' launches). Wraps those calls with timers for the measurement only."""
    spent: dict[str, float] = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return call

    planner, staging = getattr(graphs, "_planner", None), model.staging
    saved_replay = torch.cuda.CUDAGraph.replay
    stager = getattr(graphs, "_stager", None)   # (trees since the C++ stager: planner and launch inside it)
    if stager is not None:
        graphs._stager = types.SimpleNamespace(stage=timed("stager (fills, plan, copies, launch)", stager.stage))
    if planner is not None:
        planner.plan = timed("host planner", planner.plan)
    if hasattr(staging, "reserve"):
        staging.reserve = timed("pinned buffer", staging.reserve)
    staging.upload = timed("pinned buffer", staging.upload)
    model.logits = timed("logits (norm, lm_head)", model.logits)
    torch.cuda.CUDAGraph.replay = timed("replay", saved_replay)
    rows: dict[str, list[float]] = {}
    try:
        for _ in range(reps + WARMUP):
            torch.cuda.synchronize()
            spent.clear()
            t0 = time.perf_counter()
            graphs.run(step, previous)
            total = time.perf_counter() - t0
            spent["rest (fills, copies)"] = total - sum(spent.values())
            spent["total"] = total
            for name, value in spent.items():
                rows.setdefault(name, []).append(value)
    finally:
        torch.cuda.CUDAGraph.replay = saved_replay
        if stager is not None:
            graphs._stager = stager
        for obj, name in ((planner, "plan"), (staging, "reserve"), (staging, "upload"), (model, "logits")):
            if obj is not None and name in vars(obj):
                delattr(obj, name)
    print(f"\nDecodeGraphs.run (fed) at batch {step.num_seqs} by phase, the GPU idle before each call (p50 us):")
    for name, values in rows.items():
        print(f"  {name:<24} {statistics.median(values[WARMUP:]) * 1e6:8.1f}")
    import inspect

    alone = planner is not None and "out" in inspect.signature(planner.plan).parameters   # (not in older trees)
    if alone:   # the host planner alone: its Python wrapper, and the extension's call
        from kvpager.kernels import decode_plan
        from kvpager.kernels.extension import load

        geometry, lens = planner.geometry, np.asarray(step.context_lens, np.int32)
        out = np.empty(geometry.plan_size(len(lens)), np.int32)
        lens_t, out_t = torch.from_numpy(lens), torch.from_numpy(out)
        calls = {"DecodePlanner.plan": lambda: planner.plan(lens, out=out),
                 "extension call alone": lambda: load().plan_decode_work(lens_t, geometry.workers, geometry.longest_item,
                                                                         decode_plan.MIN_ITEM, getattr(geometry, "item_cost", decode_plan.ITEM_COST),
                                                                         out_t)}
        print(f"  host planner alone, {len(lens)} rows, {geometry.workers} workers (p50 of 200, us):")
        for name, call in calls.items():
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            print(f"    {name:<22} {statistics.median(times) * 1e6:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a checkpoint directory (or --model)")
    ap.add_argument("--model", choices=("1b", "8b"), help="the random checkpoint of benchmarks/serving.py")
    ap.add_argument("--workdir", default=os.environ.get("KVPAGER_BENCH_WORKDIR", "~/.cache/kvpager/serving-bench"),
                    help="where --model checkpoints are built (benchmarks/serving.py's default too)")
    ap.add_argument("--launch-cost", default="", help="comma-separated batch sizes: launch cost vs GPU time")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=110)
    ap.add_argument("--context", type=int, default=1430, help="mean context; lengths uniform in [context/4, 7/4]")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.model:
        from serving_common import ensure_checkpoint

        args.checkpoint = str(ensure_checkpoint(args, cuda=True))
    if not args.checkpoint:
        raise SystemExit("--checkpoint DIR or --model 1b|8b")
    dev = torch.device("cuda")
    cfg = ModelConfig.from_pretrained(args.checkpoint, dtype=args.dtype)
    model = Decoder(cfg, device=dev)
    if args.launch_cost:
        launch_cost(model, cfg, [int(b) for b in args.launch_cost.split(",")], args.context, args.block_size, args.steps)
        return
    rng = random.Random(0)
    lens = [rng.randint(args.context // 4, args.context * 7 // 4) for _ in range(args.batch)]
    B = args.block_size
    width = ceil_div(max(lens), B)
    num_blocks = sum(ceil_div(n, B) for n in lens) + 1
    cache = KVCache(CacheSpec(cfg.num_layers, model.kv_heads, cfg.head_dim, B, cfg.cache_dtype), num_blocks, 1, dev)
    cache.blocks.normal_()
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    step = random_step(cfg, lens, width, B, free, rng)
    for _ in range(3):
        model.forward_paged(step, cache.layer).argmax(-1).cpu()
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        model.forward_paged(step, cache.layer).argmax(-1).cpu()
        walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(args.steps):
            model.forward_paged(step, cache.layer).argmax(-1).cpu()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / args.steps
    weight_bytes = sum(t.numel() * t.element_size() for t in [model.embed, model.final_norm]
                       + [getattr(layer, f.name) for layer in model.layers for f in dataclasses.fields(layer)
                          if getattr(layer, f.name) is not None])
    if not cfg.tie_word_embeddings:
        weight_bytes += model.lm_head.numel() * model.lm_head.element_size()
    kv_bytes = sum(lens) * cache.spec.block_bytes // B
    ceiling = copy_ceiling(dev)
    roofline_ms = (weight_bytes + kv_bytes) / ceiling * 1e3
    wall_ms = sorted(walls)[len(walls) // 2] * 1e3
    print(f"model {args.checkpoint}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {args.dtype}; batch "
          f"{args.batch}, {sum(lens):,} context tokens")
    print(f"decode step wall p50 {wall_ms:.2f} ms; GPU kernel time {gpu_us / 1e3:.2f} ms "
          f"({gpu_us / 1e3 / wall_ms:.0%} of the wall); roofline {roofline_ms:.2f} ms "
          f"(weights {weight_bytes / 1e9:.2f} GB + K/V {kv_bytes / 1e9:.2f} GB at {ceiling / 1e9:.0f} GB/s): "
          f"wall at {roofline_ms / wall_ms:.0%} of roofline, kernels at {roofline_ms / (gpu_us / 1e3):.0%}")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))

    # The same step replayed from a CUDA graph (what the worker runs for decode steps).
    graphs = DecodeGraphs(model, cache, max_batch=max(args.batch, 1), max_blocks=width)
    eager = model.forward_paged(step, cache.layer)
    replayed = graphs.run(step)
    agree = (eager.argmax(-1) == replayed.argmax(-1)).float().mean().item()
    for _ in range(3):
        graphs.run(step).argmax(-1).cpu()
    graph_walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        graphs.run(step).argmax(-1).cpu()
        graph_walls.append(time.perf_counter() - t0)
    graph_ms = sorted(graph_walls)[len(graph_walls) // 2] * 1e3
    print(f"CUDA graph: decode step wall p50 {graph_ms:.2f} ms ({eager_ms_label(wall_ms, graph_ms)}), at "
          f"{roofline_ms / graph_ms:.0%} of roofline; capture {graphs.capture_seconds * 1e3:.0f} ms; greedy tokens "
          f"equal to the eager step's for {agree:.0%} of the rows")


def eager_ms_label(eager_ms: float, graph_ms: float) -> str:
    return f"{eager_ms / graph_ms:.2f}x faster than eager {eager_ms:.2f} ms"


if __name__ == "__main__":
    main()
