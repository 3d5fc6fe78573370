"""Paged prefill attention through torch SDPA: the fast path on CUDA until kvpager has its own
prefill kernel (issue 4 allows a measured, documented torch fallback for prefill).

Same signature and semantics as ``reference.paged_prefill_attention``. Sequences with one query
(decodes riding in a mixed step) go to paged decode attention in one batch; the others are
grouped by (query length, context length), and each group gathers its K/V over the block
tables into ``[n, num_kv_heads, context, head_dim]`` and runs one SDPA call (flash attention on
CUDA, GQA without repeating K/V) with a bottom-right causal mask: query j of a q-token chunk
over c cached tokens sits at position c - q + j and sees positions <= its own, the cached
prefix included.

Planned once per step, run per layer (FlashInfer's plan/run split, as decode is): ``plan``
takes the step's host lengths (the worker's model has them as lists; without them, one host
sync) and decides everything a layer's call needs: our kernel or gather + SDPA groups
(``_kernel_pays``), the kernel's work list (uploaded once), each group's rows, block ids and
mask, and the one-token rows with their decode (bound by the caller to the step's decode plan).
``run`` then only indexes, gathers and launches. ``paged_prefill_attention`` is the one-shot form
(plan + run) for tests and benchmarks. Cost per layer on the SDPA path: per group one gather of
its K/V (2 * c * kv_heads * head_dim elements per sequence, small against the attention's
4 * q * c * q_heads * head_dim FLOPs for prompts of more than a few dozen tokens) and one SDPA
launch. docs/performance.md has the numbers against SDPA on a contiguous cache.

Our own kernel (``cuda.paged_prefill_attention``, kernels/csrc/paged_prefill.cuh: tensor cores,
K/V read straight from the pages, one launch for every sequence of the step) replaces the
gather + SDPA groups where it serves the inputs (float16/bfloat16 queries over a cache of the
same dtype or fp8 e4m3, head_dim 64/128, block_size 8-64) and where ``_kernel_pays`` says it
was measured faster (docs/performance.md, "Prefill kernel"): on Hopper (the warp-specialized
kernel) everywhere; elsewhere for many distinct shapes. ``KVPAGER_PREFILL_KERNEL=0`` (or
``use_kernel = False``) keeps gather + SDPA everywhere, ``=1`` forces the kernel wherever it serves.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from kvpager.numeric import ceil_div
from . import reference
from .split_query import SplitQuery

DecodeFn = Callable[..., torch.Tensor]
Index = slice | torch.Tensor

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
    ``wgmma``: whether the Hopper version runs (the warp-specialized kernel, over 16-bit and fp8
    caches), else the mma.sync one."""
    mode = {None: None, True: "1", False: "0"}[use_kernel] or os.environ.get(KERNEL_ENV, "")
    if mode == "1":
        return True
    if wgmma:
        # The warp-specialized kernel (benchmarks/kernels.py --only prefill_kernel, H200,
        # 2026-11-26) beat gather + SDPA on every shape measured, whole prompts included:
        # 1.08x (8 x 2K prompts) to 1.12x (one 4K prompt) and 1.29x (32 x 512), 1.6-2.3x on chunks
        # over cached prefixes, 10x on 24 ragged prompts; over fp8 caches too (--only prefill_fp8,
        # H100, 2026-11-26, ninth session).
        return True
    # The mma.sync version (measured on the H100 only): even with gather + SDPA on 8 distinct
    # chunk shapes, ahead from 24 distinct prompts on, behind on uniform shapes.
    return len(set(zip(q_lens, ctx))) >= MIN_DISTINCT_SHAPES


