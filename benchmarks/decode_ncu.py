"""One work-list decode and one torch SDPA call (contiguous cache) per shape, each after a clean L2
flush, inside an NVTX range named ``profile_<shape>``: the driver for Nsight Compute comparisons of
our decode kernel with the SDPA backend's (cuDNN's, on the lent GPUs). Both are warmed up first.

    ncu --nvtx --nvtx-include "profile_64x4096/" --metrics gpu__time_duration.sum,\\
        dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,\\
        smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,... --csv \\
        python3 benchmarks/decode_ncu.py 64x4096

Prints the decode instance and work list of each shape.
"""

from __future__ import annotations

import sys

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes and the L2 flush
import torch


def main(shapes: list[str]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    for spec in shapes:
        batch, ctx = (int(x) for x in spec.split("x"))
        c = bench.decode_layer(batch, ctx, gen)
        for _ in range(5):
            c.decode()
            c.sdpa()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"profile_{spec}")
        for fn in (c.decode, c.sdpa):
            bench.flush_l2("clean")
            fn()
            torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        g = c.step.geometry
        print(f"{spec}: {'tensor-core' if g.mma else 'FMA'} instance, {g.loads} loads, {g.workers} workers a KV head, "
              f"{int(c.step.work[0])} items of {int(c.step.work[1])} tokens", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["8x4096"])
