"""Conversions between the protobuf messages of kvpager.v1 and the manager's plain records.

The servicer's codec (``manager/service.py``): requests become operations, results and stats
become responses. (Registration, plans to the workers and statuses have their own modules.)
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, TypeVar

from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import plan_pb2

from kvpager.errors import InvalidArgument, quote
from .operations import (
    AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, Operation, RejectedOp, SwapInOp, SwapOutOp,
)
from .plan import (
    AllocateResult,
    AppendBatchResult,
    AppendResult,
    BatchTables,
    BlockMapping,
    ExecutionPlan,
    ForkResult,
    FreeResult,
    ManagerStats,
    StepResult,
    SwapResult,
    TableLayout,
    TierStats,
)
from .sequence import GPU, Sequence
from .tenancy import Usage
from kvpager.status import number_of

M = TypeVar("M")  # a response message type
R = TypeVar("R")  # an operation's result type



# ---- requests -> operations ----------------------------------------------------------------------
def allocate_op(m: pb.AllocateRequest) -> AllocateOp:
    return AllocateOp(m.seq_id, list(m.token_ids) or None, m.num_tokens, m.cache_namespace)


def append_op(m: pb.AppendRequest) -> AppendOp:
    return AppendOp(m.seq_id, list(m.token_ids) or None, m.num_tokens)


def append_batch_op(m: pb.AppendBatchRequest) -> AppendBatchOp:
    return AppendBatchOp(list(m.seq_ids), list(m.token_ids) or None)


def fork_op(m: pb.ForkRequest, max_forks: int = 1 << 62) -> ForkOp:
    """INVALID_ARGUMENT, before anything is applied, when ``max_forks`` (max_step_forks) is 0: a
    Fork RPC is a step of one fork, bounded as a Step's forks are."""
    if max_forks < 1:
        raise InvalidArgument(_too_many_forks("fork", max_forks))
    return ForkOp(m.parent_seq_id, m.child_seq_id)


def _too_many_forks(kind: str, max_forks: int) -> str:
    if max_forks == 0:  # no split helps: forks are off on this manager
        return f"{kind}: forks are off on this manager (max_step_forks 0); nothing was applied"
    return f"{kind}: more than {max_forks} forks (max_step_forks); nothing was applied: split it"


def free_op(m: pb.FreeRequest) -> FreeOp:
    return FreeOp(m.seq_id)


def swap_out_op(m: pb.SwapOutRequest, max_sequences: int = 1 << 62) -> SwapOutOp:
    """INVALID_ARGUMENT, before anything is applied, when it names more than ``max_sequences``
    (a SwapOut RPC is bounded as a Step of its sequences is: max_step_operations)."""
    return SwapOutOp(_bounded_ids("swap_out", m.seq_ids, max_sequences))


def swap_in_op(m: pb.SwapInRequest, max_sequences: int = 1 << 62) -> SwapInOp:
    return SwapInOp(_bounded_ids("swap_in", m.seq_ids, max_sequences))


def _bounded_ids(kind: str, seq_ids: Collection[str], max_sequences: int) -> list[str]:
    if len(seq_ids) > max_sequences:
        raise InvalidArgument(f"{kind}: {len(seq_ids)} sequences, more than {max_sequences} (max_step_operations); "
                              "nothing was applied: split it")
    return list(seq_ids)


# The oneof's field name -> its decoder (each takes its own request message).
_OP_DECODERS: dict[str, Callable[[Any], Operation]] = {
    "allocate": allocate_op, "append": append_op, "append_batch": append_batch_op, "fork": fork_op,
    "free": free_op, "swap_out": swap_out_op, "swap_in": swap_in_op,
}


_MULTI = ("append_batch", "swap_out", "swap_in")  # operations that name many sequences


def step_ops(request: pb.StepRequest, max_operations: int = 1 << 62, max_forks: int = 1 << 62) -> list[Operation]:
    """The Step's operations; INVALID_ARGUMENT, before anything is applied, when there are more
    than ``max_operations`` (each sequence named by an append_batch, swap_out or swap_in counting
    as one) or more than ``max_forks`` forks."""
    ops: list[Operation] = []
    count = forks = 0
    for i, operation in enumerate(request.operations):
        kind = operation.WhichOneof("op")
        inner: Any = getattr(operation, kind) if kind is not None else None  # the oneof's message, of kind's type
        count += max(1, len(inner.seq_ids)) if kind in _MULTI else 1
        if count > max_operations:
            raise InvalidArgument(
                f"step: more than {max_operations} operations (max_step_operations; each sequence of an "
                f"append_batch, swap_out or swap_in counts as one); nothing was applied: split it")
        if kind == "fork":
            forks += 1
            if forks > max_forks:
                raise InvalidArgument(_too_many_forks("step", max_forks))
        if kind is None:
            ops.append(RejectedOp(f"operation {i} sets none of {', '.join(_OP_DECODERS)}"))
            continue
        if kind != "append_batch" and inner.request_id:
            ops.append(RejectedOp(
                f"operation {i} ({kind}) carries request_id {quote(inner.request_id)}; inside a Step only the "
                "StepRequest's request_id is used: leave it empty"))
            continue
        ops.append(_OP_DECODERS[kind](inner))
    return ops


