"""kvpager's own CUDA kernels: paged decode and prefill attention, K/V writes, block copies and swaps.

Same semantics as :mod:`kvpager.kernels.reference` (the oracle they are tested against), for
CUDA tensors. Decode attention is split as FlashInfer splits it: a plan made once per step
(``DecodePlan``: the work-list geometry, fixed per model, the step's work list and the split-KV
workspace; or ``DecodeGridPlan`` from the table's width) and a run per layer
(``paged_decode_run``, ``paged_decode_grid_run``) that checks its inputs and launches, never
re-plans and never allocates. ``paged_decode_attention`` is the one-shot form (plan + run).
Prefill likewise: ``PrefillKernelPlan`` (the step's work list, uploaded once; the instance) made by
``plan_prefill``, run per layer by ``paged_prefill_run``; ``paged_prefill_attention`` is one-shot.
These are what serving calls; benchmark and test knobs are in ``kernels/debug.py``; building and
loading the extension (``kernels/csrc``, JIT with ninja, cached outside the repository) is
``kernels/extension.py``.

Cache layout (``kvpager.worker.kv_cache``): one block-major tensor
``kv_cache[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``; attention reads a
layer through the views ``k_cache = kv_cache[:, layer, 0]`` and ``v_cache = kv_cache[:, layer, 1]``,
``[num_blocks, num_kv_heads, block_size, head_dim]`` with any block stride and packed inner dims
(head stride ``block_size * head_dim``, token stride ``head_dim``, element stride 1).

Supported: float32, float16 and bfloat16, and float8_e4m3fn caches (per-tensor k_scale and
v_scale) with float16/bfloat16 queries and K/V; head_dim 64, 128, 256; block_size 8, 16, 32;
any GQA ratio (query heads a multiple of KV heads). Decode over float8_e4m3fn caches of head_dim
64/128 runs on tensor cores (``mma`` in the plans; ``kernels/debug.py`` forces the FMA instance,
or the tensor-core one over 16-bit caches, which plans take on devices whose DRAM peaks at
4.2 TB/s or more (an H200) or when built with ``-DKVPAGER_DECODE_MMA16=1``; built with
``-DKVPAGER_DECODE_MMA_BULK=1``, that instance is, on Hopper, the one whose K/V the copy engine
stages in shared memory, ``paged_decode_bulk.cuh``: docs/performance.md). Prefill (``paged_prefill_attention``, one
launch per ragged batch, tensor cores: wgmma on Hopper, mma.sync elsewhere): float16/bfloat16
queries over caches of their dtype or float8_e4m3fn, head_dim 64/128, block_size 8-64; the rest
falls back to ``kernels/prefill.py``'s gather + SDPA. Inputs are checked (device, dtype, shape, strides,
alignment) and rejected with ``ValueError``. Data-dependent checks that would need a device
sync are not made: block-table entries and slots outside the cache are skipped (never
dereferenced), and a context longer than its table row is clamped to the row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from . import decode_plan as work_plan
from .extension import available, load, load_error
from .prefill_plan import PREFILL_WARPS, check_schedule, prefill_schedule, prefill_work
from .split_query import SPLIT_DTYPES, SplitQuery

__all__ = ["available", "load_error", "supports_decode", "DecodeGeometry", "DecodePlan", "DecodeGridPlan",
           "decode_work_geometry", "plan_decode_work", "decode_workspace", "paged_decode_run", "plan_decode_grid",
           "paged_decode_grid_run", "paged_decode_attention", "supports_prefill", "prefill_work", "prefill_schedule",
           "PrefillKernelPlan", "plan_prefill", "paged_prefill_run", "paged_prefill_attention", "supports_split_query",
           "split_query", "rope_split_query", "write_kv", "copy_blocks", "swap_blocks", "SWAP_MODES", "add_rms_norm", "rope",
           "silu_and_mul"]

HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


FP8 = torch.float8_e4m3fn


def supports_decode(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the decode kernel is built for this head dim, block size and (query, cache) dtypes:
    the same float32/float16/bfloat16, or float16/bfloat16 over a float8_e4m3fn cache."""
    dtypes_ok = query.dtype in DTYPES and (
        query.dtype == k_cache.dtype or (k_cache.dtype == FP8 and query.dtype != torch.float32))
    return k_cache.shape[3] in HEAD_DIMS and k_cache.shape[2] in BLOCK_SIZES and dtypes_ok


