"""Replies that never lie, through a real server on 127.0.0.1: what cannot be answered is refused
before anything is applied; ids are quoted truncated; retries get the first answer; malformed
input is INVALID_ARGUMENT and a bug is INTERNAL with the whole step rolled back."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpager import client as C
from kvpager import errors
from kvpager.manager import ManagerConfig
from kvpager.manager.operations import ForkOp
from kvpager.v1 import block_manager_pb2 as pb

from tests.support.state import served_fingerprint

from ..conftest import running_server

BOUNDED = ManagerConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=16, watermark=0.0, max_step_operations=8,
                        max_step_forks=2, max_id_len=40, max_prompt_tokens=40)


@pytest.fixture
def bounded():
    with running_server(BOUNDED) as pair:
        yield pair


# ---- bounds ----------------------------------------------------------------------------------------
def test_each_bound_is_refused_with_its_status_and_nothing_applied(bounded):
    client, service = bounded
    client.allocate("p", num_tokens=6)
    before = served_fingerprint(service)
    refusals = [
        (lambda: client.step([C.allocate_op(f"s{i}", num_tokens=1) for i in range(9)]), "max_step_operations"),
        (lambda: client.step([C.append_batch_op(["p"] * 9)]), "max_step_operations"),
        (lambda: client.swap_out([f"s{i}" for i in range(9)]), "max_step_operations"),  # bounded as a Step is
        (lambda: client.swap_in([f"s{i}" for i in range(9)]), "max_step_operations"),
        (lambda: client.swap_out([f"s{i}" for i in range(8)]), None),  # within the bound: unknown ids, NOT_FOUND
        (lambda: client.step([C.fork_op("p", f"c{i}") for i in range(3)]), "max_step_forks"),
        (lambda: client.allocate("x" * 41, num_tokens=1), "max_id_len"),
        (lambda: client.fork("p", "y" * 41), "max_id_len"),
        (lambda: client.allocate("n", num_tokens=1, namespace="z" * 41), "max_id_len"),
        (lambda: client.allocate("n", num_tokens=1, request_id="r" * 41), "max_id_len"),
        (lambda: client.allocate("n", token_ids=list(range(41))), "max_prompt_tokens"),
        (lambda: client.append("p", num_tokens=41), "max_prompt_tokens"),
        (lambda: client.allocate("n", num_tokens=-1), "at least 1 token"),
    ]
    for call, fragment in refusals:
        expected = errors.NotFound if fragment is None else errors.InvalidArgument
        with pytest.raises(expected) as info:
            call()
        assert fragment is None or fragment in str(info.value), info.value
        assert served_fingerprint(service) == before
    # Within the bounds the same calls work.
    client.step([C.allocate_op(f"s{i}", num_tokens=1) for i in range(8)])
    client.step([C.fork_op("p", f"c{i}") for i in range(2)])


def test_the_fork_rpc_obeys_max_step_forks_as_a_steps_forks_do():
    config = dataclasses.replace(BOUNDED, max_step_forks=0)   # forks off
    with running_server(config) as (client, service):
        client.allocate("p", num_tokens=6)
        before = served_fingerprint(service)
        for call, kind in ((lambda: client.fork("p", "c"), "fork"), (lambda: client.step([C.fork_op("p", "c")]), "step")):
            with pytest.raises(errors.InvalidArgument) as info:
                call()
            assert str(info.value) == f"{kind}: forks are off on this manager (max_step_forks 0); nothing was applied"
            assert served_fingerprint(service) == before
        client.append("p", num_tokens=1)   # still serving
    with running_server(dataclasses.replace(BOUNDED, max_step_forks=1)) as (client, service):
        client.allocate("p", num_tokens=6)
        assert client.fork("p", "c").child_seq_id == "c"   # one fork: within any bound of at least one


def test_an_answer_larger_than_max_reply_bytes_is_refused_and_rolled_back():
    config = ManagerConfig(block_size=4, num_gpu_blocks=1024, num_cpu_blocks=16, watermark=0.0, max_reply_bytes=1024)
    with running_server(config) as (client, service):
        before = served_fingerprint(service)
        # Caught by the lower bound before the prompt is applied.
        with pytest.raises(errors.OutOfRange, match="max_reply_bytes"):
            client.allocate("big", num_tokens=400)
        # Fits the lower bound, but the encoded answer (result + batch tables) does not: rolled back.
        with pytest.raises(errors.OutOfRange, match=r"the answer would be \d+ bytes"):
            client.step([C.allocate_op("big", num_tokens=300)])
        assert served_fingerprint(service) == before
        client.allocate("big", num_tokens=300)  # the single call's smaller answer fits


def test_a_huge_fork_step_is_refused_before_it_is_applied():
    """The issue's case: hundreds of forks of a long sequence. Refused quickly, nothing applied."""
    with running_server(ManagerConfig(max_reply_bytes=256 << 10)) as (client, service):
        client.allocate("parent", num_tokens=60_000)  # 3,750 blocks
        before = served_fingerprint(service)
        increfs = []
        gpu = service.manager.gpu
        real_incref = gpu.incref
        gpu.incref = lambda b: (increfs.append(b), real_incref(b))[1]
        try:
            started = time.perf_counter()
            r = client.step([C.fork_op("parent", f"child{i}") for i in range(1000)], all_or_nothing=True)
            elapsed = time.perf_counter() - started
        finally:
            gpu.incref = real_incref
        assert not r.applied
        failed = [i for i, res in enumerate(r.results) if res.code != 10]  # all ABORTED but the one that failed
        assert len(failed) == 1 and r.results[failed[0]].code == 11 and "max_reply_bytes" in r.results[failed[0]].message
        assert len(increfs) <= (failed[0] + 1) * 3750 and failed[0] < 30
        assert r.ByteSize() < 200_000 and elapsed < 5
        with pytest.raises(errors.OutOfRange, match="max_reply_bytes"):  # not all-or-nothing: refused whole
            client.step([C.fork_op("parent", f"child{i}") for i in range(300)])
        assert served_fingerprint(service) == before


