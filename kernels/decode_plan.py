"""The decode kernel's work list for one step, planned on the host from the step's real lengths.

Why: a decode batch is ragged. Splitting every sequence by the table's width (the longest
sequence) gives short sequences empty splits and long ones too few, so a wave ends with a few
thread blocks still reading while the rest of the GPU idles. Here the step's token ranges are cut
into pieces of one size P and ordered so that every thread block of the launch (a fixed number of
"workers" per KV head, as many as stay resident together) gets about the same number of tokens.

The worker runs this planner's C++ twin (``kernels/csrc/decode_plan.cu`` ``plan_decode_work``,
equal to this one: tests/gpu compares them); this one is the readable reference.

Plan once per step, run per layer: the list depends only on the step's context lengths, so every
layer's launch reads the same list (and a CUDA graph replays it: the launch geometry is fixed by
the model and the device, ``cuda.decode_work_geometry``, only the list's contents change).

Layout (int32, ``kernels/csrc/launch.h``, ``DecodeArgs::work``)::

    [n, P, 0, 0]                      header (HEADER ints; the caller may set int 2 to the block
                                      tables' row stride, e.g. a CUDA graph's packed tables)
    capacity item records of 2 ints   (seq << 16 | piece, end): tokens [piece * P, end) of seq;
                                      the first n used, in the order dealt (below): worker y's
                                      round-r item is item r * workers + (y, or workers - 1 - y
                                      in odd rounds), found with no offsets to read first
    2 ints per sequence                first partial row, number of pieces (1 = written directly)

Choosing P: a few candidates, each scored by the exact makespan of its assignment (tokens plus
``item_cost`` per item, on the busiest worker): whole sequences (P = the longest item the kernel
stages), pieces of total / (R * workers) tokens for R in ROUNDS and, beside each of those, the
size just above it that cuts the longest context into m equal pieces, m = longest // it (all at
least ``min_item``; on uniform batches total / (R * workers) leaves every sequence a short last
piece: 32 x 16K's busiest worker 4% lighter, ``benchmarks/plan_balance.py``); the lowest makespan
wins, the larger P on ties. A size of at least the longest context is counted as whole sequences.
Items are sorted longest first and dealt in rounds over the workers, every other round in
reverse (a snake), so no worker gets the long pieces of every round. Cost: O(S + n log n) numpy
work per candidate (0.2-0.4 ms in all for 100-500 sequences on a slow host core).
"""

from __future__ import annotations

import numpy as np

from kvpager.numeric import ceil_div

HEADER = 4
ALIGN = 64          # a piece's token count is a multiple of this (kPartitionAlign)
MAX_PIECES = 256    # pieces of one sequence (kMaxSplits: the merge stages one weight per piece)
MAX_ROUNDS = 16     # items per worker the planner aims at, at most
ROUNDS = (1, 2, 4, 8, MAX_ROUNDS)
MIN_ITEM = 256      # tokens: shorter pieces cost more in prologue and merge than they balance
# Tokens' worth of time an item costs beyond its tokens (prologue, partial rows, merge, and the
# spread more items bring), by the cache's element size. Measured on an H100 (docs/performance.md,
# seventeenth session: 8 draws of each ragged shape timed by turns with costs 96-768, head_dim 128
# and 64): 192 over 16-bit caches read 0.1-0.7 point more on average than the earlier 96 and never
# less; 384 over fp8 ones, whose tokens take half the bytes, 1.5-1.9 more than 96 on ragged 128 x 8K
# and within 0.2 on 64 x 32K (4 more on one draw that 96 cut into 414 items); costlier still, long
# ragged batches lost up to 1 point. Uniform batches plan the same with any of them.
ITEM_COST = 192
ITEM_COST_FP8 = 384


def item_cost_for(cache_element_bytes: int) -> int:
    """The planner's ``item_cost`` for a cache of elements this many bytes wide."""
    return ITEM_COST_FP8 if cache_element_bytes == 1 else ITEM_COST


def capacity_for(num_seqs: int, workers: int) -> int:
    """Item slots a plan for ``num_seqs`` rows needs at most: one per row plus MAX_ROUNDS per worker."""
    return num_seqs + MAX_ROUNDS * workers


def plan_size(num_seqs: int, capacity: int) -> int:
    """Ints of a plan for ``num_seqs`` rows and ``capacity`` item slots."""
    return HEADER + 2 * capacity + 2 * num_seqs


