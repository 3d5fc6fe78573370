"""Every RPC and every error, through a real server on a loopback port.

The ``served`` fixture checks the manager's invariants after each test.
Pool: block size 4, 17 GPU blocks (block 0 is the null block: 16 usable, handed out from 1),
8 CPU blocks, no watermark.
"""

from __future__ import annotations

import pytest

from kvpager import client as C
from kvpager import errors
from kvpager.v1 import block_manager_pb2 as pb


def stats(client) -> pb.GetStatsResponse:
    return client.get_stats()


# ---- Allocate ---------------------------------------------------------------------------------------
def test_allocate_returns_table_slots_and_cached_prefix(served):
    client, _ = served
    r = client.allocate("a", token_ids=list(range(10)))
    assert list(r.block_ids) == [1, 2, 3]
    assert list(r.slot_mapping) == list(range(4, 14))
    assert r.num_cached_tokens == 0
    r2 = client.allocate("b", token_ids=list(range(8)) + [99, 98])
    assert list(r2.block_ids[:2]) == [1, 2] and r2.num_cached_tokens == 8
    assert list(r2.slot_mapping[8:]) == [r2.block_ids[2] * 4, r2.block_ids[2] * 4 + 1]
    s = stats(client)
    assert (s.gpu.used_blocks, s.prefix_query_tokens, s.prefix_hit_tokens) == (4, 20, 8)


def test_allocate_by_count_only(served):
    client, _ = served
    r = client.allocate("a", num_tokens=5)
    assert list(r.block_ids) == [1, 2] and r.num_cached_tokens == 0
    assert client.get_block_table("a").num_tokens == 5


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(seq_id="x"), errors.InvalidArgument),                                 # empty prompt
        (dict(seq_id="x", num_tokens=-3), errors.InvalidArgument),                  # negative count
        (dict(seq_id="x", token_ids=[1, 2], num_tokens=3), errors.InvalidArgument),  # ids and count disagree
        (dict(seq_id="x", token_ids=[1, -2]), errors.InvalidArgument),              # negative token id
        (dict(seq_id="x", num_tokens=1 << 30), errors.InvalidArgument),             # absurd count
        (dict(seq_id="", num_tokens=3), errors.InvalidArgument),                    # no id
        (dict(seq_id="x", num_tokens=65), errors.OutOfRange),                       # 17 blocks > 16 ever
    ],
)
def test_allocate_rejects_bad_input(served, kwargs, error):
    client, _ = served
    with pytest.raises(error):
        client.allocate(**kwargs)
    assert stats(client).gpu.used_blocks == 0


def test_allocate_duplicate_id_is_already_exists(served):
    client, _ = served
    client.allocate("a", num_tokens=3)
    with pytest.raises(errors.AlreadyExists, match="'a' already exists"):
        client.allocate("a", num_tokens=3)
    assert stats(client).gpu.used_blocks == 1


def test_allocate_without_room_is_resource_exhausted_and_says_why(served):
    client, _ = served
    client.allocate("a", num_tokens=13 * 4)
    with pytest.raises(errors.ResourceExhausted, match=r"needs 4 free GPU blocks, 3 are free") as info:
        client.allocate("b", num_tokens=16)
    # The same numbers as structured status details (google.rpc.ErrorInfo), no message parsing.
    assert (info.value.needed, info.value.free, info.value.tier) == (4, 3, "gpu")
    assert info.value.code == "RESOURCE_EXHAUSTED"
    client.free("a")
    client.allocate("b", num_tokens=16)  # room again


