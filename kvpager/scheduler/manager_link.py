"""The scheduler's Step RPCs through a manager that restarts or loses its workers.

A manager restarted with ``--state-dir`` recovers its state (docs/durability.md): a Step it
could not be reached for is sent again with the same request id, so that it is applied once and
answered once. A manager that answers pings but not the Step (its workers are gone) is the
scheduler's to recover from: the UNAVAILABLE is raised, and ``wait_until_serving`` waits for
workers to come back.
"""

from __future__ import annotations

import time
import uuid

from kvpager import client as C
from kvpager import errors
from kvpager.v1 import block_manager_pb2 as pb


class ManagerLink:
    """Step and health calls to one manager (``client``), retried through its restarts."""

    def __init__(self, client: C.BlockManagerClient) -> None:
        self.client = client

    def step(self, ops: list[pb.Operation], timeout: float) -> pb.StepResponse:
        """The Step RPC with one request id, asking for the packed padded tables (all that
        ``StepInput`` reads). While the manager cannot be reached it is sent again with the same
        id, until ``timeout`` seconds have passed; an UNAVAILABLE from a manager that answers
        pings (its workers are gone) is raised at once."""
        request_id = uuid.uuid4().hex
        deadline = time.monotonic() + timeout
        answered = False  # the manager answered a ping since the last failed attempt
        while True:
            try:
                return self.client.step(ops, request_id=request_id, table_layout=pb.TABLE_LAYOUT_PADDED_PACKED)
            except (errors.Unavailable, errors.DeadlineExceeded, errors.Cancelled):
                if answered or time.monotonic() > deadline:
                    raise
            answered = self._wait_for_manager(deadline)

    def wait_until_serving(self, timeout: float) -> None:
        """Until the manager's health is SERVING (its workers registered again); UNAVAILABLE after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._health() != "SERVING":
            if time.monotonic() > deadline:
                raise errors.Unavailable(f"the manager's workers did not come back within {timeout} s")
            time.sleep(0.1)

    def _wait_for_manager(self, deadline: float) -> bool:
        """Ping the manager with backoff until it answers (True) or ``deadline`` passes (False)."""
        delay = 0.05
        while True:
            try:
                self.client.ping()
                return True
            except errors.ManagerError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def _health(self) -> str:
        try:
            return self.client.health()
        except errors.ManagerError:  # the manager is restarting: not serving yet
            return "UNREACHABLE"
