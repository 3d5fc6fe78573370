"""The block manager's state and the checks every operation starts with.

``ManagerState`` holds the pools, the sequence table, the journal, the counters and what the
current step accumulates (``StepState``); its methods look sequences up and validate what an
operation asks for, raising the precise error before anything changes. The operations build on
it (``manager/sequence_ops.py``, ``manager/swap_ops.py``) and ``BlockManager`` runs them as steps.
Every method is O(1) or O(what the operation names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol, Sequence as Seq

from .block import CACHED, USED
from .block_pool import BlockPool
from .config import ManagerConfig
from kvpager.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    quote,
)
from .journal import Journal
from .operations import Operation
from .plan import (
    ExecutionPlan,
    StepResult,
    TableLayout,
)
from .tenancy import client_len, tenant_of
from .sequence import GPU, Sequence, SequenceTable
from .counts import Counters, OperationCounts
from .tentative import TentativeSteps

MAX_SEQ_ID_LEN = 256  # the default of ManagerConfig.max_id_len

# One step, unlogged: (ops, all_or_nothing, batch, before_commit, layout, hold_open) -> its result.
StepFn = Callable[[Seq[Operation], bool, bool, Optional[Callable[[StepResult], None]], TableLayout, bool], StepResult]


class StepLog(Protocol):
    """What ``ManagerState.step_log`` is: runs ``apply`` on the step's arguments, around it records the step."""

    def __call__(self, apply: StepFn, ops: Seq[Operation], all_or_nothing: bool, batch: bool,
                 before_commit: Optional[Callable[[StepResult], None]], layout: TableLayout,
                 hold_open: bool) -> StepResult: ...


@dataclass(slots=True)
class StepState:
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


class ManagerState:
    def __init__(self, config: ManagerConfig | None = None) -> None:
        self.config = config or ManagerConfig()
        if self.config.num_gpu_blocks < 2:
            raise InvalidArgument("a BlockManager needs num_gpu_blocks >= 2 (block 0 is the null block that padding "
                                  "names; 0 means: let the service size it from workers)")
        self.block_size = self.config.block_size
        self.watermark_blocks = self.config.watermark_blocks
        self._journal = Journal()
        self.gpu = BlockPool(self.config.num_gpu_blocks, self._journal, "gpu", self.config.enable_prefix_caching,
                             reserve_null=True)
        self.cpu = BlockPool(self.config.num_cpu_blocks, self._journal, "cpu", caching=False)
        self.seqs = SequenceTable(self._journal, tenant_of)
        self.counters = Counters()
        self.op_counts = OperationCounts()
        self.steps = 0
        # Sequences whose K/V was lost with a replaced worker group (``lose_all``): id -> the epoch
        # that lost it. Every operation on one answers DATA_LOSS until it is freed.
        self.lost: dict[str, int] = {}
        self._step: Optional[StepState] = None
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
        # (new ones, or unused ones it revives: CACHED, or HELD since this step released them),
        # before it changes anything, like its check of the pool's room: the service's per-tenant
        # quota check, set for one step. Raising a ManagerError refuses the operation. None: no check.
        self.admit: Optional[Callable[[str, int], None]] = None
        # Called as admit_sequence(what) by an allocate or fork about to add a live sequence, after
        # the manager's own limits passed (``_admit_sequence``), before it changes anything: the
        # service's per-tenant sequence quota, set for one step. Raising a ManagerError refuses it.
        self.admit_sequence: Optional[Callable[[str], None]] = None
        # Wraps every step (the write-ahead log records it there: manager/recovery.py); called
        # with the unlogged step function and the step's arguments. None: steps are not logged.
        self.step_log: Optional[StepLog] = None

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

    def _admit(self, what: str, new: int, hits: Iterable[int]) -> None:
        """Admission of an allocation or swap-in: ``new`` blocks to take, besides the distinct GPU
        blocks ``hits`` it shares by prefix. A hit that is not in use (CACHED, or HELD: released
        earlier in this step) is revived: it counts against the tenant's quota like a new block,
        and a CACHED one against the pool's room too (it could have been evicted for a new block).
        RESOURCE_EXHAUSTED unless the new blocks fit above the watermark; then the service's
        per-tenant quota check (``admit``). O(hits)."""
        gpu = self.gpu
        states = [gpu.blocks[b].state for b in hits]
        available = gpu.num_available - states.count(CACHED)
        if new > available - self.watermark_blocks:
            raise ResourceExhausted(
                f"{what}: needs {new} free GPU blocks, {available} are free or evictable and "
                f"{self.watermark_blocks} are kept in reserve", needed=new, free=available - self.watermark_blocks)
        if self.admit is not None:
            self.admit(what, new + len(states) - states.count(USED))

    def _admit_sequence(self, what: str, entries: int) -> None:
        """Admission of one more sequence whose block table has ``entries`` entries (an allocate's
        prompt, a fork's copy of its parent's table: a fork takes no block, yet the manager keeps
        a table for the child, 8 bytes an entry). RESOURCE_EXHAUSTED when the sequences the
        manager holds (live ones, and lost ones until they are freed) are ``max_sequences``
        already, or when the live tables would pass ``max_block_table_entries``; then the
        service's per-tenant check (``admit_sequence``). O(1): the table keeps the counts."""
        config, seqs = self.config, self.seqs
        held = len(seqs) + len(self.lost)
        if held >= config.max_sequences:
            lost = f" ({len(self.lost)} of them lost, until freed)" if self.lost else ""
            raise ResourceExhausted(
                f"{what}: the manager holds {held} sequences{lost}, its limit (max_sequences {config.max_sequences}); "
                "free sequences first")
        if seqs.num_entries + entries > config.max_block_table_entries:
            raise ResourceExhausted(
                f"{what}: its block table of {entries} entries would take the live sequences' tables to "
                f"{seqs.num_entries + entries} entries, over the limit (max_block_table_entries "
                f"{config.max_block_table_entries}); free sequences first")
        if self.admit_sequence is not None:
            self.admit_sequence(what)

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
