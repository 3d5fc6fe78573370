"""Manager settings (``kvpager manager`` makes one flag per field, each also read from
KVPAGER_<FIELD>: see kvpager/commands/manager.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from kvpager.errors import InvalidArgument

_MAX_SECONDS = 1e6   # timeouts and TTLs: finite, and far below what threading's waits accept


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    block_size: int = 16              # tokens per KV block
    num_gpu_blocks: int = 4096        # GPU pool size; 0: both pools sized from the workers' capacity
    num_cpu_blocks: int = 4096        # CPU swap pool size
    # Largest pool sized from the workers' capacity (num_gpu_blocks 0): a worker reporting more is
    # refused INVALID_ARGUMENT before anything is built. A pool is built under the state lock at
    # ~1.5 s and ~170 MiB per million blocks (measured on a busy 2-core machine), so this default
    # takes ~3 s and ~350 MiB per pool; 2**31-1 blocks would take ~50 minutes and ~350 GiB.
    max_pool_blocks_from_workers: int = 1 << 21
    watermark: float = 0.01           # fraction of GPU blocks kept free at admission and swap-in
    enable_prefix_caching: bool = True
    max_seq_len: int = 1 << 20        # longer sequences are rejected as INVALID_ARGUMENT
    worker_heartbeat_timeout: float = 5.0  # seconds without a heartbeat before a worker is dropped
    worker_plan_timeout: float = 30.0      # deadline of one ExecutePlan call to a worker
    # Bounds that refuse, before anything is applied, what could not be answered (docs/design.md):
    max_prompt_tokens: int = 131072   # tokens of one Allocate's prompt (INVALID_ARGUMENT above)
    max_id_len: int = 256             # characters of a seq_id, cache_namespace or request_id
    max_step_operations: int = 16384  # operations of one Step (each sequence of an append_batch,
                                      # swap_out or swap_in counts as one)
    max_step_forks: int = 1024        # forks in one Step
    # What live sequences may make the manager hold (RESOURCE_EXHAUSTED above; docs/design.md). A
    # fork takes no block, yet its table is a copy of its parent's: measured (tracemalloc), a
    # sequence costs ~260 bytes plus its id, plus 8 bytes per table entry (a fork of a 1M-token
    # sequence at block size 16: 512 KiB). These defaults bound that to ~130 MiB (256-character ids)
    # + 128 MiB; 262,144 sequences is above the 100,000 live that benchmarks/manager_bench.py scales to.
    max_sequences: int = 1 << 18      # live sequences, plus lost ones until freed
    max_block_table_entries: int = 1 << 24  # entries of all live sequences' tables (8x the largest
                                            # pool sized from workers)
    max_reply_bytes: int = 2 << 20    # serialized answer; a larger one is refused and rolled back
                                      # (OUT_OF_RANGE); gRPC clients accept 4 MiB by default
    # Answers kept by request id, so that a retry gets the first answer (manager/request_cache.py):
    request_cache_entries: int = 65536
    request_cache_bytes: int = 64 << 20  # ids plus serialized answers
    request_cache_ttl: float = 600.0     # seconds an answer is kept
    # Durable state (manager/wal.py, docs/durability.md): "" keeps the state in memory only.
    state_dir: str = ""               # write-ahead log and snapshots; recovered at start
    fsync: str = "always"             # always (each record), batch (every 10 ms), never (the OS decides)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise InvalidArgument(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_gpu_blocks < 0 or self.num_cpu_blocks < 0:
            raise InvalidArgument(
                f"pool sizes must be >= 0 blocks (0 GPU blocks: size from workers), got {self.num_gpu_blocks} "
                f"and {self.num_cpu_blocks}"
            )
        if self.max_pool_blocks_from_workers < 2:   # GPU block 0 is the null block
            raise InvalidArgument(f"max_pool_blocks_from_workers must be >= 2, got {self.max_pool_blocks_from_workers}")
        for name in ("worker_heartbeat_timeout", "worker_plan_timeout", "request_cache_ttl"):   # nan and inf too
            if not 0 < getattr(self, name) < _MAX_SECONDS:
                raise InvalidArgument(f"{name} must be > 0 and < {_MAX_SECONDS:g} seconds, got {getattr(self, name)}")
        if not 0.0 <= self.watermark < 1.0:
            raise InvalidArgument(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_seq_len < 1:
            raise InvalidArgument(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        for name in ("max_prompt_tokens", "max_id_len", "max_step_operations", "max_reply_bytes",
                     "request_cache_entries", "request_cache_bytes", "max_sequences", "max_block_table_entries"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_step_forks < 0:
            raise InvalidArgument(f"max_step_forks must be >= 0, got {self.max_step_forks}")
        if self.max_reply_bytes < 1024:
            raise InvalidArgument(f"max_reply_bytes must be >= 1024, got {self.max_reply_bytes}")
        if self.fsync not in ("always", "batch", "never"):
            raise InvalidArgument(f"fsync must be always, batch or never, got {self.fsync!r}")

    @property
    def sized_by_workers(self) -> bool:
        return self.num_gpu_blocks == 0

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_gpu_blocks)


def from_args(args: argparse.Namespace) -> ManagerConfig:
    return ManagerConfig(**{f.name: getattr(args, f.name) for f in fields(ManagerConfig)})
