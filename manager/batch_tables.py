"""The block tables of a step's answer, in the forms a caller's kernels read: vLLM's padded rows
(a list, or packed little-endian int32 bytes reused across steps) and FlashInfer's CSR. Only the
forms asked for are built: O(rows) Python steps plus O(entries) in C-level list operations."""

from __future__ import annotations

import sys
from array import array
from itertools import accumulate, chain
from operator import attrgetter

from kvpager.errors import InvariantViolation, quote
from .plan import (
    BatchTables,
    TableLayout,
)
from .sequence import Sequence, SequenceTable


def batch_tables(seqs: SequenceTable, touched: dict[str, list[int]], block_size: int,
             layout: TableLayout = TableLayout.BOTH) -> BatchTables:
    """The batch of the touched sequences, with the block-table forms ``layout`` asks for.
    O(rows) steps, all but the packed rows' in C (``map`` over the rows), plus O(entries)
    copied by C-level list operations."""
    rows: list[Sequence] = list(map(seqs.getter(), touched))  # type: ignore[arg-type]  # touched ones are live
    tables: list[list[int]] = []
    lengths: list[int] = []
    if layout.padded or layout.csr:
        tables = list(map(_BLOCK_IDS, rows))
        lengths = list(map(len, tables))
        max_blocks = max(lengths, default=0)
    else:  # the lengths' maximum only
        max_blocks = max(map(len, map(_BLOCK_IDS, rows)), default=0)
    queries = touched.values()
    out = BatchTables(
        seq_ids=list(touched),
        context_lens=list(map(_NUM_TOKENS, rows)),
        query_lens=list(map(len, queries)),
        slot_mapping=list(chain.from_iterable(queries)),
        max_blocks=max_blocks,
        kv_indptr=[],
    )
    if layout.padded:
        out.block_tables = _padded(tables, lengths, max_blocks)
    if layout.csr:
        out.kv_indptr = [0, *accumulate(lengths)]
        out.kv_indices = list(chain.from_iterable(tables))
        out.kv_last_page_len = _last_page_lens(out.context_lens, lengths, block_size)
    if layout.packed:
        out.block_tables_packed = packed_rows(rows, max_blocks)
    return out


def _padded(tables: list[list[int]], lengths: list[int], width: int) -> list[int]:
    """Row-major ``[len(tables), width]`` table, each row a table followed by block-0 padding.
    One zeroed list, then one slice assignment (a C-level copy) per row: O(rows + entries)."""
    padded = [0] * (len(tables) * width)
    start = 0
    for table, length in zip(tables, lengths):
        padded[start:start + length] = table
        start += width
    return padded


_INT32 = "i" if array("i").itemsize == 4 else "l"  # a 4-byte array type code
_BLOCK_IDS, _NUM_TOKENS = attrgetter("block_ids"), attrgetter("num_tokens")


def _int32_bytes(entries: list[int]) -> bytes:
    """Little-endian int32 bytes of ``entries``. O(entries), in C."""
    row = array(_INT32, entries)
    if sys.byteorder == "big":
        row.byteswap()
    return row.tobytes()


def packed_table(seq: Sequence, width: int) -> bytes:
    """The sequence's block table as little-endian int32 bytes padded with block 0 to ``width``
    entries, kept in ``seq.packed_row`` for the next steps. Reused as it is while it is current
    (no change of the table since: ``seq.packed_width`` >= 0, see ``manager/sequence.py``) and as
    wide; else while its copy of the table (``seq.packed_table``) equals the table (one C-level
    list comparison). A decode step changes one table in 1/block_size steps, by one block at its
    end: then only the new entries are packed (the kept copy is a prefix of the table: checked).
    A new width only re-pads the kept bytes. O(blocks), in C but for O(1) Python steps."""
    if seq.packed_width == width:
        return seq.packed_row
    table, kept = seq.block_ids, seq.packed_table
    if kept is None:
        copy, raw = table[:], _int32_bytes(table)
    else:
        copy, raw = kept
        if seq.packed_width < 0 and copy != table:
            k = len(copy)
            if k < len(table) and table[:k] == copy:  # blocks appended: pack only those
                raw += _int32_bytes(table[k:])
            else:
                raw = _int32_bytes(table)
            copy = table[:]
    pad = 4 * width - len(raw)
    seq.packed_table = (copy, raw)
    seq.packed_row = raw + bytes(pad) if pad > 0 else raw
    seq.packed_width = width
    return seq.packed_row


def packed_rows(seqs: list[Sequence], width: int) -> bytes:
    """Row-major ``[len(seqs), width]`` little-endian int32 table, rows padded with block 0 (the
    bytes of ``_padded``'s list; no table longer than ``width``). One list comprehension over the
    rows, each its kept row while that is current and as wide (``packed_table``'s first check,
    inline: this runs for every row of every step; it reads no table, which matters: comparing
    every table with a copy cost as much as the rest of the step's tables, 0.1 ms at 331 rows,
    the rows being cold in the CPU cache), then one join. O(rows) Python steps, the rest C-level
    copies."""
    return b"".join([seq.packed_row if seq.packed_width == width else packed_table(seq, width) for seq in seqs])


def packed_padded(seqs: list[Sequence], lengths: list[int], width: int) -> bytes:
    """``packed_rows`` for callers that have the tables' lengths (not needed: kept rows are padded)."""
    return packed_rows(seqs, width)


def check_packed(seq: Sequence) -> None:
    """Raise InvariantViolation if the sequence's packed row is current but is not its block
    table's (``manager/invariants.py``). O(blocks)."""
    width = seq.packed_width
    if width < 0:
        return
    table = seq.block_ids
    raw = _int32_bytes(table)
    if width < len(table) or seq.packed_table != (table, raw) or seq.packed_row != raw + bytes(4 * width - len(raw)):
        raise InvariantViolation(f"sequence {quote(seq.seq_id)}: its packed block table is current but does not "
                                 f"encode its table {table}")


def _last_page_lens(context_lens: list[int], lengths: list[int], block_size: int) -> list[int]:
    """Tokens filled in each sequence's last block (CSR ``kv_last_page_len``). O(rows)."""
    return [n - (length - 1) * block_size for n, length in zip(context_lens, lengths)]
