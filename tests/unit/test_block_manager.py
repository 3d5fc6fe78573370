"""The block manager in-process (no gRPC), with exact expectations: block ids, ref counts,
free / cached / used counts, slot mappings, plans and block tables.

Unless a test says otherwise the pool is: block size 4, 17 GPU blocks (block 0 is the null
block, never handed out: 16 usable), 8 CPU blocks, no watermark. A fresh pool hands out free
blocks in id order (GPU blocks from 1, CPU blocks from 0); released blocks join the tail of
the free list (tail of a sequence first) or, when they hold a hashed full block, the tail of
the LRU. Every manager a test builds is checked with ``check_invariants()`` at teardown.
"""

from __future__ import annotations

import pytest

from kvpager.manager import (
    Aborted, AlreadyExists, BlockManager, FailedPrecondition, InvalidArgument, ManagerConfig, NotFound,
    OutOfRange, ResourceExhausted,
)
from kvpager.manager.block_manager import MAX_SEQ_ID_LEN
from kvpager.errors import Unavailable
from kvpager.manager.operations import (
    AllocateOp, AppendOp, ForkOp, FreeOp, RejectedOp, SwapInOp, SwapOutOp,
)
from kvpager.manager.plan import TierStats
from tests.support.state import fingerprint

DEFAULTS = dict(block_size=4, num_gpu_blocks=17, num_cpu_blocks=8, watermark=0.0)


@pytest.fixture
def make():
    made: list[BlockManager] = []

    def factory(**overrides) -> BlockManager:
        manager = BlockManager(ManagerConfig(**{**DEFAULTS, **overrides}))
        made.append(manager)
        return manager

    yield factory
    for manager in made:
        manager.check_invariants()


@pytest.fixture
def m(make) -> BlockManager:
    return make()


# ---- helpers ----------------------------------------------------------------------------------------
def fails(m: BlockManager, error: type, fn, *args, match: str | None = None, **kwargs):
    """Call fn, expect ``error``, and check that the failure left no trace."""
    before = fingerprint(m)
    with pytest.raises(error, match=match) as info:
        fn(*args, **kwargs)
    assert type(info.value) is error
    assert fingerprint(m) == before
    m.check_invariants()
    return info.value


def refs(m: BlockManager, *ids: int, tier: str = "gpu") -> list[int]:
    pool = m.gpu if tier == "gpu" else m.cpu
    return [pool.blocks[b].ref_count for b in ids]


def filled(m: BlockManager, *ids: int, tier: str = "gpu") -> list[int]:
    pool = m.gpu if tier == "gpu" else m.cpu
    return [pool.blocks[b].num_filled for b in ids]


def table(m: BlockManager, seq_id: str) -> list[int]:
    return list(m.block_table(seq_id).block_ids)


def tier_stats(m: BlockManager, tier: str = "gpu") -> TierStats:
    return getattr(m.stats(), tier)


