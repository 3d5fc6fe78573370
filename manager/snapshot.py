"""The block manager's whole state as plain data (``manager_state``) and back (``restore_manager``):
what a snapshot of ``--state-dir`` holds (``manager/recovery.py``), and what the durability
tests compare. O(blocks + sequences) each; never inside a step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from .block_manager import BlockManager
from .block_pool import BlockPool
from .config import ManagerConfig
from .counts import Counters
from .sequence import CPU, GPU, Sequence
from .wal import CorruptState


def _pool_state(pool: BlockPool) -> dict[str, Any]:
    if pool.num_held:
        raise RuntimeError("snapshot inside a step")
    return {
        "num_blocks": pool.num_blocks,
        "blocks": [(b.state, b.ref_count, b.block_hash, b.num_filled) for b in pool.blocks],
        "free": pool.free_order(),
        "lru": pool.lru_order(),
        "hash_to_block": pool.cache.hashes(),
        "num_used": pool.num_used,
        "filled_slots": pool.filled_slots,
        "evictions": pool.evictions,
    }


def _restore_pool(pool: BlockPool, state: dict[str, Any]) -> None:
    if state["num_blocks"] != pool.num_blocks:
        raise CorruptState(f"the {pool.name} pool has {pool.num_blocks} blocks; the snapshot has {state['num_blocks']}")
    for block, (st, refs, h, filled) in zip(pool.blocks, state["blocks"]):
        block.state, block.ref_count, block.block_hash, block.num_filled = st, refs, h, filled
    pool.load(state["free"], state["lru"], state["hash_to_block"])
    pool.num_used, pool.filled_slots, pool.evictions = state["num_used"], state["filled_slots"], state["evictions"]


def manager_state(m: BlockManager) -> dict[str, Any]:
    """The whole BlockManager state as plain data (also what tests compare)."""
    return {
        "config": dataclasses.asdict(m.config),
        "steps": m.steps,
        "counters": dataclasses.asdict(m.counters),
        "op_counts": (dict(m.op_counts.applied), dict(m.op_counts.failed)),
        "gpu": _pool_state(m.gpu),
        "cpu": _pool_state(m.cpu),
        "seqs": [(s.seq_id, list(s.block_ids), s.num_tokens, s.tier, s.namespace, s.last_hash,
                  None if s.pending_tokens is None else list(s.pending_tokens)) for s in m.seqs.values()],
        "lost": dict(m.lost),
    }


def restore_manager(state: dict[str, Any], config: ManagerConfig) -> BlockManager:
    """A BlockManager holding what ``manager_state`` returned, under ``config``."""
    m = BlockManager(config)
    m.steps = state["steps"]
    m.counters = Counters(**state["counters"])
    applied, failed = state["op_counts"]
    m.op_counts.applied, m.op_counts.failed = Counter(applied), Counter(failed)
    _restore_pool(m.gpu, state["gpu"])
    _restore_pool(m.cpu, state["cpu"])
    for seq_id, table, n, tier, namespace, last_hash, pending in state["seqs"]:
        m.seqs.add_silently(Sequence(seq_id, table, n, tier, namespace, last_hash, pending))
    for pool, tier in ((m.gpu, GPU), (m.cpu, CPU)):  # blocks' owners: derived from the tables, never saved
        pool.count_owners((m.seqs.owner(s.seq_id), s.block_ids) for s in m.seqs.values() if s.tier == tier)
    m.lost = dict(state.get("lost", {}))
    return m


def config_from(d: dict[str, Any]) -> ManagerConfig:
    """A ManagerConfig from its ``asdict`` form (fields it no longer has are dropped)."""
    known = {f.name for f in dataclasses.fields(ManagerConfig)}
    return ManagerConfig(**{k: v for k, v in d.items() if k in known})
