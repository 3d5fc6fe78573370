"""The standard gRPC health service, with the worker epoch in every answer.

``grpc.health.v1.Health/Check`` answers a status only. Which worker caches hold the manager's
state (the epoch of ``manager/epochs.py``: how many times they were lost) matters to whoever
watches health, so each Check answer carries it as initial metadata ``kvpager-epoch``: a
replaced worker group shows in health, not only in GetStats. The statuses are set by the
service (``_update_health`` in ``manager/registration.py``).
"""

from __future__ import annotations

from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2

EPOCH_METADATA = "kvpager-epoch"


class HealthService(health.HealthServicer):  # type: ignore[misc]  # grpc_health ships no types
    def __init__(self) -> None:
        super().__init__()
        self.epoch: Callable[[], int] = lambda: 0   # the service sets it once its caches exist

    def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - the gRPC method's name
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        context.send_initial_metadata(((EPOCH_METADATA, str(self.epoch())),))
        return super().Check(request, context)
