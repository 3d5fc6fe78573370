"""A 16-bit query split for the fp8 prefill kernel, and its torch reference.

Over a float8_e4m3fn cache, Hopper's prefill kernel computes Q K^T on the e4m3 tensor cores,
each query value as two e4m3 terms (``hi + lo``) scaled per row: exact for bf16's 8 significant
bits; fp16's 11 are rounded to within 2^-9 of each value, as rounding to bf16 would leave them,
a 32nd of the cache's own e4m3 rounding of K (docs/performance.md, "fp16 queries over fp8 caches
split too"). The op that writes Q (RoPE: ``cuda.rope_split_query``) can write it split, so that the
attention kernel only loads it (``cuda.paged_prefill_run`` takes a :class:`SplitQuery`); the
kernel splits a plain query itself otherwise, at a cost of issue slots (docs/performance.md, "A
query split before the kernel"). The format is
``kernels/csrc/split_query.cuh``'s; :func:`split_query_reference` computes the same bytes in
torch (CPU or CUDA) and :func:`joined_query` the values they hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

__all__ = ["SplitQuery", "split_query_reference", "joined_query", "split_query_chunk", "SPLIT_DTYPES"]

_E4M3 = torch.float8_e4m3fn
SPLIT_HEAD_DIMS = (64, 128)
SPLIT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SplitQuery:
    """Queries ``[tokens, q_heads, head_dim]`` held split (``split_query.cuh``):

    data: uint8 ``[tokens, q_heads, 2 * head_dim]``, each row's e4m3 terms in the kernel's order
    down: float32 ``[kv_heads, tokens, q_heads // kv_heads]``, each row's factor ``2^-f`` (row
          ``(token, head)`` at ``[head // G, token, head % G]``)
    rows: the 16-bit queries themselves where some rows are read as such (a mixed step's one-token
          rows, by decode attention: ``rope_split_query(keep=...)`` rotates those in place), or None
    dtype: the queries' type before the split (bf16 or fp16), the attention output's
    """

    data: torch.Tensor
    down: torch.Tensor
    rows: Optional[torch.Tensor] = None
    dtype: torch.dtype = torch.bfloat16

    @property
    def shape(self) -> tuple[int, int, int]:
        tokens, heads, width = self.data.shape
        return tokens, heads, width // 2

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def kv_heads(self) -> int:
        return self.down.shape[0]

    @staticmethod
    def empty(tokens: int, q_heads: int, head_dim: int, kv_heads: int, device,
              dtype: torch.dtype = torch.bfloat16) -> "SplitQuery":
        if dtype not in SPLIT_DTYPES:
            raise ValueError(f"a split query holds bf16 or fp16 queries, got {dtype}")
        if head_dim not in SPLIT_HEAD_DIMS:
            raise ValueError(f"a split query has head_dim 64 or 128, got {head_dim}")
        if kv_heads < 1 or q_heads % kv_heads:
            raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads (GQA)")
        data = torch.empty(tokens, q_heads, 2 * head_dim, dtype=torch.uint8, device=device)
        down = torch.empty(kv_heads, tokens, q_heads // kv_heads, dtype=torch.float32, device=device)
        return SplitQuery(data, down, dtype=dtype)


def split_query_chunk(kk: int, t4: int) -> int:
    """The 16-byte chunk of a split row holding k-step ``kk``'s columns for quad lane ``t4``."""
    return (kk >> 1) * 8 + 2 * t4 + (kk & 1)


@lru_cache(maxsize=None)
def _byte_order(head_dim: int) -> torch.Tensor:
    """Index into ``cat(hi bytes, lo bytes)`` (2 * head_dim) of each byte of a split row."""
    order = torch.empty(2 * head_dim, dtype=torch.long)
    for kk in range(head_dim // 32):
        for t4 in range(4):
            c = 32 * kk + 4 * t4
            at = 16 * split_query_chunk(kk, t4)
            for part, first in enumerate((c, c + 16, head_dim + c, head_dim + c + 16)):
                order[at + 4 * part:at + 4 * part + 4] = torch.arange(first, first + 4)
    return order


def split_query_reference(q: torch.Tensor, kv_heads: int) -> SplitQuery:
    """``q`` (bf16 or fp16 ``[tokens, q_heads, head_dim]``, head_dim 64 or 128) split as the CUDA
    op splits it."""
    if q.dtype not in SPLIT_DTYPES or q.dim() != 3:
        raise ValueError(f"split_query takes bf16 or fp16 [tokens, heads, head_dim], got {q.dtype} {list(q.shape)}")
    tokens, heads, head_dim = q.shape
    out = SplitQuery.empty(tokens, heads, head_dim, kv_heads, q.device, q.dtype)
    x = q.float()
    largest = x.abs().amax(dim=-1)                                   # [tokens, heads]
    exponent = torch.frexp(largest).exponent - 1                     # floor(log2), for largest > 0
    f = torch.where(largest > 0, 7 - exponent, torch.full_like(exponent, 7)).clamp(-126, 126)
    up = torch.ldexp(torch.ones_like(largest), f)
    scaled = (x * up[..., None]).half()                              # exact: <= 11 significant bits under 2^8
    hi = scaled.to(_E4M3)
    lo = (scaled - hi.half()).to(_E4M3)                              # the difference exact in fp16 (lo: fp16's rounded)
    raw = torch.cat([hi.view(torch.uint8), lo.view(torch.uint8)], dim=-1)
    out.data.copy_(raw[..., _byte_order(head_dim).to(q.device)])
    down = torch.ldexp(torch.ones_like(largest), -f)                 # [tokens, heads]
    out.down.copy_(down.view(tokens, kv_heads, heads // kv_heads).transpose(0, 1))
    return out


def joined_query(split: SplitQuery) -> torch.Tensor:
    """The float32 values ``(hi + lo) * down`` a split query holds, ``[tokens, q_heads, head_dim]``:
    a bf16 query exactly, but for values under 2^-9 of their row's largest, which are off by at
    most 2^-17 of it (half e4m3's subnormal step); an fp16 query within 2^-9 of each value
    (relative), besides the same 2^-17 of the row's largest."""
    tokens, heads, head_dim = split.shape
    order = _byte_order(head_dim).to(split.device)
    raw = torch.empty_like(split.data)
    raw[..., order] = split.data
    hi = raw[..., :head_dim].contiguous().view(_E4M3).float()
    lo = raw[..., head_dim:].contiguous().view(_E4M3).float()
    down = split.down.transpose(0, 1).reshape(tokens, heads)
    return (hi + lo) * down[..., None]
