"""The manager's invariant checker: every block is free, cached, held or owned exactly as the
block tables say (ref counts and pins, fill, totals per tier), sequences and their hash state
agree. O(blocks + sequences): tests, the demo and recovery call it, never the hot path."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvpager.errors import (
    InvariantViolation,
    quote,
)
from .sequence import CPU, GPU

if TYPE_CHECKING:
    from .block_manager import BlockManager


def check_manager(m: "BlockManager") -> None:
    """Raise InvariantViolation unless every block is free, cached or owned exactly as the
    block tables say (refcounts, fill, totals per tier). O(blocks + sequences)."""
    B = m.block_size
    refs: dict[str, Counter[int]] = {GPU: Counter(), CPU: Counter()}
    fill: dict[str, dict[int, int]] = {GPU: {}, CPU: {}}
    swapped = 0
    for seq in m.seqs.values():
        table = seq.block_ids
        if seq.num_tokens < 1 or len(table) != -(-seq.num_tokens // B):
            raise InvariantViolation(f"sequence {quote(seq.seq_id)}: {seq.num_tokens} tokens in {len(table)} blocks")
        if len(set(table)) != len(table):
            raise InvariantViolation(f"sequence {quote(seq.seq_id)} names a block twice: {table}")
        if seq.pending_tokens is not None and len(seq.pending_tokens) != seq.num_tokens % B:
            raise InvariantViolation(f"sequence {quote(seq.seq_id)}: hash state out of step with its length")
        swapped += seq.tier == CPU
        refs[seq.tier].update(table)
        for i, b in enumerate(table):
            filled = min(B, seq.num_tokens - i * B)
            fill[seq.tier][b] = max(fill[seq.tier].get(b, 0), filled)
    both = [s for s in m.lost if s in m.seqs]
    if both:
        raise InvariantViolation(f"sequence {quote(both[0])} is both live and lost")
    if swapped != m.seqs.num_swapped:
        raise InvariantViolation(f"{swapped} sequences swapped out, counter says {m.seqs.num_swapped}")
    for tier, pool in ((GPU, m.gpu), (CPU, m.cpu)):
        pool.check_invariants(refs[tier])
        for b, filled in fill[tier].items():
            if pool.blocks[b].num_filled != filled:
                raise InvariantViolation(
                    f"{tier} block {b} records {pool.blocks[b].num_filled} filled slots; its sequences fill {filled}")
        if m._step is None and pool.num_held_by_step:
            raise InvariantViolation(f"{tier} pool holds {pool.num_held_by_step} blocks outside a step")
