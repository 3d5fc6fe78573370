"""Requests, their sampling parameters, and the sequences the scheduler tracks for them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .sampling import sample as sample_logits


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    n: int = 1                  # parallel samples (the prompt is computed once, then forked)
    temperature: float = 0.0    # 0: greedy
    top_p: float = 1.0          # nucleus sampling: the smallest set of tokens holding this probability (1: off)
    top_k: int = 0              # sample among the k most likely tokens (0: off)
    seed: Optional[int] = None  # seeded sampling: the same seed gives the same tokens
    stop_token_ids: tuple[int, ...] = ()  # generation of a sample ends after any of these (EOS)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    namespace: str = ""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    samples: list[list[int]]  # n generated token lists (a stop token, when one ended the sample, included)
    finish_reasons: list[str] = field(default_factory=list)  # per sample: "stop" (a stop token) or "length"


@dataclass(slots=True, eq=False)
class SeqState:
    seq_id: str
    tokens: list[int]          # prompt + generated
    num_cached: int = 0        # tokens whose K/V the cache holds (as of the last step)
    num_generated: int = 0
    generator: Optional[torch.Generator] = None
    finish_reason: str = ""    # "" while generating, then "stop" or "length"
    streamed: int = 0          # tokens a restarted request streamed before (not streamed again)
    finish_streamed: bool = False   # a restarted request streamed this sample's end before

    @property
    def next_token(self) -> int:
        return self.tokens[self.num_cached]


@dataclass(slots=True, eq=False)
class Group:
    """One request: its parent sequence and, with n > 1, its forked samples."""

    request: Request
    seqs: list[SeqState] = field(default_factory=list)

    def unfinished(self) -> list[SeqState]:
        return [s for s in self.seqs if not s.finish_reason]

    @property
    def done(self) -> bool:
        return not self.unfinished()


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> int:
    """One token from float32 logits ``[vocab]`` under ``params`` (``sampling.sample``)."""
    return sample_logits(logits, params.temperature, params.top_p, params.top_k, generator)
