"""What the manager counts: the effects of committed steps (``Counters``, restored with the
state when a step rolls back) and every operation attempted, by kind and status
(``OperationCounts``, exported as metrics). Plain data, O(ops) per step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

from kvpager.errors import (
    ManagerError,
)
from .operations import (
    AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, Operation, RejectedOp, SwapInOp, SwapOutOp,
)
from .plan import (
    AppendBatchResult,
    OperationOutcome,
)
from kvpager.status import status_of


# The kind of each operation, as counted in OperationCounts (and named in the metrics).
OP_KINDS: dict[type, str] = {
    AllocateOp: "allocate", AppendOp: "append", AppendBatchOp: "append", ForkOp: "fork", FreeOp: "free",
    SwapOutOp: "swap_out", SwapInOp: "swap_in", RejectedOp: "invalid",
}


@dataclass(slots=True)
class Counters:
    """Counts of what committed steps did (restored with the state when a step rolls back)."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_blocks: int = 0
    prefix_hit_blocks: int = 0
    cow_copies: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    preemptions: int = 0  # sequences swapped out


@dataclass(slots=True)
class OperationCounts:
    """Operations applied, and refused or rolled back by status code, by kind (for metrics).
    Unlike Counters these count every attempt, so a rolled-back step counts as failures."""

    applied: Counter[str] = field(default_factory=Counter)              # kind -> count
    failed: Counter[tuple[str, str]] = field(default_factory=Counter)   # (kind, status code name) -> count

    def record(self, ops: Seq[Operation], outcomes: Seq[OperationOutcome], committed: bool,
               error: Optional[ManagerError] = None) -> None:
        """Count one step's operations: ``outcomes`` when it committed, else every op failed
        with ``error`` (the dispatch failure that rolled it back). O(ops + batch failures)."""
        for i, op in enumerate(ops):
            kind = OP_KINDS.get(type(op), "invalid")
            outcome = outcomes[i] if committed and i < len(outcomes) else None
            if outcome is None or outcome.error is not None:
                failed_with = outcome.error if outcome is not None else error
                code = status_of(failed_with) if failed_with is not None else "INTERNAL"
                self.failed[(kind, code)] += len(op.seq_ids) if isinstance(op, AppendBatchOp) else 1
            elif isinstance(op, AppendBatchOp):
                assert isinstance(outcome.result, AppendBatchResult)
                failures = outcome.result.failures
                self.applied[kind] += len(op.seq_ids) - len(failures)
                for _, err in failures:
                    self.failed[(kind, status_of(err))] += 1
            else:
                self.applied[kind] += 1
