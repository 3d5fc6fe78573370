"""The gRPC face of the block manager: a thin servicer (protobuf in, a manager call, protobuf out).

Every RPC decodes its request, takes the state lock (``manager/state_lock.py``), calls the
manager, encodes the answer and releases it; errors become gRPC statuses in one place
(``manager/rpc_errors.py``). A step's plan goes to the workers (``WorkerRegistry.execute``)
before the step commits, with the lock released: the step is tentative meanwhile
(``manager/tentative.py``), so every other call (reads, Ping, heartbeats, steps that need no
worker or other sequences) goes on; only a call naming one of its sequences waits for it
(``Busy``, then run again). Ids are mapped to the caller's tenant (``manager/tenancy.py``) when a
request is decoded and back when its answer is encoded. Worker registration and health:
``manager/registration.py``; the answers kept for retries: ``manager/request_cache.py``; the
write-ahead log: ``manager/recovery.py``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpager import auth
from kvpager.auth import TLS, TokenTable, current_identity
from kvpager.errors import (
    Busy, DeadlineExceeded, InvalidArgument, InvariantViolation, ManagerError, OutOfRange, Unavailable, quote,
)
from kvpager.metrics_http import MetricsServer
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc
from . import tenancy, wire
from .block_manager import BlockManager
from .config import ManagerConfig
from .epochs import WorkerCaches
from .health import HealthService
from .metrics import ManagerMetrics, RpcMetricsInterceptor
from .operations import Operation
from .plan import ExecutionPlan, StepResult
from .registration import SERVICE_NAME, WorkerRegistration
from .request_cache import Answer, RequestCache, fingerprint
from .rpc_errors import MalformedRequestInterceptor, reply
from .state_lock import StateLock
from .workers import WorkerRegistry

if TYPE_CHECKING:
    from .recovery import Durability

__all__ = ["SERVICE_NAME", "BlockManagerService", "create_server"]

log = logging.getLogger("kvpager.manager")
_NOT_KEPT = (Unavailable, DeadlineExceeded, InvariantViolation)  # answers the request-id cache does not keep
_READS = frozenset({"GetStats", "GetBlockTable"})  # calls that change nothing
R = TypeVar("R")  # an RPC's response message type


class BlockManagerService(WorkerRegistration, pb_grpc.BlockManagerServicer):
    def __init__(self, config: ManagerConfig, manager: Optional[BlockManager] = None,
                 health_servicer: Optional[HealthService] = None,
                 request_cache_size: Optional[int] = None) -> None:
        self.config = config
        # None while the pools wait to be sized from the workers' capacity (num_gpu_blocks == 0).
        self.manager = manager if manager is not None or config.sized_by_workers else BlockManager(config)
        # One lock guards the state (docs/design.md, "The service"); it is never held while
        # waiting on a worker. ``lock`` and ``state_lock`` are that lock (reentrant, so ``with
        # service.lock, service.state_lock`` is fine): holding it, a caller sees no call
        # half-applied (tentative steps may be pending).
        self.state = StateLock(config.worker_plan_timeout)
        self.state_lock = self.lock = self.state.lock
        self.quotas: dict[str, int] = {}  # tenant -> block quota (create_server: the tokens file's quota_blocks)
        self.sequence_quotas: dict[str, int] = {}  # tenant -> live sequences (the tokens file's quota_sequences)
        self.requests = RequestCache(request_cache_size or config.request_cache_entries, config.request_cache_bytes,
                                     config.request_cache_ttl)
        self.health = health_servicer
        timeout = config.worker_heartbeat_timeout
        self.registry = WorkerRegistry(config.block_size, heartbeat_interval=timeout / 5, heartbeat_timeout=timeout,
                                       plan_timeout=config.worker_plan_timeout)
        self._stop = threading.Event()
        self._monitor: Optional[threading.Thread] = None
        self.metrics = ManagerMetrics(self)
        self._metrics_server: Optional[MetricsServer] = None
        self.caches = WorkerCaches()  # the workers' cache ids and the epoch (manager/epochs.py)
        # Recovered state whose K/V lives on workers that have not registered again yet: steps that
        # move blocks are refused until they have, and health says so for the BlockManager service.
        self.awaiting_workers = False
        self.durable: Optional[Durability] = None  # the write-ahead log and snapshots of --state-dir
        if config.state_dir:
            from .recovery import open_state
            self.durable = open_state(self)  # recovers the state first; raises wal.CorruptState

    def _manager(self) -> BlockManager:
        if self.manager is None:
            raise Unavailable("no block pool yet: it is sized from the workers' capacity; waiting for all "
                              "tensor-parallel ranks to register")
        return self.manager

    # ---- the one path every RPC takes -----------------------------------------------------------
    def _call(self, method: str, request: Message, context: grpc.ServicerContext, reply_type: type[R],
              work: Callable[[], object]) -> R:
        """Run ``work`` under the state lock (its kept answer when the request id was seen), log
        it (--state-dir), and answer its ``reply_type`` response or its error's status."""
        try:
            request_id: str = getattr(request, "request_id", "")
            if len(request_id) > self.config.max_id_len:
                raise InvalidArgument(f"request_id {quote(request_id)} is {len(request_id)} characters; the limit "
                                      f"is {self.config.max_id_len} (max_id_len)")
            request_key = self._scope().key(request_id)  # a request id is its tenant's
            print_ = fingerprint(method, request.SerializeToString(deterministic=True)) if request_id else b""
            with self.state.held(mutation=method not in _READS):
                while True:
                    answer = self.requests.get(request_key, print_) if request_id else None
                    if answer is None:
                        answer = self._answer(method, work)
                        # Kept for retries, unless nothing was applied and trying again may help
                        # (UNAVAILABLE) or the answer is a bug's (INTERNAL: rolled back too).
                        if request_id and not isinstance(answer.error, _NOT_KEPT):
                            self.requests.put(request_key, print_, answer)
                    if not isinstance(answer.error, Busy):
                        break
                    self.state.wait_for_step(method, answer.error)  # then run it again (a retry: its first answer)
                if method not in _READS:
                    self.state.notify_finished()
                if self.durable is not None:
                    self.durable.commit()  # in the write-ahead log before the answer leaves (--state-dir)
        except ManagerError as err:
            scope = self._scope()
            answer = Answer(error=scope.error(err, [scope.key(getattr(request, "request_id", ""))]))
        except Exception as exc:  # a bug: the manager rolled back; report it, keep serving
            log.exception("%s failed", method)
            answer = Answer(error=InvariantViolation(f"{method}: internal error: {exc!r}"))
        return reply(answer, context, reply_type)

    @staticmethod
    def _answer(method: str, work: Callable[[], object]) -> Answer:
        """What ``work`` answers: its response (an ``Answer`` already, when it measured its size:
        see ``_bounded``), or its error."""
        try:
            response = work()
            return response if isinstance(response, Answer) else Answer(response=response)
        except InvariantViolation as err:  # a bug: the step was rolled back whole
            log.exception("%s failed: %s", method, err)
            return Answer(error=err)
        except ManagerError as err:
            return Answer(error=err)

    # ---- tenants (manager/tenancy.py) ---------------------------------------------------------
    @staticmethod
    def _scope() -> tenancy.Scope:
        """The caller's tenant (``""`` on a server without tokens)."""
        identity = current_identity()
        return tenancy.Scope(identity.tenant if identity is not None else "")

    @contextlib.contextmanager
    def _quota(self, scope: tenancy.Scope) -> Iterator[None]:
        """Enforce the caller's block and sequence quotas, if it has them, on the step run inside."""
        quota, sequences = self.quotas.get(scope.tenant), self.sequence_quotas.get(scope.tenant)
        if (quota is None and sequences is None) or self.manager is None:
            yield
            return
        if quota is not None:
            self.manager.admit = tenancy.QuotaCheck(self.manager, scope.tenant, quota)
        if sequences is not None:
            self.manager.admit_sequence = tenancy.SequenceQuotaCheck(self.manager, scope.tenant, sequences)
        try:
            yield
        finally:
            self.manager.admit = self.manager.admit_sequence = None

    def _apply_as(self, op: Operation, encode: Callable[[Any], Any]) -> Answer:
        """``_apply`` in the caller's tenant: its ids mapped to keys, the answer and errors mapped back."""
        scope = self._scope()
        op = scope.op(op)
        try:
            with self._quota(scope):
                return self._apply(op, lambda result: scope.response(encode(result)))
        except ManagerError as err:
            shown = scope.op_error(err, op)
            if shown is err:
                raise
            raise shown from None

    def _apply(self, op: Operation, encode: Callable[[Any], Any]) -> Answer:
        """Run one operation as a step of one; its answer is encoded and its size checked
        before the step commits (a too large one rolls it back)."""
        replies: list[Answer] = []

        def check(result: StepResult) -> None:
            outcome = result.outcomes[0]
            if outcome.error is None:
                replies.append(self._bounded(encode(outcome.result)))

        self._manager().run(op, before_commit=check)
        return replies[0]

    def _bounded(self, reply: Any) -> Answer:
        """The reply with its size, unless it is larger than max_reply_bytes: then OUT_OF_RANGE
        (the caller raises this before its step commits, so nothing is applied). The size is
        measured once here (``ByteSize`` walks the whole message) and kept for the request-id
        cache's byte bound."""
        size: int = reply.ByteSize()
        if size > self.config.max_reply_bytes:
            raise OutOfRange(f"the answer would be {size} bytes, more than max_reply_bytes "
                             f"({self.config.max_reply_bytes}); nothing was applied: split the work over several calls")
        return Answer(response=reply, nbytes=size)

    # ---- RPCs ---------------------------------------------------------------------------------
    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        return self._call("Allocate", request, context, pb.AllocateResponse,
                          lambda: self._apply_as(wire.allocate_op(request), wire.allocate_pb))

    def Append(self, request: pb.AppendRequest, context: grpc.ServicerContext) -> pb.AppendResponse:
        return self._call("Append", request, context, pb.AppendResponse,
                          lambda: self._apply_as(wire.append_op(request), wire.append_pb))

    def Fork(self, request: pb.ForkRequest, context: grpc.ServicerContext) -> pb.ForkResponse:
        return self._call("Fork", request, context, pb.ForkResponse,
                          lambda: self._apply_as(wire.fork_op(request, self.config.max_step_forks), wire.fork_pb))

    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        return self._call("Free", request, context, pb.FreeResponse,
                          lambda: self._apply_as(wire.free_op(request), wire.free_pb))

    def SwapOut(self, request: pb.SwapOutRequest, context: grpc.ServicerContext) -> pb.SwapOutResponse:
        return self._call("SwapOut", request, context, pb.SwapOutResponse,
                          lambda: self._apply_as(wire.swap_out_op(request, self.config.max_step_operations),
                                                 wire.swap_out_pb))

    def SwapIn(self, request: pb.SwapInRequest, context: grpc.ServicerContext) -> pb.SwapInResponse:
        return self._call("SwapIn", request, context, pb.SwapInResponse,
                          lambda: self._apply_as(wire.swap_in_op(request, self.config.max_step_operations),
                                                 wire.swap_in_pb))

    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        def work() -> Answer:
            layout = wire.step_layout(request)
            scope = self._scope()
            ops = scope.ops(wire.step_ops(request, self.config.max_step_operations, self.config.max_step_forks))
            replies: list[Answer] = []

            def encode(result: StepResult) -> None:
                replies.append(self._bounded(scope.response(wire.step_pb(ops, result), ops)))

            with self._quota(scope):
                self._manager().step(ops, request.all_or_nothing, layout=layout, before_commit=encode)
            return replies[0]

        return self._call("Step", request, context, pb.StepResponse, work)

    def GetBlockTable(self, request: pb.GetBlockTableRequest,
                      context: grpc.ServicerContext) -> pb.GetBlockTableResponse:
        def work() -> pb.GetBlockTableResponse:
            scope = self._scope()
            key = scope.key(request.seq_id)
            try:
                return scope.response(wire.block_table_pb(self._manager().block_table(key)))
            except ManagerError as err:
                shown = scope.error(err, [key])
                if shown is err:
                    raise
                raise shown from None

        return self._call("GetBlockTable", request, context, pb.GetBlockTableResponse, work)

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        def work() -> pb.GetStatsResponse:
            manager = self.manager
            if manager is None:  # the pools wait for the workers: what is known (block size, workers)
                reply = pb.GetStatsResponse(block_size=self.config.block_size)
            else:
                reply = wire.stats_pb(manager.stats())
            reply.workers_registered = len(self.registry.workers())
            reply.workers_expected = self.registry.tensor_parallel_size or 0
            reply.epoch, reply.lost_sequences = self.caches.epoch, len(manager.lost) if manager is not None else 0
            identity = current_identity()
            if manager is not None and identity is not None:
                # Tokens: a scheduler sees its tenant, an admin every tenant. O(sequences + their blocks).
                admin = identity.role == "admin"
                usage = tenancy.usage(manager, None if admin else identity.tenant)
                wire.fill_tenant_stats(reply, usage, self.quotas, self.sequence_quotas, identity.tenant, admin)
                if not admin:   # its own lost sequences only, as its running and swapped ones
                    reply.lost_sequences = sum(1 for key in manager.lost if tenancy.tenant_of(key) == identity.tenant)
            return reply

        return self._call("GetStats", request, context, pb.GetStatsResponse, work)

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return pb.PingResponse()

    # ---- workers (manager/registration.py) ----------------------------------------------------
    def RegisterWorker(self, request: pb.RegisterWorkerRequest,
                       context: grpc.ServicerContext) -> pb.RegisterWorkerResponse:
        left = context.time_remaining()  # the worker's deadline: a wait for steps ends before it
        deadline = None if left is None else time.monotonic() + left
        return self._call("RegisterWorker", request, context, pb.RegisterWorkerResponse,
                          lambda: self._register(request, deadline))

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(registered=self.registry.heartbeat(request.worker_id))

    def _dispatch(self, plan: ExecutionPlan) -> None:
        """Send a step's plan to the workers, before the step commits (``BlockManager.step``, where
        the step is tentative by now). The state lock is released while waiting, so every other
        call goes on (reads may see this step's changes before it commits or rolls back)."""
        if not plan.moves_blocks:
            return  # nothing to move: no worker needed
        started = time.perf_counter()
        message = wire.plan_pb(plan)
        try:
            with self.state.released_for_workers(f"step {plan.step_id}"):
                sent = self.registry.execute(message)
        finally:
            self._update_health()
        if sent:
            bytes_per_block = sum(w.block_bytes for w in self.registry.workers())
            self.metrics.observe_dispatch(plan, time.perf_counter() - started, bytes_per_block)

    # ---- metrics and shutdown -----------------------------------------------------------------
    def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
        """Serve /metrics and /sd/workers (Prometheus HTTP service discovery) on host:port."""
        self._metrics_server = MetricsServer(self.metrics.registry, host, port, {"/sd/workers": self.worker_targets})
        return self._metrics_server

    def close(self) -> None:
        """Stop, once the server stopped (its owner stops it first: no answer leaves any more).
        Calls still running there (gRPC cancelled them after the grace period, but their threads
        run on) end without applying anything more: a plan out to the workers is cancelled and its
        step rolled back, other calls are refused UNAVAILABLE. The write-ahead log is closed only
        when none is left to write to it (a restart recovers exactly what was answered)."""
        self._stop.set()
        self.state.refuse_all()
        self.registry.close()   # no plan is sent, the ones out are cancelled: their steps end now
        # Bounded, so that nothing keeps the process from exiting: after the cancels, only a call
        # busy under the lock (or a bug) is left.
        limit = self.config.worker_plan_timeout
        if not self.state.wait_idle(limit):
            log.warning("%d calls still run %.1fs after the shutdown began; what they change is not logged (none "
                        "of them can be answered: the server stopped)", self.state.inside, limit)
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        if self.durable is not None:
            with self.state.lock:   # not while a call writes a record
                self.durable.close()


