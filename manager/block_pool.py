"""A pool of physical KV blocks for one memory tier, with ref counts and an evictable prefix cache.

Every block is in exactly one state:

- FREE: holds nothing; in ``_free`` (a deque; allocation pops the left end).
- USED: referenced by ``ref_count`` >= 1 block-table entries.
- CACHED: unreferenced, but holds a full block whose content hash is known, so a later
  prompt with the same prefix can reuse it; in the LRU list, evicted from its head only
  when no FREE block is left.
- NULL: block 0 of a pool made with ``reserve_null`` (the GPU pool), never handed out. Padding
  entries of block tables name it (the workers keep it zeroed), so a kernel that reads past a
  sequence's context by mistake reads zeros, never another sequence's K/V (vLLM and SGLang do
  the same).
- HELD: released during a Step; it rejoins FREE or CACHED when the step ends, so a block
  never plays two roles in one step's plan (see ``hold_releases``). A step whose plan is on its
  way to the workers (a tentative step, ``manager/tentative.py``) keeps its HELD blocks until
  the workers answer (``take_held``/``resume_held``).

While tentative steps are pending, other steps run beside them. Two more marks keep them apart:
a *pin* is an extra reference a tentative step keeps on a shared block it dropped (so the block
cannot be freed and reused before the step is known to stand), and a *hidden* block is one the
tentative step took for itself (allocated, revived from the cache, registered, held): ``lookup``
does not find it, so no other step can share it. The undo functions below restore exactly when
nothing ran in between, and stay valid when other steps did (an undone cache hit rejoins the LRU
at its old place if that still exists, else at its head; an undone eviction whose hash another
block took since becomes FREE; an undone reference that was the last releases the block).

Complexity: allocate, acquire, incref, decref, lookup and register are O(1). The LRU is an
intrusive doubly linked list over the block records (as in vLLM v1's free queue) so that a
cache hit can take a block out of its middle in O(1). Every mutation records its inverse
in the shared ``Journal`` so that an all-or-nothing step can roll back exactly.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Optional

from kvpager.errors import InvariantViolation
from .journal import Journal

FREE, USED, CACHED, HELD, NULL = "free", "used", "cached", "held", "null"
NULL_BLOCK = 0  # the GPU pool's reserved block: what padding entries of block tables name


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    state: str = FREE                    # changed only by BlockPool
    ref_count: int = 0                   # block-table references; changed only by BlockPool
    block_hash: Optional[bytes] = None   # prefix hash of a full block; set by register, cleared on eviction
    num_filled: int = 0                  # token slots written (the fullest sharer); set by BlockPool.fill
    prev: Optional["Block"] = None       # LRU links, meaningful only while CACHED
    next: Optional["Block"] = None


class BlockPool:
    def __init__(self, num_blocks: int, journal: Journal, name: str, caching: bool,
                 reserve_null: bool = False) -> None:
        """``caching``: keep released hashed blocks as CACHED (the GPU tier). A pool without
        it (the CPU tier) still carries each block's hash, so a swapped-in block can be
        matched against the GPU cache, but frees such blocks at once. ``reserve_null``: block 0
        is the NULL block, never handed out (``num_usable`` is one less than ``num_blocks``)."""
        self.name = name
        self.caching = caching
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._journal = journal
        first = 0
        if reserve_null:
            self.blocks[NULL_BLOCK].state = NULL
            first = NULL_BLOCK + 1
        self.num_usable = num_blocks - first  # blocks that can ever be handed out
        self._free: deque[int] = deque(range(first, num_blocks))
        self._head = Block(-1)  # LRU sentinels: head.next is the least recently used block
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._num_cached = 0
        self._hash_to_block: dict[bytes, int] = {}
        self._held: Optional[dict[int, None]] = None  # insertion-ordered set while a step runs
        self._tentative_held: set[int] = set()  # HELD blocks of tentative steps
        self._pins: Counter[int] = Counter()     # block -> references kept by tentative steps
        self._hidden: Counter[int] = Counter()   # blocks tentative steps own: lookup skips them
        # True while a tentative step is undone after its plan went out: a block it took may have
        # been written by the workers (a copy or swap-in target), so none goes back to the cache.
        self.plan_may_have_run = False
        self.num_used = 0
        self.filled_slots = 0  # sum of num_filled over USED blocks
        self.evictions = 0

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_held(self) -> int:
        """HELD blocks: the current step's and the tentative steps'."""
        return (len(self._held) if self._held else 0) + len(self._tentative_held)

    @property
    def num_held_by_step(self) -> int:
        """HELD blocks of the step being applied now."""
        return len(self._held) if self._held else 0

    @property
    def num_available(self) -> int:
        """Blocks that ``allocate`` can hand out now (free ones, then evicted cached ones)."""
        return len(self._free) + self._num_cached

    # ---- allocation and references ------------------------------------------------------
    def allocate(self) -> int:
        """Take a FREE block, or evict the least recently used CACHED one; ref_count becomes 1."""
        if self._free:
            block = self.blocks[self._free.popleft()]
            self._journal.record(self._undo_allocate_free, block, block.block_hash)
            block.block_hash = None
        else:
            block = self._head.next
            if block is self._tail:
                raise InvariantViolation(f"{self.name} pool: allocate with no available block")
            self._lru_remove(block)
            old_hash = block.block_hash
            del self._hash_to_block[old_hash]
            block.block_hash = None
            self.evictions += 1
            self._journal.record(self._undo_allocate_evict, block, old_hash, block.num_filled)
        block.state = USED
        block.ref_count = 1
        block.num_filled = 0
        self.num_used += 1
        return block.block_id

    def incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count += 1
        self._journal.record(self._undo_incref, block)

    def decref(self, block_id: int) -> bool:
        """Drop one reference; returns True when it was the last (the block leaves USED)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            self._journal.record(self._undo_decref, block)
            return False
        self._leave_used(block)
        self._journal.record(self._undo_release, block)
        return True

    def _leave_used(self, block: Block) -> None:
        """A block's last reference is gone: HELD while a step runs, else FREE or CACHED."""
        self.num_used -= 1
        self.filled_slots -= block.num_filled
        if self._held is not None:
            block.state = HELD
            self._held[block.block_id] = None
        else:
            self._park(block)

    def acquire(self, block_id: int) -> None:
        """Take a reference to a block found by ``lookup`` (USED, CACHED or HELD)."""
        block = self.blocks[block_id]
        state = block.state
        if state == USED:
            self.incref(block_id)
            return
        if state == CACHED:
            prev, nxt = block.prev, block.next
            self._lru_remove(block)
            self._journal.record(self._undo_acquire_cached, block, prev, nxt)
        elif state == HELD:
            del self._held[block_id]
            self._journal.record(self._undo_acquire_held, block)
        else:
            raise InvariantViolation(f"{self.name} block {block_id} is {state}; cannot acquire")
        block.state = USED
        block.ref_count = 1
        self.num_used += 1
        self.filled_slots += block.num_filled

    def fill(self, block_id: int, num_filled: int) -> None:
        """Record that ``num_filled`` slots of a USED block hold tokens (for fragmentation)."""
        block = self.blocks[block_id]
        old = block.num_filled
        if num_filled > old:
            block.num_filled = num_filled
            self.filled_slots += num_filled - old
            self._journal.record(self._undo_fill, block, old)

    def add_filled(self, block_id: int, delta: int) -> None:
        """Adjust a USED block's fill by delta, unjournaled: for a caller that journals the
        whole change itself (the manager's in-place append)."""
        self.blocks[block_id].num_filled += delta
        self.filled_slots += delta

    # ---- prefix cache -------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> Optional[int]:
        """The block holding this prefix, unless a tentative step owns it (hidden)."""
        block_id = self._hash_to_block.get(block_hash)
        if block_id is not None and self._hidden and block_id in self._hidden:
            return None
        return block_id

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Make a full block findable by its prefix hash (first block with a hash wins)."""
        block = self.blocks[block_id]
        if not self.caching:
            self._journal.record(self._undo_carry_hash, block, block.block_hash)
            block.block_hash = block_hash
            return
        if block.block_hash is None and block_hash not in self._hash_to_block:
            block.block_hash = block_hash
            self._hash_to_block[block_hash] = block_id
            self._journal.record(self._undo_register, block)

    def hash_of(self, block_id: int) -> Optional[bytes]:
        return self.blocks[block_id].block_hash

    def forget_contents(self) -> None:
        """Drop every content hash (a worker was replaced: what its blocks held is gone).
        CACHED blocks become FREE; USED blocks stay with their sequences. O(num_blocks)."""
        while self._head.next is not self._tail:
            block = self._head.next
            self._lru_remove(block)
            block.block_hash = None
            self._park(block)
        for block in self.blocks:
            block.block_hash = None
        self._hash_to_block.clear()

    # ---- steps --------------------------------------------------------------------------
    def hold_releases(self) -> None:
        """From now until ``end_hold``, released blocks are HELD instead of reusable."""
        self._held = {}

    def end_hold(self) -> None:
        held, self._held = self._held or {}, None
        for block_id in held:
            self._park(self.blocks[block_id])

    # ---- tentative steps (manager/tentative.py) -------------------------------------------------
    def take_held(self) -> dict[int, None]:
        """The current step goes tentative: its HELD blocks stay HELD, now as its own, and the
        pool is ready for the next step. O(held)."""
        held, self._held = self._held or {}, None
        self._tentative_held.update(held)
        return held

    def resume_held(self, held: dict[int, None]) -> None:
        """A tentative step finishes: its HELD blocks are the pool's current ones again, to be
        undone or parked by ``end_hold``. O(held)."""
        if self._held is not None:
            raise InvariantViolation(f"{self.name} pool: a tentative step finishes while another step runs")
        self._tentative_held.difference_update(held)
        self._held = held

    def pin(self, block_id: int) -> None:
        self.blocks[block_id].ref_count += 1
        self._pins[block_id] += 1

    def unpin(self, block_id: int) -> None:
        """Drop a pin; the block leaves USED if that was its last reference."""
        pins = self._pins
        pins[block_id] -= 1
        if not pins[block_id]:
            del pins[block_id]
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._leave_used(block)

    def hide(self, block_id: int) -> None:
        self._hidden[block_id] += 1

    def unhide(self, block_id: int) -> None:
        hidden = self._hidden
        hidden[block_id] -= 1
        if not hidden[block_id]:
            del hidden[block_id]

    # ---- internals ----------------------------------------------------------------------
    def _park(self, block: Block) -> None:
        if self.caching and block.block_hash is not None:
            block.state = CACHED
            self._lru_append(block)
        else:
            block.state = FREE
            block.num_filled = 0
            self._free.append(block.block_id)

    def _lru_append(self, block: Block) -> None:
        last = self._tail.prev
        last.next = block
        block.prev, block.next = last, self._tail
        self._tail.prev = block
        self._num_cached += 1

    def _lru_remove(self, block: Block) -> None:
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self._num_cached -= 1

    def _lru_insert_between(self, block: Block, prev: Block, nxt: Block) -> None:
        prev.next = block
        nxt.prev = block
        block.prev, block.next = prev, nxt
        self._num_cached += 1

    # Inverses of the mutations above, run by Journal.rollback in reverse order.
    def _undo_allocate_free(self, block: Block, old_hash: Optional[bytes]) -> None:
        block.state, block.ref_count, block.num_filled = FREE, 0, 0
        block.block_hash = old_hash
        self.num_used -= 1
        self._free.appendleft(block.block_id)

    def _undo_allocate_evict(self, block: Block, old_hash: bytes, old_filled: int) -> None:
        self.num_used -= 1
        self.evictions -= 1
        if old_hash in self._hash_to_block or self.plan_may_have_run:
            # Another block took that prefix since, or the workers may have written this block:
            # it comes back FREE, never as a cache entry whose content may be gone.
            block.state, block.ref_count, block.num_filled = FREE, 0, 0
            self._free.appendleft(block.block_id)
            return
        block.state, block.ref_count, block.num_filled = CACHED, 0, old_filled
        block.block_hash = old_hash
        self._hash_to_block[old_hash] = block.block_id
        self._lru_insert_between(block, self._head, self._head.next)

    def _undo_incref(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:  # the other references went while the step was tentative
            self._leave_used(block)

    def _undo_decref(self, block: Block) -> None:
        block.ref_count += 1

    def _undo_release(self, block: Block) -> None:
        if block.state == HELD:
            del self._held[block.block_id]
        elif block.state == CACHED:
            self._lru_remove(block)
        else:
            popped = self._free.pop()
            if popped != block.block_id:
                raise InvariantViolation(f"undo release: free tail {popped}, expected {block.block_id}")
        block.state, block.ref_count = USED, 1
        self.num_used += 1
        self.filled_slots += block.num_filled

    def _undo_acquire_cached(self, block: Block, prev: Block, nxt: Block) -> None:
        self._undo_acquire(block)
        block.state = CACHED
        if prev.next is nxt:  # its old place in the LRU still exists
            self._lru_insert_between(block, prev, nxt)
        else:
            self._lru_insert_between(block, self._head, self._head.next)

    def _undo_acquire_held(self, block: Block) -> None:
        self._undo_acquire(block)
        block.state = HELD
        self._held[block.block_id] = None

    def _undo_acquire(self, block: Block) -> None:
        block.ref_count = 0
        self.num_used -= 1
        self.filled_slots -= block.num_filled

    def _undo_fill(self, block: Block, old: int) -> None:
        self.filled_slots -= block.num_filled - old
        block.num_filled = old

    def _undo_carry_hash(self, block: Block, old_hash: Optional[bytes]) -> None:
        block.block_hash = old_hash

    def _undo_register(self, block: Block) -> None:
        del self._hash_to_block[block.block_hash]
        block.block_hash = None

    # ---- checking -----------------------------------------------------------------------
    def lru_order(self) -> list[int]:
        out, block = [], self._head.next
        while block is not self._tail:
            out.append(block.block_id)
            block = block.next
        return out

    def free_order(self) -> list[int]:
        return list(self._free)

    def check_invariants(self, references: dict[int, int]) -> None:
        """``references`` maps block id -> number of block-table entries naming it. O(num_blocks)."""

        def fail(msg: str) -> None:
            raise InvariantViolation(f"{self.name} pool: {msg}")

        free, lru = self.free_order(), self.lru_order()
        if len(set(free)) != len(free):
            fail("a block is twice in the free list")
        if len(lru) != self._num_cached:
            fail(f"LRU holds {len(lru)} blocks, counter says {self._num_cached}")
        held = set(self._held or ()) | self._tentative_held
        places: dict[int, str] = {}
        for bid in free:
            places[bid] = FREE
        for bid in lru:
            if bid in places:
                fail(f"block {bid} is both {places[bid]} and cached")
            places[bid] = CACHED
        for bid in held:
            if bid in places:
                fail(f"block {bid} is both {places[bid]} and held")
            places[bid] = HELD
        used = filled = 0
        for block in self.blocks:
            if block.state == NULL:
                if block.ref_count or block.block_id in places or block.block_hash is not None:
                    fail(f"the null block {block.block_id} is referenced, listed or hashed")
                continue
            bid = block.block_id
            refs = references.get(bid, 0) + self._pins.get(bid, 0)
            if block.ref_count != refs:
                fail(f"block {bid} ref_count {block.ref_count} but {refs} block-table references and pins")
            if refs > 0:
                if bid in places:
                    fail(f"block {bid} is referenced but {places[bid]}")
                if block.state != USED:
                    fail(f"block {bid} is referenced but marked {block.state}")
                used += 1
                filled += block.num_filled
            else:
                where = places.get(bid)
                if where is None:
                    fail(f"block {bid} is neither free, cached, held nor owned (leaked)")
                if block.state != where:
                    fail(f"block {bid} is in the {where} list but marked {block.state}")
            if block.state == CACHED and block.block_hash is None:
                fail(f"cached block {bid} has no hash")
            if block.num_filled > 0 and block.state == FREE:
                fail(f"free block {bid} claims {block.num_filled} filled slots")
            if not self.caching:
                continue
            if block.block_hash is not None and self._hash_to_block.get(block.block_hash) != bid:
                fail(f"block {bid} has a hash the cache does not map to it")
        for h, bid in self._hash_to_block.items():
            if self.blocks[bid].block_hash != h:
                fail(f"hash map names block {bid}, which holds another hash")
        for bid in self._hidden:
            if self.blocks[bid].state not in (USED, HELD):
                fail(f"block {bid} is hidden for a tentative step but {self.blocks[bid].state}")
        if used != self.num_used:
            fail(f"{used} blocks referenced, counter says {self.num_used}")
        if filled != self.filled_slots:
            fail(f"{filled} filled slots, counter says {self.filled_slots}")
        if len(free) + len(lru) + len(held) + used != self.num_usable:
            fail("free + cached + held + used != total")
