"""How big a rank's caches are when the configuration does not say (``WorkerConfig``'s
``num_gpu_blocks`` and ``num_cpu_blocks`` left unset).

The defaults agree with the manager's default pools, and `kvpager worker --help` states them
(it reads these constants: this module imports torch only to ask CUDA for its free memory).
On the CPU the "device" cache is host RAM, shared by the ranks: a fraction of it would be
gigabytes no CPU model step can use, so it is capped.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPU_CACHE_BYTES = 256 << 20   # device cache of one CPU rank, at most
DEFAULT_SWAP_BLOCKS = 4096    # swap space of one rank: the manager's default CPU pool (--num-cpu-blocks)...
SWAP_BYTES = 4 << 30          # ...at most this much host memory


def free_device_memory(device: torch.device) -> int:
    """Free bytes on ``device``: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_device_blocks(device: torch.device, block_bytes: int, memory_fraction: float, ranks_sharing: int) -> int:
    """Device cache blocks of a rank when none are asked for: ``memory_fraction`` of the free device
    memory; on the CPU, that share of available RAM divided among the ``ranks_sharing`` ranks, and
    at most CPU_CACHE_BYTES."""
    budget = free_device_memory(device) * memory_fraction
    if device.type == "cpu":
        budget = min(budget / ranks_sharing, CPU_CACHE_BYTES)
    return int(budget) // block_bytes


def default_swap_blocks(block_bytes: int) -> int:
    """CPU swap blocks of a rank when none are asked for: DEFAULT_SWAP_BLOCKS, at most SWAP_BYTES."""
    return max(1, min(DEFAULT_SWAP_BLOCKS, SWAP_BYTES // block_bytes))