# The collector's generation thresholds while a manager serves (gc.set_threshold's arguments).
SERVING_GC_THRESHOLDS = (20_000, 50, 100)


def settle_garbage_collector() -> tuple[int, int, int]:
    """Collect once, then keep the collector off every object alive now and collect the young
    generation less often; returns the thresholds it replaced. The pools are hundreds of thousands
    of long-lived objects: a full collection would otherwise stall every RPC of the process for
    ~0.1-0.4 s, and each Step allocates thousands of short-lived ones. For a process that serves
    a manager (``kvpager manager`` calls it before it starts serving); a test hosting one undoes it
    with ``gc.unfreeze()`` and ``gc.set_threshold(*returned)``."""
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    return previous


def create_server(manager: BlockManager | ManagerConfig | None = None, address: str = "127.0.0.1:0",
                  max_workers: int = 16, *, tokens: Optional[TokenTable] = None, tls: Optional[TLS] = None,
                  worker_tls: Optional[TLS] = None, worker_token: Optional[str] = None,
                  quotas: Optional[dict[str, int]] = None, sequence_quotas: Optional[dict[str, int]] = None,
                  ) -> tuple[grpc.Server, int, BlockManagerService, HealthService]:
    """Build (not start) a server; returns (server, port, service, health_servicer).
    Call ``service.close()`` after stopping the server.

    Plaintext and open by default (the library API, loopback tests, the embedded system);
    ``kvpager manager`` requires credentials or --insecure. ``tokens`` (a ``kvpager.auth.TokenTable``)
    turns on the bearer-token check of every call but health and reflection; ``tls`` (a
    ``kvpager.auth.TLS`` with a certificate, and a client CA for mutual TLS) serves TLS. The
    channels to the workers use ``worker_tls`` (its ``ca`` verifies them, its certificate is the
    manager's client certificate) and send ``worker_token``. ``quotas`` (tenant -> blocks) adds to
    the tokens' ``quota_blocks``, ``sequence_quotas`` (tenant -> live sequences) to their
    ``quota_sequences`` (docs/security.md, "Tenants")."""
    health_servicer = HealthService()
    if isinstance(manager, BlockManager):
        service = BlockManagerService(manager.config, manager, health_servicer)
    else:
        service = BlockManagerService(manager or ManagerConfig(), None, health_servicer)
    # SO_REUSEPORT off: a second manager on a port in use must fail, not share it silently.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvpager-rpc"),
                         interceptors=[RpcMetricsInterceptor(service.metrics)]
                         + ([auth.manager_interceptor(tokens)] if tokens is not None else [])
                         + [MalformedRequestInterceptor()],
                         options=[("grpc.so_reuseport", 0)])
    health_servicer.epoch = lambda: service.caches.epoch
    service.quotas = {**(tokens.quotas() if tokens is not None else {}), **(quotas or {})}
    service.sequence_quotas = {**(tokens.sequence_quotas() if tokens is not None else {}), **(sequence_quotas or {})}
    service.state.max_waiting = max(1, max_workers // 2)
    if worker_tls is not None or worker_token:
        service.registry.connect = lambda target: auth.channel(target, worker_tls, worker_token)
    pb_grpc.add_BlockManagerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service._update_health()  # its first statuses, before the server starts
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = auth.add_port(server, address, tls)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port, service, health_servicer
