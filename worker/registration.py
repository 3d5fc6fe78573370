"""A worker's membership in the block manager: RegisterWorker once the worker serves, then a
daemon thread's heartbeats at the interval the manager asked for, registering again whenever the
manager answers that it forgot the worker (a restarted manager, or one that dropped it for missed
heartbeats). A failed heartbeat is logged and retried at the next beat; the thread ends at ``stop``.
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
            reply = pb_grpc.BlockManagerStub(channel).RegisterWorker(self._request(), timeout=30)
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
                    log.warning("heartbeat failed: %s", exc.code().name)
