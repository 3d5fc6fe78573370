"""The kernels the worker calls: our CUDA kernels for tensors on a CUDA device when the
extension builds, the torch reference everywhere else. Prefill attention on CUDA
(``kernels/prefill.py``) runs our paged prefill kernel where it measured faster (cached
prefixes, many shapes) and gathers K/V for torch SDPA otherwise; decodes riding in the same step
go to our decode kernel.

Same signatures and semantics as ``kvpager.kernels.reference`` for valid inputs. Block table
entries within a context must be blocks of the cache, and slots must lie in it: the CUDA kernels
never touch memory outside the cache, but where the reference raises ValueError on such an entry
they answer it each their own way (write_kv drops the token, the decode leaves it out, the prefill
kernel reads zeros; gathering for SDPA would hit a device assert). The worker refuses a step that
names one before any kernel runs (``worker.kv_cache.KVCache.check_step``).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from . import layer_reference, prefill, reference


def _cuda(tensor: torch.Tensor):
    if tensor.device.type != "cuda":
        return None
    from . import cuda  # imported lazily: it needs no GPU to import, but builds on first use

    return cuda if cuda.available() else None


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    impl = _cuda(k_cache) or reference
    if k_cache.dtype == reference.FP8 and key.dtype == torch.float32:
        impl = reference   # our fp8 write kernel takes 16-bit K/V
    impl.write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale=1.0,
                           v_scale=1.0) -> torch.Tensor:
    """One-shot decode attention (plans and runs in one call). A step that attends in every layer
    plans once instead: ``DecodePlanner`` (a work list from the host lengths) or
    ``plan_decode_grid`` (from the table's width), then the run functions below per layer."""
    impl = _cuda(query)
    if impl is None or not impl.supports_decode(query, k_cache):  # other head dims, block sizes: reference
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                                k_scale, v_scale)
    return impl.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale=k_scale,
                                       v_scale=v_scale)


def plan_decode_grid(query_like, k_cache, v_cache, block_tables, context_lens):
    """A grid plan (``cuda.DecodeGridPlan``, with its workspace) for a step's decode calls over
    these sizes (``query_like``: [num_seqs, num_q_heads, head_dim] of the query dtype), made
    once; None where the reference serves (no CUDA kernel for these inputs)."""
    impl = _cuda(query_like)
    if impl is None or not impl.supports_decode(query_like, k_cache):
        return None
    return impl.plan_decode_grid(query_like, k_cache, v_cache, block_tables, context_lens)


def paged_decode_grid_run(plan, query, k_cache, v_cache, block_tables, context_lens, scale, k_scale=1.0,
                          v_scale=1.0) -> torch.Tensor:
    """One layer's decode attention as ``plan_decode_grid``'s plan says (the reference when None)."""
    if plan is None:
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                                k_scale, v_scale)
    from . import cuda

    return cuda.paged_decode_grid_run(plan, query, k_cache, v_cache, block_tables, context_lens, scale,
                                      k_scale=k_scale, v_scale=v_scale)


def paged_decode_run(plan, query, k_cache, v_cache, block_tables, context_lens, scale, k_scale=1.0,
                     v_scale=1.0) -> torch.Tensor:
    """One layer's decode attention over the step's work-list plan (``DecodePlanner.step_plan``)."""
    from . import cuda

    return cuda.paged_decode_run(plan, query, k_cache, v_cache, block_tables, context_lens, scale, k_scale=k_scale,
                                 v_scale=v_scale)


WORK_LIST_ENV = "KVPAGER_DECODE_WORK_LIST"


