"""The block manager: sequences, their block tables, copy-on-write, prefix caching and swaps.

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
import sys
from array import array
from collections import Counter
from itertools import accumulate, chain
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq

from .block_pool import CACHED, BlockPool
from .config import ManagerConfig
from .errors import (
    Aborted,
    AlreadyExists,
    Busy,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    InvariantViolation,
    ManagerError,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    quote,
)
from .journal import Journal
from .operations import (
    AllocateOp, AppendBatchOp, AppendOp, ForkOp, FreeOp, Operation, RejectedOp, SwapInOp, SwapOutOp,
)
from .plan import (
    AllocateResult,
    AppendBatchResult,
    AppendResult,
    BatchTables,
    BlockMapping,
    ExecutionPlan,
    ForkResult,
    FreeResult,
    ManagerStats,
    OperationOutcome,
    StepResult,
    SwapResult,
    TableLayout,
    TierStats,
)
from .prefix_hash import chain_hash, root_hash
from .tenancy import client_len
from .tentative import TentativeStep, TentativeSteps, counter_delta
from .sequence import CPU, GPU, Sequence, SequenceTable

MAX_SEQ_ID_LEN = 256  # the default of ManagerConfig.max_id_len


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

    applied: Counter = field(default_factory=Counter)   # kind -> count
    failed: Counter = field(default_factory=Counter)    # (kind, status code name) -> count

    def record(self, ops: Seq[Operation], outcomes: Seq[OperationOutcome], committed: bool,
               error: Optional[ManagerError] = None) -> None:
        """Count one step's operations: ``outcomes`` when it committed, else every op failed
        with ``error`` (the dispatch failure that rolled it back). O(ops + batch failures)."""
        for i, op in enumerate(ops):
            kind = OP_KINDS.get(type(op), "invalid")
            outcome = outcomes[i] if committed and i < len(outcomes) else None
            if outcome is None or outcome.error is not None:
                code = outcome.error.code if outcome is not None else (error.code if error else "INTERNAL")
                self.failed[(kind, code)] += len(op.seq_ids) if isinstance(op, AppendBatchOp) else 1
            elif isinstance(op, AppendBatchOp):
                failures = outcome.result.failures
                self.applied[kind] += len(op.seq_ids) - len(failures)
                for _, err in failures:
                    self.failed[(kind, err.code)] += 1
            else:
                self.applied[kind] += 1


@dataclass(slots=True)
class _StepState:
    """What one Step accumulates while its operations run."""

    plan: ExecutionPlan
    # GPU blocks the step writes (new K/V slots, copy and swap-in targets); swapping one of
    # them out in the same step would copy it before it is written, so that is refused.
    written: set[int] = field(default_factory=set)
    # The subset that gets the K/V of the step's new tokens (after the plan's copies run); a
    # copy-on-write from one of them would copy it before it is written, so that is refused.
    computed: set[int] = field(default_factory=set)
    # Running sequences touched, in first-touch order -> slots of the tokens to compute.
    touched: dict[str, list[int]] = field(default_factory=dict)
    # A lower bound of the answer's size so far (every number in it takes at least a byte):
    # lets an operation whose answer could not be sent be refused before it is applied.
    reply_bytes: int = 0
    # How many times the answer's batch holds the block table of each sequence it touches
    # (2: padded and CSR; TableLayout.copies).
    table_copies: int = 2


class BlockManager:
    def __init__(self, config: ManagerConfig | None = None) -> None:
        self.config = config or ManagerConfig()
        if self.config.num_gpu_blocks < 1:
            raise InvalidArgument("a BlockManager needs num_gpu_blocks >= 1 (0 means: let the service size it from workers)")
        self.block_size = self.config.block_size
        self.watermark_blocks = self.config.watermark_blocks
        self._journal = Journal()
        self.gpu = BlockPool(self.config.num_gpu_blocks, self._journal, "gpu", self.config.enable_prefix_caching)
        self.cpu = BlockPool(self.config.num_cpu_blocks, self._journal, "cpu", caching=False)
        self.seqs = SequenceTable(self._journal)
        self.counters = Counters()
        self.op_counts = OperationCounts()
        self.steps = 0
        # Sequences whose K/V was lost with a replaced worker group (``lose_all``): id -> the epoch
        # that lost it. Every operation on one answers DATA_LOSS until it is freed.
        self.lost: dict[str, int] = {}
        self._step: Optional[_StepState] = None
        self._all_or_nothing = False
        # Called with each step's plan before the step commits (the service sends it to the
        # workers); raising rolls the step back. None when no worker is attached. A step whose
        # plan moves blocks is tentative while it waits (manager/tentative.py): other steps may
        # run meanwhile (the service lets them), except on the sequences it names.
        self.dispatch: Optional[Callable[[ExecutionPlan], None]] = None
        self.tentative = TentativeSteps()
        # Called with a step's result when it becomes tentative, before ``dispatch`` (the
        # write-ahead log records it there: later steps may be logged before it finishes).
        self.on_tentative: Optional[Callable[[StepResult], None]] = None
        # Called as admit(what, blocks) by an operation about to take ``blocks`` more GPU blocks
        # (new ones, or cached ones it revives), before it changes anything, like its check of the
        # pool's room: the service's per-tenant quota check, set for one step. Raising a
        # ManagerError refuses the operation. None: no check.
        self.admit: Optional[Callable[[str, int], None]] = None
        self._apply = {
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
        return self.run(AllocateOp(seq_id, token_ids, num_tokens, namespace))

    def append(self, seq_id: str, token_ids: Optional[Seq[int]] = None, num_tokens: int = 0) -> AppendResult:
        return self.run(AppendOp(seq_id, token_ids, num_tokens))

    def fork(self, parent_seq_id: str, child_seq_id: str) -> ForkResult:
        return self.run(ForkOp(parent_seq_id, child_seq_id))

    def free(self, seq_id: str) -> FreeResult:
        return self.run(FreeOp(seq_id))

    def swap_out(self, seq_ids: Seq[str]) -> SwapResult:
        return self.run(SwapOutOp(list(seq_ids)))

    def swap_in(self, seq_ids: Seq[str]) -> SwapResult:
        return self.run(SwapInOp(list(seq_ids)))

    def run(self, op: Operation, before_commit: Optional[Callable[[StepResult], None]] = None):
        """Apply one operation on its own: a step of one, whose error is raised."""
        outcome = self.step([op], batch=False, before_commit=before_commit).outcomes[0]
        if outcome.error is not None:
            raise outcome.error
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
        that a tentative step keeps busy raises ``Busy`` before anything is applied.
        """
        if self.tentative:
            busy = self.tentative.busy_with(ops)
            if busy is not None:
                raise Busy(f"a sequence of this call is in step {busy.step_id}, whose plan waits on the workers; "
                           "nothing was applied", busy)
        self.steps += 1
        copies = layout.copies if batch else TableLayout.BOTH.copies
        state = _StepState(ExecutionPlan(self.steps), table_copies=copies)
        saved = dataclasses.replace(self.counters)
        journal = self._journal
        self._step = state
        self._all_or_nothing = all_or_nothing
        self.gpu.hold_releases()
        self.cpu.hold_releases()
        outcomes: list[OperationOutcome] = []
        failed_at: Optional[int] = None
        tentative: Optional[TentativeStep] = None
        journal.begin()
        try:
            for i, op in enumerate(ops):
                mark, charged = journal.mark(), state.reply_bytes
                try:
                    result = self._run(op)
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
                    outcomes.append(OperationOutcome(result=result))
            if failed_at is not None:
                journal.rollback()
                self.counters = saved
                outcomes = self._aborted(len(ops), failed_at, outcomes[failed_at].error)
                state = _StepState(ExecutionPlan(state.plan.step_id), table_copies=copies)
            tables = self._batch(state.touched, layout) if batch else BatchTables()
            result = StepResult(state.plan.step_id, outcomes, failed_at is None, state.plan, tables,
                                self.gpu.num_available + self.gpu.num_held_by_step,
                                self.cpu.num_available + self.cpu.num_held_by_step)
            if before_commit is not None:
                before_commit(result)
            if failed_at is None and state.plan.moves_blocks and (hold_open or self.dispatch is not None):
                tentative = self.tentative.open(state.plan.step_id, ops, outcomes, journal.detach(),
                                                counter_delta(self.counters, saved), (self.gpu, self.cpu))
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
        self.admit = self.on_tentative = None
        try:
            self.dispatch(result.plan)
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
            gpu=TierStats(gpu.num_blocks, gpu.num_used + gpu.num_held, gpu.num_free, gpu.num_cached),
            cpu=TierStats(cpu.num_blocks, cpu.num_used + cpu.num_held, cpu.num_free, cpu.num_cached),
            running_sequences=self.seqs.num_running,
            swapped_sequences=self.seqs.num_swapped,
            gpu_utilization=(gpu.num_used + gpu.num_held) / gpu.num_blocks,
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
    def _run(self, op: Operation):
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
                    f"not applied: the step is all-or-nothing and operation {failed_at} failed ({error.code})")))
        return out

    # ---- the six operations -----------------------------------------------------------------
    @staticmethod
    def _reject(op: RejectedOp):
        raise InvalidArgument(op.reason)

    def _allocate(self, op: AllocateOp) -> AllocateResult:
        self._check_new_id(op.seq_id)
        if client_len(op.namespace) > self.config.max_id_len:
            raise InvalidArgument(
                f"allocate {quote(op.seq_id)}: cache_namespace is {client_len(op.namespace)} characters; the limit is "
                f"{self.config.max_id_len} (max_id_len)")
        tokens = op.token_ids or None
        n = self._count(tokens, op.num_tokens, "prompt")
        B, gpu = self.block_size, self.gpu
        num_blocks = -(-n // B)
        # The answer holds the prompt's slots twice (result and batch) and its table once in the
        # result and once per table layout of the batch.
        self._charge(2 * n + (1 + self._table_copies()) * num_blocks, f"allocate {quote(op.seq_id)}")
        usable = gpu.num_blocks - self.watermark_blocks
        if num_blocks > usable:
            raise OutOfRange(
                f"allocate {quote(op.seq_id)}: a prompt of {n} tokens needs {num_blocks} blocks; the GPU pool can "
                f"never give more than {usable} ({gpu.num_blocks} minus a reserve of {self.watermark_blocks})")

        caching = self.config.enable_prefix_caching and tokens is not None
        hashes: list[bytes] = []
        hits: list[int] = []
        last_hash = root_hash(op.namespace) if caching else None
        if caching:
            for i in range(n // B):
                last_hash = chain_hash(last_hash, tokens[i * B:(i + 1) * B])
                hashes.append(last_hash)
            for h in hashes:
                bid = gpu.lookup(h)
                if bid is None:
                    break
                hits.append(bid)
            if len(hits) == num_blocks:
                hits.pop()  # the whole prompt is cached: recompute its last block to get logits

        new = num_blocks - len(hits)
        available = gpu.num_available - sum(1 for b in hits if gpu.blocks[b].state == CACHED)
        if new > available - self.watermark_blocks:
            raise ResourceExhausted(
                f"allocate {quote(op.seq_id)}: needs {new} free GPU blocks, {available} are free or evictable "
                f"and {self.watermark_blocks} are kept in reserve")
        if self.admit is not None:
            self.admit(f"allocate {quote(op.seq_id)}", new + gpu.num_available - available)

        for b in hits:
            gpu.acquire(b)
        block_ids = hits + [gpu.allocate() for _ in range(new)]
        for i in range(len(hits), len(hashes)):
            gpu.register(block_ids[i], hashes[i])
        for i in range(len(hits), num_blocks):
            gpu.fill(block_ids[i], min(B, n - i * B))
        pending = list(tokens[len(hashes) * B:]) if caching else None
        seq = Sequence(op.seq_id, block_ids, n, GPU, op.namespace, last_hash, pending)
        self.seqs.add(seq)

        cached = len(hits) * B
        slots = self._slots(block_ids, 0, n)
        if caching:
            c = self.counters
            c.prefix_query_tokens += n
            c.prefix_hit_tokens += cached
            c.prefix_query_blocks += len(hashes)
            c.prefix_hit_blocks += len(hits)
        if self._step is not None:
            self._step.written.update(block_ids[len(hits):])
            self._step.computed.update(block_ids[len(hits):])
            self._step.touched[op.seq_id] = slots[cached:]
        return AllocateResult(op.seq_id, list(block_ids), slots, cached)

    def _append(self, op: AppendOp) -> AppendResult:
        seq = self._get_running(op.seq_id, "append to")
        tokens = op.token_ids or None
        k = self._count(tokens, op.num_tokens, "append")
        self._charge(2 * k, f"append to {quote(op.seq_id)}")
        slots, new_ids, copies = self._grow(seq, tokens, k)
        return AppendResult(op.seq_id, slots, new_ids, copies or BlockMapping(), seq.num_tokens)

    def _append_batch(self, op: AppendBatchOp) -> AppendBatchResult:
        """One token to each sequence, each append atomic on its own (all of them, if the step is
        all-or-nothing). The decode hot path: no per-append request or result objects."""
        tokens = op.token_ids
        if tokens is not None and len(tokens) != len(op.seq_ids):
            raise InvalidArgument(
                f"append batch: {len(tokens)} token ids for {len(op.seq_ids)} sequences; give one per sequence")
        if tokens is not None and tokens and min(tokens) < 0:
            raise InvalidArgument("append batch: token ids must be >= 0")
        result = AppendBatchResult()
        journal, grow, in_place, lookup = self._journal, self._grow, self._grow_in_place, self.seqs.get
        B, blocks, limit = self.block_size, self.gpu.blocks, self.config.max_seq_len
        for i, seq_id in enumerate(op.seq_ids):
            token = None if tokens is None else tokens[i]
            seq = lookup(seq_id)
            if seq is not None and seq.tier == GPU:  # _grow's fast path, tested inline: the hot loop
                n = seq.num_tokens
                offset = n % B
                if offset and n < limit and blocks[seq.block_ids[-1]].ref_count == 1:
                    in_place(seq, token, n, offset)
                    continue
            mark = journal.mark()
            try:
                if seq is None or seq.tier != GPU:
                    seq = self._get_running(seq_id, "append to")  # raises the precise error
                grow(seq, None if token is None else (token,), 1)
            except InvariantViolation:
                raise
            except ManagerError as err:
                if self._all_or_nothing:
                    raise
                journal.rollback_to(mark)
                result.failures.append((i, err))
        return result

    def _grow(self, seq: Sequence, tokens: Optional[Seq[int]], k: int):
        """Add k tokens to a running sequence: check room, then copy a shared partial last block
        (copy-on-write) and take new blocks. Returns the new tokens' slots, the blocks added and
        the copy (None when there is none). O(k + new blocks)."""
        n, B, gpu = seq.num_tokens, self.block_size, self.gpu
        seq_id = seq.seq_id
        offset = n % B
        if k == 1 and offset and gpu.blocks[seq.block_ids[-1]].ref_count == 1 and n < self.config.max_seq_len:
            slot = self._grow_in_place(seq, None if tokens is None else tokens[0], n, offset)
            return [slot], [], None
        if n + k > self.config.max_seq_len:
            raise InvalidArgument(
                f"append to {quote(seq_id)}: {n} + {k} tokens exceeds max_seq_len {self.config.max_seq_len}")
        table = seq.block_ids
        total = -(-(n + k) // B)
        if total > gpu.num_blocks:
            raise OutOfRange(f"append to {quote(seq_id)}: {n + k} tokens need {total} blocks; the GPU pool has {gpu.num_blocks}")
        step = self._step
        cow = n % B != 0 and gpu.blocks[table[-1]].ref_count > 1
        if cow and step is not None and table[-1] in step.computed:
            raise FailedPrecondition(
                f"append to {quote(seq_id)}: its last block is shared and gets K/V in this step; copy-on-write "
                f"would copy it before it is written; append in a later step")
        need = total - len(table) + cow
        if need > gpu.num_available:
            raise ResourceExhausted(
                f"append to {quote(seq_id)}: needs {need} free GPU blocks, {gpu.num_available} are free or evictable")
        if self.admit is not None and need:
            self.admit(f"append to {quote(seq_id)}", need)

        self.seqs.save(seq)
        copies = BlockMapping() if cow else None
        new_ids: list[int] = []
        if cow:
            shared = table[-1]
            private = gpu.allocate()
            gpu.fill(private, n % B)
            copies.add(shared, private)
            table[-1] = private
            gpu.decref(shared)
            new_ids.append(private)
            self.counters.cow_copies += 1
        while len(table) < total:
            bid = gpu.allocate()
            table.append(bid)
            new_ids.append(bid)
        first = n // B
        for i in range(first, total):
            gpu.fill(table[i], min(B, n + k - i * B))
        seq.num_tokens = n + k
        self._hash_new_tokens(seq, tokens, n)

        slots = self._slots(table, n, n + k)
        if step is not None:
            if cow:
                step.plan.blocks_to_copy.extend(copies)
            for i in range(first, total):
                step.written.add(table[i])
                step.computed.add(table[i])
            step.touched.setdefault(seq_id, []).extend(slots)
        return slots, new_ids, copies

    def _grow_in_place(self, seq: Sequence, token: Optional[int], n: int, offset: int) -> int:
        """The common decode case of ``_grow``: one token into a private, partly filled last block.
        No block is taken and nothing is copied, so nothing can fail; one journal entry undoes it.
        Returns the token's slot."""
        last = seq.block_ids[-1]
        pending = seq.pending_tokens
        self._journal.record(self._undo_grow_in_place, seq, last, n, pending,
                             0 if pending is None else len(pending), seq.last_hash)
        self.gpu.add_filled(last, 1)
        seq.num_tokens = n + 1
        if pending is not None:
            if token is None:
                seq.pending_tokens = seq.last_hash = None
            elif offset + 1 < self.block_size:
                pending.append(token)
            else:
                self._hash_new_tokens(seq, (token,), n)  # the block is full now: register its hash
        slot = last * self.block_size + offset
        step = self._step
        if step is not None:
            step.written.add(last)
            step.computed.add(last)
            touched = step.touched.get(seq.seq_id)
            if touched is None:
                step.touched[seq.seq_id] = [slot]
            else:
                touched.append(slot)
        return slot

    def _undo_grow_in_place(self, seq: Sequence, last: int, n: int, pending: Optional[list[int]],
                            pending_len: int, last_hash: Optional[bytes]) -> None:
        self.gpu.add_filled(last, -1)
        seq.num_tokens = n
        if pending is not None:
            del pending[pending_len:]
        seq.pending_tokens = pending
        seq.last_hash = last_hash

    def _fork(self, op: ForkOp) -> ForkResult:
        parent = self._get_running(op.parent_seq_id, "fork")
        self._check_new_id(op.child_seq_id)
        # The answer holds the child's table once in the result and once per table layout of the batch.
        self._charge((1 + self._table_copies()) * len(parent.block_ids),
                     f"fork {quote(op.parent_seq_id)} -> {quote(op.child_seq_id)}")
        for b in parent.block_ids:
            self.gpu.incref(b)
        pending = list(parent.pending_tokens) if parent.pending_tokens is not None else None
        child = Sequence(op.child_seq_id, list(parent.block_ids), parent.num_tokens, GPU,
                         parent.namespace, parent.last_hash, pending)
        self.seqs.add(child)
        if self._step is not None:
            self._step.touched.setdefault(op.child_seq_id, [])
        return ForkResult(op.child_seq_id, list(child.block_ids))

    def _free(self, op: FreeOp) -> FreeResult:
        if op.seq_id in self.lost and op.seq_id not in self.seqs:  # its blocks went with the lost workers
            self._journal.record(self.lost.__setitem__, op.seq_id, self.lost.pop(op.seq_id))
            return FreeResult(op.seq_id, 0)
        seq = self._get(op.seq_id)
        if self._step is not None and self._step.touched.get(op.seq_id):
            # Its tokens would not be computed, yet a fork or a prefix hit may share their blocks.
            raise FailedPrecondition(
                f"free: sequence {quote(op.seq_id)} has tokens to compute in this step; free it in a later step")
        pool = self.gpu if seq.tier == GPU else self.cpu
        released = 0
        for b in reversed(seq.block_ids):  # tail first, so the LRU evicts a prefix's tail first
            released += pool.decref(b)
        self.seqs.remove(seq)
        if self._step is not None:
            self._step.touched.pop(op.seq_id, None)
        return FreeResult(op.seq_id, released)

    def _swap_out(self, op: SwapOutOp) -> SwapResult:
        seqs = self._distinct(op.seq_ids, "swap out")
        step = self._step
        for s in seqs:
            if s.tier != GPU:
                raise FailedPrecondition(f"swap out: sequence {quote(s.seq_id)} is already swapped out")
            if step is not None and not step.written.isdisjoint(s.block_ids):
                raise FailedPrecondition(
                    f"swap out: sequence {quote(s.seq_id)} has K/V written in this step; swap it out in a later step")
        distinct = dict.fromkeys(b for s in seqs for b in s.block_ids)
        need, cpu, gpu = len(distinct), self.cpu, self.gpu
        if need > cpu.num_blocks:
            raise OutOfRange(f"swap out: needs {need} CPU blocks; the CPU pool has {cpu.num_blocks}")
        if need > cpu.num_available:
            raise ResourceExhausted(f"swap out: needs {need} free CPU blocks, {cpu.num_available} are free")

        mapping = BlockMapping()
        to_cpu: dict[int, int] = {}
        for g in distinct:
            c = cpu.allocate()
            cpu.fill(c, gpu.blocks[g].num_filled)
            h = gpu.hash_of(g)
            if h is not None:
                cpu.register(c, h)
            to_cpu[g] = c
            mapping.add(g, c)
        self._move(seqs, gpu, cpu, to_cpu, CPU)
        self.counters.blocks_swapped_out += need
        self.counters.preemptions += len(seqs)
        if step is not None:
            step.plan.blocks_to_swap_out.extend(mapping)
            for s in seqs:
                step.touched.pop(s.seq_id, None)
        return SwapResult(mapping)

    def _swap_in(self, op: SwapInOp) -> SwapResult:
        seqs = self._distinct(op.seq_ids, "swap in")
        for s in seqs:
            if s.tier != CPU:
                raise FailedPrecondition(f"swap in: sequence {quote(s.seq_id)} is not swapped out")
        gpu, cpu = self.gpu, self.cpu
        distinct = dict.fromkeys(c for s in seqs for c in s.block_ids)
        reuse: dict[int, int] = {}  # CPU block -> GPU block already holding the same content
        if self.config.enable_prefix_caching:
            for c in distinct:
                h = cpu.hash_of(c)
                g = gpu.lookup(h) if h is not None else None
                if g is not None:
                    reuse[c] = g
        need = len(distinct) - len(reuse)
        usable = gpu.num_blocks - self.watermark_blocks
        if need > usable:
            raise OutOfRange(f"swap in: needs {need} GPU blocks; the GPU pool can never give more than {usable}")
        available = gpu.num_available - sum(1 for g in set(reuse.values()) if gpu.blocks[g].state == CACHED)
        if need > available - self.watermark_blocks:
            raise ResourceExhausted(
                f"swap in: needs {need} free GPU blocks, {available} are free or evictable "
                f"and {self.watermark_blocks} are kept in reserve")
        if self.admit is not None:
            self.admit(f"swap in {quote(seqs[0].seq_id)}", need + gpu.num_available - available)

        # Take the cache hits first, so that allocating the other blocks cannot evict them.
        for g in dict.fromkeys(reuse.values()):  # two CPU copies of one block map to one GPU block
            gpu.acquire(g)
        mapping = BlockMapping()
        to_gpu: dict[int, int] = {}
        for c in distinct:
            g = reuse.get(c)
            if g is None:
                g = gpu.allocate()
                gpu.fill(g, cpu.blocks[c].num_filled)
                h = cpu.hash_of(c)
                if h is not None:
                    gpu.register(g, h)
                mapping.add(c, g)
            to_gpu[c] = g
        self._move(seqs, cpu, gpu, to_gpu, GPU)
        self.counters.blocks_swapped_in += need
        if self._step is not None:
            self._step.plan.blocks_to_swap_in.extend(mapping)
            self._step.written.update(mapping.dst)
            for s in seqs:
                self._step.touched.setdefault(s.seq_id, [])
        return SwapResult(mapping, len(reuse))

    def _move(self, seqs: list[Sequence], src: BlockPool, dst: BlockPool, to: dict[int, int], tier: str) -> None:
        """Point each sequence's table at its blocks' new homes; each new block already holds one
        reference (from allocate or acquire), so only repeat references take another."""
        referenced: set[int] = set()
        for s in seqs:
            self.seqs.save(s)
            table = [to[b] for b in s.block_ids]
            for b in table:
                if b in referenced:
                    dst.incref(b)
                else:
                    referenced.add(b)
            for b in reversed(s.block_ids):
                src.decref(b)
            s.block_ids = table
            self.seqs.set_tier(s, tier)

    # ---- helpers ------------------------------------------------------------------------------
    def _hash_new_tokens(self, seq: Sequence, tokens: Optional[Seq[int]], start: int) -> None:
        """Extend the prefix-hash chain over appended tokens, registering blocks they fill."""
        pending = seq.pending_tokens
        if pending is None:
            return
        if tokens is None:  # an unknown token breaks the chain for good
            seq.pending_tokens = seq.last_hash = None
            return
        B = self.block_size
        pending.extend(tokens)  # only ever extended in place, so the journal restores it by truncation
        if len(pending) < B:
            return
        full, i = start // B, 0
        while len(pending) - i >= B:
            seq.last_hash = chain_hash(seq.last_hash, pending[i:i + B])
            self.gpu.register(seq.block_ids[full], seq.last_hash)
            i += B
            full += 1
        seq.pending_tokens = pending[i:]

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        B = self.block_size
        if end - start == 1:
            return [table[start // B] * B + start % B]
        return [table[i // B] * B + i % B for i in range(start, end)]

    def _count(self, tokens: Optional[Seq[int]], num_tokens: int, what: str) -> int:
        if tokens is not None:
            if num_tokens and num_tokens != len(tokens):
                raise InvalidArgument(
                    f"{what}: {len(tokens)} token ids given but num_tokens says {num_tokens}; give one or make them agree")
            n = len(tokens)
            if min(tokens) < 0:
                raise InvalidArgument(f"{what}: token ids must be >= 0")
        else:
            n = num_tokens
            if n < 1:
                raise InvalidArgument(f"{what}: needs at least 1 token (token_ids or num_tokens), got {n}")
        if n > self.config.max_seq_len:
            raise InvalidArgument(f"{what}: {n} tokens exceeds max_seq_len {self.config.max_seq_len}")
        if n > self.config.max_prompt_tokens:
            raise InvalidArgument(
                f"{what}: {n} tokens in one call exceeds max_prompt_tokens {self.config.max_prompt_tokens}")
        return n

    def _table_copies(self) -> int:
        """Block-table copies the current step's batch holds per touched sequence (2 outside a step)."""
        return self._step.table_copies if self._step is not None else TableLayout.BOTH.copies

    def _charge(self, numbers: int, what: str) -> None:
        """Count ``numbers`` more numbers in the step's answer (each takes at least one byte);
        refuse the operation, before it changes anything, once they could not fit the answer."""
        step = self._step
        if step is None:
            return
        step.reply_bytes += numbers
        if step.reply_bytes > self.config.max_reply_bytes:
            step.reply_bytes -= numbers
            raise OutOfRange(
                f"{what}: the answer would exceed max_reply_bytes ({self.config.max_reply_bytes} bytes); "
                f"nothing of it was applied: split the work over several calls")

    def _check_new_id(self, seq_id: str) -> None:
        if not seq_id:
            raise InvalidArgument("a sequence id must be a non-empty string")
        if client_len(seq_id) > self.config.max_id_len:
            raise InvalidArgument(
                f"sequence id {quote(seq_id)} is {client_len(seq_id)} characters; the limit is {self.config.max_id_len} "
                "(max_id_len)")
        if seq_id in self.seqs:
            raise AlreadyExists(f"sequence {quote(seq_id)} already exists")
        if seq_id in self.lost:
            raise self._data_loss(seq_id)

    def _get(self, seq_id: str) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            if seq_id in self.lost:
                raise self._data_loss(seq_id)
            raise NotFound(f"no sequence {quote(seq_id)}")
        return seq

    def _data_loss(self, seq_id: str) -> DataLoss:
        return DataLoss(f"sequence {quote(seq_id)} lost its K/V: the worker group that held it was replaced (epoch "
                        f"{self.lost[seq_id]}); free it and compute it again")

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

    def _get_running(self, seq_id: str, what: str) -> Sequence:
        seq = self._get(seq_id)
        if seq.tier != GPU:
            raise FailedPrecondition(f"cannot {what} sequence {quote(seq_id)}: it is swapped out; swap it in first")
        return seq

    def _distinct(self, seq_ids: Seq[str], what: str) -> list[Sequence]:
        if not seq_ids:
            raise InvalidArgument(f"{what}: no sequence ids given")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument(f"{what}: a sequence id is listed twice")
        return [self._get(s) for s in seq_ids]

    def _batch(self, touched: dict[str, list[int]], layout: TableLayout = TableLayout.BOTH) -> BatchTables:
        """The batch of the touched sequences, with the block-table forms ``layout`` asks for.
        O(rows) Python steps plus O(entries) copied by C-level list operations."""
        get = self.seqs.get
        seqs = [get(seq_id) for seq_id in touched]
        tables = [seq.block_ids for seq in seqs]
        lengths = list(map(len, tables))
        max_blocks = max(lengths, default=0)
        queries = touched.values()
        out = BatchTables(
            seq_ids=list(touched),
            context_lens=[seq.num_tokens for seq in seqs],
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
            out.kv_last_page_len = _last_page_lens(out.context_lens, lengths, self.block_size)
        if layout.packed:
            out.block_tables_packed = packed_padded(seqs, lengths, max_blocks)
        return out

    # ---- checking -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise InvariantViolation unless every block is free, cached or owned exactly as the
        block tables say (refcounts, fill, totals per tier). O(blocks + sequences)."""
        B = self.block_size
        refs = {GPU: Counter(), CPU: Counter()}
        fill = {GPU: {}, CPU: {}}
        swapped = 0
        for seq in self.seqs.values():
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
        both = [s for s in self.lost if s in self.seqs]
        if both:
            raise InvariantViolation(f"sequence {quote(both[0])} is both live and lost")
        if swapped != self.seqs.num_swapped:
            raise InvariantViolation(f"{swapped} sequences swapped out, counter says {self.seqs.num_swapped}")
        for tier, pool in ((GPU, self.gpu), (CPU, self.cpu)):
            pool.check_invariants(refs[tier])
            for b, filled in fill[tier].items():
                if pool.blocks[b].num_filled != filled:
                    raise InvariantViolation(
                        f"{tier} block {b} records {pool.blocks[b].num_filled} filled slots; its sequences fill {filled}")
            if self._step is None and pool.num_held_by_step:
                raise InvariantViolation(f"{tier} pool holds {pool.num_held_by_step} blocks outside a step")


# ---- batch tables ---------------------------------------------------------------------------------
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
    parts: list = []
    for seq, length in zip(seqs, lengths):
        kept = seq.packed_table  # packed_table's check, inline: this loop runs for every row of every step
        parts.append(kept[1] if kept is not None and kept[0] == seq.block_ids else packed_table(seq))
        if length < width:
            parts.append(zeros[:4 * (width - length)])
    return b"".join(parts)


def _last_page_lens(context_lens: list[int], lengths: list[int], block_size: int) -> list[int]:
    """Tokens filled in each sequence's last block (CSR ``kv_last_page_len``). O(rows)."""
    return [n - (length - 1) * block_size for n, length in zip(context_lens, lengths)]
