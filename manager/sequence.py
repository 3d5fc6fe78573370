"""The sequence table: each live sequence's block table, length, tier and prefix-hash state.

O(1) lookup, add and remove by id (a dict). It also keeps what the manager's limits on live
sequences read in O(1) (``max_sequences``, ``max_block_table_entries``, tenants'
``quota_sequences``: ``manager/state.py``): the block-table entries of all live sequences and the
live sequences of each owner (tenant). Both are derived from the table (``add``, ``remove``,
``save``'s undo, and the operations that lengthen a table: ``lengthened``), never logged, so a
recovered table rebuilds them; the invariant checker recounts them. Mutations go through ``SequenceTable`` so that
the journal can undo them; ``save`` snapshots what an operation may change in O(1), never
copying the block table or the pending tokens (operations only append to them, replace the
table's last entry, or replace either list whole). Every change of a block table comes after
``save`` (or in its undo), which is what lets a sequence's packed table (``Sequence.packed_row``)
be trusted without comparing tables until the next ``save``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, ValuesView

from .journal import Journal

GPU, CPU = "gpu", "cpu"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    block_ids: list[int]        # the block table, in the tier below
    num_tokens: int             # tokens whose K/V the table holds (or will after this step)
    tier: str                   # GPU (running) or CPU (swapped out)
    namespace: str              # prefix-cache namespace
    # Prefix hashing: hash of the last full block (or the namespace root) and the token ids
    # of the partially filled last block. None once a token id was not given: no block
    # after that point can be identified, so hashing stops for this sequence.
    last_hash: Optional[bytes]
    pending_tokens: Optional[list[int]]
    # The table as packed little-endian int32 bytes (manager/batch_tables.py), derived data, never
    # journaled: ``packed_row``, padded with block 0 to ``packed_width`` entries, is the table's
    # while ``packed_width`` >= 0 ("current"): set when the row is made, cleared (-1) by
    # ``SequenceTable.save`` and its undo, which every change of a table goes through (the journal
    # needs them: operations change a table only after ``save``, rollbacks only in its undo), so a
    # stale row (after a rollback, a swap, a copy-on-write) is never used; the invariant checker
    # verifies it (manager/invariants.py). ``packed_table`` (a copy of the table, its bytes
    # unpadded) lets a row no longer current be reused where the copy equals the table (compared
    # in full) or is a prefix of it.
    packed_table: Optional[tuple[list[int], bytes]] = None
    packed_width: int = -1
    packed_row: bytes = b""


def _no_owner(seq_id: str) -> str:
    return ""


class SequenceTable:
    def __init__(self, journal: Journal, owner: Callable[[str], str] = _no_owner) -> None:
        self._seqs: dict[str, Sequence] = {}
        self._journal = journal
        self.num_swapped = 0
        # The owner (tenant) of a sequence id: ``manager/tenancy.py``'s ``tenant_of``, passed in so
        # that this module stays below tenancy (which reads the table). O(length of the id).
        self.owner = owner
        self.num_entries = 0                  # block-table entries of all live sequences
        self.owned: dict[str, int] = {}       # owner -> its live sequences (owners with none are absent)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def get(self, seq_id: str) -> Optional[Sequence]:
        return self._seqs.get(seq_id)

    def getter(self) -> Callable[[str], Optional[Sequence]]:
        """``get`` as the table's own C-level lookup, for loops over many ids (a call from Python
        costs less, and ``map`` runs it without a Python frame). O(1)."""
        return self._seqs.get

    def values(self) -> ValuesView[Sequence]:
        return self._seqs.values()

    @property
    def num_running(self) -> int:
        return len(self._seqs) - self.num_swapped

    def owned_by(self, owner: str) -> int:
        """Live sequences of ``owner``. O(1)."""
        return self.owned.get(owner, 0)

    def _count(self, seq: Sequence, sign: int) -> None:
        """Count ``seq`` in (1) or out (-1) of the entry and owner counts. O(length of its id)."""
        self.num_entries += sign * len(seq.block_ids)
        owner = self.owner(seq.seq_id)
        held = self.owned.get(owner, 0) + sign
        if held:
            self.owned[owner] = held
        else:
            del self.owned[owner]   # so that the map holds only owners with live sequences

    def lengthened(self, entries: int) -> None:
        """A live sequence's table got ``entries`` more entries (an append's new blocks), after
        ``save`` (whose undo takes them back). O(1)."""
        self.num_entries += entries

    def add(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq
        if seq.tier == CPU:
            self.num_swapped += 1
        self._count(seq, 1)
        self._journal.record(self._undo_add, seq)

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq.seq_id]
        if seq.tier == CPU:
            self.num_swapped -= 1
        self._count(seq, -1)
        self._journal.record(self.add_silently, seq)

    def set_tier(self, seq: Sequence, tier: str) -> None:
        if seq.tier != tier:
            self.num_swapped += 1 if tier == CPU else -1
            seq.tier = tier

    def save(self, seq: Sequence) -> None:
        """Snapshot the fields an operation may change, before it changes them (every change of
        a sequence's block table comes after this call: it also marks the sequence's packed
        table as no longer current)."""
        seq.packed_width = -1
        if self._journal.active:
            table, pending = seq.block_ids, seq.pending_tokens
            self._journal.record(
                self._restore, seq, table, len(table), table[-1] if table else None,
                seq.num_tokens, seq.tier, seq.last_hash, pending, len(pending) if pending is not None else 0,
            )

    def _restore(self, seq: Sequence, table: list[int], length: int, last: Optional[int], num_tokens: int, tier: str,
                 last_hash: Optional[bytes], pending: Optional[list[int]], pending_len: int) -> None:
        # Operations only append to a table or replace its last entry or the whole list, and
        # only extend pending_tokens in place (or replace it): truncation undoes them.
        self.num_entries += length - len(seq.block_ids)   # the table it has now (a swap replaced it whole)
        del table[length:]
        if length and last is not None:
            table[-1] = last
        seq.block_ids = table
        seq.packed_width = -1
        seq.num_tokens = num_tokens
        self.set_tier(seq, tier)
        seq.last_hash = last_hash
        if pending is not None:
            del pending[pending_len:]
        seq.pending_tokens = pending

    def _undo_add(self, seq: Sequence) -> None:
        del self._seqs[seq.seq_id]
        if seq.tier == CPU:
            self.num_swapped -= 1
        self._count(seq, -1)

    def add_silently(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq
        if seq.tier == CPU:
            self.num_swapped += 1
        self._count(seq, 1)
