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
    """(n, size, seq, piece, end, spans) of a plan: its n items in the order dealt."""
    capacity = (len(plan) - HEADER - 2 * rows) // 2
    n, size = int(plan[0]), int(plan[1])
    records = plan[HEADER:HEADER + 2 * capacity].reshape(capacity, 2)
    assert (records[n:] == 0).all()
    codes = records[:n, 0].view(np.uint32).astype(np.int64)
    spans = plan[HEADER + 2 * capacity:].reshape(rows, 2)
    return n, size, codes >> 16, codes & 0xFFFF, records[:n, 1].astype(np.int64), spans


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


def _run_plan(plan, workers, query, k_cache, v_cache, tables, lens, scale):
    """Float64 attention executed the way the kernel executes a plan: each item over its token
    range (log-sum-exp partials), the pieces of a row merged."""
    rows = len(lens)
    n, size, seq, piece, end, spans = _parts(plan, rows)
    heads, dim = query.shape[1], query.shape[2]
    group = heads // k_cache.shape[1]
    bs = k_cache.shape[2]
    partial = {}
    for w in range(workers):
        for i in _worker_items(n, workers, w):
            s, p = int(seq[i]), int(piece[i])
            lo, hi = p * size, int(end[i])
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
    for workers, longest_item in ((5, 256), (40, 1024), (1, 32768)):
        plan = plan_decode_work(lens, workers, longest_item, min_item=64)
        got = _run_plan(plan, workers, query, k_cache, v_cache, tables, lens, scale)
        live = [i for i, n in enumerate(lens) if n > 0]
        expect = reference.paged_decode_attention(query[live], k_cache, v_cache, tables[live],
                                                  torch.tensor([lens[i] for i in live], dtype=torch.int32), scale)
        assert torch.allclose(got[live], expect, atol=1e-12, rtol=1e-10)
        assert (got[[i for i, n in enumerate(lens) if n == 0]] == 0).all()
