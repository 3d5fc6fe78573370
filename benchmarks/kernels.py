"""Decode-attention bandwidth of kvpager's CUDA kernel against the device copy ceiling and torch.

Configuration (the anchors' one, docs/../shared/PERFORMANCE-ANCHORS.md): bf16, 32 query heads,
8 KV heads, head dim 128, block 16, every sequence at the stated context, K/V read through one
layer's views of a 2-layer block-major cache (so the block stride is two layers' blocks) with
block tables shuffled by randperm.

Columns: our kernel's time (median of CUDA-event timings, L2 flushed by a 256 MiB write before
each run) and bandwidth = K+V bytes of the valid tokens / time, with its percent of the copy
ceiling (clone of a 2 GiB tensor, read+write bytes / time); torch SDPA (enable_gqa=True) over a
contiguous [batch, kv_heads, context, head_dim] cache of the same shape; and gather over the
block table then SDPA (the gather counted). Also the 32q/8kv over 8q/8kv time ratio at one shape
(K/V read once per group: near 1 means grouping works), copy_blocks bandwidth, and each config's
split count and max relative error against gather+SDPA.

Also (issue 4, second part): swaps of 1,024 scattered 2 MiB blocks (32 layers x 2 x 8 heads x 16 x
128 bf16) device<->pinned host in each mode of ``cuda.swap_blocks`` (copy-engine DMA per run,
one cudaMemcpyBatchAsync, zero-copy kernel over mapped host memory) and the reference's staged
path, against one contiguous pinned copy of the same bytes measured in the same run, plus the
swap overlapped with compute on another stream; write_kv bandwidth (64K tokens x 8 heads x 128
bf16 into random slots; bytes = K,V read + written); torch FlexAttention decode over the same
block tables; and prefill (kernels/prefill.py, gather + SDPA; and the reference's batched torch
prefill) against SDPA over contiguous K/V.

And (``--only fp8``) decode over an fp8 e4m3 cache on both of its kernel instances (FMA, tensor
cores; grid plans and work lists) against the kernel over the bf16 cache, and write_kv quantizing
into fp8; ``--only fp8_sweep`` the tensor-core instance's knobs (loads, L2 prefetch, splits).

And (``--only prefill_kernel``) our paged prefill kernel (kernels/csrc/paged_prefill.cuh; its
mma.sync instances with 4 and 8 warps and the wgmma one) on prompts, chunked prefill over cached
prefixes and ragged batches, against the fastest torch SDPA backend (flash, efficient, cuDNN;
GQA native or K/V expanded) over the same shapes laid out contiguously and against gather + SDPA
(kernels/prefill.py with the kernel off), ratios side by side.

And (``--only after_write``) a decode layer's attention as serving runs it: write_kv of the step's
new K/V then the work-list decode (its prologue under write_kv on Hopper), against copying the new
K/V into a contiguous cache then SDPA; each pair whole and each part alone, under both L2 flushes.

Build variants of the decode kernel (the knobs at the top of kernels/csrc/paged_decode.cuh),
each built in its own directory and timed in its own process, with ``--variants``:
     python benchmarks/kernels.py --variants "base=;rows8=-DKVPAGER_DECODE_ROWS=8"

And (``--only plan``, issue 12) a 32-layer decode step planned in every layer's call against
planned once per step (grid plan, work list): host and device time per step; ``--only
prefill_plan`` the same for prefill and mixed steps (``ops.plan_prefill`` once, then
``ops.paged_prefill_run`` per layer, against the one-shot call per layer).

Run: python benchmarks/kernels.py            (needs CUDA; builds the extension on first use)
     python benchmarks/kernels.py --only swap,write_kv,flex,prefill,copy   (a subset)
     python benchmarks/kernels.py --only prefill_kernel   (the prefill kernel against SDPA)
     python benchmarks/kernels.py --smoke    (one small call of every kernel, e.g. under compute-sanitizer)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpager.kernels import cuda, debug, reference
from kvpager.numeric import ceil_div

HQ, HKV, D, B, LAYERS = 32, 8, 128, 16, 2
DTYPE = torch.bfloat16
CONFIGS = [(1, 32768), (8, 4096), (32, 2048), (64, 4096), (128, 2048), (256, 1024), (32, 16384)]
PREFETCH_SWEEP = (0, 1, 2)
SPLIT_SWEEP = (1, 2, 3, 4, 6, 8, 12, 16, 32)
SPLIT_SWEEP_CONFIGS = {(8, 4096), (32, 2048), (64, 4096), (32, 16384)}

_flush = None
_flush_read = None
FLUSH_MODE = "write"   # --flush: how the L2 is emptied before each timed run (see flush_l2)


def flush_l2(mode: str | None = None) -> None:
    """Empties the L2 of the timed kernel's data. "write" (the default, and every table in
    docs/performance.md before 2026-11-25): a 256 MiB write, which leaves up to the whole L2 (50 MiB
    on an H100) holding dirty lines that the timed kernel's own reads must write back to DRAM.
    "clean": the same write, then a 256 MiB read of another buffer, so the L2 holds clean lines of
    unrelated data (as after a GEMM that read weights) and the kernel pays for its own bytes only.
    The dirty write-back weighs most on short kernels (about 50 MiB against the 134 MB of 8 x 4K).
    mode: "write" or "clean"; None: FLUSH_MODE (--flush)."""
    global _flush, _flush_read
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _flush.zero_()
    if (mode or FLUSH_MODE) == "clean":
        if _flush_read is None:
            _flush_read = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
        _flush_read.sum()


def warm_up(fn, seconds: float = 0.3) -> None:
    """Run fn back to back for a while before timing it. Short kernels timed on a GPU that was
    idle read low (8 x 4096 decode: ~59% of the ceiling on the first timings, ~66% once the GPU
    has been busy), so every decode config is timed after this."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()


def timed(fn, reps: int = 15, warmup: int = 2, flush: str | None = None) -> float:
    """Median seconds of fn over reps runs, L2 flushed before each (flush: flush_l2's mode)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush_l2(flush)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def kernel_time(fn, reps: int = 15, flush: str | None = None) -> float:
    """Median seconds of GPU kernel time per call of fn, from the kernels' own durations (CUPTI,
    through torch.profiler), the L2 flushed before each call as in timed(). CUDA events around a
    call also count the gaps between its kernels and any wait for the host to launch them; this
    counts only the kernels (fn's copies and memsets are left out, and so are the flush's kernels).
    Kernels that overlap (a programmatic dependent launch, such as the decode's merge) are each
    counted whole, so this suits calls whose kernels run one after another.
    Used to compare two implementations measured alternately (prefill_kernel): on 2026-11-26 the
    event-timed table read our prefill kernel 9-25% above its kernel duration, after the table's
    slower instances had run (the GPU at its power cap), while this agreed with Nsight Compute."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(prof):
        return [e for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))]

    with profile(activities=[ProfilerActivity.CUDA]) as flush_only:
        flush_l2(flush)
        torch.cuda.synchronize()
    flush_names = {e.name for e in kernels(flush_only)}
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush_l2(flush)
            fn()
        torch.cuda.synchronize()
    mine = sorted((e for e in kernels(prof) if e.name not in flush_names), key=lambda e: e.time_range.start)
    if not mine or len(mine) % reps:
        raise RuntimeError(f"{len(mine)} kernels over {reps} calls: not the same kernels every call")
    per_call = len(mine) // reps
    return statistics.median(sum(e.device_time for e in mine[i:i + per_call])
                             for i in range(0, len(mine), per_call)) / 1e6


def copy_ceiling() -> float:
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")   # 2 GiB
    x.random_()
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), reps=10)
    del x, y
    return 2 * (1 << 31) / t


def make_case(batch: int, ctx: int, hq: int = HQ, gen: torch.Generator | None = None):
    nblk = ctx // B
    num_blocks = batch * nblk
    cache = torch.randn(num_blocks, LAYERS, 2, HKV, B, D, dtype=DTYPE, device="cuda", generator=gen)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, nblk).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, D, dtype=DTYPE, device="cuda", generator=gen)
    return q, cache, tables, lens


