"""A typed Python client for the block manager service.

Every method returns the RPC's protobuf response (typed by the generated .pyi stubs) or
raises the ``ManagerError`` subclass of the status code it got (``NotFound``,
``ResourceExhausted``, ``Unavailable``...). Every mutating call carries a request id (a
fresh uuid4 unless the caller gives one) and is retried with the same id, up to ``retries``
times with jittered exponential backoff, on UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED: the
call may have been applied although its answer was lost, and the server answers a retry with
the first answer, applying nothing twice. An error that outlives the retries (``Unavailable``,
``DeadlineExceeded``, ``Cancelled``) does not say whether the call was applied: retry it later
with the same ``request_id`` (within the server's ``--request-cache-ttl``) to find out.
The retries are ours, not gRPC's ``retryPolicy``: that one spends one deadline on all attempts
and never retries the client's own DEADLINE_EXCEEDED, the very case (a slow step whose answer
the caller stopped waiting for) where a retry with a fresh deadline gets the first answer.
A value protobuf cannot encode (a str with a lone surrogate, which UTF-8 cannot carry; an
integer beyond its field's range) or a token that cannot be a header raises ``InvalidArgument``
naming the field before anything is sent, as the manager answers a bad request.
"""

from __future__ import annotations

import random
import time
import uuid
import os
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar, Union

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvpager import auth, errors, status
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc

_RETRYABLE = (errors.Unavailable, errors.DeadlineExceeded, errors.Cancelled)  # the answer may have been lost
_MAX_BACKOFF = 2.0  # seconds, the longest wait between two attempts
R = TypeVar("R")  # a response message type
M = TypeVar("M", bound=Message)  # a request message type
PemSource = Union[str, bytes, os.PathLike[str], None]  # PEM bytes, a file path, or none


def error_for(code_name: str, message: str) -> errors.ManagerError:
    """The typed exception for a status code name, its ``code`` that name (``ManagerError`` for
    codes the manager's table does not list: kvpager/status.py)."""
    return status.error_for(code_name, message)


def result_error(result: pb.OperationResult) -> Optional[errors.ManagerError]:
    """The typed exception a Step operation result carries, or None when it succeeded."""
    if result.code == 0:
        return None
    return error_for(status.NAMES.get(result.code, "UNKNOWN"), result.message)


def rpc_error(exc: grpc.RpcError) -> errors.ManagerError:
    """The typed exception of a failed call; RESOURCE_EXHAUSTED carries the blocks needed and
    free (and their tier) from the status details when the manager sent them."""
    code = exc.code()
    err = error_for(code.name if code else "UNKNOWN", exc.details() or "")
    if isinstance(err, errors.ResourceExhausted):
        try:
            details = rpc_status.from_call(exc)
        except ValueError:  # a status whose details disagree with its code: keep the plain error
            details = None
        for packed in details.details if details is not None else ():
            info = error_details_pb2.ErrorInfo()
            if packed.Unpack(info) and info.reason == "NOT_ENOUGH_BLOCKS":
                err.needed, err.free = int(info.metadata["needed"]), int(info.metadata["free"])
                err.tier = info.metadata.get("tier", "gpu")
    return err


# ---- requests ---------------------------------------------------------------------------------------
def unsendable(field: str, value: object, err: ValueError) -> errors.InvalidArgument:
    """The error for a value protobuf cannot encode into ``field``: a str holding a lone surrogate
    ("a\\ud800": Python allows it, UTF-8 does not), an integer beyond its field's range."""
    shown = errors.quote(value) if isinstance(value, str) else repr(value)
    why = (f"a lone surrogate at index {err.start}, which UTF-8 cannot encode" if isinstance(err, UnicodeEncodeError)
           else str(err))
    return errors.InvalidArgument(f"{field} {shown} cannot be sent: {why}")


def build(message_type: type[M], **fields: Any) -> M:
    """``message_type(**fields)``; a value it cannot encode raises InvalidArgument naming the field
    (and the index in a list), as the manager answers a bad request, before anything is sent."""
    try:
        built: M = message_type(**fields)  # protobuf's constructors are untyped
        return built
    except ValueError as err:  # UnicodeEncodeError is one
        for name, value in fields.items():
            items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
            for i, item in items:
                try:
                    message_type(**{name: item if i is None else [item]})
                except ValueError as cause:
                    raise unsendable(name if i is None else f"{name}[{i}]", item, cause) from None
        raise errors.InvalidArgument(f"{message_type.__name__} cannot be sent: {err}") from None