# ---- Append ----------------------------------------------------------------------------------------
def test_append_slots_new_blocks_and_copy_on_write(served):
    client, _ = served
    client.allocate("a", token_ids=[1, 2, 3, 4, 5, 6])  # blocks 1, 2; 2 tokens in block 2
    r = client.append("a", token_ids=[7])
    assert list(r.slot_mapping) == [10] and list(r.new_block_ids) == [] and r.num_tokens == 7
    r = client.append("a", token_ids=[8, 9, 10])  # speculative: fills block 2, spills into block 3
    assert list(r.slot_mapping) == [11, 12, 13] and list(r.new_block_ids) == [3]
    client.fork("a", "b")
    r = client.append("b", token_ids=[11])  # block 3 is shared and partial: copy-on-write
    assert list(r.copies.src) == [3] and list(r.copies.dst) == [4] and list(r.new_block_ids) == [4]
    assert list(r.slot_mapping) == [4 * 4 + 2]
    r = client.append("a", token_ids=[12])  # now a holds block 3 alone: written in place
    assert list(r.copies.src) == [] and list(r.slot_mapping) == [3 * 4 + 2]
    assert stats(client).cow_copies == 1


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(seq_id="nope", num_tokens=1), errors.NotFound),
        (dict(seq_id="a", num_tokens=0), errors.InvalidArgument),
        (dict(seq_id="a", num_tokens=-1), errors.InvalidArgument),
        (dict(seq_id="a", token_ids=[1], num_tokens=2), errors.InvalidArgument),
        (dict(seq_id="a", num_tokens=100), errors.OutOfRange),
    ],
)
def test_append_rejects_bad_input(served, kwargs, error):
    client, _ = served
    client.allocate("a", num_tokens=3)
    with pytest.raises(error):
        client.append(**kwargs)
    assert client.get_block_table("a").num_tokens == 3


def test_append_to_swapped_out_sequence_is_failed_precondition(served):
    client, _ = served
    client.allocate("a", num_tokens=3)
    client.swap_out(["a"])
    with pytest.raises(errors.FailedPrecondition, match="swapped out"):
        client.append("a", num_tokens=1)


def test_append_without_room_is_resource_exhausted(served):
    client, _ = served
    client.allocate("a", num_tokens=15 * 4)
    client.allocate("b", num_tokens=4)  # the pool is full
    with pytest.raises(errors.ResourceExhausted, match="needs 1 free GPU blocks, 0 are free"):
        client.append("a", num_tokens=1)
    assert client.get_block_table("a").num_tokens == 60


# ---- Fork and Free ------------------------------------------------------------------------------------
def test_fork_shares_blocks_and_free_releases_last_reference(served):
    client, _ = served
    client.allocate("a", num_tokens=6)
    r = client.fork("a", "b")
    assert r.child_seq_id == "b" and list(r.block_ids) == [1, 2]
    assert stats(client).gpu.used_blocks == 2
    assert client.free("a").num_blocks_released == 0
    assert client.free("b").num_blocks_released == 2
    s = stats(client)
    assert (s.gpu.used_blocks, s.gpu.free_blocks, s.running_sequences) == (0, 16, 0)


def test_fork_and_free_errors(served):
    client, _ = served
    client.allocate("a", num_tokens=3)
    client.allocate("b", num_tokens=3)
    with pytest.raises(errors.NotFound):
        client.fork("nope", "c")
    with pytest.raises(errors.AlreadyExists):
        client.fork("a", "b")
    with pytest.raises(errors.InvalidArgument):
        client.fork("a", "")
    with pytest.raises(errors.NotFound):
        client.free("nope")
    client.swap_out(["a"])
    with pytest.raises(errors.FailedPrecondition):
        client.fork("a", "c")
    assert client.free("a").num_blocks_released == 1  # frees its CPU block
    assert stats(client).cpu.used_blocks == 0


# ---- Swap -------------------------------------------------------------------------------------------
def test_swap_out_and_in_keep_shared_blocks_shared(served):
    client, _ = served
    client.allocate("a", num_tokens=6)  # count only: no prefix hashes, so swap-in copies everything
    client.fork("a", "b")
    client.append("b", num_tokens=1)    # b: blocks 1, 3 (copy of 2)
    out = client.swap_out(["a", "b"])
    assert list(out.mapping.src) == [1, 2, 3] and list(out.mapping.dst) == [0, 1, 2]
    s = stats(client)
    assert (s.gpu.used_blocks, s.cpu.used_blocks, s.swapped_sequences, s.running_sequences) == (0, 3, 2, 0)
    assert client.get_block_table("a").tier == pb.TIER_CPU
    back = client.swap_in(["b", "a"])
    assert list(back.mapping.src) == [0, 2, 1] and len(back.mapping.dst) == 3
    a, b = client.get_block_table("a"), client.get_block_table("b")
    assert a.tier == b.tier == pb.TIER_GPU and a.block_ids[0] == b.block_ids[0]  # still shared
    assert stats(client).gpu.used_blocks == 3


