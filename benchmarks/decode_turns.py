"""Our work-list decode and torch SDPA (contiguous cache) on the short decode shapes, event-timed
by turns: ours, SDPA, ours, SDPA, ... four times each, each after a warm-up, under both L2
flushes; % of the copy ceiling and SDPA's time over ours per turn. By turns because the H100 runs
at its power cap and its clock follows what ran before (docs/performance.md, eighth session);
the decode's merge is a programmatic dependent launch, so kernels.kernel_time does not apply.

    python3 benchmarks/decode_turns.py
"""

from __future__ import annotations

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes, flush and timers
import torch

SHAPES = [(8, 4096), (1, 32768), (32, 2048)]
TURNS = 4


def main() -> None:
    ceiling = bench.copy_ceiling()
    gen = torch.Generator(device="cuda").manual_seed(2)
    for batch, ctx in SHAPES:
        c = bench.decode_layer(batch, ctx, gen)
        ours, sdpa = c.decode, c.sdpa

        def pct(t):
            return 100 * c.nbytes / t / ceiling

        for mode in ("write", "clean"):
            mine, theirs = [], []
            for _ in range(TURNS):
                bench.warm_up(ours, 0.1)
                mine.append(bench.timed(ours, flush=mode))
                bench.warm_up(sdpa, 0.1)
                theirs.append(bench.timed(sdpa, flush=mode))
            ratios = [b / a for a, b in zip(mine, theirs)]
            print(f"{batch} x {ctx} {mode}: ours {min(map(pct, mine)):.1f}-{max(map(pct, mine)):.1f}%, "
                  f"SDPA {min(map(pct, theirs)):.1f}-{max(map(pct, theirs)):.1f}%, "
                  f"SDPA time / ours {min(ratios):.3f}-{max(ratios):.3f}", flush=True)
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
