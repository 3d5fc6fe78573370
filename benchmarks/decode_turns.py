"""Our work-list decode and torch SDPA (contiguous cache) on the short decode shapes, event-timed
by turns: ours, SDPA, ours, SDPA, ... four times each, each after a warm-up, under both L2
flushes; % of the copy ceiling and SDPA's time over ours per turn. By turns because the H100 runs
at its power cap and its clock follows what ran before (docs/performance.md, eighth session);
the decode's merge is a programmatic dependent launch, so kernels.kernel_time does not apply.

    python3 benchmarks/decode_turns.py
    python3 benchmarks/decode_turns.py --mma --shapes 8x4096,1x32768,32x2048,64x4096,32x16384

``--mma`` adds, in the same turns, the other instance over the bf16 cache (its work list planned
for that instance's geometry): the tensor-core one beside the FMA one the planner takes on an
H100, the FMA one beside the tensor-core one it takes on an H200.
``--loads 4`` (or 2) adds the FMA work list of that instance (4: 3 blocks an SM, twice the K/V in
registers a lane; the H100's lists take 2); with ``--fp8``, the fp8 (tensor-core) list of that
instance too (4: 32 tokens a warp iteration, 3 blocks an SM; the planner takes 2).
``--min-item 1024,2048`` adds work lists planned with pieces of at least that many tokens (the
planner's ``min_item``, by default 256): fewer items than workers where that leaves sequences
whole; with ``--loads``, that instance's lists too, and with ``--fp8`` the fp8 list's. ``--piece
1024`` adds lists cut into pieces of exactly that many tokens (the planner's numpy twin given that
size only), likewise.
``--prefetch 0,2,4`` runs the default list, those of ``--loads``, ``--min-item`` and ``--piece``, the
other instances' (``--mma``, ``--bulk``) and the fp8 ones (``--fp8``) with these L2 prefetch
distances too (block iterations whose K/V slabs go to L2 ahead of their loads; the default is 1,
0 on the tensor-core instances).
``--grid`` adds the grid plan (split count and instance from the table's width).
``--bulk`` adds the tensor-core work list whose K/V the copy engine stages in shared memory
(``mma=2``: Hopper, paged_decode_bulk.cuh), planned for that instance's geometry.
``--bars`` adds kernels that only load (Triton), the bars a decode of these bytes can reach:
``contiguous``, the same bytes from one buffer, 64 KiB a program; ``paged``, every K and V page the
decode reads through the same shuffled block tables, 8 blocks a program, the programs of one
block's heads launched together (``paged, heads last``: all of one head's programs first);
``streamed``, persistent programs laid out as the work list (4 an SM, KV heads fastest) streaming
equal shares of the step's pages, one block an iteration (``streamed, 8 blocks, 2 an SM``: 8 blocks
an iteration, 2 programs an SM).
``--streams 3x1,6x1,4x4h2`` adds streamed bars of other shapes: programs an SM x blocks an
iteration, and ``hG`` to read G heads of each block together (a program per G heads).
``--evict-first`` (with ``--bars``) adds the contiguous and streamed bars with Triton's evict-first
load policy (fp8's too with ``--fp8``): reads that keep the write flush's dirty lines in the L2, as
our decode's loads do (docs/performance.md, "Evict-first K/V loads, measured").
``--fp8`` adds our decode over an e4m3 copy of the same cache (scale 0.05, the planner's work list
for it), its % of the ceiling counted in fp8 bytes (issue 13's fp8 target), and with ``--bars`` the
contiguous, paged and streamed bars over as many fp8 bytes and its pages.
"""

from __future__ import annotations

import argparse

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes, flush and timers
import torch

from kvpager.kernels import cuda, debug, reference
from kvpager.kernels import decode_plan as work_plan

SHAPES = "8x4096,1x32768,32x2048"
TURNS = 4
FP8_SCALE = 0.05


