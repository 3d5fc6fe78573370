"""The decode Step's AppendBatch path (manager/sequence_ops.py ``_append_batch``: in-place appends
inline, sharing one journal entry per run; new blocks inline) and the packed block tables kept
across steps (manager/batch_tables.py), against the plain per-sequence path.

The reference is a twin manager that applies the same appends as one ``AppendOp`` each, in the
same step shape: both must end in the same state (block ids, fills, hashes, pending tokens, free
and LRU order: ``tests.support.state.fingerprint``), answer the same failures and the same batch,
and roll back the same way. Every manager is checked with ``check_invariants()``, which also
verifies that a packed row marked current encodes its table.
"""

from __future__ import annotations

import random
from array import array

import pytest

from kvpager.errors import InvariantViolation, Unavailable
from kvpager.manager import BlockManager, ManagerConfig
from kvpager.manager.operations import AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, SwapInOp, SwapOutOp
from kvpager.manager.plan import StepResult, TableLayout
from kvpager.status import status_of
from tests.support.state import fingerprint


def manager(block_size: int, caching: bool = True, gpu: int = 48, max_seq_len: int = 1 << 20) -> BlockManager:
    return BlockManager(ManagerConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=32,
                                      enable_prefix_caching=caching, watermark=0.0, max_seq_len=max_seq_len))


def twins(block_size: int, caching: bool = True, gpu: int = 48, max_seq_len: int = 1 << 20
          ) -> tuple[BlockManager, BlockManager]:
    return manager(block_size, caching, gpu, max_seq_len), manager(block_size, caching, gpu, max_seq_len)


def both(ms: tuple[BlockManager, BlockManager], ops: list, **kw) -> None:
    for m in ms:
        m.step(list(ops), **kw)


def unpacked(data: bytes) -> list[int]:
    row = array("i")
    row.frombytes(data)
    return row.tolist()


def expected_padded(m: BlockManager, result: StepResult) -> list[int]:
    width = result.batch.max_blocks
    out: list[int] = []
    for seq_id in result.batch.seq_ids:
        table = m.block_table(seq_id).block_ids
        out += table + [0] * (width - len(table))
    return out


def batch_vs_singles(ms: tuple[BlockManager, BlockManager], seq_ids: list[str], tokens: list[int] | None,
                     all_or_nothing: bool = False) -> tuple[StepResult, StepResult]:
    """One AppendBatch step on ms[0], the same appends as AppendOps on ms[1]; checks they agree."""
    a, b = ms
    ra = a.step([AppendBatchOp(list(seq_ids), None if tokens is None else list(tokens))], all_or_nothing,
                layout=TableLayout.PADDED_PACKED)
    rb = b.step([AppendOp(s, None if tokens is None else [tokens[i]], 0 if tokens is not None else 1)
                 for i, s in enumerate(seq_ids)], all_or_nothing, layout=TableLayout.BOTH)
    assert ra.applied == rb.applied
    if ra.applied:
        outcome = ra.outcomes[0]
        assert outcome.result is not None
        failed = {i: status_of(err) for i, err in outcome.result.failures}  # type: ignore[union-attr]
        assert failed == {i: status_of(o.error) for i, o in enumerate(rb.outcomes) if o.error is not None}
        assert [str(err) for _, err in outcome.result.failures] == \
               [str(o.error) for o in rb.outcomes if o.error is not None]  # type: ignore[union-attr]
    assert ra.batch.seq_ids == rb.batch.seq_ids
    assert ra.batch.context_lens == rb.batch.context_lens
    assert ra.batch.query_lens == rb.batch.query_lens
    assert ra.batch.slot_mapping == rb.batch.slot_mapping
    assert ra.batch.max_blocks == rb.batch.max_blocks
    assert unpacked(ra.batch.block_tables_packed) == rb.batch.block_tables == expected_padded(a, ra)
    assert ra.plan.blocks_to_copy.pairs() == rb.plan.blocks_to_copy.pairs()
    assert fingerprint(a) == fingerprint(b)
    a.check_invariants()
    b.check_invariants()
    return ra, rb


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("caching", [True, False])
def test_decode_steps_match_single_appends(block_size, caching):
    """Many decode steps over sequences of every offset, across block boundaries (hashes
    registered as blocks fill), with prompts that share cached prefixes."""
    ms = twins(block_size, caching, gpu=400)
    rng = random.Random(block_size)
    ids = [f"s{i}" for i in range(12)]
    for i, s in enumerate(ids):
        prompt = [1, 2, 3, 4, 5, 6, 7, 8][: 1 + i % 8] + [100 + i] * (i % 5)  # shared prefixes, every length
        both(ms, [AllocateOp(s, prompt)])
    for step in range(3 * block_size + 5):
        tokens = None if step % 7 == 6 else [rng.randrange(50) for _ in ids]  # None: hash chains break
        batch_vs_singles(ms, ids, tokens)


