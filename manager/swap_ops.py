"""Swapping whole sequences between the GPU and CPU pools: swap_out, swap_in (reusing GPU
blocks that still hold the same content by prefix hash) and the table move both share. O(blocks
of the sequences named)."""

from __future__ import annotations


from .block_pool import BlockPool
from kvpager.errors import (
    FailedPrecondition,
    OutOfRange,
    ResourceExhausted,
    quote,
)
from .operations import (
    SwapInOp, SwapOutOp,
)
from .plan import (
    BlockMapping,
    SwapResult,
)
from .sequence import CPU, GPU, Sequence
from .state import ManagerState


class SwapOperations(ManagerState):
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
        if need > cpu.num_usable:
            raise OutOfRange(f"swap out: needs {need} CPU blocks; the CPU pool has {cpu.num_usable}")
        if need > cpu.num_available:
            raise ResourceExhausted(f"swap out: needs {need} free CPU blocks, {cpu.num_available} are free",
                                    needed=need, free=cpu.num_available, tier="cpu")

        mapping = BlockMapping()
        to_cpu: dict[int, int] = {}
        for g in distinct:
            c = self._new_copy(gpu, g, cpu)
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
        usable = gpu.num_usable - self.watermark_blocks
        if need > usable:
            raise OutOfRange(f"swap in: needs {need} GPU blocks; the GPU pool can never give more than {usable}")
        self._admit(f"swap in {quote(seqs[0].seq_id)}", need, set(reuse.values()))

        # Take the cache hits first, so that allocating the other blocks cannot evict them. Two
        # CPU copies of one block map to one GPU block; the owner of each is its CPU copy's.
        for g, owner in {g: cpu.blocks[c].owner for c, g in reuse.items()}.items():
            gpu.acquire(g, owner)
        mapping = BlockMapping()
        to_gpu: dict[int, int] = {}
        for c in distinct:
            g = reuse.get(c)
            if g is None:
                g = self._new_copy(cpu, c, gpu)
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

    @staticmethod
    def _new_copy(src: BlockPool, block_id: int, dst: BlockPool) -> int:
        """A new block of ``dst`` to receive ``src``'s block: its owner, its fill, and its prefix hash
        carried over (so a swapped block can be matched against the GPU prefix cache). O(1)."""
        new = dst.allocate(src.blocks[block_id].owner)
        dst.fill(new, src.blocks[block_id].num_filled)
        block_hash = src.hash_of(block_id)
        if block_hash is not None:
            dst.register(new, block_hash)
        return new

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