def slots_of(block_ids: list[int], start: int, end: int, block_size: int = 4) -> list[int]:
    return [block_ids[i // block_size] * block_size + i % block_size for i in range(start, end)]


# ---- allocate ----------------------------------------------------------------------------------------
def test_allocate_with_token_ids(m):
    r = m.allocate("a", list(range(10)))
    assert r.seq_id == "a"
    assert r.block_ids == [1, 2, 3]
    assert r.slot_mapping == list(range(4, 14))
    assert r.num_cached_tokens == 0
    assert refs(m, 1, 2, 3) == [1, 1, 1]
    assert filled(m, 1, 2, 3) == [4, 4, 2]
    # Full blocks are registered for prefix caching, the partial last one is not.
    assert m.gpu.hash_of(1) is not None and m.gpu.hash_of(2) is not None and m.gpu.hash_of(3) is None
    seq = m.block_table("a")
    assert (seq.block_ids, seq.num_tokens, seq.tier, seq.pending_tokens) == ([1, 2, 3], 10, "gpu", [8, 9])
    s = m.stats()
    assert s.gpu == TierStats(16, 3, 13, 0)
    assert s.cpu == TierStats(8, 0, 8, 0)
    assert (s.running_sequences, s.swapped_sequences) == (1, 0)
    assert s.gpu_utilization == 3 / 16
    assert s.internal_fragmentation == pytest.approx(2 / 12)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (10, 0)
    assert m.gpu.free_order() == list(range(4, 17))
    m.check_invariants()


def test_allocate_with_a_count_only(m):
    r = m.allocate("a", num_tokens=5)
    assert (r.block_ids, r.slot_mapping, r.num_cached_tokens) == ([1, 2], [4, 5, 6, 7, 8], 0)
    assert m.gpu.hash_of(1) is None  # nothing to hash without token ids
    seq = m.block_table("a")
    assert seq.last_hash is None and seq.pending_tokens is None
    # Same length, no ids: no sharing.
    r = m.allocate("b", num_tokens=5)
    assert (r.block_ids, r.slot_mapping, r.num_cached_tokens) == ([3, 4], [12, 13, 14, 15, 16], 0)
    # Ids and a count that agree are fine.
    r = m.allocate("c", [1, 2, 3], num_tokens=3)
    assert r.block_ids == [5] and r.slot_mapping == [20, 21, 22]
    s = m.stats()
    assert s.gpu == TierStats(16, 5, 11, 0)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (3, 0)  # count-only prompts are not queried
    m.check_invariants()


def test_gpu_block_0_is_the_null_block_and_never_handed_out(make):
    m = make(num_gpu_blocks=3, num_cpu_blocks=2)  # 2 usable GPU blocks
    assert m.gpu.blocks[0].state == "null" and 0 not in m.gpu.free_order()
    assert m.stats().gpu == TierStats(2, 0, 2, 0) and m.stats().cpu == TierStats(2, 0, 2, 0)
    assert m.allocate("a", num_tokens=8).block_ids == [1, 2]  # the whole usable pool
    assert m.stats().gpu_utilization == 1.0
    fails(m, ResourceExhausted, m.allocate, "b", num_tokens=1, match="needs 1 free GPU blocks, 0 are free")
    fails(m, OutOfRange, m.append, "a", num_tokens=1, match="GPU pool has 2")
    m.swap_out(["a"])  # the CPU pool has no null block: CPU block 0 is a block like any other
    assert table(m, "a") == [0, 1]
    assert m.swap_in(["a"]).mapping.dst == [2, 1]  # the GPU free list, tail of the sequence first
    m.free("a")
    assert m.gpu.free_order() == [1, 2] and m.gpu.blocks[0].state == "null"
    with pytest.raises(InvalidArgument, match="num_gpu_blocks >= 2"):
        BlockManager(ManagerConfig(**{**DEFAULTS, "num_gpu_blocks": 1}))


def test_slot_is_block_id_times_block_size_plus_offset(m):
    m.allocate("x", num_tokens=56)  # blocks 1..14
    m.free("x")  # released tail first: 14, 13, ..., 1 join the free list after 15, 16
    assert m.gpu.free_order() == [15, 16] + list(range(14, 0, -1))
    r = m.allocate("y", num_tokens=10)
    assert r.block_ids == [15, 16, 14]
    assert r.slot_mapping == [60, 61, 62, 63, 64, 65, 66, 67, 56, 57]
    assert r.slot_mapping == slots_of(r.block_ids, 0, 10)
    a = m.append("y", num_tokens=3)
    assert a.slot_mapping == [58, 59, 52] and a.new_block_ids == [13]
    m.check_invariants()


# ---- append -------------------------------------------------------------------------------------------
def test_append_without_a_new_block(m):
    m.allocate("a", num_tokens=5)
    r = m.append("a", [7])
    assert (r.seq_id, r.slot_mapping, r.new_block_ids, r.num_tokens) == ("a", [9], [], 6)
    assert len(r.copies) == 0
    assert table(m, "a") == [1, 2] and filled(m, 1, 2) == [4, 2]
    assert tier_stats(m) == TierStats(16, 2, 14, 0)
    m.check_invariants()


def test_append_with_a_new_block(m):
    m.allocate("a", num_tokens=4)
    r = m.append("a", num_tokens=1)
    assert (r.slot_mapping, r.new_block_ids, r.num_tokens) == ([8], [2], 5)
    assert table(m, "a") == [1, 2] and filled(m, 1, 2) == [4, 1]
    assert tier_stats(m) == TierStats(16, 2, 14, 0)
    m.check_invariants()


def test_append_several_tokens_spanning_blocks(m):
    m.allocate("a", num_tokens=3)
    r = m.append("a", [10, 11, 12, 13, 14, 15])  # speculative tokens: 1 in block 1, 4 in a new one, 1 more
    assert r.slot_mapping == [7, 8, 9, 10, 11, 12]
    assert r.new_block_ids == [2, 3]
    assert r.num_tokens == 9
    assert table(m, "a") == [1, 2, 3] and filled(m, 1, 2, 3) == [4, 4, 1]
    assert refs(m, 1, 2, 3) == [1, 1, 1]
    m.check_invariants()


# ---- fork and copy-on-write ------------------------------------------------------------------------------
def test_fork_shares_blocks_then_copy_on_write(m):
    m.allocate("p", [10, 11, 12, 13, 14, 15])  # blocks 1 (full, hashed), 2 (2 of 4)
    f = m.fork("p", "c")
    assert (f.child_seq_id, f.block_ids) == ("c", [1, 2])
    assert refs(m, 1, 2) == [2, 2]
    assert tier_stats(m) == TierStats(16, 2, 14, 0)  # no copy at fork time
    assert m.stats().cow_copies == 0

    r = m.append("p", [16])  # p writes into the shared partial block: copy it first
    assert r.copies.pairs() == [(2, 3)]
    assert r.new_block_ids == [3] and r.slot_mapping == [14] and r.num_tokens == 7
    assert table(m, "p") == [1, 3] and table(m, "c") == [1, 2]
    assert refs(m, 1, 2, 3) == [2, 1, 1]
    assert filled(m, 2, 3) == [2, 3]
    assert m.stats().cow_copies == 1

    r = m.append("c", [26])  # block 2 is c's alone now: no copy
    assert len(r.copies) == 0 and r.new_block_ids == [] and r.slot_mapping == [10]
    assert filled(m, 2) == [3]

    # Both fill their private blocks, which get registered under their own (diverged) prefixes.
    m.append("p", [17])
    m.append("c", [27])
    assert m.gpu.hash_of(2) is not None and m.gpu.hash_of(3) is not None
    assert m.gpu.hash_of(2) != m.gpu.hash_of(3)
    q = m.allocate("q", [10, 11, 12, 13, 14, 15, 16, 17, 1])
    assert q.block_ids == [1, 3, 4] and q.num_cached_tokens == 8
    r2 = m.allocate("r", [10, 11, 12, 13, 14, 15, 26, 27, 1])
    assert r2.block_ids == [1, 2, 5] and r2.num_cached_tokens == 8
    assert refs(m, 1, 2, 3, 4, 5) == [4, 2, 2, 1, 1]
    assert m.stats().cow_copies == 1
    m.check_invariants()


def test_fork_with_a_full_last_block_needs_no_copy(m):
    m.allocate("p", num_tokens=8)
    m.fork("p", "c")
    r = m.append("p", num_tokens=1)
    assert len(r.copies) == 0 and r.new_block_ids == [3] and r.slot_mapping == [12]
    assert table(m, "p") == [1, 2, 3] and table(m, "c") == [1, 2]
    assert refs(m, 1, 2, 3) == [2, 2, 1]
    assert m.stats().cow_copies == 0
    m.check_invariants()


def test_fork_of_a_fork_copies_once_per_writer(m):
    m.allocate("a", num_tokens=2)
    m.fork("a", "b")
    m.fork("b", "c")
    assert refs(m, 1) == [3]
    r = m.append("c", num_tokens=1)
    assert r.copies.pairs() == [(1, 2)] and refs(m, 1, 2) == [2, 1]
    r = m.append("a", num_tokens=1)
    assert r.copies.pairs() == [(1, 3)] and refs(m, 1, 2, 3) == [1, 1, 1]
    r = m.append("b", num_tokens=1)  # the last holder writes in place
    assert len(r.copies) == 0 and r.slot_mapping == [6]
    assert (table(m, "a"), table(m, "b"), table(m, "c")) == ([3], [1], [2])
    assert filled(m, 1, 2, 3) == [3, 3, 3]
    assert m.stats().cow_copies == 2
    m.check_invariants()


# ---- free ---------------------------------------------------------------------------------------------
def test_free_returns_blocks_and_shared_ones_survive_until_the_last_holder(m):
    m.allocate("a", num_tokens=5)
    m.fork("a", "b")
    r = m.free("a")
    assert (r.seq_id, r.num_blocks_released) == ("a", 0)
    assert "a" not in m.seqs and refs(m, 1, 2) == [1, 1]
    assert tier_stats(m) == TierStats(16, 2, 14, 0)
    m.check_invariants()
    r = m.free("b")
    assert r.num_blocks_released == 2
    assert tier_stats(m) == TierStats(16, 0, 16, 0)
    assert m.gpu.free_order() == list(range(3, 17)) + [2, 1]
    assert m.stats().running_sequences == 0
    m.check_invariants()


def test_free_of_a_swapped_sequence_returns_its_cpu_blocks(m):
    m.allocate("a", num_tokens=6)
    m.swap_out(["a"])
    assert tier_stats(m, "cpu") == TierStats(8, 2, 6, 0)
    r = m.free("a")
    assert r.num_blocks_released == 2
    assert tier_stats(m, "cpu") == TierStats(8, 0, 8, 0)
    assert m.cpu.free_order() == list(range(2, 8)) + [1, 0]
    assert m.stats().swapped_sequences == 0
    m.check_invariants()


# ---- prefix caching -------------------------------------------------------------------------------------
def test_prefix_hit_reuses_blocks_and_reports_cached_tokens(m):
    m.allocate("a", list(range(10)))  # [1, 2, 3]
    r = m.allocate("b", list(range(8)) + [99, 98])
    assert r.block_ids == [1, 2, 4]
    assert r.num_cached_tokens == 8
    assert r.slot_mapping == list(range(4, 12)) + [16, 17]
    assert refs(m, 1, 2, 3, 4) == [2, 2, 1, 1]
    s = m.stats()
    assert s.gpu == TierStats(16, 4, 12, 0)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (20, 8)
    # A prompt that differs inside the first block shares nothing (the hash chains over the prefix).
    r = m.allocate("c", [0, 1, 2, 7] + list(range(4, 8)) + [1])
    assert r.block_ids == [5, 6, 7] and r.num_cached_tokens == 0
    m.check_invariants()


def test_whole_prompt_cached_recomputes_its_last_block(m):
    m.allocate("a", list(range(8)))  # [1, 2], both full and hashed
    r = m.allocate("b", list(range(8)))
    assert r.block_ids == [1, 3]
    assert r.num_cached_tokens == 4
    assert r.slot_mapping == [4, 5, 6, 7, 12, 13, 14, 15]
    assert refs(m, 1, 2, 3) == [2, 1, 1]
    assert m.gpu.hash_of(3) is None  # the first block with a hash keeps it
    assert m.stats().prefix_hit_tokens == 4
    # A one-block prompt that is fully cached is recomputed whole.
    r = m.allocate("c", list(range(4)))
    assert r.block_ids == [4] and r.num_cached_tokens == 0
    m.check_invariants()


def test_namespaces_do_not_share(m):
    assert m.allocate("a", list(range(8)), namespace="x").block_ids == [1, 2]
    r = m.allocate("b", list(range(8)), namespace="y")
    assert r.block_ids == [3, 4] and r.num_cached_tokens == 0
    r = m.allocate("c", list(range(8)))  # the default namespace is a namespace of its own
    assert r.block_ids == [5, 6] and r.num_cached_tokens == 0
    r = m.allocate("d", list(range(8)) + [1], namespace="x")
    assert r.block_ids == [1, 2, 7] and r.num_cached_tokens == 8
    m.check_invariants()


def test_freed_hashed_blocks_become_cached_and_are_revived_by_a_hit(m):
    m.allocate("a", list(range(10)))  # [1, 2, 3]
    r = m.free("a")
    assert r.num_blocks_released == 3
    assert tier_stats(m) == TierStats(16, 0, 14, 2)
    assert [m.gpu.blocks[b].state for b in (1, 2, 3)] == ["cached", "cached", "free"]
    assert m.gpu.lru_order() == [2, 1]  # tail first: block 2 is evicted before block 1
    assert m.gpu.free_order() == list(range(4, 17)) + [3]
    assert m.stats().gpu_utilization == 0.0
    r = m.allocate("b", list(range(10)))
    assert r.block_ids == [1, 2, 4] and r.num_cached_tokens == 8
    assert m.gpu.lru_order() == []
    assert refs(m, 1, 2, 4) == [1, 1, 1]
    assert tier_stats(m) == TierStats(16, 3, 13, 0)
    assert m.stats().evictions == 0
    m.check_invariants()


def test_lru_evicts_the_tail_block_of_a_freed_prompt_first(m):
    m.allocate("a", list(range(12)))  # [1, 2, 3], all full
    m.free("a")
    assert m.gpu.lru_order() == [3, 2, 1]
    m.allocate("filler", num_tokens=52)  # takes all 13 free blocks
    assert tier_stats(m) == TierStats(16, 13, 0, 3)
    r = m.allocate("x", num_tokens=4)
    assert r.block_ids == [3]
    assert m.gpu.hash_of(3) is None and m.gpu.lru_order() == [2, 1]
    assert m.stats().evictions == 1
    # A hit on block 1 takes it before the new block is found, so the eviction takes 2, not 1.
    r = m.allocate("b", [0, 1, 2, 3, 50])
    assert r.block_ids == [1, 2] and r.num_cached_tokens == 4
    assert m.gpu.lru_order() == [] and m.stats().evictions == 2
    assert tier_stats(m) == TierStats(16, 16, 0, 0)
    # Block 2's old content is gone from the cache.
    m.free("filler")
    r = m.allocate("c", list(range(8)) + [9])
    assert r.num_cached_tokens == 4 and r.block_ids[0] == 1
    m.check_invariants()


def test_lru_order_follows_recent_use(m):
    m.allocate("p1", [1, 1, 1, 1])  # block 1
    m.allocate("p2", [2, 2, 2, 2])  # block 2
    m.free("p1")
    m.free("p2")
    assert m.gpu.lru_order() == [1, 2]
    m.allocate("q", [1, 1, 1, 1, 5])  # hits block 1, new block 3
    m.free("q")  # block 1 goes back to the LRU tail
    assert m.gpu.lru_order() == [2, 1]
    assert m.gpu.free_order() == list(range(4, 17)) + [3]
    m.allocate("filler", num_tokens=56)  # the 14 free blocks
    assert m.allocate("x", num_tokens=1).block_ids == [2]  # p2's block was least recently used
    assert m.gpu.lru_order() == [1] and m.gpu.hash_of(1) is not None and m.gpu.hash_of(2) is None
    m.check_invariants()


def test_appended_tokens_that_fill_a_block_are_registered(m):
    m.allocate("a", [7, 8, 9])
    assert m.gpu.hash_of(1) is None
    m.append("a", [10])
    assert m.gpu.hash_of(1) is not None
    r = m.allocate("b", [7, 8, 9, 10, 11])
    assert r.block_ids == [1, 2] and r.num_cached_tokens == 4
    # Several blocks filled by one append: the same hashes as the same prompt would get.
    m.allocate("c", [20, 21, 22])  # [3]
    m.append("c", [23, 24, 25, 26, 27, 28])  # fills 3 and 4, starts 5
    assert table(m, "c") == [3, 4, 5]
    r = m.allocate("d", [20, 21, 22, 23, 24, 25, 26, 27, 0])
    assert r.block_ids == [3, 4, 6] and r.num_cached_tokens == 8
    m.check_invariants()


def test_an_unknown_appended_token_stops_hashing(m):
    m.allocate("a", [7, 8, 9])
    m.append("a", num_tokens=1)
    assert m.gpu.hash_of(1) is None
    seq = m.block_table("a")
    assert seq.last_hash is None and seq.pending_tokens is None
    m.append("a", [1, 2, 3, 4])  # fills block 2; still unknown what came before
    assert m.gpu.hash_of(2) is None
    r = m.allocate("b", [7, 8, 9, 0, 1])
    assert r.num_cached_tokens == 0
    m.check_invariants()


def test_prefix_caching_off_shares_nothing(make):
    m = make(enable_prefix_caching=False)
    m.allocate("a", list(range(8)))
    r = m.allocate("b", list(range(8)) + [1])
    assert r.block_ids == [3, 4, 5] and r.num_cached_tokens == 0
    m.free("a")
    assert tier_stats(m) == TierStats(16, 3, 13, 0)  # nothing is kept as cached
    m.swap_out(["b"])
    assert m.swap_in(["b"]).num_blocks_reused == 0
    m.check_invariants()


# ---- swap -------------------------------------------------------------------------------------------------
def test_swap_out_and_in_map_blocks_between_tiers(m):
    m.allocate("z", num_tokens=4)  # gpu [1]
    m.allocate("a", num_tokens=6)  # gpu [2, 3]
    r = m.swap_out(["a"])
    assert r.mapping.pairs() == [(2, 0), (3, 1)]
    seq = m.block_table("a")
    assert (seq.tier, seq.block_ids, seq.num_tokens) == ("cpu", [0, 1], 6)
    assert refs(m, 0, 1, tier="cpu") == [1, 1] and filled(m, 0, 1, tier="cpu") == [4, 2]
    assert m.gpu.free_order() == list(range(4, 17)) + [3, 2]
    s = m.stats()
    assert (s.gpu, s.cpu) == (TierStats(16, 1, 15, 0), TierStats(8, 2, 6, 0))
    assert (s.running_sequences, s.swapped_sequences, s.blocks_swapped_out) == (1, 1, 2)
    m.check_invariants()

    r = m.swap_in(["a"])
    assert r.mapping.pairs() == [(0, 4), (1, 5)] and r.num_blocks_reused == 0
    seq = m.block_table("a")
    assert (seq.tier, seq.block_ids) == ("gpu", [4, 5])
    assert filled(m, 4, 5) == [4, 2]
    assert m.cpu.free_order() == list(range(2, 8)) + [1, 0]
    s = m.stats()
    assert (s.gpu, s.cpu) == (TierStats(16, 3, 13, 0), TierStats(8, 0, 8, 0))
    assert (s.running_sequences, s.swapped_sequences, s.blocks_swapped_in) == (2, 0, 2)
    assert m.append("a", num_tokens=1).slot_mapping == [5 * 4 + 2]
    m.check_invariants()


def test_blocks_shared_in_a_swapped_set_move_once_and_stay_shared(m):
    m.allocate("w", num_tokens=8)  # gpu [1, 2]
    m.swap_out(["w"])  # cpu [0, 1]; gpu free list [3..16, 2, 1]
    m.allocate("p", num_tokens=6)  # gpu [3, 4]
    m.fork("p", "c")
    assert m.append("c", num_tokens=1).copies.pairs() == [(4, 5)]  # c: [3, 5]
    r = m.swap_out(["c", "p"])
    assert r.mapping.pairs() == [(3, 2), (5, 3), (4, 4)]  # block 3 once for both
    assert table(m, "c") == [2, 3] and table(m, "p") == [2, 4]
    assert refs(m, 2, 3, 4, tier="cpu") == [2, 1, 1]
    assert m.stats().cpu == TierStats(8, 5, 3, 0)
    assert m.stats().gpu == TierStats(16, 0, 16, 0)
    assert m.gpu.free_order() == list(range(6, 17)) + [2, 1, 5, 4, 3]
    assert m.stats().blocks_swapped_out == 5
    m.check_invariants()

    r = m.swap_in(["p", "c"])
    assert r.mapping.pairs() == [(2, 6), (4, 7), (3, 8)]
    assert table(m, "p") == [6, 7] and table(m, "c") == [6, 8]
    assert refs(m, 6, 7, 8) == [2, 1, 1]
    assert m.cpu.free_order() == [5, 6, 7, 4, 3, 2]
    assert m.append("p", num_tokens=1).slot_mapping == [7 * 4 + 2]
    assert m.append("c", num_tokens=1).slot_mapping == [8 * 4 + 3]
    m.check_invariants()


def test_a_shared_partial_block_stays_shared_through_a_swap_and_is_copied_on_write(m):
    m.allocate("p", num_tokens=6)
    m.fork("p", "c")
    r = m.swap_out(["p", "c"])
    assert r.mapping.pairs() == [(1, 0), (2, 1)]
    assert refs(m, 0, 1, tier="cpu") == [2, 2]
    r = m.swap_in(["c", "p"])
    assert r.mapping.pairs() == [(0, 3), (1, 4)]
    assert table(m, "p") == table(m, "c") == [3, 4] and refs(m, 3, 4) == [2, 2]
    r = m.append("p", num_tokens=1)
    assert r.copies.pairs() == [(4, 5)] and table(m, "p") == [3, 5]
    m.check_invariants()


def test_swapping_out_one_sharer_copies_the_block_and_leaves_it_to_the_other(m):
    m.allocate("p", num_tokens=6)
    m.fork("p", "c")
    r = m.swap_out(["c"])
    assert r.mapping.pairs() == [(1, 0), (2, 1)]
    assert refs(m, 1, 2) == [1, 1] and table(m, "p") == [1, 2]
    assert m.stats().gpu == TierStats(16, 2, 14, 0)
    r = m.append("p", num_tokens=1)
    assert len(r.copies) == 0 and r.slot_mapping == [10]
    r = m.swap_in(["c"])
    assert r.mapping.pairs() == [(0, 3), (1, 4)] and r.num_blocks_reused == 0
    m.check_invariants()


def test_swap_in_reuses_blocks_still_in_the_gpu_prefix_cache(m):
    m.allocate("a", list(range(10)))  # [1, 2, 3]
    r = m.swap_out(["a"])
    assert r.mapping.pairs() == [(1, 0), (2, 1), (3, 2)]
    assert m.gpu.lru_order() == [2, 1] and m.gpu.free_order() == list(range(4, 17)) + [3]
    assert m.cpu.hash_of(0) == m.gpu.hash_of(1) is not None
    r = m.swap_in(["a"])
    assert r.mapping.pairs() == [(2, 4)]
    assert r.num_blocks_reused == 2
    assert table(m, "a") == [1, 2, 4]
    assert m.gpu.lru_order() == [] and refs(m, 1, 2, 4) == [1, 1, 1]
    assert m.stats().blocks_swapped_in == 1
    m.check_invariants()


def test_swap_in_reuses_blocks_a_running_sequence_holds(m):
    m.allocate("a", list(range(10)))  # [1, 2, 3]
    m.allocate("b", list(range(8)) + [9, 9])  # [1, 2, 4]
    m.swap_out(["a"])
    assert refs(m, 1, 2) == [1, 1]
    r = m.swap_in(["a"])
    assert r.mapping.pairs() == [(2, 5)] and r.num_blocks_reused == 2
    assert table(m, "a") == [1, 2, 5] and refs(m, 1, 2) == [2, 2]
    m.check_invariants()


def test_swap_in_takes_its_cache_hits_before_allocating(make):
    """The blocks it allocates may come from the LRU: that must not evict a block it reuses."""
    m = make(num_gpu_blocks=9)  # 8 usable
    m.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8])  # gpu [1, 2]
    m.swap_out(["a"])  # cpu [0, 1], gpu LRU [2, 1]
    m.allocate("z", [9, 9, 9, 9])  # gpu [3]
    m.free("z")  # LRU [2, 1, 3]
    m.allocate("e", num_tokens=4)  # gpu [4]
    m.swap_out(["e"])  # cpu [2]
    m.allocate("filler", num_tokens=20)  # the 5 free blocks
    assert m.gpu.num_free == 0 and m.gpu.lru_order() == [2, 1, 3]
    r = m.swap_in(["e", "a"])
    assert r.num_blocks_reused == 2
    assert r.mapping.pairs() == [(2, 3)]  # e's block evicts z's, not a's block 2
    assert table(m, "e") == [3] and table(m, "a") == [1, 2]
    assert refs(m, 1, 2, 3) == [1, 1, 1]
    assert m.gpu.lru_order() == [] and m.stats().evictions == 1
    m.check_invariants()