class DecodePlanner:
    """Our CUDA decode kernel planned once per step (``kernels/decode_plan.py``): ``plan`` the
    step's work list on the host from its context lengths, copy it to the device with the step's
    other inputs, wrap it as the step's ``cuda.DecodePlan`` (``step_plan``), then every layer's
    ``paged_decode_run`` reuses it. The geometry is planned once, here; one planner per (model,
    cache) pair."""

    def __init__(self, query_like: torch.Tensor, k_cache: torch.Tensor) -> None:
        from . import cuda

        self._cuda = cuda
        self.geometry = cuda.decode_work_geometry(query_like, k_cache)
        self.num_q_heads, self.head_dim = query_like.shape[1], query_like.shape[2]
        self.device = query_like.device
        self._workspace: Optional[tuple[torch.Tensor, torch.Tensor]] = None   # eager steps' workspace, grow-only

    def capacity(self, rows: int) -> int:
        """Item slots of a plan for ``rows`` rows."""
        return self.geometry.capacity(rows)

    def plan_size(self, rows: int) -> int:
        """Ints of a plan for ``rows`` rows."""
        return self.geometry.plan_size(rows)

    def plan(self, context_lens, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The work list (int32, host) for rows of these context lengths (0 for padding rows),
        written into ``out`` when given (``plan_size(rows)`` int32s, e.g. a view of a pinned
        buffer). O(S log S + items) in C++: tens of microseconds for hundreds of rows."""
        return self._cuda.plan_decode_work(context_lens, self.geometry, out=out)

    def workspace(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A new split-KV workspace for plans of ``rows`` rows (uninitialized; each plan writes
        what it reads), for a caller that keeps it (a CUDA graph's static buffers)."""
        return self._cuda.decode_workspace(self.capacity(rows), self.num_q_heads, self.head_dim, self.device)

    def step_plan(self, work: torch.Tensor, rows: int, workspace: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """The step's ``cuda.DecodePlan``: ``work`` (``plan``'s list for ``rows`` rows, on the
        device) with ``workspace``, by default the planner's own, allocated once and grown when a
        step has more rows (steps run in stream order, so each may reuse what the previous one
        wrote; a CUDA graph passes the workspace it keeps)."""
        if workspace is None:
            if self._workspace is None or self._workspace[0].shape[0] < self.capacity(rows):
                self._workspace = self.workspace(max(rows, 64))
            workspace = self._workspace
        return self._cuda.DecodePlan(self.geometry, work, workspace)


def decode_step_stager(inputs: torch.Tensor, previous: torch.Tensor, layouts: list[tuple[int, int, int, int, int]],
                       planner: Optional[DecodePlanner]):
    """``cuda.decode_step_stager`` with ``planner``'s geometry (None: no work list): a CUDA-graph
    decode step's host path, for graphs of our CUDA decode kernel only."""
    from . import cuda

    return cuda.decode_step_stager(inputs, previous, layouts, planner.geometry if planner is not None else None)


def decode_planner(query_like: torch.Tensor, k_cache: torch.Tensor) -> Optional[DecodePlanner]:
    """A planner when our CUDA decode kernel serves queries like ``query_like`` ([*, heads,
    head_dim]) over this cache; None where the reference serves (no GPU, other sizes), or when
    ``KVPAGER_DECODE_WORK_LIST=0`` asks for grid plans from the table's width (before/after
    benchmarks)."""
    impl = _cuda(query_like)
    if impl is None or not impl.supports_decode(query_like, k_cache) or os.environ.get(WORK_LIST_ENV) == "0":
        return None
    return DecodePlanner(query_like, k_cache)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                            k_scale=1.0, v_scale=1.0, host_lengths=None, decode=None):
    """One-shot prefill attention (plans and runs in one call), for tests and benchmarks; a step
    that attends in every layer plans once (``plan_prefill``) and runs each layer
    (``paged_prefill_run``). ``host_lengths``: optional (query_start_loc, context_lens) as host
    lists, sparing the CUDA path a host sync (see ``kernels/prefill.py``). ``decode``: how the
    one-token sequences of a mixed step attend (``paged_decode_attention``'s signature), default
    the one-shot ``paged_decode_attention``."""
    if query.device.type == "cuda":
        return prefill.paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens,
                                               query_start_loc, scale, k_scale, v_scale,
                                               decode=decode or paged_decode_attention, host_lengths=host_lengths)
    return reference.paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens,
                                             query_start_loc, scale, k_scale, v_scale)


