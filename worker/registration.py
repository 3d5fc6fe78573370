"""A worker's membership in the block manager: RegisterWorker once the worker serves, then a
daemon thread's heartbeats at the interval the manager asked for, registering again whenever the
manager answers that it forgot the worker (a restarted manager, or one that dropped it for missed
heartbeats). A failed heartbeat is logged and retried at the next beat; the thread ends at ``stop``,
or when the manager refuses to register the worker again with FAILED_PRECONDITION: what it refuses
(a cache a newer process of this rank superseded, a capacity below its pools, another block size)
is this process's for good, so asking again every beat would only be refused again.
"""

from __future__ import annotations

import logging
import threading
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


class ManagerRegistration:
    """``request`` builds the worker's RegisterWorkerRequest (asked anew at each registration);
    ``registered`` is called with the worker id the manager gave, after each registration."""

    def __init__(self, manager_address: str, credentials: Optional[auth.WorkerCredentials],
                 request: Callable[[], pb.RegisterWorkerRequest], registered: Callable[[str], None]) -> None:
        self.manager_address = manager_address
        self.credentials = credentials or auth.WorkerCredentials()
        self.worker_id = ""      # the manager's id for this worker; set by each registration
        self.interval = 0.0      # seconds between heartbeats, as the manager asked
        self._request = request
        self._registered = registered
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None

    def start(self) -> None:
        """Register (a refusal raises the manager's grpc.RpcError), then start the heartbeats."""
        self.register()
        self._heartbeat = threading.Thread(target=self._beat, name="kvpager-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop(self) -> None:
        """End the heartbeats (the thread exits at its next wake-up)."""
        self._stop.set()

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
