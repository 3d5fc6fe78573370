"""Work lists of pieces (the planner's sizes) against equal shares (stream-K: every worker
total / workers tokens, items cut at any token, or at multiples of 8 for the tensor-core
instance), event-timed by turns with torch SDPA on a contiguous bf16 cache, under both L2 flushes.
% of the copy ceiling (in the cache's bytes); "shares / pieces" is the pieces' time over the
shares' (above 1: shares faster), "SDPA / x" SDPA's time over x's. By turns because the H100's
clock follows what ran before (docs/performance.md, eighth session).

    python3 benchmarks/decode_shares.py [--shapes 8x4096,1x32768,64x4096] [--fp8] [--ragged 128x8192,...]

Why: 8 x 4K and 64 x 4K give 512 items to 528 resident slots (66 workers a KV head, 4 blocks an
SM); the 16 SMs holding 3 finish early and idle (docs/performance.md, "Where a short decode
step's time goes"). Equal shares fill every slot with 1/528 of the tokens.
"""

from __future__ import annotations

import argparse
import dataclasses

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes, flush and timers
import torch

from kvpager.kernels import cuda, decode_plan

SHAPES = "8x4096,1x32768,64x4096,32x2048"
TURNS = 4


def shares_of(geometry: cuda.DecodeGeometry) -> cuda.DecodeGeometry:
    """The geometry planning equal shares at its instance's alignment."""
    return dataclasses.replace(geometry, share_align=decode_plan.SHARE_ALIGN_MMA if geometry.mma else 1)


def runs_for(q, k, v, tables, lens, k_scale: float, v_scale: float) -> dict:
    """{name: launch} of the two plans over this cache (its default instance), with their outputs."""
    geometry = cuda.decode_work_geometry(q, k)
    host = lens.tolist()
    scale = q.shape[-1] ** -0.5
    runs = {}
    for name, g in (("pieces", geometry), ("shares", shares_of(geometry))):
        step, out = bench.work_step(host, g), torch.empty_like(q)
        runs[name] = (lambda step=step, out=out: cuda.paged_decode_run(step, q, k, v, tables, lens, scale, out=out,
                                                                        k_scale=k_scale, v_scale=v_scale))
    a, b = (runs[name]().float() for name in ("pieces", "shares"))
    err = float(((a - b).norm(dim=-1) / a.norm(dim=-1)).max())
    plan = cuda.plan_decode_work(host, shares_of(geometry))
    kind = "equal shares" if plan[1] == 0 else "pieces (shares could not be planned)"
    print(f"  {geometry.workers} workers a KV head; shares planned as {kind}, {int(plan[0])} records; "
          f"largest row difference from pieces {err:.1e}")
    return runs


def turns(label: str, runs: dict, nbytes: int, ceiling: float) -> None:
    def pct(t):
        return 100 * nbytes / t / ceiling

    for mode in ("write", "clean"):
        times = {name: [] for name in runs}
        for _ in range(TURNS):
            for name, fn in runs.items():
                bench.warm_up(fn, 0.1)
                times[name].append(bench.timed(fn, flush=mode))
        cells = [f"{name} {min(map(pct, t)):.1f}-{max(map(pct, t)):.1f}%" for name, t in times.items()]
        pairs = [("shares / pieces", "pieces", "shares")]
        pairs += [(f"SDPA / {name}", "SDPA", name) for name in ("pieces", "shares") if "SDPA" in times]
        ratios = [f"{title} {min(a / b for a, b in zip(times[num], times[den])):.3f}-"
                  f"{max(a / b for a, b in zip(times[num], times[den])):.3f}" for title, num, den in pairs]
        print(f"{label} {mode}: {', '.join(cells)}; {'; '.join(ratios)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="uniform batch x context, comma-separated")
    ap.add_argument("--ragged", default="", help="ragged batch x longest context (lengths uniform in 1..it)")
    ap.add_argument("--fp8", action="store_true", help="also over an fp8 e4m3 cache (the tensor-core instance)")
    args = ap.parse_args()
    ceiling = bench.copy_ceiling()
    gen = torch.Generator(device="cuda").manual_seed(2)
    cases = [("uniform", spec) for spec in args.shapes.split(",") if spec]
    cases += [("ragged", spec) for spec in args.ragged.split(",") if spec]
    for kind, spec in cases:
        batch, ctx = (int(x) for x in spec.split("x"))
        if kind == "uniform":
            c = bench.decode_layer(batch, ctx, gen)
            print(f"{batch} x {ctx}, bf16 cache:")
            runs = runs_for(c.q, c.k, c.v, c.tables, c.lens, 1.0, 1.0)
            runs["SDPA"] = c.sdpa
            turns(f"{batch} x {ctx} bf16", runs, c.nbytes, ceiling)
            del c, runs
        else:
            q, cache, tables, _ = bench.make_case(batch, ctx, gen=gen)
            lens = torch.randint(1, ctx + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
            k, v = cache[:, 0, 0], cache[:, 0, 1]
            print(f"ragged {batch} x {ctx}, bf16 cache:")
            nbytes = 2 * int(lens.sum()) * bench.HKV * bench.D * q.element_size()
            turns(f"ragged {batch} x {ctx} bf16", runs_for(q, k, v, tables, lens, 1.0, 1.0), nbytes, ceiling)
            del q, cache, k, v
        torch.cuda.empty_cache()
        if args.fp8:
            q, cache8, tables, lens = bench.fp8_case(kind, batch, ctx, gen)
            k8, v8 = cache8[:, 0, 0], cache8[:, 0, 1]
            print(f"{kind} {batch} x {ctx}, fp8 cache:")
            nbytes = 2 * int(lens.sum()) * bench.HKV * bench.D
            turns(f"{kind} {batch} x {ctx} fp8", runs_for(q, k8, v8, tables, lens, 0.05, 0.05), nbytes, ceiling)
            del q, cache8, k8, v8
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
