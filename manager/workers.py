"""The manager's view of its GPU workers: registration, liveness, and plan fan-out.

Workers form one tensor-parallel group: rank r of N holds a slice of the KV heads, and every
rank receives the same plan. A step's plan goes to all ranks in parallel, each call with a
deadline, and the step commits only after every rank acknowledged it; the first failure rolls
the step back. Rolling back is safe even when some ranks already executed the plan: a plan only
writes blocks that the step newly took, which are free again after the rollback. What a failed
ExecutePlan means depends on the status the worker (or gRPC) answered it with:

- INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE: the worker checked the plan against its
  cache and refused it whole (``KVCache.execute`` checks every part before anything moves), so
  the plan was wrong: a manager bug. The caller gets INTERNAL naming the rank, the step and the
  worker's reason; the worker stays registered (it is healthy, its cache untouched).
- RESOURCE_EXHAUSTED: the worker is alive but took no new call (gRPC answers it when the
  worker's server has no thread free); nothing was applied. The worker stays registered; the
  caller gets UNAVAILABLE (retrying may help).
- Any other status: the worker is dropped and the caller gets UNAVAILABLE until the rank
  registers again. UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED: it could not be reached or did not
  answer in time; INTERNAL, UNKNOWN, DATA_LOSS: it broke (a CUDA error...), so its cache cannot
  be trusted; UNIMPLEMENTED: no CacheWorker serves its address; UNAUTHENTICATED,
  PERMISSION_DENIED: it refuses the manager's credentials.

A worker whose heartbeats stop for ``heartbeat_timeout`` seconds is dropped too (its ExecutePlan
calls in flight are cancelled, so a step waiting on it fails at once); a replacement registering
under the same rank is used.

The registry has its own lock, so heartbeats never wait behind a long step.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import grpc

from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import plan_pb2, worker_pb2, worker_pb2_grpc

from kvpager.errors import FailedPrecondition, InvalidArgument, InvariantViolation, Unavailable

# The statuses with which a worker refuses a plan that does not fit its cache, having applied
# none of it: the manager made a wrong plan (a bug), the worker is fine.
_PLAN_REJECTED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.OUT_OF_RANGE})
# The worker is alive but took no new call now (its server's threads are all busy): nothing applied.
_WORKER_BUSY = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True, slots=True)
class PlanFailure:
    """Why one rank's ExecutePlan call failed."""

    code: Optional[grpc.StatusCode]  # its status; None: cancelled because the rank was dropped
    reason: str                      # one line for the messages: the status and the worker's details


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    address: str
    rank: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    channel: grpc.Channel
    stub: worker_pb2_grpc.CacheWorkerStub
    last_seen: float  # clock() of the last registration or heartbeat
    metrics_address: str = ""  # host:port of its Prometheus endpoint; empty: none
    block_bytes: int = 0       # bytes of one block on this rank (0: not reported)


