"""Sampling (kvpager.scheduler.sampling): greedy, temperature, top-k, top-p, seeded draws."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kvpager.scheduler.sampling import sample, sample_batch  # noqa: E402


def _logits(seed: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits, n, temperature=1.0, top_p=1.0, top_k=0, seed=0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [sample(logits, temperature, top_p, top_k, g) for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_greedy_is_argmax_and_draws_nothing(temperature):
    for seed in range(20):
        logits = _logits(seed)
        g = torch.Generator().manual_seed(7)
        state = g.get_state().clone()
        assert sample(logits, temperature, 0.5, 3, g) == int(torch.argmax(logits))
        assert torch.equal(g.get_state(), state)  # greedy leaves the generator alone
    # Ties: the lowest id, as torch.argmax.
    assert sample(torch.tensor([1.0, 3.0, 3.0, 0.0]), 0.0) == 1


def test_top_k_1_and_tiny_top_p_are_argmax():
    for seed in range(30):
        logits = _logits(seed)
        best = int(torch.argmax(logits))
        assert set(_draws(logits, 20, temperature=5.0, top_k=1, seed=seed)) == {best}
        assert set(_draws(logits, 20, temperature=5.0, top_p=1e-6, seed=seed)) == {best}


def test_only_top_k_tokens_are_drawn():
    logits = _logits(3, vocab=100)
    top = set(torch.topk(logits, 5).indices.tolist())
    draws = _draws(logits, 1000, temperature=2.0, top_k=5, seed=1)
    assert set(draws) == top  # never outside the top 5, and every one of them drawn


def test_top_k_ties_keep_the_lowest_ids():
    assert set(_draws(torch.zeros(10), 300, top_k=3)) == {0, 1, 2}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)
    assert set(_draws(logits, 400, top_p=0.75)) == {0, 1}
    assert set(_draws(logits, 400, top_p=0.85)) == {0, 1, 2}
    assert set(_draws(logits, 400, top_p=0.4)) == {0}
    # top-p applies to what top-k kept, renormalized: top_k=2 leaves [0.625, 0.375].
    assert set(_draws(logits, 400, top_k=2, top_p=0.6)) == {0}
    assert set(_draws(logits, 400, top_k=2, top_p=0.7)) == {0, 1}


def test_draw_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.softmax(logits / temperature, dim=-1)
        draws = _draws(logits, 2500, temperature=temperature, seed=11)
        freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
        assert torch.allclose(freq, expected, atol=0.04), (temperature, freq, expected)
    # Top-k renormalizes over the kept tokens.
    expected = torch.softmax(logits[:3], dim=-1)
    draws = _draws(logits, 2500, top_k=3, seed=12)
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], expected, atol=0.04)


def test_disabled_filters_draw_exactly_as_plain_multinomial():
    logits = _logits(5)
    g = torch.Generator().manual_seed(3)
    plain = [int(torch.multinomial(torch.softmax(logits / 0.7, -1), 1, generator=g)) for _ in range(50)]
    for top_p, top_k in ((1.0, 0), (1.5, -1), (1.0, logits.numel()), (1.0, 10**6)):
        assert _draws(logits, 50, temperature=0.7, top_p=top_p, top_k=top_k, seed=3) == plain


def test_seeded_sampling_is_deterministic():
    logits = _logits(9, vocab=1000)
    for params in ((1.0, 1.0, 0), (0.8, 0.9, 0), (1.3, 1.0, 40), (0.7, 0.95, 50)):
        a = _draws(logits, 200, *params, seed=1234)
        b = _draws(logits, 200, *params, seed=1234)
        c = _draws(logits, 200, *params, seed=4321)
        assert a == b
        assert a != c


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -math.inf, "1.0", None])
def test_invalid_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        sample(_logits(0), temperature, 1.0, 0, torch.Generator())


@pytest.mark.parametrize("top_p", [0.0, -0.5, math.nan])
def test_invalid_top_p_raises(top_p):
    with pytest.raises(ValueError, match="top_p"):
        sample(_logits(0), 1.0, top_p, 0, torch.Generator())


def test_invalid_top_k_and_logits_raise():
    with pytest.raises(ValueError, match="top_k"):
        sample(_logits(0), 1.0, 1.0, 2.5, torch.Generator())
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(2, 5), 1.0, 1.0, 0, torch.Generator())
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(0), 0.0, 1.0, 0, None)


def test_sample_batch_matches_row_by_row():
    logits = torch.stack([_logits(s, vocab=64) for s in range(6)])
    params = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 0.9, 0), (1.2, 1.0, 5), (0.5, 0.8, 10), (0.0, 0.5, 3)]
    temps, top_ps, top_ks = (list(x) for x in zip(*params))
    got = sample_batch(logits, temps, top_ps, top_ks, [torch.Generator().manual_seed(s) for s in range(6)])
    gens = [torch.Generator().manual_seed(s) for s in range(6)]
    want = [sample(logits[i], *params[i], gens[i]) for i in range(6)]
    assert got == want
    assert sample_batch(logits, [0.0] * 6, [1.0] * 6, [0] * 6, [None] * 6) == torch.argmax(logits, -1).tolist()
    with pytest.raises(ValueError):
        sample_batch(logits, [0.0], [1.0], [0], [None])