def test_a_swapped_out_sequence_cannot_be_appended_forked_or_swapped_out_again(m):
    m.allocate("a", num_tokens=5)
    m.swap_out(["a"])
    fails(m, FailedPrecondition, m.append, "a", num_tokens=1, match="swapped out")
    fails(m, FailedPrecondition, m.fork, "a", "b", match="swapped out")
    fails(m, FailedPrecondition, m.swap_out, ["a"], match="already swapped out")
    m.allocate("r", num_tokens=1)
    fails(m, FailedPrecondition, m.swap_in, ["r"], match="not swapped out")
    fails(m, FailedPrecondition, m.swap_in, ["a", "r"])
    m.check_invariants()


def test_swap_argument_errors(m):
    m.allocate("a", num_tokens=5)
    m.allocate("b", num_tokens=5)
    fails(m, InvalidArgument, m.swap_out, ["a", "b", "a"], match="twice")
    fails(m, InvalidArgument, m.swap_out, [])
    fails(m, NotFound, m.swap_out, ["a", "nope"])
    m.swap_out(["a", "b"])
    fails(m, InvalidArgument, m.swap_in, ["b", "b"], match="twice")
    fails(m, InvalidArgument, m.swap_in, [])
    fails(m, NotFound, m.swap_in, ["nope"])


