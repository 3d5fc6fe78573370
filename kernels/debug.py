"""Benchmark and test entry points of kvpager's CUDA kernels: the knobs that serving never
turns, kept off the serving signatures of ``kernels/cuda.py``.

- decode: a forced split count and kernel instance (2 or 4 16-byte loads in flight per lane;
  ``mma``: the tensor-core instance (True; over fp8 caches the default, over 16-bit ones an
  option), the tensor-core one whose K/V the copy engine stages (2; 16-bit caches, Hopper) or the
  FMA one (False)),
  the L2 prefetch distance, the split-KV workspace filled with NaN before the launch (a merge
  that reads a partial no split wrote then shows up as NaN), the work-list planner's knobs;
- prefill: the kernel instance (4 or 8 warps, mma.sync or wgmma);
- swaps: the non-default modes ("batch": one cudaMemcpyBatchAsync; "kernel": a zero-copy SM
  kernel over mapped pinned memory).

Used by ``benchmarks/kernels.py`` and ``tests/gpu``; every function here plans and runs in one
call (the serving path plans once per step, ``cuda.DecodePlan``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from . import cuda
from . import decode_plan as work_plan


def _count(name: str, value: int | None, allowed: tuple[int, ...] | None = None) -> int:
    """0 for None (the planner's choice), else the positive int given (one of ``allowed``)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (allowed and value not in allowed):
        raise ValueError(f"{name} must be {' or '.join(map(str, allowed)) if allowed else 'a positive int'} "
                         f"or None, got {value!r}")
    return value


def _mma(value: bool | int | None) -> int:
    """-1 for None (the planner's choice), 1 for True (the tensor-core instance), 0 for False (the
    FMA one), or 2 (the tensor-core instance whose K/V the copy engine stages: 16-bit caches, Hopper)."""
    if value is None:
        return -1
    if isinstance(value, bool):
        return int(value)
    if value != 2:
        raise ValueError(f"mma must be True, False, 2 or None, got {value!r}")
    return 2


def plan_decode_grid(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, *, num_splits: int | None = None, loads: int | None = None,
                     mma: bool | int | None = None) -> cuda.DecodeGridPlan:
    """``cuda.plan_decode_grid`` with a forced split count (about ``num_splits`` partitions:
    fewer when the table is too narrow to give each one) and/or kernel instance (``loads``;
    ``mma``: True, the tensor-core instance (fp8 or 16-bit caches, head_dim 64/128; over a 16-bit
    cache loads 2 only), ValueError where not built; 2, the one staged by the copy engine (16-bit
    caches, Hopper); False, the FMA one)."""
    return cuda._plan_grid(query, k_cache, v_cache, block_tables, context_lens, _count("num_splits", num_splits),
                           _count("loads", loads, (2, 4)), _mma(mma))


def decode_plan(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, num_splits: int | None = None, *, loads: int | None = None,
                mma: bool | int | None = None) -> tuple[int, int, int, int]:
    """``(num_splits, partition_tokens, head_tile, loads)`` of the grid plan for these inputs."""
    plan = plan_decode_grid(query, k_cache, v_cache, block_tables, context_lens, num_splits=num_splits, loads=loads,
                            mma=mma)
    return plan.num_splits, plan.partition_tokens, plan.head_tile, plan.loads


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, *, loads: int | None = None,
                           prefetch_steps: int | None = None, poison_workspace: bool = False,
                           out: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, mma: bool | int | None = None) -> torch.Tensor:
    """``cuda.paged_decode_attention`` (grid plan + run) with its knobs: ``num_splits``, ``loads``
    and ``mma`` as in :func:`plan_decode_grid`; ``prefetch_steps``: the L2 prefetch distance in
    block iterations (None: the default, 1, or 0 on the tensor-core instance); ``poison_workspace``:
    NaN in the workspace first."""
    plan = plan_decode_grid(query, k_cache, v_cache, block_tables, context_lens, num_splits=num_splits, loads=loads,
                            mma=mma)
    if poison_workspace and plan.workspace is not None:
        for part in plan.workspace:
            part.fill_(float("nan"))
    return cuda._run_grid(plan, query, k_cache, v_cache, block_tables, context_lens, scale, out, k_scale, v_scale,
                          -1 if prefetch_steps is None else int(prefetch_steps))


