"""What a worker reports about its cache and the plans it ran (``CacheWorker.memory_stats``).

Plain records: the gRPC servicer (``worker.service``) turns a ``MemoryStats`` into the wire's
``WorkerMemoryStats``, whose field names it shares; Ray callers get it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PlanCounts:
    """The plans a worker applied. Changed only by ``CacheWorker.execute_plan``, under its lock."""

    plans_executed: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    blocks_copied: int = 0
    last_step_id: int = 0    # the step of the last plan applied (0: none yet)


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """A worker's cache and its plan counts at one moment. "gpu" names the cache on the worker's
    device (host memory on a CPU worker) and "cpu" the swap space, as on the wire."""

    worker_id: str
    device: str                # the cache's device, e.g. "cuda:0" or "cpu"
    num_gpu_blocks: int        # blocks of the cache (KVCache.num_blocks)
    num_cpu_blocks: int        # blocks of the swap space (KVCache.num_swap_blocks)
    block_bytes: int           # one block across all layers, K and V
    gpu_cache_bytes: int       # bytes of KVCache.blocks
    cpu_cache_bytes: int       # bytes of KVCache.swap_space
    attention_backend: str     # what runs attention over this cache (kvpager.kernels.ops.backend)
    plans_executed: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    blocks_copied: int
    last_step_id: int
