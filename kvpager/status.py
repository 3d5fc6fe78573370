"""The one table from the manager's errors to gRPC status codes.

Domain errors (``kvpager/errors.py``) say what went wrong, not how it travels; this table says
which status each one is answered with, by name (the service's ``grpc.StatusCode[...]``, metric
labels, the write-ahead log) and by number (``google.rpc.Code``: the per-operation results inside
a Step). The client maps statuses back to the same classes through it (``error_for``). Pure data:
no grpc import, so the manager's core and the log can use it.
"""

from __future__ import annotations

from .errors import (
    Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument,
    InvariantViolation, ManagerError, NotFound, OutOfRange, ResourceExhausted, Unavailable,
)

# google.rpc.Code: name -> number
NUMBERS = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9, "ABORTED": 10,
    "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
NAMES = {number: name for name, number in NUMBERS.items()}

# Each error class and the status it is answered with (a subclass answers as its nearest listed base).
STATUS: dict[type[ManagerError], str] = {
    InvalidArgument: "INVALID_ARGUMENT",
    NotFound: "NOT_FOUND",
    AlreadyExists: "ALREADY_EXISTS",
    FailedPrecondition: "FAILED_PRECONDITION",
    ResourceExhausted: "RESOURCE_EXHAUSTED",
    OutOfRange: "OUT_OF_RANGE",
    Aborted: "ABORTED",
    InvariantViolation: "INTERNAL",
    Unavailable: "UNAVAILABLE",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    Cancelled: "CANCELLED",
    DataLoss: "DATA_LOSS",
}
_BY_NAME = {name: cls for cls, name in STATUS.items()}


def status_of(err: BaseException) -> str:
    """The status name ``err`` is answered with: by its class (its nearest listed base), or the
    status it arrived with (an error the client made from an answer). O(depth of its class)."""
    for cls in type(err).__mro__:
        name = STATUS.get(cls)
        if name is not None:
            return name
    return getattr(err, "code", None) or "UNKNOWN"


def number_of(err: BaseException) -> int:
    """The google.rpc.Code number ``err`` is answered with."""
    return NUMBERS.get(status_of(err), NUMBERS["UNKNOWN"])


def error_for(name: str, message: str) -> ManagerError:
    """The error of a status name, as a typed exception whose ``code`` is that name (the client's
    view: ``except NotFound`` or ``err.code == "NOT_FOUND"``). Unlisted statuses (UNAUTHENTICATED,
    PERMISSION_DENIED...) give a plain ``ManagerError``."""
    err = _BY_NAME.get(name, ManagerError)(message)
    err.code = name  # type: ignore[attr-defined]
    return err
