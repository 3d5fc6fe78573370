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

Run: python benchmarks/kernels.py            (needs CUDA; builds the extension on first use)
     python benchmarks/kernels.py --smoke    (one small call of every kernel, e.g. under compute-sanitizer)
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from kvpager.kernels import cuda

HQ, HKV, D, B, LAYERS = 32, 8, 128, 16, 2
DTYPE = torch.bfloat16
CONFIGS = [(1, 32768), (8, 4096), (32, 2048), (64, 4096), (128, 2048), (256, 1024), (32, 16384)]
PREFETCH_SWEEP = (0, 1, 2)
SPLIT_SWEEP = (1, 2, 3, 4, 6, 8, 12, 16, 32)
SPLIT_SWEEP_CONFIGS = {(8, 4096), (32, 2048), (64, 4096), (32, 16384)}

_flush = None


def flush_l2() -> None:
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _flush.zero_()


def timed(fn, reps: int = 15, warmup: int = 2) -> float:
    """Median seconds of fn over reps runs, L2 flushed before each."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush_l2()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


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
        splits, partition, _ = cuda.decode_plan(q, k, v, tables, lens)
        t_ours = timed(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        t_again = timed(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        sweep_pd = {}
        for pd in PREFETCH_SWEEP:
            cuda._prefetch_steps = pd
            sweep_pd[pd] = nbytes / timed(lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, out=out))
        cuda._prefetch_steps = None
        sweep_splits = {}
        if (batch, ctx) in SPLIT_SWEEP_CONFIGS:
            for n in SPLIT_SWEEP:
                got = cuda.decode_plan(q, k, v, tables, lens, n)[0]
                if got == n:
                    sweep_splits[n] = nbytes / timed(
                        lambda: cuda.paged_decode_attention(q, k, v, tables, lens, scale, n, out=out))

        q4 = q.view(batch, HQ, 1, D)

        def gathered():
            return F.scaled_dot_product_attention(q4, gather(k, tables), gather(v, tables), scale=scale,
                                                  enable_gqa=True)

        t_gather = timed(gathered, reps=7)
        ref = gathered().view(batch, HQ, D).float()
        err = float(((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
        kc, vc = gather(k, tables).contiguous(), gather(v, tables).contiguous()
        del cache, k, v
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


def smoke() -> None:
    """Each kernel once on small inputs (split and unsplit decode, write_kv, copy_blocks)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for dtype, d, group in ((torch.bfloat16, 128, 4), (torch.float32, 256, 8), (torch.float16, 64, 3)):
        cache = torch.randn(40, 2, 2, 2, 16, d, dtype=dtype, device="cuda", generator=gen)
        k, v = cache[:, 1, 0], cache[:, 1, 1]
        tables = torch.randperm(40, device="cuda", generator=gen)[:36].view(3, 12).to(torch.int32)
        lens = torch.tensor([1, 17, 190], dtype=torch.int32, device="cuda")
        q = torch.randn(3, 2 * group, d, dtype=dtype, device="cuda", generator=gen)
        for splits in (1, 3):
            cuda.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, splits)
        key = torch.randn(5, 2, d, dtype=dtype, device="cuda", generator=gen)
        slots = torch.tensor([0, -1, 17, 639, 100], device="cuda")
        cuda.write_kv(key, key, k, v, slots)
        cuda.copy_blocks(cache, torch.tensor([0, 5]), torch.tensor([7, 39]))
    torch.cuda.synchronize()
    print("smoke ok")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if not cuda.available():
        raise SystemExit(cuda.load_error() or "needs CUDA")
    if args.smoke:
        smoke()
        return
    print(torch.cuda.get_device_name(), torch.__version__)
    ceiling = copy_ceiling()
    bench(ceiling)
    gqa_ratio()
    bench_copy_blocks(ceiling)


if __name__ == "__main__":
    main()
