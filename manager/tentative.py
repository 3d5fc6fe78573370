"""Steps whose plan is on its way to the workers: applied, not yet committed, while others run.

A step that moves blocks (copy-on-write copies, swaps) must not commit before the workers have
executed its plan, and must roll back if they fail it. Waiting for them under the manager's lock
would stall every other call behind one stuck rank, so such a step is made *tentative*: its
changes stay applied, its undo entries leave the shared journal and stay with it, and other steps
run beside it until the workers answer. Then it commits (its held blocks rejoin the pools) or
aborts (its entries are undone, newest first). docs/design.md, "Steps waiting on the workers",
gives the argument; in short, what keeps the undo valid after other steps ran:

- the sequences it names are *busy*: a later step naming one waits for it (``busy_with``), so no
  other step changes them, frees them or reuses their ids;
- the blocks it took for itself (allocated, revived from the prefix cache, registered under a
  prefix hash, released to HELD) are *hidden*: no other step can find them by prefix, share or
  reuse them;
- a shared block it dropped a reference to is *pinned*: the reference is kept until the step
  finishes, so the block cannot be freed and reused under a rollback that gives it back;
- what is left (ref counts it added to shared blocks, the free queue, the LRU, counters) is
  arithmetic or order that the undo functions restore validly in any interleaving.

Tentative plans touch disjoint blocks (hidden, pinned or held ones), so they may reach the
workers in any order. Replay (``manager/recovery.py``) reopens and finishes tentative steps
where the log says they opened and finished, so a recovered manager gets the same block ids.

A snapshot holds no tentative step (its undo entries are closures over live objects, not plain
data), so when one falls due while steps are out the write-ahead log sets ``draining``: until
the open steps finish (each within the plan timeout), a step that would become tentative (its
plan moves blocks: a swap, an append's copy-on-write) is undone whole once applied and held back
like a step naming a busy sequence (``holding``), so that no new step opens and the snapshot is
taken at the next commit. Every other step, decode appends among them, runs on meanwhile: a
worker slow with a plan stalls only the steps that need the workers, as without a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence as Seq

from .block import USED
from .block_pool import BlockPool
from .counts import Counters
from .journal import undo
from .operations import Operation, op_ids
from .plan import OperationOutcome

# Undo entries of the pools that need no mark: shared-reference arithmetic and per-block data
# of blocks the step owns anyway.
_UNMARKED = (BlockPool._undo_incref, BlockPool._undo_fill, BlockPool._undo_carry_hash)


@dataclass(eq=False)
class TentativeStep:
    step_id: int
    ops: list[Operation]
    outcomes: list[OperationOutcome]    # one per op, as answered
    ids: frozenset[str]                 # every sequence id its operations name
    entries: list[tuple[Callable[..., Any], tuple[Any, ...]]]   # its undo journal
    counter_delta: dict[str, int]       # what it added to the manager's Counters
    held: list[tuple[BlockPool, dict[int, None]]] = field(default_factory=list)
    pins: list[tuple[BlockPool, int]] = field(default_factory=list)
    hidden: list[tuple[BlockPool, int]] = field(default_factory=list)
    finished: bool = False
    committed: bool = False


class TentativeSteps:
    """The pending tentative steps and the sequence ids they keep busy."""

    def __init__(self) -> None:
        self.steps: dict[int, TentativeStep] = {}
        self._busy: dict[str, TentativeStep] = {}
        # Set by the write-ahead log while a due snapshot waits for the open steps to finish
        # (manager/recovery.py, Durability.commit), cleared when it is taken: ``holding``.
        self.draining = False

    def __bool__(self) -> bool:
        return bool(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def busy_with(self, ops: Seq[Operation]) -> Optional[TentativeStep]:
        """The tentative step that keeps one of these operations' sequences busy, if any.
        O(ids named), and O(1) while no step is tentative (the decode path)."""
        busy = self._busy
        if not busy:
            return None
        for op in ops:
            for seq_id in op_ids(op):
                step = busy.get(seq_id)
                if step is not None:
                    return step
        return None

    def holding(self) -> Optional[TentativeStep]:
        """While ``draining``, the open step a step that would become tentative waits for (it would
        put the snapshot off again); None otherwise. O(1)."""
        if not self.draining or not self.steps:
            return None
        return next(iter(self.steps.values()))   # the oldest: the first likely to finish

    def open(self, step_id: int, ops: Seq[Operation], outcomes: list[OperationOutcome],
             entries: list[tuple[Callable[..., Any], tuple[Any, ...]]], counter_delta: dict[str, int],
             pools: Seq[BlockPool]) -> TentativeStep:
        """Make the step being applied tentative: mark its sequences busy, take its held blocks,
        pin the shared blocks it dropped and hide the blocks it took. O(journal entries)."""
        ids = frozenset(seq_id for op in ops for seq_id in op_ids(op))
        step = TentativeStep(step_id, list(ops), outcomes, ids, entries, counter_delta)
        for pool in pools:
            step.held.append((pool, pool.take_held()))
        dropped: dict[tuple[BlockPool, int], None] = {}  # shared blocks it dropped a reference to
        for fn, args in entries:
            owner = getattr(fn, "__self__", None)
            if not isinstance(owner, BlockPool):
                continue
            pool, kind, block_id = owner, getattr(fn, "__func__"), args[0].block_id
            if kind is BlockPool._undo_decref:
                dropped[(pool, block_id)] = None
            elif kind not in _UNMARKED:
                pool.hide(block_id)
                step.hidden.append((pool, block_id))
        hidden = set(step.hidden)
        for pool, block_id in dropped:
            # One pin keeps it from reaching 0. Not needed (and wrong: its undo sets the count) for a
            # block the step took back for itself: hidden, every reference to it is the step's.
            if pool.blocks[block_id].state == USED and (pool, block_id) not in hidden:
                pool.pin(block_id)
                step.pins.append((pool, block_id))
        self.steps[step_id] = step
        for seq_id in ids:
            self._busy[seq_id] = step
        return step

    def finish(self, step: TentativeStep, ok: bool, counters: Counters) -> None:
        """Commit (``ok``) or undo a tentative step, then release its marks and held blocks."""
        if step.finished or self.steps.get(step.step_id) is not step:
            raise RuntimeError(f"step {step.step_id} is not a pending tentative step")
        for pool, held in step.held:
            pool.resume_held(held)
        if not ok:
            for pool, _ in step.held:
                pool.plan_may_have_run = True
            try:
                undo(step.entries)   # pins still in place: a dropped reference comes back on top of its pin
            finally:
                for pool, _ in step.held:
                    pool.plan_may_have_run = False
        else:   # its counts, kept out of the totals while it waited
            for name, delta in step.counter_delta.items():
                setattr(counters, name, getattr(counters, name) + delta)
        for pool, block_id in step.pins:
            pool.unpin(block_id)
        for pool, block_id in step.hidden:
            pool.unhide(block_id)
        for pool, _ in step.held:
            pool.end_hold()
        del self.steps[step.step_id]
        for seq_id in step.ids:
            if self._busy.get(seq_id) is step:
                del self._busy[seq_id]
        step.entries = []
        step.finished, step.committed = True, ok


def counter_delta(after: Counters, before: Counters) -> dict[str, int]:
    """Field by field ``after - before`` of two Counters, the nonzero ones."""
    out: dict[str, int] = {}
    for f in fields(after):
        d = getattr(after, f.name) - getattr(before, f.name)
        if d:
            out[f.name] = d
    return out
