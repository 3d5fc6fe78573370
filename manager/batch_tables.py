"""The block tables of a step's answer, in the forms a caller's kernels read: vLLM's padded rows
(a list, or packed little-endian int32 bytes reused across steps) and FlashInfer's CSR. Only the
forms asked for are built: O(rows) Python steps plus O(entries) in C-level list operations."""

from __future__ import annotations

import sys
from array import array
from itertools import accumulate, chain

from .plan import (
    BatchTables,
    TableLayout,
)
from .sequence import Sequence, SequenceTable


def batch_tables(seqs: SequenceTable, touched: dict[str, list[int]], block_size: int,
             layout: TableLayout = TableLayout.BOTH) -> BatchTables:
    """The batch of the touched sequences, with the block-table forms ``layout`` asks for.
    O(rows) Python steps plus O(entries) copied by C-level list operations."""
    get = seqs.get
    rows: list[Sequence] = [get(seq_id) for seq_id in touched]  # type: ignore[misc]  # touched ones are live
    tables = [seq.block_ids for seq in rows]
    lengths = list(map(len, tables))
    max_blocks = max(lengths, default=0)
    queries = touched.values()
    out = BatchTables(
        seq_ids=list(touched),
        context_lens=[seq.num_tokens for seq in rows],
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
        out.block_tables_packed = packed_padded(rows, lengths, max_blocks)
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


def packed_table(seq: Sequence) -> bytes:
    """The sequence's block table as little-endian int32 bytes, reused from ``seq.packed_table``
    while the table equals the copy kept there. A decode step changes one table in 1/block_size
    steps, so most rows cost one C-level list comparison. O(blocks)."""
    table, kept = seq.block_ids, seq.packed_table
    if kept is not None and kept[0] == table:
        return kept[1]
    row = array(_INT32, table)
    if sys.byteorder == "big":
        row.byteswap()
    data = row.tobytes()
    seq.packed_table = (table[:], data)
    return data


def packed_padded(seqs: list[Sequence], lengths: list[int], width: int) -> bytes:
    """Row-major ``[len(seqs), width]`` little-endian int32 table, rows padded with block 0 (the
    bytes of ``_padded``'s list). O(rows) Python steps, the rest C-level copies."""
    zeros = memoryview(bytes(4 * width))  # slices of it are views: no copy until the join
    parts: list[bytes | memoryview] = []
    for seq, length in zip(seqs, lengths):
        kept = seq.packed_table  # packed_table's check, inline: this loop runs for every row of every step
        parts.append(kept[1] if kept is not None and kept[0] == seq.block_ids else packed_table(seq))
        if length < width:
            parts.append(zeros[:4 * (width - length)])
    return b"".join(parts)


def _last_page_lens(context_lens: list[int], lengths: list[int], block_size: int) -> list[int]:
    """Tokens filled in each sequence's last block (CSR ``kv_last_page_len``). O(rows)."""
    return [n - (length - 1) * block_size for n, length in zip(context_lens, lengths)]
