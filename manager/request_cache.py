"""Answers already given, by client request id, so that a retried request applies nothing twice.

A scheduler that timed out waiting for an answer resends the same request with the same
request_id and gets the first answer back, error or not. The cache is bounded three ways,
the oldest answers forgotten first: at most ``capacity`` ids, at most ``max_bytes`` bytes
(each entry costs its id, its fingerprint and its answer's serialized size, or its error
message's length), and no answer older than ``ttl`` seconds. So a retry must come within
``ttl`` seconds and before ``capacity`` / ``max_bytes`` worth of newer answers pushed it out;
a later retry with the same id is applied as a new request. A request id reused for a
different request is an INVALID_ARGUMENT. O(1) per lookup and store (amortized).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, Callable, Optional

from kvpager.errors import InvalidArgument, ManagerError, quote

_ENTRY_OVERHEAD = 64  # bytes of bookkeeping counted per entry besides its id and answer


@dataclass(slots=True, frozen=True)
class Answer:
    response: Any = None
    error: Optional[ManagerError] = None
    nbytes: Optional[int] = None  # the response's serialized size, when the caller measured it already

    def size(self) -> int:
        """Bytes this answer costs to keep: its serialized response, or its error message.
        O(1) when ``nbytes`` is known; else ``ByteSize`` walks the whole message."""
        if self.error is not None:
            return len(str(self.error))
        if self.nbytes is not None:
            return self.nbytes
        byte_size = getattr(self.response, "ByteSize", None)
        return byte_size() if byte_size is not None else 0


def fingerprint(method: str, request_bytes: bytes) -> bytes:
    return blake2b(method.encode() + b"\0" + request_bytes, digest_size=16).digest()


class RequestCache:
    def __init__(self, capacity: int = 65536, max_bytes: int = 64 << 20, ttl: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.bytes = 0  # what the entries kept now cost
        # id -> (fingerprint, answer, cost, time stored); oldest first (stores only append).
        self._answers: OrderedDict[str, tuple[bytes, Answer, int, float]] = OrderedDict()
        # Told of every new answer put (the write-ahead log: manager/recovery.py); restored ones are not.
        self.on_put: Optional[Callable[[str, bytes, Answer], None]] = None

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, request_id: str, print_: bytes) -> Optional[Answer]:
        self._expire()
        entry = self._answers.get(request_id)
        if entry is None:
            return None
        if entry[0] != print_:
            raise InvalidArgument(
                f"request_id {quote(request_id)} was already used for a different request; use a new id per request")
        return entry[1]

    def put(self, request_id: str, print_: bytes, answer: Answer) -> None:
        """Keep a new ``answer`` (given now), and tell ``on_put``."""
        self.restore(request_id, print_, answer, self.clock())
        if self.on_put is not None:
            self.on_put(request_id, print_, answer)

    def restore(self, request_id: str, print_: bytes, answer: Answer, stored_at: float) -> None:
        """Keep ``answer``, first given at ``stored_at`` (a ``clock`` time: recovery restores
        answers with their age)."""
        old = self._answers.pop(request_id, None)
        if old is not None:
            self.bytes -= old[2]
        cost = len(request_id) + len(print_) + answer.size() + _ENTRY_OVERHEAD
        if cost > self.max_bytes:
            return  # could never be kept: a retry will be applied as a new request
        self._answers[request_id] = (print_, answer, cost, stored_at)
        self.bytes += cost
        while len(self._answers) > self.capacity or self.bytes > self.max_bytes:
            self._pop_oldest()
        self._expire()

    def entries(self) -> list[tuple[str, bytes, Answer, float]]:
        """(request id, fingerprint, answer, age in seconds) of every kept answer, oldest first
        (snapshots). O(entries)."""
        now = self.clock()
        return [(rid, print_, answer, now - stored) for rid, (print_, answer, _cost, stored) in self._answers.items()]

    def _expire(self) -> None:
        answers = self._answers
        if not answers:
            return
        horizon = self.clock() - self.ttl
        while answers and next(iter(answers.values()))[3] <= horizon:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._answers.popitem(last=False)
        self.bytes -= entry[2]
