"""A pool of physical KV blocks for one memory tier: ref counts, free list, held blocks.

Every block (``manager/block.py``) is in exactly one state:

- FREE: holds nothing; in ``_free`` (a deque: allocation pops the left end, a release appends
  to the right end, an undo puts a block back at the end it left from: O(1) each).
- USED: referenced by ``ref_count`` >= 1 block-table entries (and pins, below).
- CACHED: unreferenced, but holds a full block whose content hash is known, so a later
  prompt with the same prefix can reuse it; in the prefix cache's LRU
  (``manager/prefix_cache.py``), evicted from its head only when no FREE block is left.
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

Per-owner counts (``owned``): the blocks that each owner's (tenant's) block tables name, each
counted once however many tables share it: what a tenant's quota of GPU blocks reads, in O(1)
(``manager/tenancy.py``'s ``QuotaCheck``). A block's *table references* are its ``ref_count`` less
its pins; it counts for its ``owner`` while it has at least one. The count moves where that
number moves between 0 and 1: ``allocate`` and ``acquire`` (which take the owner, and set it on
the block), ``incref``/``decref`` of a block that only pins hold besides, and the undo of each.
Pins never move it (``pin`` and ``unpin`` leave table references as they are). The count lives
here, not in the sequence table, because every undo function has the block in hand: a rollback
counts for the block's own owner, whichever tenant's step is current when it runs (a tentative
step rolled back beside another tenant's step). A block's owner is set when it gains its first
reference and never needs undoing: nothing gives another tenant a block until it has none
(prefix hashes are per tenant, a hidden block is its step's alone), and every gain but an undo's
sets it again. Derived data, never logged: recovery rebuilds it (``count_owners``) and the
invariant checker recounts it.

Complexity: allocate, acquire, incref, decref, fill, lookup and register are O(1) (the free
deque's ends and the prefix cache's intrusive LRU). Every mutation records its inverse in the
shared ``Journal`` so that an all-or-nothing step can roll back exactly. The invariant checker
is ``manager/invariants.py``'s ``check_pool``.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Iterable, Optional

from kvpager.errors import InvariantViolation
from .block import CACHED, FREE, HELD, NULL, NULL_BLOCK, USED, Block
from .journal import Journal
from .prefix_cache import PrefixCache

__all__ = ["CACHED", "FREE", "HELD", "NULL", "NULL_BLOCK", "USED", "Block", "BlockPool"]


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
        self._free: deque[int] = deque(range(first, num_blocks))  # FREE blocks; allocate pops the left end
        self.cache = PrefixCache(name)  # hash -> block, and the LRU of CACHED blocks (manager/prefix_cache.py)
        self._held: Optional[dict[int, None]] = None  # insertion-ordered set while a step runs
        self._tentative_held: set[int] = set()  # HELD blocks of tentative steps
        self._pins: Counter[int] = Counter()     # block -> references kept by tentative steps
        # True while a tentative step is undone after its plan went out: a block it took may have
        # been written by the workers (a copy or swap-in target), so none goes back to the cache.
        self.plan_may_have_run = False
        self.num_used = 0
        self.filled_slots = 0  # sum of num_filled over USED blocks
        self.owned: dict[str, int] = {}  # owner -> blocks its tables name (owners with none are absent)
        self.evictions = 0

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached

    @property
    def num_held(self) -> int:
        """HELD blocks: the current step's and the tentative steps'."""
        return (len(self._held) if self._held else 0) + len(self._tentative_held)

    @property
    def num_held_by_step(self) -> int:
        """HELD blocks of the step being applied now."""
        return len(self._held) if self._held else 0

    def owned_by(self, owner: str) -> int:
        """Blocks that ``owner``'s block tables name, each once. O(1)."""
        return self.owned.get(owner, 0)

    @property
    def num_available(self) -> int:
        """Blocks that ``allocate`` can hand out now (free ones, then evicted cached ones)."""
        return len(self._free) + self.cache.num_cached

    # ---- allocation and references ------------------------------------------------------
    def allocate(self, owner: str) -> int:
        """Take a FREE block, or evict the least recently used CACHED one, for a table of ``owner``;
        ref_count becomes 1."""
        if self._free:
            block = self.blocks[self._free.popleft()]
            self._journal.record(self._undo_allocate_free, block, block.block_hash)
            block.block_hash = None
        else:
            evicted = self.cache.evict_oldest()
            if evicted is None or evicted.block_hash is None:
                raise InvariantViolation(f"{self.name} pool: allocate with no available block")
            block, old_hash = evicted, evicted.block_hash
            block.block_hash = None
            self.evictions += 1
            self._journal.record(self._undo_allocate_evict, block, old_hash, block.num_filled)
        block.state = USED
        block.ref_count = 1
        block.num_filled = 0
        block.owner = owner
        self._gain(block)
        self.num_used += 1
        return block.block_id

    def incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count += 1
        if self._pins and block.ref_count - 1 == self._pins.get(block_id, 0):
            self._gain(block)  # only pins held it: a table names it again
        self._journal.record(self._undo_incref, block)

    def decref(self, block_id: int) -> bool:
        """Drop one reference; returns True when it was the last (the block leaves USED)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            if self._pins and block.ref_count == self._pins.get(block_id, 0):
                self._lose(block)  # only pins hold it now: no table names it
            self._journal.record(self._undo_decref, block)
            return False
        self._lose(block)
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

    def acquire(self, block_id: int, owner: str) -> None:
        """Take a reference to a block found by ``lookup`` (USED, CACHED or HELD) for a table of
        ``owner`` (the block's own: prefix hashes are per tenant)."""
        block = self.blocks[block_id]
        state = block.state
        if state == USED:
            self.incref(block_id)
            return
        if state == CACHED:
            prev, nxt = self.cache.take(block)
            self._journal.record(self._undo_acquire_cached, block, prev, nxt)
        elif state == HELD and self._held is not None:
            del self._held[block_id]
            self._journal.record(self._undo_acquire_held, block)
        else:
            raise InvariantViolation(f"{self.name} block {block_id} is {state}; cannot acquire")
        block.state = USED
        block.ref_count = 1
        block.owner = owner
        self._gain(block)
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
        """The block holding this prefix, unless a tentative step owns it (hidden). O(1)."""
        return self.cache.lookup(block_hash)

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Make a full block findable by its prefix hash (first block with a hash wins)."""
        block = self.blocks[block_id]
        if not self.caching:
            self._journal.record(self._undo_carry_hash, block, block.block_hash)
            block.block_hash = block_hash
            return
        if block.block_hash is None and not self.cache.holds(block_hash):
            block.block_hash = block_hash
            self.cache.add(block_hash, block_id)
            self._journal.record(self._undo_register, block)

    def hash_of(self, block_id: int) -> Optional[bytes]:
        return self.blocks[block_id].block_hash

    def forget_contents(self) -> None:
        """Drop every content hash (a worker was replaced: what its blocks held is gone).
        CACHED blocks become FREE; USED blocks stay with their sequences. O(num_blocks)."""
        for block in self.blocks:
            block.block_hash = None
        for block in self.cache.clear():
            self._park(block)

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
        self.cache.hide(block_id)

    def unhide(self, block_id: int) -> None:
        self.cache.unhide(block_id)

    # ---- internals ----------------------------------------------------------------------
    def _gain(self, block: Block) -> None:
        """``block`` gained its first table reference: count it for its owner. O(1)."""
        owned = self.owned
        owned[block.owner] = owned.get(block.owner, 0) + 1

    def _lose(self, block: Block) -> None:
        """``block`` lost its last table reference: uncount it. O(1)."""
        owned, owner = self.owned, block.owner
        left = owned[owner] - 1
        if left:
            owned[owner] = left
        else:
            del owned[owner]   # so that the map holds only owners with blocks

    def _park(self, block: Block) -> None:
        if self.caching and block.block_hash is not None:
            block.state = CACHED
            self.cache.push(block)
        else:
            block.state = FREE
            block.num_filled = 0
            self._free.append(block.block_id)

    # Inverses of the mutations above, run by Journal.rollback in reverse order.
    def _undo_allocate_free(self, block: Block, old_hash: Optional[bytes]) -> None:
        self._lose(block)
        block.state, block.ref_count, block.num_filled = FREE, 0, 0
        block.block_hash = old_hash
        self.num_used -= 1
        self._free.appendleft(block.block_id)

    def _undo_allocate_evict(self, block: Block, old_hash: bytes, old_filled: int) -> None:
        self._lose(block)
        self.num_used -= 1
        if self.cache.holds(old_hash) or self.plan_may_have_run:
            # Another block took that prefix since, or the workers may have written this block:
            # it comes back FREE, never as a cache entry whose content may be gone. Its prefix is
            # evicted all the same: the count stays (and never goes back under a scrape).
            block.state, block.ref_count, block.num_filled = FREE, 0, 0
            self._free.appendleft(block.block_id)
            return
        self.evictions -= 1
        block.state, block.ref_count, block.num_filled = CACHED, 0, old_filled
        block.block_hash = old_hash
        self.cache.add(old_hash, block.block_id)
        self.cache.insert(block)

    def _undo_incref(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == self._pins.get(block.block_id, 0):
            self._lose(block)  # the other table references went while the step was tentative
        if block.ref_count == 0:
            self._leave_used(block)

    def _undo_decref(self, block: Block) -> None:
        block.ref_count += 1
        if self._pins and block.ref_count - 1 == self._pins.get(block.block_id, 0):
            self._gain(block)  # only pins held it meanwhile

    def _undo_release(self, block: Block) -> None:
        if block.state == HELD and self._held is not None:
            del self._held[block.block_id]
        elif block.state == CACHED:
            self.cache.take(block)
        else:
            popped = self._free.pop()
            if popped != block.block_id:
                raise InvariantViolation(f"undo release: free tail {popped}, expected {block.block_id}")
        block.state, block.ref_count = USED, 1
        self._gain(block)   # its owner is still the one whose table named it
        self.num_used += 1
        self.filled_slots += block.num_filled

    def _undo_acquire_cached(self, block: Block, prev: Block, nxt: Block) -> None:
        self._undo_acquire(block)
        block.state = CACHED
        self.cache.insert(block, prev, nxt)  # at its old place if that still exists

    def _undo_acquire_held(self, block: Block) -> None:
        self._undo_acquire(block)
        block.state = HELD
        if self._held is None:
            raise InvariantViolation(f"{self.name} pool: undo of a held block outside a step")
        self._held[block.block_id] = None

    def _undo_acquire(self, block: Block) -> None:
        self._lose(block)
        block.ref_count = 0
        self.num_used -= 1
        self.filled_slots -= block.num_filled

    def _undo_fill(self, block: Block, old: int) -> None:
        self.filled_slots -= block.num_filled - old
        block.num_filled = old

    def _undo_carry_hash(self, block: Block, old_hash: Optional[bytes]) -> None:
        block.block_hash = old_hash

    def _undo_register(self, block: Block) -> None:
        if block.block_hash is not None:
            self.cache.discard(block.block_hash)
        block.block_hash = None

    # ---- checking -----------------------------------------------------------------------
    def lru_order(self) -> list[int]:
        return self.cache.order()

    def free_order(self) -> list[int]:
        return list(self._free)

    def load(self, free: Iterable[int], lru: Iterable[int], by_hash: dict[bytes, int]) -> None:
        """Refill a new pool's free list and prefix cache from a snapshot (``manager/recovery.py``,
        which sets the block records and counters). O(num_blocks)."""
        self._free = deque(free)
        self.cache.load((self.blocks[b] for b in lru), by_hash)

    def count_owners(self, tables: Iterable[tuple[str, Iterable[int]]]) -> None:
        """Set the owner of every block named in ``tables`` ((owner, block table) of each sequence
        of this tier) and count ``owned`` again from them (recovery: both are derived, never
        logged). O(entries)."""
        blocks = self.blocks
        named: dict[int, str] = {}
        for owner, table in tables:
            for b in table:
                named[b] = owner
        for b, owner in named.items():
            blocks[b].owner = owner
        self.owned = dict(Counter(named.values()))

    def held_ids(self) -> set[int]:
        """Every HELD block: the current step's and the tentative steps'. O(held)."""
        return set(self._held or ()) | self._tentative_held

    def pins_on(self, block_id: int) -> int:
        """References tentative steps keep on this block. O(1)."""
        return self._pins.get(block_id, 0)