def plan_prefill(query_like, k_cache, block_tables, context_lens, query_start_loc, scale, *, host_lengths=None,
                 decode_plan=None) -> prefill.PrefillPlan:
    """A step's prefill attention planned once (``kernels/prefill.py`` ``plan``; FlashInfer's
    plan/run split): ``query_like`` [*, num_q_heads, head_dim] of the queries' dtype and device,
    ``k_cache`` any layer's K view, the step's int32 tensors (kept in the plan), ``host_lengths``
    (query starts, context lengths) as host ints, ``decode_plan``: the step's
    ``DecodePlanner.step_plan`` for its one-token rows (planned from their context lengths, in
    row order), if any. On CUDA: the kernel-or-SDPA choice, the work list or the groups, and the
    one-token rows' decode (the work list of ``decode_plan``, else one grid plan over them).
    Elsewhere: a plan the torch reference runs."""
    if query_like.device.type != "cuda":
        return prefill.plan(query_like, k_cache, block_tables, context_lens, query_start_loc, scale,
                            host_lengths=host_lengths, reference_only=True)
    if decode_plan is not None:
        def decode(q, k_cache, v_cache, tables, context, scale, k_scale=1.0, v_scale=1.0):
            return paged_decode_run(decode_plan, q, k_cache, v_cache, tables, context, scale, k_scale, v_scale)
        return prefill.plan(query_like, k_cache, block_tables, context_lens, query_start_loc, scale,
                            host_lengths=host_lengths, decode=decode)

    def plan_decode(tables, context):
        """One grid plan for the one-token rows (the reference where our kernel does not serve)."""
        like = query_like.new_empty(context.shape[0], *query_like.shape[1:])
        grid = plan_decode_grid(like, k_cache, k_cache, tables, context)

        def decode(q, k_cache, v_cache, tables, context, scale, k_scale=1.0, v_scale=1.0):
            return paged_decode_grid_run(grid, q, k_cache, v_cache, tables, context, scale, k_scale, v_scale)
        return decode
    return prefill.plan(query_like, k_cache, block_tables, context_lens, query_start_loc, scale,
                        host_lengths=host_lengths, plan_decode=plan_decode)


def paged_prefill_run(plan, query, k_cache, v_cache, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """One layer's prefill attention over the step's plan (``plan_prefill``): no re-planning."""
    return prefill.run(plan, query, k_cache, v_cache, k_scale, v_scale)


def copy_blocks(kv_cache, src, dst) -> None:
    impl = _cuda(kv_cache) if kv_cache.is_contiguous() else None
    (impl or reference).copy_blocks(kv_cache, src, dst)


def swap_blocks(src_cache, dst_cache, src, dst) -> None:
    """On CUDA (device side CUDA, host side pinned, both contiguous): our asynchronous swap on
    the current stream (``cuda.swap_blocks``: copy engines, no host sync; the caller orders it
    with events, see ``worker.kv_cache``). Elsewhere: the reference (synchronous for the host)."""
    device_side = src_cache if src_cache.device.type == "cuda" else dst_cache
    host_side = dst_cache if device_side is src_cache else src_cache
    impl = _cuda(device_side)
    if (impl is not None and src_cache.is_contiguous() and dst_cache.is_contiguous()
            and (host_side.device.type == "cuda" or host_side.is_pinned())):
        impl.swap_blocks(src_cache, dst_cache, src, dst)
        return
    reference.swap_blocks(src_cache, dst_cache, src, dst)


def add_rms_norm(x, delta, weight, eps):
    """``x += delta`` (in place, when given), then ``weight * RMSNorm(x)``: our kernel for a CUDA
    ``[rows, hidden]`` x with a contiguous last dim, the torch formulas otherwise (e.g. the
    per-head q/k norms of Qwen3, which are strided 3-d views)."""
    impl = _cuda(x)
    if impl is None or x.dim() != 2 or x.stride(-1) != 1 or (delta is not None and delta.stride(-1) != 1):
        return layer_reference.add_rms_norm(x, delta, weight, eps)
    return impl.add_rms_norm(x, delta, weight, eps)


def rope(q, k, cos, sin):
    """q and k rotated (in place on CUDA); use the returned pair."""
    impl = _cuda(q)
    return (impl or layer_reference).rope(q, k, cos, sin)


def rope_split_query(q, k, cos, sin, kv_heads: int, out=None, keep=None):
    """q rotated and written split for a prefill plan that takes it (``plan.split_query``: Hopper,
    bf16 or fp16 over fp8; ``kernels/split_query.py``), q left as it is but at the tokens ``keep`` marks
    (``plan.keep_rows``: rotated in place too); k rotated in place. Returns (the SplitQuery, k)."""
    impl = _cuda(q)
    if impl is None:
        raise ValueError("a split query is written by the CUDA kernels only; this q is on " + str(q.device))
    return impl.rope_split_query(q, k, cos, sin, kv_heads, out, keep), k


def silu_and_mul(gate_up):
    impl = _cuda(gate_up)
    if impl is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return layer_reference.silu_and_mul(gate_up)
    return impl.silu_and_mul(gate_up)


def backend(k_cache: torch.Tensor) -> str:
    """Which implementation runs decode attention over this (per-layer) cache: "cuda" or "reference"."""
    impl = _cuda(k_cache)
    query_like = k_cache if k_cache.dtype != reference.FP8 else k_cache.new_empty(0, dtype=torch.bfloat16)
    return "cuda" if impl is not None and impl.supports_decode(query_like, k_cache) else "reference"