@dataclass(frozen=True, slots=True)
class SdpaGroup:
    """Sequences of one (query length q, context length c): one gather of their K/V and one SDPA call."""
    q: int
    c: int
    n: int                          # sequences
    n_blocks: int                   # blocks per sequence, ceil(c / block_size)
    rows: Index                     # their n * q query rows (a slice when consecutive)
    tables: torch.Tensor            # [n * n_blocks] int64 block ids, on the device
    mask: Optional[CausalBias]      # lower-right causal (None: q == c, SDPA's is_causal)


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The one-token rows of a mixed step and how they attend (paged decode over their tables)."""
    rows: Index                     # their query rows (a slice when consecutive)
    block_tables: torch.Tensor      # [n, max_blocks] int32, on the device
    context_lens: torch.Tensor      # [n] int32, on the device
    decode: DecodeFn                # ``paged_decode_attention``'s signature (bound to the step's decode plan)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One step's prefill attention, planned once (``plan``) and run by every layer (``run``).
    Holds the step's device tensors and host lengths; on CPU (``reference``) nothing more."""
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor      # [num_seqs] int32
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    starts: tuple[int, ...]         # query_start_loc on the host
    context: tuple[int, ...]        # context_lens on the host
    scale: float
    query_shape: tuple[int, int, int]     # [num_tokens, num_q_heads, head_dim]
    cache_shape: tuple[int, int, int]     # [num_kv_heads, block_size, head_dim]
    reference: bool = False         # the torch reference runs the whole step
    decodes: Optional[DecodeRows] = None
    kernel: Any = None              # cuda.PrefillKernelPlan: one launch for every multi-token sequence
    groups: tuple[SdpaGroup, ...] = ()
    # run takes the query split before it (split_query.SplitQuery, e.g. from rope_split_query): the
    # kernel runs every multi-token row and reads a split query (bf16 or fp16 over fp8 on Hopper).
    # With one-token rows, the split query carries the 16-bit q as its `rows`, rotated at the tokens
    # keep_rows marks (int32 [num_tokens], on the device: rope_split_query's `keep`).
    split_query: bool = False
    keep_rows: Optional[torch.Tensor] = None


def host_lengths_of(query_start_loc: torch.Tensor, context_lens: torch.Tensor) -> tuple[list[int], list[int]]:
    """(query starts, context lengths) read from the tensors: one host sync."""
    n = context_lens.shape[0]
    lengths = torch.cat([query_start_loc.to("cpu", torch.int64), context_lens.to("cpu", torch.int64)]).tolist()
    return lengths[:n + 1], lengths[n + 1:]