def test_swap_out_needs_room_on_the_cpu(m):
    m.allocate("big", num_tokens=36)  # 9 blocks: more than the CPU pool has
    fails(m, OutOfRange, m.swap_out, ["big"], match="CPU pool has 8")
    m.free("big")
    m.allocate("a", num_tokens=20)  # 5 blocks
    m.allocate("b", num_tokens=16)  # 4 blocks
    m.swap_out(["a"])
    err = fails(m, ResourceExhausted, m.swap_out, ["b"])
    assert "needs 4 free CPU blocks, 3 are free" in str(err)


def test_swap_in_needs_room_on_the_gpu(make):
    m = make(num_cpu_blocks=16, watermark=0.25)  # 4 blocks reserved at admission and swap-in
    m.allocate("a", num_tokens=48)  # 12 blocks: all a prompt may take
    m.append("a", num_tokens=4)  # appends may use the reserve: 13 blocks
    m.swap_out(["a"])
    fails(m, OutOfRange, m.swap_in, ["a"], match="never give more than 12")
    m.free("a")
    m.allocate("b", num_tokens=8)
    m.swap_out(["b"])
    m.allocate("c", num_tokens=44)  # 11 blocks; 5 free, 4 of them reserved
    err = fails(m, ResourceExhausted, m.swap_in, ["b"])
    assert "needs 2 free GPU blocks, 5 are free or evictable and 4 are kept in reserve" in str(err)
    m.allocate("d", num_tokens=1)  # what the reserve leaves is still there for admissions


