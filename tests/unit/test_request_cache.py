"""The request-id cache is bounded by entries, by bytes and by age; the id helper for messages."""

from __future__ import annotations

import pytest

from kvpager.errors import InvalidArgument, NotFound, quote
from kvpager.manager.request_cache import Answer, RequestCache, fingerprint
from kvpager.v1 import block_manager_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def answer(n: int) -> Answer:
    return Answer(response=pb.AllocateResponse(seq_id="s", block_ids=list(range(n))))


def test_first_answer_is_returned_and_a_reused_id_for_another_request_is_refused():
    cache = RequestCache()
    p1, p2 = fingerprint("Allocate", b"1"), fingerprint("Allocate", b"2")
    cache.put("r", p1, answer(3))
    assert cache.get("r", p1) == answer(3)
    with pytest.raises(InvalidArgument, match="different request"):
        cache.get("r", p2)


def test_evicts_oldest_by_bytes():
    cache = RequestCache(capacity=1000, max_bytes=2000)
    p = fingerprint("Allocate", b"")
    for i in range(10):
        cache.put(f"r{i}", p, answer(200))  # ~ 200 + 16 + 2 + 64 bytes each
    assert cache.bytes <= 2000
    assert 4 <= len(cache) <= 7
    assert cache.get("r0", p) is None and cache.get("r9", p) is not None
    cache.put("huge", p, answer(5000))  # larger than the whole budget: not kept, nothing evicted for it
    assert cache.get("huge", p) is None and cache.get("r9", p) is not None


def test_evicts_by_count():
    cache = RequestCache(capacity=3)
    p = fingerprint("Free", b"")
    for i in range(5):
        cache.put(f"r{i}", p, Answer(error=NotFound("no sequence")))
    assert len(cache) == 3 and cache.get("r1", p) is None and cache.get("r2", p) is not None


def test_evicts_by_age():
    clock = Clock()
    cache = RequestCache(ttl=10.0, clock=clock)
    p = fingerprint("Free", b"")
    cache.put("old", p, answer(1))
    clock.now += 6
    cache.put("new", p, answer(1))
    clock.now += 5  # "old" is 11 s old, "new" 5 s
    assert cache.get("old", p) is None and cache.get("new", p) is not None
    assert len(cache) == 1
    clock.now += 10
    assert cache.get("new", p) is None and len(cache) == 0 and cache.bytes == 0


def test_error_answers_cost_their_message():
    cache = RequestCache(max_bytes=10_000)
    p = fingerprint("Free", b"")
    cache.put("e", p, Answer(error=NotFound("x" * 100)))
    assert 100 < cache.bytes < 300


def test_quote_truncates_long_ids():
    assert quote("abc") == "'abc'"
    long = "y" * 1_000_000
    q = quote(long)
    assert len(q) < 100 and q.startswith("'" + "y" * 64 + "'") and "(1000000 chars)" in q