_LAYOUTS = {
    pb.TABLE_LAYOUT_BOTH: TableLayout.BOTH, pb.TABLE_LAYOUT_PADDED: TableLayout.PADDED,
    pb.TABLE_LAYOUT_CSR: TableLayout.CSR, pb.TABLE_LAYOUT_NONE: TableLayout.NONE,
    pb.TABLE_LAYOUT_PADDED_PACKED: TableLayout.PADDED_PACKED,
}


def step_layout(request: pb.StepRequest) -> TableLayout:
    """The block-table forms the Step asks for; INVALID_ARGUMENT, before anything is applied,
    for a number the enum does not name (proto3 enums accept any). O(1)."""
    layout = _LAYOUTS.get(request.table_layout)
    if layout is None:
        raise InvalidArgument(
            f"step: table_layout {request.table_layout} is none of "
            f"{', '.join(f'{pb.TableLayout.Name(n)} ({n})' for n in _LAYOUTS)}; nothing was applied")
    return layout


# ---- results -> responses ------------------------------------------------------------------------
# The _fill_* functions write into a message in place (cheaper than building and copying
# sub-messages, which matters for a Step of hundreds of operations).
def _fill_mapping(m: plan_pb2.BlockMapping, mapping: BlockMapping) -> None:
    m.src.extend(mapping.src)
    m.dst.extend(mapping.dst)


def _fill_allocate(m: pb.AllocateResponse, r: AllocateResult) -> None:
    m.seq_id = r.seq_id
    m.block_ids.extend(r.block_ids)
    m.slot_mapping.extend(r.slot_mapping)
    m.num_cached_tokens = r.num_cached_tokens


def _fill_append(m: pb.AppendResponse, r: AppendResult) -> None:
    m.seq_id = r.seq_id
    m.slot_mapping.extend(r.slot_mapping)
    m.new_block_ids.extend(r.new_block_ids)
    if r.copies.src:
        _fill_mapping(m.copies, r.copies)
    m.num_tokens = r.num_tokens


def _fill_append_batch(m: pb.AppendBatchResponse, r: AppendBatchResult) -> None:
    m.SetInParent()  # present even when nothing failed
    for index, err in r.failures:
        m.failed_indices.append(index)
        m.failed_codes.append(number_of(err))
        m.failed_messages.append(str(err))


def _fill_fork(m: pb.ForkResponse, r: ForkResult) -> None:
    m.child_seq_id = r.child_seq_id
    m.block_ids.extend(r.block_ids)


def _fill_free(m: pb.FreeResponse, r: FreeResult) -> None:
    m.seq_id = r.seq_id
    m.num_blocks_released = r.num_blocks_released
    m.SetInParent()


def _fill_swap_out(m: pb.SwapOutResponse, r: SwapResult) -> None:
    m.SetInParent()
    _fill_mapping(m.mapping, r.mapping)


def _fill_swap_in(m: pb.SwapInResponse, r: SwapResult) -> None:
    _fill_swap_out(m, r)
    m.num_blocks_reused = r.num_blocks_reused


def _single(message_type: Callable[[], M], fill: Callable[[M, R], None]) -> Callable[[R], M]:
    """An encoder of one operation's result as its RPC's response message."""
    def encode(result: R) -> M:
        m = message_type()
        fill(m, result)
        return m
    return encode


allocate_pb = _single(pb.AllocateResponse, _fill_allocate)
append_pb = _single(pb.AppendResponse, _fill_append)
fork_pb = _single(pb.ForkResponse, _fill_fork)
free_pb = _single(pb.FreeResponse, _fill_free)
swap_out_pb = _single(pb.SwapOutResponse, _fill_swap_out)
swap_in_pb = _single(pb.SwapInResponse, _fill_swap_in)


def plan_pb(p: ExecutionPlan) -> plan_pb2.ExecutionPlan:
    m = plan_pb2.ExecutionPlan()
    _fill_plan(m, p)
    return m


def _fill_plan(m: plan_pb2.ExecutionPlan, p: ExecutionPlan) -> None:
    m.step_id = p.step_id
    _fill_mapping(m.blocks_to_swap_out, p.blocks_to_swap_out)
    _fill_mapping(m.blocks_to_swap_in, p.blocks_to_swap_in)
    _fill_mapping(m.blocks_to_copy, p.blocks_to_copy)


