"""benchmarks/decode_gaps.py's split of traced calls (kernels between L2 flushes) into lead, span,
tail and kernel durations, on traces written here: a programmatic dependent kernel that overlaps
the one before it, a call of one kernel, and the refusals of traces that do not match the calls."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_gaps  # noqa: E402

FLUSH = {"fill", "reduce"}


def call(at: float, lead: float, decode: float, merge_tail: float) -> list[tuple[str, float, float]]:
    """A clean flush (fill, then reduce) ending at ``at``, then a decode kernel ``lead`` us later and
    its merge, launched early, ending ``merge_tail`` us after it."""
    start = at + lead
    return [("fill", at - 20.0, at - 10.0), ("reduce", at - 9.0, at),
            ("decode", start, start + decode), ("merge", start + 1.0, start + decode + merge_tail)]


def test_lead_span_tail_and_durations_are_medians_over_calls():
    trace = call(100.0, 3.0, 40.0, 2.0) + call(300.0, 3.5, 41.0, 2.5) + call(500.0, 2.5, 39.0, 2.0)
    r = decode_gaps.summarize(trace, FLUSH, [46.0, 47.5, 44.0])
    assert r["lead"] == pytest.approx(3.0)
    assert r["span"] == pytest.approx(42.0)          # spans 42, 43.5, 41: the merge's end, not the sum
    assert r["event"] == pytest.approx(46.0)
    assert r["tail"] == pytest.approx(46.0 - 3.0 - 42.0)
    assert r["kernels"]["decode"] == pytest.approx(40.0)
    assert r["kernels"]["merge"] == pytest.approx(41.0)   # 40 - 1 + 2: it waited from its early start


def test_a_call_of_one_kernel_and_flushes_of_one_kernel():
    trace = [("fill", 0.0, 10.0), ("sdpa", 12.0, 50.0), ("fill", 60.0, 70.0), ("sdpa", 74.0, 110.0)]
    r = decode_gaps.summarize(trace, {"fill"}, [40.0, 41.0])
    assert r["lead"] == pytest.approx(3.0) and r["span"] == pytest.approx(37.0)
    assert r["kernels"] == {"sdpa": pytest.approx(37.0)}


def test_traces_that_do_not_match_the_calls_are_refused():
    with pytest.raises(RuntimeError, match="2 calls traced, 3 timed"):
        decode_gaps.summarize(call(100.0, 3.0, 40.0, 2.0) + call(300.0, 3.0, 40.0, 2.0), FLUSH, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="before any flush"):
        decode_gaps.summarize([("decode", 0.0, 1.0)], FLUSH, [1.0])
