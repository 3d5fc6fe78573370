"""The KV cache a worker owns: its blocks on the worker's device (``blocks``), the host swap
space (``swap_space``), and the execution of plans.

Layout (block-major): ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``,
K at index 0 and V at 1 of dim 2. One block's data for every layer is one contiguous chunk,
so a swap or a copy-on-write moves one chunk per block instead of one per layer; attention
reads per-layer views ``[num_blocks, num_kv_heads, block_size, head_dim]`` whose block stride
is ``num_layers * 2`` times a layer's block. Heads before tokens (HND) keep one head's tokens
of a block contiguous (block_size * head_dim elements), which is what a decode kernel reads.

On CUDA a plan runs asynchronously on the cache's own swap stream, ordered by events:

- the swap stream first waits for everything already queued on the compute stream (the
  previous step's K/V writes to a block being swapped out, its attention over a block that
  a swap-in or copy now overwrites);
- then, in stream order, swap-out (GPU→pinned CPU), swap-in (pinned CPU→GPU) and the
  copy-on-write copies: a CPU block written by a swap-out is complete before any later
  swap-in reads it, and a GPU block freed by a swap-out is read before a swap-in or copy
  of the same or a later plan rewrites it;
- an event recorded after the plan is waited on by the compute stream at the step's first
  access to the cache (``layer()``, which the model calls right before its first K/V write
  and attention), so the model's embedding and first projections overlap the swap, and no
  write of the step can reach a block before the swap-out reading it has finished.

``execute`` returns once the work is enqueued. The host must call ``synchronize()`` before it
reads ``swap_space`` itself (tests do); nothing in the serving path reads it from the host. On the
CPU the plan runs synchronously through the reference.

A model step is checked against the cache before it runs (``check_step``): every block it names
and every slot it writes must lie in the cache.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kvpager.kernels import ops
from kvpager.step import StepInput

from .block_plan import BlockMoves, BlockPlan


# Times one part of a plan ("swap_out", "swap_in" or "copy"): entered on the stream that runs
# the part (the swap stream on CUDA), so it can record events there (worker.metrics).
PartTimer = Callable[[str], AbstractContextManager]


class PlanRejected(ValueError):
    """A plan names a block that does not exist, or repeats a target; nothing was executed."""


class PlanExpired(RuntimeError):
    """A plan reached the cache after its sender stopped waiting for it (the step was rolled
    back): nothing was executed."""


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
    def __init__(self, spec: CacheSpec, num_blocks: int, num_swap_blocks: int, device: torch.device | str) -> None:
        self.spec = spec
        self.device = torch.device(device)
        # The cache the model reads and writes, on ``device`` (a GPU, or host memory on a CPU worker):
        # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
        self.blocks = torch.zeros(spec.shape(num_blocks), dtype=spec.dtype, device=self.device)
        # The swap space, always in host memory, pinned with CUDA so swaps run as asynchronous DMA:
        # [num_swap_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
        pin = self.device.type == "cuda"
        self.swap_space = torch.zeros(spec.shape(num_swap_blocks), dtype=spec.dtype, pin_memory=pin)
        self._swap_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ready: torch.cuda.Event | None = None   # recorded on the swap stream after the last plan
        self._waited: set[int] = set()                 # compute streams that already waited on it

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_space.shape[0]

    def check_step(self, step: StepInput) -> None:
        """Raise ValueError naming the first block table entry of ``step`` that is not a block of
        this cache (padding included: the manager pads rows with block 0) or the first slot it
        writes outside the cache. The kernels never touch memory outside the cache, but each path
        would answer such an entry its own way (write_kv drops the token, the decode leaves it
        out, the prefill reads zeros, the reference raises), so a step naming one is refused
        whole, before anything runs. O(S * max_blocks + T), in C (``_first_outside``): a few
        microseconds for 256 rows of 128 blocks."""
        bad_block = _first_outside(step.block_tables, self.num_blocks)
        if bad_block is not None:
            at, block = bad_block
            raise ValueError(f"step {step.step_id}: block table row {at // step.max_blocks} names block "
                             f"{block}, not a block of this cache (0 to {self.num_blocks - 1})")
        num_slots = self.num_blocks * self.spec.block_size
        bad_slot = _first_outside(step.slot_mapping, num_slots)
        if bad_slot is not None:
            at, slot = bad_slot
            raise ValueError(f"step {step.step_id}: token {at} is written to slot {slot}, outside this cache's "
                             f"{num_slots} slots (0 to {num_slots - 1})")

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer: two views ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        On CUDA, the current stream first waits for the last plan's swaps and copies."""
        self.wait()
        return self.blocks[:, index, 0], self.blocks[:, index, 1]

    def wait(self, stream: "torch.cuda.Stream | None" = None) -> None:
        """Make ``stream`` (default: the current stream of the cache's device) wait, on the
        device, for the last executed plan. No host sync; a no-op on the CPU or when done."""
        ready = self._ready
        if ready is None:
            return
        stream = stream or torch.cuda.current_stream(self.device)
        key = stream.cuda_stream
        if key not in self._waited:
            stream.wait_event(ready)
            self._waited.add(key)

    def synchronize(self) -> None:
        """Block the host until every executed plan has finished (e.g. before reading ``swap_space``)."""
        if self._swap_stream is not None:
            self._swap_stream.synchronize()

    def execute(self, plan: BlockPlan, time_part: Optional[PartTimer] = None) -> None:
        """Run one step's plan in the order that keeps data right: swap-out (cache→swap space)
        before a released block is reused, swap-in (swap space→cache), then copy-on-write copies,
        all before the step writes new K/V. The whole plan is checked first; a bad one is
        rejected (PlanRejected) without touching memory.
        On CUDA it is enqueued on the swap stream and this returns at once (see the module
        docstring for the ordering); on the CPU it has finished when this returns.
        ``time_part(kind)``, if given, is entered around each part that has work, on the
        stream that runs it; it must not make the host wait."""
        self._check("swap-out", plan.swap_out, self.num_blocks, self.num_swap_blocks)
        self._check("swap-in", plan.swap_in, self.num_swap_blocks, self.num_blocks)
        self._check("copy", plan.copy, self.num_blocks, self.num_blocks)
        if plan.is_empty:
            return
        if self._swap_stream is None:
            self._run(plan, time_part)
            return
        with torch.cuda.device(self.device):
            swap = self._swap_stream
            swap.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(swap):
                self._run(plan, time_part)
                ready = torch.cuda.Event()
                ready.record(swap)
        self._ready, self._waited = ready, set()

    def _run(self, plan: BlockPlan, time_part: Optional[PartTimer]) -> None:
        # Index tensors are built before a part's timer starts: on CUDA an idle stream's clock
        # runs between the events, so host work inside them would count as device time.
        timed = time_part or _untimed
        if plan.swap_out:
            src, dst = _ids(plan.swap_out.src), _ids(plan.swap_out.dst)
            with timed("swap_out"):
                ops.swap_blocks(self.blocks, self.swap_space, src, dst)
        if plan.swap_in:
            src, dst = _ids(plan.swap_in.src), _ids(plan.swap_in.dst)
            with timed("swap_in"):
                ops.swap_blocks(self.swap_space, self.blocks, src, dst)
        if plan.copy:
            src, dst = _ids(plan.copy.src), _ids(plan.copy.dst)
            with timed("copy"):
                ops.copy_blocks(self.blocks, src, dst)

    @staticmethod
    def _check(what: str, moves: BlockMoves, src_blocks: int, dst_blocks: int) -> None:
        src, dst = moves.src, moves.dst
        if len(src) != len(dst):
            raise PlanRejected(f"{what}: {len(src)} sources but {len(dst)} destinations")
        for ids, limit, side in ((src, src_blocks, "source"), (dst, dst_blocks, "destination")):
            bad = [b for b in ids if not 0 <= b < limit]
            if bad:
                raise PlanRejected(f"{what}: {side} block {bad[0]} out of range [0, {limit})")
        if len(set(dst)) != len(dst):
            raise PlanRejected(f"{what}: a destination block is written twice")


def _first_outside(values: Sequence[int], limit: int) -> Optional[tuple[int, int]]:
    """(index, value) of the first of ``values`` (a list or an integer array) outside [0, limit),
    or None. O(n) in C: one pass (an array's largest value read as unsigned, where a negative one
    is larger than any limit; a list's min and max), then the position only when one is outside."""
    if len(values) == 0:
        return None
    if isinstance(values, np.ndarray):
        if int(values.view(f"u{values.itemsize}").max()) < limit:
            return None
    elif min(values) >= 0 and max(values) < limit:
        return None
    array = np.asarray(values, dtype=np.int64)
    at = int(np.flatnonzero((array < 0) | (array >= limit))[0])
    return at, int(array[at])


def _untimed(kind: str) -> AbstractContextManager:
    return nullcontext()


def _ids(ids: Sequence[int]) -> torch.Tensor:
    # Index lists stay on the CPU: the copy helpers move them where needed in one transfer.
    return torch.as_tensor(list(ids), dtype=torch.int64)
