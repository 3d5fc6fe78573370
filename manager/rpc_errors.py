"""Where the manager's answers become gRPC replies: the one place a domain error becomes a status.

``reply`` sends an ``Answer``'s response, or aborts the call with its error's status (the code
from the one table, ``kvpager/status.py``; no room now also carries the blocks needed and free
as a ``google.rpc.ErrorInfo`` detail). ``MalformedRequestInterceptor`` sends requests that do
not parse through the same ``reply``.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Optional, TypeVar

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvpager.errors import InvalidArgument, InvariantViolation, ManagerError, ResourceExhausted
from kvpager.status import NUMBERS, status_of
from .request_cache import Answer

NOT_ENOUGH_BLOCKS = "NOT_ENOUGH_BLOCKS"  # ErrorInfo.reason of a RESOURCE_EXHAUSTED answer
R = TypeVar("R")  # a response message type


def status_message(err: ManagerError) -> status_pb2.Status:
    """The google.rpc.Status of a domain error."""
    status = status_pb2.Status(code=NUMBERS[status_of(err)], message=str(err))
    if isinstance(err, ResourceExhausted) and err.needed is not None:
        status.details.add().Pack(error_details_pb2.ErrorInfo(
            reason=NOT_ENOUGH_BLOCKS, domain="kvpager.v1",
            metadata={"needed": str(err.needed), "free": str(err.free), "tier": err.tier}))
    return status


def abort(err: ManagerError, context: grpc.ServicerContext) -> NoReturn:
    """End the call with the error's status (``abort_with_status`` raises)."""
    context.abort_with_status(rpc_status.to_status(status_message(err)))
    raise InvariantViolation("grpc's abort_with_status returned")  # it never does


def reply(answer: Answer, context: grpc.ServicerContext, reply_type: type[R]) -> R:
    """The response (of ``reply_type``), or the call aborted with the error's status."""
    if answer.error is not None:
        abort(answer.error, context)
    response = answer.response
    if not isinstance(response, reply_type):
        raise InvariantViolation(f"an answer of {type(response).__name__}, not {reply_type.__name__}")
    return response


class Malformed:
    """What a request that is not a valid message becomes (``MalformedRequestInterceptor``)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class MalformedRequestInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc has no type stubs here
    """Bytes that do not parse as the method's request (bad UTF-8 in a string field included)
    are answered INVALID_ARGUMENT through ``reply`` (gRPC itself would answer INTERNAL,
    "Exception deserializing request")."""

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Optional[grpc.RpcMethodHandler]],
                          handler_call_details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler]:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary
        method = handler_call_details.method.rsplit("/", 1)[-1]

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # protobuf's DecodeError, or whatever a parser raises
                return Malformed(f"{method}: the request is not a valid message ({type(exc).__name__}: "
                                 f"{str(exc)[:200]})")

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                abort(InvalidArgument(request.reason), context)
            return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=deserialize, response_serializer=handler.response_serializer)
