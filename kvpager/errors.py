"""Typed errors of the block manager.

The errors say what went wrong; which gRPC status each is answered with is the one table in
``kvpager/status.py``. Three kinds are kept apart: *no room now* (``ResourceExhausted``, a
normal outcome the scheduler acts on), *a bad request* (the others), and *a broken invariant*
(``InvariantViolation``, a bug).
"""

from __future__ import annotations

from typing import Optional, Protocol


class ManagerError(Exception):
    """Base of every error the manager raises on purpose."""


class InvalidArgument(ManagerError):
    """The request is malformed or asks for something impossible as given."""


class NotFound(ManagerError):
    """No such sequence (or it belongs to another tenant)."""


class AlreadyExists(ManagerError):
    """The id is taken."""


class FailedPrecondition(ManagerError):
    """Not now in this state (e.g. append to a swapped-out sequence)."""


class ResourceExhausted(ManagerError):
    """No room now; the same request may succeed after sequences are freed or swapped out.
    ``needed`` and ``free`` (blocks of ``tier``), when known, travel as structured details of
    the status (google.rpc.ErrorInfo), so a caller need not parse the message."""

    def __init__(self, message: str, needed: int | None = None, free: int | None = None, tier: str = "gpu") -> None:
        super().__init__(message)
        self.needed, self.free, self.tier = needed, free, tier


class OutOfRange(ManagerError):
    """The request can never fit the pool as configured."""


class Aborted(ManagerError):
    """Not applied because another operation of an all-or-nothing step failed."""


class InvariantViolation(ManagerError):
    """Manager state is inconsistent: a bug, never the caller's fault."""


class Unavailable(ManagerError):
    """A service (the manager, or a worker it needs) cannot be reached now; retrying may help."""


class PendingStep(Protocol):
    """What ``Busy`` names: a step that says when it has finished (``manager/tentative.py``)."""

    @property
    def finished(self) -> bool: ...


class Busy(Unavailable):
    """A sequence the call names belongs to a step whose plan the workers have not answered yet
    (a tentative step, ``manager/tentative.py``); nothing was applied. The service waits for that
    step and runs the call again; ``step`` is the step to wait for."""

    def __init__(self, message: str, step: Optional[PendingStep] = None) -> None:
        super().__init__(message)
        self.step = step


class DeadlineExceeded(ManagerError):
    """The caller's deadline passed before the answer."""


class DataLoss(ManagerError):
    """The sequence's K/V is gone (the worker group that held it was replaced): free it and
    recompute it. Every operation on it but Free answers this until it is freed."""


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

