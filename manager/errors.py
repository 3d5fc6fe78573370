"""Typed errors of the block manager.

Each class names the gRPC status it maps to (as a string, so this module needs no grpc);
the one mapping to real status codes lives in ``kvpager.manager.service``. Three kinds are
kept apart: *no room now* (``ResourceExhausted``, a normal outcome the scheduler acts on),
*a bad request* (the others), and *a broken invariant* (``InvariantViolation``, a bug).
"""

from __future__ import annotations


class ManagerError(Exception):
    """Base of every error the manager raises on purpose; ``code`` is a gRPC status name."""

    code = "UNKNOWN"


class InvalidArgument(ManagerError):
    code = "INVALID_ARGUMENT"


class NotFound(ManagerError):
    code = "NOT_FOUND"


class AlreadyExists(ManagerError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(ManagerError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(ManagerError):
    """No room now; the same request may succeed after sequences are freed or swapped out."""

    code = "RESOURCE_EXHAUSTED"


class OutOfRange(ManagerError):
    """The request can never fit the pool as configured."""

    code = "OUT_OF_RANGE"


class Aborted(ManagerError):
    """Not applied because another operation of an all-or-nothing step failed."""

    code = "ABORTED"


class InvariantViolation(ManagerError):
    """Manager state is inconsistent: a bug, never the caller's fault."""

    code = "INTERNAL"


class Unavailable(ManagerError):
    """A service (the manager, or a worker it needs) cannot be reached now; retrying may help."""

    code = "UNAVAILABLE"


class Busy(Unavailable):
    """A sequence the call names belongs to a step whose plan the workers have not answered yet
    (a tentative step, ``manager/tentative.py``); nothing was applied. The service waits for that
    step and runs the call again; ``step`` is the step to wait for."""

    def __init__(self, message: str, step: object = None) -> None:
        super().__init__(message)
        self.step = step


class DeadlineExceeded(ManagerError):
    code = "DEADLINE_EXCEEDED"


class DataLoss(ManagerError):
    """The sequence's K/V is gone (the worker group that held it was replaced): free it and
    recompute it. Every operation on it but Free answers this until it is freed."""

    code = "DATA_LOSS"


QUOTE_LIMIT = 64  # characters of an id quoted in a message; the rest is only counted


def quote(value: str, limit: int = QUOTE_LIMIT) -> str:
    """An id (or any caller-given string) as error messages show it: ``repr`` of at most
    ``limit`` characters, then how long it really is, so that an oversized id never makes
    an oversized message (messages are kept in answers and in the request-id cache)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}…({len(value)} chars)"


class Cancelled(ManagerError):
    """The call was cancelled before its answer arrived; it may have been applied: retry it with
    the same request id to learn its answer."""

    code = "CANCELLED"