# ---- paged decode: planned once per step, run per layer (FlashInfer's plan/run split) ----
#
# The plan (kernels/csrc/decode_plan.cu: the kernel instance, head tile and grid or work-list
# geometry; the step's work list; the split-KV workspace) is made once per step, or once per
# model for the work-list geometry; the run functions only check inputs and launch what the
# plan says. Benchmark and test knobs (forced split counts and kernel instances, the L2 prefetch
# distance, workspace poisoning, planner knobs) live in kernels/debug.py, not here.

@dataclass(frozen=True)
class DecodeGeometry:
    """A work-list decode launch's fixed shape for one (model, cache, device): ``workers`` thread
    blocks per (KV head, head chunk), the kernel instance (``loads``; ``mma``: 1, the tensor-core
    instance; 2, the one whose K/V the copy engine stages, Hopper), query heads per block, the most tokens one item may hold, and the planner's cost of
    an item in tokens (``decode_plan.item_cost_for`` the cache's element size)."""
    workers: int
    loads: int
    head_tile: int
    longest_item: int
    mma: int = 0                # 0 FMA, 1 tensor cores, 2 tensor cores staged by the copy engine (Hopper)
    item_cost: int = work_plan.ITEM_COST

    def capacity(self, num_seqs: int) -> int:
        """Item slots a plan for ``num_seqs`` rows needs."""
        return work_plan.capacity_for(num_seqs, self.workers)

    def plan_size(self, num_seqs: int, capacity: int | None = None) -> int:
        """Ints of a plan for ``num_seqs`` rows (``capacity`` item slots, default ``capacity(num_seqs)``)."""
        return work_plan.plan_size(num_seqs, self.capacity(num_seqs) if capacity is None else capacity)


Workspace = tuple[torch.Tensor, torch.Tensor]   # part_out [rows, num_q_heads, head_dim], part_ml [rows, num_q_heads, 2]


@dataclass(frozen=True)
class DecodePlan:
    """One step's work-list decode plan, made once and read by every layer's
    :func:`paged_decode_run`: the geometry, the work list on the device (``plan_decode_work`` of
    the step's host lengths, uploaded with the step's other inputs) and the split-KV workspace
    (at least ``geometry.capacity(num_seqs)`` rows, see :func:`decode_workspace`)."""
    geometry: DecodeGeometry
    work: torch.Tensor          # [geometry.plan_size(num_seqs)] int32, on the device
    workspace: Workspace


@dataclass(frozen=True)
class DecodeGridPlan:
    """A grid decode plan (one thread block per KV head chunk, sequence and split; splits cut
    from the block table's width, so no host lengths are needed): made once for a step's sizes
    by :func:`plan_decode_grid`, read by every layer's :func:`paged_decode_grid_run`."""
    num_splits: int             # 1: unsplit (no merge kernel, no workspace)
    partition_tokens: int       # tokens per split
    head_tile: int              # query heads per thread block
    loads: int                  # kernel instance: 16-byte K (and V) loads in flight per lane
    mma: int                    # 0 FMA; 1, 2 tensor cores (head_dim 64/128; fp8 caches by default), as DecodeGeometry
    num_seqs: int
    table_width: int            # block-table width (entries) the plan covers
    workspace: Workspace | None   # [num_seqs * num_splits, ...] rows when num_splits > 1


_geometries: dict[tuple, DecodeGeometry] = {}


def decode_work_geometry(query_like: torch.Tensor, k_cache: torch.Tensor, *, loads: int = 0,
                         mma: int = -1) -> DecodeGeometry:
    """The work-list geometry for queries like ``query_like`` ([*, num_q_heads, head_dim], its
    dtype and device) over ``k_cache``'s layout. Cached: planned once per configuration.
    (``loads``: 0, the planner's instance; ``mma``: -1, the planner's choice; kernels/debug.py
    forces them.)"""
    key = (query_like.device, query_like.dtype, tuple(query_like.shape[1:]), k_cache.dtype, tuple(k_cache.shape[1:]),
           loads, mma)
    geometry = _geometries.get(key)
    if geometry is None:
        q = query_like.new_empty(1, *query_like.shape[1:])
        workers, chosen, tile, longest, use_mma = (int(x) for x in load().decode_work_geometry(q, k_cache, int(loads),
                                                                                              int(mma)))
        geometry = DecodeGeometry(workers, chosen, tile, longest, use_mma,
                                  work_plan.item_cost_for(k_cache.element_size()))
        _geometries[key] = geometry
    return geometry


