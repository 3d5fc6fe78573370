"""Small arithmetic every layer uses: ceiling division (blocks for a token count) and percentiles."""

from __future__ import annotations

import statistics
from typing import Sequence


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer >= numerator / denominator (``denominator`` > 0): e.g. the blocks
    that hold ``numerator`` tokens at ``denominator`` tokens per block. O(1)."""
    return -(-numerator // denominator)


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 < q < 100, to 0.1) of ``samples``, interpolated between the two
    nearest samples as ``statistics.quantiles(method="inclusive")`` does: p50 of [1, 2] is 1.5 and
    p99 never exceeds the largest sample. One sample is its own every percentile. O(n log n)."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 < q < 100:
        raise ValueError(f"percentile {q} outside (0, 100)")
    if len(samples) == 1:
        return float(samples[0])
    cut = round(q * 10)  # the cut point among 1000 quantiles
    return statistics.quantiles(samples, n=1000, method="inclusive")[max(1, min(999, cut)) - 1]