def test_duplicates_missing_swapped_and_copy_on_write_in_one_batch():
    ms = twins(4)
    both(ms, [AllocateOp("a", [1, 2, 3]), AllocateOp("b", [1, 2, 3, 4]), AllocateOp("c", [5, 6]),
              AllocateOp("d", [7, 8, 9, 10, 11])])
    both(ms, [ForkOp("a", "a2")])          # a's last block is shared: copy-on-write on append
    both(ms, [SwapOutOp(["d"])])           # d is swapped out: FAILED_PRECONDITION
    # a twice (the second time its block is full: a new block), b at a block boundary twice,
    # c (in place) three times, a missing id, d swapped out, a2 after a copied.
    seq_ids = ["a", "b", "c", "a", "nope", "c", "b", "d", "a2", "c"]
    batch_vs_singles(ms, seq_ids, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    batch_vs_singles(ms, seq_ids, None)
    both(ms, [SwapInOp(["d"])])
    batch_vs_singles(ms, ["d", "a", "a", "a", "a", "a"], [1, 2, 3, 4, 5, 6])


@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_all_or_nothing_rolls_back_every_in_place_run(fail_at):
    ms = twins(4)
    ids = [f"s{i}" for i in range(8)]
    for i, s in enumerate(ids):
        both(ms, [AllocateOp(s, list(range(10 * i, 10 * i + 1 + i)))])  # offsets 1, 2, 3, 0, ...
    before = fingerprint(ms[0])
    seq_ids = ids[:fail_at] + ["missing"] + ids[fail_at:]
    ra, _ = batch_vs_singles(ms, seq_ids, list(range(len(seq_ids))), all_or_nothing=True)
    assert not ra.applied
    assert fingerprint(ms[0]) == before


def test_a_step_rolled_back_after_its_tables_were_packed_leaves_no_stale_row():
    """The packed rows are made before the step commits (the answer's size is checked after);
    when it rolls back, the blocks the rows named go back to the pool and another sequence may
    take them; the next rows must name the blocks each table has then."""
    m = manager(2, gpu=24)
    m.allocate("x", [1, 2, 3, 4])                                  # 2 full blocks
    m.allocate("y", [5])
    m.step([AppendBatchOp(["x", "y"], [0, 0])], layout=TableLayout.PADDED_PACKED)
    m.step([AppendBatchOp(["x", "y"], [0, 0])], layout=TableLayout.PADDED_PACKED)  # x: 3 full blocks

    def refuse(result: StepResult) -> None:
        assert unpacked(result.batch.block_tables_packed) == expected_padded(m, result)
        raise Unavailable("refused after packing")

    before = fingerprint(m)
    with pytest.raises(Unavailable):
        m.step([AppendBatchOp(["x", "y"], [1, 1])], layout=TableLayout.PADDED_PACKED, before_commit=refuse)
    assert fingerprint(m) == before
    m.check_invariants()
    m.allocate("z", [9, 9, 9])                                      # takes the block x had taken
    for _ in range(5):
        r = m.step([AppendBatchOp(["x", "y", "z"], [2, 2, 2])], layout=TableLayout.PADDED_PACKED)
        assert unpacked(r.batch.block_tables_packed) == expected_padded(m, r)
        m.check_invariants()


@pytest.mark.parametrize("ok", [True, False])
def test_a_tentative_decode_step_commits_or_undoes_its_runs(ok):
    """In-place runs, new blocks, a filled block's hash and a copy-on-write in one step whose plan
    waits on the workers (tentative: its journal entries are undone later, after another step)."""
    m, twin = twins(4)
    for x in (m, twin):
        x.allocate("a", [1, 2, 3])
        x.fork("a", "f")                                           # a's last block shared: a copy
        x.allocate("b", [4, 5, 6, 7])                              # full: a new block
        x.allocate("c", [8, 9])                                    # in place
        x.allocate("d", [1, 2, 3, 4, 5, 6, 7])                     # in place, fills its block
        x.allocate("other", [3])
    r = m.step([AppendBatchOp(["c", "a", "b", "d", "c", "d"], [1, 2, 3, 4, 5, 6])], hold_open=True,
               layout=TableLayout.PADDED_PACKED)
    assert r.step_id in m.tentative.steps and r.plan.blocks_to_copy.src
    assert unpacked(r.batch.block_tables_packed) == expected_padded(m, r)
    m.check_invariants()
    for x in (m, twin):                                            # runs beside it
        x.step([AppendBatchOp(["other"], [7])], layout=TableLayout.PADDED_PACKED)
    m.finish_tentative(r.step_id, ok)
    m.check_invariants()
    grown = {"a": 1, "b": 1, "c": 2, "d": 2, "f": 0} if ok else dict.fromkeys("abcdf", 0)
    for seq_id, n in (("a", 3), ("b", 4), ("c", 2), ("d", 7), ("f", 3)):
        assert m.block_table(seq_id).num_tokens == n + grown[seq_id]
    if not ok:  # as if the decode step never ran
        assert fingerprint(m) == fingerprint(twin)
    r = m.step([AppendBatchOp(["a", "b", "c", "d", "f"], [0] * 5)], layout=TableLayout.PADDED_PACKED)
    assert unpacked(r.batch.block_tables_packed) == expected_padded(m, r)
    m.check_invariants()


def test_a_full_pool_or_max_seq_len_falls_back_to_the_precise_errors():
    ms = twins(2, gpu=6, max_seq_len=6)  # 5 usable blocks
    both(ms, [AllocateOp("a", [1, 2]), AllocateOp("b", [3, 4]), AllocateOp("c", [5, 6, 7, 8, 9])])
    batch_vs_singles(ms, ["a", "b", "c"], [1, 2, 3])   # a, b need a block: one is left; c in place (6 = max)
    batch_vs_singles(ms, ["c", "b", "a"], [1, 2, 3])   # c at max_seq_len; the pool is full
    both(ms, [FreeOp("c")])
    batch_vs_singles(ms, ["a", "b"], None)


def test_the_invariant_checker_catches_a_stale_packed_row():
    m = manager(2, caching=False)
    m.allocate("x", [1, 2, 3])
    m.step([AppendBatchOp(["x"], [4])], layout=TableLayout.PADDED_PACKED)
    m.check_invariants()
    seq = m.block_table("x")
    seq.block_ids.append(m.gpu.allocate(""))  # a change that bypassed SequenceTable.save (a bug)
    seq.num_tokens += 1
    m.gpu.fill(seq.block_ids[-1], 1)
    with pytest.raises(InvariantViolation, match="packed block table"):
        m.check_invariants()


def test_an_error_inside_a_run_rolls_back_the_whole_step():
    """A bug inside an in-place append (here: pending tokens with no prefix hash) rolls the whole
    step back, the run's own appends included."""
    m = manager(2)
    m.allocate("a", [1])
    m.allocate("b", [2])
    m.allocate("c", [3])
    m.block_table("b").last_hash = None  # corrupt b's hash state: its block fills on this append
    state = [(s, m.block_table(s).num_tokens, list(m.block_table(s).pending_tokens or [])) for s in "abc"]
    filled = m.gpu.filled_slots
    with pytest.raises(InvariantViolation):
        m.step([AppendBatchOp(["a", "b", "c"], [5, 6, 7])])
    assert [(s, m.block_table(s).num_tokens, list(m.block_table(s).pending_tokens or [])) for s in "abc"] == state
    assert m.gpu.filled_slots == filled
