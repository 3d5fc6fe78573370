"""The worker's gRPC face: the manager sends it plans (ExecutePlan) and asks for memory stats."""

from __future__ import annotations

import time

import grpc

from kvpager.v1 import worker_pb2, worker_pb2_grpc

from .kv_cache import PlanExpired, PlanRejected


class CacheWorkerService(worker_pb2_grpc.CacheWorkerServicer):
    """Thin: decodes the plan and hands it to the worker, which serializes it with model steps."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def ExecutePlan(self, request, context):
        plan = request.plan
        started = time.perf_counter()
        try:
            self.worker.execute_plan(
                plan.step_id,
                (plan.blocks_to_swap_out.src, plan.blocks_to_swap_out.dst),
                (plan.blocks_to_swap_in.src, plan.blocks_to_swap_in.dst),
                (plan.blocks_to_copy.src, plan.blocks_to_copy.dst),
                still_wanted=context.is_active,
            )
        except PlanRejected as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {plan.step_id}: {err}")
        except PlanExpired as err:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
        return worker_pb2.ExecutePlanResponse(step_id=plan.step_id,
                                              elapsed_ms=(time.perf_counter() - started) * 1e3)

    def GetMemoryStats(self, request, context):
        return self.worker.memory_stats()
