"""The step contract: what one model step computes, as the scheduler hands it to the workers.

A scheduler builds a ``StepInput`` from the manager's ``Step`` answer and the tokens it wants
computed; every tensor-parallel rank runs it (``CacheWorker.execute_model``). Neither side
imports the other: this module, plain Python data, is all they share.

The block tables are the manager's own answer, unchanged: ``block_tables`` is the row-major
``[num_seqs, max_blocks]`` table of ``BatchTables`` (rows padded past each sequence's blocks;
the kernels never read past ``context_lens``), so the worker turns it into the kernels' tensor
with one copy and no per-row work. Rows whose ``query_lens`` is 0 (a sequence the step only
forked or swapped in) compute nothing and give no logits.

Ordering: the manager sends a step's plan (swaps and copies) to every worker before it answers
that Step, and the step's K/V writes and attention must run after the plan. ``plan_step_id``
names the plan this step needs (the step's own id when its plan moved blocks, else 0); a worker
that has not applied that plan refuses the step (``PlanNotApplied``) instead of reading blocks
that are still being moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Sequence

import numpy as np


class PlanNotApplied(RuntimeError):
    """A step reached a worker before the plan it needs (delayed, dropped or reordered): the
    worker ran nothing. Retrying after the plan arrives is safe."""


class FeedbackUnavailable(RuntimeError):
    """A step takes tokens from a previous step's output that this worker does not hold (it ran
    another step since, or it is not a single rank): the worker ran nothing."""


@dataclass(frozen=True, slots=True)
class StepInput:
    step_id: int                # the manager's id of the Step this input comes from
    plan_step_id: int           # the plan the workers must have applied first; 0: none needed
    token_ids: list[int]        # [T] tokens to compute, sequence after sequence
    positions: list[int]        # [T] each token's position in its sequence
    slot_mapping: list[int]     # [T] cache slot each token's K/V is written to
    query_lens: list[int]       # [S] tokens each sequence computes (0: none; no logits for it)
    context_lens: list[int]     # [S] tokens in each sequence's cache after the step, the new ones included
    # [S * max_blocks] the manager's padded block tables, row-major: a list, or the int32 array
    # of the packed answer (no per-entry conversion anywhere between the manager and the GPU).
    block_tables: Sequence[int]
    max_blocks: int             # row width of block_tables
    # What rank 0 returns for each sequence that computed tokens: False, its last token's float32
    # logits [vocab]; True, their argmax (greedy decoding: the token ids alone cross the wire).
    greedy: bool = False
    # Tokens the scheduler does not know yet (it sent this step before the previous one's tokens
    # came back): [T] ints, -1 for a token given in token_ids (where these rows hold 0), else the
    # row of step ``feedback_step``'s greedy output whose id the worker puts there on the device.
    # Single-rank groups only; a worker whose last greedy step is not feedback_step refuses the
    # step (FeedbackUnavailable) and runs nothing.
    feedback_rows: Sequence[int] | None = None
    feedback_step: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def query_start_loc(self) -> list[int]:
        """[S+1]: sequence i's tokens are ``[query_start_loc[i], query_start_loc[i+1])``. O(S)."""
        return [0, *accumulate(self.query_lens)]

    @property
    def decode_only(self) -> bool:
        """Every sequence computes exactly one token (a pure decode step). O(S), in C."""
        return len(self.token_ids) == len(self.query_lens) and self.query_lens.count(1) == len(self.query_lens)

    def check(self) -> None:
        """Raise ValueError naming the first inconsistency (lengths that disagree, a query longer
        than its context, a table too narrow for a context). O(S + T)."""
        t, s = len(self.token_ids), len(self.query_lens)
        if len(self.positions) != t or len(self.slot_mapping) != t:
            raise ValueError(f"step {self.step_id}: {t} token ids but {len(self.positions)} positions and "
                             f"{len(self.slot_mapping)} slots")
        if len(self.context_lens) != s:
            raise ValueError(f"step {self.step_id}: {s} query lengths but {len(self.context_lens)} context lengths")
        if sum(self.query_lens) != t:
            raise ValueError(f"step {self.step_id}: query lengths add up to {sum(self.query_lens)}, not the {t} tokens")
        if len(self.block_tables) != s * self.max_blocks:
            raise ValueError(f"step {self.step_id}: block tables hold {len(self.block_tables)} entries, "
                             f"not {s} rows of {self.max_blocks}")
        if not any(self.query_lens):
            raise ValueError(f"step {self.step_id}: no sequence computes a token")
        if self.feedback_rows is not None and (len(self.feedback_rows) != t or not self.feedback_step):
            raise ValueError(f"step {self.step_id}: {len(self.feedback_rows)} feedback rows for {t} tokens "
                             f"(feedback step {self.feedback_step})")
        if self.decode_only and min(self.context_lens) >= 1:
            return   # a decode step, its one condition checked in C (the loop below costs ~8 us at S = 256)
        for i, (q, ctx) in enumerate(zip(self.query_lens, self.context_lens)):
            if q < 0 or q > ctx:
                raise ValueError(f"step {self.step_id}: sequence {i} computes {q} tokens of a {ctx}-token context")

    @classmethod
    def from_step_reply(cls, reply: Any, token_ids: list[int], positions: list[int],
                        greedy: bool = False, feedback_rows: Sequence[int] | None = None,
                        feedback_step: int = 0) -> "StepInput":
        """The input for a manager ``StepResponse`` (read by field name, so no protobuf import):
        its step id, whether its plan moved blocks, and its batch tables as they are, with the
        tokens the scheduler computes (``token_ids``/``positions``, sequence after sequence, as
        many as ``batch.query_lens`` says). The reply must carry the padded tables (a Step asked
        for ``TABLE_LAYOUT_PADDED_PACKED``, ``PADDED`` or both), else ValueError.
        O(S + T) C-level copies (``[:]`` of a protobuf repeated field is cheaper than ``list()``)
        plus, for the packed table, an O(1) int32 view of its bytes (else an O(S * max_blocks) copy)."""
        plan, batch = reply.plan, reply.batch
        packed = getattr(batch, "block_tables_packed", b"")
        block_tables = unpack_int32(packed) if packed else batch.block_tables[:]
        if batch.max_blocks and len(block_tables) == 0:
            raise ValueError(f"step {reply.step_id}: the answer carries no padded block tables; ask the manager "
                             "for them (TABLE_LAYOUT_PADDED_PACKED or TABLE_LAYOUT_PADDED)")
        moved = bool(plan.blocks_to_swap_out.src or plan.blocks_to_swap_in.src or plan.blocks_to_copy.src)
        return cls(step_id=reply.step_id, plan_step_id=reply.step_id if moved else 0, token_ids=token_ids,
                   positions=positions, slot_mapping=batch.slot_mapping[:], query_lens=batch.query_lens[:],
                   context_lens=batch.context_lens[:], block_tables=block_tables,
                   max_blocks=batch.max_blocks, greedy=greedy, feedback_rows=feedback_rows,
                   feedback_step=feedback_step)


def unpack_int32(data: bytes) -> np.ndarray:
    """Little-endian int32s (``BatchTables.block_tables_packed``) as a read-only int32 array
    viewing ``data``: O(1), no copy. (numpy converts to the machine's order where it differs.)"""
    if len(data) % 4:
        raise ValueError(f"packed int32 table of {len(data)} bytes: not a multiple of 4")
    return np.frombuffer(data, dtype="<i4")


class WorkerDied(RuntimeError):
    """A rank of the worker group died during a call; the group is unusable (its tensor-parallel
    process group cannot take a new member) and must be replaced. Part of the step contract: the
    scheduler catches it without importing the workers."""
