"""What a step's plan asks of a worker's cache: the blocks to swap out, to swap in and to copy.

Plain records, built once where a plan enters the worker (its gRPC servicer, ``worker.service``)
and read by ``CacheWorker.execute_plan`` and ``KVCache.execute``; the wire format stays in the
servicer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class BlockMoves:
    """Block ``src[i]`` goes to block ``dst[i]``; the two are the same length (``KVCache.execute``
    checks it, with the ids' ranges, before anything moves)."""

    src: Sequence[int] = ()
    dst: Sequence[int] = ()

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """One step's memory work, run in field order before the step writes K/V."""

    swap_out: BlockMoves = BlockMoves()  # cache block -> swap-space block
    swap_in: BlockMoves = BlockMoves()   # swap-space block -> cache block
    copy: BlockMoves = BlockMoves()      # cache block -> cache block (copy-on-write)

    @property
    def is_empty(self) -> bool:
        """Whether it moves nothing."""
        return not (self.swap_out.src or self.swap_in.src or self.copy.src)
