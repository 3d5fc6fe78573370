"""The gRPC face of the block manager: a thin servicer, worker registration, health, reflection.

Every RPC decodes its request, takes the state lock, calls the manager, encodes the answer and
releases it. A step's plan goes to the workers (``WorkerRegistry.execute``) before the step
commits, with the lock released: the step is tentative meanwhile (``manager/tentative.py``), so
every other call (reads, Ping, heartbeats, steps that need no worker or other sequences) goes on;
only a call naming one of its sequences waits for it. Manager errors
become gRPC statuses in exactly one place (``_reply``). Ids are mapped to the caller's tenant
(``manager/tenancy.py``) when a request is decoded and back when its answer is encoded. Health
is SERVING unless workers registered and a rank is missing (the BlockManager service also
NOT_SERVING while no pool exists).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from concurrent import futures
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from google.rpc import error_details_pb2, status_pb2

from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc

from kvpager.auth import current_identity

from . import tenancy, wire
from .block_manager import BlockManager
from .config import ManagerConfig
from .epochs import WorkerCaches
from .health import HealthService
from kvpager.errors import (
    Busy, DeadlineExceeded, FailedPrecondition, InvalidArgument, InvariantViolation, ManagerError, OutOfRange,
    ResourceExhausted, Unavailable, quote,
)
from .metrics import ManagerMetrics, RpcMetricsInterceptor
from .plan import ExecutionPlan
from .request_cache import Answer, RequestCache, fingerprint
from kvpager.status import NUMBERS, status_of
from .workers import WorkerRegistry

log = logging.getLogger("kvpager.manager")
_NOT_KEPT = (Unavailable, DeadlineExceeded, InvariantViolation)  # answers the request-id cache does not keep
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name
_READS = frozenset({"GetStats", "GetBlockTable"})  # calls that change nothing


def _status(err: ManagerError) -> status_pb2.Status:
    status = status_pb2.Status(code=NUMBERS[status_of(err)], message=str(err))
    if isinstance(err, ResourceExhausted) and err.needed is not None:
        status.details.add().Pack(error_details_pb2.ErrorInfo(
            reason=NOT_ENOUGH_BLOCKS, domain="kvpager.v1",
            metadata={"needed": str(err.needed), "free": str(err.free), "tier": err.tier}))
    return status


NOT_ENOUGH_BLOCKS = "NOT_ENOUGH_BLOCKS"  # ErrorInfo.reason of a RESOURCE_EXHAUSTED answer


class Malformed:
    """What a request that is not a valid message becomes (``MalformedRequestInterceptor``)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Bytes that do not parse as the method's request (bad UTF-8 in a string field included)
    are answered INVALID_ARGUMENT through the servicer's one mapping (gRPC itself would answer
    INTERNAL, "Exception deserializing request")."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary
        method = handler_call_details.method.rsplit("/", 1)[-1]

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # protobuf's DecodeError, or whatever a parser raises
                return Malformed(f"{method}: the request is not a valid message ({type(exc).__name__}: "
                                 f"{str(exc)[:200]})")

        def guarded(request, context):
            if isinstance(request, Malformed):
                return BlockManagerService._reply(Answer(error=InvalidArgument(request.reason)), context)
            return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=deserialize, response_serializer=handler.response_serializer)


