"""The KV cache a worker owns: device blocks, CPU swap blocks, and the execution of plans.

Layout (block-major): ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``,
K at index 0 and V at 1 of dim 2. One block's data for every layer is one contiguous chunk,
so a swap or a copy-on-write moves one chunk per block instead of one per layer; attention
reads per-layer views ``[num_blocks, num_kv_heads, block_size, head_dim]`` whose block stride
is ``num_layers * 2`` times a layer's block. Heads before tokens (HND) keep one head's tokens
of a block contiguous (block_size * head_dim elements), which is what a decode kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvpager.kernels import ops


class PlanRejected(ValueError):
    """A plan names a block that does not exist, or repeats a target; nothing was executed."""


@dataclass(frozen=True, slots=True)
class CacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float16

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elems = self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
        return elems * torch.empty((), dtype=self.dtype).element_size()

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)


class KVCache:
    def __init__(self, spec: CacheSpec, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device | str) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.gpu = torch.zeros(spec.shape(num_gpu_blocks), dtype=spec.dtype, device=self.device)
        # Pinned host memory lets swaps run as asynchronous DMA; only possible with CUDA.
        pin = self.device.type == "cuda"
        self.cpu = torch.zeros(spec.shape(num_cpu_blocks), dtype=spec.dtype, pin_memory=pin)

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu.shape[0]

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu.shape[0]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer: two views ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
        return self.gpu[:, index, 0], self.gpu[:, index, 1]

    def execute(self, swap_out: tuple[Sequence[int], Sequence[int]], swap_in: tuple[Sequence[int], Sequence[int]],
                copy: tuple[Sequence[int], Sequence[int]]) -> None:
        """Run one step's plan in the order that keeps data right: swap-out (GPU→CPU) before a
        released block is reused, swap-in (CPU→GPU), then copy-on-write copies (GPU→GPU),
        all before the step writes new K/V. Each argument is a (src, dst) pair of id lists.
        The whole plan is checked first; a bad one is rejected without touching memory."""
        self._check("swap-out", swap_out, self.num_gpu_blocks, self.num_cpu_blocks)
        self._check("swap-in", swap_in, self.num_cpu_blocks, self.num_gpu_blocks)
        self._check("copy", copy, self.num_gpu_blocks, self.num_gpu_blocks)
        if swap_out[0]:
            ops.swap_blocks(self.gpu, self.cpu, _ids(swap_out[0]), _ids(swap_out[1]))
        if swap_in[0]:
            ops.swap_blocks(self.cpu, self.gpu, _ids(swap_in[0]), _ids(swap_in[1]))
        if copy[0]:
            ops.copy_blocks(self.gpu, _ids(copy[0]), _ids(copy[1]))

    @staticmethod
    def _check(what: str, pairs: tuple[Sequence[int], Sequence[int]], src_blocks: int, dst_blocks: int) -> None:
        src, dst = pairs
        if len(src) != len(dst):
            raise PlanRejected(f"{what}: {len(src)} sources but {len(dst)} destinations")
        for ids, limit, side in ((src, src_blocks, "source"), (dst, dst_blocks, "destination")):
            bad = [b for b in ids if not 0 <= b < limit]
            if bad:
                raise PlanRejected(f"{what}: {side} block {bad[0]} out of range [0, {limit})")
        if len(set(dst)) != len(dst):
            raise PlanRejected(f"{what}: a destination block is written twice")


def _ids(ids: Sequence[int]) -> torch.Tensor:
    # Index lists stay on the CPU: the copy helpers move them where needed in one transfer.
    return torch.as_tensor(list(ids), dtype=torch.int64)
