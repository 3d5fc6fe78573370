"""The prefix cache of one pool: which block holds each prefix hash, and the LRU order of the
CACHED blocks (unreferenced blocks kept for a later prompt with the same prefix).

The LRU is an intrusive doubly linked list over the block records' ``prev``/``next`` fields,
between two sentinels (as vLLM v1's free block queue), so that a cache hit takes a block out of
its middle in O(1); eviction takes the head (the least recently used block). A *hidden* block is
one a tentative step owns (``manager/tentative.py``): ``lookup`` does not find it, so no other
step can share it.

Complexity: lookup, add, discard, push, take, insert, evict_oldest, hide and unhide are O(1);
order, clear and check are O(cached blocks) or O(hashes). The pool (``manager/block_pool.py``)
decides when a block enters or leaves; this module only keeps the two structures consistent.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Optional, Sequence

from kvpager.errors import InvariantViolation
from .block import CACHED, HELD, USED, Block


class PrefixCache:
    def __init__(self, name: str) -> None:
        self.name = name
        self._by_hash: dict[bytes, int] = {}   # prefix hash -> block id (the first block registered with it)
        self._head = Block(-1)                 # sentinels: head.next is the least recently used block
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._num_cached = 0
        self._hidden: Counter[int] = Counter()  # block -> tentative steps that own it; lookup skips these

    @property
    def num_cached(self) -> int:
        """Blocks in the LRU. O(1)."""
        return self._num_cached

    # ---- the hash map ------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> Optional[int]:
        """The block holding this prefix, unless a tentative step owns it (hidden). O(1)."""
        block_id = self._by_hash.get(block_hash)
        if block_id is not None and self._hidden and block_id in self._hidden:
            return None
        return block_id

    def holds(self, block_hash: bytes) -> bool:
        """Whether some block (hidden or not) is registered under this hash. O(1)."""
        return block_hash in self._by_hash

    def add(self, block_hash: bytes, block_id: int) -> None:
        self._by_hash[block_hash] = block_id

    def discard(self, block_hash: bytes) -> None:
        del self._by_hash[block_hash]

    def hashes(self) -> dict[bytes, int]:
        """A copy of the hash map (snapshots). O(hashes)."""
        return dict(self._by_hash)

    # ---- the LRU -----------------------------------------------------------------------------
    def push(self, block: Block) -> None:
        """Make ``block`` the most recently used. O(1)."""
        self._link(block, _linked(self._tail.prev), self._tail)

    def take(self, block: Block) -> tuple[Block, Block]:
        """Take ``block`` out of the LRU (a cache hit, or an eviction); returns its old
        neighbours, for ``insert`` to put it back. O(1)."""
        prev, nxt = _linked(block.prev), _linked(block.next)
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._num_cached -= 1
        return prev, nxt

    def insert(self, block: Block, prev: Optional[Block] = None, nxt: Optional[Block] = None) -> None:
        """Put ``block`` back between ``prev`` and ``nxt`` if they are still neighbours, else at
        the head (the next to be evicted). O(1)."""
        if prev is None or nxt is None or prev.next is not nxt:
            prev, nxt = self._head, _linked(self._head.next)
        self._link(block, prev, nxt)

    def evict_oldest(self) -> Optional[Block]:
        """Take the least recently used block out of the LRU and the hash map (its hash stays on
        the record, for the caller to journal); None when the LRU is empty. O(1)."""
        block = _linked(self._head.next)
        if block is self._tail:
            return None
        self.take(block)
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
        return block

    def order(self) -> list[int]:
        """Block ids from least to most recently used. O(cached blocks)."""
        out, block = [], _linked(self._head.next)
        while block is not self._tail:
            out.append(block.block_id)
            block = _linked(block.next)
        return out

    def clear(self) -> list[Block]:
        """Empty the LRU and the hash map; returns the blocks that were in the LRU, oldest first.
        O(cached blocks + hashes)."""
        out = []
        while (block := _linked(self._head.next)) is not self._tail:
            self.take(block)
            out.append(block)
        self._by_hash.clear()
        return out

    def load(self, lru: Iterable[Block], by_hash: dict[bytes, int]) -> None:
        """Fill an empty cache from a snapshot (``manager/recovery.py``)."""
        for block in lru:
            self.push(block)
        self._by_hash = dict(by_hash)

    # ---- tentative steps ---------------------------------------------------------------------
    def hide(self, block_id: int) -> None:
        self._hidden[block_id] += 1

    def unhide(self, block_id: int) -> None:
        hidden = self._hidden
        hidden[block_id] -= 1
        if not hidden[block_id]:
            del hidden[block_id]

    # ---- checking ----------------------------------------------------------------------------
    def check(self, blocks: Sequence[Block], caching: bool, fail: Callable[[str], None]) -> None:
        """The LRU's count, the hash map against the blocks' hashes, hidden blocks owned.
        O(blocks)."""
        lru = self.order()
        if len(lru) != self._num_cached:
            fail(f"LRU holds {len(lru)} blocks, counter says {self._num_cached}")
        for block in blocks:
            if block.state == CACHED and block.block_hash is None:
                fail(f"cached block {block.block_id} has no hash")
            if caching and block.block_hash is not None and self._by_hash.get(block.block_hash) != block.block_id:
                fail(f"block {block.block_id} has a hash the cache does not map to it")
        for h, bid in self._by_hash.items():
            if blocks[bid].block_hash != h:
                fail(f"hash map names block {bid}, which holds another hash")
        for bid in self._hidden:
            if blocks[bid].state not in (USED, HELD):
                fail(f"block {bid} is hidden for a tentative step but {blocks[bid].state}")

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        prev.next = nxt.prev = block
        block.prev, block.next = prev, nxt
        self._num_cached += 1


def _linked(block: Optional[Block]) -> Block:
    """A link of the list, which inside it is never None (only the sentinels' outer ends are)."""
    if block is None:
        raise InvariantViolation("prefix cache: a broken LRU link")
    return block