# ---- admission, watermark and argument errors ------------------------------------------------------------
def test_watermark_is_kept_free_at_admission(make):
    m = make(watermark=0.25)
    assert m.watermark_blocks == 4 and m.stats().watermark_blocks == 4
    fails(m, OutOfRange, m.allocate, "huge", num_tokens=52, match="never give more than 12")
    m.allocate("a", num_tokens=44)  # [1..11]
    assert m.allocate("b", num_tokens=4).block_ids == [12]  # 5 free, 4 reserved: fits exactly
    err = fails(m, ResourceExhausted, m.allocate, "c", num_tokens=1)
    assert "needs 1 free GPU blocks, 4 are free or evictable and 4 are kept in reserve" in str(err)
    # Running sequences may still grow into the reserve.
    r = m.append("a", num_tokens=16)
    assert r.new_block_ids == [13, 14, 15, 16]
    assert m.stats().gpu == TierStats(16, 16, 0, 0)
    err = fails(m, ResourceExhausted, m.append, "a", num_tokens=1)
    assert "needs 1 free GPU blocks, 0 are free or evictable" in str(err)
    fails(m, OutOfRange, m.append, "a", num_tokens=5, match="GPU pool has 16")


def test_allocate_that_can_never_fit_is_out_of_range(m):
    fails(m, OutOfRange, m.allocate, "a", num_tokens=65, match="17 blocks")
    m.allocate("a", num_tokens=64)  # exactly the pool
    fails(m, ResourceExhausted, m.allocate, "b", num_tokens=1)