def row_error(out: torch.Tensor, base: torch.Tensor) -> float:
    """The largest relative L2 error of a row (a head's output) of ``out`` against ``base``."""
    out, base = out.float(), base.float()
    return float(((out - base).norm(dim=-1) / base.norm(dim=-1)).max())


def fp8_views(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 copies of layer-0 views ``k``, ``v`` (quantized with FP8_SCALE), as the same views of a
    block-major fp8 cache of bench.LAYERS layers (the block stride a real cache has)."""
    cache8 = torch.empty(k.shape[0], bench.LAYERS, 2, *k.shape[1:], dtype=reference.FP8, device=k.device)
    cache8[:, 0, 0] = bench.quantize_in_chunks(k, FP8_SCALE)
    cache8[:, 0, 1] = bench.quantize_in_chunks(v, FP8_SCALE)
    return cache8[:, 0, 0], cache8[:, 0, 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="batch x context, comma-separated")
    ap.add_argument("--mma", action="store_true", help="also the tensor-core instance over the bf16 cache")
    ap.add_argument("--prefetch", default="", help="also these L2 prefetch distances, comma-separated")
    ap.add_argument("--loads", type=int, choices=(2, 4), help="also this instance's work list (loads in flight a lane; with --fp8, the fp8 list's too)")
    ap.add_argument("--min-item", default="", help="also work lists with pieces of at least these tokens, comma-separated")
    ap.add_argument("--piece", default="", help="also work lists cut in pieces of exactly these tokens, comma-separated")
    ap.add_argument("--grid", action="store_true", help="also the grid plan")
    ap.add_argument("--bulk", action="store_true", help="also the tensor-core list staged by the copy engine (Hopper)")
    ap.add_argument("--bars", action="store_true", help="also loads-only reads of the same pages and of as many "
                    "contiguous bytes")
    ap.add_argument("--streams", default="", help="also streamed bars: programs an SM x blocks an iteration[hG], "
                    "comma-separated")
    ap.add_argument("--evict-first", action="store_true", help="with --bars, also the contiguous and streamed "
                    "bars with evict-first loads")
    ap.add_argument("--fp8", action="store_true", help="also our decode over an e4m3 copy of the cache (%% in fp8 "
                    "bytes), and with --bars the bars over its bytes")
    args = ap.parse_args()
    ceiling = bench.copy_ceiling()
    gen = torch.Generator(device="cuda").manual_seed(2)
    for spec in args.shapes.split(","):
        batch, ctx = (int(x) for x in spec.split("x"))
        c = bench.decode_layer(batch, ctx, gen)
        runs = {"ours": c.decode, "SDPA": c.sdpa}
        sizes = {}   # the bytes a run reads, where not c.nbytes (the fp8 runs)
        scale = c.q.shape[-1] ** -0.5
        lens = c.lens.tolist()

        def variant_lists(g):
            """(name suffix, host work list) of --min-item and --piece for geometry ``g``."""
            by_min = [(f", min_item {m}", debug.plan_decode_work(lens, g, min_item=m))
                      for m in (int(x) for x in args.min_item.split(",") if x)]
            return by_min + [(f", pieces of {p}", work_plan.plan_decode_work(   # the numpy twin, capped and floored at p
                lens, g.workers, p, g.capacity(batch), min_item=p, item_cost=g.item_cost))
                for p in (int(x) for x in args.piece.split(",") if x)]

        def planned_lists(k, default):
            """(name suffix, host work list, geometry) over cache ``k`` beside the planner's list of
            geometry ``default``: --loads' instance, then --min-item and --piece for both geometries."""
            geometries = {"": default}
            planned = []
            if args.loads:
                g = debug.decode_work_geometry(c.q, k, loads=args.loads)
                geometries[f", {args.loads} loads"] = g
                planned.append((f", {args.loads} loads", cuda.plan_decode_work(lens, g), g))
                print(f"{batch} x {ctx}: the {k.dtype} cache's default list has {default.loads} loads and "
                      f"{default.workers} workers a KV head, the {args.loads}-loads one {g.workers}")
            for label, g in geometries.items():
                planned += [(label + suffix, host, g) for suffix, host in variant_lists(g)]
            return planned

        def list_run(step, k=c.k, v=c.v, kv_scale=1.0):
            """Our decode over work list ``step`` and the cache (k, v), into its own output."""
            out = torch.empty_like(c.out)
            return lambda: cuda.paged_decode_run(step, c.q, k, v, c.tables, c.lens, scale, out=out, k_scale=kv_scale,
                                                 v_scale=kv_scale)

        def uploaded(label, host, geometry, default):
            """``host`` (a list planned for ``geometry``) on the device, said beside the ``default`` step's."""
            print(f"{batch} x {ctx}: {label}: {host[0]} items of {host[1]} tokens "
                  f"(default: {int(default.work[0])} of {int(default.work[1])})")
            return debug.decode_plan_on("cuda", host, geometry, batch, num_q_heads=bench.HQ, head_dim=bench.D)

        # The work lists --prefetch runs, (step, k, v, kv_scale) by name suffix: the default one, the
        # planned ones, the other instances' and the fp8 ones.
        lists = {"": (c.step, c.k, c.v, 1.0)}
        for suffix, host, geometry_m in planned_lists(c.k, c.step.geometry):
            lists[suffix] = (uploaded(suffix[2:], host, geometry_m, c.step), c.k, c.v, 1.0)
            runs[f"ours{suffix}"] = list_run(lists[suffix][0])
        if args.grid:
            grid = cuda.plan_decode_grid(c.q, c.k, c.v, c.tables, c.lens)
            out_g = torch.empty_like(c.out)
            runs["grid"] = lambda: cuda.paged_decode_grid_run(grid, c.q, c.k, c.v, c.tables, c.lens, scale, out=out_g)
            print(f"{batch} x {ctx}: grid plan {grid.num_splits} splits of {grid.partition_tokens} tokens")
        def add_instance(label, mma):
            """The work list of instance ``mma``, planned for its own geometry, as run ``label``;
            returns (its geometry, its largest row error against the planner's list)."""
            geometry = debug.decode_work_geometry(c.q, c.k, mma=mma)
            step = bench.work_step(lens, geometry)
            lists[label[len("ours"):]] = (step, c.k, c.v, 1.0)
            runs[label] = list_run(step)
            return geometry, row_error(runs[label](), c.decode())

        if args.mma:
            other = not c.step.geometry.mma
            label = "ours, tensor cores" if other else "ours, FMA"
            _, err = add_instance(label, other)
            print(f"{batch} x {ctx}: the planner's instance is {'tensor cores' if c.step.geometry.mma else 'FMA'}; "
                  f"{label} against it, largest row error {err:.1e}")
        if args.bulk:
            geometry_b, err = add_instance("ours, bulk", 2)
            print(f"{batch} x {ctx}: bulk-staged list, {geometry_b.workers} workers a KV head (default "
                  f"{c.step.geometry.workers}), largest row error against the default {err:.1e}")

        if args.bars:
            flat = torch.randn(c.nbytes // 2, dtype=torch.bfloat16, device="cuda")   # as many bytes, contiguous
            runs["contiguous"] = bench.contiguous_loads(flat)
            runs["paged"] = bench.paged_loads(c.k, c.v, c.tables)
            runs["paged, heads last"] = bench.paged_loads(c.k, c.v, c.tables, heads_first=False)
            runs["streamed"] = bench.streamed_loads(c.k, c.v, c.tables)
            runs["streamed, 8 blocks, 2 an SM"] = bench.streamed_loads(c.k, c.v, c.tables, pages=8, programs_per_sm=2)
            if args.evict_first:
                runs["contiguous, evict first"] = bench.contiguous_loads(flat, evict_first=True)
                runs["streamed, evict first"] = bench.streamed_loads(c.k, c.v, c.tables, evict_first=True)
            if runs["paged"] is None:
                raise SystemExit("--bars needs Triton")
        if args.fp8:
            k8, v8 = fp8_views(c.k, c.v)
            geometry8 = cuda.decode_work_geometry(c.q, k8)
            step8 = bench.work_step(lens, geometry8)
            lists[", fp8"] = (step8, k8, v8, FP8_SCALE)
            runs["ours, fp8"] = list_run(step8, k8, v8, FP8_SCALE)
            err = row_error(runs["ours, fp8"](), c.decode())
            print(f"{batch} x {ctx}: fp8 cache, {'tensor cores' if geometry8.mma else 'FMA'}, {geometry8.workers} "
                  f"workers a KV head; largest row error against the bf16 cache's decode {err:.1e} (quantization)")
            for suffix, host, g in planned_lists(k8, geometry8):   # --loads, --min-item and --piece over fp8 too
                lists[f", fp8{suffix}"] = (uploaded(f"fp8{suffix}", host, g, step8), k8, v8, FP8_SCALE)
                runs[f"ours, fp8{suffix}"] = list_run(*lists[f", fp8{suffix}"])
            if args.bars:
                runs["fp8 contiguous"] = bench.contiguous_loads(torch.randint(0, 256, (c.nbytes // 2,), dtype=torch.uint8,
                                                                              device="cuda"))
                runs["fp8 paged"] = bench.paged_loads(k8, v8, c.tables)
                runs["fp8 streamed"] = bench.streamed_loads(k8, v8, c.tables)
                if args.evict_first:
                    runs["fp8 streamed, evict first"] = bench.streamed_loads(k8, v8, c.tables, evict_first=True)
        for pd in (int(x) for x in args.prefetch.split(",") if x):
            for suffix, (step_p, k_p, v_p, s_p) in lists.items():
                pd_out = torch.empty_like(c.out)
                runs[f"ours{suffix}, prefetch {pd}"] = (
                    lambda pd=pd, pd_out=pd_out, step_p=step_p, k_p=k_p, v_p=v_p, s_p=s_p: debug.paged_decode_run(
                        step_p, c.q, k_p, v_p, c.tables, c.lens, scale, prefetch_steps=pd, out=pd_out, k_scale=s_p,
                        v_scale=s_p))
        sizes.update({name: c.nbytes // 2 for name in runs if name.startswith(("fp8", "ours, fp8"))})
        for spec_s in (x for x in args.streams.split(",") if x):
            per_sm, _, rest = spec_s.partition("x")
            pages, _, heads = rest.partition("h")
            runs[f"streamed {spec_s}"] = bench.streamed_loads(c.k, c.v, c.tables, heads=int(heads or 1), pages=int(pages),
                                                              programs_per_sm=int(per_sm))
            if runs[f"streamed {spec_s}"] is None:
                raise SystemExit("--streams needs Triton")

        def pct(name, t):
            return 100 * sizes.get(name, c.nbytes) / t / ceiling

        for mode in ("write", "clean"):
            times = {name: [] for name in runs}
            for _ in range(TURNS):
                for name, fn in runs.items():
                    bench.warm_up(fn, 0.1)
                    times[name].append(bench.timed(fn, flush=mode))
            cells = [f"{name} {min(pct(name, x) for x in t):.1f}-{max(pct(name, x) for x in t):.1f}%"
                     for name, t in times.items()]
            ratios = [f"SDPA time / {name} {min(b / a for a, b in zip(t, times['SDPA'])):.3f}-"
                      f"{max(b / a for a, b in zip(t, times['SDPA'])):.3f}"
                      for name, t in times.items() if name != "SDPA"]
            print(f"{batch} x {ctx} {mode}: {', '.join(cells)}; {'; '.join(ratios)}", flush=True)
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
