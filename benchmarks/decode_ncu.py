"""One work-list decode and one torch SDPA call (contiguous cache) per shape, each after an L2
flush, inside an NVTX range named ``profile_<shape>``: the driver for Nsight Compute comparisons of
our decode kernel with the SDPA backend's (cuDNN's, on the lent GPUs). All are warmed up first.

    ncu --nvtx --nvtx-include "profile_64x4096/" --metrics gpu__time_duration.sum,\\
        dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,\\
        smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,... --csv \\
        python3 benchmarks/decode_ncu.py 64x4096

``--flush write`` flushes with the write that leaves the L2 full of dirty lines (the clean flush
by default; ``benchmarks/kernels.py`` ``flush_l2``): with ``ncu --cache-control none`` each kernel
then meets them, and ``dram__bytes_write.sum`` counts the ones its reads evicted. ``--mma`` adds the
other decode instance's work list (the tensor-core one on an H100), ``--bars`` Triton's streamed
loads-only read of the same pages (``decode_turns.py --bars``), with and without evict-first loads.

Prints the decode instance and work list of each shape.
"""

from __future__ import annotations

import argparse

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes and the L2 flush
import torch

from kvpager.kernels import cuda, debug


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=["8x4096"], help="batch x context")
    ap.add_argument("--flush", choices=("clean", "write"), default="clean")
    ap.add_argument("--mma", action="store_true", help="also the other decode instance's work list")
    ap.add_argument("--bars", action="store_true", help="also Triton's streamed read, plain and evict-first")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(2)
    for spec in args.shapes:
        batch, ctx = (int(x) for x in spec.split("x"))
        c = bench.decode_layer(batch, ctx, gen)
        runs = [c.decode, c.sdpa]
        if args.mma:
            other = bench.work_step(c.lens.tolist(), debug.decode_work_geometry(c.q, c.k, mma=not c.step.geometry.mma))
            out = torch.empty_like(c.out)
            scale = c.q.shape[-1] ** -0.5
            runs.append(lambda: cuda.paged_decode_run(other, c.q, c.k, c.v, c.tables, c.lens, scale, out=out))
        if args.bars:
            runs += [bench.streamed_loads(c.k, c.v, c.tables), bench.streamed_loads(c.k, c.v, c.tables, evict_first=True)]
            if runs[-1] is None:
                raise SystemExit("--bars needs Triton")
        for _ in range(5):
            for fn in runs:
                fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"profile_{spec}")
        for fn in runs:
            bench.flush_l2(args.flush)
            fn()
            torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        g = c.step.geometry
        print(f"{spec}: {'tensor-core' if g.mma else 'FMA'} instance, {g.loads} loads, {g.workers} workers a KV head, "
              f"{int(c.step.work[0])} items of {int(c.step.work[1])} tokens", flush=True)


if __name__ == "__main__":
    main()