def test_cached_hits_count_against_the_room_they_take(make):
    m = make(num_gpu_blocks=5)  # 4 usable
    m.allocate("a", list(range(8)))  # [1, 2]
    m.free("a")  # both cached
    m.allocate("x", num_tokens=8)  # the 2 free blocks
    # 2 hits on cached blocks, 1 new block: the cached blocks cannot also be evicted for it.
    fails(m, ResourceExhausted, m.allocate, "b", list(range(8)) + [1], match="needs 1 free GPU blocks, 0")
    r = m.allocate("c", list(range(4)) + [1])  # 1 hit, 1 new (evicts block 2)
    assert r.block_ids == [1, 2] and r.num_cached_tokens == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_tokens=0), "at least 1 token"),
    (dict(num_tokens=-3), "at least 1 token"),
    (dict(token_ids=[]), "at least 1 token"),
    (dict(token_ids=[1, 2, 3], num_tokens=2), "3 token ids given but num_tokens says 2"),
    (dict(token_ids=[1, -1]), ">= 0"),
    (dict(num_tokens=11), "exceeds max_seq_len 10"),
])
def test_allocate_rejects_bad_prompts(make, kwargs, match):
    m = make(max_seq_len=10)
    fails(m, InvalidArgument, m.allocate, "a", match=match, **kwargs)
    assert len(m.seqs) == 0


@pytest.mark.parametrize("seq_id, error", [
    ("", InvalidArgument),
    ("x" * (MAX_SEQ_ID_LEN + 1), InvalidArgument),
])
def test_sequence_ids_must_be_non_empty_and_bounded(m, seq_id, error):
    fails(m, error, m.allocate, seq_id, num_tokens=1)
    m.allocate("a", num_tokens=1)
    fails(m, error, m.fork, "a", seq_id)


def test_longest_sequence_id_is_accepted(m):
    m.allocate("x" * MAX_SEQ_ID_LEN, num_tokens=1)
    m.check_invariants()


def test_append_rejects_bad_counts(make):
    m = make(max_seq_len=10)
    m.allocate("a", num_tokens=9)
    fails(m, InvalidArgument, m.append, "a", num_tokens=0)
    fails(m, InvalidArgument, m.append, "a", num_tokens=-1)
    fails(m, InvalidArgument, m.append, "a", token_ids=[])
    fails(m, InvalidArgument, m.append, "a", token_ids=[1, 2], num_tokens=1)
    fails(m, InvalidArgument, m.append, "a", token_ids=[-5])
    fails(m, InvalidArgument, m.append, "a", num_tokens=2, match="9 \\+ 2 tokens exceeds max_seq_len 10")
    assert m.append("a", [3]).num_tokens == 10


def test_not_found_and_already_exists(m):
    m.allocate("a", num_tokens=5)
    fails(m, AlreadyExists, m.allocate, "a", num_tokens=1)
    fails(m, NotFound, m.append, "b", num_tokens=1)
    fails(m, NotFound, m.free, "b")
    fails(m, NotFound, m.fork, "b", "c")
    m.allocate("c", num_tokens=1)
    fails(m, AlreadyExists, m.fork, "a", "c")
    fails(m, AlreadyExists, m.fork, "a", "a")
    with pytest.raises(NotFound):
        m.block_table("b")


def test_a_failing_operation_changes_nothing_in_a_busy_pool(make):
    m = make(num_gpu_blocks=9, num_cpu_blocks=4, watermark=0.25)  # 8 usable, 2 reserved
    m.allocate("a", list(range(10)))
    m.allocate("b", list(range(8)) + [5])
    m.fork("b", "c")
    m.swap_out(["a"])
    m.allocate("d", [7, 7, 7, 7])
    m.free("d")
    m.allocate("e", num_tokens=2)
    assert m.gpu.lru_order() and m.gpu.num_free
    fails(m, ResourceExhausted, m.allocate, "f", num_tokens=16)
    fails(m, OutOfRange, m.allocate, "f", num_tokens=25)
    fails(m, ResourceExhausted, m.append, "c", num_tokens=16)
    fails(m, OutOfRange, m.append, "c", num_tokens=30)
    fails(m, ResourceExhausted, m.swap_out, ["b", "c", "e"])
    fails(m, FailedPrecondition, m.swap_in, ["a", "b"])
    fails(m, NotFound, m.swap_out, ["b", "zz"])
    fails(m, AlreadyExists, m.fork, "b", "e")
    fails(m, InvalidArgument, m.allocate, "g", [1, 2, -1])
    with pytest.raises(InvalidArgument):
        m.run(RejectedOp("bad request"))
    m.check_invariants()


