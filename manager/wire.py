"""Conversions between the protobuf messages of kvpager.v1 and the manager's plain records.

The only module of the manager that knows the wire format (with service.py, which uses it).
"""

from __future__ import annotations

from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import plan_pb2

from .operations import AllocateOp, AppendOp, ForkOp, FreeOp, Operation, RejectedOp, SwapInOp, SwapOutOp
from .plan import (
    AllocateResult,
    AppendResult,
    BatchTables,
    BlockMapping,
    ExecutionPlan,
    ForkResult,
    FreeResult,
    ManagerStats,
    StepResult,
    SwapResult,
)
from .sequence import GPU, Sequence

STATUS_CODES = {  # google.rpc.Code numbers, for per-operation results inside a Step
    "OK": 0, "INVALID_ARGUMENT": 3, "NOT_FOUND": 5, "ALREADY_EXISTS": 6, "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9, "ABORTED": 10, "OUT_OF_RANGE": 11, "INTERNAL": 13, "UNKNOWN": 2,
}


# ---- requests -> operations ----------------------------------------------------------------------
def allocate_op(m: pb.AllocateRequest) -> AllocateOp:
    return AllocateOp(m.seq_id, list(m.token_ids) or None, m.num_tokens, m.cache_namespace)


def append_op(m: pb.AppendRequest) -> AppendOp:
    return AppendOp(m.seq_id, list(m.token_ids) or None, m.num_tokens)


def fork_op(m: pb.ForkRequest) -> ForkOp:
    return ForkOp(m.parent_seq_id, m.child_seq_id)


def free_op(m: pb.FreeRequest) -> FreeOp:
    return FreeOp(m.seq_id)


def swap_out_op(m: pb.SwapOutRequest) -> SwapOutOp:
    return SwapOutOp(list(m.seq_ids))


def swap_in_op(m: pb.SwapInRequest) -> SwapInOp:
    return SwapInOp(list(m.seq_ids))


_OP_DECODERS = {
    "allocate": allocate_op, "append": append_op, "fork": fork_op,
    "free": free_op, "swap_out": swap_out_op, "swap_in": swap_in_op,
}


def step_ops(request: pb.StepRequest) -> list[Operation]:
    ops: list[Operation] = []
    for i, operation in enumerate(request.operations):
        kind = operation.WhichOneof("op")
        if kind is None:
            ops.append(RejectedOp(f"operation {i} sets none of {', '.join(_OP_DECODERS)}"))
            continue
        inner = getattr(operation, kind)
        if inner.request_id:
            ops.append(RejectedOp(
                f"operation {i} ({kind}) carries request_id {inner.request_id!r}; inside a Step only the "
                "StepRequest's request_id is used: leave it empty"))
            continue
        ops.append(_OP_DECODERS[kind](inner))
    return ops


# ---- results -> responses ------------------------------------------------------------------------
def mapping_pb(m: BlockMapping) -> plan_pb2.BlockMapping:
    return plan_pb2.BlockMapping(src=m.src, dst=m.dst)


def allocate_pb(r: AllocateResult) -> pb.AllocateResponse:
    return pb.AllocateResponse(seq_id=r.seq_id, block_ids=r.block_ids, slot_mapping=r.slot_mapping,
                               num_cached_tokens=r.num_cached_tokens)


def append_pb(r: AppendResult) -> pb.AppendResponse:
    return pb.AppendResponse(seq_id=r.seq_id, slot_mapping=r.slot_mapping, new_block_ids=r.new_block_ids,
                             copies=mapping_pb(r.copies), num_tokens=r.num_tokens)


def fork_pb(r: ForkResult) -> pb.ForkResponse:
    return pb.ForkResponse(child_seq_id=r.child_seq_id, block_ids=r.block_ids)


def free_pb(r: FreeResult) -> pb.FreeResponse:
    return pb.FreeResponse(seq_id=r.seq_id, num_blocks_released=r.num_blocks_released)


def swap_out_pb(r: SwapResult) -> pb.SwapOutResponse:
    return pb.SwapOutResponse(mapping=mapping_pb(r.mapping))


def swap_in_pb(r: SwapResult) -> pb.SwapInResponse:
    return pb.SwapInResponse(mapping=mapping_pb(r.mapping), num_blocks_reused=r.num_blocks_reused)


def plan_pb(p: ExecutionPlan) -> plan_pb2.ExecutionPlan:
    return plan_pb2.ExecutionPlan(
        step_id=p.step_id,
        blocks_to_swap_out=mapping_pb(p.blocks_to_swap_out),
        blocks_to_swap_in=mapping_pb(p.blocks_to_swap_in),
        blocks_to_copy=mapping_pb(p.blocks_to_copy),
    )


def batch_pb(b: BatchTables) -> pb.BatchTables:
    return pb.BatchTables(
        seq_ids=b.seq_ids, context_lens=b.context_lens, query_lens=b.query_lens, slot_mapping=b.slot_mapping,
        max_blocks=b.max_blocks, block_tables=b.block_tables, kv_indptr=b.kv_indptr, kv_indices=b.kv_indices,
        kv_last_page_len=b.kv_last_page_len,
    )


_RESULT_FIELDS = {
    AllocateOp: ("allocate", allocate_pb), AppendOp: ("append", append_pb), ForkOp: ("fork", fork_pb),
    FreeOp: ("free", free_pb), SwapOutOp: ("swap_out", swap_out_pb), SwapInOp: ("swap_in", swap_in_pb),
}


def step_pb(ops: list[Operation], r: StepResult) -> pb.StepResponse:
    results = []
    for op, outcome in zip(ops, r.outcomes):
        if outcome.error is not None:
            err = outcome.error
            results.append(pb.OperationResult(code=STATUS_CODES.get(err.code, 2), message=str(err)))
        else:
            name, encode = _RESULT_FIELDS[type(op)]
            results.append(pb.OperationResult(**{name: encode(outcome.result)}))
    return pb.StepResponse(step_id=r.step_id, results=results, applied=r.applied, plan=plan_pb(r.plan),
                           batch=batch_pb(r.batch), gpu_blocks_available=r.gpu_blocks_available,
                           cpu_blocks_available=r.cpu_blocks_available)


def block_table_pb(seq: Sequence) -> pb.GetBlockTableResponse:
    return pb.GetBlockTableResponse(seq_id=seq.seq_id, tier=pb.TIER_GPU if seq.tier == GPU else pb.TIER_CPU,
                                    num_tokens=seq.num_tokens, block_ids=seq.block_ids)


def stats_pb(s: ManagerStats) -> pb.GetStatsResponse:
    def tier(t):
        return pb.TierStats(total_blocks=t.total_blocks, used_blocks=t.used_blocks, free_blocks=t.free_blocks,
                            cached_blocks=t.cached_blocks)

    return pb.GetStatsResponse(
        block_size=s.block_size, gpu=tier(s.gpu), cpu=tier(s.cpu), running_sequences=s.running_sequences,
        swapped_sequences=s.swapped_sequences, gpu_utilization=s.gpu_utilization,
        internal_fragmentation=s.internal_fragmentation, prefix_caching=s.prefix_caching,
        prefix_query_tokens=s.prefix_query_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
        cow_copies=s.cow_copies, blocks_swapped_out=s.blocks_swapped_out, blocks_swapped_in=s.blocks_swapped_in,
        evictions=s.evictions, watermark_blocks=s.watermark_blocks, steps=s.steps,
    )
