"""Workers joining the manager: registration, the heartbeat monitor, and the health it implies.

A mixin of ``BlockManagerService`` (``manager/service.py``), which owns the state named in the
class body. A registration is checked against the pools before the registry changes (a refusal
leaves no trace); the last rank of a manager without pools sizes them from the workers'
capacity; a rank that comes back with another cache id loses every sequence (a new epoch,
``manager/epochs.py``), and a replaced rank without cache ids forgets the prefix cache's
contents. It waits until no step is tentative first, since no pending step could be undone
across those changes, but never past the worker's own deadline on the call (gRPC carries it):
it gives up ``REGISTRATION_WORK_S`` before it (half the time left, when less), UNAVAILABLE with nothing registered, so that a
worker learns of every registration the manager makes (``worker/registration.py`` sets that
deadline). Health is SERVING unless workers registered and a rank is missing (the
BlockManager service also NOT_SERVING while no pool exists or recovered state waits for its
workers).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from grpc_health.v1 import health_pb2

from kvpager.errors import FailedPrecondition, InvalidArgument, ManagerError, Unavailable, quote
from kvpager.v1 import block_manager_pb2 as pb
from .block_manager import BlockManager
from .config import ManagerConfig
from .epochs import WorkerCaches, holds_state
from .health import HealthService
from .plan import ExecutionPlan
from .state_lock import StateLock
from .workers import WorkerRegistry

if TYPE_CHECKING:
    from .recovery import Durability

log = logging.getLogger("kvpager.manager")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name

# Seconds a registration keeps, of its caller's deadline, for its own work after waiting for the
# tentative steps: the registry and epochs, ``lose_all`` when a rank's cache was lost, the log's
# fsync. ``lose_all`` over a full pool of 2M blocks (32K sequences) took 4.1 s on a busy 2-core
# machine; pools are built only where no step can be tentative (no pool existed yet). A caller
# whose deadline leaves less than twice this keeps half of what is left (it still waits a while).
REGISTRATION_WORK_S = 5.0


class WorkerRegistration:
    # Owned by the service (set in its __init__); read and changed here under the state lock.
    config: ManagerConfig
    manager: Optional[BlockManager]
    registry: WorkerRegistry
    caches: WorkerCaches
    durable: Optional[Durability]
    health: Optional[HealthService]
    state: StateLock
    awaiting_workers: bool
    _stop: threading.Event
    _monitor: Optional[threading.Thread]

    _dispatch: Callable[[ExecutionPlan], None]  # the service's method: sends a plan to the workers

    def _register(self, request: pb.RegisterWorkerRequest,
                  deadline: Optional[float] = None) -> pb.RegisterWorkerResponse:
        """``deadline``: the caller's, on time.monotonic()'s clock (None: it gave none)."""
        try:
            return self._admit_worker(request, deadline)
        except ManagerError as err:  # one line for the operator; the worker gets the status
            log.warning("refused the worker at %s (rank %d): %s", quote(request.address), request.rank, err)
            raise

    def _admit_worker(self, request: pb.RegisterWorkerRequest,
                      deadline: Optional[float]) -> pb.RegisterWorkerResponse:
        self._until_no_tentative_step("RegisterWorker", deadline)
        if self.manager is not None:  # checked before the registry changes: a refusal leaves no trace
            gpu, cpu = self.manager.gpu.num_blocks, self.manager.cpu.num_blocks
            if request.num_gpu_blocks < gpu or request.num_cpu_blocks < cpu:
                raise FailedPrecondition(
                    f"register worker: capacity {request.num_gpu_blocks} GPU / {request.num_cpu_blocks} CPU blocks is "
                    f"below the manager's pools ({gpu} / {cpu}): give the workers more (--num-gpu-blocks, "
                    "--num-cpu-blocks) or the manager less")
        else:  # the pools will be sized from the workers' capacity: bounded before anything is built
            limit = self.config.max_pool_blocks_from_workers
            if request.num_gpu_blocks > limit or request.num_cpu_blocks > limit:
                raise InvalidArgument(
                    f"register worker: capacity {request.num_gpu_blocks} GPU / {request.num_cpu_blocks} CPU blocks is "
                    f"above the {limit} blocks per pool a manager sizes from its workers "
                    "(--max-pool-blocks-from-workers): start the workers with fewer (--num-gpu-blocks, "
                    "--num-cpu-blocks) or give the manager its pool sizes")
        self.caches.check(request.rank, request.cache_id)   # a superseded cache (epochs.py): refused here too
        replacing = request.rank in self.registry.ranks_seen
        record = self.registry.register(request)
        if self.manager is None and self.registry.complete():
            gpu, cpu = self.registry.capacity()
            self.manager = BlockManager(dataclasses.replace(self.config, num_gpu_blocks=gpu, num_cpu_blocks=cpu))
            log.info("pools sized from the workers: %d GPU and %d CPU blocks", gpu, cpu)
        cache_lost = self.caches.register(record.rank, request.cache_id, holds_state(self.manager))  # epochs.py
        if self.durable is not None and request.cache_id:
            self.durable.event("worker_cache", record.rank, request.cache_id)
        manager = self.manager
        if manager is not None:
            manager.dispatch = self._dispatch
            if cache_lost:
                lost = manager.lose_all(self.caches.epoch)
                log.warning("rank %d came back with another cache (a replaced worker): epoch %d, %d sequences lost "
                            "(DATA_LOSS until freed), prefix cache cleared", record.rank, self.caches.epoch, lost)
            elif replacing and not request.cache_id:
                # The replaced worker's cache contents are gone: no prefix may be served from them.
                # (Running sequences lost their K/V on that rank; their scheduler must recompute them.)
                manager.gpu.forget_contents()
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
            num_gpu_blocks=manager.gpu.num_blocks if manager else 0,
            num_cpu_blocks=manager.cpu.num_blocks if manager else 0)

    def _until_no_tentative_step(self, method: str, deadline: Optional[float] = None) -> None:
        """Wait until no step waits on the workers (a registration may forget the caches' contents
        or lose every sequence, which no pending step could be undone across): at most the state
        lock's ``wait_limit``, and until ``REGISTRATION_WORK_S`` (or half the time left, if less)
        before ``deadline`` (the caller's)."""
        manager = self.manager
        if manager is None or not manager.tentative:
            return
        limit = self.state.wait_limit
        if deadline is not None:   # keep REGISTRATION_WORK_S of it for the work, or half of a shorter one
            left = deadline - time.monotonic()
            limit = min(limit, left - min(REGISTRATION_WORK_S, left / 2))
        if not self.state.wait_until(lambda: not manager.tentative, limit):
            bound = " (all that the caller's deadline allows)" if limit < self.state.wait_limit else ""
            raise Unavailable(f"{method}: {len(manager.tentative)} steps still wait on the workers after "
                              f"{max(limit, 0.0):.1f}s{bound}; nothing was registered: try again")

    def worker_targets(self) -> list[dict[str, object]]:
        """The registered workers' metrics endpoints, as a Prometheus HTTP SD document. Labelled by
        rank only: a target label lands on every series of the target, and a new worker id at each
        registration would start a new set of series per restart of a rank. The id is a ``__meta_``
        label, which Prometheus shows on its targets page and drops after relabeling."""
        return [{"targets": [w.metrics_address],
                 "labels": {"rank": str(w.rank), "__meta_kvpager_worker_id": w.worker_id}}
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