def test_swap_in_reuses_blocks_still_in_the_prefix_cache(served):
    client, _ = served
    client.allocate("a", token_ids=list(range(9)))  # two full hashed blocks + one partial
    client.swap_out(["a"])
    assert stats(client).gpu.cached_blocks == 2
    back = client.swap_in(["a"])
    assert back.num_blocks_reused == 2 and len(back.mapping.src) == 1


def test_swap_errors(served):
    client, _ = served
    client.allocate("a", num_tokens=3)
    with pytest.raises(errors.FailedPrecondition, match="not swapped out"):
        client.swap_in(["a"])
    with pytest.raises(errors.NotFound):
        client.swap_out(["nope"])
    with pytest.raises(errors.InvalidArgument):
        client.swap_out([])
    with pytest.raises(errors.InvalidArgument):
        client.swap_out(["a", "a"])
    client.swap_out(["a"])
    with pytest.raises(errors.FailedPrecondition, match="already swapped out"):
        client.swap_out(["a"])


def test_swap_out_without_cpu_room(served):
    client, _ = served
    client.allocate("big", num_tokens=9 * 4)  # 9 blocks: more than the 8 CPU blocks there are
    with pytest.raises(errors.OutOfRange, match="CPU pool has 8"):
        client.swap_out(["big"])
    client.allocate("a", num_tokens=5 * 4)
    client.swap_out(["a"])                     # 3 CPU blocks left
    client.free("big")
    client.allocate("b", num_tokens=4 * 4)
    with pytest.raises(errors.ResourceExhausted, match="needs 4 free CPU blocks, 3 are free") as info:
        client.swap_out(["b"])
    assert (info.value.needed, info.value.free, info.value.tier) == (4, 3, "cpu")
    assert client.get_block_table("b").tier == pb.TIER_GPU


# ---- Step ----------------------------------------------------------------------------------------------
def test_step_applies_in_order_reports_each_result_and_merges_the_plan(served):
    client, _ = served
    client.allocate("a", num_tokens=6)
    client.fork("a", "b")
    r = client.step([
        C.append_op("a", num_tokens=1),     # copy-on-write of block 2
        C.append_op("nope", num_tokens=1),  # fails alone
        C.allocate_op("c", num_tokens=5),
        C.free_op("b"),
    ])
    assert r.applied and r.step_id == 3  # Allocate and Fork were steps of one
    assert [res.code for res in r.results] == [0, 5, 0, 0]
    assert C.result_error(r.results[1]).__class__ is errors.NotFound
    assert list(r.plan.blocks_to_copy.src) == [2] and list(r.plan.blocks_to_copy.dst) == [3]
    batch = r.batch
    assert list(batch.seq_ids) == ["a", "c"]
    assert list(batch.context_lens) == [7, 5] and list(batch.query_lens) == [1, 5]
    assert list(batch.slot_mapping) == [3 * 4 + 2, 16, 17, 18, 19, 20]
    assert batch.max_blocks == 2
    assert list(batch.block_tables) == [1, 3, 4, 5]
    assert list(batch.kv_indptr) == [0, 2, 4] and list(batch.kv_indices) == [1, 3, 4, 5]
    assert list(batch.kv_last_page_len) == [3, 1]


def test_step_all_or_nothing_rolls_back(served):
    client, _ = served
    client.allocate("a", num_tokens=6)
    before = stats(client)
    r = client.step([C.append_op("a", num_tokens=1), C.allocate_op("c", num_tokens=5), C.free_op("nope")],
                    all_or_nothing=True)
    assert not r.applied
    assert [res.code for res in r.results] == [10, 10, 5]  # ABORTED, ABORTED, NOT_FOUND
    assert len(r.plan.blocks_to_copy.src) == 0 and len(r.batch.seq_ids) == 0
    after = stats(client)
    assert (after.gpu.used_blocks, after.running_sequences) == (before.gpu.used_blocks, before.running_sequences)
    assert client.get_block_table("a").num_tokens == 6
    with pytest.raises(errors.NotFound):
        client.get_block_table("c")