def plan_decode_work(context_lens, workers: int, longest_item: int, capacity: int | None = None, *,
                     min_item: int = MIN_ITEM, item_cost: int = ITEM_COST) -> np.ndarray:
    """The work list (int32, layout above) for sequences of these context lengths (a list or an
    integer array; lengths <= 0 get one empty item, so their output rows are written as zeros).
    ``workers``: thread blocks per KV head of the launch; ``longest_item``: the most tokens one
    item may hold (``cuda.decode_work_geometry``); ``capacity``: item slots (default
    ``capacity_for``). Raises ValueError when no piece size fits (a context longer than
    MAX_PIECES * longest_item, or too small a capacity)."""
    ctx = np.maximum(np.asarray(context_lens, dtype=np.int64), 0)
    num_seqs = len(ctx)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    capacity = capacity_for(num_seqs, workers) if capacity is None else capacity
    if capacity < num_seqs:
        raise ValueError(f"capacity {capacity} is below the {num_seqs} rows (one item each at least)")
    hi = longest_item // ALIGN * ALIGN
    longest = int(ctx.max()) if num_seqs else 0
    lo = max(ALIGN, _align_up(ceil_div(longest, MAX_PIECES)))
    if hi < lo:
        raise ValueError(f"a context of {longest} tokens needs pieces of {lo} tokens, above the kernel's "
                         f"{hi} (at most {MAX_PIECES} pieces per sequence)")
    total = int(ctx.sum())
    floor = max(lo, min(min_item, hi))

    def clamp(size: int) -> int:   # a size of at least the longest context leaves every sequence whole, as hi does
        aligned = min(hi, max(floor, _align_up(size)))
        return hi if aligned >= longest else aligned

    sizes = {hi}
    for r in ROUNDS:
        even = clamp(ceil_div(total, r * workers))
        sizes.add(even)
        if longest > 0:   # the size just above it cutting the longest context into equal pieces
            sizes.add(clamp(ceil_div(longest, max(1, longest // even))))
    best = None
    for size in sorted(sizes, reverse=True):
        pieces = np.maximum(1, -(-ctx // size))
        if int(pieces.sum()) > capacity:
            continue
        seq, piece, tokens = _sorted_items(ctx, pieces, size)
        span = int(worker_loads(tokens, workers, item_cost).max())
        if best is None or span < best[0] or (span == best[0] and size > best[1]):
            best = (span, size, pieces, seq, piece, tokens)
    if best is None:
        raise ValueError(f"{num_seqs} sequences of {total} tokens do not fit {capacity} items")
    _, size, pieces, seq, piece, tokens = best
    n = len(seq)
    out = np.zeros(plan_size(num_seqs, capacity), dtype=np.int32)
    out[0], out[1] = n, size
    records = out[HEADER:HEADER + 2 * capacity].reshape(capacity, 2)
    records[:n, 0] = ((seq << 16) | piece).astype(np.uint32).view(np.int32)
    records[:n, 1] = piece * size + tokens
    spans = out[HEADER + 2 * capacity:].reshape(num_seqs, 2)
    spans[:, 1] = pieces
    spans[1:, 0] = np.cumsum(pieces[:-1])
    return out


def worker_loads(tokens: np.ndarray, workers: int, item_cost: int = ITEM_COST) -> np.ndarray:
    """Each worker's load in the planner's model: the tokens of the items dealt to it (items in
    list order, ``tokens`` each, snake deal) plus ``item_cost`` per item."""
    return np.bincount(_snake(len(tokens), workers), weights=tokens + item_cost, minlength=workers)


def _align_up(x: int) -> int:
    return ceil_div(x, ALIGN) * ALIGN


def _sorted_items(ctx: np.ndarray, pieces: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq, piece, tokens) of every item, longest first: every piece but a sequence's last holds
    ``size`` tokens; the last pieces follow by length."""
    inner = pieces - 1
    seq_inner = np.repeat(np.arange(len(ctx), dtype=np.int64), inner)
    piece_inner = np.arange(len(seq_inner), dtype=np.int64) - np.repeat(np.cumsum(inner) - inner, inner)
    last_tokens = ctx - inner * size
    seq_last = np.argsort(-last_tokens, kind="stable")
    tokens = np.concatenate([np.full(len(seq_inner), size), last_tokens[seq_last]])
    return np.concatenate([seq_inner, seq_last]), np.concatenate([piece_inner, inner[seq_last]]), tokens


def _snake(n: int, workers: int) -> np.ndarray:
    """The worker of each of n items dealt in rounds over the workers, odd rounds in reverse."""
    k = np.arange(n)
    j = k % workers
    return np.where((k // workers) % 2 == 1, workers - 1 - j, j)