class BlockManagerService(pb_grpc.BlockManagerServicer):
    def __init__(self, config: ManagerConfig, manager: Optional[BlockManager] = None,
                 health_servicer: Optional[health.HealthServicer] = None,
                 request_cache_size: Optional[int] = None) -> None:
        self.config = config
        # None while the pools wait to be sized from the workers' capacity (num_gpu_blocks == 0).
        self.manager = manager if manager is not None or config.sized_by_workers else BlockManager(config)
        # One lock guards the state (docs/design.md, "The service"); it is never held while
        # waiting on a worker: a step whose plan is out is tentative and the lock is released.
        # ``lock`` is the same lock (reentrant, so ``with service.lock, service.state_lock`` is
        # fine): holding it, a caller sees no call half-applied (tentative steps may be pending).
        self.state_lock = threading.RLock()
        self.lock = self.state_lock
        self._finished = threading.Condition(self.state_lock)  # notified when a call that waited on workers ends
        self._state_owner: Optional[int] = None  # thread holding state_lock through a mutation
        self._dispatches: dict[int, float] = {}  # thread -> monotonic start of the plan it dispatches
        self._waiting = 0  # calls waiting on workers: dispatching a plan, or for a busy sequence's step
        self._waiting_lock = threading.Lock()
        # While a dispatch has waited longer than stall_after seconds, calls beyond max_waiting
        # that would wait on workers too answer UNAVAILABLE at once (nothing applied), so they do
        # not take every server thread from Ping, GetStats, health, heartbeats and the steps
        # that need no worker.
        self.max_waiting = 8
        self.stall_after = 0.02
        self.quotas: dict[str, int] = {}  # tenant -> block quota (create_server: the tokens file's quota_blocks)
        self.requests = RequestCache(request_cache_size or config.request_cache_entries, config.request_cache_bytes,
                                     config.request_cache_ttl)
        self.health = health_servicer
        timeout = config.worker_heartbeat_timeout
        self.registry = WorkerRegistry(config.block_size, heartbeat_interval=timeout / 5, heartbeat_timeout=timeout,
                                       plan_timeout=config.worker_plan_timeout)
        self._stop = threading.Event()
        self._monitor: Optional[threading.Thread] = None
        self.metrics = ManagerMetrics(self)
        self._metrics_server = None
        self.caches = WorkerCaches()  # the workers' cache ids and the epoch (manager/epochs.py)
        # Recovered state whose K/V lives on workers that have not registered again yet: steps that
        # move blocks are refused until they have, and health says so for the BlockManager service.
        self.awaiting_workers = False
        self.durable = None  # the write-ahead log and snapshots of --state-dir (manager/recovery.py)
        if config.state_dir:
            from .recovery import open_state
            self.durable = open_state(self)  # recovers the state first; raises wal.CorruptState

    def _manager(self) -> BlockManager:
        if self.manager is None:
            raise Unavailable("no block pool yet: it is sized from the workers' capacity; waiting for all "
                              "tensor-parallel ranks to register")
        return self.manager

    # ---- the one path every RPC takes -----------------------------------------------------------
    def _call(self, method: str, request, context, work: Callable[[], object]):
        try:
            request_id = getattr(request, "request_id", "")
            if len(request_id) > self.config.max_id_len:
                raise InvalidArgument(f"request_id {quote(request_id)} is {len(request_id)} characters; the limit "
                                      f"is {self.config.max_id_len} (max_id_len)")
            request_key = self._scope().key(request_id)  # a request id is its tenant's
            print_ = fingerprint(method, request.SerializeToString(deterministic=True)) if request_id else None
            with self._locks(method):
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
                    self._wait_for_step(method, answer.error)  # then run it again (a retry: its first answer)
                if method not in _READS:
                    self._finished.notify_all()
                if self.durable is not None:
                    self.durable.commit()  # in the write-ahead log before the answer leaves (--state-dir)
        except ManagerError as err:
            scope = self._scope()
            answer = Answer(error=scope.error(err, [scope.key(getattr(request, "request_id", ""))]))
        except Exception as exc:  # a bug: the manager rolled back; report it, keep serving
            log.exception("%s failed", method)
            answer = Answer(error=InvariantViolation(f"{method}: internal error: {exc!r}"))
        return self._reply(answer, context)

    @contextlib.contextmanager
    def _locks(self, method: str):
        """The state lock; a mutation also notes that its thread owns it (``_dispatch`` releases
        it while the workers run a plan)."""
        with self.state_lock:
            if method in _READS:
                yield
                return
            self._state_owner = threading.get_ident()
            try:
                yield
            finally:
                self._state_owner = None

    @contextlib.contextmanager
    def _waiting_on_workers(self, method: str):
        """Count a call that waits on the workers; refuse it (UNAVAILABLE, nothing applied) when a
        dispatch has waited more than stall_after seconds and max_waiting calls already wait."""
        with self._waiting_lock:
            since = min(self._dispatches.values(), default=None)
            if since is not None and self._waiting >= self.max_waiting:
                waited = time.monotonic() - since
                if waited > self.stall_after:
                    raise Unavailable(
                        f"{method}: a step has waited {waited:.2f}s on the workers and {self._waiting} calls wait on "
                        "them; nothing was applied: retry later")
            self._waiting += 1
        try:
            yield
        finally:
            with self._waiting_lock:
                self._waiting -= 1

    def _wait_for_step(self, method: str, busy: Busy) -> None:
        """Wait (the state lock released) until the tentative step that keeps a sequence of this
        call busy has finished; UNAVAILABLE if that takes longer than a plan may."""
        step = busy.step
        limit = self.config.worker_plan_timeout + 1.0
        started = time.monotonic()
        try:
            with self._waiting_on_workers(method):
                while not step.finished:
                    left = started + limit - time.monotonic()
                    if left <= 0:
                        raise Unavailable(f"{method}: {busy} after waiting {limit:.1f}s for it: retry later")
                    self._finished.wait(left)
        finally:
            self._state_owner = threading.get_ident()  # others held the lock meanwhile: it is ours again

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
    def _quota(self, scope: tenancy.Scope):
        """Enforce the caller's block quota, if it has one, on the step run inside."""
        quota = self.quotas.get(scope.tenant)
        if quota is None or self.manager is None:
            yield
            return
        self.manager.admit = tenancy.QuotaCheck(self.manager, scope.tenant, quota)
        try:
            yield
        finally:
            self.manager.admit = None

    def _apply_as(self, op, encode: Callable[[object], object]) -> Answer:
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

    def _apply(self, op, encode: Callable[[object], object]) -> Answer:
        """Run one operation as a step of one; its answer is encoded and its size checked
        before the step commits (a too large one rolls it back)."""
        replies = []

        def check(result):
            outcome = result.outcomes[0]
            if outcome.error is None:
                replies.append(self._bounded(encode(outcome.result)))

        self._manager().run(op, before_commit=check)
        return replies[0]

    def _bounded(self, reply) -> Answer:
        """The reply with its size, unless it is larger than max_reply_bytes: then OUT_OF_RANGE
        (the caller raises this before its step commits, so nothing is applied). The size is
        measured once here (``ByteSize`` walks the whole message) and kept for the request-id
        cache's byte bound."""
        size = reply.ByteSize()
        if size > self.config.max_reply_bytes:
            raise OutOfRange(f"the answer would be {size} bytes, more than max_reply_bytes "
                             f"({self.config.max_reply_bytes}); nothing was applied: split the work over several calls")
        return Answer(response=reply, nbytes=size)

    @staticmethod
    def _reply(answer: Answer, context):
        """The response, or the error as its status (the one table: ``kvpager/status.py``); no
        room now carries the blocks needed and free as a google.rpc.ErrorInfo detail."""
        if answer.error is not None:
            context.abort_with_status(rpc_status.to_status(_status(answer.error)))
        return answer.response

    # ---- RPCs ---------------------------------------------------------------------------------
    def Allocate(self, request, context):
        return self._call("Allocate", request, context,
                          lambda: self._apply_as(wire.allocate_op(request), wire.allocate_pb))

    def Append(self, request, context):
        return self._call("Append", request, context,
                          lambda: self._apply_as(wire.append_op(request), wire.append_pb))

    def Fork(self, request, context):
        return self._call("Fork", request, context, lambda: self._apply_as(wire.fork_op(request), wire.fork_pb))

    def Free(self, request, context):
        return self._call("Free", request, context, lambda: self._apply_as(wire.free_op(request), wire.free_pb))

    def SwapOut(self, request, context):
        return self._call("SwapOut", request, context,
                          lambda: self._apply_as(wire.swap_out_op(request, self.config.max_step_operations),
                                                 wire.swap_out_pb))

    def SwapIn(self, request, context):
        return self._call("SwapIn", request, context,
                          lambda: self._apply_as(wire.swap_in_op(request, self.config.max_step_operations),
                                                 wire.swap_in_pb))

    def Step(self, request, context):
        def work() -> Answer:
            layout = wire.step_layout(request)
            scope = self._scope()
            ops = scope.ops(wire.step_ops(request, self.config.max_step_operations, self.config.max_step_forks))
            replies = []

            def encode(result):
                replies.append(self._bounded(scope.response(wire.step_pb(ops, result), ops)))

            with self._quota(scope):
                self._manager().step(ops, request.all_or_nothing, layout=layout, before_commit=encode)
            return replies[0]

        return self._call("Step", request, context, work)

    def GetBlockTable(self, request, context):
        def work():
            scope = self._scope()
            key = scope.key(request.seq_id)
            try:
                return scope.response(wire.block_table_pb(self._manager().block_table(key)))
            except ManagerError as err:
                shown = scope.error(err, [key])
                if shown is err:
                    raise
                raise shown from None

        return self._call("GetBlockTable", request, context, work)

    def GetStats(self, request, context):
        def work():
            manager = self.manager
            if manager is None:  # the pools wait for the workers: what is known (block size, workers)
                reply = pb.GetStatsResponse(block_size=self.config.block_size)
            else:
                reply = wire.stats_pb(manager.stats())
            reply.workers_registered = len(self.registry.workers())
            reply.workers_expected = self.registry.tensor_parallel_size or 0
            reply.epoch, reply.lost_sequences = self.caches.epoch, len(manager.lost) if manager is not None else 0
            if manager is None:
                return reply
            identity = current_identity()
            if identity is not None:  # tokens: a scheduler sees its tenant, an admin every tenant
                self._tenant_stats(reply, manager, identity)
            return reply

        return self._call("GetStats", request, context, work)

    def _tenant_stats(self, reply: pb.GetStatsResponse, manager: BlockManager, identity) -> None:
        """A scheduler's stats: its own tenant's sequences and usage (``tenant``) besides the pool
        totals; an admin's: everything, and ``tenants``, one entry per tenant with live sequences
        or a quota. O(sequences + their blocks)."""
        def fill(m: pb.TenantStats, tenant: str, use: tenancy.Usage) -> None:
            m.tenant = tenant
            m.gpu_blocks, m.cpu_blocks = use.gpu_blocks, use.cpu_blocks
            m.running_sequences, m.swapped_sequences = use.running_sequences, use.swapped_sequences
            quota = self.quotas.get(tenant)
            m.has_quota = quota is not None
            m.quota_blocks = quota or 0

        if identity.role == "admin":
            usage = tenancy.usage(manager)
            for tenant in sorted(set(usage) | set(self.quotas)):
                fill(reply.tenants.add(), tenant, usage.get(tenant, tenancy.Usage()))
            mine = usage.get(identity.tenant, tenancy.Usage())
        else:
            mine = tenancy.usage(manager, identity.tenant).get(identity.tenant, tenancy.Usage())
            reply.running_sequences, reply.swapped_sequences = mine.running_sequences, mine.swapped_sequences
        fill(reply.tenant, identity.tenant, mine)

    def Ping(self, request, context):
        return pb.PingResponse()

    # ---- workers ------------------------------------------------------------------------------
    def RegisterWorker(self, request, context):
        return self._call("RegisterWorker", request, context, lambda: self._register(request))

    def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(registered=self.registry.heartbeat(request.worker_id))

    def _register(self, request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerResponse:
        try:
            return self._admit_worker(request)
        except ManagerError as err:  # one line for the operator; the worker gets the status
            log.warning("refused the worker at %s (rank %d): %s", quote(request.address), request.rank, err)
            raise

    def _admit_worker(self, request: pb.RegisterWorkerRequest) -> pb.RegisterWorkerResponse:
        self._until_no_tentative_step("RegisterWorker")
        if self.manager is not None:  # checked before the registry changes: a refusal leaves no trace
            gpu, cpu = self.manager.gpu.num_blocks, self.manager.cpu.num_blocks
            if request.num_gpu_blocks < gpu or request.num_cpu_blocks < cpu:
                raise FailedPrecondition(
                    f"register worker: capacity {request.num_gpu_blocks} GPU / {request.num_cpu_blocks} CPU blocks is "
                    f"below the manager's pools ({gpu} / {cpu}): give the workers more (--num-gpu-blocks, "
                    "--num-cpu-blocks) or the manager less")
        replacing = request.rank in self.registry.ranks_seen
        record = self.registry.register(request)
        if self.manager is None and self.registry.complete():
            gpu, cpu = self.registry.capacity()
            self.manager = BlockManager(dataclasses.replace(self.config, num_gpu_blocks=gpu, num_cpu_blocks=cpu))
            log.info("pools sized from the workers: %d GPU and %d CPU blocks", gpu, cpu)
        cache_lost = self.caches.register(record.rank, request.cache_id)  # manager/epochs.py
        if self.durable is not None and request.cache_id:
            self.durable.event("worker_cache", record.rank, request.cache_id)
        if self.manager is not None:
            self.manager.dispatch = self._dispatch
            if cache_lost:
                lost = self.manager.lose_all(self.caches.epoch)
                log.warning("rank %d came back with another cache (a replaced worker): epoch %d, %d sequences lost "
                            "(DATA_LOSS until freed), prefix cache cleared", record.rank, self.caches.epoch, lost)
            elif replacing and not request.cache_id:
                # The replaced worker's cache contents are gone: no prefix may be served from them.
                # (Running sequences lost their K/V on that rank; their scheduler must recompute them.)
                self.manager.gpu.forget_contents()
                if self.durable is not None:
                    self.durable.event("forget_gpu_contents")
                log.warning("rank %d replaced: prefix cache cleared", record.rank)
        if self.registry.complete():
            self.awaiting_workers = False
        log.info("registered %s (rank %d of %d) at %s", record.worker_id, record.rank,
                 self.registry.tensor_parallel_size, record.address)
        self._start_monitor()
        self._update_health()
        return pb.RegisterWorkerResponse(
            worker_id=record.worker_id, heartbeat_interval_s=self.registry.heartbeat_interval,
            num_gpu_blocks=self.manager.gpu.num_blocks if self.manager else 0,
            num_cpu_blocks=self.manager.cpu.num_blocks if self.manager else 0)

    def _until_no_tentative_step(self, method: str) -> None:
        """Wait until no step waits on the workers (a registration may forget the caches' contents
        or lose every sequence, which no pending step could be undone across)."""
        manager = self.manager
        if manager is None or not manager.tentative:
            return
        limit = self.config.worker_plan_timeout + 1.0
        done = self._finished.wait_for(lambda: not manager.tentative, timeout=limit)
        self._state_owner = threading.get_ident()  # others held the lock meanwhile: it is ours again
        if not done:
            raise Unavailable(f"{method}: {len(manager.tentative)} steps still wait on the workers after "
                              f"{limit:.1f}s; try again")

    def _dispatch(self, plan: ExecutionPlan) -> None:
        """Send a step's plan to the workers, before the step commits (``BlockManager.step``, where
        the step is tentative by now). The state lock is released while waiting, so every other
        call goes on (reads may see this step's changes before it commits or rolls back)."""
        if not plan.moves_blocks:
            return  # nothing to move: no worker needed
        started = time.perf_counter()
        message = wire.plan_pb(plan)
        me = threading.get_ident()
        release = self._state_owner == me
        with self._waiting_on_workers(f"step {plan.step_id}"):
            with self._waiting_lock:
                self._dispatches[me] = time.monotonic()
            if release:
                self._state_owner = None
                self.state_lock.release()
            try:
                sent = self.registry.execute(message)
            finally:
                if release:
                    self.state_lock.acquire()
                    self._state_owner = me
                with self._waiting_lock:
                    del self._dispatches[me]
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
        # "": the process can serve (NOT_SERVING once a rank is known dead or missing);
        # the BlockManager service: it can serve steps, so also NOT_SERVING while no pool exists
        # and, after a restart, until the workers holding the recovered state registered again.
        # (Not "" for the pool: compose starts the workers, which size the pool, once "" is SERVING.)
        ok = not self.registry.expected or self.registry.complete()
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", serving if ok else not_serving)
        ready = ok and self.manager is not None and not self.awaiting_workers
        self.health.set(SERVICE_NAME, serving if ready else not_serving)

    def close(self) -> None:
        """Stop watching workers and close their channels (the server is stopped by its owner)."""
        self._stop.set()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        self.registry.close()
        if self.durable is not None:
            self.durable.close()


def create_server(manager: BlockManager | ManagerConfig | None = None, address: str = "127.0.0.1:0",
                  max_workers: int = 16, *, tokens=None, tls=None, worker_tls=None, worker_token: Optional[str] = None,
                  quotas: Optional[dict[str, int]] = None):
    """Build (not start) a server; returns (server, port, service, health_servicer).
    Call ``service.close()`` after stopping the server.

    Plaintext and open by default (the library API, loopback tests, the embedded system);
    ``kvpager manager`` requires credentials or --insecure. ``tokens`` (a ``kvpager.auth.TokenTable``)
    turns on the bearer-token check of every call but health and reflection; ``tls`` (a
    ``kvpager.auth.TLS`` with a certificate, and a client CA for mutual TLS) serves TLS. The
    channels to the workers use ``worker_tls`` (its ``ca`` verifies them, its certificate is the
    manager's client certificate) and send ``worker_token``. ``quotas`` (tenant -> blocks) adds to
    the tokens' ``quota_blocks`` (docs/security.md, "Tenants")."""
    from kvpager import auth
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
    service.max_waiting = max(1, max_workers // 2)
    if worker_tls is not None or worker_token:
        service.registry.connect = lambda target: auth.channel(target, worker_tls, worker_token)
    pb_grpc.add_BlockManagerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service._update_health()
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = auth.add_port(server, address, tls)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port, service, health_servicer
