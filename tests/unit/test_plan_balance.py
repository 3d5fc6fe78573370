"""benchmarks/plan_balance.py: a work list's per-worker loads and the even split's item count."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_balance  # noqa: E402

from kvpager.kernels import decode_plan  # noqa: E402


def test_loads_add_up_to_the_tokens_and_item_costs():
    lens = np.array([4096] * 8)
    plan = decode_plan.plan_decode_work(lens, 66, 33280)
    load = plan_balance.loads(plan, 66, 96)
    assert load.sum() == lens.sum() + 96 * int(plan[0])
    assert (load == 0).sum() == 66 - int(plan[0])   # 64 items of 512 tokens: two workers idle


def test_even_split_cuts_at_worker_boundaries():
    # 3 x 100 tokens over 3 workers: shares end at 100 and 200, the sequences' own ends: no cut.
    assert plan_balance.even_split(np.array([100, 100, 100]), 3, 1000, 10) == (3, 0, 110)
    # 2 x 150 over 3 workers: a boundary at 100 in the first sequence, at 200 in the second; the
    # middle worker holds two items (50 tokens of each sequence).
    assert plan_balance.even_split(np.array([150, 150]), 3, 1000, 10) == (4, 2, 120)
    # One sequence of 300 over 1 worker, items of at most 128 tokens: three items.
    assert plan_balance.even_split(np.array([300]), 1, 128, 10) == (3, 1, 330)


def test_divisor_sizes_and_the_best_of_them():
    # 16,384 tokens in m equal aligned pieces: 16,384, 8,192, 5,504 (5,462 aligned up), 4,096, ...
    assert plan_balance.divisor_sizes(np.array([16384]), 33280)[:4] == [16384, 8192, 5504, 4096]
    # 2 x 8,192 over 2 workers, item cost 0: whole sequences are already even (8,192 each).
    assert plan_balance.best_with_sizes(np.array([8192, 8192]), 2, [8192, 4096], 0) == (8192.0, 8192)
