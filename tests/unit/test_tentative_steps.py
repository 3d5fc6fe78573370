"""Tentative steps (manager/tentative.py): a step whose plan is with the workers stays applied but
uncommitted while other steps run, then commits or rolls back. Each scenario below is one that
breaks a naive undo when another step runs in between; after each, the invariants hold (no block
leaked or double-owned) and the sequences have the tables they should."""

from __future__ import annotations

import pytest

from kvpager.manager import BlockManager, ManagerConfig
from kvpager.manager.block_pool import CACHED, FREE, USED
from kvpager.errors import Busy, ResourceExhausted, Unavailable
from kvpager.manager.operations import AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, SwapInOp, SwapOutOp

from tests.support.state import fingerprint

B = 2


def manager(gpu: int = 17, cpu: int = 8) -> BlockManager:
    return BlockManager(ManagerConfig(block_size=B, num_gpu_blocks=gpu, num_cpu_blocks=cpu))


def tentative(m: BlockManager, *ops) -> int:
    """Apply ops as a step whose plan the workers have not answered yet; returns its step id."""
    result = m.step(list(ops), hold_open=True)
    assert result.step_id in m.tentative.steps, result.plan
    m.check_invariants()
    return result.step_id


def table(m: BlockManager, seq_id: str) -> list[int]:
    return list(m.block_table(seq_id).block_ids)


@pytest.mark.parametrize("ok", [True, False])
def test_a_shared_block_it_dropped_survives_the_other_sharer_being_freed(ok):
    m = manager()
    m.allocate("p", [1, 2, 3])                 # 2 blocks, the last one partial
    m.fork("p", "c")                           # c shares both
    shared = table(m, "c")
    step = tentative(m, AppendOp("c", [4]))    # copy-on-write of the shared last block
    assert table(m, "c")[-1] != shared[-1]
    m.free("p")                                # not busy: runs beside the tentative step
    m.check_invariants()
    assert m.gpu.blocks[shared[-1]].state == USED   # pinned: not reusable yet
    m.allocate("other", list(range(20)))           # takes whatever is free; must not get it
    assert shared[-1] not in table(m, "other")
    m.finish_tentative(step, ok)
    m.check_invariants()
    if ok:
        assert m.block_table("c").num_tokens == 4 and table(m, "c")[-1] != shared[-1]
        assert m.gpu.blocks[shared[-1]].state in (FREE, CACHED)
    else:
        assert table(m, "c") == shared and m.block_table("c").num_tokens == 3
        assert m.gpu.blocks[shared[-1]].ref_count == 1


@pytest.mark.parametrize("ok", [True, False])
def test_swapping_out_one_fork_while_its_sibling_is_freed(ok):
    m = manager()
    m.allocate("p", [1, 2, 3, 4, 5])
    m.fork("p", "c")
    shared = table(m, "c")
    step = tentative(m, SwapOutOp(["c"]))
    m.free("p")
    m.check_invariants()
    m.allocate("q", list(range(7)))            # needs 4 GPU blocks: none of c's old ones
    assert not set(shared) & set(table(m, "q"))
    m.finish_tentative(step, ok)
    m.check_invariants()
    assert m.block_table("c").tier == ("cpu" if ok else "gpu")
    if not ok:
        assert table(m, "c") == shared


@pytest.mark.parametrize("ok", [True, False])
def test_blocks_it_registered_are_not_found_by_another_prompt_until_it_commits(ok):
    m = manager()
    m.allocate("v", [9, 9, 9])
    prompt = [1, 2, 3, 4, 5]
    step = tentative(m, AllocateOp("a", prompt), SwapOutOp(["v"]))
    assert m.allocate("b", prompt).num_cached_tokens == 0     # a's blocks are hidden
    m.finish_tentative(step, ok)
    m.check_invariants()
    assert ("a" in m.seqs) == ok
    # The prefix was a's (the first block with a hash wins): committed, it is found; rolled back,
    # it is gone with a's blocks (b's blocks were not registered under it).
    assert m.allocate("c", prompt).num_cached_tokens == (4 if ok else 0)


