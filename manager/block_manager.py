"""The block manager: sequences, their block tables, copy-on-write, prefix caching and swaps.

This module runs operations as steps (journal, held blocks, all-or-nothing, tentative steps
waiting on the workers, the answer's tables) and answers stats. The operations themselves:
``manager/sequence_ops.py`` (allocate, append, fork, free) and ``manager/swap_ops.py``, over the
state and checks of ``manager/state.py``; the answer's tables: ``manager/batch_tables.py``; the
invariant checker: ``manager/invariants.py``.

Pure Python and single-threaded: the caller (``kvpager.manager.service``) serializes calls
with one lock. Every operation validates its whole request before changing anything, and
runs under the journal, so a failure of any kind leaves no trace.

Cost of each operation, independent of how many sequences are live (B = block size):
- allocate: O(prompt tokens) to hash the prompt, plus O(prompt blocks).
- append: O(new tokens + new blocks).
- fork: O(parent's blocks) ref-count increments.
- free, swap_out, swap_in: O(blocks of the sequences named).
- step: the sum of its operations, plus O(blocks of the sequences it touched) for the
  block tables of its answer (in C-level list operations: slices and extends, no Python loop
  per entry; only the table layouts asked for are built).
- stats: O(1). check_invariants: O(all blocks and sequences) (tests only).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence as Seq, TypeVar

from .config import ManagerConfig
from kvpager.errors import (
    Aborted,
    Busy,
    InvalidArgument,
    InvariantViolation,
    ManagerError,
)
from .operations import (
    AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, Operation, RejectedOp, SwapInOp, SwapOutOp,
)
from .plan import (
    AllocateResult,
    AppendResult,
    BatchTables,
    ExecutionPlan,
    ForkResult,
    FreeResult,
    ManagerStats,
    OperationOutcome,
    Result,
    StepResult,
    SwapResult,
    TableLayout,
    TierStats,
)
from .tentative import TentativeStep, counter_delta
from .sequence import GPU, Sequence
from .batch_tables import batch_tables
from kvpager.status import status_of
from .invariants import check_manager
from .sequence_ops import SequenceOperations
from .state import MAX_SEQ_ID_LEN, StepState
from .swap_ops import SwapOperations

__all__ = ["MAX_SEQ_ID_LEN", "BlockManager"]  # MAX_SEQ_ID_LEN: re-exported for callers that bound ids


class BlockManager(SequenceOperations, SwapOperations):
    def __init__(self, config: ManagerConfig | None = None) -> None:
        super().__init__(config)
        # Operation type -> its handler (each takes its own type of operation: hence Any).
        self._apply: dict[type[Operation], Callable[[Any], Result]] = {
            AllocateOp: self._allocate,
            AppendOp: self._append,
            AppendBatchOp: self._append_batch,
            ForkOp: self._fork,
            FreeOp: self._free,
            SwapOutOp: self._swap_out,
            SwapInOp: self._swap_in,
            RejectedOp: self._reject,
        }

    # ---- public operations ----------------------------------------------------------------
    def allocate(self, seq_id: str, token_ids: Optional[Seq[int]] = None, num_tokens: int = 0,
                 namespace: str = "") -> AllocateResult:
        return _expect(self.run(AllocateOp(seq_id, token_ids, num_tokens, namespace)), AllocateResult)

    def append(self, seq_id: str, token_ids: Optional[Seq[int]] = None, num_tokens: int = 0) -> AppendResult:
        return _expect(self.run(AppendOp(seq_id, token_ids, num_tokens)), AppendResult)

    def fork(self, parent_seq_id: str, child_seq_id: str) -> ForkResult:
        return _expect(self.run(ForkOp(parent_seq_id, child_seq_id)), ForkResult)

    def free(self, seq_id: str) -> FreeResult:
        return _expect(self.run(FreeOp(seq_id)), FreeResult)

    def swap_out(self, seq_ids: Seq[str]) -> SwapResult:
        return _expect(self.run(SwapOutOp(list(seq_ids))), SwapResult)

    def swap_in(self, seq_ids: Seq[str]) -> SwapResult:
        return _expect(self.run(SwapInOp(list(seq_ids))), SwapResult)

    def run(self, op: Operation, before_commit: Optional[Callable[[StepResult], None]] = None) -> Result:
        """Apply one operation on its own: a step of one, whose error is raised."""
        outcome = self.step([op], batch=False, before_commit=before_commit).outcomes[0]
        if outcome.error is not None:
            raise outcome.error
        if outcome.result is None:
            raise InvariantViolation(f"{type(op).__name__}: an outcome with neither a result nor an error")
        return outcome.result

    def step(self, ops: Seq[Operation], all_or_nothing: bool = False, batch: bool = True,
             before_commit: Optional[Callable[[StepResult], None]] = None,
             layout: TableLayout = TableLayout.BOTH, hold_open: bool = False) -> StepResult:
        """Apply ops in order, each atomically; merge their plans and block tables.

        ``layout`` picks the block-table forms of the answer's batch (``batch`` False: no batch
        at all, as a single operation's answer has none).

        Blocks released during the step are HELD until it ends, so no block is both freed and
        reused within one plan; with that, the worker's fixed order (swap-out, swap-in, copy,
        write) is always correct. If ``dispatch`` is set, it receives the plan before the step
        commits; if it raises (a worker is unreachable), the whole step is rolled back and the
        error propagates. ``before_commit`` (the service's check of the answer's size) gets the
        step's result before the plan is dispatched; if it raises, the step is rolled back the same
        way. An ``InvariantViolation`` (a bug) inside any operation also rolls the whole step back
        and propagates: it is never reported as one operation's refusal.

        A step whose plan moves blocks becomes tentative before ``dispatch`` is called (see
        manager/tentative.py), so other steps may run while it waits; it commits or rolls back
        when ``dispatch`` returns or raises. ``hold_open`` (log replay) makes such a step
        tentative without dispatching it: ``finish_tentative`` ends it. A step naming a sequence
        that a tentative step keeps busy raises ``Busy`` before anything is applied; a step that
        would become tentative while a due snapshot waits for the open steps is undone whole and
        raises ``Busy`` too (``TentativeSteps.holding``).

        With ``step_log`` set (the write-ahead log), the step runs through it.
        """
        if self.step_log is not None:
            return self.step_log(self._apply_step, ops, all_or_nothing, batch, before_commit, layout, hold_open)
        return self._apply_step(ops, all_or_nothing, batch, before_commit, layout, hold_open)

    def _apply_step(self, ops: Seq[Operation], all_or_nothing: bool, batch: bool,
                    before_commit: Optional[Callable[[StepResult], None]], layout: TableLayout,
                    hold_open: bool) -> StepResult:
        """``step``, unlogged."""
        if self.tentative:
            busy = self.tentative.busy_with(ops)
            if busy is not None:
                raise Busy(f"a sequence of this call is in step {busy.step_id}, whose plan waits on the workers; "
                           "nothing was applied", busy)
        self.steps += 1
        copies = layout.copies if batch else TableLayout.BOTH.copies
        state = StepState(ExecutionPlan(self.steps), table_copies=copies)
        saved = dataclasses.replace(self.counters)
        journal = self._journal
        self._step = state
        self._all_or_nothing = all_or_nothing
        self.gpu.hold_releases()
        self.cpu.hold_releases()
        outcomes: list[OperationOutcome] = []
        failed_at: Optional[int] = None
        tentative: Optional[TentativeStep] = None
        held: Optional[TentativeStep] = None
        journal.begin()
        try:
            for i, op in enumerate(ops):
                mark, charged = journal.mark(), state.reply_bytes
                try:
                    done = self._run(op)
                except InvariantViolation:
                    raise
                except ManagerError as err:
                    journal.rollback_to(mark)
                    state.reply_bytes = charged
                    outcomes.append(OperationOutcome(error=err))
                    if all_or_nothing:
                        failed_at = i
                        break
                else:
                    outcomes.append(OperationOutcome(result=done))
            if failed_at is not None:
                journal.rollback()
                self.counters = saved
                failure = outcomes[failed_at].error
                assert failure is not None
                outcomes = self._aborted(len(ops), failed_at, failure)
                state = StepState(ExecutionPlan(state.plan.step_id), table_copies=copies)
            tables = self._batch(state.touched, layout) if batch else BatchTables()
            result = StepResult(state.plan.step_id, outcomes, failed_at is None, state.plan, tables,
                                self.gpu.num_available + self.gpu.num_held_by_step,
                                self.cpu.num_available + self.cpu.num_held_by_step)
            if before_commit is not None:
                before_commit(result)
            if failed_at is None and state.plan.moves_blocks and (hold_open or self.dispatch is not None):
                held = None if hold_open else self.tentative.holding()
                if held is not None:
                    # A due snapshot waits for the open steps (manager/tentative.py): this step
                    # would open another, so it is undone whole, its step id given back, and it
                    # waits as for a busy sequence. Steps with nothing to move run on.
                    journal.rollback()
                    self.counters = saved
                    self.steps -= 1
                else:
                    tentative = self.tentative.open(state.plan.step_id, ops, outcomes, journal.detach(),
                                                    counter_delta(self.counters, saved), (self.gpu, self.cpu))
                    # Its counts join the totals when it commits (TentativeSteps.finish): a scrape
                    # while it waits never sees counters that a rollback would take back.
                    self.counters = saved
            else:
                journal.commit()
        except BaseException as exc:
            journal.rollback()
            self.counters = saved
            self.op_counts.record(ops, outcomes, False, exc if isinstance(exc, ManagerError) else None)
            raise
        finally:
            self._step = None
            self.gpu.end_hold()
            self.cpu.end_hold()
        if held is not None:
            raise Busy(f"a state snapshot waits for step {held.step_id}, whose plan is with the workers, and this "
                       "call would send the workers another plan; nothing was applied", held)
        if tentative is None:
            self.op_counts.record(ops, outcomes, True)
            return result
        return self._wait_for_workers(tentative, result, hold_open)

    def _wait_for_workers(self, tentative: TentativeStep, result: StepResult, hold_open: bool) -> StepResult:
        """Dispatch a tentative step's plan (the service lets other steps run meanwhile), then
        commit it, or roll it back and raise what ``dispatch`` raised."""
        if self.on_tentative is not None:
            self.on_tentative(result)
        if hold_open:
            return result
        # The per-call hooks belong to this call; other calls set their own while it waits.
        self.admit = self.admit_sequence = self.on_tentative = None
        dispatch = self.dispatch
        assert dispatch is not None  # a step is tentative only with workers attached, or held open
        try:
            dispatch(result.plan)
        except BaseException as exc:
            self.finish_tentative(tentative.step_id, False, exc if isinstance(exc, ManagerError) else None)
            raise
        self.finish_tentative(tentative.step_id, True)
        return result

    def finish_tentative(self, step_id: int, ok: bool, error: Optional[ManagerError] = None) -> None:
        """Commit (``ok``) or roll back tentative step ``step_id``. O(its journal entries)."""
        tentative = self.tentative.steps.get(step_id)
        if tentative is None:
            raise InvariantViolation(f"step {step_id} is not tentative")
        self.tentative.finish(tentative, ok, self.counters)
        self.op_counts.record(tentative.ops, tentative.outcomes, ok, error)

    def block_table(self, seq_id: str) -> Sequence:
        return self._get(seq_id)

    def stats(self) -> ManagerStats:
        gpu, cpu, c = self.gpu, self.cpu, self.counters
        slots = gpu.num_used * self.block_size
        return ManagerStats(
            block_size=self.block_size,
            # Blocks HELD by steps waiting on the workers count as used until those steps finish.
            gpu=TierStats(gpu.num_usable, gpu.num_used + gpu.num_held, gpu.num_free, gpu.num_cached),
            cpu=TierStats(cpu.num_usable, cpu.num_used + cpu.num_held, cpu.num_free, cpu.num_cached),
            running_sequences=self.seqs.num_running,
            swapped_sequences=self.seqs.num_swapped,
            gpu_utilization=(gpu.num_used + gpu.num_held) / gpu.num_usable,
            internal_fragmentation=(slots - gpu.filled_slots) / slots if slots else 0.0,
            prefix_caching=self.config.enable_prefix_caching,
            prefix_query_tokens=c.prefix_query_tokens,
            prefix_hit_tokens=c.prefix_hit_tokens,
            prefix_query_blocks=c.prefix_query_blocks,
            prefix_hit_blocks=c.prefix_hit_blocks,
            preemptions=c.preemptions,
            cow_copies=c.cow_copies,
            blocks_swapped_out=c.blocks_swapped_out,
            blocks_swapped_in=c.blocks_swapped_in,
            evictions=gpu.evictions,
            watermark_blocks=self.watermark_blocks,
            steps=self.steps,
        )

    # ---- running operations ---------------------------------------------------------------
    def _run(self, op: Operation) -> Result:
        handler = self._apply.get(type(op))
        if handler is None:
            raise InvalidArgument(f"unknown operation {type(op).__name__}")
        return handler(op)

    @staticmethod
    def _aborted(n: int, failed_at: int, error: ManagerError) -> list[OperationOutcome]:
        out = []
        for i in range(n):
            if i == failed_at:
                out.append(OperationOutcome(error=error))
            else:
                out.append(OperationOutcome(error=Aborted(
                    f"not applied: the step is all-or-nothing and operation {failed_at} failed ({status_of(error)})")))
        return out

    def lose_all(self, epoch: int) -> int:
        """The workers' caches are gone: every sequence becomes lost (its blocks are released, its
        id answers DATA_LOSS until freed) and the prefix cache forgets every block. Outside a
        step only. Returns how many sequences were lost. O(blocks)."""
        if self._step is not None or self.tentative:
            raise InvariantViolation("lose_all inside a step or while a step waits on the workers")
        seqs = list(self.seqs.values())
        for seq in seqs:
            pool = self.gpu if seq.tier == GPU else self.cpu
            for b in reversed(seq.block_ids):
                pool.decref(b)
            self.seqs.remove(seq)
            self.lost[seq.seq_id] = epoch
        self.gpu.forget_contents()
        self.cpu.forget_contents()
        return len(seqs)

    def _batch(self, touched: dict[str, list[int]], layout: TableLayout = TableLayout.BOTH) -> BatchTables:
        return batch_tables(self.seqs, touched, self.block_size, layout)

    def check_invariants(self) -> None:
        """Raise InvariantViolation unless the state is consistent (``manager/invariants.py``)."""
        check_manager(self)


R = TypeVar("R", bound=Result)


def _expect(result: Result, kind: type[R]) -> R:
    """``result`` as the kind its operation answers (an InvariantViolation if it is not). O(1)."""
    if not isinstance(result, kind):
        raise InvariantViolation(f"expected a {kind.__name__}, got {type(result).__name__}")
    return result
