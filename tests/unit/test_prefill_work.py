"""The prefill kernel's work list (kernels/prefill_plan.py ``prefill_work``), planned on the host: every
row tile of every sequence with new tokens exactly once, in the order each schedule needs, and the
schedule chosen from the environment. No GPU needed (the list is numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpager.kernels import prefill_plan as plan

ROWS = 16 * plan.PREFILL_WARPS   # rows per tile of the default instance


def _batch(rng: np.random.Generator, n: int):
    """n sequences: whole prompts, chunks over cached prefixes and some with no new tokens."""
    q = rng.integers(0, 700, n)
    q[rng.random(n) < 0.2] = 0
    ctx = q + rng.integers(0, 3000, n) * (rng.random(n) < 0.5)
    starts = np.concatenate([[0], np.cumsum(q)])
    return starts.tolist(), ctx.tolist(), q


def _cost(item, starts, ctx, group):
    seq, tile = int(item[0]), int(item[1])
    q = starts[seq + 1] - starts[seq]
    last_row = min(q * group, (tile + 1) * ROWS) - 1
    return ctx[seq] - q + last_row // group + 1


def _expected_items(q, group):
    return {(s, t) for s in range(len(q)) for t in range(-(-int(q[s]) * group // ROWS))}


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("seed", range(4))
def test_heaviest_order_covers_every_tile_once_most_expensive_first(group, seed):
    starts, ctx, q = _batch(np.random.default_rng(seed), 40)
    work = plan.prefill_work(starts, ctx, group)
    assert work.dtype == np.int32 and work.shape[1] == 2
    items = [tuple(int(x) for x in row) for row in work]
    assert len(items) == len(set(items)) and set(items) == _expected_items(q, group)
    costs = [_cost(row, starts, ctx, group) for row in work]
    assert costs == sorted(costs, reverse=True)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("seed", range(4))
def test_by_sequence_order_keeps_each_sequence_together_heaviest_first(group, seed):
    starts, ctx, q = _batch(np.random.default_rng(100 + seed), 40)
    work = plan.prefill_work(starts, ctx, group, order="by_sequence")
    items = [tuple(int(x) for x in row) for row in work]
    assert len(items) == len(set(items)) and set(items) == _expected_items(q, group)
    seqs = [s for s, _ in items]
    runs = [s for i, s in enumerate(seqs) if i == 0 or s != seqs[i - 1]]
    assert len(runs) == len(set(runs)), "a sequence's items are not together"
    costs = [_cost(row, starts, ctx, group) for row in work]
    heaviest_of = {}
    for s, c in zip(seqs, costs):
        heaviest_of.setdefault(s, c)   # the first item of a run is its sequence's heaviest
    for i in range(1, len(items)):
        if seqs[i] == seqs[i - 1]:
            assert costs[i] <= costs[i - 1]
    run_heads = [heaviest_of[s] for s in runs]
    assert run_heads == sorted(run_heads, reverse=True), "sequences not ordered by their heaviest item"
    assert max(costs) == costs[0]


def test_only_the_named_sequences_and_none_without_new_tokens():
    starts, ctx = [0, 300, 300, 900], [300, 50, 1000]
    for order in ("heaviest", "by_sequence"):
        work = plan.prefill_work(starts, ctx, 4, seqs=[1, 2], order=order)
        assert {int(s) for s in work[:, 0]} == {2}   # sequence 1 has no new tokens: no items
        assert plan.prefill_work([0, 0], [5], 4, order=order).shape == (0, 2)


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="order"):
        plan.prefill_work([0, 4], [4], 1, order="random")


def test_schedule_from_the_environment(monkeypatch):
    monkeypatch.delenv(plan.PREFILL_SCHEDULE_ENV, raising=False)
    assert plan.prefill_schedule() == "dynamic"
    assert plan.prefill_schedule(persistent=False) == "static"
    monkeypatch.setenv(plan.PREFILL_SCHEDULE_ENV, "static")
    assert plan.prefill_schedule() == "static"
    monkeypatch.setenv(plan.PREFILL_SCHEDULE_ENV, "dynamic")
    assert plan.prefill_schedule() == "dynamic"
    monkeypatch.setenv(plan.PREFILL_SCHEDULE_ENV, "fastest")
    with pytest.raises(ValueError, match=plan.PREFILL_SCHEDULE_ENV):
        plan.prefill_schedule()


def test_the_plan_takes_the_dynamic_order_only_for_the_persistent_kernel(monkeypatch):
    """cuda._plan_prefill (what every prefill step plans with), on CPU tensors: the list by
    sequence for the persistent kernel (wgmma, over a 16-bit or an fp8 cache) unless the
    variable says static, heaviest first for the one-block-per-item kernels (mma.sync) whatever it
    says. No counter without a GPU."""
    torch = pytest.importorskip("torch")
    from kvpager.kernels import cuda

    monkeypatch.delenv(plan.PREFILL_SCHEDULE_ENV, raising=False)
    starts, ctx, _ = _batch(np.random.default_rng(7), 24)
    query = torch.zeros(starts[-1], 8, 64, dtype=torch.bfloat16)
    cache16 = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
    cache8 = torch.zeros(4, 2, 16, 64, dtype=torch.float8_e4m3fn)
    by_sequence = plan.prefill_work(starts, ctx, 4, order="by_sequence")
    heaviest = plan.prefill_work(starts, ctx, 4, order="heaviest")
    assert not np.array_equal(by_sequence, heaviest)

    def work(cache, wgmma):
        p = cuda._plan_prefill(query, cache, (starts, ctx), None, plan.PREFILL_WARPS, wgmma)
        assert p.counter is None and p.wgmma == wgmma
        return p.work.numpy()

    assert np.array_equal(work(cache16, True), by_sequence)
    assert np.array_equal(work(cache8, True), by_sequence)
    assert np.array_equal(work(cache16, False), heaviest)
    assert np.array_equal(work(cache8, False), heaviest)
    monkeypatch.setenv(plan.PREFILL_SCHEDULE_ENV, "static")
    assert np.array_equal(work(cache16, True), heaviest)
    assert np.array_equal(work(cache8, True), heaviest)
    monkeypatch.setenv(plan.PREFILL_SCHEDULE_ENV, "dynamic")
    assert np.array_equal(work(cache16, False), heaviest)


def test_debug_plan_prefill_plans_the_chosen_instance_and_refuses_other_warp_counts():
    """debug.plan_prefill (the benchmarks' plan made once, on a chosen instance), on CPU tensors:
    warps and schedule as asked (the static schedule's heaviest-first list even for the persistent
    kernel), 8 warps by default; warp counts the kernels do not have are refused."""
    torch = pytest.importorskip("torch")
    from kvpager.kernels import debug

    starts, ctx, _ = _batch(np.random.default_rng(11), 12)
    query = torch.zeros(starts[-1], 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
    p = debug.plan_prefill(query, cache, (starts, ctx), warps=4, wgmma=False)
    assert p.warps == 4 and not p.wgmma
    assert np.array_equal(p.work.numpy(), plan.prefill_work(starts, ctx, 4, 4, order="heaviest"))
    p = debug.plan_prefill(query, cache, (starts, ctx), wgmma=True, schedule="static")
    assert p.warps == plan.PREFILL_WARPS and p.wgmma
    assert np.array_equal(p.work.numpy(), plan.prefill_work(starts, ctx, 4, order="heaviest"))
    with pytest.raises(ValueError, match="warps must be 4 or 8"):
        debug.plan_prefill(query, cache, (starts, ctx), warps=3)
