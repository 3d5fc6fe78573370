"""The gRPC face of the block manager: a thin servicer, health checking, reflection.

One lock (``BlockManagerService.lock``) owns all manager state: every RPC decodes its
request, takes the lock, calls the manager, encodes the answer and releases it. Manager
errors become gRPC statuses in exactly one place (``_reply``).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc

from . import wire
from .block_manager import BlockManager
from .config import ManagerConfig
from .errors import InvariantViolation, ManagerError
from .request_cache import Answer, RequestCache, fingerprint

log = logging.getLogger("kvpager.manager")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name


class BlockManagerService(pb_grpc.BlockManagerServicer):
    def __init__(self, manager: BlockManager, request_cache_size: int = 65536) -> None:
        self.manager = manager
        self.lock = threading.Lock()
        self.requests = RequestCache(request_cache_size)

    # ---- the one path every RPC takes -----------------------------------------------------------
    def _call(self, method: str, request, context, work: Callable[[], object]):
        try:
            with self.lock:
                request_id = getattr(request, "request_id", "")
                if not request_id:
                    answer = self._answer(work)
                else:
                    print_ = fingerprint(method, request.SerializeToString(deterministic=True))
                    answer = self.requests.get(request_id, print_)
                    if answer is None:
                        answer = self._answer(work)
                        self.requests.put(request_id, print_, answer)
        except ManagerError as err:
            answer = Answer(error=err)
        except Exception as exc:  # a bug: the manager rolled back; report it, keep serving
            log.exception("%s failed", method)
            answer = Answer(error=InvariantViolation(f"{method}: internal error: {exc!r}"))
        return self._reply(answer, context)

    @staticmethod
    def _answer(work: Callable[[], object]) -> Answer:
        try:
            return Answer(response=work())
        except ManagerError as err:
            return Answer(error=err)

    @staticmethod
    def _reply(answer: Answer, context):
        if answer.error is not None:
            context.abort(grpc.StatusCode[answer.error.code], str(answer.error))
        return answer.response

    # ---- RPCs ---------------------------------------------------------------------------------
    def Allocate(self, request, context):
        return self._call("Allocate", request, context,
                          lambda: wire.allocate_pb(self.manager.run(wire.allocate_op(request))))

    def Append(self, request, context):
        return self._call("Append", request, context,
                          lambda: wire.append_pb(self.manager.run(wire.append_op(request))))

    def Fork(self, request, context):
        return self._call("Fork", request, context, lambda: wire.fork_pb(self.manager.run(wire.fork_op(request))))

    def Free(self, request, context):
        return self._call("Free", request, context, lambda: wire.free_pb(self.manager.run(wire.free_op(request))))

    def SwapOut(self, request, context):
        return self._call("SwapOut", request, context,
                          lambda: wire.swap_out_pb(self.manager.run(wire.swap_out_op(request))))

    def SwapIn(self, request, context):
        return self._call("SwapIn", request, context,
                          lambda: wire.swap_in_pb(self.manager.run(wire.swap_in_op(request))))

    def Step(self, request, context):
        def work():
            ops = wire.step_ops(request)
            return wire.step_pb(ops, self.manager.step(ops, request.all_or_nothing))

        return self._call("Step", request, context, work)

    def GetBlockTable(self, request, context):
        return self._call("GetBlockTable", request, context,
                          lambda: wire.block_table_pb(self.manager.block_table(request.seq_id)))

    def GetStats(self, request, context):
        return self._call("GetStats", request, context, lambda: wire.stats_pb(self.manager.stats()))

    def Ping(self, request, context):
        return pb.PingResponse()


def create_server(manager: BlockManager | ManagerConfig | None = None, address: str = "127.0.0.1:0",
                  max_workers: int = 16):
    """Build (not start) a server; returns (server, port, service, health_servicer)."""
    if not isinstance(manager, BlockManager):
        manager = BlockManager(manager)
    service = BlockManagerService(manager)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvpager-rpc"))
    pb_grpc.add_BlockManagerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port, service, health_servicer
