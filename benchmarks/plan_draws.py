"""The work-list planner's item cost over many draws of ragged lengths, on the GPU, by turns.

One draw of lengths per shape is what ``kernels.py --only ragged`` and ``--only fp8_plan`` time,
and one draw can decide a knob: an fp8 batch of 276 x <= 2,600 tokens that the planner cut into
414 items read 82%, whole sequences 86% (docs/performance.md, seventeenth session). Here, for each
ragged shape, DRAWS draws of lengths uniform in 1..max share one cache; each draw's work list is
planned with each item cost (identical plans timed once), the plans are timed in turns (3 rounds,
write flush unless --flush clean), and each cost's mean and worst % of the copy ceiling over the draws is printed. bf16
caches take the FMA work list, fp8 (e4m3) ones the tensor-core list; % counts the bytes read.

    python3 benchmarks/plan_draws.py [--draws 8] [--head-dim 128] [--kinds bf16,fp8]
        [--costs-bf16 96,192,384,768] [--costs-fp8 96,192,384,768] [--shapes 128x8192,64x32768]
        [--loads 0,2,4]

``--loads 2,4`` times bf16 work lists of both FMA instances (2 and 4 16-byte loads in flight a
lane: 4 and 3 blocks an SM) side by side, each planned for its own workers.
"""

from __future__ import annotations

import argparse
import statistics

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes, flush and timers
import numpy as np
import torch

from kvpager.kernels import cuda, debug

SHAPES = ((128, 8192), (64, 32768), (256, 2048), (276, 2600))


def time_costs(kind: str, batch: int, longest: int, costs: list[int], draws: int, ceiling: float,
               loads: tuple[int, ...] = (0,)) -> dict[str, list[float]]:
    """% of the copy ceiling of each (instance, cost) plan, per draw, for one shape; ``loads``: the
    work-list instances (0: the planner's; 2 or 4 loads in flight a lane, bf16 only)."""
    scale = bench.D ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, cache, tables, _ = bench.make_case(batch, longest, gen=gen)
    extra = {}
    if kind == "fp8":
        cache = bench.quantize_in_chunks(cache, 0.05)
        extra = dict(k_scale=0.05, v_scale=0.05)
    k, v = cache[:, 0, 0], cache[:, 0, 1]
    geometries = {n: debug.decode_work_geometry(q, k, loads=n or None) for n in loads}
    variants = [(f"{'' if n == 0 else f'{n}L '}c{c}", geometries[n], c) for n in loads for c in costs]
    out = torch.empty_like(q)
    per_cost: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    for draw in range(draws):
        lens = torch.randint(1, longest + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
        host = lens.tolist()
        nbytes = 2 * sum(host) * bench.HKV * bench.D * cache.element_size()
        plans, steps = {}, {}
        for label, geometry, c in variants:
            plan = debug.plan_decode_work(host, geometry, item_cost=c)
            key = plan.tobytes() + bytes([geometry.loads])
            if key not in steps:
                steps[key] = debug.decode_plan_on("cuda", plan, geometry, batch, num_q_heads=bench.HQ, head_dim=bench.D)
            plans[label] = (key, int(plan[0]))
        times: dict[bytes, list[float]] = {key: [] for key in steps}
        for _ in range(3):
            for key, step in steps.items():
                fn = lambda s=step: cuda.paged_decode_run(s, q, k, v, tables, lens, scale, out=out, **extra)  # noqa: E731
                bench.warm_up(fn, 0.05)
                times[key].append(bench.timed(fn, reps=9))
        cells = []
        for label, _, _ in variants:
            key, items = plans[label]
            pct = 100 * nbytes / statistics.median(times[key]) / ceiling
            per_cost[label].append(pct)
            cells.append(f"{label}: {items} items {pct:.1f}%")
        print(f"{kind} d{bench.D} {batch} x {longest} draw {draw}: " + "  ".join(cells), flush=True)
    return per_cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=bench.D, help="64 or 128")
    ap.add_argument("--kinds", default="bf16,fp8")
    ap.add_argument("--costs-bf16", default="96,192,384,768")
    ap.add_argument("--costs-fp8", default="96,192,384,768")
    ap.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES), help="batch x longest, comma-separated")
    ap.add_argument("--loads", default="0", help="work-list instances, comma-separated: 0 the planner's, 2, 4 (bf16)")
    ap.add_argument("--flush", default="write", choices=("write", "clean"), help="the L2 flush before each call")
    args = ap.parse_args()
    bench.FLUSH_MODE = args.flush
    bench.D = args.head_dim   # make_case and the byte counts read the module's head_dim
    ceiling = bench.copy_ceiling()
    print(f"{torch.cuda.get_device_name()}, copy ceiling {ceiling / 1e9:,.0f} GB/s; item costs over "
          f"{args.draws} draws of lengths, by turns, {args.flush} flush (% of the copy ceiling)")
    costs = {"bf16": args.costs_bf16, "fp8": args.costs_fp8}
    for kind in args.kinds.split(","):
        for batch, longest in (tuple(int(x) for x in spec.split("x")) for spec in args.shapes.split(",")):
            loads = tuple(int(n) for n in args.loads.split(",")) if kind == "bf16" else (0,)
            per_cost = time_costs(kind, batch, longest, [int(c) for c in costs[kind].split(",")], args.draws, ceiling,
                                  loads)
            print(f"{kind} d{bench.D} {batch} x {longest} over {args.draws} draws: " + "  ".join(
                f"{label} mean {np.mean(v):.1f} worst {min(v):.1f}" for label, v in per_cost.items()), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