def test_step_swap_plan_and_written_blocks_rule(served):
    client, _ = served
    client.allocate("a", num_tokens=5)
    client.allocate("b", num_tokens=5)
    r = client.step([C.append_op("a", num_tokens=1), C.swap_out_op(["a"]), C.swap_out_op(["b"])])
    assert [res.code for res in r.results] == [0, 9, 0]  # a was written this step: FAILED_PRECONDITION
    assert "later step" in r.results[1].message
    assert list(r.plan.blocks_to_swap_out.src) == [3, 4]
    r = client.step([C.swap_in_op(["b"]), C.free_op("a")])
    assert [res.code for res in r.results] == [0, 0]
    assert list(r.plan.blocks_to_swap_in.src) == [0, 1] and list(r.batch.seq_ids) == ["b"]
    assert list(r.batch.query_lens) == [0] and list(r.batch.context_lens) == [5]


def test_step_rejects_malformed_operations(served):
    client, _ = served
    op = C.allocate_op("x", num_tokens=1)
    op.allocate.request_id = "inner"
    r = client.step([op, pb.Operation(), C.allocate_op("y", num_tokens=1)])
    assert [res.code for res in r.results] == [3, 3, 0]
    assert "request_id" in r.results[0].message and "sets none" in r.results[1].message


# ---- queries, idempotency, health, reflection ---------------------------------------------------------
def test_get_block_table_and_stats(served):
    client, _ = served
    client.allocate("a", num_tokens=6)
    t = client.get_block_table("a")
    assert (t.seq_id, t.tier, t.num_tokens, list(t.block_ids)) == ("a", pb.TIER_GPU, 6, [1, 2])
    with pytest.raises(errors.NotFound):
        client.get_block_table("nope")
    s = stats(client)
    assert s.block_size == 4 and s.gpu.total_blocks == 16 and s.cpu.total_blocks == 8
    assert s.gpu_utilization == pytest.approx(2 / 16)
    assert s.internal_fragmentation == pytest.approx(2 / 8)
    assert s.prefix_caching and s.watermark_blocks == 0


def test_retry_with_same_request_id_applies_once(served):
    client, _ = served
    first = client.allocate("a", num_tokens=5, request_id="req-1")
    again = client.allocate("a", num_tokens=5, request_id="req-1")
    assert again == first
    client.append("a", num_tokens=1, request_id="req-2")
    client.append("a", num_tokens=1, request_id="req-2")
    assert client.get_block_table("a").num_tokens == 6
    step = [C.append_op("a", num_tokens=1)]
    assert client.step(step, request_id="req-3") == client.step(step, request_id="req-3")
    assert client.get_block_table("a").num_tokens == 7
    with pytest.raises(errors.NotFound):
        client.free("nope", request_id="req-4")
    with pytest.raises(errors.NotFound):  # the first answer, even an error, is the answer
        client.free("nope", request_id="req-4")
    with pytest.raises(errors.InvalidArgument, match="different request"):
        client.append("a", num_tokens=2, request_id="req-2")
    assert client.get_block_table("a").num_tokens == 7


def test_client_retries_reuse_one_request_id(served):
    client, service = served
    retrying = C.BlockManagerClient(client.target, retries=3)
    try:
        r = retrying.allocate("a", num_tokens=5)
        assert list(r.block_ids) == [1, 2]
        assert len(service.requests) == 1  # the client gave the call an id
    finally:
        retrying.close()


def test_health_and_reflection(served):
    client, _ = served
    assert client.health() == "SERVING"
    assert client.health("kvpager.v1.BlockManager") == "SERVING"
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"kvpager.v1.BlockManager", "grpc.health.v1.Health"} <= names


def test_server_keeps_serving_after_errors(served):
    client, _ = served
    for _ in range(20):
        with pytest.raises(errors.NotFound):
            client.append("ghost", num_tokens=1)
    client.ping()
    assert client.allocate("a", num_tokens=1).block_ids[0] == 1