def plan(query_like: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
         query_start_loc: torch.Tensor, scale: float, *,
         host_lengths: tuple[Sequence[int], Sequence[int]] | None = None,
         decode: DecodeFn = reference.paged_decode_attention,
         plan_decode: Optional[Callable[[torch.Tensor, torch.Tensor], DecodeFn]] = None,
         reference_only: bool = False) -> PrefillPlan:
    """The step's plan. ``query_like``: [*, num_q_heads, head_dim] of the queries' dtype and
    device (its rows are not read); ``k_cache``: any layer's K view (layout and dtype);
    ``block_tables``, ``context_lens``, ``query_start_loc``: the step's tensors, as in
    ``reference.paged_prefill_attention`` (kept in the plan); ``host_lengths``: (query starts,
    context lengths) as host ints equal to the tensors (else read once, a sync); ``decode``:
    how one-token rows attend (``paged_decode_attention``'s signature), or ``plan_decode``, which
    makes that function once from the one-token rows' block tables and context lengths (e.g. a
    grid plan over them); ``reference_only``: a
    plan the torch reference runs (the CPU path: lengths only). All host work of the step's
    prefill attention happens here: O(num_seqs) Python, one small upload per group's block ids
    and index, one for the kernel's work list."""
    reference._check_query(query_like, k_cache)
    num_seqs = reference._check_tables(block_tables, context_lens, query_start_loc)
    if host_lengths is None:
        starts, ctx = host_lengths_of(query_start_loc, context_lens)
    else:
        starts, ctx = [int(x) for x in host_lengths[0]], [int(x) for x in host_lengths[1]]
        if len(starts) != num_seqs + 1 or len(ctx) != num_seqs:
            raise ValueError(f"host_lengths must hold {num_seqs + 1} query starts and {num_seqs} context lengths")
    num_tokens = starts[-1] if starts else 0
    block_size = k_cache.shape[2]
    base = PrefillPlan(block_tables, context_lens, query_start_loc, tuple(starts), tuple(ctx), float(scale),
                       (num_tokens, query_like.shape[1], query_like.shape[2]), tuple(k_cache.shape[1:]),  # type: ignore[arg-type]
                       reference=reference_only)
    if num_seqs == 0 or reference_only:
        return base
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    reference._check_lengths(starts[0], starts[-1], min(q_lens), any(q > c for q, c in zip(q_lens, ctx)), max(ctx),
                             num_tokens, block_tables.shape[1] * block_size)
    dev = query_like.device

    decodes = None
    singles = [i for i, q in enumerate(q_lens) if q == 1]
    if singles:
        seqs, rows = _index(singles, dev), _index([starts[i] for i in singles], dev)
        single_tables, single_ctx = block_tables[seqs], context_lens[seqs]
        decodes = DecodeRows(rows, single_tables, single_ctx,
                             decode if plan_decode is None else plan_decode(single_tables, single_ctx))

    multi = [i for i, q in enumerate(q_lens) if q > 1]
    kernel = _kernel(query_like, k_cache) if multi and scale > 0 else None
    wgmma = kernel is not None and kernel.prefill_wgmma(dev)
    if kernel is not None and _kernel_pays([q_lens[i] for i in multi], [ctx[i] for i in multi], wgmma):
        # One launch for every sequence of more than one new token, straight from the pages.
        kernel_plan = kernel.plan_prefill(query_like, k_cache, (starts, ctx),
                                          None if len(multi) == num_seqs else multi)
        split = kernel_plan.wgmma and kernel.supports_split_query(query_like, k_cache)
        keep = None
        if split and decodes is not None:
            keep = torch.zeros(num_tokens, dtype=torch.int32, device=dev)
            keep[decodes.rows] = 1
        return replace(base, decodes=decodes, kernel=kernel_plan, split_query=split, keep_rows=keep)

    shapes: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in multi:
        shapes[(q_lens[i], ctx[i])].append(i)
    groups = []
    for (q, c), seqs_list in shapes.items():
        seqs = _index(seqs_list, dev)
        if isinstance(seqs, slice):      # consecutive sequences: their rows are one run too
            rows = slice(starts[seqs_list[0]], starts[seqs_list[-1]] + q)
        else:
            rows = (torch.tensor([starts[i] for i in seqs_list])[:, None] + torch.arange(q)).flatten().to(dev)
        n_blocks = ceil_div(c, block_size)
        tables = block_tables[seqs, :n_blocks].to(dev, torch.int64).flatten()   # all inside the context
        groups.append(SdpaGroup(q, c, len(seqs_list), n_blocks, rows, tables, None if q == c else causal_lower_right(q, c)))
    return replace(base, decodes=decodes, groups=tuple(groups))


