"""StepRequest.table_layout, through a real server on a loopback port: each value answers the
block-table forms it names and only those, the padded table (as a list or packed) and the CSR
one describe the same blocks (and GetBlockTable's), also after rollbacks, swaps and
copy-on-write, an unset field answers both as before, and a number the enum does not name is
refused before anything is applied.

Pool: block size 4, 64 GPU blocks, 16 CPU blocks, no watermark (invariants checked after each test).
"""

from __future__ import annotations

import pytest

from kvpager import client as C, errors
from kvpager.manager import BlockManager, ManagerConfig
from kvpager.manager.operations import AllocateOp
from kvpager.manager.plan import TableLayout
from kvpager.step import StepInput, unpack_int32
from kvpager.v1 import block_manager_pb2 as pb

from ..conftest import running_server

BLOCK = 4
LAYOUTS = [pb.TABLE_LAYOUT_BOTH, pb.TABLE_LAYOUT_PADDED, pb.TABLE_LAYOUT_CSR, pb.TABLE_LAYOUT_NONE,
           pb.TABLE_LAYOUT_PADDED_PACKED]
HAS_PADDED = {pb.TABLE_LAYOUT_BOTH, pb.TABLE_LAYOUT_PADDED}
HAS_PACKED = {pb.TABLE_LAYOUT_PADDED_PACKED}
HAS_CSR = {pb.TABLE_LAYOUT_BOTH, pb.TABLE_LAYOUT_CSR}


@pytest.fixture
def served():
    with running_server(ManagerConfig(block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=16, watermark=0.0)) as pair:
        yield pair


def populate(client: C.BlockManagerClient) -> list[str]:
    """Sequences of different lengths, two sharing blocks by a fork, one swapped out and back in."""
    client.allocate("a", token_ids=list(range(9)))          # 3 blocks, last one holds 1 token
    client.allocate("b", token_ids=list(range(100, 104)))   # 1 full block
    client.allocate("c", num_tokens=22)                     # 6 blocks
    client.fork("a", "a2")                                  # shares all of a's blocks
    client.swap_out(["b"])
    client.swap_in(["b"])
    return ["a", "b", "c", "a2"]


def decode(client: C.BlockManagerClient, seq_ids: list[str], layout: int) -> pb.StepResponse:
    reply = client.step([C.append_batch_op(seq_ids, [5] * len(seq_ids))], table_layout=layout)
    assert reply.applied and not reply.results[0].append_batch.failed_indices
    return reply


def padded_rows(batch: pb.BatchTables) -> list[list[int]]:
    width = batch.max_blocks
    flat = list(unpack_int32(batch.block_tables_packed)) if batch.block_tables_packed else list(batch.block_tables)
    return [flat[i * width:(i + 1) * width] for i in range(len(batch.seq_ids))]


def csr_rows(batch: pb.BatchTables) -> list[list[int]]:
    ptr, idx = list(batch.kv_indptr), list(batch.kv_indices)
    return [idx[ptr[i]:ptr[i + 1]] for i in range(len(batch.seq_ids))]


def check_rows(client: C.BlockManagerClient, batch: pb.BatchTables, layout: int) -> None:
    """The forms the layout names are there and agree with GetBlockTable; the others are empty."""
    tables = [list(client.get_block_table(s).block_ids) for s in batch.seq_ids]
    assert batch.max_blocks == max(map(len, tables))
    assert list(batch.context_lens) == [client.get_block_table(s).num_tokens for s in batch.seq_ids]
    if layout in HAS_PADDED | HAS_PACKED:
        packed = layout in HAS_PACKED
        assert len(batch.block_tables_packed if packed else batch.block_tables) == \
            len(tables) * batch.max_blocks * (4 if packed else 1)
        for row, table in zip(padded_rows(batch), tables):
            assert row == table + [0] * (batch.max_blocks - len(table))
    if layout not in HAS_PADDED:
        assert len(batch.block_tables) == 0
    if layout not in HAS_PACKED:
        assert batch.block_tables_packed == b""
    if layout in HAS_CSR:
        assert csr_rows(batch) == tables
        assert list(batch.kv_last_page_len) == [n - (len(t) - 1) * BLOCK for n, t in zip(batch.context_lens, tables)]
    else:
        assert len(batch.kv_indptr) == len(batch.kv_indices) == len(batch.kv_last_page_len) == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: pb.TableLayout.Name(v))