def _fill_batch(m: pb.BatchTables, b: BatchTables) -> None:
    """One ``extend`` per field (each entry converted in C; the layouts not asked for are empty
    lists); the packed table is one bytes copy. O(entries)."""
    m.seq_ids.extend(b.seq_ids)
    m.context_lens.extend(b.context_lens)
    m.query_lens.extend(b.query_lens)
    m.slot_mapping.extend(b.slot_mapping)
    m.max_blocks = b.max_blocks
    m.block_tables.extend(b.block_tables)
    m.kv_indptr.extend(b.kv_indptr)
    m.kv_indices.extend(b.kv_indices)
    m.kv_last_page_len.extend(b.kv_last_page_len)
    if b.block_tables_packed:
        m.block_tables_packed = b.block_tables_packed


# Operation type -> (the OperationResult field of its answer, its filler).
_RESULT_FILLERS: dict[type[Operation], tuple[str, Callable[[Any, Any], None]]] = {
    AllocateOp: ("allocate", _fill_allocate), AppendOp: ("append", _fill_append),
    AppendBatchOp: ("append_batch", _fill_append_batch), ForkOp: ("fork", _fill_fork),
    FreeOp: ("free", _fill_free), SwapOutOp: ("swap_out", _fill_swap_out), SwapInOp: ("swap_in", _fill_swap_in),
}


def step_pb(ops: list[Operation], r: StepResult) -> pb.StepResponse:
    resp = pb.StepResponse(step_id=r.step_id, applied=r.applied, gpu_blocks_available=r.gpu_blocks_available,
                           cpu_blocks_available=r.cpu_blocks_available)
    results = resp.results
    for op, outcome in zip(ops, r.outcomes):
        res = results.add()
        if outcome.error is not None:
            res.code = number_of(outcome.error)
            res.message = str(outcome.error)
        else:
            name, fill = _RESULT_FILLERS[type(op)]
            fill(getattr(res, name), outcome.result)
    _fill_plan(resp.plan, r.plan)
    _fill_batch(resp.batch, r.batch)
    return resp


def block_table_pb(seq: Sequence) -> pb.GetBlockTableResponse:
    return pb.GetBlockTableResponse(seq_id=seq.seq_id, tier=pb.TIER_GPU if seq.tier == GPU else pb.TIER_CPU,
                                    num_tokens=seq.num_tokens, block_ids=seq.block_ids)


def stats_pb(s: ManagerStats) -> pb.GetStatsResponse:
    def tier(t: TierStats) -> pb.TierStats:
        return pb.TierStats(total_blocks=t.total_blocks, used_blocks=t.used_blocks, free_blocks=t.free_blocks,
                            cached_blocks=t.cached_blocks)

    return pb.GetStatsResponse(
        block_size=s.block_size, gpu=tier(s.gpu), cpu=tier(s.cpu), running_sequences=s.running_sequences,
        swapped_sequences=s.swapped_sequences, gpu_utilization=s.gpu_utilization,
        internal_fragmentation=s.internal_fragmentation, prefix_caching=s.prefix_caching,
        prefix_query_tokens=s.prefix_query_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
        prefix_query_blocks=s.prefix_query_blocks, prefix_hit_blocks=s.prefix_hit_blocks, preemptions=s.preemptions,
        cow_copies=s.cow_copies, blocks_swapped_out=s.blocks_swapped_out, blocks_swapped_in=s.blocks_swapped_in,
        evictions=s.evictions, watermark_blocks=s.watermark_blocks, steps=s.steps,
    )


def fill_tenant_stats(reply: pb.GetStatsResponse, usage: Mapping[str, Usage], quotas: Mapping[str, int],
                      sequence_quotas: Mapping[str, int], tenant: str, admin: bool) -> None:
    """A scheduler's stats: its own tenant's sequences and usage (``tenant``) besides the pool
    totals; an admin's: everything, and ``tenants``, one entry per tenant with live sequences
    or a quota of blocks or sequences (``usage`` then holds every tenant). O(tenants)."""
    def fill(m: pb.TenantStats, name: str, use: Usage) -> None:
        m.tenant = name
        m.gpu_blocks, m.cpu_blocks = use.gpu_blocks, use.cpu_blocks
        m.running_sequences, m.swapped_sequences = use.running_sequences, use.swapped_sequences
        quota, sequences = quotas.get(name), sequence_quotas.get(name)
        m.has_quota, m.quota_blocks = quota is not None, quota or 0
        m.has_sequence_quota, m.quota_sequences = sequences is not None, sequences or 0

    mine = usage.get(tenant, Usage())
    if admin:
        for name in sorted(set(usage) | set(quotas) | set(sequence_quotas)):
            fill(reply.tenants.add(), name, usage.get(name, Usage()))
    else:
        reply.running_sequences, reply.swapped_sequences = mine.running_sequences, mine.swapped_sequences
    fill(reply.tenant, tenant, mine)