# ---- messages --------------------------------------------------------------------------------------
def test_long_ids_are_quoted_truncated_in_messages(served):
    client, service = served
    client.allocate("a", num_tokens=2)
    huge = "q" * 1_000_000
    for call in (lambda: client.append(huge, num_tokens=1), lambda: client.get_block_table(huge),
                 lambda: client.allocate(huge, num_tokens=1), lambda: client.free(huge, request_id="")):
        with pytest.raises(errors.ManagerError) as info:
            call()
        assert len(str(info.value)) < 400 and "(1000000 chars)" in str(info.value)
    r = client.step([C.fork_op("a", huge), C.append_op(huge, num_tokens=1), C.swap_out_op([huge])])
    assert all(len(res.message) < 400 and "(1000000 chars)" in res.message for res in r.results)
    assert r.ByteSize() < 2000


# ---- the request-id cache and retries ------------------------------------------------------------------
def _retry_cases(client):
    return [
        ("allocate", lambda rid: client.allocate("n", num_tokens=3, request_id=rid)),
        ("append", lambda rid: client.append("a", num_tokens=1, request_id=rid)),
        ("fork", lambda rid: client.fork("a", "f", request_id=rid)),
        ("swap_out", lambda rid: client.swap_out(["s"], request_id=rid)),
        ("swap_in", lambda rid: client.swap_in(["w"], request_id=rid)),
        ("free", lambda rid: client.free("d", request_id=rid)),
        ("step", lambda rid: client.step([C.append_op("a", num_tokens=1), C.fork_op("a", "g")], request_id=rid)),
    ]


def test_every_mutating_rpc_answers_a_retry_with_its_first_answer(served):
    client, service = served
    for seq in ("a", "s", "w", "d"):
        client.allocate(seq, num_tokens=2)
    client.swap_out(["w"])
    for name, call in _retry_cases(client):
        first = call(f"id-{name}")
        state = served_fingerprint(service)
        assert call(f"id-{name}") == first, name
        assert served_fingerprint(service) == state, name


def test_client_sends_a_request_id_by_default(served):
    client, service = served
    client.allocate("a", num_tokens=2)
    client.step([C.append_op("a", num_tokens=1)])
    assert len(service.requests) == 2


def test_retry_after_deadline_exceeded_gets_the_first_answer_and_applies_once(served):
    client, service = served
    impatient = C.BlockManagerClient(client.target, timeout=0.3, retries=5, retry_backoff=0.05)
    dispatched = []

    def slow_worker(plan):  # the first plan takes longer than the client waits
        dispatched.append(plan.step_id)
        if len(dispatched) == 1:
            time.sleep(0.6)

    client.allocate("a", num_tokens=5)
    client.fork("a", "b")
    client.allocate("c", num_tokens=3)
    try:
        with service.lock:
            service.manager.dispatch = slow_worker
        r = impatient.append("b", num_tokens=1)   # copy-on-write of the shared last block: a plan
        assert len(r.copies.src) == 1 and len(dispatched) == 1
        dispatched.clear()
        r = impatient.step([C.append_op("a", num_tokens=4), C.swap_out_op(["c"]), C.fork_op("a", "d")])
        assert [res.code for res in r.results] == [0, 0, 0] and len(dispatched) == 1
    finally:
        impatient.close()
        with service.lock:
            service.manager.dispatch = None
    assert client.get_block_table("a").num_tokens == 9 and client.get_block_table("b").num_tokens == 6
    stats = client.get_stats()
    assert stats.running_sequences == 3 and stats.swapped_sequences == 1 and stats.cow_copies == 1


def test_answers_are_forgotten_after_the_ttl():
    config = dataclasses.replace(BOUNDED, request_cache_ttl=0.3)
    with running_server(config) as (client, service):
        client.allocate("a", num_tokens=1, request_id="once")
        assert client.allocate("a", num_tokens=1, request_id="once").seq_id == "a"  # the first answer
        time.sleep(0.4)
        with pytest.raises(errors.AlreadyExists):  # forgotten: applied as a new request
            client.allocate("a", num_tokens=1, request_id="once")
        assert len(service.requests) == 1