def test_a_cached_block_it_evicted_comes_back_free_since_the_workers_may_have_written_it():
    m = manager(gpu=5)                         # 4 usable blocks: block 0 is the null block
    prompt = [1, 2, 3]
    m.allocate("a", prompt)
    m.free("a")                                # its full first block stays CACHED
    evicted = m.gpu.lookup(next(iter(m.gpu.cache.hashes())))
    assert m.gpu.num_cached == 1
    m.allocate("v", [7])
    # Takes the 2 free blocks and evicts the cached one (hash of [1, 2]); a plan: the swap-out.
    step = tentative(m, AllocateOp("x", [5, 6, 7, 8, 9, 9]), SwapOutOp(["v"]))
    assert evicted in table(m, "x")
    with pytest.raises(ResourceExhausted):
        m.allocate("b", prompt)                # no room at all now
    m.finish_tentative(step, False)
    m.check_invariants()
    # Its plan may have reached some workers (it does, here: a copy or swap-in target could be
    # this block), so its old prefix is not served from it again.
    assert m.gpu.blocks[evicted].state == FREE
    assert m.allocate("b", prompt).num_cached_tokens == 0


def test_a_block_it_evicted_whose_prefix_another_step_registered_meanwhile_comes_back_free():
    m = manager(gpu=9)
    m.allocate("a", [1, 2, 3])
    m.free("a")                                # E: hash of [1, 2], CACHED
    evicted = m.gpu.lookup(next(iter(m.gpu.cache.hashes())))
    m.allocate("v", [7])
    m.allocate("w", [8, 8, 8, 8])
    # x takes the 4 free blocks and evicts E; its plan (v's swap-out) waits.
    step = tentative(m, AllocateOp("x", [4] * 9), SwapOutOp(["v"]))
    assert evicted in table(m, "x")
    m.free("w")                                # beside it: w's blocks become CACHED
    assert m.allocate("b", [1, 2, 3]).num_cached_tokens == 0   # evicts w's; registers [1, 2] anew
    m.finish_tentative(step, False)
    m.check_invariants()
    assert m.gpu.blocks[evicted].state == FREE   # its prefix is b's block now
    assert m.allocate("c", [1, 2, 3]).num_cached_tokens == 2


def test_a_cache_hit_it_took_rejoins_the_lru_validly_after_the_lru_changed():
    m = manager(gpu=12)
    for i, prompt in enumerate(([1, 2, 9], [3, 4, 9], [5, 6, 9])):
        m.allocate(f"s{i}", prompt)
        m.free(f"s{i}")                        # three cached blocks in LRU order
    m.allocate("v", [7])
    step = tentative(m, AllocateOp("hit", [3, 4, 8]), SwapOutOp(["v"]))   # takes the middle one
    assert m.allocate("u", [1, 2, 8]).num_cached_tokens == 2            # takes its LRU neighbour
    m.finish_tentative(step, False)
    m.check_invariants()
    assert m.gpu.num_cached == 2


def test_a_call_naming_a_sequence_of_a_tentative_step_is_busy_and_changes_nothing():
    m = manager()
    m.allocate("p", [1, 2, 3])
    m.fork("p", "c")
    step = tentative(m, AppendOp("c", [4]))
    steps = m.steps
    for op in (AppendOp("c", [5]), FreeOp("c"), ForkOp("c", "d"), SwapOutOp(["c", "p"])):
        with pytest.raises(Busy) as info:
            m.run(op)
        assert info.value.step.step_id == step
    assert m.steps == steps                    # no step id spent by a refused call
    m.append("p", [6])                         # its sibling is not busy
    m.finish_tentative(step, True)
    m.append("c", [5])
    m.check_invariants()


def test_freeing_and_reusing_an_id_waits_for_the_step():
    m = manager()
    m.allocate("a", [1, 2, 3])
    m.allocate("v", [7])
    step = tentative(m, FreeOp("a"), SwapOutOp(["v"]))
    with pytest.raises(Busy):
        m.allocate("a", [5])                   # the id is the tentative step's until it finishes
    m.finish_tentative(step, False)
    assert table(m, "a") and m.block_table("a").num_tokens == 3
    m.check_invariants()


@pytest.mark.parametrize("ok", [True, False])
def test_a_waiting_steps_counts_join_the_totals_only_when_it_commits(ok):
    # Prometheus reads the counters while the step waits: they must never go back afterwards.
    m = manager()
    m.allocate("a", [1, 2, 3])
    m.allocate("b", [4, 5, 6])
    step = tentative(m, SwapOutOp(["a"]))
    assert m.counters.preemptions == 0 and m.counters.blocks_swapped_out == 0   # not yet
    m.swap_out(["b"])
    assert m.counters.preemptions == 1 and m.counters.blocks_swapped_out == 2
    m.finish_tentative(step, ok, None if ok else Unavailable("the workers failed its plan"))
    assert (m.counters.preemptions, m.counters.blocks_swapped_out) == ((2, 4) if ok else (1, 2))
    assert m.op_counts.applied["swap_out"] == 1 + ok
    assert m.op_counts.failed.get(("swap_out", "UNAVAILABLE"), 0) == (not ok)
    m.check_invariants()


