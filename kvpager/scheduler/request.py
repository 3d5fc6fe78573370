"""Requests, their sampling parameters, and the sequences the scheduler tracks for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    n: int = 1                  # parallel samples (the prompt is computed once, then forked)
    temperature: float = 0.0    # 0: greedy
    seed: Optional[int] = None  # seeded sampling: the same seed gives the same tokens


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    namespace: str = ""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    samples: list[list[int]]  # n generated token lists


@dataclass(slots=True, eq=False)
class SeqState:
    seq_id: str
    tokens: list[int]          # prompt + generated
    num_cached: int = 0        # tokens whose K/V the cache holds (as of the last step)
    num_generated: int = 0
    generator: Optional[torch.Generator] = None

    @property
    def next_token(self) -> int:
        return self.tokens[self.num_cached]


@dataclass(slots=True, eq=False)
class Group:
    """One request: its parent sequence and, with n > 1, its forked samples."""

    request: Request
    seqs: list[SeqState] = field(default_factory=list)

    def unfinished(self) -> list[SeqState]:
        return [s for s in self.seqs if s.num_generated < self.request.params.max_new_tokens]

    @property
    def done(self) -> bool:
        return not self.unfinished()


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """One token from float32 logits ``[vocab]``: argmax when greedy, else seeded multinomial."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
