"""The gRPC face of the block manager: a thin servicer, worker registration, health, reflection.

One lock (``BlockManagerService.lock``) owns all manager state: every RPC decodes its
request, takes the lock, calls the manager, encodes the answer and releases it; a step's
plan goes to the workers (``WorkerRegistry.execute``) before the step commits, still under
the lock, so steps reach the workers in order. Manager errors become gRPC statuses in exactly
one place (``_reply``). Health is SERVING unless workers registered and a rank is missing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent import futures
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc

from . import wire
from .block_manager import BlockManager
from .config import ManagerConfig
from .errors import FailedPrecondition, InvariantViolation, ManagerError, Unavailable
from .metrics import ManagerMetrics, RpcMetricsInterceptor
from .plan import ExecutionPlan
from .request_cache import Answer, RequestCache, fingerprint
from .workers import WorkerRegistry

log = logging.getLogger("kvpager.manager")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name


class BlockManagerService(pb_grpc.BlockManagerServicer):
    def __init__(self, config: ManagerConfig, manager: Optional[BlockManager] = None,
                 health_servicer: Optional[health.HealthServicer] = None, request_cache_size: int = 65536) -> None:
        self.config = config
        # None while the pools wait to be sized from the workers' capacity (num_gpu_blocks == 0).
        self.manager = manager if manager is not None or config.sized_by_workers else BlockManager(config)
        self.lock = threading.Lock()
        self.requests = RequestCache(request_cache_size)
        self.health = health_servicer
        timeout = config.worker_heartbeat_timeout
        self.registry = WorkerRegistry(config.block_size, heartbeat_interval=timeout / 5, heartbeat_timeout=timeout,
                                       plan_timeout=config.worker_plan_timeout)
        self._stop = threading.Event()
        self._monitor: Optional[threading.Thread] = None
        self.metrics = ManagerMetrics(self)
        self._metrics_server = None

    def _manager(self) -> BlockManager:
        if self.manager is None:
            raise Unavailable("no block pool yet: it is sized from the workers' capacity; waiting for all "
                              "tensor-parallel ranks to register")
        return self.manager

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
                          lambda: wire.allocate_pb(self._manager().run(wire.allocate_op(request))))

    def Append(self, request, context):
        return self._call("Append", request, context,
                          lambda: wire.append_pb(self._manager().run(wire.append_op(request))))

    def Fork(self, request, context):
        return self._call("Fork", request, context, lambda: wire.fork_pb(self._manager().run(wire.fork_op(request))))

    def Free(self, request, context):
        return self._call("Free", request, context, lambda: wire.free_pb(self._manager().run(wire.free_op(request))))

    def SwapOut(self, request, context):
        return self._call("SwapOut", request, context,
                          lambda: wire.swap_out_pb(self._manager().run(wire.swap_out_op(request))))

    def SwapIn(self, request, context):
        return self._call("SwapIn", request, context,
                          lambda: wire.swap_in_pb(self._manager().run(wire.swap_in_op(request))))

    def Step(self, request, context):
        def work():
            ops = wire.step_ops(request)
            return wire.step_pb(ops, self._manager().step(ops, request.all_or_nothing))

        return self._call("Step", request, context, work)

    def GetBlockTable(self, request, context):
        return self._call("GetBlockTable", request, context,
                          lambda: wire.block_table_pb(self._manager().block_table(request.seq_id)))

    def GetStats(self, request, context):
        def work():
            reply = wire.stats_pb(self._manager().stats())
            reply.workers_registered = len(self.registry.workers())
            reply.workers_expected = self.registry.tensor_parallel_size or 0
            return reply

        return self._call("GetStats", request, context, work)

    def Ping(self, request, context):
        return pb.PingResponse()

    # ---- workers ------------------------------------------------------------------------------
    def RegisterWorker(self, request, context):
        return self._call("RegisterWorker", request, context, lambda: self._register(request))

    def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(registered=self.registry.heartbeat(request.worker_id))

    def _register(self, request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerResponse:
        replacing = request.rank in self.registry.ranks_seen
        record = self.registry.register(request)
        if self.manager is not None:
            gpu, cpu = self.manager.gpu.num_blocks, self.manager.cpu.num_blocks
            if record.num_gpu_blocks < gpu or record.num_cpu_blocks < cpu:
                self.registry.unregister(record.worker_id)
                raise FailedPrecondition(
                    f"register worker: capacity {record.num_gpu_blocks} GPU / {record.num_cpu_blocks} CPU blocks is "
                    f"below the manager's pools ({gpu} / {cpu})")
        elif self.registry.complete():
            gpu, cpu = self.registry.capacity()
            self.manager = BlockManager(dataclasses.replace(self.config, num_gpu_blocks=gpu, num_cpu_blocks=cpu))
            log.info("pools sized from the workers: %d GPU and %d CPU blocks", gpu, cpu)
        if self.manager is not None:
            self.manager.dispatch = self._dispatch
            if replacing:
                # The replaced worker's cache contents are gone: no prefix may be served from them.
                # (Running sequences lost their K/V on that rank; their scheduler must recompute them.)
                self.manager.gpu.forget_contents()
                log.warning("rank %d replaced: prefix cache cleared", record.rank)
        log.info("registered %s (rank %d of %d) at %s", record.worker_id, record.rank,
                 self.registry.tensor_parallel_size, record.address)
        self._start_monitor()
        self._update_health()
        return pb.RegisterWorkerResponse(
            worker_id=record.worker_id, heartbeat_interval_s=self.registry.heartbeat_interval,
            num_gpu_blocks=self.manager.gpu.num_blocks if self.manager else 0,
            num_cpu_blocks=self.manager.cpu.num_blocks if self.manager else 0)

    def _dispatch(self, plan: ExecutionPlan) -> None:
        started = time.perf_counter()
        try:
            sent = self.registry.execute(wire.plan_pb(plan))
        finally:
            self._update_health()
        if sent:
            bytes_per_block = sum(w.block_bytes for w in self.registry.workers())
            self.metrics.observe_dispatch(plan, time.perf_counter() - started, bytes_per_block)

    # ---- metrics ------------------------------------------------------------------------------
    def serve_metrics(self, host: str = "127.0.0.1", port: int = 0):
        """Serve /metrics and /sd/workers (Prometheus HTTP service discovery) on host:port."""
        from kvpager.metrics_http import MetricsServer

        self._metrics_server = MetricsServer(self.metrics.registry, host, port, {"/sd/workers": self.worker_targets})
        return self._metrics_server

    def worker_targets(self) -> list[dict]:
        """The registered workers' metrics endpoints, as a Prometheus HTTP SD document."""
        return [{"targets": [w.metrics_address], "labels": {"rank": str(w.rank), "worker_id": w.worker_id}}
                for w in self.registry.workers() if w.metrics_address]

    def _start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch_workers, name="kvpager-worker-monitor", daemon=True)
            self._monitor.start()

    def _watch_workers(self) -> None:
        while not self._stop.wait(self.registry.heartbeat_interval / 2):
            for record in self.registry.expire():
                log.warning("worker %s (rank %d) at %s missed its heartbeats; dropped",
                            record.worker_id, record.rank, record.address)
            self._update_health()

    def _update_health(self) -> None:
        if self.health is None:
            return
        ok = not self.registry.expected or self.registry.complete()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def close(self) -> None:
        """Stop watching workers and close their channels (the server is stopped by its owner)."""
        self._stop.set()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        self.registry.close()


def create_server(manager: BlockManager | ManagerConfig | None = None, address: str = "127.0.0.1:0",
                  max_workers: int = 16):
    """Build (not start) a server; returns (server, port, service, health_servicer).
    Call ``service.close()`` after stopping the server."""
    health_servicer = health.HealthServicer()
    if isinstance(manager, BlockManager):
        service = BlockManagerService(manager.config, manager, health_servicer)
    else:
        service = BlockManagerService(manager or ManagerConfig(), None, health_servicer)
    # SO_REUSEPORT off: a second manager on a port in use must fail, not share it silently.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvpager-rpc"),
                         interceptors=[RpcMetricsInterceptor(service.metrics)], options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_BlockManagerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port, service, health_servicer
