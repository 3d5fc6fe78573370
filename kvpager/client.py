"""A typed Python client for the block manager service.

Every method returns the RPC's protobuf response (typed by the generated .pyi stubs) or
raises the ``ManagerError`` subclass of the status code it got (``NotFound``,
``ResourceExhausted``, ``Unavailable``...). With ``retries > 0``, mutating calls get a
request id and are retried with the same id on UNAVAILABLE or DEADLINE_EXCEEDED, which the
server answers without applying anything twice.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterable, Optional, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpager.manager import errors
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc

_ERRORS = {cls.code: cls for cls in (
    errors.InvalidArgument, errors.NotFound, errors.AlreadyExists, errors.FailedPrecondition,
    errors.ResourceExhausted, errors.OutOfRange, errors.Aborted, errors.InvariantViolation,
    errors.Unavailable, errors.DeadlineExceeded,
)}
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_CODE_NAMES = {0: "OK", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 5: "NOT_FOUND", 6: "ALREADY_EXISTS",
               8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE",
               13: "INTERNAL", 14: "UNAVAILABLE"}


def error_for(code_name: str, message: str) -> errors.ManagerError:
    """The typed exception for a status code name (``ManagerError`` for unmapped codes)."""
    cls = _ERRORS.get(code_name)
    if cls is None:
        err = errors.ManagerError(message)
        err.code = code_name
        return err
    return cls(message)


def result_error(result: pb.OperationResult) -> Optional[errors.ManagerError]:
    """The typed exception a Step operation result carries, or None when it succeeded."""
    if result.code == 0:
        return None
    return error_for(_CODE_NAMES.get(result.code, "UNKNOWN"), result.message)


# ---- Step operations ----------------------------------------------------------------------------
def allocate_op(seq_id: str, token_ids: Sequence[int] = (), num_tokens: int = 0, namespace: str = "") -> pb.Operation:
    return pb.Operation(allocate=pb.AllocateRequest(seq_id=seq_id, token_ids=token_ids, num_tokens=num_tokens,
                                                    cache_namespace=namespace))


def append_op(seq_id: str, token_ids: Sequence[int] = (), num_tokens: int = 0) -> pb.Operation:
    return pb.Operation(append=pb.AppendRequest(seq_id=seq_id, token_ids=token_ids, num_tokens=num_tokens))


def append_batch_op(seq_ids: Sequence[str], token_ids: Sequence[int] = ()) -> pb.Operation:
    """One token to each sequence (a decode step); failures come back per sequence."""
    return pb.Operation(append_batch=pb.AppendBatchRequest(seq_ids=seq_ids, token_ids=token_ids))


def batch_failures(result: pb.OperationResult) -> list[tuple[int, errors.ManagerError]]:
    """(index, typed error) of each append of an append_batch result that failed."""
    r = result.append_batch
    return [(i, error_for(_CODE_NAMES.get(code, "UNKNOWN"), message))
            for i, code, message in zip(r.failed_indices, r.failed_codes, r.failed_messages)]


def fork_op(parent_seq_id: str, child_seq_id: str) -> pb.Operation:
    return pb.Operation(fork=pb.ForkRequest(parent_seq_id=parent_seq_id, child_seq_id=child_seq_id))


def free_op(seq_id: str) -> pb.Operation:
    return pb.Operation(free=pb.FreeRequest(seq_id=seq_id))


def swap_out_op(seq_ids: Iterable[str]) -> pb.Operation:
    return pb.Operation(swap_out=pb.SwapOutRequest(seq_ids=list(seq_ids)))


def swap_in_op(seq_ids: Iterable[str]) -> pb.Operation:
    return pb.Operation(swap_in=pb.SwapInRequest(seq_ids=list(seq_ids)))


class BlockManagerClient:
    def __init__(self, target: str, timeout: float = 10.0, retries: int = 0, retry_backoff: float = 0.05) -> None:
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.BlockManagerStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "BlockManagerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError as exc:
            raise errors.Unavailable(f"block manager at {self.target} not reachable within {timeout}s") from exc

    # ---- mutating calls ------------------------------------------------------------------------
    def allocate(self, seq_id: str, token_ids: Sequence[int] = (), num_tokens: int = 0, namespace: str = "",
                 request_id: Optional[str] = None) -> pb.AllocateResponse:
        return self._mutate(self.stub.Allocate, pb.AllocateRequest(
            seq_id=seq_id, token_ids=token_ids, num_tokens=num_tokens, cache_namespace=namespace), request_id)

    def append(self, seq_id: str, token_ids: Sequence[int] = (), num_tokens: int = 0,
               request_id: Optional[str] = None) -> pb.AppendResponse:
        return self._mutate(self.stub.Append, pb.AppendRequest(
            seq_id=seq_id, token_ids=token_ids, num_tokens=num_tokens), request_id)

    def fork(self, parent_seq_id: str, child_seq_id: str, request_id: Optional[str] = None) -> pb.ForkResponse:
        return self._mutate(self.stub.Fork, pb.ForkRequest(
            parent_seq_id=parent_seq_id, child_seq_id=child_seq_id), request_id)

    def free(self, seq_id: str, request_id: Optional[str] = None) -> pb.FreeResponse:
        return self._mutate(self.stub.Free, pb.FreeRequest(seq_id=seq_id), request_id)

    def swap_out(self, seq_ids: Iterable[str], request_id: Optional[str] = None) -> pb.SwapOutResponse:
        return self._mutate(self.stub.SwapOut, pb.SwapOutRequest(seq_ids=list(seq_ids)), request_id)

    def swap_in(self, seq_ids: Iterable[str], request_id: Optional[str] = None) -> pb.SwapInResponse:
        return self._mutate(self.stub.SwapIn, pb.SwapInRequest(seq_ids=list(seq_ids)), request_id)

    def step(self, operations: Iterable[pb.Operation], all_or_nothing: bool = False,
             request_id: Optional[str] = None) -> pb.StepResponse:
        """One scheduler iteration. Per-operation failures are in ``results`` (see ``result_error``)."""
        return self._mutate(self.stub.Step, pb.StepRequest(
            operations=list(operations), all_or_nothing=all_or_nothing), request_id)

    # ---- queries ---------------------------------------------------------------------------------
    def get_block_table(self, seq_id: str) -> pb.GetBlockTableResponse:
        return self._call(self.stub.GetBlockTable, pb.GetBlockTableRequest(seq_id=seq_id))

    def get_stats(self) -> pb.GetStatsResponse:
        return self._call(self.stub.GetStats, pb.GetStatsRequest())

    def ping(self) -> pb.PingResponse:
        return self._call(self.stub.Ping, pb.PingRequest())

    def health(self, service: str = "") -> str:
        """SERVING, NOT_SERVING or SERVICE_UNKNOWN."""
        reply = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # ---- plumbing --------------------------------------------------------------------------------
    def _mutate(self, method, request, request_id: Optional[str]):
        if request_id is None and self.retries > 0:
            request_id = uuid.uuid4().hex
        if request_id:
            request.request_id = request_id
        attempts = 1 + (self.retries if request_id else 0)
        for attempt in range(attempts):
            try:
                return self._call(method, request)
            except (errors.Unavailable, errors.DeadlineExceeded):
                if attempt + 1 == attempts:
                    raise
                time.sleep(self.retry_backoff * (2 ** attempt))
        raise AssertionError("unreachable")

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            raise error_for(code.name if code else "UNKNOWN", exc.details() or "") from exc
