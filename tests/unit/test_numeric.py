"""kvpager.numeric: the one ceiling division and the one percentile."""

import random
import statistics

import pytest

from kvpager.numeric import ceil_div, percentile


def test_ceil_div_counts_the_blocks_that_hold_tokens():
    for tokens in range(0, 70):
        for block in (1, 3, 16):
            assert ceil_div(tokens, block) * block >= tokens > (ceil_div(tokens, block) - 1) * block or tokens == 0


def test_percentile_interpolates_and_stays_within_the_samples():
    rng = random.Random(7)
    samples = [rng.expovariate(1.0) for _ in range(501)]
    assert percentile(samples, 50) == pytest.approx(statistics.median(samples))
    assert min(samples) <= percentile(samples, 0.1) <= percentile(samples, 99.9) <= max(samples)
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], 100)