def paged_decode_run(plan: cuda.DecodePlan, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                     prefetch_steps: int | None = None, out: torch.Tensor | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """``cuda.paged_decode_run`` with the L2 prefetch distance in block iterations
    (``prefetch_steps``; None: the default, 1, or 0 on the tensor-core instance)."""
    return cuda._run_work(plan, query, k_cache, v_cache, block_tables, context_lens, scale, out, k_scale, v_scale,
                          -1 if prefetch_steps is None else int(prefetch_steps))


def decode_work_geometry(query_like: torch.Tensor, k_cache: torch.Tensor, *, loads: int | None = None,
                         mma: bool | int | None = None) -> cuda.DecodeGeometry:
    """``cuda.decode_work_geometry`` with a forced kernel instance (``loads`` 2 or 4; ``mma`` as
    in :func:`plan_decode_grid`)."""
    return cuda.decode_work_geometry(query_like, k_cache, loads=_count("loads", loads, (2, 4)), mma=_mma(mma))


def plan_decode_work(context_lens, geometry: cuda.DecodeGeometry, capacity: int | None = None, *,
                     min_item: int = work_plan.MIN_ITEM, item_cost: int | None = None) -> np.ndarray:
    """``cuda.plan_decode_work`` with the planner's knobs (for sweeps; ``item_cost`` None: the
    geometry's)."""
    return cuda._plan_work(context_lens, geometry, capacity, min_item,
                           geometry.item_cost if item_cost is None else item_cost)


def decode_plan_on(device: torch.device | str, host_plan: np.ndarray, geometry: cuda.DecodeGeometry, rows: int, *,
                   num_q_heads: int, head_dim: int, poison_workspace: bool = False) -> cuda.DecodePlan:
    """A ``cuda.DecodePlan`` from a host work list (uploaded here) with a fresh workspace for
    ``rows`` rows, NaN-filled when ``poison_workspace``."""
    workspace = cuda.decode_workspace(geometry.capacity(rows), num_q_heads, head_dim, device)
    if poison_workspace:
        for part in workspace:
            part.fill_(float("nan"))
    return cuda.DecodePlan(geometry, torch.from_numpy(host_plan).to(device), workspace)


def with_work(plan: cuda.DecodePlan, host_plan: np.ndarray) -> cuda.DecodePlan:
    """The same plan (geometry, workspace) over another host work list of the same size."""
    return dataclasses.replace(plan, work=torch.from_numpy(host_plan).to(plan.work.device))


def plan_prefill(query_like: torch.Tensor, k_cache: torch.Tensor, host_lengths, seqs=None, *,
                 warps: int | None = None, wgmma: bool | None = None,
                 schedule: str | None = None) -> cuda.PrefillKernelPlan:
    """``cuda.plan_prefill`` on a chosen instance (``warps``, ``wgmma``, ``schedule`` as in
    :func:`paged_prefill_attention`), for ``cuda.paged_prefill_run``."""
    w = _count("warps", warps, (4, 8)) or cuda.PREFILL_WARPS
    return cuda._plan_prefill(query_like, k_cache, host_lengths, seqs, w, wgmma, schedule)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, k_scale: float = 1.0, v_scale: float = 1.0, *, host_lengths=None,
                            seqs=None, out: torch.Tensor | None = None, warps: int | None = None,
                            wgmma: bool | None = None, schedule: str | None = None) -> torch.Tensor:
    """``cuda.paged_prefill_attention`` on a chosen instance: ``warps`` 4 or 8 (default 8),
    ``wgmma`` (default: where built for the device; needs 8 warps; instances not built for
    sm_90a run mma.sync), ``schedule`` "static" or "dynamic" (default: ``cuda.prefill_schedule``)."""
    w = _count("warps", warps, (4, 8)) or cuda.PREFILL_WARPS
    return cuda._prefill(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale, v_scale,
                         host_lengths, seqs, out, w, wgmma, schedule)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                mode: str = cuda.DEFAULT_SWAP_MODE) -> None:
    """``cuda.swap_blocks`` in any of ``cuda.SWAP_MODES``: "dma" (the default: copy engines, one
    cudaMemcpyAsync per run of consecutive pairs), "batch" (the same copies as one
    cudaMemcpyBatchAsync; CUDA 13, "dma" on the legacy default stream), "kernel" (one zero-copy
    kernel whose threads read or write the mapped pinned host memory; uses SMs)."""
    cuda._swap(src_cache, dst_cache, src, dst, mode)
