"""The worker's gRPC face: the manager sends it plans (ExecutePlan) and asks for memory stats.
The wire format stops here: plans go in as ``BlockPlan``, stats come out of ``MemoryStats``."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import grpc

from kvpager.v1 import plan_pb2, worker_pb2, worker_pb2_grpc

from .block_plan import BlockMoves, BlockPlan
from .kv_cache import PlanExpired, PlanRejected

if TYPE_CHECKING:
    from .cache_worker import CacheWorker


def block_plan(plan: plan_pb2.ExecutionPlan) -> BlockPlan:
    """The wire's ExecutionPlan as the worker's plain record."""
    return BlockPlan(swap_out=_moves(plan.blocks_to_swap_out), swap_in=_moves(plan.blocks_to_swap_in),
                     copy=_moves(plan.blocks_to_copy))


def _moves(mapping: plan_pb2.BlockMapping) -> BlockMoves:
    return BlockMoves(src=tuple(mapping.src), dst=tuple(mapping.dst))


class CacheWorkerService(worker_pb2_grpc.CacheWorkerServicer):
    """Thin: decodes the plan and hands it to the worker, which serializes it with model steps."""

    def __init__(self, worker: "CacheWorker") -> None:
        self.worker = worker

    def ExecutePlan(self, request: worker_pb2.ExecutePlanRequest,
                    context: grpc.ServicerContext) -> worker_pb2.ExecutePlanResponse:
        plan = request.plan
        started = time.perf_counter()
        try:
            self.worker.execute_plan(plan.step_id, block_plan(plan), still_wanted=context.is_active)
        except PlanRejected as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {plan.step_id}: {err}")
        except PlanExpired as err:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
        return worker_pb2.ExecutePlanResponse(step_id=plan.step_id,
                                              elapsed_ms=(time.perf_counter() - started) * 1e3)

    def GetMemoryStats(self, request: worker_pb2.GetMemoryStatsRequest,
                       context: grpc.ServicerContext) -> worker_pb2.WorkerMemoryStats:
        return worker_pb2.WorkerMemoryStats(**dataclasses.asdict(self.worker.memory_stats()))