def test_an_eviction_undone_into_a_free_block_stays_counted():
    # A rolled-back step's eviction whose block comes back FREE (the workers may have written it)
    # lost its prefix all the same: the count stays, as a scrape during the wait saw it.
    m = manager(gpu=5)
    m.allocate("a", [1, 2, 3])
    m.free("a")
    m.allocate("v", [7])
    step = tentative(m, AllocateOp("x", [5, 6, 7, 8, 9, 9]), SwapOutOp(["v"]))
    assert m.gpu.evictions == 1
    m.finish_tentative(step, False)
    assert m.gpu.evictions == 1
    m.check_invariants()


def test_a_fork_rolled_back_after_its_parent_was_freed_releases_the_blocks():
    m = manager()
    m.allocate("p", [1, 2, 3])
    m.allocate("v", [7])
    blocks = table(m, "p")
    step = tentative(m, ForkOp("p", "c"), SwapOutOp(["v"]))
    with pytest.raises(Busy):
        m.free("p")                            # the parent is named by the step: busy
    m.finish_tentative(step, True)
    step = tentative(m, FreeOp("p"), SwapInOp(["v"]))   # c shares p's blocks; p freed tentatively
    m.free("c")                                # beside it: the blocks' last table reference goes
    assert all(m.gpu.blocks[b].state == USED for b in blocks)   # pinned
    m.finish_tentative(step, False)            # p is back, holding its blocks alone
    m.check_invariants()
    assert table(m, "p") == blocks and all(m.gpu.blocks[b].ref_count == 1 for b in blocks)


def test_a_prefix_hit_rolled_back_after_the_other_sharer_was_freed_releases_the_block():
    m = manager()
    m.allocate("p", [1, 2, 3])
    m.allocate("v", [7])
    shared = table(m, "p")[0]
    step = tentative(m, AllocateOp("c", [1, 2, 9]), SwapOutOp(["v"]))   # hits p's first block
    assert table(m, "c")[0] == shared
    m.free("p")
    m.finish_tentative(step, False)            # c's reference was the last: the block is CACHED
    m.check_invariants()
    assert m.gpu.blocks[shared].state == CACHED and m.gpu.blocks[shared].ref_count == 0


def test_a_block_it_dropped_and_took_back_for_a_swap_in_rolls_back_exactly():
    m = manager()
    m.allocate("p", [1, 2, 3, 4, 5])
    m.fork("p", "p2")
    m.allocate("s", [1, 2, 3, 4, 9])           # shares p's two full blocks
    m.swap_out(["s"])                          # its CPU copies carry their prefix hashes
    shared = table(m, "p")
    # Both forks freed (the first drops a reference, the second releases), then s swapped in:
    # it takes the released blocks back by their hashes, within the same step.
    step = tentative(m, FreeOp("p"), FreeOp("p2"), SwapInOp(["s"]))
    assert table(m, "s")[:2] == shared[:2]
    m.finish_tentative(step, False)
    m.check_invariants()
    assert table(m, "p") == table(m, "p2") == shared and m.block_table("s").tier == "cpu"


def test_while_draining_for_a_snapshot_a_step_that_would_open_another_waits_and_changes_nothing():
    # A due snapshot waits for the open steps (Durability.commit sets ``draining``): a step whose
    # plan would move blocks (a swap, an append's copy-on-write) is undone whole and waits for
    # them, no step id spent; every other step, plain appends among them, runs beside them.
    m = manager()
    m.allocate("a", [1, 2, 3])
    m.allocate("b", [4, 5, 6])
    m.fork("b", "b2")                          # b's last block shared: its next append copies it
    step = tentative(m, SwapOutOp(["a"]))
    m.dispatch = lambda plan: None             # workers attached: a step that moves blocks becomes tentative
    m.tentative.draining = True
    steps, before = m.steps, fingerprint(m)
    for op in (SwapOutOp(["b2"]), AppendOp("b", [7]), AppendBatchOp(["b"], [7])):
        with pytest.raises(Busy) as info:
            m.step([AllocateOp("c", [8]), op])
        assert info.value.step.step_id == step
        assert m.steps == steps and fingerprint(m) == before
    m.step([AllocateOp("c", [8]), ForkOp("c", "d"), FreeOp("d"), AppendOp("c", [9])])
    assert m.block_table("c").num_tokens == 2
    m.finish_tentative(step, True)
    m.append("b", [7])                         # none open: nothing to wait for
    m.swap_out(["b2"])
    assert m.block_table("b2").tier == "cpu"
    m.check_invariants()
