"""The operations a scheduler asks of the manager, as plain records (the servicer builds
them from protobuf; tests and in-process callers build them directly)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union


@dataclass(slots=True)
class AllocateOp:
    seq_id: str
    token_ids: Optional[Sequence[int]] = None  # the prompt; None or empty when unknown
    num_tokens: int = 0                         # the prompt length when ids are unknown
    namespace: str = ""


@dataclass(slots=True)
class AppendOp:
    seq_id: str
    token_ids: Optional[Sequence[int]] = None
    num_tokens: int = 0


@dataclass(slots=True)
class AppendBatchOp:
    """One token to each sequence (a decode step): one Append per sequence, each on its own."""

    seq_ids: Sequence[str]
    token_ids: Optional[Sequence[int]] = None  # one per sequence, or None when unknown


@dataclass(slots=True)
class ForkOp:
    parent_seq_id: str
    child_seq_id: str


@dataclass(slots=True)
class FreeOp:
    seq_id: str


@dataclass(slots=True)
class SwapOutOp:
    seq_ids: Sequence[str] = field(default_factory=list)


@dataclass(slots=True)
class SwapInOp:
    seq_ids: Sequence[str] = field(default_factory=list)


@dataclass(slots=True)
class RejectedOp:
    """A malformed request found while decoding a Step; applying it fails with INVALID_ARGUMENT."""

    reason: str


Operation = Union[AllocateOp, AppendOp, AppendBatchOp, ForkOp, FreeOp, SwapOutOp, SwapInOp, RejectedOp]


def op_ids(op: Operation) -> Sequence[str]:
    """The sequence ids an operation names (not copied). O(1)."""
    if isinstance(op, (AllocateOp, AppendOp, FreeOp)):
        return (op.seq_id,)
    if isinstance(op, ForkOp):
        return (op.parent_seq_id, op.child_seq_id)
    if isinstance(op, (AppendBatchOp, SwapOutOp, SwapInOp)):
        return op.seq_ids
    return ()