def test_each_layout_answers_its_tables_only(served, layout):
    client, _ = served
    seq_ids = populate(client)
    reply = decode(client, seq_ids, layout)
    batch = reply.batch
    # The rows that do not depend on the layout are always there.
    assert list(batch.seq_ids) == seq_ids
    assert list(batch.query_lens) == [1] * len(seq_ids)
    assert len(batch.slot_mapping) == len(seq_ids)
    check_rows(client, batch, layout)
    # The copy-on-write of a's (or a2's) shared last block is in the plan whatever the layout.
    assert len(reply.plan.blocks_to_copy.src) == 1


def test_layouts_answer_the_same_tables_step_after_step(served):
    """Decode steps asked in every layout in turn, across block boundaries: each answer agrees
    with GetBlockTable, and the padded rows of BOTH are its CSR rows, padded with block 0."""
    client, _ = served
    seq_ids = populate(client)
    for _ in range(3):
        for layout in LAYOUTS:
            batch = decode(client, seq_ids, layout).batch
            check_rows(client, batch, layout)
            if layout == pb.TABLE_LAYOUT_BOTH:
                assert padded_rows(batch) == [row + [0] * (batch.max_blocks - len(row)) for row in csr_rows(batch)]


def test_packed_tables_follow_rollbacks_swaps_and_copy_on_write(served):
    """The manager reuses each sequence's packed row while its table is unchanged: a step rolled
    back, a swap out and in, a fork's copy-on-write and new blocks must all show in the next
    packed answer."""
    client, _ = served
    seq_ids = populate(client)
    packed = pb.TABLE_LAYOUT_PADDED_PACKED
    check_rows(client, decode(client, seq_ids, packed).batch, packed)
    # Appends that take blocks and copy, then rolled back whole by a failing operation.
    for _ in range(3):
        r = client.step([C.append_batch_op(seq_ids, [5] * len(seq_ids)), C.append_op("nope", num_tokens=1)],
                        all_or_nothing=True, table_layout=packed)
        assert not r.applied and r.batch.block_tables_packed == b""
        check_rows(client, decode(client, seq_ids, packed).batch, packed)
    client.swap_out(["c", "b"])
    client.swap_in(["c", "b"])
    check_rows(client, decode(client, seq_ids, packed).batch, packed)
    client.fork("c", "c2")  # c's last block is shared now: c's next append copies it
    reply = decode(client, seq_ids + ["c2"], packed)
    assert len(reply.plan.blocks_to_copy.src) >= 1
    check_rows(client, reply.batch, packed)
    for _ in range(BLOCK + 1):
        check_rows(client, decode(client, seq_ids, packed).batch, packed)


def test_unset_layout_answers_both_as_before(served):
    client, _ = served
    seq_ids = populate(client)
    request = pb.StepRequest(operations=[C.append_batch_op(seq_ids, [5] * len(seq_ids))])
    assert request.table_layout == pb.TABLE_LAYOUT_BOTH  # an old caller's request: the field is not on the wire
    assert request.SerializeToString() == pb.StepRequest(operations=request.operations).SerializeToString()
    reply = client.stub.Step(request, timeout=10)
    check_rows(client, reply.batch, pb.TABLE_LAYOUT_BOTH)
    check_rows(client, client.step([C.append_op("c", num_tokens=1)]).batch, pb.TABLE_LAYOUT_BOTH)