# ---- step ---------------------------------------------------------------------------------------------------
def test_step_reports_each_operation_and_errors_do_not_stop_the_others(m):
    r = m.step([
        AllocateOp("a", num_tokens=5),
        AllocateOp("a", num_tokens=1),
        AppendOp("nope", num_tokens=1),
        AllocateOp("b", [1, 2, 3]),
        RejectedOp("malformed"),
    ])
    assert r.applied
    assert [type(o.error) if o.error else None for o in r.outcomes] == [
        None, AlreadyExists, NotFound, None, InvalidArgument]
    assert all((o.result is None) != (o.error is None) for o in r.outcomes)
    assert r.outcomes[0].result.block_ids == [1, 2]
    assert r.outcomes[3].result.block_ids == [3]
    b = r.batch
    assert b.seq_ids == ["a", "b"]
    assert b.context_lens == [5, 3] and b.query_lens == [5, 3]
    assert b.slot_mapping == [4, 5, 6, 7, 8, 12, 13, 14]
    assert b.max_blocks == 2
    assert b.block_tables == [1, 2, 3, 0]  # padding names the null block
    assert b.kv_indptr == [0, 2, 3] and b.kv_indices == [1, 2, 3] and b.kv_last_page_len == [1, 3]
    assert (r.gpu_blocks_available, r.cpu_blocks_available) == (13, 8)
    assert len(r.plan.blocks_to_copy) == len(r.plan.blocks_to_swap_in) == len(r.plan.blocks_to_swap_out) == 0
    assert m.step([]).step_id == r.step_id + 1
    m.check_invariants()


def test_step_merges_plans_and_answers_block_tables(m):
    m.allocate("a", num_tokens=6)  # [1, 2]
    m.fork("a", "c")
    m.allocate("b", num_tokens=4)  # [3]
    m.swap_out(["b"])  # cpu [0]; gpu free list [4..16, 3]
    m.allocate("d", num_tokens=3)  # [4]
    r = m.step([
        AppendOp("a", num_tokens=1),  # copy-on-write 2 -> 5
        SwapInOp(["b"]),              # cpu 0 -> gpu 6
        SwapOutOp(["d"]),             # gpu 4 -> cpu 1
        AppendOp("c", num_tokens=2),  # block 2 is c's alone now: in place
    ])
    assert r.applied and all(o.error is None for o in r.outcomes)
    assert r.plan.blocks_to_copy.pairs() == [(2, 5)]
    assert r.plan.blocks_to_swap_in.pairs() == [(0, 6)]
    assert r.plan.blocks_to_swap_out.pairs() == [(4, 1)]
    b = r.batch
    assert b.seq_ids == ["a", "b", "c"]  # first-touch order; d left the GPU
    assert b.context_lens == [7, 4, 8]
    assert b.query_lens == [1, 0, 2]
    assert b.slot_mapping == [5 * 4 + 2, 2 * 4 + 2, 2 * 4 + 3]
    assert b.max_blocks == 2
    assert b.block_tables == [1, 5, 6, 0, 1, 2]
    assert b.kv_indptr == [0, 2, 3, 5]
    assert b.kv_indices == [1, 5, 6, 1, 2]
    assert b.kv_last_page_len == [3, 4, 4]
    assert m.gpu.free_order() == list(range(7, 17)) + [3, 4]
    assert m.cpu.free_order() == list(range(2, 8)) + [0]
    assert (r.gpu_blocks_available, r.cpu_blocks_available) == (12, 7)
    m.check_invariants()


def test_blocks_freed_in_a_step_are_held_until_it_ends(make):
    m = make(num_gpu_blocks=5, num_cpu_blocks=2)  # 4 usable GPU blocks
    m.allocate("a", num_tokens=8)  # [1, 2]
    m.allocate("b", num_tokens=8)  # [3, 4]
    r = m.step([FreeOp("a"), AllocateOp("c", num_tokens=1)])
    assert r.outcomes[0].result.num_blocks_released == 2
    assert isinstance(r.outcomes[1].error, ResourceExhausted)
    assert m.gpu.free_order() == [2, 1] and m.gpu.num_held == 0
    assert r.gpu_blocks_available == 2
    assert m.allocate("c", num_tokens=1).block_ids == [2]
    # The same on the CPU: blocks a swap-in releases are not swap-out targets in that step.
    m.swap_out(["b"])  # cpu [0, 1]
    r = m.step([SwapInOp(["b"]), SwapOutOp(["c"])])
    assert r.outcomes[0].error is None
    assert isinstance(r.outcomes[1].error, ResourceExhausted)
    assert m.cpu.free_order() == [1, 0]
    m.check_invariants()


def test_a_freed_cached_block_is_revived_within_the_step(m):
    m.allocate("a", list(range(8)) + [1])
    r = m.step([FreeOp("a"), AllocateOp("b", list(range(8)) + [2])])
    assert r.outcomes[1].result.block_ids == [1, 2, 4] and r.outcomes[1].result.num_cached_tokens == 8
    assert m.gpu.free_order() == list(range(5, 17)) + [3]
    m.check_invariants()


def test_swap_out_of_a_sequence_written_in_the_same_step_is_refused(m):
    m.allocate("a", num_tokens=3)
    r = m.step([AppendOp("a", num_tokens=1), SwapOutOp(["a"])])
    assert r.outcomes[0].error is None
    assert isinstance(r.outcomes[1].error, FailedPrecondition)
    assert "written in this step" in str(r.outcomes[1].error)
    r = m.step([AllocateOp("b", num_tokens=5), SwapOutOp(["b"])])
    assert isinstance(r.outcomes[1].error, FailedPrecondition)
    # A fork shares the blocks its parent's prompt is written to.
    r = m.step([AllocateOp("p", num_tokens=5), ForkOp("p", "q"), SwapOutOp(["q"])])
    assert isinstance(r.outcomes[2].error, FailedPrecondition)
    # Swap-in targets are written too.
    m.swap_out(["a"])
    r = m.step([SwapInOp(["a"]), SwapOutOp(["a"])])
    assert r.outcomes[0].error is None and isinstance(r.outcomes[1].error, FailedPrecondition)
    # A sequence the step did not write may leave.
    r = m.step([AppendOp("b", num_tokens=1), SwapOutOp(["q"])])
    assert r.outcomes[1].error is None
    assert r.batch.seq_ids == ["b"]
    m.check_invariants()


