"""One summary of a block manager's state, for tests that compare it before and after a call.

    before = fingerprint(manager)
    ...a call that must fail, or be rolled back...
    assert fingerprint(manager) == before

or, of a running server's manager (tests/conftest.py's ``running_server``), ``served_fingerprint(service)``.

It reads only what the manager offers to everyone (``stats()``, ``counters``, the sequence
table's values, each pool's blocks, counts, ``free_order()``, ``lru_order()`` and ``lookup()``),
never a private attribute: a test that compares fingerprints then keeps working when the
manager's insides change, and fails only when something observable changed. One copy, here, so
that every such test agrees on what "nothing changed" means.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def pool_state(pool) -> tuple:
    """A pool's blocks (id, state, ref count, hash, filled slots), free order, LRU order, held,
    used, filled and eviction counts, and its prefix index (hash -> block, through lookup())."""
    blocks = [(b.block_id, b.state, b.ref_count, b.block_hash, b.num_filled) for b in pool.blocks]
    hashes = {b.block_hash for b in pool.blocks if b.block_hash is not None}  # a swapped-out copy carries
    index = {h: pool.lookup(h) for h in hashes if pool.lookup(h) is not None}  # its hash unregistered
    return (blocks, pool.free_order(), pool.lru_order(), pool.num_held, pool.num_used, pool.filled_slots,
            pool.evictions, index)


def sequences_state(manager) -> list[tuple]:
    """Each sequence's id, block table, length, tier, namespace and prefix-hash state, by id."""
    return sorted(
        (s.seq_id, tuple(s.block_ids), s.num_tokens, s.tier, s.namespace, s.last_hash,
         None if s.pending_tokens is None else tuple(s.pending_tokens))
        for s in manager.seqs.values()
    )


def fingerprint(manager) -> tuple[Any, ...]:
    """Everything an operation may change. ``stats().steps`` is left out: it numbers step
    attempts (every call gets a fresh step id, applied or not)."""
    stats = dataclasses.asdict(manager.stats())
    del stats["steps"]
    return (pool_state(manager.gpu), pool_state(manager.cpu), sequences_state(manager), manager.seqs.num_swapped,
            len(manager.seqs), stats, dataclasses.asdict(manager.counters))


def served_fingerprint(service) -> tuple[Any, ...]:
    """``fingerprint`` of a running server's manager, taken under the service's lock after checking
    its invariants (a test then compares the state as the next call will find it)."""
    with service.lock:
        service.manager.check_invariants()
        return fingerprint(service.manager)
