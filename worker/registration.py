"""A worker's membership in the block manager: RegisterWorker once the worker serves (asked again,
with backoff, for up to ``REGISTER_RETRY_S`` while the manager answers UNAVAILABLE or
DEADLINE_EXCEEDED: not listening yet, restarting, or busy with steps waiting on the workers; a
refusal ends the start at once), then a daemon thread's heartbeats at the interval the manager
asked for, registering again whenever the manager answers that it forgot the worker (a restarted
manager, or one that dropped it for missed heartbeats). A failed heartbeat is logged and retried
at the next beat; the thread ends at ``stop``, or when the manager refuses to register the worker
again with FAILED_PRECONDITION: what it refuses (a cache a newer process of this rank superseded,
a capacity below its pools, another block size) is this process's for good, so asking again
every beat would only be refused again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import grpc

from kvpager import auth
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc

log = logging.getLogger("kvpager.worker")

# The deadline of one RegisterWorker call. The manager reads it from the call (gRPC carries it) and
# stops waiting for its pending steps early enough to answer within it (``_until_no_tentative_step``
# in manager/registration.py), so the worker learns of every registration the manager makes. It
# must exceed the manager's own work on a registration (``REGISTRATION_WORK_S`` there), and the
# building of pools sized from this worker's capacity (``max_pool_blocks_from_workers``: a few
# seconds at most).
REGISTER_DEADLINE_S = 30.0

# How long a worker's start keeps asking a manager that answers RegisterWorker with a transient
# status (``_TRANSIENT``), and the first and longest wait between two attempts (doubling). It
# covers a manager started after its workers or restarting, and one whose steps wait on the
# workers for up to its plan timeout (30 s by default). An attempt under way when it ends still
# has its own deadline, so a start gives up within REGISTER_RETRY_S + REGISTER_DEADLINE_S.
REGISTER_RETRY_S = 120.0
REGISTER_BACKOFF_S = (0.5, 5.0)
# Nothing was registered and asking again may succeed; any other status is a refusal.
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class ManagerRegistration:
    """``request`` builds the worker's RegisterWorkerRequest (asked anew at each registration);
    ``registered`` is called with the worker id the manager gave, after each registration."""

    def __init__(self, manager_address: str, credentials: Optional[auth.WorkerCredentials],
                 request: Callable[[], pb.RegisterWorkerRequest], registered: Callable[[str], None],
                 retry_for: float = REGISTER_RETRY_S) -> None:
        self.manager_address = manager_address
        self.retry_for = retry_for   # seconds ``start`` asks again after transient failures
        self.credentials = credentials or auth.WorkerCredentials()
        self.worker_id = ""      # the manager's id for this worker; set by each registration
        self.interval = 0.0      # seconds between heartbeats, as the manager asked
        self._request = request
        self._registered = registered
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None

    def start(self) -> None:
        """Register, then start the heartbeats. A refusal raises the manager's grpc.RpcError at
        once; a transient failure does after ``retry_for`` seconds of asking again."""
        self._register_patiently()
        self._heartbeat = threading.Thread(target=self._beat, name="kvpager-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop(self) -> None:
        """End the heartbeats (the thread exits at its next wake-up)."""
        self._stop.set()

    def _register_patiently(self) -> None:
        """``register``, asked again with backoff while the manager fails it transiently, logging
        one line per wait."""
        give_up = time.monotonic() + self.retry_for
        wait = REGISTER_BACKOFF_S[0]
        while True:
            try:
                self.register()
                return
            except grpc.RpcError as exc:
                left = give_up - time.monotonic()
                if exc.code() not in _TRANSIENT or left <= 0:
                    raise
                pause = min(wait, left)
                log.warning("registering with the block manager at %s: %s: %s; asking again in %.1fs (for %.0fs more)",
                            self.manager_address, exc.code().name, exc.details(), pause, left)
                if self._stop.wait(pause):
                    raise
                wait = min(2 * wait, REGISTER_BACKOFF_S[1])

    def register(self) -> None:
        with self._channel() as channel:
            reply = pb_grpc.BlockManagerStub(channel).RegisterWorker(self._request(), timeout=REGISTER_DEADLINE_S)
        self.worker_id = reply.worker_id
        self.interval = reply.heartbeat_interval_s
        self._registered(self.worker_id)

    def _channel(self) -> grpc.Channel:
        """To the block manager: TLS and the worker token when the credentials have them."""
        return self.credentials.manager_channel(self.manager_address)

    def _beat(self) -> None:
        with self._channel() as channel:
            stub = pb_grpc.BlockManagerStub(channel)
            while not self._stop.wait(self.interval):
                try:
                    if not stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id), timeout=5).registered:
                        log.warning("the manager forgot worker %s; registering again", self.worker_id)
                        self.register()
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        log.error("the manager refused to register this worker again; it stops asking: %s",
                                  exc.details())
                        return
                    log.warning("heartbeat failed: %s", exc.code().name)