def plan_decode_work(context_lens, geometry: DecodeGeometry, capacity: int | None = None, *,
                     out: np.ndarray | None = None) -> np.ndarray:
    """The step's work list (int32 numpy, ``decode_plan`` layout) for these host context lengths
    (a list or an integer array, one per row; 0 for padding rows): the C++ planner, equal to
    ``decode_plan.plan_decode_work`` and ~50x faster. Raises ValueError as that one does.
    ``out``: a contiguous int32 array of the plan's size to write it into (every int is written)."""
    return _plan_work(context_lens, geometry, capacity, work_plan.MIN_ITEM, geometry.item_cost, out)


def _plan_work(context_lens, geometry: DecodeGeometry, capacity: int | None, min_item: int,
               item_cost: int, out: np.ndarray | None = None) -> np.ndarray:
    lens = np.ascontiguousarray(context_lens, dtype=np.int32)
    size = geometry.plan_size(len(lens), capacity)
    if out is None:
        out = np.empty(size, dtype=np.int32)
    elif out.dtype != np.int32 or out.shape != (size,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous int32 array of {size} ints, got {out.dtype} {out.shape}")
    load().plan_decode_work(torch.from_numpy(lens), geometry.workers, geometry.longest_item, min_item, item_cost,
                             torch.from_numpy(out))
    return out


def decode_step_stager(inputs: torch.Tensor, previous: torch.Tensor, layouts: list[tuple[int, int, int, int, int]],
                       geometry: DecodeGeometry | None, slots: int = 4):
    """The extension's ``DecodeStepStager`` (kernels/csrc/decode_stage_binding.cpp): a CUDA-graph
    decode step's host path in one call. ``layouts``: each batch bucket's (batch, context_at,
    work_at, work_end, tables_at) byte offsets in ``inputs`` (the graphs' uint8 input buffer) and
    in the stager's own ``slots`` pinned buffers; ``previous``: the int64 ids fed steps take their
    tokens from; ``geometry``: the work list's (None: the graphs take none).
    ``stage(bucket, graph_exec, tokens, positions, slots, feedback_rows, context_lens, tables,
    rows, width, table_stride, previous_ids)`` writes a step into the next pinned buffer (its work
    list planned there as ``plan_decode_work`` plans it), enqueues on the current stream its copy,
    the fed ids' copy and, unless ``graph_exec`` is 0, that graph's launch, and returns the bytes
    copied; ValueError for bad input, with nothing enqueued."""
    workers, longest, item_cost = ((geometry.workers, geometry.longest_item, geometry.item_cost)
                                   if geometry is not None else (0, 0, work_plan.ITEM_COST))
    return load().DecodeStepStager(inputs, previous, [list(lay) for lay in layouts], workers, longest,
                                   work_plan.MIN_ITEM, item_cost, slots)


def decode_workspace(rows: int, num_q_heads: int, head_dim: int, device: torch.device | str) -> Workspace:
    """An empty split-KV workspace of ``rows`` partial rows (a plan's capacity, or a grid plan's
    num_seqs * num_splits): each plan writes every row it reads."""
    return (torch.empty(rows, num_q_heads, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, num_q_heads, 2, dtype=torch.float32, device=device))


def paged_decode_run(plan: DecodePlan, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                     out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One layer's decode attention over the step's work-list plan: one new token per sequence
    attending to all of its cached tokens (its own included).

    query:            [num_seqs, num_q_heads, head_dim], float32/float16/bfloat16, CUDA; last dim
                      contiguous, other strides multiples of 16 bytes
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] views of the block-major
                      cache (any block stride, equal for K and V; packed inner dims), query's
                      dtype or float8_e4m3fn (with a float16/bfloat16 query)
    block_tables:     [num_seqs, max_blocks] int32 (entries past a context are never read; an entry
                      within one that is not a block id, negative or >= num_blocks, is never
                      dereferenced: its tokens are left out of the softmax)
    context_lens:     [num_seqs] int32 on the device: the lengths the plan was made from (0: a
                      padding row, written as zeros)
    out:              optional [num_seqs, num_q_heads, head_dim] output (query's dtype)
    k_scale, v_scale: fp8 caches: real K = stored K * k_scale, V alike
    returns           [num_seqs, num_q_heads, head_dim] in query's dtype (``out`` if given)

    No host work beyond the checks and the launch, no allocation but ``out`` when not given: a
    CUDA graph can capture it, and replays serve any plan of the same size written into
    ``plan.work``. GQA: q head h reads kv head h // (num_q_heads // num_kv_heads).
    """
    return _run_work(plan, query, k_cache, v_cache, block_tables, context_lens, scale, out, k_scale, v_scale, -1)


def _run_work(plan: DecodePlan, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, out: torch.Tensor | None,
              k_scale: float, v_scale: float, prefetch_steps: int) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    g = plan.geometry
    part_out, part_ml = plan.workspace
    load().paged_decode_work(out, query, k_cache, v_cache, block_tables, context_lens, plan.work, part_out, part_ml,
                              g.workers, g.loads, g.head_tile, int(g.mma), int(prefetch_steps), float(scale),
                              float(k_scale), float(v_scale))
    return out


def plan_decode_grid(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor) -> DecodeGridPlan:
    """A grid plan for decode calls over these inputs' sizes (the step's query rows, the cache
    layout, the block table's width), with its workspace: splits chosen from the batch size,
    num_kv_heads, the longest possible context (max_blocks * block_size: no device sync) and the
    SM count. Make it once per step; every layer's :func:`paged_decode_grid_run` reuses it."""
    return _plan_grid(query, k_cache, v_cache, block_tables, context_lens, 0, 0, -1)


def _plan_grid(query, k_cache, v_cache, block_tables, context_lens, num_splits: int, loads: int,
               mma: int) -> DecodeGridPlan:
    splits, partition, tile, chosen, use_mma = (int(x) for x in load().decode_grid_plan(
        query, k_cache, v_cache, block_tables, context_lens, int(num_splits), int(loads), int(mma)))
    rows = query.shape[0] * splits
    workspace = decode_workspace(rows, query.shape[1], query.shape[2], query.device) if splits > 1 and rows else None
    return DecodeGridPlan(splits, partition, tile, chosen, use_mma, query.shape[0], block_tables.shape[1],
                          workspace)


def paged_decode_grid_run(plan: DecodeGridPlan, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                          out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One layer's decode attention as the grid plan says; tensors as in :func:`paged_decode_run`
    (``context_lens``: each >= 1; a length <= 0 gives a zero row). The plan must be made for
    tables at least this wide (checked)."""
    return _run_grid(plan, query, k_cache, v_cache, block_tables, context_lens, scale, out, k_scale, v_scale, -1)


def _run_grid(plan: DecodeGridPlan, query, k_cache, v_cache, block_tables, context_lens, scale, out, k_scale, v_scale,
              prefetch_steps: int) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    part_out, part_ml = plan.workspace if plan.workspace is not None else (None, None)
    load().paged_decode(out, query, k_cache, v_cache, block_tables, context_lens, part_out, part_ml, plan.num_splits,
                         plan.partition_tokens, plan.head_tile, plan.loads, int(plan.mma), int(prefetch_steps),
                         float(scale),
                         float(k_scale), float(v_scale))
    return out


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """One-shot decode attention (``reference.paged_decode_attention``'s signature): a grid plan
    for these inputs (:func:`plan_decode_grid`), then one run. For a caller with one call to make;
    a step that attends in every layer plans once (:func:`plan_decode_grid`, or a work list from
    the host lengths, :class:`DecodePlan`) and runs each layer with the plan."""
    plan = plan_decode_grid(query, k_cache, v_cache, block_tables, context_lens)
    return paged_decode_grid_run(plan, query, k_cache, v_cache, block_tables, context_lens, scale, out=out,
                                 k_scale=k_scale, v_scale=v_scale)


# ---- paged prefill (kernels/csrc/paged_prefill.cuh) ----

PREFILL_HEAD_DIMS = (64, 128)
PREFILL_BLOCK_SIZES = (8, 16, 32, 64)


def prefill_wgmma(device: torch.device) -> bool:
    """Whether prefill launches use the wgmma instances on ``device`` (Hopper, built for sm_90a)."""
    return torch.cuda.get_device_capability(device) == (9, 0) and has_wgmma(device)


_wgmma_built: dict = {}


def has_wgmma(device: torch.device) -> bool:
    """Whether the extension's prefill wgmma instances hold wgmma code for ``device`` (probed once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _wgmma_built:
        _wgmma_built[index] = bool(load().prefill_has_wgmma(index))
    return _wgmma_built[index]


def supports_prefill(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the prefill kernel is built for these: float16/bfloat16 queries over a cache of the
    same dtype or float8_e4m3fn, head_dim 64 or 128, block_size 8 to 64 (a power of two)."""
    return (query.dtype in (torch.float16, torch.bfloat16) and k_cache.dim() == 4
            and (k_cache.dtype == query.dtype or k_cache.dtype == FP8)
            and k_cache.shape[3] in PREFILL_HEAD_DIMS and k_cache.shape[2] in PREFILL_BLOCK_SIZES)


@dataclass(frozen=True)
class PrefillKernelPlan:
    """One step's prefill-kernel plan, made once (:func:`plan_prefill`) and read by every layer's
    :func:`paged_prefill_run`: the kernel instance and the step's work list on the device."""
    work: torch.Tensor          # [num_items, 2] int32 (sequence, row tile), on the device
    warps: int                  # 4 or 8 warps per block
    wgmma: bool                 # the Hopper (wgmma) instance, else mma.sync
    # The dynamic schedule's int32 [2] device counter (zeros; every launch leaves it zero), else
    # None (static). The plan's launches must run one after another (one stream), as layers do.
    counter: Optional[torch.Tensor] = None


def plan_prefill(query_like: torch.Tensor, k_cache: torch.Tensor, host_lengths, seqs=None) -> PrefillKernelPlan:
    """The step's prefill plan for queries like ``query_like`` ([*, num_q_heads, head_dim], its
    device) over ``k_cache``'s layout: ``prefill_work`` of ``host_lengths`` ((query starts,
    context lengths) as host ints), uploaded once through pinned memory (no sync), and the 8-warp
    instance (wgmma where built for the device), scheduled as :func:`prefill_schedule` says.
    ``seqs``: as in :func:`prefill_work`."""
    return _plan_prefill(query_like, k_cache, host_lengths, seqs, PREFILL_WARPS, None)


def _plan_prefill(query_like, k_cache, host_lengths, seqs, warps: int, wgmma: bool | None,
                  schedule: str | None = None) -> PrefillKernelPlan:
    use_wgmma = (prefill_wgmma(query_like.device) and warps == 8) if wgmma is None else bool(wgmma)
    # The persistent kernel (paged_prefill_ws.cuh) is the wgmma one, over 16-bit and fp8 caches
    # alike; the others launch a block per item and take the heaviest-first list whatever the schedule.
    chosen = check_schedule(schedule) if schedule else prefill_schedule(use_wgmma)
    dynamic = use_wgmma and chosen == "dynamic"
    group = query_like.shape[1] // k_cache.shape[1]
    work = torch.from_numpy(prefill_work(host_lengths[0], host_lengths[1], group, warps, seqs,
                                         order="by_sequence" if dynamic else "heaviest"))
    counter = None
    if query_like.device.type == "cuda":
        work = work.pin_memory().to(query_like.device, non_blocking=True)
        if dynamic:
            counter = torch.zeros(2, dtype=torch.int32, device=query_like.device)
    return PrefillKernelPlan(work, warps, use_wgmma, counter)


def supports_split_query(query_like: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_prefill_run` takes a :class:`SplitQuery` for queries like
    ``query_like`` (bf16 or fp16, its device) over ``k_cache``: a float8_e4m3fn cache of head_dim
    64 or 128, read by Hopper's warp-specialized kernel (built for sm_90a; fp16 unless built with
    ``KVPAGER_PREFILL_WS_FP16_SPLIT=0``)."""
    return (query_like.is_cuda and query_like.dtype in SPLIT_DTYPES and k_cache.dtype == FP8
            and k_cache.dim() == 4 and bool(load().prefill_split_query_supported(query_like, k_cache)))


def rope_split_query(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
                     kv_heads: int, out: SplitQuery | None = None, keep: torch.Tensor | None = None) -> SplitQuery:
    """q ``[T, Hq, D]`` (bf16 or fp16, D 64 or 128) rotated by cos/sin ``[T, D]`` (None: as it is) and
    written split for the fp8 prefill kernel (``kernels/split_query.py``), q itself left as it is
    but at the tokens ``keep`` marks (int32 ``[T]``, nonzero: rotated in place too, and q returned
    as the result's ``rows``); k ``[T, Hk, D]`` rotated in place as :func:`rope` does (None: no k).
    One launch."""
    tokens, heads, head_dim = q.shape
    if out is None:
        out = SplitQuery.empty(tokens, heads, head_dim, kv_heads, q.device, q.dtype)
    elif out.dtype != q.dtype:
        raise ValueError(f"out holds a split {out.dtype} query, q is {q.dtype}")
    load().rope_split_query(q, k, cos, sin, out.data, out.down, keep)
    return out if keep is None else replace(out, rows=q)


def split_query(q: torch.Tensor, kv_heads: int, out: SplitQuery | None = None) -> SplitQuery:
    """q (bf16 or fp16 ``[T, Hq, D]``) split for the fp8 prefill kernel as it is (no rotation)."""
    return rope_split_query(q, None, None, None, kv_heads, out)


def paged_prefill_run(plan: PrefillKernelPlan, query: torch.Tensor | SplitQuery, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      scale: float, k_scale: float = 1.0, v_scale: float = 1.0, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's prefill attention as the step's plan says: ``reference.paged_prefill_attention``
    on tensor cores, one launch for the whole ragged batch, K/V read straight from the pages.

    query:            [num_tokens, num_q_heads, head_dim] float16/bfloat16 (last dim contiguous), or
                      a query split ahead (:class:`SplitQuery`, where :func:`supports_split_query`;
                      the output is of its type before the split)
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] views, query's dtype or
                      float8_e4m3fn (real K = stored * k_scale, V alike); head_dim 64/128
    block_tables, context_lens, query_start_loc: int32 on the device, as in the reference (the
                      lengths the plan was made from); a table entry within a context that is not a
                      block id (negative or >= num_blocks) is never dereferenced, its keys and
                      values read as zeros (decode leaves such tokens out instead: tables are
                      expected to hold valid ids within their contexts)
    out:              optional output; rows of sequences the plan does not cover are left as they are

    No host work beyond the launcher's checks and the launch (no planning, no upload, no sync).
    """
    down = None
    if isinstance(query, SplitQuery):
        down = query.down
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        query = query.data.view(query.dtype)   # the kernel copies a row's 2 * head_dim bytes as they are
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if plan.work.shape[0] == 0:
        return out
    load().paged_prefill(out, query, k_cache, v_cache, block_tables, context_lens, query_start_loc, plan.work,
                          float(scale), float(k_scale), float(v_scale), int(plan.warps), plan.wgmma, plan.counter,
                          down)
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, k_scale: float = 1.0, v_scale: float = 1.0, *,
                            host_lengths=None, seqs=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot prefill (:func:`plan_prefill`, then :func:`paged_prefill_run`), tensors as there.

    host_lengths:     (query_start_loc, context_lens) as host lists, equal to the tensors (no
                      sync; without it they are read from the device once)
    seqs:             the sequences to compute (default: all with new tokens); the rows of the
                      others are left as they are in ``out``

    A step that attends in every layer plans once instead (``kernels/prefill.py`` ``plan``).
    """
    return _prefill(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale, v_scale,
                    host_lengths, seqs, out, PREFILL_WARPS, None)


def _prefill(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale, v_scale,
             host_lengths, seqs, out, warps: int, wgmma: bool | None, schedule: str | None = None) -> torch.Tensor:
    if host_lengths is None:
        n = context_lens.shape[0]
        lengths = torch.cat([query_start_loc.to("cpu", torch.int64), context_lens.to("cpu", torch.int64)]).tolist()
        host_lengths = (lengths[:n + 1], lengths[n + 1:])
    plan = _plan_prefill(query, k_cache, host_lengths, seqs, warps, wgmma, schedule)
    return paged_prefill_run(plan, query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                             k_scale, v_scale, out=out)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new K/V into their slots, in place. A negative slot is padding and is skipped
    (so is a slot past the cache); two tokens mapped to one slot leave either one.

    key, value:       [num_tokens, num_kv_heads, head_dim], the cache's dtype (float16/bfloat16 for
                      a float8_e4m3fn cache), CUDA; last dim contiguous, other strides multiples of
                      16 bytes (slices of a fused QKV are fine)
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] views (packed inner dims)
    slot_mapping:     [num_tokens] integer slots ``block_id * block_size + offset``; int32 and int64
                      are used as they are, other integer dtypes are converted to int64; moved to
                      the cache's device if elsewhere
    k_scale, v_scale: fp8 caches only: K is stored as key / k_scale, saturated to +-448 (V alike)
    """
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
            raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
        slot_mapping = slot_mapping.long()
    slot_mapping = slot_mapping.to(k_cache.device).contiguous()
    load().write_kv(key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale))


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (every layer, K and V) within one block-major cache, in place:
    ``kv_cache[dst[i]] = kv_cache[src[i]]``, all pairs in one launch.

    kv_cache: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], contiguous, CUDA
    src, dst: [num_pairs] integer block ids, on any device (moved to the cache's device as int64)

    Pairs must not chain (no dst is also a src, no dst repeats): pairs run in parallel. Pairs
    naming a block outside the cache are skipped.
    """
    if src.dim() != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be [num_pairs], got {tuple(src.shape)} and {tuple(dst.shape)}")
    if src.numel() == 0:
        return
    dev = kv_cache.device
    load().copy_blocks(kv_cache, src.to(dev, torch.int64).contiguous(), dst.to(dev, torch.int64).contiguous())


SWAP_MODES = ("dma", "batch", "kernel")
# What swap_blocks does. benchmarks/kernels.py measures all three (kernels/debug.py runs the
# others; docs/performance.md): on an H100 each runs at >= 90% of the pinned-copy ceiling, and
# only "dma" leaves concurrent compute unslowed (the batch API slowed a matmul load by ~22%, the
# zero-copy kernel by ~63%).
DEFAULT_SWAP_MODE = "dma"


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move whole blocks between the device cache and the pinned host swap space (either
    direction; device to device works too): ``dst_cache[dst[i]] = src_cache[src[i]]``, on the
    copy engines (one cudaMemcpyAsync per run of consecutive pairs; no SM used, so it overlaps
    compute fully). Asynchronous: enqueued on the CURRENT stream of the device's side and
    returns at once; the host side is complete once that stream reaches this point (an event or
    a sync).

    src_cache, dst_cache: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim],
                          contiguous, same block shape and dtype; the host one pinned
    src, dst:             [num_pairs] integer block ids, any device; destinations distinct

    Pairs naming a block outside its cache are skipped.
    """
    _swap(src_cache, dst_cache, src, dst, DEFAULT_SWAP_MODE)


def _swap(src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, mode: str) -> None:
    if mode not in SWAP_MODES:
        raise ValueError(f"mode must be one of {SWAP_MODES}, got {mode!r}")
    if src.dim() != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be [num_pairs], got {tuple(src.shape)} and {tuple(dst.shape)}")
    if src.numel() == 0:
        return
    mod = load()
    if mode == "kernel":
        dev = src_cache.device if src_cache.is_cuda else dst_cache.device
        mod.swap_blocks_kernel(src_cache, dst_cache, src.to(dev, torch.int64, non_blocking=True).contiguous(),
                               dst.to(dev, torch.int64, non_blocking=True).contiguous())
    else:
        mod.swap_blocks_dma(src_cache, dst_cache, src.to("cpu", torch.int64).contiguous(),
                            dst.to("cpu", torch.int64).contiguous(), mode == "batch")


# ---- the decoder's per-layer elementwise ops (kernels/layer_reference.py says what each computes) ----
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x ``[rows, hidden]`` (+= delta, in place, when given) normalized times weight; into
    ``out`` (a new tensor if None). float32/float16/bfloat16, last dims contiguous."""
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    load().add_rms_norm(out, x, delta, weight, float(eps))
    return out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in place by cos/sin ``[T, D]``; returns them."""
    load().rope(q, k, cos, sin)
    return q, k


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` ``[rows, width]`` for gate_up ``[rows, 2 * width]``."""
    if out is None:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    load().silu_and_mul(out, gate_up)
    return out
