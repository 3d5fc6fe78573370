"""One shape of ``benchmarks/kernels.py --only prefill_kernel``, run a few times through our
prefill kernel (the wgmma instance: on Hopper the warp-specialized kernel), for a profiler or a
sanitizer to look at; prints nothing else. bf16, 32q/8kv, d128, block 16, K/V in a 2-layer
block-major cache behind randperm'd tables, as there; ``--fp8``: the cache quantized to e4m3, as
``--only prefill_fp8`` runs it.

    ncu --kernel-name regex:paged_prefill_ws --launch-skip 2 --launch-count 1 --set full \\
        --import-source yes -o ws4k python3 benchmarks/prefill_shape.py "1 x 4K prompt"
    compute-sanitizer --tool racecheck python3 benchmarks/prefill_shape.py "ragged: 24 prompts 16-1K"
    python3 benchmarks/prefill_shape.py --list

``--sdpa cudnn`` (or flash, efficient) runs torch SDPA on that backend instead, over the shape laid
out contiguously as ``--only prefill_kernel`` times it (``--expand``: K/V repeated to the query
heads), so that the same profiler compares our kernel with the one we are measured against:

    ncu --kernel-name regex:"cudnn|flash|fmha" --launch-skip 2 --launch-count 1 --set full \
        -o sdpa512 python3 benchmarks/prefill_shape.py "32 x 512 prompts" --sdpa cudnn
"""

from __future__ import annotations

import argparse

import kernels as bench  # benchmarks/kernels.py (this script's folder): the shapes and the configuration
import torch

from kvpager.kernels import cuda, debug


def main() -> None:
    shapes = dict(bench.PREFILL_SHAPES + bench._ragged_prefill_shapes())
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", default="1 x 4K prompt", help="a shape name (--list)")
    ap.add_argument("--list", action="store_true", help="print the shape names")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--schedule", choices=("static", "dynamic"), default=None,
                    help="the persistent kernel's schedule (default: KVPAGER_PREFILL_SCHEDULE, else dynamic)")
    ap.add_argument("--sdpa", choices=("flash", "efficient", "cudnn"), default=None,
                    help="run torch SDPA on this backend over the contiguous layout instead of our kernel")
    ap.add_argument("--expand", action="store_true", help="with --sdpa: K/V repeated to the query heads")
    ap.add_argument("--fp8", action="store_true",
                    help="our kernel over the cache quantized to fp8 e4m3 (k_scale = v_scale = 4, as "
                         "--only prefill_fp8)")
    args = ap.parse_args()
    if args.list:
        print("\n".join(shapes))
        return
    if args.shape not in shapes:
        ap.error(f"unknown shape {args.shape!r}; --list names them")
    c = bench.prefill_case(shapes[args.shape], torch.Generator(device="cuda").manual_seed(1))
    scale = bench.D ** -0.5
    if args.sdpa:
        from torch.nn.attention import SDPBackend

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION}[args.sdpa]
        run = bench.sdpa_runner(*bench.contiguous_prefill(c, shapes[args.shape]), scale, backend, args.expand)
    else:
        k, v, kv_scale = c.k, c.v, 1.0
        if args.fp8:
            from kvpager.kernels.reference import FP8

            cache8 = (c.cache * 0.25).to(FP8)
            k, v, kv_scale = cache8[:, 0, 0], cache8[:, 0, 1], 4.0
        plan = debug.plan_prefill(c.query, k, c.host, warps=8, wgmma=True, schedule=args.schedule)
        run = lambda: cuda.paged_prefill_run(plan, c.query, k, v, c.tables, c.lens, c.starts, scale,  # noqa: E731
                                             kv_scale, kv_scale)
    for _ in range(args.runs):
        run()
    torch.cuda.synchronize()
    print(f"ran {args.shape!r} {args.runs} times" + (f" on SDPA ({args.sdpa})" if args.sdpa else "")
          + (" over an fp8 cache" if args.fp8 and not args.sdpa else ""))


if __name__ == "__main__":
    main()
