"""The model inputs of a step's batch: which tokens each computed sequence feeds the model, at
which positions, read from the sequences the scheduler tracks and the batch tables the manager
answered with. With overlap, a token that a step still in flight computes is not known yet: it is
named by its row of that step's output instead (``StepInput.feedback_rows``)."""

from __future__ import annotations

from typing import Any, Optional

from .request import SeqState

# (token ids, positions, (sequence, its context length after the step) per computed sequence,
# feedback rows: per token, the row of the step in flight's output that holds it, -1 for a known
# token; None when every token is known).
BatchInputs = tuple[list[int], list[int], list[tuple[SeqState, int]], Optional[list[int]]]


def batch_inputs(batch: Any, seqs: dict[str, SeqState], fed_row: dict[str, int]) -> Optional[BatchInputs]:
    """The inputs of ``batch`` (a ``BatchTables``: seq_ids, query_lens, context_lens) over
    ``seqs`` (by id). A token not known yet (a sequence's last, computed by the step in flight)
    is 0, with its row of that step's output from ``fed_row`` (by sequence id); None when such a
    token's sequence has no row there. Sequences with nothing to compute (forked, swapped in) are
    left out. O(S + T)."""
    token_ids: list[int] = []
    positions: list[int] = []
    computed: list[tuple[SeqState, int]] = []
    rows: Optional[list[int]] = None
    for seq_id, q, ctx in zip(batch.seq_ids, batch.query_lens, batch.context_lens):
        if q == 1 and rows is not None:   # the fed decode case, without slices
            seq = seqs[seq_id]
            if len(seq.tokens) >= ctx:
                token_ids.append(seq.tokens[ctx - 1])
                rows.append(-1)
            else:
                row = fed_row.get(seq_id)
                if row is None:
                    return None
                token_ids.append(0)
                rows.append(row)
            positions.append(ctx - 1)
            computed.append((seq, ctx))
            continue
        if q == 0:  # forked or swapped in: nothing to compute
            continue
        seq = seqs[seq_id]
        known = seq.tokens[ctx - q:ctx]
        if len(known) < q:   # its last token is the step in flight's output
            row = fed_row.get(seq_id)
            if row is None or len(known) + 1 != q:
                return None
            if rows is None:
                rows = [-1] * len(token_ids)
            token_ids += known
            token_ids.append(0)
            rows += [-1] * len(known)
            rows.append(row)
        else:
            token_ids += known
            if rows is not None:
                rows += [-1] * q
        positions += range(ctx - q, ctx)
        computed.append((seq, ctx))
    return token_ids, positions, computed, rows