def test_append_batch_reports_only_failures_and_merges_slots(served):
    client, _ = served
    client.allocate("a", num_tokens=3)
    client.allocate("b", num_tokens=4)
    client.fork("b", "c")  # b and c share a full block: appends start a new block each
    client.allocate("s", num_tokens=2)
    client.swap_out(["s"])
    r = client.step([C.append_batch_op(["a", "nope", "b", "s", "c"], [10, 11, 12, 13, 14])])
    failures = C.batch_failures(r.results[0])
    assert [(i, type(e)) for i, e in failures] == [(1, errors.NotFound), (3, errors.FailedPrecondition)]
    assert list(r.batch.seq_ids) == ["a", "b", "c"] and list(r.batch.query_lens) == [1, 1, 1]
    assert list(r.batch.context_lens) == [4, 5, 5]
    assert list(r.batch.slot_mapping) == [7, 4 * 4, 5 * 4]
    r = client.step([C.append_batch_op(["a", "nope"], [1, 2])], all_or_nothing=True)
    assert not r.applied and [res.code for res in r.results] == [5]
    assert client.get_block_table("a").num_tokens == 4
    r = client.step([C.append_batch_op(["a", "b"], [1])])
    assert r.results[0].code == 3  # one token id per sequence, or none


# ---- what the client cannot send ------------------------------------------------------------------
LONE = "a\ud800"  # a Python str, but with a lone surrogate: UTF-8, and so protobuf, cannot encode it


def rpcs_answered(service) -> float:
    return sum(s.value for m in service.metrics.rpc_requests.collect() for s in m.samples
               if s.name.endswith("_total"))


@pytest.mark.parametrize("call, field", [
    (lambda c: c.allocate(LONE, num_tokens=3), "seq_id"),
    (lambda c: c.allocate("x", num_tokens=3, namespace=LONE), "cache_namespace"),
    (lambda c: c.allocate("x", num_tokens=3, request_id=LONE), "request_id"),
    (lambda c: c.allocate("x", num_tokens=1 << 40), "num_tokens"),            # beyond int32
    (lambda c: c.allocate("x", token_ids=[1, 1 << 70]), "token_ids[1]"),      # beyond int64
    (lambda c: c.append(LONE, num_tokens=1), "seq_id"),
    (lambda c: c.fork(LONE, "b"), "parent_seq_id"),
    (lambda c: c.fork("a", LONE), "child_seq_id"),
    (lambda c: c.free(LONE), "seq_id"),
    (lambda c: c.swap_out(["a", LONE]), "seq_ids[1]"),
    (lambda c: c.swap_in([LONE]), "seq_ids[0]"),
    (lambda c: c.get_block_table(LONE), "seq_id"),
    (lambda c: c.health(LONE), "service"),
    (lambda c: c.step([C.append_batch_op(["a", LONE], [1, 2])]), "seq_ids[1]"),
    (lambda c: c.step([C.allocate_op("x", num_tokens=3, namespace=LONE)]), "cache_namespace"),
    (lambda c: c.step([C.free_op("a")], request_id=LONE), "request_id"),
])
def test_what_protobuf_cannot_encode_is_refused_invalid_argument_before_anything_is_sent(served, call, field):
    client, service = served
    client.allocate("a", num_tokens=5)
    before = (len(service.requests), client.get_stats().gpu.used_blocks)
    answered = rpcs_answered(service)
    with pytest.raises(errors.InvalidArgument) as refused:
        call(client)
    message = str(refused.value)
    assert message.startswith(f"{field} ") and "cannot be sent: " in message and "\n" not in message
    assert rpcs_answered(service) == answered  # nothing reached the server
    assert (len(service.requests), client.get_stats().gpu.used_blocks) == before  # nor changed it
    assert list(client.get_block_table("a").block_ids) == [1, 2]


def test_a_token_that_cannot_be_a_header_is_refused_invalid_argument_without_showing_it(served):
    client, service = served
    answered = rpcs_answered(service)
    for token in ("s3cret\ud800", "s3crét"):
        with pytest.raises(errors.InvalidArgument, match="^token cannot be sent: its character at index") as refused:
            C.BlockManagerClient(client.target, token=token)
        assert "s3cr" not in str(refused.value)
    assert rpcs_answered(service) == answered
