"""The decode work-list planner (kernels/decode_plan.py): every token covered once, spans and
item ends consistent, balance across workers, clear refusals; and the plan's semantics checked by
running it in float64 torch (pieces attended separately, merged by log-sum-exp) against the
reference attention over random paged K/V. The CUDA kernel and the C++ twin of the planner are
checked on the GPU (tests/gpu/test_cuda_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpager.kernels import decode_plan, reference
from kvpager.kernels.decode_plan import HEADER, plan_decode_work
from kvpager.numeric import ceil_div


def _parts(plan: np.ndarray, rows: int):
    """(n, size, seq, piece, end, spans) of a plan of pieces: its n items in the order dealt."""
    capacity = (len(plan) - HEADER - 2 * rows) // decode_plan.RECORD
    rec = decode_plan.records_of(plan, rows)
    assert (plan[HEADER + decode_plan.RECORD * rec.n:HEADER + decode_plan.RECORD * capacity] == 0).all()
    assert (rec.start == rec.piece * rec.piece_size).all()
    return rec.n, rec.piece_size, rec.seq, rec.piece, rec.end, rec.spans


def _worker_items(n: int, workers: int, y: int) -> list[int]:
    """The items worker y runs, in order, as the kernel finds them: round r's at r * workers + y,
    or + workers - 1 - y in odd rounds."""
    found, r = [], 0
    while (k := r * workers + (workers - 1 - y if r % 2 else y)) < n:
        found.append(k)
        r += 1
    return found


def _check(lens, workers, longest_item=32768):
    plan = plan_decode_work(lens, workers, longest_item)
    rows = len(lens)
    n, size, seq, piece, end, spans = _parts(plan, rows)
    ctx = np.maximum(np.asarray(lens), 0)
    assert size % decode_plan.ALIGN == 0 and size <= longest_item
    assert n <= decode_plan.capacity_for(rows, workers)
    assert (end == np.minimum(ctx[seq], (piece + 1) * size)).all()
    # Every item run by exactly one worker.
    assert sorted(k for y in range(workers) for k in _worker_items(n, workers, y)) == list(range(n))
    pieces = np.maximum(1, -(-ctx // size))
    assert (spans[:, 1] == pieces).all() and (pieces <= decode_plan.MAX_PIECES).all()
    assert (spans[:, 0] == np.cumsum(pieces) - pieces).all()
    # Each (seq, piece) exactly once: the pieces tile [0, ctx) of every row.
    assert sorted(zip(seq.tolist(), piece.tolist())) == [(s, p) for s in range(rows) for p in range(pieces[s])]
    return plan, size, seq, piece, end


@pytest.mark.parametrize("workers", [1, 7, 132])
def test_pieces_cover_every_token_once(workers):
    rng = np.random.default_rng(workers)
    for lens in ([1], [0, 0, 5], rng.integers(1, 9000, 50), rng.integers(-3, 40, 300), [70000, 3],
                 np.full(64, 4096)):
        _check(list(lens), workers)


def test_ragged_batches_are_balanced_across_workers():
    """The busiest worker holds at most a few percent more than the average (cost model:
    tokens + ITEM_COST per item) on the ragged batches serving produces."""
    rng = np.random.default_rng(0)
    workers = 132
    for lens in (rng.integers(1, 8193, 128), rng.integers(1, 32769, 64), rng.integers(1, 2049, 256),
                 rng.integers(128, 2600, 276), np.full(64, 4096), [32768]):
        _, size, seq, piece, end = _check(list(lens), workers)
        tokens = end - piece * size + decode_plan.ITEM_COST
        worker = np.zeros(len(seq), np.int64)
        for y in range(workers):
            worker[_worker_items(len(seq), workers, y)] = y
        loads = np.bincount(worker, weights=tokens, minlength=workers)
        average = tokens.sum() / workers
        assert loads.max() <= 1.08 * average + size / 4, (len(lens), size, loads.max(), average)


def test_fp8_caches_count_an_item_dearer():
    """A one-byte cache's tokens take half the time, so an item's fixed cost is worth more of them:
    on this ragged batch the 16-bit cost cuts sequences (578 items of 2,752 tokens), the fp8 cost
    keeps every sequence whole."""
    assert decode_plan.item_cost_for(1) == decode_plan.ITEM_COST_FP8
    assert decode_plan.item_cost_for(2) == decode_plan.item_cost_for(4) == decode_plan.ITEM_COST
    rng = np.random.default_rng(0)
    for _ in range(2):   # (the search's first trials)
        rng.integers(1, 8192, int(rng.integers(60, 300)))
    lens = rng.integers(1, 8192, int(rng.integers(60, 300)))
    cut = plan_decode_work(lens, 66, 66560)
    whole = plan_decode_work(lens, 66, 66560, item_cost=decode_plan.ITEM_COST_FP8)
    assert (int(cut[0]), int(cut[1])) == (578, 2752)
    assert (int(whole[0]), int(whole[1])) == (len(lens), 66560)


def test_a_long_sequence_is_split_and_short_ones_are_whole():
    _, size, seq, piece, _ = _check([40000, 10, 20], 64)
    assert size < 40000 and piece[seq == 0].max() > 0 and (piece[seq > 0] == 0).all()


def test_refusals_name_the_limit():
    with pytest.raises(ValueError, match="pieces of"):
        plan_decode_work([256 * 4096 + 1], 8, 4096)
    with pytest.raises(ValueError, match="capacity"):
        plan_decode_work([5, 5, 5], 8, 4096, capacity=2)
    with pytest.raises(ValueError, match="workers"):
        plan_decode_work([5], 0, 4096)


def _check_shares(lens, workers, share_align, longest_item=32768):
    """An equal-shares plan: every token of every row in exactly one item, pieces numbered in
    stream order and counted by the spans, every worker's tokens within share_align (and a row's
    end) of total / workers, starts aligned, empty rows one empty item each, at most
    MAX_PIECES pieces a row."""
    plan = plan_decode_work(lens, workers, longest_item, share_align=share_align)
    assert plan[1] == 0, "planned pieces, not equal shares"
    rows = len(lens)
    ctx = np.maximum(np.asarray(lens), 0)
    rec = decode_plan.records_of(plan, rows)
    assert rec.n % workers == 0 and rec.n <= decode_plan.capacity_for(rows, workers)
    live = rec.seq != decode_plan.SKIP_SEQ
    assert (rec.start[live] % share_align == 0).all() and (rec.start[~live] == 0).all()
    assert (rec.end[live] - rec.start[live] <= longest_item - decode_plan.ALIGN).all()
    for s in range(rows):
        mine = np.flatnonzero(live & (rec.seq == s))
        mine = mine[np.argsort(rec.piece[mine])]
        assert (rec.piece[mine] == np.arange(len(mine))).all() and len(mine) == rec.spans[s, 1]
        assert rec.spans[s, 0] == int(rec.spans[:s, 1].sum())
        if ctx[s] == 0:
            assert len(mine) == 1 and rec.start[mine[0]] == rec.end[mine[0]] == 0
            continue
        bounds = np.stack([rec.start[mine], rec.end[mine]], 1).ravel()
        assert bounds[0] == 0 and bounds[-1] == ctx[s] and (bounds[1:-1:2] == bounds[2::2]).all()
        assert (rec.end[mine] > rec.start[mine]).all()
    tokens = np.zeros(workers, np.int64)
    for y in range(workers):
        items = [k for k in _worker_items(rec.n, workers, y) if live[k]]
        tokens[y] = sum(int(rec.end[k] - rec.start[k]) for k in items)
        assert [int(rec.seq[k]) for k in items if ctx[rec.seq[k]] > 0] == sorted(
            int(rec.seq[k]) for k in items if ctx[rec.seq[k]] > 0)   # stream order
    assert tokens.sum() == ctx.sum()
    assert tokens.max() - tokens.min() <= share_align * (1 + int((ctx > 0).sum())), tokens
    return rec


@pytest.mark.parametrize("share_align", [1, 8])
def test_equal_shares_give_every_worker_the_same_tokens(share_align):
    rng = np.random.default_rng(share_align)
    for lens, workers in (([4096] * 8, 66), ([32768], 66), ([4096] * 64, 66), (list(rng.integers(1, 9000, 50)), 132),
                          (list(rng.integers(-3, 400, 300)), 7), ([0, 0, 5], 66), ([3, 0, 70000, 0, 1], 66)):
        _check_shares(lens, workers, share_align)


def test_equal_shares_of_8_x_4k():
    """The stream-K cut of the decode benchmark's 8 x 4K: 66 shares of 496 or 497 tokens; of the 7
    row ends inside the stream one falls on a cut (share 33 starts row 4), the 6 shares across the
    others run as two items (72 in all), every row cut into 9 pieces."""
    rec = _check_shares([4096] * 8, 66, 1)
    live = rec.seq != decode_plan.SKIP_SEQ
    assert rec.n == 132 and int(live.sum()) == 72 and (rec.spans[:, 1] == 9).all()
    assert sorted({int(x) for x in rec.end[:66] - rec.start[:66]})[-1] <= 497


def test_equal_shares_fall_back_to_pieces():
    """Shares that cannot be planned (one longer than an item may be; a row in more than
    MAX_PIECES pieces) plan pieces, as without share_align."""
    for lens, workers, longest in (([40000, 40000], 2, 32768), ([300 * 64], 300, 32768)):
        plan = plan_decode_work(lens, workers, longest, share_align=1)
        assert plan[1] > 0
        assert np.array_equal(plan, plan_decode_work(lens, workers, longest))


def _run_plan(plan, workers, query, k_cache, v_cache, tables, lens, scale):
    """Float64 attention executed the way the kernel executes a plan: each item over its token
    range (log-sum-exp partials), skip records skipped, the pieces of a row merged."""
    rows = len(lens)
    n, _, seq, piece, start, end, spans = decode_plan.records_of(plan, rows)
    heads, dim = query.shape[1], query.shape[2]
    group = heads // k_cache.shape[1]
    bs = k_cache.shape[2]
    partial = {}
    for w in range(workers):
        for i in _worker_items(n, workers, w):
            if seq[i] == decode_plan.SKIP_SEQ:
                continue
            s, p = int(seq[i]), int(piece[i])
            lo, hi = int(start[i]), int(end[i])
            pos = torch.arange(lo, max(lo, hi))
            blocks = tables[s, pos // bs].long()
            k = k_cache[blocks, :, pos % bs].repeat_interleave(group, dim=1)   # [t, heads, dim]
            v = v_cache[blocks, :, pos % bs].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,thd->ht", query[s], k) * scale
            m = scores.max(dim=1).values if len(pos) else torch.full((heads,), -torch.inf, dtype=torch.float64)
            e = torch.exp(scores - m[:, None])
            partial[(s, p)] = (m, e.sum(1), torch.einsum("ht,thd->hd", e, v))
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for s in range(rows):
        parts = [partial[(s, p)] for p in range(int(spans[s, 1]))]
        m = torch.stack([x[0] for x in parts]).max(0).values
        if not torch.isfinite(m).all():
            continue   # an empty row: zeros
        w = [torch.exp(x[0] - m) for x in parts]
        total = sum(wi * x[1] for wi, x in zip(w, parts))
        out[s] = sum(wi[:, None] * x[2] for wi, x in zip(w, parts)) / total[:, None]
    return out


def test_executing_a_plan_equals_attention():
    torch.manual_seed(0)
    lens = [1, 15, 16, 17, 700, 3000, 0, 1299]
    bs, kv_heads, group, dim = 16, 2, 4, 32
    need = [max(1, ceil_div(n, bs)) for n in lens]
    num_blocks = sum(need) + 2
    k_cache = torch.randn(num_blocks, kv_heads, bs, dim, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, kv_heads, bs, dim, dtype=torch.float64)
    perm = torch.randperm(num_blocks).tolist()
    width = max(need)
    tables = torch.tensor([[perm.pop() for _ in range(k)] + [0] * (width - k) for k in need], dtype=torch.int32)
    query = torch.randn(len(lens), kv_heads * group, dim, dtype=torch.float64)
    scale = dim ** -0.5
    for workers, longest_item, share_align in ((5, 256, 0), (40, 1024, 0), (1, 32768, 0), (5, 4096, 1),
                                               (40, 1024, 1), (7, 4096, 8), (1, 32768, 1)):
        plan = plan_decode_work(lens, workers, longest_item, min_item=64, share_align=share_align)
        assert (plan[1] == 0) == (share_align > 0)   # every case here plans equal shares when asked
        got = _run_plan(plan, workers, query, k_cache, v_cache, tables, lens, scale)
        live = [i for i, n in enumerate(lens) if n > 0]
        expect = reference.paged_decode_attention(query[live], k_cache, v_cache, tables[live],
                                                  torch.tensor([lens[i] for i in live], dtype=torch.int32), scale)
        assert torch.allclose(got[live], expect, atol=1e-12, rtol=1e-10)
        assert (got[[i for i, n in enumerate(lens) if n == 0]] == 0).all()
