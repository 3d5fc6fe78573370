"""How evenly the decode work list fills the launch's resident thread blocks, on this CPU (no
GPU): for each step shape, the planner's list (kernels/decode_plan.py, the C++ planner's
reference) per KV head, with its workers' loads in tokens plus the planner's per-item cost.

- idle: workers with no item (each a resident block slot that reads nothing);
- busiest / even: the busiest worker's load over the step's tokens / workers: what the step takes
  over an even split with no per-item cost (the planner's own model; the GPU adds its ramp, end
  spread and merge);
- with divisor sizes: the best busiest / even in the same model when the candidate piece sizes
  also include the longest context cut into m equal aligned pieces for every m up to 64 (the
  planner's candidates are total / (rounds * workers), which on uniform batches leave a short last
  piece per sequence, and beside each the one such size just above it: where this column is
  lower, a divisor size the planner does not try would do better);
- an even split's items: the items a list needs to give every worker the same tokens, cutting
  sequences at worker boundaries (stream-K), how many of the sequences it cuts, and its busiest
  worker over the even share with the same per-item cost: the extra items of the workers whose
  share crosses a sequence's end cost about what the even shares save (2026-11-27, seventeenth
  session: with an item cost of 96 tokens, lighter than the planner's busiest worker by 0.2-2.5%
  on 7 of the 11 shapes and heavier by 4-13% on the other 4; with the planner's measured 192,
  lighter by 0.7-2.1% on 3 and heavier by up to 25% on 8). Built and timed on an H100 the
  nineteenth session (docs/performance.md, "Equal shares (stream-K) and deeper prefetch for the
  short decode steps"): no faster on any shape, so the planner cuts pieces only.

The decode timeline (benchmarks/decode_timeline.py, docs/performance.md "Where a short decode
step's time goes") found 8 x 4K and 64 x 4K ending late by their idle slots: 512 blocks on 528.

    python3 benchmarks/plan_balance.py [--workers 66] [--longest 33280]
"""

from __future__ import annotations

import argparse

import numpy as np

from kvpager.kernels import decode_plan

UNIFORM = [(1, 32768), (8, 4096), (32, 2048), (64, 4096), (128, 2048), (256, 1024), (32, 16384)]
RAGGED = [(128, 8192), (64, 32768), (256, 2048), (276, 2600)]


def loads(plan: np.ndarray, workers: int, item_cost: int) -> np.ndarray:
    """Each worker's planned load (tokens + item_cost per item) of a work list."""
    n, size = int(plan[0]), int(plan[1])
    records = plan[decode_plan.HEADER:decode_plan.HEADER + 2 * n].reshape(n, 2)
    piece = records[:, 0].view(np.uint32) & 0xFFFF
    tokens = records[:, 1] - piece.astype(np.int64) * size
    return decode_plan.worker_loads(tokens, workers, item_cost)


def best_with_sizes(lens: np.ndarray, workers: int, sizes: list[int], item_cost: int) -> tuple[float, int]:
    """(busiest worker's load, piece size) of the best of these piece sizes in the planner's own
    model (its items, order and snake deal: decode_plan's helpers; a load is tokens plus item_cost
    per item): the lowest busiest load, the larger size on ties, as the planner picks."""
    best = (np.inf, 0)
    for size in sorted(set(sizes), reverse=True):
        pieces = np.maximum(1, -(-lens // size))
        if int(pieces.max()) > decode_plan.MAX_PIECES:
            continue
        _, _, tokens = decode_plan._sorted_items(lens, pieces, size)
        busiest = float(decode_plan.worker_loads(tokens, workers, item_cost).max())
        if busiest < best[0] - 1e-9:
            best = (busiest, size)
    return best


def divisor_sizes(lens: np.ndarray, longest: int) -> list[int]:
    """Piece sizes that cut the longest context into m equal aligned pieces (m = 1 .. 64), beyond
    the one beside each total / (rounds * workers) that the planner tries."""
    top, align = int(lens.max()), decode_plan.ALIGN
    sizes = (-(-(-(-top // m)) // align) * align for m in range(1, 65))   # ceil(top / m), aligned up
    return [size for size in sizes if align <= size <= longest]


def even_split(lens: np.ndarray, workers: int, longest: int, item_cost: int = 0) -> tuple[int, int, float]:
    """(items, sequences cut, busiest worker's load) of a list giving every worker total / workers
    tokens (shares of the step's tokens laid end to end; a share crossing a sequence's end is two
    items, and no item longer than ``longest``), a load being its tokens plus ``item_cost`` per
    item: stream-K's deal in the planner's model."""
    total = int(lens.sum())
    share = -(-total // workers)
    ends = np.cumsum(lens)
    starts = ends - lens
    items, cut_seqs = 0, set()
    busiest = 0.0
    for w in range(workers):
        lo, hi = w * share, min(total, (w + 1) * share)
        if hi <= lo:
            continue
        first, last = np.searchsorted(ends, lo, side="right"), np.searchsorted(ends, hi - 1, side="right")
        mine = 0
        for i in range(int(first), int(last) + 1):
            a, b = max(lo, int(starts[i])), min(hi, int(ends[i]))
            mine += -(-(b - a) // longest)
            if (a, b) != (int(starts[i]), int(ends[i])):
                cut_seqs.add(i)
        items += mine
        busiest = max(busiest, hi - lo + item_cost * mine)
    cut_seqs |= {i for i in range(len(lens)) if lens[i] > longest}
    return items, len(cut_seqs), busiest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=66, help="workers per KV head (66: 4 blocks an SM on an H100)")
    ap.add_argument("--longest", type=int, default=33280,
                    help="the most tokens an item may hold (33,280: bf16 d128 block 16, the FMA instance's geometry)")
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    cases = [("uniform", b, c, np.full(b, c)) for b, c in UNIFORM]
    cases += [("ragged", b, c, rng.integers(1, c + 1, b)) for b, c in RAGGED]
    print(f"{'kind':>7} {'batch x ctx':>12} | {'items':>5} {'P':>5} {'idle':>4} {'busiest/even':>12} | "
          f"with divisor sizes: {'P':>5} {'busiest/even':>12} | even split: {'items':>5} {'cut':>4} {'busiest/even':>12}")
    for kind, batch, ctx, lens in cases:
        plan = decode_plan.plan_decode_work(lens, args.workers, args.longest)
        load = loads(plan, args.workers, decode_plan.ITEM_COST)
        idle = int((load == 0).sum())
        items, cut, split_busiest = even_split(lens, args.workers, args.longest, decode_plan.ITEM_COST)
        sizes = [int(plan[1]), *divisor_sizes(lens, args.longest)]
        busiest, size = best_with_sizes(lens, args.workers, sizes, decode_plan.ITEM_COST)
        even = lens.sum() / args.workers
        print(f"{kind:>7} {batch:>5} x {ctx:<6} | {int(plan[0]):>5} {int(plan[1]):>5} {idle:>4} "
              f"{load.max() / even:>12.3f} | {'':>19} {size:>5} {busiest / even:>12.3f} | {'':>12}{items:>5} {cut:>4} "
              f"{split_busiest / even:>12.3f}")


if __name__ == "__main__":
    main()
