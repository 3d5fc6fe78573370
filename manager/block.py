"""The record of one physical KV block, and the states it can be in (``manager/block_pool.py``
says what each state means and which structure holds a block in it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FREE, USED, CACHED, HELD, NULL = "free", "used", "cached", "held", "null"
NULL_BLOCK = 0  # the GPU pool's reserved block: what padding entries of block tables name


@dataclass(slots=True, eq=False)
class Block:
    block_id: int                        # its index in the pool; never changes
    state: str = FREE                    # changed only by BlockPool
    ref_count: int = 0                   # block-table references and pins; changed only by BlockPool
    block_hash: Optional[bytes] = None   # prefix hash of a full block; set by register, cleared on eviction
    num_filled: int = 0                  # token slots written (the fullest sharer); set by BlockPool.fill
    # The tenant whose block tables name it (no block is shared across tenants): set by BlockPool when
    # the block gains its first block-table reference, meaningful while it has one; recovery sets it.
    owner: str = ""
    prev: Optional[Block] = None         # LRU links, meaningful only while CACHED; changed only by PrefixCache
    next: Optional[Block] = None
