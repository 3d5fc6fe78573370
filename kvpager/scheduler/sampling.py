"""Token sampling from a model's logits: greedy, temperature, top-k and top-p (nucleus).

``sample`` takes one sequence's float32 logits ``[vocab]`` and the sampling parameters of its
request, and returns one token id. The order of the filters is the usual one (Hugging Face's
and vLLM's): temperature scaling, then top-k, then top-p over what top-k kept, then one draw
with ``torch.multinomial`` from the request's seeded ``torch.Generator``. The same generator
state and the same logits give the same token on every run; a temperature of 0 (or below)
is greedy and draws nothing, so it leaves the generator untouched.

``sample_batch`` does the same for the rows of a ``[batch, vocab]`` tensor, each with its own
parameters and generator (one greedy argmax for the whole batch when every row is greedy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["sample", "sample_batch", "check_sampling_args"]


def check_sampling_args(temperature: float, top_p: float, top_k: int) -> None:
    """Raise ``ValueError`` (one line) for parameters ``sample`` cannot honour.

    ``temperature`` must be finite (``<= 0`` means greedy); ``top_p`` must be in ``(0, 1]``
    (1: off; values above 1 are also off); ``top_k`` must be an integer (``<= 0``: off).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or math.isnan(top_p) or top_p <= 0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an integer, got {top_k!r}")


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: Optional[torch.Generator] = None,
) -> int:
    """One token id from the logits ``[vocab]`` of one sequence.

    - ``temperature <= 0``: greedy, ``argmax`` (the lowest id among equal maxima).
    - otherwise ``logits / temperature``; then top-k (``k <= 0`` or ``k >= vocab``: off) keeps
      the k largest (exactly k, ties broken toward the lower id); then top-p (``top_p >= 1``:
      off) keeps the smallest prefix of the tokens sorted by probability whose probability
      mass reaches ``top_p``, and always at least the most likely token; then one draw with
      ``torch.multinomial(..., generator=generator)``.

    Raises ``ValueError`` for a non-finite temperature, a ``top_p`` outside ``(0, 1]``, a
    non-integer ``top_k``, or logits that are not one-dimensional and non-empty.
    """
    check_sampling_args(temperature, top_p, top_k)
    if logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty [vocab] tensor, got shape {tuple(logits.shape)}")
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / float(temperature)
    vocab = scaled.numel()
    use_top_k = 0 < top_k < vocab
    use_top_p = top_p < 1.0
    if not use_top_k and not use_top_p:
        probs = torch.softmax(scaled, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))
    if use_top_k:
        # torch.topk's order among equal values is unspecified: take every token at least as
        # large as the k-th largest (ties included), then a stable sort of those few keeps the
        # lower id first among equals, so which k tokens are kept is well defined.
        kth = torch.topk(scaled, top_k, sorted=False).values.min()
        candidates = torch.nonzero(scaled >= kth).flatten()
        values, order = torch.sort(scaled[candidates], descending=True, stable=True)
        values, indices = values[:top_k], candidates[order[:top_k]]
    else:
        values, indices = torch.sort(scaled, descending=True, stable=True)
    probs = torch.softmax(values, dim=-1)
    if use_top_p:
        # Keep token i when the mass of the more likely tokens before it is still below top_p:
        # the smallest prefix reaching top_p, and always token 0.
        before = torch.cumsum(probs, dim=-1) - probs
        keep = before < top_p
        keep[0] = True
        probs = probs[: int(keep.sum())]
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return int(indices[choice])


def sample_batch(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    top_ks: Sequence[int],
    generators: Sequence[Optional[torch.Generator]],
) -> list[int]:
    """``sample`` for each row of ``logits [batch, vocab]`` with that row's parameters.

    Gives the same ids as calling ``sample`` row by row with the same generators (in row order).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if not (len(temperatures) == len(top_ps) == len(top_ks) == len(generators) == batch):
        raise ValueError(f"one temperature, top_p, top_k and generator per row ({batch} rows) are needed")
    for t, p, k in zip(temperatures, top_ps, top_ks):
        check_sampling_args(t, p, k)
    if all(t <= 0 for t in temperatures):
        return [int(i) for i in torch.argmax(logits, dim=-1).tolist()]
    return [sample(logits[i], temperatures[i], top_ps[i], top_ks[i], generators[i]) for i in range(batch)]
