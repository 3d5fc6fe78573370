"""What the manager answers: per-operation results, the memory plan workers execute, and
the block tables of a step's sequences. Plain data; the wire format lives in the servicer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Union

from kvpager.errors import ManagerError


@dataclass(slots=True)
class BlockMapping:
    """Parallel lists: block src[i] moves or copies to dst[i]."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)

    def add(self, src: int, dst: int) -> None:
        self.src.append(src)
        self.dst.append(dst)

    def extend(self, other: "BlockMapping") -> None:
        self.src.extend(other.src)
        self.dst.extend(other.dst)

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.src, self.dst))

    def __len__(self) -> int:
        return len(self.src)


@dataclass(slots=True)
class AllocateResult:
    seq_id: str
    block_ids: list[int]
    slot_mapping: list[int]   # one per prompt token
    num_cached_tokens: int


@dataclass(slots=True)
class AppendResult:
    seq_id: str
    slot_mapping: list[int]   # one per new token
    new_block_ids: list[int]
    copies: BlockMapping      # copy-on-write of a shared last block
    num_tokens: int


@dataclass(slots=True)
class AppendBatchResult:
    """The appends of a batch that failed: (index into its seq_ids, error), in order."""

    failures: list[tuple[int, ManagerError]] = field(default_factory=list)


@dataclass(slots=True)
class ForkResult:
    child_seq_id: str
    block_ids: list[int]


@dataclass(slots=True)
class FreeResult:
    seq_id: str
    num_blocks_released: int


@dataclass(slots=True)
class SwapResult:
    mapping: BlockMapping     # gpu->cpu for swap-out, cpu->gpu for swap-in
    num_blocks_reused: int = 0  # swap-in: blocks found in the GPU prefix cache, not copied


Result = Union[AllocateResult, AppendResult, AppendBatchResult, ForkResult, FreeResult, SwapResult]


@dataclass(slots=True)
class OperationOutcome:
    """Exactly one of result and error is set."""

    result: Optional[Result] = None
    error: Optional[ManagerError] = None


@dataclass(slots=True)
class ExecutionPlan:
    """A step's memory work. Workers run it in field order, then write the step's K/V."""

    step_id: int
    blocks_to_swap_out: BlockMapping = field(default_factory=BlockMapping)
    blocks_to_swap_in: BlockMapping = field(default_factory=BlockMapping)
    blocks_to_copy: BlockMapping = field(default_factory=BlockMapping)

    @property
    def moves_blocks(self) -> bool:
        """Whether the workers have anything to do (else the plan needs no worker)."""
        return bool(self.blocks_to_swap_out.src or self.blocks_to_swap_in.src or self.blocks_to_copy.src)


class TableLayout(enum.Enum):
    """Which block-table forms a step's ``BatchTables`` holds (``StepRequest.table_layout``).
    Each costs time in proportion to its entries at every step, in the manager, on the wire and
    in the caller: a caller asks only for the one its kernels read."""

    BOTH = "both"      # padded and CSR (the default)
    PADDED = "padded"  # block_tables (vLLM style)
    CSR = "csr"        # kv_indptr, kv_indices, kv_last_page_len (FlashInfer style)
    NONE = "none"      # no block table
    PADDED_PACKED = "padded_packed"  # block_tables_packed: the padded table as little-endian int32 bytes

    @property
    def padded(self) -> bool:
        return self in (TableLayout.BOTH, TableLayout.PADDED)

    @property
    def csr(self) -> bool:
        return self in (TableLayout.BOTH, TableLayout.CSR)

    @property
    def packed(self) -> bool:
        return self is TableLayout.PADDED_PACKED

    @property
    def copies(self) -> int:
        """How many times the answer's batch holds each touched sequence's block table."""
        return self.padded + self.csr + self.packed


@dataclass(slots=True)
class BatchTables:
    """Running sequences a step touched, in the block-table forms kernels use (both by default;
    the forms its ``TableLayout`` leaves out are empty lists, ``kv_indptr`` included)."""

    seq_ids: list[str] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    max_blocks: int = 0                                      # the longest table's length, whatever the layout
    block_tables: list[int] = field(default_factory=list)   # row-major [num_seqs, max_blocks], 0-padded
    block_tables_packed: bytes = b""                         # the same, as little-endian int32s (PADDED_PACKED)
    kv_indptr: list[int] = field(default_factory=lambda: [0])
    kv_indices: list[int] = field(default_factory=list)
    kv_last_page_len: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    step_id: int
    outcomes: list[OperationOutcome]
    applied: bool
    plan: ExecutionPlan
    batch: BatchTables
    gpu_blocks_available: int = 0  # free + evictable once the step ended
    cpu_blocks_available: int = 0


@dataclass(slots=True)
class TierStats:
    total_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int


@dataclass(slots=True)
class ManagerStats:
    block_size: int
    gpu: TierStats
    cpu: TierStats
    running_sequences: int
    swapped_sequences: int
    gpu_utilization: float
    internal_fragmentation: float
    prefix_caching: bool
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_query_blocks: int
    prefix_hit_blocks: int
    preemptions: int
    cow_copies: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    evictions: int
    watermark_blocks: int
    steps: int
