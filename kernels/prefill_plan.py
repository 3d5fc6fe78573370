"""The prefill kernel's work list for one step, planned on the host from the step's lengths, and
how the kernel's persistent blocks take it (the schedule).

A sequence of q new tokens has q * group rows (token x query head of its GQA group), cut into
tiles of 16 * warps rows; a work item is one (sequence, row tile), run for every KV head; its cost
is the K/V positions it reads (the cached prefix and the tile's own causal span). The kernel
(``kernels/csrc/paged_prefill_ws.cuh`` on Hopper) takes the list in one of two ways:

- static: the list sorted heaviest first, dealt over the blocks in stripes, alternately forwards
  and backwards; balanced because the costs fall along the list;
- dynamic (the default for the persistent kernel): each block takes the next (item, KV head) pair
  from a device counter when it is ready for one, so any order balances, and the list keeps each
  sequence's items together: the pairs running at once then share their K/V in the L2 (with the
  static stripes they span every sequence, and short prompts in large batches miss the L2:
  docs/performance.md, "Prefill kernel, warp-specialized").

``KVPAGER_PREFILL_SCHEDULE=static|dynamic`` overrides the default. The one-block-per-item kernels
(GPUs before Hopper) always take the heaviest-first list in launch order.

Plan once per step, run per layer (``cuda.plan_prefill``): the list depends only on the step's
lengths. Pure numpy; no GPU needed.
"""

from __future__ import annotations

import os

import numpy as np

PREFILL_WARPS = 8   # warps per prefill block (16 query rows each); kernels/debug.py runs the 4-warp instances
PREFILL_SCHEDULE_ENV = "KVPAGER_PREFILL_SCHEDULE"
PREFILL_SCHEDULES = ("static", "dynamic")


def prefill_schedule(persistent: bool = True) -> str:
    """How the prefill kernel's blocks take their work: ``KVPAGER_PREFILL_SCHEDULE`` where set
    ("static": the list sorted heaviest first, dealt in stripes over the blocks, alternately
    forwards and backwards; "dynamic": each block takes the next item from a device counter when
    it is ready for one, over a list that keeps a sequence's items together, so the items running
    at once share their K/V in the L2; ValueError for others), else "dynamic" for the persistent
    (Hopper) kernel and "static" for the others."""
    value = os.environ.get(PREFILL_SCHEDULE_ENV, "")
    if not value:
        return "dynamic" if persistent else "static"
    return check_schedule(value, PREFILL_SCHEDULE_ENV)


def check_schedule(value: str, what: str = "schedule") -> str:
    """``value`` if it names a schedule, else ValueError naming ``what`` (a variable, an argument)."""
    if value not in PREFILL_SCHEDULES:
        raise ValueError(f"{what} must be one of {', '.join(PREFILL_SCHEDULES)}, got {value!r}")
    return value


def prefill_work(starts, context_lens, group: int, warps: int | None = None, seqs=None,
                 order: str = "heaviest") -> np.ndarray:
    """The prefill kernel's work list, int32 ``[num_items, 2]`` of (sequence, row tile), from
    HOST lengths: ``starts`` the query CSR offsets (num_seqs + 1), ``context_lens`` (num_seqs).
    A sequence of q new tokens has q * group rows (token x GQA head), cut into tiles of
    16 * warps rows; an item's cost is the K/V positions it reads. ``order``: "heaviest" (every
    item by cost, most first: the static schedule's balance needs it) or "by_sequence" (the
    sequences by their heaviest item, most first, each sequence's items together, heaviest
    first: for the dynamic schedule, which balances any order, and whose blocks then work on
    few sequences at a time). ``seqs``: the sequences to cover (default: every one with new
    tokens). O(items log items)."""
    if order not in ("heaviest", "by_sequence"):
        raise ValueError(f"order must be 'heaviest' or 'by_sequence', got {order!r}")
    rows_per_tile = 16 * (warps or PREFILL_WARPS)
    starts = np.asarray(starts, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    q = starts[1:] - starts[:-1]
    ids = np.nonzero(q > 0)[0] if seqs is None else np.asarray(seqs, dtype=np.int64)
    if len(ids) == 0:
        return np.zeros((0, 2), dtype=np.int32)
    rows = q[ids] * group
    tiles = (rows + rows_per_tile - 1) // rows_per_tile
    seq = np.repeat(ids, tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile = np.arange(len(seq)) - first
    last_row = np.minimum(np.repeat(rows, tiles), (tile + 1) * rows_per_tile) - 1
    cost = ctx[seq] - q[seq] + last_row // group + 1
    if order == "heaviest":
        order_idx = np.argsort(-cost, kind="stable")
    else:
        group_of_item = np.repeat(np.arange(len(ids)), tiles)
        heaviest = np.full(len(ids), np.iinfo(np.int64).min)
        np.maximum.at(heaviest, group_of_item, cost)
        rank = np.empty(len(ids), dtype=np.int64)
        rank[np.argsort(-heaviest, kind="stable")] = np.arange(len(ids))
        order_idx = np.lexsort((-cost, rank[group_of_item]))
    return np.ascontiguousarray(np.stack([seq[order_idx], tile[order_idx]], axis=1).astype(np.int32))