def check_token(token: Optional[str]) -> None:
    """Refuse a bearer token that cannot travel in the authorization header, whose value gRPC
    takes in printable ASCII only (else every call fails, as an encoding error or an "Invalid
    metadata" status); the message names the character's index, never the secret."""
    bad = auth.unsendable_index(token or "")
    if bad is not None:
        raise errors.InvalidArgument(f"token cannot be sent: its character at index {bad} is not printable ASCII, "
                                     "which a bearer token in the authorization header must be")


# ---- Step operations ----------------------------------------------------------------------------
def allocate_op(seq_id: str, token_ids: Sequence[int] = (), num_tokens: int = 0, namespace: str = "") -> pb.Operation:
    return pb.Operation(allocate=build(pb.AllocateRequest, seq_id=seq_id, token_ids=token_ids, num_tokens=num_tokens,
                                       cache_namespace=namespace))


def append_op(seq_id: str, token_ids: Sequence[int] = (), num_tokens: int = 0) -> pb.Operation:
    return pb.Operation(append=build(pb.AppendRequest, seq_id=seq_id, token_ids=token_ids, num_tokens=num_tokens))


def append_batch_op(seq_ids: Sequence[str], token_ids: Sequence[int] = ()) -> pb.Operation:
    """One token to each sequence (a decode step); failures come back per sequence."""
    return pb.Operation(append_batch=build(pb.AppendBatchRequest, seq_ids=seq_ids, token_ids=token_ids))


def batch_failures(result: pb.OperationResult) -> list[tuple[int, errors.ManagerError]]:
    """(index, typed error) of each append of an append_batch result that failed."""
    r = result.append_batch
    return [(i, error_for(status.NAMES.get(code, "UNKNOWN"), message))
            for i, code, message in zip(r.failed_indices, r.failed_codes, r.failed_messages)]


def fork_op(parent_seq_id: str, child_seq_id: str) -> pb.Operation:
    return pb.Operation(fork=build(pb.ForkRequest, parent_seq_id=parent_seq_id, child_seq_id=child_seq_id))


def free_op(seq_id: str) -> pb.Operation:
    return pb.Operation(free=build(pb.FreeRequest, seq_id=seq_id))


def swap_out_op(seq_ids: Iterable[str]) -> pb.Operation:
    return pb.Operation(swap_out=build(pb.SwapOutRequest, seq_ids=list(seq_ids)))


def swap_in_op(seq_ids: Iterable[str]) -> pb.Operation:
    return pb.Operation(swap_in=build(pb.SwapInRequest, seq_ids=list(seq_ids)))


