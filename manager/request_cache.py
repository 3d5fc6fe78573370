"""Answers already given, by client request id, so that a retried request applies nothing twice.

A scheduler that timed out waiting for an answer resends the same request with the same
request_id and gets the first answer back, error or not. The cache is bounded (least
recently used ids are forgotten first), so retries must come within the last ``capacity``
requests. A request id reused for a different request is an INVALID_ARGUMENT.
O(1) per lookup and store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, Optional

from .errors import InvalidArgument, ManagerError


@dataclass(slots=True, frozen=True)
class Answer:
    response: Any = None
    error: Optional[ManagerError] = None


def fingerprint(method: str, request_bytes: bytes) -> bytes:
    return blake2b(method.encode() + b"\0" + request_bytes, digest_size=16).digest()


class RequestCache:
    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._answers: OrderedDict[str, tuple[bytes, Answer]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, request_id: str, print_: bytes) -> Optional[Answer]:
        entry = self._answers.get(request_id)
        if entry is None:
            return None
        if entry[0] != print_:
            raise InvalidArgument(
                f"request_id {request_id!r} was already used for a different request; use a new id per request")
        self._answers.move_to_end(request_id)
        return entry[1]

    def put(self, request_id: str, print_: bytes, answer: Answer) -> None:
        self._answers[request_id] = (print_, answer)
        if len(self._answers) > self.capacity:
            self._answers.popitem(last=False)
