"""The manager's invariant checker: every block is free, cached, held or owned exactly as the
block tables say (ref counts and pins, fill, owner, totals per tier and per tenant: the pools'
``owned`` against ``tenancy.usage``), sequences and their hash state agree, a packed block table
marked current encodes its table. O(blocks + sequences): tests, the demo and recovery call it,
never the hot path."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Mapping, NoReturn

from kvpager.errors import InvariantViolation, quote
from kvpager.numeric import ceil_div
from .batch_tables import check_packed
from .block import CACHED, FREE, HELD, NULL, USED
from .block_pool import BlockPool
from .sequence import CPU, GPU
from .tenancy import usage

if TYPE_CHECKING:
    from .block_manager import BlockManager


def check_manager(m: "BlockManager") -> None:
    """Raise InvariantViolation unless every block is free, cached or owned exactly as the
    block tables say (refcounts, fill, totals per tier). O(blocks + sequences)."""
    B = m.block_size
    refs: dict[str, Counter[int]] = {GPU: Counter(), CPU: Counter()}
    fill: dict[str, dict[int, int]] = {GPU: {}, CPU: {}}
    swapped = entries = 0
    owned: Counter[str] = Counter()
    for seq in m.seqs.values():
        table = seq.block_ids
        if seq.num_tokens < 1 or len(table) != ceil_div(seq.num_tokens, B):
            raise InvariantViolation(f"sequence {quote(seq.seq_id)}: {seq.num_tokens} tokens in {len(table)} blocks")
        if len(set(table)) != len(table):
            raise InvariantViolation(f"sequence {quote(seq.seq_id)} names a block twice: {table}")
        if seq.pending_tokens is not None and len(seq.pending_tokens) != seq.num_tokens % B:
            raise InvariantViolation(f"sequence {quote(seq.seq_id)}: hash state out of step with its length")
        check_packed(seq)
        swapped += seq.tier == CPU
        entries += len(table)
        owner = m.seqs.owner(seq.seq_id)
        owned[owner] += 1
        refs[seq.tier].update(table)
        blocks = (m.gpu if seq.tier == GPU else m.cpu).blocks
        for i, b in enumerate(table):
            filled = min(B, seq.num_tokens - i * B)
            fill[seq.tier][b] = max(fill[seq.tier].get(b, 0), filled)
            if blocks[b].owner != owner:
                raise InvariantViolation(
                    f"{seq.tier} block {b} of sequence {quote(seq.seq_id)} records owner {blocks[b].owner!r}, "
                    f"not {owner!r}")
    both = [s for s in m.lost if s in m.seqs]
    if both:
        raise InvariantViolation(f"sequence {quote(both[0])} is both live and lost")
    if swapped != m.seqs.num_swapped:
        raise InvariantViolation(f"{swapped} sequences swapped out, counter says {m.seqs.num_swapped}")
    if entries != m.seqs.num_entries:
        raise InvariantViolation(f"{entries} block-table entries in live sequences, counter says {m.seqs.num_entries}")
    if owned != m.seqs.owned:
        raise InvariantViolation(f"live sequences per tenant {dict(owned)}, counters say {m.seqs.owned}")
    used = usage(m)
    for tier, pool in ((GPU, m.gpu), (CPU, m.cpu)):
        counted = {t: n for t, u in used.items() if (n := u.gpu_blocks if tier == GPU else u.cpu_blocks)}
        if counted != pool.owned:
            raise InvariantViolation(f"{tier} blocks per tenant {counted}, counters say {pool.owned}")
    for tier, pool in ((GPU, m.gpu), (CPU, m.cpu)):
        check_pool(pool, refs[tier])
        for b, filled in fill[tier].items():
            if pool.blocks[b].num_filled != filled:
                raise InvariantViolation(
                    f"{tier} block {b} records {pool.blocks[b].num_filled} filled slots; its sequences fill {filled}")
        if m._step is None and pool.num_held_by_step:
            raise InvariantViolation(f"{tier} pool holds {pool.num_held_by_step} blocks outside a step")


def check_pool(pool: BlockPool, references: Mapping[int, int]) -> None:
    """Every block of ``pool`` is in exactly the place its state says (free list, LRU, held, or
    referenced as often as ``references``, block id -> block-table entries naming it, plus pins
    say), and the pool's counters and prefix cache agree. O(num_blocks)."""

    def fail(msg: str) -> NoReturn:
        raise InvariantViolation(f"{pool.name} pool: {msg}")

    free, lru = pool.free_order(), pool.lru_order()
    if len(set(free)) != len(free):
        fail("a block is twice in the free list")
    pool.cache.check(pool.blocks, pool.caching, fail)
    held = pool.held_ids()
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
    for block in pool.blocks:
        if block.state == NULL:
            if block.ref_count or block.block_id in places or block.block_hash is not None:
                fail(f"the null block {block.block_id} is referenced, listed or hashed")
            continue
        bid = block.block_id
        refs = references.get(bid, 0) + pool.pins_on(bid)
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
        if block.num_filled > 0 and block.state == FREE:
            fail(f"free block {bid} claims {block.num_filled} filled slots")
    if used != pool.num_used:
        fail(f"{used} blocks referenced, counter says {pool.num_used}")
    if filled != pool.filled_slots:
        fail(f"{filled} filled slots, counter says {pool.filled_slots}")
    if len(free) + len(lru) + len(held) + used != pool.num_usable:
        fail("free + cached + held + used != total")