class BlockManagerClient:
    def __init__(self, target: str, timeout: float = 10.0, retries: int = 3, retry_backoff: float = 0.05, *,
                 token: Optional[str] = None, root_certificates: PemSource = None,
                 certificate_chain: PemSource = None, private_key: PemSource = None) -> None:
        """``token``: sent as ``authorization: Bearer TOKEN`` on every call. ``root_certificates``
        (PEM bytes or a file path): use TLS, verifying the manager with this CA;
        ``certificate_chain``/``private_key`` (PEM bytes or paths): a client certificate for
        mutual TLS. Neither: plaintext, no token (docs/security.md)."""
        check_token(token)
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        from kvpager import auth

        self.channel = auth.raw_channel(target, auth.read_bytes(root_certificates, "CA certificate"),
                                        auth.read_bytes(certificate_chain, "client certificate"),
                                        auth.read_bytes(private_key, "client key"))
        calls = auth.with_token(self.channel, token)
        self.stub = pb_grpc.BlockManagerStub(calls)
        self._health = health_pb2_grpc.HealthStub(calls)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "BlockManagerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError as exc:
            raise errors.Unavailable(f"block manager at {self.target} not reachable within {timeout}s") from exc

    # ---- mutating calls ------------------------------------------------------------------------
    def allocate(self, seq_id: str, token_ids: Sequence[int] = (), num_tokens: int = 0, namespace: str = "",
                 request_id: Optional[str] = None) -> pb.AllocateResponse:
        return self._mutate(self.stub.Allocate, pb.AllocateResponse, build(
            pb.AllocateRequest, seq_id=seq_id, token_ids=token_ids, num_tokens=num_tokens, cache_namespace=namespace),
            request_id)

    def append(self, seq_id: str, token_ids: Sequence[int] = (), num_tokens: int = 0,
               request_id: Optional[str] = None) -> pb.AppendResponse:
        return self._mutate(self.stub.Append, pb.AppendResponse, build(
            pb.AppendRequest, seq_id=seq_id, token_ids=token_ids, num_tokens=num_tokens), request_id)

    def fork(self, parent_seq_id: str, child_seq_id: str, request_id: Optional[str] = None) -> pb.ForkResponse:
        return self._mutate(self.stub.Fork, pb.ForkResponse, build(
            pb.ForkRequest, parent_seq_id=parent_seq_id, child_seq_id=child_seq_id), request_id)

    def free(self, seq_id: str, request_id: Optional[str] = None) -> pb.FreeResponse:
        return self._mutate(self.stub.Free, pb.FreeResponse, build(pb.FreeRequest, seq_id=seq_id), request_id)

    def swap_out(self, seq_ids: Iterable[str], request_id: Optional[str] = None) -> pb.SwapOutResponse:
        return self._mutate(self.stub.SwapOut, pb.SwapOutResponse, build(pb.SwapOutRequest, seq_ids=list(seq_ids)),
                            request_id)

    def swap_in(self, seq_ids: Iterable[str], request_id: Optional[str] = None) -> pb.SwapInResponse:
        return self._mutate(self.stub.SwapIn, pb.SwapInResponse, build(pb.SwapInRequest, seq_ids=list(seq_ids)),
                            request_id)

    def step(self, operations: Iterable[pb.Operation], all_or_nothing: bool = False,
             request_id: Optional[str] = None,
             table_layout: pb.TableLayout = pb.TABLE_LAYOUT_BOTH) -> pb.StepResponse:
        """One scheduler iteration. Per-operation failures are in ``results`` (see ``result_error``).
        ``table_layout``: the block-table forms the answer's batch carries (``TABLE_LAYOUT_PADDED``,
        ``_CSR``, ``_NONE``, ``_PADDED_PACKED``; default both): each costs time in proportion to its
        entries at every step, on both sides of the wire, so ask only for the one the kernels read
        (``PADDED_PACKED``, raw int32 bytes, is the cheapest; ``kvpager.step.unpack_int32`` reads it)."""
        return self._mutate(self.stub.Step, pb.StepResponse, pb.StepRequest(
            operations=list(operations), all_or_nothing=all_or_nothing, table_layout=table_layout), request_id)

    # ---- queries ---------------------------------------------------------------------------------
    def get_block_table(self, seq_id: str) -> pb.GetBlockTableResponse:
        return self._call(self.stub.GetBlockTable, build(pb.GetBlockTableRequest, seq_id=seq_id),
                          pb.GetBlockTableResponse)

    def get_stats(self) -> pb.GetStatsResponse:
        return self._call(self.stub.GetStats, pb.GetStatsRequest(), pb.GetStatsResponse)

    def ping(self) -> pb.PingResponse:
        return self._call(self.stub.Ping, pb.PingRequest(), pb.PingResponse)

    def health(self, service: str = "") -> str:
        """SERVING, NOT_SERVING or SERVICE_UNKNOWN."""
        reply = self._call(self._health.Check, build(health_pb2.HealthCheckRequest, service=service),
                           health_pb2.HealthCheckResponse)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def health_epoch(self, service: str = "") -> tuple[str, int]:
        """(health status, worker epoch): the epoch counts the times the workers' caches were
        lost (a replaced group); a manager that sends none gives 0."""
        reply, call = self._call(self._health.Check.with_call, build(health_pb2.HealthCheckRequest, service=service),
                                 tuple)
        epoch = dict(call.initial_metadata()).get("kvpager-epoch", "0")
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)), int(epoch)

    # ---- plumbing --------------------------------------------------------------------------------
    def _mutate(self, method: Callable[..., object], reply_type: type[R], request: Message,
                request_id: Optional[str]) -> R:
        """Send a mutating request with a request id (``request_id``, or a new uuid4); retry it
        with the same id when its answer may have been lost. An empty ``request_id`` ("") sends
        none and never retries."""
        if request_id is None:
            request_id = uuid.uuid4().hex
        if request_id:
            try:
                request.request_id = request_id
            except ValueError as err:
                raise unsendable("request_id", request_id, err) from None
        attempts = 1 + (max(0, self.retries) if request_id else 0)
        for attempt in range(attempts):
            try:
                return self._call(method, request, reply_type)
            except _RETRYABLE:
                if attempt + 1 == attempts:
                    raise
                # Jittered (half to all of the exponential wait): clients that failed together
                # do not retry together.
                time.sleep(random.uniform(0.5, 1.0) * min(_MAX_BACKOFF, self.retry_backoff * (2 ** attempt)))
        raise AssertionError("unreachable")

    def _call(self, method: Callable[..., object], request: Message, reply_type: type[R]) -> R:
        """One attempt of ``method``; its reply (of ``reply_type``) or its status's typed error."""
        try:
            reply = method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise rpc_error(exc) from exc
        if not isinstance(reply, reply_type):
            raise errors.InvariantViolation(f"{reply_type.__name__} expected, got {type(reply).__name__}")
        return reply
