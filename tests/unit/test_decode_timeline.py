"""benchmarks/decode_timeline.py's summary of a launch's timeline records (the lines the
timeline build's merge kernel prints, kernels/csrc/decode_timeline.cuh), on records written here:
entry spread, first data, item ends per SM and per blocks held, the merge, the span; records of
an older launch are left out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_timeline  # noqa: E402

T0 = 5_000_000_000   # ns


def item(sm: int, bx: int, entry: int, start: int, first: int, end: int, tokens: int = 512) -> str:
    mid = (first + end) // 2
    return f"KVTL d {sm} {bx} 0 0 0 {T0 + entry} {T0 + start} {T0 + first} {T0 + end} {tokens} {T0 + mid}"


def test_summary_of_one_launch():
    lines = [
        item(0, 0, 0, 100, 2_100, 40_000),
        item(0, 1, 50, 150, 2_650, 42_000),
        item(1, 2, 20, 120, 2_120, 45_000),
        "KVTL m 1 0 0 5000000000 5000045800 5000047000",   # merge: entry 0, waited 45.8 us, end 47 us
        "unrelated output",
        item(3, 3, -20_000_000, 0, 1_000, 2_000),          # an older launch's record: 20 ms before
    ]
    nbytes = 3 * 512 * 2 * 128 * 2
    text = decode_timeline.summarize(lines, nbytes, 3.0e12, 50.0)
    assert text.startswith("3 items on 3 blocks, 2 SMs")
    assert "first  median   2.0  p90   2.5  max   2.5" in text   # start -> first data, us
    assert "last  45.0" in text
    assert "1 blocks: 1 SMs done by  45.0" in text and "2 blocks: 1 SMs done by  42.0" in text
    assert "past the wait  45.8- 45.8, last end  47.0" in text
    span = 47.0e-6
    assert f"span    47.0 us: {100 * nbytes / span / 3.0e12:4.1f}% of the ceiling" in text


def test_rate_profile_spreads_each_items_bytes_over_its_time():
    # One item: first data at 2 us, middle at 6 us, end at 10 us, 1.2e4 bytes: 6e3 bytes over [2, 6)
    # and 6e3 over [6, 10); bins of 2 us at a ceiling of 1.5e9 B/s (3e3 bytes a bin = 100%).
    rec = [0, 0, 0, 0, 0, T0, T0, T0 + 2_000, T0 + 10_000, 512, T0 + 6_000]
    rates = decode_timeline.rate_profile([rec], 12_000, 1.5e9, T0, 2.0)
    assert [round(r) for r in rates[:6]] == [0, 100, 100, 100, 100, 0]


def test_no_records():
    assert "no timeline lines" in decode_timeline.summarize(["nothing"], 1, 1.0, 1.0)
