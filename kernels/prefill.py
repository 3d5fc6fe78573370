"""Paged prefill attention through torch SDPA: the fast path on CUDA until kvpager has its own
prefill kernel (issue 4 allows a measured, documented torch fallback for prefill).

Same signature and semantics as ``reference.paged_prefill_attention``. Sequences with one query
(decodes riding in a mixed step) go to paged decode attention in one batch; the others are
grouped by (query length, context length), and each group gathers its K/V over the block
tables into ``[n, num_kv_heads, context, head_dim]`` and runs one SDPA call (flash attention on
CUDA, GQA without repeating K/V) with a bottom-right causal mask: query j of a q-token chunk
over c cached tokens sits at position c - q + j and sees positions <= its own, the cached
prefix included.

Cost: one host sync for the lengths, unless the caller passes them (``host_lengths``: the
worker's model has them as lists, so a step's layers never sync); per group one gather of its K/V (2 * c * kv_heads *
head_dim elements per sequence, small against the attention's 4 * q * c * q_heads * head_dim
FLOPs for prompts of more than a few dozen tokens) and one SDPA launch. docs/performance.md
has the numbers against SDPA on a contiguous cache.

Our own kernel (``cuda.paged_prefill_attention``, kernels/csrc/paged_prefill.cuh: tensor cores,
K/V read straight from the pages, one launch for every sequence of the step) replaces the
gather + SDPA groups where it serves the inputs (float16/bfloat16 queries over a cache of the
same dtype or fp8 e4m3, head_dim 64/128, block_size 8-64) and where ``_kernel_pays`` says it
was measured faster (docs/performance.md, "Prefill kernel"). ``KVPAGER_PREFILL_KERNEL=0`` (or
``use_kernel = False``) keeps gather + SDPA everywhere, ``=1`` forces the kernel wherever it serves.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvpager.numeric import ceil_div
from . import reference

DecodeFn = Callable[..., torch.Tensor]

KERNEL_ENV = "KVPAGER_PREFILL_KERNEL"
# None: the environment decides (KERNEL_ENV: "0" never, "1" wherever it serves, unset: where it pays).
use_kernel: bool | None = None
MIN_DISTINCT_SHAPES = 8


def _kernel(query: torch.Tensor, k_cache: torch.Tensor):
    """The CUDA module when our prefill kernel may serve these inputs, else None."""
    if query.device.type != "cuda":
        return None
    mode = {None: None, True: "1", False: "0"}[use_kernel] or os.environ.get(KERNEL_ENV, "")
    if mode == "0":
        return None
    from . import cuda
    if not cuda.supports_prefill(query, k_cache) or not cuda.available():
        return None
    return cuda


def _kernel_pays(q_lens: Sequence[int], ctx: Sequence[int], wgmma: bool = True) -> bool:
    """Whether our kernel beat gather + SDPA on shapes like these (measured, docs/performance.md);
    ``wgmma``: whether the Hopper (wgmma) version runs, else the mma.sync one."""
    mode = {None: None, True: "1", False: "0"}[use_kernel] or os.environ.get(KERNEL_ENV, "")
    if mode == "1":
        return True
    if not wgmma:
        # The mma.sync version (measured on the H100 only): even with gather + SDPA on 8
        # distinct chunk shapes, ahead from 24 distinct prompts on, behind on uniform shapes.
        return len(set(zip(q_lens, ctx))) >= MIN_DISTINCT_SHAPES
    # H100, bf16 32q/8kv d128 (benchmarks/kernels.py --only prefill_kernel, docs/performance.md):
    # the kernel beats gather + SDPA on every chunked-prefill shape measured (new tokens over a
    # cached prefix: SDPA runs its lower-right-masked kernels there) and on batches of many
    # distinct shapes (one SDPA call per shape); on a few shapes of whole prompts gather + cuDNN
    # SDPA is faster.
    return any(q < c for q, c in zip(q_lens, ctx)) or len(set(zip(q_lens, ctx))) >= MIN_DISTINCT_SHAPES


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                            decode: DecodeFn = reference.paged_decode_attention,
                            host_lengths: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """``decode`` runs the one-query sequences (``paged_decode_attention``'s signature);
    ``host_lengths``, if given, is (query_start_loc, context_lens) as host integers, equal to the
    tensors (saves the host sync). A float8_e4m3fn cache is dequantized (times k_scale,
    v_scale) into the query's dtype as it is gathered."""
    num_tokens, num_q_heads, head_dim, num_seqs = reference._check_prefill(
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scale, v_scale)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if host_lengths is None:   # the one host sync: every length, for the checks and the grouping
        lengths = torch.cat([query_start_loc.to("cpu", torch.int64), context_lens.to("cpu", torch.int64)]).tolist()
        starts, ctx = lengths[:num_seqs + 1], lengths[num_seqs + 1:]
    else:
        starts, ctx = [int(x) for x in host_lengths[0]], [int(x) for x in host_lengths[1]]
        if len(starts) != num_seqs + 1 or len(ctx) != num_seqs:
            raise ValueError(f"host_lengths must hold {num_seqs + 1} query starts and {num_seqs} context lengths")
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    block_size = k_cache.shape[2]
    reference._check_lengths(starts[0], starts[-1], min(q_lens), any(q > c for q, c in zip(q_lens, ctx)), max(ctx),
                             num_tokens, block_tables.shape[1] * block_size)

    dev = query.device
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (q, c) in enumerate(zip(q_lens, ctx)):
        if q > 0:
            groups[(q, c)].append(i)

    singles = sorted(i for (q, _), seqs in groups.items() if q == 1 for i in seqs)
    if singles:
        seqs, rows = _index(singles, dev), _index([starts[i] for i in singles], dev)
        out[rows] = decode(query[rows], k_cache, v_cache, block_tables[seqs], context_lens[seqs], scale,
                           k_scale=k_scale, v_scale=v_scale)

    multi = [i for i, q in enumerate(q_lens) if q > 1]
    kernel = _kernel(query, k_cache) if multi and scale > 0 else None
    if kernel is not None and _kernel_pays([q_lens[i] for i in multi], [ctx[i] for i in multi],
                                           kernel.prefill_wgmma(query.device)):
        # One launch for every sequence of more than one new token, straight from the pages.
        kernel.paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                                       k_scale, v_scale, host_lengths=(starts, ctx),
                                       seqs=None if len(multi) == num_seqs else multi, out=out)
        return out

    for (q, c), seqs_list in groups.items():
        if q == 1:
            continue
        n = len(seqs_list)
        seqs = _index(seqs_list, dev)
        if isinstance(seqs, slice):      # consecutive sequences: their rows are one run too
            rows = slice(starts[seqs_list[0]], starts[seqs_list[-1]] + q)
        else:
            rows = (torch.tensor([starts[i] for i in seqs_list])[:, None] + torch.arange(q)).flatten().to(dev)
        n_blocks = ceil_div(c, block_size)
        tables = block_tables[seqs, :n_blocks].to(dev, torch.int64).flatten()   # all inside the context

        def gather(cache: torch.Tensor, cache_scale: float) -> torch.Tensor:
            """[n, Hkv, c, D] (a strided view of one gathered copy, heads outermost)."""
            x = cache.transpose(0, 1).index_select(1, tables)            # [Hkv, n * n_blocks, B, D]
            if x.dtype == reference.FP8:
                x = (x.float() * cache_scale).to(query.dtype)
            return x.view(x.shape[0], n, n_blocks * block_size, head_dim).transpose(0, 1)[:, :, :c]

        qs = query[rows].reshape(n, q, num_q_heads, head_dim).transpose(1, 2)   # [n, Hq, q, D]
        mask = None if q == c else causal_lower_right(q, c)
        res = F.scaled_dot_product_attention(qs, gather(k_cache, k_scale), gather(v_cache, v_scale), attn_mask=mask,
                                             is_causal=q == c, scale=scale,
                                             enable_gqa=num_q_heads != k_cache.shape[1])
        out[rows] = res.transpose(1, 2).reshape(n * q, num_q_heads, head_dim)
    return out


def _index(ids: list[int], device: torch.device) -> slice | torch.Tensor:
    """ids as an index: a slice (a view, no copy, no transfer) when they are consecutive."""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return torch.tensor(ids, device=device)