def test_copy_on_write_from_a_block_written_in_the_same_step_is_refused(m):
    # The copy would run before the step writes the block it copies.
    r = m.step([AllocateOp("p", num_tokens=5), ForkOp("p", "c"), AppendOp("c", num_tokens=1)])
    assert r.outcomes[0].error is None and r.outcomes[1].error is None
    assert isinstance(r.outcomes[2].error, FailedPrecondition)
    assert len(r.plan.blocks_to_copy) == 0
    r = m.step([AppendOp("c", num_tokens=1)])  # next step: fine
    assert r.plan.blocks_to_copy.pairs() == [(2, 3)]
    # Appending, forking and appending again in one step would copy a block the first append
    # writes (and chain the copies).
    r = m.step([AppendOp("p", num_tokens=1), ForkOp("p", "d"), AppendOp("p", num_tokens=1)])
    assert r.outcomes[0].error is None and r.outcomes[1].error is None
    assert isinstance(r.outcomes[2].error, FailedPrecondition)
    # A block that is only a swap-in target is copied after the swap-in: allowed.
    m.allocate("g", num_tokens=5)
    m.fork("g", "h")
    m.swap_out(["g", "h"])
    r = m.step([SwapInOp(["g", "h"]), AppendOp("g", num_tokens=1), AppendOp("h", num_tokens=1)])
    assert r.applied and all(o.error is None for o in r.outcomes)
    swapped_in = r.plan.blocks_to_swap_in.dst  # g's and h's two shared blocks
    assert len(swapped_in) == 2
    assert r.plan.blocks_to_copy.pairs() == [(swapped_in[1], r.outcomes[1].result.new_block_ids[0])]
    assert table(m, "h") == swapped_in
    m.check_invariants()


def test_free_of_a_sequence_with_tokens_in_the_same_step_is_refused(m):
    # b's prompt hits a's blocks, which a's prompt writes in this step: freeing a would drop
    # those writes.
    r = m.step([
        AllocateOp("a", list(range(9))),
        AllocateOp("b", list(range(8)) + [5]),
        FreeOp("a"),
    ])
    assert r.outcomes[1].result.num_cached_tokens == 8
    assert isinstance(r.outcomes[2].error, FailedPrecondition)
    # A forked child shares them too.
    r = m.step([AllocateOp("p", num_tokens=5), ForkOp("p", "c"), FreeOp("p")])
    assert isinstance(r.outcomes[2].error, FailedPrecondition)
    # Freeing the child (nothing to compute) is fine, and so is freeing anything in the next step.
    r = m.step([AppendOp("a", num_tokens=1), FreeOp("c"), FreeOp("b")])
    assert r.applied and all(o.error is None for o in r.outcomes)
    m.free("a")
    m.free("p")
    assert m.stats().running_sequences == 0
    m.check_invariants()


def test_all_or_nothing_rolls_back_exactly(make):
    m = make(num_cpu_blocks=6)
    m.allocate("a", list(range(10)))
    m.allocate("b", list(range(8)) + [9, 9])
    m.fork("b", "c")
    m.allocate("s", num_tokens=5)
    m.swap_out(["s"])
    m.allocate("d", [3, 3, 3, 3, 4, 4, 4, 4])
    m.free("d")
    m.allocate("e", num_tokens=3)
    before = fingerprint(m)
    assert m.gpu.lru_order() == [8, 7]
    ops = [
        FreeOp("a"),
        AppendOp("b", [1, 2, 3]),                    # copy-on-write of the shared block
        AllocateOp("f", [3, 3, 3, 3, 4, 4, 4, 4, 1]),  # revives cached blocks 7, 8
        SwapOutOp(["c"]),
        SwapInOp(["s"]),
        ForkOp("e", "g"),
        AppendOp("e", num_tokens=5),
        AllocateOp("h", num_tokens=40),                # fails: no room
        AllocateOp("i", num_tokens=1),                 # never runs
    ]
    r = m.step(ops, all_or_nothing=True)
    assert not r.applied
    assert isinstance(r.outcomes[7].error, ResourceExhausted)
    for i, o in enumerate(r.outcomes):
        assert o.result is None
        if i != 7:
            assert type(o.error) is Aborted and "operation 7 failed (RESOURCE_EXHAUSTED)" in str(o.error)
    assert len(r.outcomes) == len(ops)
    assert len(r.plan.blocks_to_copy) == len(r.plan.blocks_to_swap_in) == len(r.plan.blocks_to_swap_out) == 0
    assert r.batch.seq_ids == [] and r.batch.slot_mapping == [] and r.batch.kv_indptr == [0]
    assert fingerprint(m) == before
    m.check_invariants()
    # The same ops without the failing one apply, and a later failure of a lone op rolls back too.
    r = m.step(ops[:7] + ops[8:], all_or_nothing=True)
    assert r.applied and all(o.error is None for o in r.outcomes)
    assert r.outcomes[2].result.block_ids[:2] == [7, 8]
    m.check_invariants()


def test_all_or_nothing_failure_on_the_first_operation(m):
    m.allocate("a", num_tokens=5)
    before = fingerprint(m)
    r = m.step([FreeOp("zz"), FreeOp("a")], all_or_nothing=True)
    assert not r.applied
    assert type(r.outcomes[0].error) is NotFound and type(r.outcomes[1].error) is Aborted
    assert fingerprint(m) == before
    m.check_invariants()


def test_all_or_nothing_success_is_a_normal_step(m):
    r = m.step([AllocateOp("a", num_tokens=5), ForkOp("a", "b")], all_or_nothing=True)
    assert r.applied and r.batch.seq_ids == ["a", "b"] and r.batch.query_lens == [5, 0]
    assert refs(m, 1, 2) == [2, 2]
    m.check_invariants()


# ---- operation counts (what the metrics export) -------------------------------------------------------
def test_operation_counts_follow_commits_and_rollbacks(make):
    m = make()
    m.allocate("a", token_ids=list(range(6)))
    m.step([AppendOp("a", num_tokens=1), FreeOp("ghost"), RejectedOp("bad field")])
    m.step([AppendOp("a", num_tokens=1), FreeOp("ghost")], all_or_nothing=True)

    def unreachable(plan):
        raise Unavailable("worker rank 0 is gone")

    m.dispatch = unreachable
    with pytest.raises(Unavailable):
        m.step([SwapOutOp(["a"]), ForkOp("a", "b")])
    m.dispatch = None
    assert dict(m.op_counts.applied) == {"allocate": 1, "append": 1}
    assert dict(m.op_counts.failed) == {
        ("free", "NOT_FOUND"): 2, ("invalid", "INVALID_ARGUMENT"): 1, ("append", "ABORTED"): 1,
        ("swap_out", "UNAVAILABLE"): 1, ("fork", "UNAVAILABLE"): 1}
    assert m.stats().preemptions == 0 and len(m.seqs) == 1  # the rolled-back swap-out left no trace
