"""A stand-in for a worker rank's CacheWorker service in manager tests: its ExecutePlan waits
until the test opens ``gate`` (a rank busy with a long plan, stopped, or stuck in a collective),
then acknowledges the plan, or fails it UNAVAILABLE while ``fail`` is set. Served by the test on a
real gRPC server on 127.0.0.1."""

from __future__ import annotations

import threading

import grpc

from kvpager.v1 import worker_pb2, worker_pb2_grpc


class GatedWorker(worker_pb2_grpc.CacheWorkerServicer):
    """ExecutePlan waits for ``gate`` (at most ``hold`` seconds); then answers OK, or UNAVAILABLE
    while ``fail`` is set. ``entered`` is set by the first plan that arrives."""

    def __init__(self, hold: float = 30.0) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = False
        self.hold = hold
        self.port = 0   # where it serves, when the test records it

    def ExecutePlan(self, request, context):
        self.entered.set()
        self.gate.wait(self.hold)
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the test fails this plan")
        return worker_pb2.ExecutePlanResponse(step_id=request.plan.step_id)

    def GetMemoryStats(self, request, context):
        return worker_pb2.WorkerMemoryStats()

    def open_all(self) -> None:
        self.gate.set()