def test_request_cache_is_bounded_in_bytes():
    config = dataclasses.replace(BOUNDED, request_cache_bytes=4096)
    with running_server(config) as (client, service):
        for i in range(100):
            with pytest.raises(errors.NotFound):  # NOT_FOUND answers, each kept
                client.append("ghost", num_tokens=1)
        assert service.requests.bytes <= 4096 and 10 < len(service.requests) < 100


# ---- malformed input and bugs ------------------------------------------------------------------------
BAD_MESSAGES = [
    ("Allocate", b"\xff\xff\xff"),                      # not protobuf
    ("Allocate", b"\x12\x02\xc3\x28\x20\x01"),          # seq_id with bad UTF-8
    ("Step", b"\x12\x06\x0a\x04\x12\x02\xc3\x28"),      # bad UTF-8 inside a nested operation
    ("Step", b"\x12\xff\xff\xff\x0f"),                   # a length past the end
    ("Ping", b"\x08"),                                   # a truncated field
    ("Heartbeat", b"\x0a\x01\xff"),                      # worker_id with bad UTF-8
    ("GetBlockTable", b"\x0a\x02\xed\xa0"),              # a lone surrogate's bytes
]


@pytest.mark.parametrize("method, raw", BAD_MESSAGES)
def test_malformed_bytes_are_invalid_argument_and_the_server_keeps_serving(served, method, raw):
    client, service = served
    client.allocate("a", num_tokens=2)
    before = served_fingerprint(service)
    call = client.channel.unary_unary(f"/kvpager.v1.BlockManager/{method}")  # raw bytes both ways
    with pytest.raises(grpc.RpcError) as info:
        call(raw, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert served_fingerprint(service) == before
    client.ping()
    client.append("a", num_tokens=1)


@pytest.mark.parametrize("failure", [errors.InvariantViolation("broken"), RuntimeError("oops")])
def test_a_bug_rolls_the_whole_step_back_and_answers_internal(served, caplog, failure):
    client, service = served
    client.allocate("a", num_tokens=2)
    before = served_fingerprint(service)
    real_fork = service.manager._apply[ForkOp]

    def broken_fork(op):
        real_fork(op)  # it changed things, then found a bug
        raise failure

    service.manager._apply[ForkOp] = broken_fork
    try:
        with caplog.at_level(logging.ERROR, logger="kvpager.manager"):
            with pytest.raises(errors.InvariantViolation):
                client.step([C.allocate_op("b", num_tokens=3), C.fork_op("a", "c"), C.append_op("a", num_tokens=1)])
            with pytest.raises(errors.InvariantViolation):
                client.fork("a", "c", request_id="bug-1")
    finally:
        service.manager._apply[ForkOp] = real_fork
    assert served_fingerprint(service) == before
    assert any(r.exc_info for r in caplog.records), "logged with its traceback"
    assert client.fork("a", "c", request_id="bug-1").child_seq_id == "c"  # a bug's answer is not kept


# ---- random input ----------------------------------------------------------------------------------
IDS = st.sampled_from(["a", "b", "c", "d", "", "é", "x" * 300])
TOKENS = st.lists(st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(0, 50), max_size=6)
COUNT = st.integers(-(1 << 31), (1 << 31) - 1) | st.integers(-1, 12)
OPERATION = st.one_of(
    st.builds(lambda s, t, n, ns: C.allocate_op(s, t, n, ns), IDS, TOKENS, COUNT, IDS),
    st.builds(lambda s, t, n: C.append_op(s, t, n), IDS, TOKENS, COUNT),
    st.builds(lambda s, t: C.append_batch_op(s, t), st.lists(IDS, max_size=4), TOKENS),
    st.builds(C.fork_op, IDS, IDS),
    st.builds(C.free_op, IDS),
    st.builds(C.swap_out_op, st.lists(IDS, max_size=3)),
    st.builds(C.swap_in_op, st.lists(IDS, max_size=3)),
    st.just(pb.Operation()),
    st.builds(lambda s, rid: pb.Operation(free=pb.FreeRequest(seq_id=s, request_id=rid)), IDS, IDS),
)
STEP = st.builds(lambda ops, aon, rid: pb.StepRequest(operations=ops, all_or_nothing=aon, request_id=rid),
                 st.lists(OPERATION, max_size=12), st.booleans(), st.sampled_from(["", "r1", "r2", "z" * 300]))


def test_random_steps_and_bytes_never_answer_internal():
    config = ManagerConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, watermark=0.0, max_step_operations=10,
                           max_step_forks=3)
    with running_server(config) as (client, service):
        raw_step = client.channel.unary_unary("/kvpager.v1.BlockManager/Step")
        lock = threading.Lock()

        def check(raw: bytes) -> None:
            try:
                raw_step(raw, timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc.details()
            with service.lock:
                service.manager.check_invariants()

        @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.one_of(STEP.map(lambda m: m.SerializeToString()), st.binary(max_size=64),
                         STEP.map(lambda m: m.SerializeToString()).flatmap(
                             lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda i: b[:i] + b"\xff" + b[i + 1:]))))
        def run(raw):
            with lock:
                check(raw)

        run()
        client.ping()