@dataclass
class DecodeLayer:
    """One uniform decode shape for side-by-side timings: our paged layout (layer 0's views), the
    step's work list planned from its lengths, and the same K/V gathered into SDPA's contiguous
    layout; nbytes: the K/V bytes attention reads."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    out: torch.Tensor
    step: cuda.DecodePlan
    kc: torch.Tensor
    vc: torch.Tensor
    q4: torch.Tensor
    nbytes: int

    def decode(self) -> torch.Tensor:
        """Our work-list decode of the step (the serving path), into self.out."""
        return cuda.paged_decode_run(self.step, self.q, self.k, self.v, self.tables, self.lens, D ** -0.5, out=self.out)

    def sdpa(self) -> torch.Tensor:
        """torch SDPA over the contiguous copy of the same K/V."""
        return F.scaled_dot_product_attention(self.q4, self.kc, self.vc, scale=D ** -0.5, enable_gqa=True)


def decode_layer(batch: int, ctx: int, gen: torch.Generator) -> DecodeLayer:
    q, cache, tables, lens = make_case(batch, ctx, gen=gen)
    k, v = cache[:, 0, 0], cache[:, 0, 1]
    return DecodeLayer(q, k, v, tables, lens, torch.empty_like(q),
                       work_step(lens.tolist(), cuda.decode_work_geometry(q, k)),
                       gather(k, tables).contiguous(), gather(v, tables).contiguous(), q.view(batch, HQ, 1, D),
                       2 * batch * ctx * HKV * D * q.element_size())


def work_step(host_lens: list[int], geometry: cuda.DecodeGeometry) -> cuda.DecodePlan:
    """A decode step's work list planned from host lengths for ``geometry`` and uploaded, with its
    workspace, as the worker does (bf16 HQ query heads of head_dim D)."""
    return debug.decode_plan_on("cuda", cuda.plan_decode_work(host_lens, geometry), geometry, len(host_lens),
                                num_q_heads=HQ, head_dim=D)


def gather(cache_view: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    batch, nblk = tables.shape
    x = cache_view[tables.long()]                                   # [batch, nblk, HKV, B, D]
    return x.permute(0, 2, 1, 3, 4).reshape(batch, HKV, nblk * B, D)


def bench(ceiling: float) -> None:
    scale = D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, extra = [], []
    for batch, ctx in CONFIGS:
        q, cache, tables, lens = make_case(batch, ctx, gen=gen)
        k, v = cache[:, 0, 0], cache[:, 0, 1]
        nbytes = 2 * batch * ctx * HKV * D * q.element_size()
        out = torch.empty_like(q)
        plan = cuda.plan_decode_grid(q, k, v, tables, lens)     # once, as a step plans for all its layers
        splits, partition = plan.num_splits, plan.partition_tokens
        ours = lambda: cuda.paged_decode_grid_run(plan, q, k, v, tables, lens, scale, out=out)  # noqa: E731
        warm_up(ours)
        t_ours = timed(ours)
        t_again = timed(ours)
        sweep_pd = {}
        for pd in PREFETCH_SWEEP:
            sweep_pd[pd] = nbytes / timed(lambda: debug.paged_decode_attention(q, k, v, tables, lens, scale, out=out,
                                                                                prefetch_steps=pd))
        sweep_splits = {}
        if (batch, ctx) in SPLIT_SWEEP_CONFIGS:
            for n in SPLIT_SWEEP:
                got = debug.decode_plan(q, k, v, tables, lens, n)[0]
                if got == n:
                    sweep_splits[n] = nbytes / timed(
                        lambda: debug.paged_decode_attention(q, k, v, tables, lens, scale, n, out=out))

        q4 = q.view(batch, HQ, 1, D)

        def gathered():
            return F.scaled_dot_product_attention(q4, gather(k, tables), gather(v, tables), scale=scale,
                                                  enable_gqa=True)

        t_gather = timed(gathered, reps=7)
        ref = gathered().view(batch, HQ, D).float()
        err = float(((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
        kc, vc = gather(k, tables).contiguous(), gather(v, tables).contiguous()
        del cache, k, v
        warm_up(lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True))
        t_sdpa = timed(lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True))
        del kc, vc
        torch.cuda.empty_cache()
        rows.append((batch, ctx, splits, partition, t_ours, nbytes / t_ours, t_sdpa, nbytes / t_sdpa, t_gather,
                     nbytes / t_gather, err))
        extra.append((batch, ctx, t_again, sweep_pd, sweep_splits))

    print(f"\ncopy ceiling (2 GiB clone, read+write): {ceiling / 1e9:,.0f} GB/s")
    print("decode, bf16, 32 q heads / 8 kv heads, head dim 128, block 16; GB/s = K+V bytes of valid tokens / time")
    hdr = (f"{'batch x ctx':>12} {'splits':>6} {'ours us':>8} {'ours GB/s':>9} {'% ceil':>6} | {'sdpa us':>8} "
           f"{'GB/s':>6} {'%':>4} | {'gath+sdpa us':>12} {'GB/s':>6} {'%':>4} | {'max rel err':>11}")
    print(hdr)
    print("-" * len(hdr))
    for (batch, ctx, splits, partition, t1, b1, t2, b2, t3, b3, err) in rows:
        print(f"{batch:>5} x {ctx:<6} {splits:>6} {t1 * 1e6:>8.1f} {b1 / 1e9:>9,.0f} {100 * b1 / ceiling:>5.1f}% | "
              f"{t2 * 1e6:>8.1f} {b2 / 1e9:>6,.0f} {100 * b2 / ceiling:>3.0f}% | {t3 * 1e6:>12.1f} {b3 / 1e9:>6,.0f} "
              f"{100 * b3 / ceiling:>3.0f}% | {err:>11.2e}")
    print("\nours again (timing spread), L2-prefetch distance sweep (GB/s), forced split counts (GB/s):")
    for batch, ctx, t_again, sweep_pd, sweep_splits in extra:
        pd = "  ".join(f"pd{k}={v / 1e9:,.0f}" for k, v in sweep_pd.items())
        sp = "  ".join(f"s{k}={v / 1e9:,.0f}" for k, v in sweep_splits.items())
        print(f"{batch:>5} x {ctx:<6} again {t_again * 1e6:7.1f} us | {pd} | {sp}")


def bench_decode_quick(ceiling: float) -> None:
    """Our decode kernel alone at every config: the planner's pick (splits, loads in flight per
    lane), then every forced (loads, splits) pair, in GB/s."""
    scale = D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, ctx in CONFIGS:
        q, cache, tables, lens = make_case(batch, ctx, gen=gen)
        k, v = cache[:, 0, 0], cache[:, 0, 1]
        nbytes = 2 * batch * ctx * HKV * D * q.element_size()
        out = torch.empty_like(q)
        splits, _, _, loads = debug.decode_plan(q, k, v, tables, lens)
        warm_up(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        t = timed(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        print(f"{batch:>5} x {ctx:<6} planned loads {loads} splits {splits:>3}: {t * 1e6:7.1f} us "
              f"{nbytes / t / 1e9:6,.0f} GB/s {100 * nbytes / t / ceiling:5.1f}%")
        for forced_loads in (2, 4):
            sweep = {}
            for n in SPLIT_SWEEP + (64, 128):
                if debug.decode_plan(q, k, v, tables, lens, n, loads=forced_loads)[0] == n:
                    sweep[n] = nbytes / timed(lambda: debug.paged_decode_attention(
                        q, k, v, tables, lens, scale, n, loads=forced_loads, out=out), 7)
            best = max(sweep, key=sweep.get)
            print(f"{'':14} loads {forced_loads}: best s{best} {100 * sweep[best] / ceiling:5.1f}% | " +
                  " ".join(f"s{n}={100 * g / ceiling:.1f}" for n, g in sweep.items()))
        t = timed(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        print(f"{'':14} planned, timed again after the sweeps: {100 * nbytes / t / ceiling:5.1f}%")
        del q, cache, k, v
        torch.cuda.empty_cache()


RAGGED_CONFIGS = [("ragged", 128, 8192), ("ragged", 64, 32768), ("ragged", 256, 2048), ("ragged", 276, 2600),
                  ("uniform", 8, 4096), ("uniform", 1, 32768), ("uniform", 32, 2048), ("uniform", 64, 4096),
                  ("uniform", 128, 2048), ("uniform", 256, 1024), ("uniform", 32, 16384)]


PLAN_MIN_ITEMS = (128, 256, 1024)   # the planner's knobs swept by --only ragged and fp8_plan (tokens)
PLAN_ITEM_COSTS = (96, 192, 384)


def bench_ragged(ceiling: float) -> None:
    """Decode planned once per step from the real lengths (work list, kernels/decode_plan.py)
    against the per-call grid planned from the table's width, on ragged batches (lengths uniform
    in 1..max, table width = max) and uniform ones, with the host planning time and, for uniform
    batches, torch SDPA over a contiguous cache of the same shape."""
    scale = D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(1)
    print("\ndecode: work list planned from the lengths vs grid planned from the table width "
          "(bf16 32q/8kv d128 block 16; % of the copy ceiling)")
    hdr = (f"{'kind':>7} {'batch x max':>12} {'tokens':>8} | {'grid us':>8} {'%':>5} | {'list us':>8} {'%':>5} "
           f"{'items':>5} {'P':>5} | {'plan us':>7} | {'sdpa %':>6} | {'err':>8}")
    print(hdr)
    print("-" * len(hdr))
    for kind, batch, longest in RAGGED_CONFIGS:
        q, cache, tables, lens = make_case(batch, longest, gen=gen)
        if kind == "ragged":
            lens = torch.randint(1, longest + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
        k, v = cache[:, 0, 0], cache[:, 0, 1]
        host_lens = lens.tolist()
        tokens = sum(host_lens)
        nbytes = 2 * tokens * HKV * D * q.element_size()
        out_grid, out_list = torch.empty_like(q), torch.empty_like(q)
        geometry = cuda.decode_work_geometry(q, k)
        plan = cuda.plan_decode_work(host_lens, geometry)
        started = time.perf_counter()
        for _ in range(20):
            cuda.plan_decode_work(host_lens, geometry)
        plan_s = (time.perf_counter() - started) / 20
        step = debug.decode_plan_on("cuda", plan, geometry, batch, num_q_heads=HQ, head_dim=D)
        grid_plan = cuda.plan_decode_grid(q, k, v, tables, lens)

        def grid():
            return cuda.paged_decode_grid_run(grid_plan, q, k, v, tables, lens, scale, out=out_grid)

        def listed():
            return cuda.paged_decode_run(step, q, k, v, tables, lens, scale, out=out_list)

        warm_up(grid)
        warm_up(listed)
        t_grid, t_list = timed(grid), timed(listed)
        err = float(((out_list.float() - out_grid.float()).norm(dim=-1) / out_grid.float().norm(dim=-1)).max())
        sdpa = ""
        if kind == "uniform":
            kc, vc = gather(k, tables).contiguous(), gather(v, tables).contiguous()
            q4 = q.view(batch, HQ, 1, D)
            warm_up(lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True))
            t_sdpa = timed(lambda: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True))
            sdpa = f"{100 * nbytes / t_sdpa / ceiling:5.1f}%"
            del kc, vc
        print(f"{kind:>7} {batch:>5} x {longest:<6} {tokens:>8} | {t_grid * 1e6:8.1f} {100 * nbytes / t_grid / ceiling:5.1f} | "
              f"{t_list * 1e6:8.1f} {100 * nbytes / t_list / ceiling:5.1f} {int(plan[0]):>5} {int(plan[1]):>5} | "
              f"{plan_s * 1e6:7.1f} | {sdpa:>6} | {err:8.1e}")
        run = lambda swept: cuda.paged_decode_run(swept, q, k, v, tables, lens, scale, out=out_list)  # noqa: E731
        print(f"{'':29}planner knobs (min_item/item_cost=%): " +
              knob_sweep(step, host_lens, geometry, run, nbytes / ceiling, PLAN_MIN_ITEMS, PLAN_ITEM_COSTS))
        del q, cache, k, v
        torch.cuda.empty_cache()
    print(f"(work list: {geometry.workers} workers per KV head, kernel instance with {geometry.loads} loads)")


def knob_sweep(step: cuda.DecodePlan, host_lens: list[int], geometry: cuda.DecodeGeometry, run, ceiling_s: float,
               min_items, item_costs) -> str:
    """'m<min_item>/c<item_cost>=<% of the copy ceiling>' for the step's work list replanned with
    each pair of planner knobs, run(plan) timed; ceiling_s: the bytes read / the copy ceiling."""
    cells = []
    for min_item in min_items:
        for item_cost in item_costs:
            swept = debug.with_work(step, debug.plan_decode_work(host_lens, geometry, min_item=min_item,
                                                                 item_cost=item_cost))
            t = timed(lambda: run(swept), reps=9)
            cells.append(f"m{min_item}/c{item_cost}={100 * ceiling_s / t:.1f}")
    return " ".join(cells)


def bench_fp8_plan(ceiling: float) -> None:
    """The work-list planner's knobs (min_item, item_cost: tokens) over an fp8 e4m3 cache on the
    tensor-core instance, the planner's fp8 default, at the ragged and uniform shapes of
    ``--only ragged``: a token there is half a bf16 token's bytes, so an item's fixed cost is worth
    more tokens (decode_plan.ITEM_COST_FP8). % of the copy ceiling in fp8 bytes."""
    scale = D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(1)
    print("\nfp8 work lists (tensor cores), planner knobs min_item/item_cost (% of the copy ceiling, fp8 bytes):")
    for kind, batch, longest in RAGGED_CONFIGS:
        q, cache8, tables, lens = fp8_case(kind, batch, longest, gen)
        k8, v8 = cache8[:, 0, 0], cache8[:, 0, 1]
        host_lens = lens.tolist()
        nbytes = 2 * sum(host_lens) * HKV * D
        out = torch.empty_like(q)
        geometry = cuda.decode_work_geometry(q, k8)
        plan = cuda.plan_decode_work(host_lens, geometry)
        step = debug.decode_plan_on("cuda", plan, geometry, batch, num_q_heads=HQ, head_dim=D)
        run = lambda p: cuda.paged_decode_run(p, q, k8, v8, tables, lens, scale, out=out,  # noqa: E731
                                              k_scale=0.05, v_scale=0.05)
        warm_up(lambda: run(step), 0.2)
        t = timed(lambda: run(step))
        print(f"{kind:>7} {batch:>4} x {longest:<6} default ({int(plan[0])} items, P {int(plan[1])}, "
              f"{geometry.workers} workers) {100 * nbytes / t / ceiling:.1f}% | " +
              knob_sweep(step, host_lens, geometry, run, nbytes / ceiling, PLAN_MIN_ITEMS, PLAN_ITEM_COSTS),
              flush=True)
        del q, cache8, k8, v8
        torch.cuda.empty_cache()


FLUSH_CONFIGS = [(8, 4096), (1, 32768), (32, 2048), (64, 4096), (32, 16384)]


def bench_flush(ceiling: float) -> None:
    """Uniform decode shapes timed under both L2 flushes (see flush_l2), side by side in one run:
    our kernel (grid planned once; work list planned from the lengths) and torch SDPA over a
    contiguous cache, in % of the copy ceiling. Shows how much of the short kernels' time is the
    write-back of the dirty lines a write flush leaves in the L2."""
    scale = D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(2)
    print("\ndecode under a dirty (write) and a clean (write + read) L2 flush; % of the copy ceiling "
          "(bf16 32q/8kv d128 block 16)")
    hdr = f"{'batch x ctx':>12} | {'grid w':>7} {'grid c':>7} | {'list w':>7} {'list c':>7} | {'sdpa w':>7} {'sdpa c':>7}"
    print(hdr)
    print("-" * len(hdr))
    for batch, ctx in FLUSH_CONFIGS:
        c = decode_layer(batch, ctx, gen)
        grid_plan = cuda.plan_decode_grid(c.q, c.k, c.v, c.tables, c.lens)
        fns = {
            "grid": lambda: cuda.paged_decode_grid_run(grid_plan, c.q, c.k, c.v, c.tables, c.lens, scale, out=c.out),
            "list": c.decode,
            "sdpa": c.sdpa,
        }
        cells = []
        for fn in fns.values():
            warm_up(fn)
            cells += [f"{100 * c.nbytes / timed(fn, flush=mode) / ceiling:6.1f}%" for mode in ("write", "clean")]
        print(f"{batch:>5} x {ctx:<6} | {cells[0]} {cells[1]} | {cells[2]} {cells[3]} | {cells[4]} {cells[5]}")
        del c, grid_plan
        torch.cuda.empty_cache()


AFTER_WRITE_CONFIGS = [(8, 4096), (1, 32768), (32, 2048), (64, 4096)]


def bench_after_write(ceiling: float) -> None:
    """A decode layer's attention as serving runs it: the step's new K/V written first, then
    attention over the cache. Ours: write_kv into the pages, then the work-list decode (on Hopper a
    programmatic dependent of write_kv, pdl.cuh: its prologue, the work list, table slice and query,
    runs while write_kv still runs). SDPA: the new K/V copied into the contiguous cache, then SDPA.
    Each pair timed whole, and each part alone, under both L2 flushes; % of the copy ceiling in the
    attention's K/V bytes, the pair's time against them."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    print("\ndecode after the step's K/V write (bf16 32q/8kv d128 block 16), us and % of the copy ceiling:")
    hdr = (f"{'batch x ctx':>12} {'flush':>5} | {'write_kv':>8} {'decode':>14} {'both':>14} | {'append':>8} "
           f"{'SDPA':>14} {'both':>14} | {'SDPA both / ours both':>21}")
    print(hdr)
    print("-" * len(hdr))
    for batch, ctx in AFTER_WRITE_CONFIGS:
        c = decode_layer(batch, ctx, gen)
        key = torch.randn(batch, HKV, D, dtype=DTYPE, device="cuda", generator=gen)
        value = torch.randn(batch, HKV, D, dtype=DTYPE, device="cuda", generator=gen)
        last = ctx - 1   # the step's token: its K/V go to each sequence's last position
        slots = (c.tables[:, last // B].long() * B + last % B).contiguous()

        def write():
            cuda.write_kv(key, value, c.k, c.v, slots)

        def append():
            c.kc[:, :, last].copy_(key)
            c.vc[:, :, last].copy_(value)

        fns = {"write": write, "decode": c.decode, "ours": lambda: (write(), c.decode()),
               "append": append, "sdpa": c.sdpa, "theirs": lambda: (append(), c.sdpa())}
        for fn in fns.values():
            warm_up(fn)
        for mode in ("write", "clean"):
            t = {name: timed(fn, flush=mode) for name, fn in fns.items()}

            def cell(name):
                return f"{t[name] * 1e6:6.1f} ({100 * c.nbytes / t[name] / ceiling:4.1f}%)"
            print(f"{batch:>5} x {ctx:<6} {mode:>5} | {t['write'] * 1e6:8.1f} {cell('decode')} {cell('ours')} | "
                  f"{t['append'] * 1e6:8.1f} {cell('sdpa')} {cell('theirs')} | {t['theirs'] / t['ours']:21.2f}")
        del c
        torch.cuda.empty_cache()


SMALL_READ_MIB = [16, 32, 64, 128, 256, 512]


try:   # the loads-only read of bench_small_reads (the GPU image has Triton; elsewhere its column reads n/a)
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None:
    @triton.jit
    def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
        start = tl.program_id(0) * BLOCK * STEPS
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in tl.static_range(STEPS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            if EVICT_FIRST:
                acc ^= tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
            else:
                acc ^= tl.load(x_ptr + offs, mask=offs < n, other=0)
        tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))

    @triton.jit
    def _paged_read_kernel(k_ptr, v_ptr, table_ptr, out_ptr, blocks_per_seq, table_stride, block_stride, head_stride,
                           PAGES: tl.constexpr, PAGE: tl.constexpr, HEADS_FIRST: tl.constexpr):
        # Program (piece, head), or (head, piece) with HEADS_FIRST: XORs the K and V pages of PAGES
        # consecutive entries of one sequence's table row (head `head`'s PAGE words of each) into
        # one word it stores.
        pieces = blocks_per_seq // PAGES
        if HEADS_FIRST:
            piece, head = tl.program_id(1), tl.program_id(0)
        else:
            piece, head = tl.program_id(0), tl.program_id(1)
        seq, first = piece // pieces, (piece % pieces) * PAGES
        words = tl.arange(0, PAGE)
        acc = tl.zeros([PAGE], dtype=tl.int32)
        for i in tl.static_range(PAGES):
            block = tl.load(table_ptr + seq * table_stride + first + i).to(tl.int64)
            page = block * block_stride + head * head_stride + words
            acc ^= tl.load(k_ptr + page) ^ tl.load(v_ptr + page)
        tl.store(out_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.xor_sum(acc, 0))

    @triton.jit
    def _streamed_read_kernel(k_ptr, v_ptr, flat_ptr, out_ptr, n_blocks, units, block_stride, head_stride,
                              G: tl.constexpr, PAGES: tl.constexpr, PAGE: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
        # Persistent program (unit fast, as the decode's grid): worker `program_id // units` streams
        # its equal share of the step's table entries (whole PAGES-entry iterations), reading head
        # group `unit`'s G consecutive heads of PAGES blocks an iteration, XORed into one word.
        unit, worker = tl.program_id(0) % units, tl.program_id(0) // units
        workers = tl.num_programs(0) // units
        start = worker * (n_blocks // PAGES) // workers * PAGES
        end = (worker + 1) * (n_blocks // PAGES) // workers * PAGES
        words = tl.arange(0, G * PAGE)
        acc = tl.zeros([G * PAGE], dtype=tl.int32)
        for j in range(start, end, PAGES):
            for i in tl.static_range(PAGES):
                page = tl.load(flat_ptr + j + i).to(tl.int64) * block_stride + unit * G * head_stride + words
                if EVICT_FIRST:   # docs/performance.md, "Evict-first K/V loads, measured"
                    acc ^= tl.load(k_ptr + page, eviction_policy="evict_first") ^ tl.load(
                        v_ptr + page, eviction_policy="evict_first")
                else:
                    acc ^= tl.load(k_ptr + page) ^ tl.load(v_ptr + page)
        tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def paged_loads(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, pages: int = 8, heads_first: bool = True):
    """A loads-only read of every K and V page a decode over these block tables reads (k, v:
    [num_blocks, kv_heads, block_size, head_dim] 16-bit or fp8 views sharing strides; every row of
    ``tables`` read whole): the bar a paged decode's reads can reach, beside the same bytes read
    contiguously. Returns the launch as a function of no arguments (None without Triton)."""
    if triton is None:
        return None
    k32, v32 = k.view(torch.int32), v.view(torch.int32)
    batch, width = tables.shape
    if width % pages:
        raise ValueError(f"paged_loads reads {pages} pages a program: a table width of {width} is not a multiple")
    grid = (batch * width // pages, k.shape[1])[::-1 if heads_first else 1]
    words = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=k.device)
    page = k32.shape[2] * k32.shape[3]
    return lambda: _paged_read_kernel[grid](k32, v32, tables, words, width, tables.stride(0), k32.stride(0),
                                            k32.stride(1), PAGES=pages, PAGE=page, HEADS_FIRST=heads_first)


def streamed_loads(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, heads: int = 1, pages: int = 1,
                   programs_per_sm: int = 4, evict_first: bool = False):
    """A loads-only read of the same pages as ``paged_loads``, by persistent programs laid out as the
    decode's work list (programs_per_sm an SM, KV head groups fastest), each streaming an equal share
    of the step's table entries, ``pages`` blocks an iteration, ``heads`` heads of each block read
    together (``evict_first``: the K/V loads with Triton's evict-first policy). As a function of no
    arguments (None without Triton)."""
    if triton is None:
        return None
    k32, v32 = k.view(torch.int32), v.view(torch.int32)
    flat = tables.flatten().contiguous()
    if flat.numel() % pages or k32.shape[1] % heads:
        raise ValueError(f"streamed_loads: {flat.numel()} blocks, {k32.shape[1]} heads do not divide by "
                         f"{pages} pages and {heads} heads")
    units = k32.shape[1] // heads
    sms = torch.cuda.get_device_properties(k.device).multi_processor_count if k.is_cuda else 4   # (CPU: Triton's interpreter)
    grid = (max(1, sms * programs_per_sm // units) * units,)
    words = torch.empty(grid[0], dtype=torch.int32, device=k.device)
    return lambda: _streamed_read_kernel[grid](k32, v32, flat, words, flat.numel(), units, k32.stride(0), k32.stride(1),
                                               G=heads, PAGES=pages, PAGE=k32.shape[2] * k32.shape[3],
                                               EVICT_FIRST=evict_first)


def contiguous_loads(x: torch.Tensor, evict_first: bool = False):
    """The Triton loads-only read of contiguous ``x`` (its bytes a multiple of 64 KiB), each program
    XORing 64 KiB into one word (``evict_first``: loads with Triton's evict-first policy), as a
    function of no arguments (None without Triton)."""
    if triton is None:
        return None
    block, steps = 2048, 8   # int32 words per load and loads per program: 64 KiB a program
    x32 = x.view(-1).view(torch.int32)
    if x32.numel() % (block * steps):
        raise ValueError(f"contiguous_loads reads 64 KiB a program: {x32.numel() * 4} bytes is not a multiple")
    words = torch.empty(x32.numel() // (block * steps), dtype=torch.int32, device=x.device)
    return lambda: _read_kernel[(words.numel(),)](x32, words, x32.numel(), BLOCK=block, STEPS=steps,
                                                  EVICT_FIRST=evict_first)


def bench_small_reads(ceiling: float) -> None:
    """What plain reads and copies reach at the byte counts of the short decode shapes, in % of
    the 2 GiB copy ceiling, under both L2 flushes: the bar a decode kernel of the same bytes can
    reach (64 MiB is 1 x 32K or 8 x 4K of an fp8 cache, 128 MiB of a bf16 one). sum: torch's
    reduction (N read); loads: a Triton kernel that only loads, each program XORing its 64 KiB into
    one word it stores (N read); copy: N read + N written."""
    print("\nplain reads and copies of N MiB (us and % of the copy ceiling; sum and loads: N read, copy: N read + "
          "N written; w: write flush, c: clean):")
    print(f"{'MiB':>5} | {'sum w':>16} {'sum c':>16} | {'loads w':>16} {'loads c':>16} | {'copy w':>16} {'copy c':>16}")
    for mib in SMALL_READ_MIB:
        x = torch.randn(mib << 19, dtype=torch.bfloat16, device="cuda")   # 2 bytes each
        y = torch.empty_like(x)
        cells = []
        for fn, nbytes in ((lambda: x.sum(dtype=torch.float32), mib << 20),
                           (contiguous_loads(x), mib << 20),
                           (lambda: y.copy_(x), 2 * (mib << 20))):
            if fn is None:
                cells += ["n/a", "n/a"]
                continue
            try:   # the loads-only column is a guest: failing, it hides no other
                warm_up(fn, 0.1)
                for mode in ("write", "clean"):
                    t = timed(fn, flush=mode)
                    cells.append(f"{t * 1e6:8.1f} ({100 * nbytes / t / ceiling:4.1f}%)")
            except Exception as e:
                cells += [type(e).__name__[:16]] * (2 - len(cells) % 2)
        print(f"{mib:>5} | " + " | ".join(f"{cells[i]:>16} {cells[i + 1]:>16}" for i in (0, 2, 4)))
        del x, y


PLAN_ONCE_CONFIGS = [(8, 512), (32, 2048), (128, 2048)]


def bench_plan_once() -> None:
    """Issue 12 (plan once per step, run per layer): a decode step's attention over 32 layers
    (one layer's cache read 32 times) three ways: planned in every layer's call (the one-shot
    ``paged_decode_attention``: a grid plan and a workspace allocation per call), a grid plan made
    once for the step, and the step's work list planned once on the host (uploaded, as the worker
    does) with the planner's kept workspace. Host time per step (the launch path, no sync inside)
    and the step's device time (events, L2 flushed before each step)."""
    from kvpager.kernels import ops

    scale, layers = D ** -0.5, 32
    print(f"\ndecode planned per layer call vs once per step ({layers} layers; host us per step / device us per step):")
    for batch, ctx in PLAN_ONCE_CONFIGS:
        q, cache, tables, lens = make_case(batch, ctx)
        k, v = cache[:, 0, 0], cache[:, 0, 1]
        out = torch.empty_like(q)
        host_lens = lens.tolist()
        planner = ops.DecodePlanner(q, k)

        def per_call():
            for _ in range(layers):
                cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out)

        def grid_once():
            plan = cuda.plan_decode_grid(q, k, v, tables, lens)
            for _ in range(layers):
                cuda.paged_decode_grid_run(plan, q, k, v, tables, lens, scale, out=out)

        def list_once():
            work = torch.from_numpy(planner.plan(host_lens)).pin_memory().to("cuda", non_blocking=True)
            plan = planner.step_plan(work, batch)
            for _ in range(layers):
                cuda.paged_decode_run(plan, q, k, v, tables, lens, scale, out=out)

        cells = []
        for fn in (per_call, grid_once, list_once):
            warm_up(fn, 0.2)
            torch.cuda.synchronize()
            reps = 10
            started = time.perf_counter()
            for _ in range(reps):
                fn()
            host = (time.perf_counter() - started) / reps
            torch.cuda.synchronize()
            cells.append(f"{host * 1e6:8.1f} / {timed(fn, 9) * 1e6:8.1f}")
        print(f"{batch:>5} x {ctx:<6} per call {cells[0]} | grid once {cells[1]} | work list once {cells[2]}")
        del q, cache, k, v
        torch.cuda.empty_cache()


PREFILL_PLAN_STEPS = [   # (name, [(new tokens, context)] per sequence, prefill.use_kernel)
    ("mixed: 8 chunks 64-1K over 0-2K + 64 decodes (kernel)", None, None),
    ("small mixed: 2 x 128 over 1K + 32 decodes (kernel)", [(128, 1152)] * 2 + [(1, 1024)] * 32, None),
    ("4 x 512 prompts + 16 decodes (gather+SDPA)", [(512, 512)] * 4 + [(1, 2048)] * 16, None),
    ("8 distinct chunks + 64 decodes, kernel off (gather+SDPA)", None, False),
]


def bench_prefill_plan() -> None:
    """Issue 12 for prefill: a 32-layer prefill/mixed step's attention (one layer's cache read 32
    times) planned in every layer's call (the one-shot ``ops.paged_prefill_attention`` with the
    step's host lengths, as the model called it before) against planned once per step
    (``ops.plan_prefill``, then ``ops.paged_prefill_run`` per layer). The one-token rows run the
    step's decode work list in both (``ops.DecodePlanner``, as the worker does). Host time to
    issue the step (no sync inside) / device time of the step (events, L2 flushed), in us. On a
    tree without ``ops.plan_prefill`` (the code before) only the first column is measured."""
    from kvpager.kernels import ops, prefill

    scale, layers = D ** -0.5, 32
    gen = torch.Generator().manual_seed(5)
    news = [int(x) for x in torch.randint(64, 1024, (8,), generator=gen)]
    prefixes = [int(x) for x in torch.randint(0, 2048, (8,), generator=gen)]
    mixed = [(n, n + p) for n, p in zip(news, prefixes)] + [(1, int(x)) for x in torch.randint(256, 4096, (64,),
                                                                                              generator=gen)]
    once_available = hasattr(ops, "plan_prefill")
    print(f"\nprefill planned per layer call vs once per step ({layers} layers; host us per step / device us per step):")
    for name, seqs, kernel_mode in PREFILL_PLAN_STEPS:
        seqs = seqs or mixed
        q_lens, ctxs = [q for q, _ in seqs], [c for _, c in seqs]
        width = max(ceil_div(c, B) for c in ctxs)
        n_blocks = sum(ceil_div(c, B) for c in ctxs)
        cache = torch.randn(n_blocks, LAYERS, 2, HKV, B, D, dtype=DTYPE, device="cuda")
        k, v = cache[:, 0, 0], cache[:, 0, 1]
        tables = torch.randint(0, n_blocks, (len(ctxs), width), dtype=torch.int32, device="cuda")
        lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
        starts_l = [0]
        for q in q_lens:
            starts_l.append(starts_l[-1] + q)
        starts = torch.tensor(starts_l, dtype=torch.int32, device="cuda")
        query = torch.randn(starts_l[-1], HQ, D, dtype=DTYPE, device="cuda")
        host = (starts_l, ctxs)
        planner = ops.DecodePlanner(query, k)
        decode_lens = [c for q, c in seqs if q == 1]
        work = torch.from_numpy(planner.plan(decode_lens)).to("cuda")
        decode_plan = planner.step_plan(work, len(decode_lens))

        def decode(q, kc, vc, bt, cl, sc, k_scale=1.0, v_scale=1.0):
            return ops.paged_decode_run(decode_plan, q, kc, vc, bt, cl, sc, k_scale, v_scale)

        def per_call():
            for _ in range(layers):
                ops.paged_prefill_attention(query, k, v, tables, lens, starts, scale, host_lengths=host, decode=decode)

        def once():
            plan = ops.plan_prefill(query[:0], k, tables, lens, starts, scale, host_lengths=host,
                                    decode_plan=decode_plan)
            for _ in range(layers):
                ops.paged_prefill_run(plan, query, k, v)

        prefill.use_kernel = kernel_mode
        cells = []
        for fn in (per_call, once) if once_available else (per_call,):
            warm_up(fn, 0.3)
            torch.cuda.synchronize()
            reps = 10
            started = time.perf_counter()
            for _ in range(reps):
                fn()
            host_s = (time.perf_counter() - started) / reps
            torch.cuda.synchronize()
            cells.append(f"{host_s * 1e6:8.1f} / {timed(fn, 9) * 1e6:8.1f}")
        if once_available:
            a = ops.paged_prefill_attention(query, k, v, tables, lens, starts, scale, host_lengths=host, decode=decode)
            b = ops.paged_prefill_run(ops.plan_prefill(query[:0], k, tables, lens, starts, scale, host_lengths=host,
                                                       decode_plan=decode_plan), query, k, v)
            cells.append(f"equal {torch.equal(a, b)}")
        prefill.use_kernel = None
        print(f"{name:58} per call {cells[0]}" + (f" | once {cells[1]} | {cells[2]}" if once_available else ""))
        del cache, k, v, query
        torch.cuda.empty_cache()


SMALL_STEP_CONFIGS = [("uniform", 8, 512), ("uniform", 16, 1024), ("ragged", 32, 4096), ("ragged", 16, 16384)]


def bench_list_loads(ceiling: float) -> None:
    """The same work lists with each kernel instance (2 or 4 loads in flight per lane, so 66 or
    49 workers per KV head on an H100) beside the grid plan, at the ragged configs and a few
    small steps: whether small steps would want the 4-loads geometry."""
    scale = D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(1)
    print("\nwork list with 2 vs 4 loads in flight, and the grid (us, % of the copy ceiling):")
    probe = make_case(1, 16)
    print(f"(the planner's work lists take {cuda.decode_work_geometry(probe[0], probe[1][:, 0, 0]).loads} loads "
          "on this device)")
    del probe
    for kind, batch, longest in RAGGED_CONFIGS + SMALL_STEP_CONFIGS:
        q, cache, tables, lens = make_case(batch, longest, gen=gen)
        if kind == "ragged":
            lens = torch.randint(1, longest + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
        k, v = cache[:, 0, 0], cache[:, 0, 1]
        host_lens = lens.tolist()
        nbytes = 2 * sum(host_lens) * HKV * D * q.element_size()
        out = torch.empty_like(q)
        cells = []
        for loads in (2, 4):
            geometry = debug.decode_work_geometry(q, k, loads=loads)
            step = work_step(host_lens, geometry)
            fn = lambda: cuda.paged_decode_run(step, q, k, v, tables, lens, scale, out=out)  # noqa: E731
            warm_up(fn, 0.2)
            t = timed(fn)
            cells.append(f"loads {loads} ({geometry.workers} workers) {t * 1e6:8.1f} us {100 * nbytes / t / ceiling:5.1f}%")
        grid = cuda.plan_decode_grid(q, k, v, tables, lens)
        fn = lambda: cuda.paged_decode_grid_run(grid, q, k, v, tables, lens, scale, out=out)  # noqa: E731
        warm_up(fn, 0.2)
        t = timed(fn)
        print(f"{kind:>7} {batch:>4} x {longest:<6} | " + " | ".join(cells) +
              f" | grid (loads {grid.loads}, splits {grid.num_splits}) {t * 1e6:8.1f} us {100 * nbytes / t / ceiling:5.1f}%")
        del q, cache, k, v
        torch.cuda.empty_cache()


def quantize_in_chunks(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """``reference.quantize_fp8`` a few thousand blocks at a time (its float32 copy of a whole
    17 GB bf16 cache does not fit beside it)."""
    out = torch.empty(cache.shape, dtype=reference.FP8, device=cache.device)
    for i in range(0, cache.shape[0], 4096):
        out[i:i + 4096] = reference.quantize_fp8(cache[i:i + 4096], scale)
    return out


FP8_RAGGED = [("ragged", 128, 8192), ("ragged", 64, 32768), ("ragged", 256, 2048), ("ragged", 276, 2600)]


def fp8_case(kind: str, batch: int, ctx: int, gen: torch.Generator):
    """make_case's (q, cache, tables, lens) with the cache quantized to e4m3 (scale 0.05); "ragged":
    lengths uniform in 1..ctx."""
    q, cache, tables, lens = make_case(batch, ctx, gen=gen)
    if kind == "ragged":
        lens = torch.randint(1, ctx + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    cache8 = quantize_in_chunks(cache, 0.05)
    del cache
    return q, cache8, tables, lens


def bench_fp8(ceiling: float) -> None:
    """Decode over an fp8 e4m3 cache (bf16 query, per-tensor scales), side by side in one run: our
    kernel over the bf16 cache, over the fp8 cache on the FMA instance (kernels/debug.py mma=False,
    the only fp8 path before issue 13) and on the tensor-core instance (mma=True, the planner's
    default for head_dim 64/128); same shapes and block tables; GB/s and % of the copy ceiling count
    the fp8 bytes read. Grid plans (the planner's splits and loads for each instance), then work
    lists planned from the lengths (what serving runs) at the uniform and ragged shapes."""
    scale = D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("\nfp8 e4m3 KV cache (bf16 query) vs bf16 cache, our decode kernel, grid plans "
          "(% = fp8 bytes / time / copy ceiling):")
    hdr = (f"{'batch x ctx':>13} | {'bf16 us':>8} | {'fp8 FMA us':>10} {'%':>5} | {'fp8 MMA us':>10} {'%':>5} "
           f"{'GB/s':>6} | {'MMA/bf16':>8} {'MMA/FMA':>7} | plans (loads, splits) | err MMA vs FMA")
    print(hdr)
    print("-" * len(hdr))
    listed = []
    for kind, batch, ctx in [("uniform", b, c) for b, c in CONFIGS] + FP8_RAGGED:
        q, cache8, tables, lens = fp8_case(kind, batch, ctx, gen)
        k8, v8 = cache8[:, 0, 0], cache8[:, 0, 1]
        host_lens = lens.tolist()
        nbytes = 2 * sum(host_lens) * HKV * D              # one byte per element
        out = torch.empty_like(q)
        row = {}
        if kind == "uniform":
            bf = (cache8.to(DTYPE) * 0.05)                   # the same values, dequantized, as bf16
            k, v = bf[:, 0, 0], bf[:, 0, 1]
            plan_bf = cuda.plan_decode_grid(q, k, v, tables, lens)
            fn = lambda: cuda.paged_decode_grid_run(plan_bf, q, k, v, tables, lens, scale, out=out)  # noqa: E731
            warm_up(fn)
            row["bf16"] = timed(fn)
            del bf, k, v, plan_bf
            torch.cuda.empty_cache()
            outs = {}
            plans = {}
            for name, mma in (("fma", False), ("mma", True)):
                plan = debug.plan_decode_grid(q, k8, v8, tables, lens, mma=mma)
                plans[name] = f"{plan.loads},{plan.num_splits}"
                o = torch.empty_like(q)
                fn = lambda: cuda.paged_decode_grid_run(plan, q, k8, v8, tables, lens, scale, out=o,  # noqa: E731
                                                        k_scale=0.05, v_scale=0.05)
                warm_up(fn)
                row[name] = timed(fn)
                outs[name] = o
            err = float(((outs["mma"].float() - outs["fma"].float()).norm(dim=-1) /
                         outs["fma"].float().norm(dim=-1)).max())
            print(f"{batch:>5} x {ctx:<6} | {row['bf16'] * 1e6:8.1f} | {row['fma'] * 1e6:10.1f} "
                  f"{100 * nbytes / row['fma'] / ceiling:5.1f} | {row['mma'] * 1e6:10.1f} "
                  f"{100 * nbytes / row['mma'] / ceiling:5.1f} {nbytes / row['mma'] / 1e9:6,.0f} | "
                  f"{row['mma'] / row['bf16']:8.2f} {row['mma'] / row['fma']:7.2f} | FMA {plans['fma']:>5} "
                  f"MMA {plans['mma']:>5} | {err:.1e}")
        cells = []
        for name, mma in (("fma", False), ("mma", True)):
            geometry = debug.decode_work_geometry(q, k8, mma=mma)
            step = work_step(host_lens, geometry)
            fn = lambda: cuda.paged_decode_run(step, q, k8, v8, tables, lens, scale, out=out,  # noqa: E731
                                               k_scale=0.05, v_scale=0.05)
            warm_up(fn, 0.2)
            t = timed(fn)
            cells.append((name, geometry.workers, t))
        listed.append((kind, batch, ctx, nbytes, cells))
        del q, cache8, k8, v8
        torch.cuda.empty_cache()
    print("\nfp8 work lists planned from the lengths (what serving runs), FMA vs tensor cores:")
    for kind, batch, ctx, nbytes, cells in listed:
        (_, wf, tf), (_, wm, tm) = cells
        print(f"{kind:>7} {batch:>4} x {ctx:<6} | FMA ({wf} workers) {tf * 1e6:8.1f} us "
              f"{100 * nbytes / tf / ceiling:5.1f}% | MMA ({wm} workers) {tm * 1e6:8.1f} us "
              f"{100 * nbytes / tm / ceiling:5.1f}% | MMA/FMA {tm / tf:.2f}")
    tokens, blocks = 65536, 8192
    cache8 = torch.zeros(blocks, LAYERS, 2, HKV, B, D, dtype=reference.FP8, device="cuda")
    key = torch.randn(tokens, HKV, D, dtype=DTYPE, device="cuda")
    value = torch.randn(tokens, HKV, D, dtype=DTYPE, device="cuda")
    slots = torch.randperm(blocks * B, device="cuda")[:tokens]
    t = timed(lambda: cuda.write_kv(key, value, cache8[:, 1, 0], cache8[:, 1, 1], slots, 0.05, 0.05))
    moved = 2 * key.numel() * (2 + 1)                   # bf16 read, fp8 written, K and V
    print(f"write_kv into fp8 (quantizing): {tokens} tokens: {t * 1e6:.1f} us {moved / t / 1e9:,.0f} GB/s "
          f"({100 * moved / t / ceiling:.1f}% of the copy ceiling)")
    del cache8, key, value
    torch.cuda.empty_cache()


def bench_fp8_sweep(ceiling: float) -> None:
    """The tensor-core fp8 instance's knobs at the uniform shapes: 16 or 32 tokens a warp iteration
    (loads 2 / 4) x L2 prefetch distance 0-3 iterations, grid plans with the planner's splits for
    each; and work lists with each instance. % of the copy ceiling in fp8 bytes."""
    scale = D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("\nfp8 tensor-core instance: loads x prefetch distance (grid), loads (work list); % of the copy ceiling:")
    splits_sweep = {(1, 32768): (16, 32, 64, 128), (8, 4096): (2, 4, 8, 16), (32, 2048): (1, 2, 4)}
    for batch, ctx in CONFIGS:
        q, cache, tables, lens = make_case(batch, ctx, gen=gen)
        cache8 = quantize_in_chunks(cache, 0.05)
        del cache
        k8, v8 = cache8[:, 0, 0], cache8[:, 0, 1]
        nbytes = 2 * batch * ctx * HKV * D
        out = torch.empty_like(q)
        cells = []
        for loads in (2, 4):
            plan = debug.plan_decode_grid(q, k8, v8, tables, lens, loads=loads, mma=True)
            for pd in (0, 1, 2):
                fn = lambda: cuda._run_grid(plan, q, k8, v8, tables, lens, scale, out, 0.05, 0.05, pd)  # noqa: E731
                warm_up(fn, 0.1)
                cells.append(f"l{loads}s{plan.num_splits}p{pd}={100 * nbytes / timed(fn, reps=9) / ceiling:.1f}")
            geometry = debug.decode_work_geometry(q, k8, loads=loads, mma=True)
            step = work_step(lens.tolist(), geometry)
            fn = lambda: cuda.paged_decode_run(step, q, k8, v8, tables, lens, scale, out=out,  # noqa: E731
                                               k_scale=0.05, v_scale=0.05)
            warm_up(fn, 0.1)
            cells.append(f"list-l{loads}({geometry.workers})={100 * nbytes / timed(fn, reps=9) / ceiling:.1f}")
            for splits in splits_sweep.get((batch, ctx), ()):   # forced split counts, no prefetch
                forced = debug.plan_decode_grid(q, k8, v8, tables, lens, num_splits=splits, loads=loads, mma=True)
                fn = lambda: cuda._run_grid(forced, q, k8, v8, tables, lens, scale, out, 0.05, 0.05, 0)  # noqa: E731
                warm_up(fn, 0.1)
                cells.append(f"l{loads}s{forced.num_splits}={100 * nbytes / timed(fn, reps=9) / ceiling:.1f}")
        print(f"{batch:>5} x {ctx:<6} " + " ".join(cells))
        del q, cache8, k8, v8
        torch.cuda.empty_cache()


def run_variants(spec: str, parts: str = "quick", flush: str = "write", dtype: str = "bfloat16") -> None:
    """Build each ``name=nvcc flags`` variant (in parallel, separate build directories), then
    time each with ``--only PARTS`` (default: quick) in its own process, one after the other."""
    variants = [item.split("=", 1) for item in spec.split(";") if item.strip()]
    envs = {}
    for name, flags in variants:
        env = dict(os.environ, KVPAGER_EXT_CUDA_FLAGS=flags.strip(),
                   KVPAGER_EXT_DIR=os.path.join(tempfile.gettempdir(), f"kvpager_variant_{name.strip()}"))
        envs[name.strip()] = env
    build = "from kvpager.kernels import cuda; assert cuda.available(), cuda.load_error()"
    procs = {name: subprocess.Popen([sys.executable, "-c", build], env=env) for name, env in envs.items()}
    built = {name: p.wait() == 0 for name, p in procs.items()}
    for name, env in envs.items():
        print(f"\n=== variant {name}: {env['KVPAGER_EXT_CUDA_FLAGS'] or '(defaults)'}", flush=True)
        if built[name]:
            subprocess.run([sys.executable, __file__, "--only", parts, "--flush", flush, "--dtype", dtype], env=env,
                           check=False)
        else:
            print("build failed")


def gqa_ratio(batch: int = 64, ctx: int = 4096) -> None:
    scale = D ** -0.5
    times = {}
    for hq in (HQ, HKV):
        q, cache, tables, lens = make_case(batch, ctx, hq=hq)
        k, v = cache[:, 0, 0], cache[:, 0, 1]
        times[hq] = timed(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale))
        del q, cache, k, v
        torch.cuda.empty_cache()
    print(f"\nGQA: {batch} x {ctx}: 32q/8kv {times[HQ] * 1e6:.1f} us, 8q/8kv {times[HKV] * 1e6:.1f} us, "
          f"ratio {times[HQ] / times[HKV]:.3f}")


def bench_copy_blocks(ceiling: float) -> None:
    layers, pairs = 32, 1024
    cache = torch.randn(2 * pairs, layers, 2, HKV, B, D, dtype=DTYPE, device="cuda")
    perm = torch.randperm(2 * pairs, device="cuda")
    src, dst = perm[:pairs], perm[pairs:]
    block_bytes = cache[0].numel() * cache.element_size()
    t_ours = timed(lambda: cuda.copy_blocks(cache, src, dst))
    t_torch = timed(lambda: cache.index_copy_(0, dst, cache.index_select(0, src)))
    moved = 2 * pairs * block_bytes
    print(f"\ncopy_blocks: {pairs} pairs x {block_bytes >> 20} MiB blocks: ours {t_ours * 1e3:.2f} ms "
          f"{moved / t_ours / 1e9:,.0f} GB/s ({100 * moved / t_ours / ceiling:.0f}%), torch index_select+index_copy_ "
          f"{t_torch * 1e3:.2f} ms {moved / t_torch / 1e9:,.0f} GB/s")


SWAP_LAYERS, SWAP_MOVED = 32, 1024


def bench_swap() -> None:
    """Swap of SWAP_MOVED scattered 2 MiB blocks each way, every mode, against the pinned-copy ceiling."""
    shape = (SWAP_LAYERS, 2, HKV, B, D)
    gpu = torch.randn(2 * SWAP_MOVED, *shape, dtype=DTYPE, device="cuda")
    cpu = torch.empty(SWAP_MOVED, *shape, dtype=DTYPE).pin_memory()
    dev_stage = torch.empty(SWAP_MOVED, *shape, dtype=DTYPE, device="cuda")
    host_stage = torch.empty(SWAP_MOVED, *shape, dtype=DTYPE).pin_memory()
    nbytes = host_stage.numel() * host_stage.element_size()
    gen = torch.Generator().manual_seed(0)
    gpu_ids = torch.randperm(2 * SWAP_MOVED, generator=gen)[:SWAP_MOVED]
    cpu_ids = torch.randperm(SWAP_MOVED, generator=gen)
    reps = 5
    res = {}
    res["ceiling: one pinned copy"] = (timed(lambda: host_stage.copy_(dev_stage, non_blocking=True), reps),
                                       timed(lambda: dev_stage.copy_(host_stage, non_blocking=True), reps))
    side = torch.cuda.Stream()

    def on_side(fn):        # the batch API refuses the legacy default stream: time it on a side stream
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
        return run

    for mode in cuda.SWAP_MODES:
        try:
            out = timed(on_side(lambda: debug.swap_blocks(gpu, cpu, gpu_ids, cpu_ids, mode)), reps)
            back = timed(on_side(lambda: debug.swap_blocks(cpu, gpu, cpu_ids, gpu_ids, mode)), reps)
            res[f"ours, {mode}"] = (out, back)
        except Exception as exc:  # report and go on
            print(f"swap mode {mode} failed: {type(exc).__name__}: {exc}")
    # Correctness of what was timed: the last swap-in put cpu back where it came from.
    expect = gpu[gpu_ids.cuda()].cpu()
    cuda.swap_blocks(gpu, cpu, gpu_ids, cpu_ids)
    torch.cuda.synchronize()
    exact = torch.equal(cpu[cpu_ids], expect)
    res["reference (staged, host index_copy_)"] = (
        timed(lambda: reference.swap_blocks(gpu, cpu, gpu_ids, cpu_ids), 2, 1),
        timed(lambda: reference.swap_blocks(cpu, gpu, cpu_ids, gpu_ids), 2, 1))
    ceil_out, ceil_in = (nbytes / t for t in res["ceiling: one pinned copy"])
    print(f"\nswap: {SWAP_MOVED} scattered blocks of {nbytes // SWAP_MOVED >> 20} MiB ({nbytes / 2**30:.1f} GiB), "
          f"bf16; median of {reps}; ours exact: {exact}")
    print(f"{'path':40} {'GPU->CPU ms':>11} {'GB/s':>6} {'% ceil':>6} | {'CPU->GPU ms':>11} {'GB/s':>6} {'% ceil':>6}")
    for name, (t_out, t_in) in res.items():
        print(f"{name:40} {t_out * 1e3:>11.2f} {nbytes / t_out / 1e9:>6.1f} {100 * nbytes / t_out / ceil_out:>5.1f}% | "
              f"{t_in * 1e3:>11.2f} {nbytes / t_in / 1e9:>6.1f} {100 * nbytes / t_in / ceil_in:>5.1f}%")

    # Overlap: a compute load (bf16 matmuls) on the default stream with a swap-out on a side stream.
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")

    def compute():
        for _ in range(40):
            a @ a

    t_compute = timed(compute, 3)
    print(f"overlap: matmul load alone {t_compute * 1e3:.1f} ms; with a concurrent swap-out (side stream):")
    for mode in cuda.SWAP_MODES:
        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                debug.swap_blocks(gpu, cpu, gpu_ids, cpu_ids, mode)
            compute()
            torch.cuda.current_stream().wait_stream(side)
        try:
            t_both = timed(both, 3)
            print(f"  {mode:7} both {t_both * 1e3:7.1f} ms (swap alone {res[f'ours, {mode}'][0] * 1e3:.1f} ms, "
                  f"serial sum {(t_compute + res[f'ours, {mode}'][0]) * 1e3:.1f} ms)")
        except Exception as exc:
            print(f"  {mode} overlap failed: {type(exc).__name__}: {exc}")
    del gpu, cpu, dev_stage, host_stage, a
    torch.cuda.empty_cache()


def bench_write_kv(ceiling: float) -> None:
    tokens, blocks = 65536, 8192
    cache = torch.zeros(blocks, LAYERS, 2, HKV, B, D, dtype=DTYPE, device="cuda")
    k, v = cache[:, 1, 0], cache[:, 1, 1]
    key = torch.randn(tokens, HKV, D, dtype=DTYPE, device="cuda")
    value = torch.randn(tokens, HKV, D, dtype=DTYPE, device="cuda")
    slots = torch.randperm(blocks * B, device="cuda")[:tokens]
    moved = 4 * key.numel() * key.element_size()          # K and V, read and written
    t_ours = timed(lambda: cuda.write_kv(key, value, k, v, slots))
    t_ref = timed(lambda: reference.write_kv(key, value, k, v, slots))
    ok = torch.equal(k[slots // B, :, slots % B], key) and torch.equal(v[slots // B, :, slots % B], value)
    small = key[:256], value[:256], slots[:256]
    t_small = timed(lambda: cuda.write_kv(small[0], small[1], k, v, small[2]))
    print(f"\nwrite_kv: {tokens} tokens x {HKV} heads x {D} bf16 into random slots ({moved >> 20} MiB moved): "
          f"ours {t_ours * 1e6:.1f} us {moved / t_ours / 1e9:,.0f} GB/s ({100 * moved / t_ours / ceiling:.1f}% of "
          f"the copy ceiling), torch reference (index_put) {t_ref * 1e6:.1f} us {moved / t_ref / 1e9:,.0f} GB/s; "
          f"exact: {ok}; a decode step's 256 tokens: {t_small * 1e6:.1f} us")
    del cache, k, v, key, value
    torch.cuda.empty_cache()


FLEX_CONFIGS = CONFIGS


def bench_flex() -> None:
    """torch FlexAttention decode over the same paged K/V and block tables.

    FlexAttention takes K/V as [batch, heads, seq, dim] strided tensors, so it cannot address the
    block-major cache (a layer's token stride inside a block and its block stride do not combine
    into one seq stride). It runs over the same blocks laid out per layer ([1, kv_heads,
    num_blocks * block, dim], vLLM's layout, copied outside the timing) with the block tables as
    its BlockMask's kv indices (one block-mask column = one 16-token page, every page full):
    paged, gather-free, the way torch's PagedAttention helper maps logical to physical pages."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except Exception as exc:
        print(f"\nflex: not importable: {type(exc).__name__}: {exc}")
        return
    scale = D ** -0.5
    # One compiled graph per shape and mask: past dynamo's default recompile limit flex falls
    # back to eager, which materializes the scores (and runs out of memory at large batches).
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    flex = torch.compile(flex_attention, dynamic=False)
    print(f"\nFlexAttention decode (torch {torch.__version__}, compiled), same shapes and block tables:")
    for batch, ctx in FLEX_CONFIGS:
        q, cache, tables, lens = make_case(batch, ctx)
        k, v = cache[:, 0, 0], cache[:, 0, 1]
        nblocks = cache.shape[0]
        out = torch.empty_like(q)
        warm_up(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        t_ours = timed(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        kp = k.permute(1, 0, 2, 3).reshape(1, HKV, nblocks * B, D)
        vp = v.permute(1, 0, 2, 3).reshape(1, HKV, nblocks * B, D)
        del cache, k, v
        nblk = ctx // B
        i32 = dict(dtype=torch.int32, device="cuda")
        # kv_indices rows are as wide as the physical cache (nblocks columns, zero-padded): the
        # mask's dense forms index columns by physical page id (as PagedAttention does).
        full_idx = torch.zeros(batch, 1, 1, nblocks, **i32)
        full_idx[:, 0, 0, :nblk] = tables
        mask = BlockMask.from_kv_blocks(torch.zeros(batch, 1, 1, **i32), torch.zeros(batch, 1, 1, nblocks, **i32),
                                        torch.full((batch, 1, 1), nblk, **i32), full_idx,
                                        BLOCK_SIZE=(128, B), mask_mod=None, seq_lengths=(1, nblocks * B),
                                        compute_q_blocks=False)
        q4 = q.view(batch, HQ, 1, D)
        nbytes = 2 * batch * ctx * HKV * D * q.element_size()
        done = False
        for opts in (None, {"BLOCK_N": B}, {"BLOCK_N": B, "FORCE_USE_FLEX_ATTENTION": True}):
            try:
                t0 = time.perf_counter()
                res = flex(q4, kp, vp, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=opts)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                warm_up(lambda: flex(q4, kp, vp, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=opts))
                t_flex = timed(lambda: flex(q4, kp, vp, block_mask=mask, scale=scale, enable_gqa=True,
                                            kernel_options=opts))
                ref = out.float()
                err = float(((res.view(batch, HQ, D).float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
                print(f"{batch:>5} x {ctx:<6} ours {t_ours * 1e6:8.1f} us {nbytes / t_ours / 1e9:6,.0f} GB/s | flex "
                      f"{t_flex * 1e6:8.1f} us {nbytes / t_flex / 1e9:6,.0f} GB/s (kernel_options={opts}, first call "
                      f"{compile_s:.1f} s) | flex/ours time {t_flex / t_ours:.2f}x | max rel diff {err:.2e}")
                done = True
                break
            except Exception as exc:
                msg = str(exc).strip().splitlines()
                print(f"{batch:>5} x {ctx:<6} flex with kernel_options={opts} failed: {type(exc).__name__}: "
                      f"{msg[0][:300] if msg else ''}")
        if not done:
            print(f"{batch:>5} x {ctx:<6} ours {t_ours * 1e6:8.1f} us; flex did not run")
        # For scale: flex without paging, over contiguous per-sequence K/V (no block mask).
        kc = kp.view(HKV, -1, B, D)[:, tables.long()].permute(1, 0, 2, 3, 4).reshape(batch, HKV, ctx, D)
        vc = vp.view(HKV, -1, B, D)[:, tables.long()].permute(1, 0, 2, 3, 4).reshape(batch, HKV, ctx, D)
        try:
            flex(q4, kc, vc, scale=scale, enable_gqa=True)
            t_c = timed(lambda: flex(q4, kc, vc, scale=scale, enable_gqa=True))
            print(f"{'':14} flex over contiguous K/V (not paged): {t_c * 1e6:8.1f} us {nbytes / t_c / 1e9:6,.0f} GB/s")
        except Exception as exc:
            print(f"{'':14} flex over contiguous K/V failed: {type(exc).__name__}: {str(exc)[:200]}")
        del kc, vc
        del q, kp, vp, mask
        torch.cuda.empty_cache()


def bench_prefill() -> None:
    """The worker's prefill on CUDA (kernels/prefill.py: our prefill kernel where it pays, else
    gather + SDPA per (query, context) shape) and the reference's batched torch prefill, against
    SDPA over contiguous K/V."""
    from torch.nn.attention.bias import causal_lower_right

    from kvpager.kernels import ops

    seqs, new, prefix = 8, 512, 1024
    ctx = new + prefix
    scale = D ** -0.5
    q, cache, tables, _ = make_case(seqs, ctx)
    k, v = cache[:, 0, 0], cache[:, 0, 1]
    query = torch.randn(seqs * new, HQ, D, dtype=DTYPE, device="cuda")
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device="cuda")
    t_ref = timed(lambda: reference.paged_prefill_attention(query, k, v, tables, lens, starts, scale), 5)
    host = ([i * new for i in range(seqs + 1)], [ctx] * seqs)      # the worker passes its lengths (no sync)
    t_ours = timed(lambda: ops.paged_prefill_attention(query, k, v, tables, lens, starts, scale, host_lengths=host))
    t_sync = timed(lambda: ops.paged_prefill_attention(query, k, v, tables, lens, starts, scale))
    out_ours = ops.paged_prefill_attention(query, k, v, tables, lens, starts, scale)
    kc = gather(k, tables).contiguous()   # [seqs, HKV, ctx, D]
    vc = gather(v, tables).contiguous()
    q4 = query.view(seqs, new, HQ, D).transpose(1, 2)
    bias = causal_lower_right(new, ctx)
    sdpa = lambda: F.scaled_dot_product_attention(q4, kc, vc, attn_mask=bias, scale=scale,  # noqa: E731
                                                  enable_gqa=True)
    t_sdpa = timed(sdpa)
    out_sdpa = sdpa().transpose(1, 2).reshape_as(query)
    err = float(((out_ours.float() - out_sdpa.float()).norm(dim=-1) / out_sdpa.float().norm(dim=-1)).max())
    flops = 4 * seqs * HQ * D * (new * prefix + new * (new + 1) / 2)
    print(f"\nprefill: {seqs} prompts x {new} new tokens over a {prefix}-token cached prefix (bf16, 32q/8kv, d128):")
    for name, t in (("ours (kernels/prefill.py: kernel or gather+SDPA)", t_ours),
                    ("ours, lengths read from the device (a sync)", t_sync), ("reference (batched torch, fp32)", t_ref),
                    ("SDPA, contiguous K/V, lower-right causal", t_sdpa)):
        print(f"  {name:42} {t * 1e3:7.3f} ms {flops / t / 1e12:6.0f} TFLOP/s  {t / t_sdpa:5.2f}x SDPA")
    print(f"  ours vs SDPA max rel diff {err:.2e}")
    # A mixed step: 8 prompts of different lengths over different cached prefixes, plus 64 decodes.
    gen = torch.Generator().manual_seed(5)
    news = [int(x) for x in torch.randint(64, 1024, (8,), generator=gen)]
    prefixes = [int(x) for x in torch.randint(0, 2048, (8,), generator=gen)]
    q_lens = news + [1] * 64
    ctxs = [n + p for n, p in zip(news, prefixes)] + [int(x) for x in torch.randint(256, 4096, (64,), generator=gen)]
    width = max(ceil_div(c, B) for c in ctxs)
    n_blocks = cache.shape[0]
    tables = torch.randint(0, n_blocks, (len(ctxs), width), dtype=torch.int32, device="cuda")
    lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    starts = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), HQ, D, dtype=DTYPE, device="cuda")
    host = (starts.tolist(), ctxs)
    t_mixed = timed(lambda: ops.paged_prefill_attention(query, k, v, tables, lens, starts, scale, host_lengths=host))
    flops = sum(4 * HQ * D * (n * (c - n) + n * (n + 1) / 2) for n, c in zip(q_lens, ctxs))
    print(f"  mixed step (8 prompts of 64-1023 new tokens over 0-2047 cached, + 64 decodes of 256-4095): "
          f"ours {t_mixed * 1e3:.3f} ms ({flops / t_mixed / 1e12:.0f} TFLOP/s)")
    del cache, k, v, kc, vc
    torch.cuda.empty_cache()


PREFILL_SHAPES = [   # (name, [(new tokens, context)] per sequence)
    ("1 x 4K prompt", [(4096, 4096)]),
    ("8 x 2K prompts", [(2048, 2048)] * 8),
    ("32 x 512 prompts", [(512, 512)] * 32),
    ("8 x 512 over 1K cached", [(512, 1536)] * 8),
    ("4 x 1K over 7K cached", [(1024, 8192)] * 4),
]


def _ragged_prefill_shapes():
    gen = torch.Generator().manual_seed(13)
    news = [int(x) for x in torch.randint(64, 2048, (8,), generator=gen)]
    prefixes = [int(x) for x in torch.randint(0, 4096, (8,), generator=gen)]
    mix = [(n, n + p) for n, p in zip(news, prefixes)]
    prompts = [(n, n) for n in (int(x) for x in torch.randint(16, 1024, (24,), generator=gen))]
    return [("ragged: 8 chunks 64-2K over 0-4K", mix), ("ragged: 24 prompts 16-1K", prompts)]


def _fastest_sdpa(q4s, ks, vs, masks, scale, measure=timed):
    """The fastest torch SDPA backend on contiguous K/V: per (backend, GQA native or K/V
    expanded to the query heads), the time of running every group once (``measure``: event
    times, or kernel_time for the comparisons by turns, so that the backend they take is the
    fastest by the measure they report); returns (name, seconds, runner) of the fastest, or None,
    and every backend's time."""
    from torch.nn.attention import SDPBackend

    best = None
    results = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for expand in (False, True):
            run = sdpa_runner(q4s, ks, vs, masks, scale, backend, expand)
            name = f"{backend.name.split('_')[0].lower()}{'+expand' if expand else ''}"
            try:
                warnings.simplefilter("ignore")     # refusals are reported below, once
                run()
                torch.cuda.synchronize()
                t = measure(run)
            except Exception as exc:   # backend refuses these inputs
                results[name] = f"n/a ({type(exc).__name__})"
                continue
            results[name] = f"{t * 1e3:.3f}"
            if best is None or t < best[1]:
                best = (name, t, run)
            del run
    return best, results


def sdpa_runner(q4s, ks, vs, masks, scale, backend, expand: bool):
    """A call of torch SDPA on `backend` over every group of a contiguous layout
    (contiguous_prefill's); expand: K/V repeated to the query heads instead of GQA."""
    from torch.nn.attention import sdpa_kernel

    if expand:
        ks = [k.repeat_interleave(HQ // HKV, dim=1) for k in ks]
        vs = [v.repeat_interleave(HQ // HKV, dim=1) for v in vs]

    def run():
        with sdpa_kernel([backend]):
            for q4, k, v, (mask, causal) in zip(q4s, ks, vs, masks):
                F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=not expand)
    return run


@dataclass
class PrefillCase:
    """One prefill shape laid out as the kernel reads it: K/V in a LAYERS-layer block-major cache
    behind randperm'd tables (layer 0's views), the queries, and the lengths on both sides."""
    cache: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    query: torch.Tensor
    lens: torch.Tensor           # context lengths, int32, on the device
    starts: torch.Tensor         # query CSR offsets, int32, on the device
    host: tuple[list[int], list[int]]   # (query starts, context lengths) as host ints


def prefill_case(seqs, gen: torch.Generator) -> PrefillCase:
    """seqs: (new tokens, context) per sequence; random data from ``gen`` (a CUDA generator)."""
    nblk = [ceil_div(c, B) for _, c in seqs]
    total = sum(nblk)
    cache = torch.randn(total, LAYERS, 2, HKV, B, D, dtype=DTYPE, device="cuda", generator=gen)
    perm = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    tables = torch.zeros(len(seqs), max(nblk), dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[at:at + n]
        at += n
    ctxs = [c for _, c in seqs]
    starts = [0]
    for q, _ in seqs:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], HQ, D, dtype=DTYPE, device="cuda", generator=gen)
    return PrefillCase(cache, cache[:, 0, 0], cache[:, 0, 1], tables, query,
                       torch.tensor(ctxs, dtype=torch.int32, device="cuda"),
                       torch.tensor(starts, dtype=torch.int32, device="cuda"), (starts, ctxs))


def contiguous_prefill(case: PrefillCase, seqs):
    """The case laid out for SDPA, one group per distinct (new tokens, context): the queries
    [n, HQ, q, D], K and V [n, HKV, c, D] gathered from the pages, and (mask, is_causal)."""
    from torch.nn.attention.bias import causal_lower_right

    groups: dict = {}
    for i, s in enumerate(seqs):
        groups.setdefault(s, []).append(i)
    starts = case.host[0]
    q4s, ks, vs, masks = [], [], [], []
    for (q, c), ids in groups.items():
        idx = torch.tensor(ids, device="cuda")
        ks.append(gather(case.k, case.tables[idx, :ceil_div(c, B)]).contiguous()[:, :, :c].contiguous())
        vs.append(gather(case.v, case.tables[idx, :ceil_div(c, B)]).contiguous()[:, :, :c].contiguous())
        sel = torch.cat([torch.arange(starts[i], starts[i] + q, device="cuda") for i in ids])
        q4s.append(case.query[sel].view(len(ids), q, HQ, D).transpose(1, 2).contiguous())
        masks.append((None, True) if q == c else (causal_lower_right(q, c), False))
    return q4s, ks, vs, masks


def bench_prefill_kernel() -> None:
    """Our paged prefill kernel against the fastest torch SDPA backend over the same shapes laid
    out contiguously, and against gather + SDPA (kernels/prefill.py without the kernel). The
    columns are CUDA-event times; the line under each shape gives ours (plan once, dynamic) and
    the fastest SDPA backend by kernel time (kernel_time), taken by turns: the comparison that
    holds when the GPU's clock moves under its power cap (docs/performance.md, eighth session)."""
    from kvpager.kernels import prefill

    scale = D ** -0.5
    print(f"\nprefill kernel (bf16, {HQ}q/{HKV}kv, d{D}, block {B}; K/V in a {LAYERS}-layer block-major cache, "
          "randperm'd tables; L2 flushed; median of 15):")
    # (warps, wgmma, schedule): mma.sync 4 and 8 warps, the wgmma instance (on Hopper the
    # warp-specialized kernel) with the static and the dynamic schedule (cuda.prefill_schedule),
    # each run from a plan made once, as a model's layers run a step's plan; and "dyn+plan": the
    # dynamic schedule planned in every call (the host's planning and upload inside the timing:
    # how this table was timed up to 2026-11-26, fifth session)
    instances = [(4, False, "static"), (8, False, "static"), (8, True, "static"), (8, True, "dynamic")]
    print(f"wgmma instances built: {cuda.has_wgmma(torch.device('cuda'))}")
    print(f"{'shape':34} {'mma4':>7} {'mma8':>7} {'wgmma8':>7} {'dynamic':>7} {'dyn+plan':>8} {'TFLOP/s':>8} "
          f"{'SDPA best ms':>16} {'gather+SDPA':>11} {'SDPA/ours':>9} {'g+S/ours':>8} {'err':>8}")
    table = []
    for name, seqs in PREFILL_SHAPES + _ragged_prefill_shapes():
        case = prefill_case(seqs, torch.Generator(device="cuda").manual_seed(len(seqs)))
        cache, k, v, tables, query, lens, starts, host = (case.cache, case.k, case.v, case.tables, case.query,
                                                          case.lens, case.starts, case.host)
        flops = sum(4 * HQ * D * (q * (c - q) + q * (q + 1) / 2) for q, c in seqs)

        def ours(w, wg, schedule):
            plan = debug.plan_prefill(query, k, host, warps=w, wgmma=wg, schedule=schedule)
            return lambda: cuda.paged_prefill_run(plan, query, k, v, tables, lens, starts, scale)

        times = {}
        outs = {}
        for inst in instances:
            fn = ours(*inst)
            warm_up(fn, 0.2)
            times[inst] = timed(fn)
            outs[inst] = fn()
        planned_each_call = lambda: debug.paged_prefill_attention(  # noqa: E731
            query, k, v, tables, lens, starts, scale, host_lengths=host, warps=8, wgmma=True, schedule="dynamic")
        warm_up(planned_each_call, 0.2)
        t_planned = timed(planned_each_call)
        prefill.use_kernel = False
        gs = lambda: prefill.paged_prefill_attention(query, k, v, tables, lens, starts, scale,  # noqa: E731
                                                     host_lengths=host)
        warm_up(gs, 0.2)
        t_gs = timed(gs)
        ref_out = gs()
        prefill.use_kernel = None
        err = max(float((out.float() - ref_out.float()).norm() / ref_out.float().norm()) for out in outs.values())
        q4s, ks, vs, masks = contiguous_prefill(case, seqs)
        best, results = _fastest_sdpa(q4s, ks, vs, masks, scale)
        t_ours = min(times.values())
        t_best = best[1] if best else float("nan")
        table.append((name, times, flops / t_ours / 1e12, best, t_gs, t_best / t_ours, t_gs / t_ours, err, results))
        print(f"{name:34} " + " ".join(f"{times[i] * 1e3:7.3f}" for i in instances) + f" {t_planned * 1e3:8.3f}"
              f" {flops / t_ours / 1e12:8.0f} "
              f"{(best[0] + ' ' + format(best[1] * 1e3, '.3f')) if best else 'n/a':>16} {t_gs * 1e3:11.3f} "
              f"{t_best / t_ours:9.2f} {t_gs / t_ours:8.2f} {err:8.1e}")
        print(f"{'':34} SDPA backends (ms, every group once): {results}")
        best, _ = _fastest_sdpa(q4s, ks, vs, masks, scale, measure=kernel_time)   # by the turns' own measure
        if best:   # the kernels alone, ours (the serving path: plan once, dynamic) and SDPA's by turns
            serving = ours(8, True, "dynamic")
            pairs = [(kernel_time(serving), kernel_time(best[2])) for _ in range(3)]
            k_ours, k_sdpa = [p[0] for p in pairs], [p[1] for p in pairs]
            ratios = [b / a for a, b in pairs]
            print(f"{'':34} kernel time, alternately (ms): ours {min(k_ours) * 1e3:.3f}-{max(k_ours) * 1e3:.3f}, "
                  f"{best[0]} {min(k_sdpa) * 1e3:.3f}-{max(k_sdpa) * 1e3:.3f}; SDPA / ours "
                  f"{min(ratios):.2f}-{max(ratios):.2f}")
        del cache, k, v, ks, vs, q4s, best
        torch.cuda.empty_cache()


def bench_prefill_fp8() -> None:
    """Our prefill kernel over an fp8 (e4m3) cache against the same kernel over the bf16 cache it
    came from, against the fastest torch SDPA backend on the bf16 K/V laid out contiguously, and
    against gather + SDPA from the fp8 cache (kernels/prefill.py without the kernel: K/V gathered
    and dequantized). The shapes of --only prefill_kernel; our plans made once; on Hopper both
    caches run the warp-specialized kernel (built with -DKVPAGER_PREFILL_WS_FP8=0, the fp8 cache
    runs the two-warpgroup one). Event times (median of 15), then the kernel times of ours (fp8,
    bf16) and SDPA's taken by turns, three times each (kernel_time)."""
    from kvpager.kernels import prefill
    from kvpager.kernels.reference import FP8

    scale = D ** -0.5
    w = "fp16" if DTYPE == torch.float16 else "bf16"   # the queries' and the 16-bit cache's dtype
    print(f"\nprefill over an fp8 cache ({DTYPE} queries, {HQ}q/{HKV}kv, d{D}, block {B}; L2 flushed; median of 15; "
          "k_scale = v_scale = 4):")
    print(f"{'shape':34} {w + ' cache ms':>13} {'fp8 cache ms':>12} {'fp8 / ' + w:>10} {'g+S fp8 ms':>10} "
          f"{'g+S / fp8':>9} {'fp8 err':>8}")
    for name, seqs in PREFILL_SHAPES:
        case = prefill_case(seqs, torch.Generator(device="cuda").manual_seed(len(seqs)))
        cache8 = (case.cache * 0.25).to(FP8)
        k8, v8 = cache8[:, 0, 0], cache8[:, 0, 1]
        plan16 = debug.plan_prefill(case.query, case.k, case.host, warps=8, wgmma=True)
        plan8 = debug.plan_prefill(case.query, k8, case.host, warps=8, wgmma=True)
        bf16 = lambda: cuda.paged_prefill_run(plan16, case.query, case.k, case.v, case.tables,  # noqa: E731
                                              case.lens, case.starts, scale)
        fp8 = lambda: cuda.paged_prefill_run(plan8, case.query, k8, v8, case.tables, case.lens,  # noqa: E731
                                             case.starts, scale, 4.0, 4.0)
        prefill.use_kernel = False
        gs = lambda: prefill.paged_prefill_attention(case.query, k8, v8, case.tables, case.lens,  # noqa: E731
                                                     case.starts, scale, 4.0, 4.0, host_lengths=case.host)
        times = []
        try:
            for fn in (bf16, fp8, gs):
                warm_up(fn, 0.2)
                times.append(timed(fn))
            ref_gs = gs().float()
        finally:
            prefill.use_kernel = None
        ref, got = bf16().float(), fp8().float()
        err = float((got - ref).norm() / ref.norm())   # fp8's own rounding of K/V, against the bf16 cache
        err_gs = float((got - ref_gs).norm() / ref_gs.norm())   # the same fp8 cache read by gather + SDPA
        print(f"{name:34} {times[0] * 1e3:13.3f} {times[1] * 1e3:12.3f} {times[1] / times[0]:10.2f} "
              f"{times[2] * 1e3:10.3f} {times[2] / times[1]:9.2f} {err:8.1e}  (against gather + SDPA: {err_gs:.1e})")
        q4s, ks, vs, masks = contiguous_prefill(case, seqs)
        best, _ = _fastest_sdpa(q4s, ks, vs, masks, scale, measure=kernel_time)   # by the turns' own measure
        if best:
            turns = [(kernel_time(fp8), kernel_time(bf16), kernel_time(best[2])) for _ in range(3)]
            k8s, k16s, ksd = zip(*turns)
            print(f"{'':34} kernel time, alternately (ms): fp8 {min(k8s) * 1e3:.3f}-{max(k8s) * 1e3:.3f}, "
                  f"{w} {min(k16s) * 1e3:.3f}-{max(k16s) * 1e3:.3f}, {best[0]} ({w}) "
                  f"{min(ksd) * 1e3:.3f}-{max(ksd) * 1e3:.3f}; fp8 / {w} "
                  f"{min(a / b for a, b, _ in turns):.2f}-{max(a / b for a, b, _ in turns):.2f}; SDPA / fp8 "
                  f"{min(c / a for a, _, c in turns):.2f}-{max(c / a for a, _, c in turns):.2f}")
            if cuda.supports_split_query(case.query, k8):
                _split_query_turns(case, plan8, k8, v8, scale, best)
        del case, cache8, k8, v8, q4s, ks, vs, best
        torch.cuda.empty_cache()


def rope_tables(tokens: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[tokens, dim]`` (rotate-half layout) of random angles, for RoPE timings."""
    angles = torch.rand(tokens, dim // 2, device="cuda", generator=gen) * 100
    return torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)


def _split_query_turns(case: PrefillCase, plan8, k8, v8, scale: float, best) -> None:
    """fp8 prefill over the query split before the kernel (cuda.split_query: what the op that
    writes Q, rope_split_query, hands it) against the kernel splitting the 16-bit query itself and
    SDPA, kernel times by turns; then what writing Q split costs that op: rope in place (q and k)
    against rope_split_query (k in place, q written split), by turns."""
    split = cuda.split_query(case.query, HKV)
    fp8 = lambda: cuda.paged_prefill_run(plan8, case.query, k8, v8, case.tables, case.lens,  # noqa: E731
                                         case.starts, scale, 4.0, 4.0)
    fp8_split = lambda: cuda.paged_prefill_run(plan8, split, k8, v8, case.tables, case.lens,  # noqa: E731
                                               case.starts, scale, 4.0, 4.0)
    assert torch.equal(fp8(), fp8_split()), "the split query changed the result"
    turns = [(kernel_time(fp8_split), kernel_time(fp8), kernel_time(best[2])) for _ in range(3)]
    ks, k8s, ksd = zip(*turns)
    print(f"{'':34} split before the kernel (ms): fp8 {min(ks) * 1e3:.3f}-{max(ks) * 1e3:.3f}, "
          f"fp8 splitting itself {min(k8s) * 1e3:.3f}-{max(k8s) * 1e3:.3f}, {best[0]} ({DTYPE}) "
          f"{min(ksd) * 1e3:.3f}-{max(ksd) * 1e3:.3f}; SDPA / fp8 split "
          f"{min(c / a for a, _, c in turns):.2f}-{max(c / a for a, _, c in turns):.2f}")
    tokens = case.query.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = case.query.clone()
    k = torch.randn(tokens, HKV, D, dtype=DTYPE, device="cuda", generator=gen)
    cos, sin = rope_tables(tokens, D, DTYPE, gen)
    in_place = lambda: cuda.rope(q, k, cos, sin)  # noqa: E731
    written_split = lambda: cuda.rope_split_query(q, k, cos, sin, HKV, out=split)  # noqa: E731
    rope_turns = [(kernel_time(written_split), kernel_time(in_place)) for _ in range(3)]
    rs, rp = zip(*rope_turns)
    print(f"{'':34} rope (ms): q written split {min(rs) * 1e3:.4f}-{max(rs) * 1e3:.4f}, in place "
          f"{min(rp) * 1e3:.4f}-{max(rp) * 1e3:.4f}; split / in place "
          f"{min(a / b for a, b in rope_turns):.2f}-{max(a / b for a, b in rope_turns):.2f}")
    # What the model's layer pays beyond SDPA's RoPE in place: the kernel over the split query plus
    # what writing it split adds to RoPE, against the kernel splitting q itself after RoPE in place.
    extra = statistics.median(rs) - statistics.median(rp)
    sdpa = statistics.median(ksd)
    print(f"{'':34} SDPA / (fp8 split + its RoPE's extra {extra * 1e3:+.4f}) "
          f"{sdpa / (statistics.median(ks) + extra):.2f}; SDPA / fp8 splitting itself "
          f"{sdpa / statistics.median(k8s):.2f}")


def bench_rope(ceiling: float) -> None:
    """RoPE over q and k (32 q and 8 KV heads, d128, --dtype, rows of a fused qkv projection): in place
    (cuda.rope) and with q written split (cuda.rope_split_query), kernel times (median of 15, L2
    flushed), and the bytes each moves over the copy ceiling (q and k read and written, cos and sin
    read; the split one writes q's split bytes and factors instead of q)."""
    print(f"\nrope ({DTYPE}, {HQ}q/{HKV}kv, d{D}; q and k views of a fused qkv; kernel time, L2 flushed):")
    print(f"{'tokens':>7} {'in place us':>11} {'% ceiling':>9} {'q split us':>10} {'% ceiling':>9}")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for tokens in (256, 4096, 16384):
        qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, dtype=DTYPE, device="cuda", generator=gen)
        q = qkv[:, :HQ * D].view(tokens, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D)
        cos, sin = rope_tables(tokens, D, DTYPE, gen)
        split = cuda.split_query(q, HKV)
        t_place = kernel_time(lambda: cuda.rope(q, k, cos, sin))
        t_split = kernel_time(lambda: cuda.rope_split_query(q, k, cos, sin, HKV, out=split))
        moved = 2 * tokens * (HQ + HKV) * D * 2 + 2 * tokens * D * 2   # read + write q and k, read cos and sin
        split_moved = moved + tokens * HQ * 4                          # plus the row factors
        print(f"{tokens:7d} {t_place * 1e6:11.1f} {moved / t_place / ceiling * 100:8.1f}% "
              f"{t_split * 1e6:10.1f} {split_moved / t_split / ceiling * 100:8.1f}%")


def smoke() -> None:
    """Each kernel once on small inputs (split and unsplit decode with 2 and 4 loads in flight,
    work lists of every instance over 16-bit caches (FMA, tensor cores, and on Hopper the one the
    copy engine stages), fp8 decode on tensor cores and FMAs, grid and work list, write_kv,
    copy_blocks, swaps in every mode)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for dtype, d, group in ((torch.bfloat16, 128, 4), (torch.float32, 256, 8), (torch.float16, 64, 3)):
        cache = torch.randn(40, 2, 2, 2, 16, d, dtype=dtype, device="cuda", generator=gen)
        k, v = cache[:, 1, 0], cache[:, 1, 1]
        tables = torch.randperm(40, device="cuda", generator=gen)[:36].view(3, 12).to(torch.int32)
        lens = torch.tensor([1, 17, 190], dtype=torch.int32, device="cuda")
        q = torch.randn(3, 2 * group, d, dtype=dtype, device="cuda", generator=gen)
        for loads in (2, 4):            # both kernel instances
            for splits in (1, 3):
                debug.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, splits, loads=loads)
        geometry = cuda.decode_work_geometry(q, k)  # a work list, its longer sequences in pieces (fused merge)
        step = debug.decode_plan_on("cuda", debug.plan_decode_work(lens.tolist(), geometry, min_item=64), geometry, 3,
                                    num_q_heads=q.shape[1], head_dim=d)
        cuda.paged_decode_run(step, q, k, v, tables, lens, d ** -0.5)
        if d in (64, 128) and dtype != torch.float32:   # every instance's work list over the 16-bit cache
            hopper = torch.cuda.get_device_capability() == (9, 0)
            for mma in (False, True, 2) if hopper else (False, True):   # 2: staged by the copy engine (Hopper)
                geometry16 = debug.decode_work_geometry(q, k, mma=mma)
                step16 = debug.decode_plan_on("cuda", debug.plan_decode_work(lens.tolist(), geometry16, min_item=64),
                                              geometry16, 3, num_q_heads=q.shape[1], head_dim=d)
                cuda.paged_decode_run(step16, q, k, v, tables, lens, d ** -0.5)
        if dtype != torch.float32:      # fp8 cache: write (quantizing) and decode
            cache8 = torch.zeros(40, 2, 2, 2, 16, d, dtype=reference.FP8, device="cuda")
            key8 = torch.randn(5, 2, d, dtype=dtype, device="cuda", generator=gen)
            cuda.write_kv(key8, key8, cache8[:, 1, 0], cache8[:, 1, 1], torch.tensor([0, -1, 17, 639, 100],
                                                                                     device="cuda"), 0.5, 0.25)
            mmas = (True, False) if d in (64, 128) else (False,)   # tensor-core instance and FMA one
            for mma in mmas:
                for loads in (2, 4):
                    for splits in (1, 3):
                        debug.paged_decode_attention(q, cache8[:, 1, 0], cache8[:, 1, 1], tables, lens, d ** -0.5,
                                                     splits, loads=loads, k_scale=0.5, v_scale=0.25, mma=mma,
                                                     prefetch_steps=1 if mma and splits == 3 else None)
                geometry8 = debug.decode_work_geometry(q, cache8[:, 1, 0], mma=mma)
                step8 = debug.decode_plan_on("cuda", debug.plan_decode_work(lens.tolist(), geometry8, min_item=64),
                                             geometry8, 3, num_q_heads=q.shape[1], head_dim=d)
                cuda.paged_decode_run(step8, q, cache8[:, 1, 0], cache8[:, 1, 1], tables, lens, d ** -0.5,
                                      k_scale=0.5, v_scale=0.25)
        key = torch.randn(5, 2, d, dtype=dtype, device="cuda", generator=gen)
        slots = torch.tensor([0, -1, 17, 639, 100], device="cuda")
        cuda.write_kv(key, key, k, v, slots)
        cuda.copy_blocks(cache, torch.tensor([0, 5]), torch.tensor([7, 39]))
        host = torch.zeros(4, *cache.shape[1:], dtype=dtype).pin_memory()
        for mode in cuda.SWAP_MODES:
            debug.swap_blocks(cache, host, torch.tensor([3, 4]), torch.tensor([0, 2]), mode)
            debug.swap_blocks(host, cache, torch.tensor([0, 2]), torch.tensor([10, 11]), mode)
    # The prefill kernel: both block shapes, a 16-bit and an fp8 cache, chunked and whole prompts, GQA 4
    # (over fp8 on Hopper, bf16 and fp16 queries meet K as e4m3, split by the kernel or before it).
    for dtype, d in ((torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 64), (torch.float16, 128)):
        cache = torch.randn(40, 2, 2, 2, 16, d, dtype=dtype, device="cuda", generator=gen)
        tables = torch.randperm(40, device="cuda", generator=gen)[:36].view(3, 12).to(torch.int32)
        lens = torch.tensor([1, 70, 190], dtype=torch.int32, device="cuda")
        starts = torch.tensor([0, 1, 71, 171], dtype=torch.int32, device="cuda")
        q = torch.randn(171, 8, d, dtype=dtype, device="cuda", generator=gen)
        cache8 = cache.to(reference.FP8)
        for warps in (4, 8):
            for wg in (False, True) if warps == 8 else (False,):
                debug.paged_prefill_attention(q, cache[:, 1, 0], cache[:, 1, 1], tables, lens, starts, d ** -0.5,
                                              warps=warps, wgmma=wg)
                debug.paged_prefill_attention(q, cache8[:, 1, 0], cache8[:, 1, 1], tables, lens, starts, d ** -0.5,
                                              0.5, 0.25, warps=warps, wgmma=wg)
        if cuda.supports_split_query(q, cache8[:, 1, 0]):   # over fp8 on Hopper: the query split before
            k_new = torch.randn(171, 2, d, dtype=dtype, device="cuda", generator=gen)
            cos, sin = rope_tables(171, d, dtype, gen)
            split = cuda.rope_split_query(q, k_new, cos, sin, 2)
            debug.paged_prefill_attention(split, cache8[:, 1, 0], cache8[:, 1, 1], tables, lens, starts, d ** -0.5,
                                          0.5, 0.25, warps=8, wgmma=True)
    torch.cuda.synchronize()
    print("smoke ok")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="",
                    help="comma-separated subset of plan,prefill_plan,ragged,list_loads,flush,after_write,small_reads,decode,gqa,copy,"
                         "swap,write_kv,flex,"
                         "prefill,fp8,fp8_sweep,fp8_plan,prefill_fp8,rope,"
                         "prefill_kernel "
                         "(quick: decode alone, loads x splits sweep)")
    ap.add_argument("--variants", default="", help='decode kernel builds to compare: "name=nvcc flags;..."')
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                    help="queries, caches and their SDPA comparisons (fp8 caches: the queries' dtype)")
    ap.add_argument("--flush", choices=("write", "clean"), default="write",
                    help="L2 flush before each timing: a 256 MiB write (dirty L2), or that write then a 256 MiB "
                         "read of another buffer (clean L2); see flush_l2")
    args = ap.parse_args()
    global FLUSH_MODE, DTYPE
    FLUSH_MODE = args.flush
    DTYPE = getattr(torch, args.dtype)
    if args.variants:
        run_variants(args.variants, args.only or "quick", args.flush, args.dtype)
        return
    if not cuda.available():
        raise SystemExit(cuda.load_error() or "needs CUDA")
    if args.smoke:
        smoke()
        return
    print(torch.cuda.get_device_name(), torch.__version__, f"L2 flush: {FLUSH_MODE}, {DTYPE}")
    parts = set(filter(None, args.only.split(","))) or {"plan", "prefill_plan", "ragged", "fp8", "decode", "gqa", "copy", "swap", "write_kv", "flex",
                                                           "prefill", "prefill_kernel"}
    ceiling = copy_ceiling()
    print(f"copy ceiling (2 GiB clone, read+write): {ceiling / 1e9:,.0f} GB/s")
    steps = [("plan", bench_plan_once), ("prefill_plan", bench_prefill_plan), ("ragged", lambda: bench_ragged(ceiling)),
             ("list_loads", lambda: bench_list_loads(ceiling)), ("flush", lambda: bench_flush(ceiling)),
             ("after_write", lambda: bench_after_write(ceiling)), ("small_reads", lambda: bench_small_reads(ceiling)),
             ("quick", lambda: bench_decode_quick(ceiling)), ("fp8", lambda: bench_fp8(ceiling)),
             ("fp8_sweep", lambda: bench_fp8_sweep(ceiling)), ("fp8_plan", lambda: bench_fp8_plan(ceiling)),
             ("decode", lambda: bench(ceiling)), ("gqa", gqa_ratio), ("copy", lambda: bench_copy_blocks(ceiling)),
             ("swap", bench_swap), ("write_kv", lambda: bench_write_kv(ceiling)), ("flex", bench_flex),
             ("prefill", bench_prefill), ("prefill_kernel", bench_prefill_kernel), ("prefill_fp8", bench_prefill_fp8),
             ("rope", lambda: bench_rope(ceiling))]
    for name, fn in steps:
        if name in parts:
            try:
                fn()
            except Exception:   # one part failing must not hide the others' numbers
                print(f"\n{name} failed:")
                traceback.print_exc()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