def run(plan: PrefillPlan, query: torch.Tensor | SplitQuery, k_cache: torch.Tensor, v_cache: torch.Tensor,
        k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One layer's prefill attention as the step's plan says: query [num_tokens, num_q_heads,
    head_dim] (or split before, where ``plan.split_query``), this layer's K/V views (the plan's
    layout), fp8 scales. Returns [num_tokens, num_q_heads, head_dim] in query's dtype (its type
    before the split for a split query). No planning: shape checks, then the decode rows' run, the
    kernel's launch or each group's gather + SDPA."""
    split = isinstance(query, SplitQuery)
    if split:
        if not plan.split_query:
            raise ValueError("this step's prefill plan does not take a split query (it needs Hopper's kernel "
                             "for every multi-token row, bf16 or fp16 over an fp8 cache: PrefillPlan.split_query)")
        if plan.decodes is not None and query.rows is None:
            raise ValueError("this step's one-token rows attend over unsplit queries: split it with its rows kept "
                             "(rope_split_query(..., keep=plan.keep_rows))")
    elif plan.reference:
        return reference.paged_prefill_attention(query, k_cache, v_cache, plan.block_tables, plan.context_lens,
                                                 plan.query_start_loc, plan.scale, k_scale, v_scale)
    if tuple(query.shape) != plan.query_shape or tuple(k_cache.shape[1:]) != plan.cache_shape \
            or v_cache.shape != k_cache.shape:
        raise ValueError(f"query {tuple(query.shape)} and caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} "
                         f"do not match the plan's [{plan.query_shape}] over [*, {plan.cache_shape}]")
    reference._check_scales(k_cache, k_scale, v_scale)
    rows = query.rows if split else query   # what one-token rows attend with (16-bit for a split query)
    out = torch.empty(plan.query_shape, dtype=query.dtype, device=query.device)
    d = plan.decodes
    if d is not None:
        out[d.rows] = d.decode(rows[d.rows], k_cache, v_cache, d.block_tables, d.context_lens, plan.scale,
                               k_scale=k_scale, v_scale=v_scale)
    if plan.kernel is not None:
        from . import cuda
        cuda.paged_prefill_run(plan.kernel, query, k_cache, v_cache, plan.block_tables, plan.context_lens,
                               plan.query_start_loc, plan.scale, k_scale, v_scale, out=out)
        return out
    _, num_q_heads, head_dim = plan.query_shape
    block_size = k_cache.shape[2]
    for g in plan.groups:
        def gather(cache: torch.Tensor, cache_scale: float, g: SdpaGroup = g) -> torch.Tensor:
            """[n, Hkv, c, D] (a strided view of one gathered copy, heads outermost)."""
            x = cache.transpose(0, 1).index_select(1, g.tables)            # [Hkv, n * n_blocks, B, D]
            if x.dtype == reference.FP8:
                x = (x.float() * cache_scale).to(query.dtype)
            return x.view(x.shape[0], g.n, g.n_blocks * block_size, head_dim).transpose(0, 1)[:, :, :g.c]

        qs = query[g.rows].reshape(g.n, g.q, num_q_heads, head_dim).transpose(1, 2)   # [n, Hq, q, D]
        res = F.scaled_dot_product_attention(qs, gather(k_cache, k_scale), gather(v_cache, v_scale), attn_mask=g.mask,
                                             is_causal=g.mask is None, scale=plan.scale,
                                             enable_gqa=num_q_heads != k_cache.shape[1])
        out[g.rows] = res.transpose(1, 2).reshape(g.n * g.q, num_q_heads, head_dim)
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                            decode: DecodeFn = reference.paged_decode_attention,
                            host_lengths: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """One-shot: ``plan`` then ``run`` (``reference.paged_prefill_attention``'s signature).
    ``decode`` runs the one-query sequences (``paged_decode_attention``'s signature);
    ``host_lengths``, if given, is (query_start_loc, context_lens) as host integers, equal to the
    tensors (saves the host sync). A float8_e4m3fn cache is dequantized (times k_scale,
    v_scale) into the query's dtype as it is gathered."""
    reference._check_prefill(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scale, v_scale)
    if context_lens.shape[0] == 0:
        return torch.empty_like(query)
    step = plan(query, k_cache, block_tables, context_lens, query_start_loc, scale, host_lengths=host_lengths,
                decode=decode)
    return run(step, query, k_cache, v_cache, k_scale, v_scale)


def _index(ids: list[int], device: torch.device) -> Index:
    """ids as an index: a slice (a view, no copy, no transfer) when they are consecutive."""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return torch.tensor(ids, device=device)