class WorkerRegistry:
    def __init__(self, block_size: int, heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0,
                 plan_timeout: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.plan_timeout = plan_timeout
        self.tensor_parallel_size: Optional[int] = None  # fixed by the first registration
        self._clock = clock
        self._lock = threading.Lock()
        self._by_rank: dict[int, WorkerRecord] = {}
        # ExecutePlan calls in flight, by worker id: cancelled when the worker is dropped, so a
        # step waiting on a rank known dead fails at once instead of at the plan timeout.
        self._inflight: dict[str, set[grpc.Future]] = {}
        self.ranks_seen: set[int] = set()  # ranks that ever registered: a new one there is a replacement
        self.closed = False  # set by ``close``: no plan is sent from then on
        self._ids = itertools.count(1)
        # Opens the channel to a worker's CacheWorker service (create_server sets TLS and the
        # manager's token here when the workers require them).
        self.connect: Callable[[str], grpc.Channel] = grpc.insecure_channel

    @property
    def expected(self) -> bool:
        """True once any worker registered: from then on steps need the whole group."""
        return self.tensor_parallel_size is not None

    def register(self, req: pb.RegisterWorkerRequest) -> WorkerRecord:
        if not req.address:
            raise InvalidArgument("register worker: address (host:port of its CacheWorker service) is required")
        if req.tensor_parallel_size < 1 or not 0 <= req.rank < req.tensor_parallel_size:
            raise InvalidArgument(
                f"register worker: rank {req.rank} must be in [0, tensor_parallel_size={req.tensor_parallel_size})")
        if req.num_gpu_blocks < 2 or req.num_cpu_blocks < 0:   # GPU block 0 is the null block padding names
            raise InvalidArgument(
                f"register worker: capacity must be >= 2 GPU blocks (block 0 is reserved) and >= 0 CPU blocks, got "
                f"{req.num_gpu_blocks}/{req.num_cpu_blocks}")
        if req.block_bytes < 0:
            raise InvalidArgument(f"register worker: block_bytes must be >= 0, got {req.block_bytes}")
        if req.block_size != self.block_size:
            raise FailedPrecondition(
                f"register worker: its block size {req.block_size} differs from the manager's {self.block_size}")
        with self._lock:
            if self.tensor_parallel_size not in (None, req.tensor_parallel_size):
                raise FailedPrecondition(
                    f"register worker: tensor_parallel_size {req.tensor_parallel_size} differs from the group's "
                    f"{self.tensor_parallel_size}")
            self.tensor_parallel_size = req.tensor_parallel_size
            old = self._by_rank.get(req.rank)
            channel = self.connect(req.address)
            record = WorkerRecord(
                worker_id=f"worker-{next(self._ids)}-rank{req.rank}", address=req.address, rank=req.rank,
                num_gpu_blocks=req.num_gpu_blocks, num_cpu_blocks=req.num_cpu_blocks, channel=channel,
                stub=worker_pb2_grpc.CacheWorkerStub(channel), last_seen=self._clock(),
                metrics_address=req.metrics_address, block_bytes=req.block_bytes,
            )
            self._by_rank[req.rank] = record
            self.ranks_seen.add(req.rank)
        if old is not None:
            old.channel.close()
        return record

    def unregister(self, worker_id: str) -> None:
        with self._lock:
            for rank, record in list(self._by_rank.items()):
                if record.worker_id == worker_id:
                    del self._by_rank[rank]
                    record.channel.close()

    def heartbeat(self, worker_id: str) -> bool:
        with self._lock:
            for record in self._by_rank.values():
                if record.worker_id == worker_id:
                    record.last_seen = self._clock()
                    return True
        return False

    def expire(self) -> list[WorkerRecord]:
        """Drop workers whose heartbeats stopped; returns them."""
        now = self._clock()
        with self._lock:
            dead = [r for r in self._by_rank.values() if now - r.last_seen > self.heartbeat_timeout]
            for record in dead:
                del self._by_rank[record.rank]
            calls = [call for record in dead for call in self._inflight.get(record.worker_id, ())]
        for call in calls:
            call.cancel()
        for record in dead:
            record.channel.close()
        return dead

    def missing_ranks(self) -> list[int]:
        if self.tensor_parallel_size is None:
            return []
        with self._lock:
            return [r for r in range(self.tensor_parallel_size) if r not in self._by_rank]

    def complete(self) -> bool:
        return self.expected and not self.missing_ranks()

    def capacity(self) -> tuple[int, int]:
        """The smallest GPU and CPU capacities among the registered workers."""
        with self._lock:
            records = list(self._by_rank.values())
        return min(r.num_gpu_blocks for r in records), min(r.num_cpu_blocks for r in records)

    def healthy(self) -> list[WorkerRecord]:
        """Registered workers heard from within two heartbeat intervals."""
        now = self._clock()
        with self._lock:
            return [r for r in self._by_rank.values() if now - r.last_seen <= 2 * self.heartbeat_interval]

    def workers(self) -> list[WorkerRecord]:
        with self._lock:
            return [self._by_rank[r] for r in sorted(self._by_rank)]

    def execute(self, plan: plan_pb2.ExecutionPlan) -> bool:
        """Send a plan to every rank in parallel; return True when all acknowledged. As soon as one
        rank fails, the other calls are cancelled and what that failure means is raised (the
        module docstring): InvariantViolation for a plan the worker rejected (it stays
        registered), else Unavailable (the rank dropped unless it was only busy).
        A plan with nothing to move needs no worker: False, nothing sent. The group is read, and
        the calls made and registered as in flight (``expire`` cancels them), under the
        registry's lock: a rank dropped meanwhile is missing, not skipped."""
        if not (plan.blocks_to_swap_out.src or plan.blocks_to_swap_in.src or plan.blocks_to_copy.src):
            return False
        request = worker_pb2.ExecutePlanRequest(plan=plan)
        with self._lock:
            if self.closed:
                raise Unavailable(f"step {plan.step_id}: the manager is shutting down; the step was not applied")
            size = self.tensor_parallel_size
            missing = [r for r in range(size) if r not in self._by_rank] if size is not None else []
            if missing:
                raise Unavailable(
                    f"step {plan.step_id}: worker rank(s) {missing} of {size} are not registered (dead or not "
                    "started); the step was not applied")
            calls = [(w, w.stub.ExecutePlan.future(request, timeout=self.plan_timeout))
                     for w in (self._by_rank[r] for r in sorted(self._by_rank))]
            for worker, call in calls:
                self._inflight.setdefault(worker.worker_id, set()).add(call)
        done: queue.SimpleQueue[tuple[WorkerRecord, grpc.Future]] = queue.SimpleQueue()
        for worker, call in calls:
            call.add_done_callback(lambda call, worker=worker: done.put((worker, call)))
        failure: Optional[tuple[WorkerRecord, PlanFailure]] = None
        try:
            for _ in calls:   # in the order they finish: the first failure ends the wait
                worker, call = done.get()
                why = _failure(call)
                if why is not None:
                    failure = (worker, why)
                    break
        finally:
            with self._lock:
                for worker, call in calls:
                    pending = self._inflight.get(worker.worker_id)
                    if pending is not None:
                        pending.discard(call)
                        if not pending:
                            del self._inflight[worker.worker_id]
            if failure is not None:
                for _, call in calls:
                    call.cancel()   # nothing on the calls that finished
        if failure is None:
            return True
        worker, why = failure
        if self.closed and why.code in (None, grpc.StatusCode.CANCELLED):   # ``close`` cancelled it
            raise Unavailable(f"step {plan.step_id}: the manager is shutting down; the step was rolled back")
        where = f"step {plan.step_id}: worker rank {worker.rank} at {worker.address}"
        if why.code in _PLAN_REJECTED:
            raise InvariantViolation(
                f"{where} rejected the plan ({why.reason}): a manager bug, the plan does not fit the worker's cache; "
                "the step was rolled back and the worker stays registered")
        if why.code in _WORKER_BUSY:
            raise Unavailable(f"{where} took no new call ({why.reason}); the step was not applied: retry")
        self.unregister(worker.worker_id)
        raise Unavailable(f"{where} failed to execute the plan ({why.reason}); the step was not applied")

    def close(self) -> None:
        """Send no plan from now on, cancel the ExecutePlan calls in flight (their steps roll back:
        at shutdown no client waits for them any more) and close the channels."""
        with self._lock:
            self.closed = True
            records, self._by_rank = list(self._by_rank.values()), {}
            calls = [call for pending in self._inflight.values() for call in pending]
        for call in calls:
            call.cancel()
        for record in records:
            record.channel.close()


def _failure(call: grpc.Future) -> Optional[PlanFailure]:
    """Why a finished ExecutePlan call failed, or None when the worker acknowledged the plan."""
    try:
        call.result()
    except grpc.RpcError as exc:
        return PlanFailure(exc.code(), f"{exc.code().name}: {exc.details()}")
    except grpc.FutureCancelledError:
        return PlanFailure(None, "dropped: it missed its heartbeats")
    return None