def test_unknown_layout_is_invalid_argument_and_applies_nothing(served):
    client, _ = served
    client.allocate("a", num_tokens=5)
    steps = client.get_stats().steps
    with pytest.raises(errors.InvalidArgument, match="table_layout 9 is none of"):
        client.step([C.append_op("a", num_tokens=1)], table_layout=9)
    assert client.get_block_table("a").num_tokens == 5
    assert client.get_stats().steps == steps


def test_step_input_needs_the_padded_tables(served):
    client, _ = served
    seq_ids = populate(client)
    for layout in LAYOUTS:
        reply = decode(client, seq_ids, layout)
        positions = [n - 1 for n in reply.batch.context_lens]
        if layout in HAS_PADDED | HAS_PACKED:
            step = StepInput.from_step_reply(reply, [5] * len(seq_ids), positions)
            step.check()
            assert list(step.block_tables) == [b for row in padded_rows(reply.batch) for b in row]
        else:
            with pytest.raises(ValueError, match="no padded block tables"):
                StepInput.from_step_reply(reply, [5] * len(seq_ids), positions)


@pytest.mark.parametrize("layout, fits", [(TableLayout.BOTH, False), (TableLayout.PADDED, True),
                                          (TableLayout.CSR, True), (TableLayout.NONE, True),
                                          (TableLayout.PADDED_PACKED, True)])
def test_reply_bound_counts_only_the_tables_sent(layout, fits):
    """A 480-token prompt (30 blocks) charges its slots twice (960 numbers) and its table once
    per copy in the answer (the result's, and one per layout): both layouts (1,050) exceed a
    1,024-byte bound, one layout (1,020) or none (990) does not."""
    mgr = BlockManager(ManagerConfig(block_size=16, num_gpu_blocks=64, max_reply_bytes=1024))
    result = mgr.step([AllocateOp("a", num_tokens=480)], layout=layout)
    error = result.outcomes[0].error
    assert isinstance(error, errors.OutOfRange) if not fits else error is None
    assert len(result.batch.block_tables) == (30 if fits and layout.padded else 0)
    assert len(result.batch.kv_indices) == (30 if fits and layout.csr else 0)
    assert len(result.batch.block_tables_packed) == (4 * 30 if fits and layout.packed else 0)
    assert result.batch.kv_indptr == ([0, 30] if fits and layout.csr else [0] if layout.csr else [])
    mgr.check_invariants()


def test_the_reference_scheduler_asks_for_the_packed_padded_tables_only(served):
    """Every Step the scheduler sends asks for TABLE_LAYOUT_PADDED_PACKED, and its StepInputs
    (built from those answers) hold the tables GetBlockTable gives."""
    import torch

    from kvpager.scheduler import Request, SamplingParams, Scheduler

    client, _ = served
    layouts, replies = [], []
    step = client.step

    def recording_step(ops, *args, **kwargs):
        layouts.append(kwargs.get("table_layout", pb.TABLE_LAYOUT_BOTH))
        replies.append(step(ops, *args, **kwargs))
        return replies[-1]

    def runner(step_input: StepInput) -> torch.Tensor:
        step_input.check()
        width = step_input.max_blocks
        for i, seq_id in enumerate(replies[-1].batch.seq_ids):
            table = list(client.get_block_table(seq_id).block_ids)
            assert list(step_input.block_tables[i * width:i * width + len(table)]) == table
        return torch.zeros(sum(1 for q in step_input.query_lens if q), dtype=torch.long)

    client.step = recording_step
    requests = [Request(f"r{i}", list(range(3 + 5 * i)), SamplingParams(max_new_tokens=6, n=1 + i % 2))
                for i in range(4)]
    outputs = Scheduler(client, runner, block_size=BLOCK).run(requests)
    assert sorted(outputs) == [r.request_id for r in requests]
    assert layouts and set(layouts) == {pb.TABLE_LAYOUT_PADDED_PACKED}
    assert all(len(r.batch.kv_indices) == len(r.batch.kv_indptr) == len(r.batch.block_tables) == 0 for r in replies)
