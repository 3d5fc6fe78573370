"""Decode steps replayed from CUDA graphs: one launch per step instead of ~17 per layer.

A pure decode step (one token per sequence) of a single-rank model on CUDA runs the same
kernels every time; only their inputs change. ``DecodeGraphs`` captures ``Decoder.decode_hidden``
(embedding, every layer with its K/V write and our paged decode attention) once per shape and
replays it: the step's tokens, positions, slots, block tables and lengths are copied into static
device buffers the graph reads, then one ``replay()`` runs the whole model. The final norm,
lm_head and argmax run eagerly after it (three launches; the logits' size depends on the batch).

Shapes: a graph serves one batch bucket: a step of S sequences runs in the smallest bucket
B >= S (``BATCH_BUCKETS``, capped at ``max_batch``), its tables in the first S rows of a
buffer ``max_blocks`` wide (the work list reads each row only up to its context). Without a work
list (``KVPAGER_DECODE_WORK_LIST=0``) the grid is planned from the table's width at capture, so
a graph serves one (batch bucket, power-of-two width >= W) for tables W blocks wide. Rows
S..B-1 are padding: context 0 and slot -1, so they write nothing and attend to nothing; table
entries past a row's context are never read, so the buffers are not cleared between steps.
Attention runs from the step's work list (``kernels/decode_plan.py``), planned on the host from
the real lengths and copied into a static buffer with the other inputs: the launch geometry is
fixed per model, so one graph serves every plan. The worker captures every bucket when it starts
(``capture_all``: about two eager steps' time each, one eager warm-up per process); shapes not
captured yet (no work list) are captured the first time they are seen. Graphs share one memory pool: at most one runs at a time, and nothing a graph allocated outlives
its replay except the static output, which every graph writes to the same buffer.

Ordering: the graph does not wait for the cache's last swap/copy plan itself (an event recorded
outside a capture cannot be waited on inside it); ``run`` makes the current stream wait for it
before the replay, which is the same ordering the eager path gets from ``KVCache.layer``.

Not captured (the eager path serves them): steps that prefill, batches above ``max_batch``,
tables wider than ``max_blocks``, tensor-parallel groups (their all-reduces stay eager), CPU
devices and head dims our CUDA kernel does not serve (``supported``).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Optional

import numpy as np
import torch

from kvpager.kernels import ops
from kvpager.step import StepInput

from .kv_cache import KVCache
from .model import Decoder, feed_tokens

log = logging.getLogger("kvpager.worker")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                 640, 768, 896, 1024)
MIN_WIDTH = 8


def supported(model: Decoder, cache: KVCache) -> Optional[str]:
    """None when decode steps of this model over this cache can be captured, else why not."""
    if cache.device.type != "cuda":
        return "the cache is not on a CUDA device"
    if model.tp_size > 1:
        return "tensor-parallel groups run their all-reduces eagerly"
    if ops.backend(cache.blocks[:, 0, 0]) != "cuda":
        return f"our CUDA decode kernel does not serve head dim {cache.spec.head_dim} / this cache"
    return None


class DecodeGraphs:
    def __init__(self, model: Decoder, cache: KVCache, max_batch: int = 512, max_blocks: int = 8192) -> None:
        """Graphs for decode batches of up to ``max_batch`` sequences whose tables are up to
        ``max_blocks`` wide (the longest context the model serves over the block size). The
        static buffers take about ``max_batch * max_blocks * 4`` bytes."""
        reason = supported(model, cache)
        if reason is not None:
            raise ValueError(f"decode steps cannot run as CUDA graphs: {reason}")
        self.model, self.cache = model, cache
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.max_batch, self.max_blocks = max_batch, _width_bucket(max_blocks)
        dev = cache.device
        with torch.cuda.device(dev):
            self._longs = torch.zeros(3, max_batch, dtype=torch.long, device=dev)   # tokens, positions, slots
            self._longs[2].fill_(-1)
            self._tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, device=dev)
            self._context = torch.zeros(max_batch, dtype=torch.int32, device=dev)
            self._hidden = torch.zeros(max_batch, model.cfg.hidden_size, dtype=model.embed.dtype, device=dev)
            # The step's work list and the split-KV workspace, sized for the largest bucket; a
            # bucket of B rows uses their prefixes. (No planner: KVPAGER_DECODE_WORK_LIST=0, the
            # per-call grid inside the graph, planned from the table's width at capture.)
            self._planner = model.decode_planner(self._layer_cache)
            if self._planner is not None:
                self._work = torch.zeros(self._planner.plan_size(max_batch), dtype=torch.int32, device=dev)
                self._workspace = self._planner.workspace(max_batch)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._warm = False
        self.capture_seconds = 0.0   # time spent capturing, all shapes together

    def serves(self, step: StepInput) -> bool:
        """Whether ``run`` takes this step (a pure decode step within the buffers' sizes)."""
        return step.decode_only and step.num_seqs <= self.max_batch and step.max_blocks <= self.max_blocks

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The (batch, width) shapes captured so far."""
        return sorted(self._graphs)

    @torch.inference_mode()
    def run(self, step: StepInput, previous_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step's logits ``[S, vocab]`` (float32), as ``Decoder.forward_paged`` gives them,
        from one graph replay. The step must be one that ``serves`` takes. O(S * W) host work:
        one host-to-device copy of its inputs, four device copies into the static buffers.
        ``previous_ids``: as ``Decoder.forward_paged`` takes them (``step.feedback_rows``)."""
        s, w = step.num_seqs, step.max_blocks
        batch = self.batch_buckets[bisect.bisect_left(self.batch_buckets, s)]
        # With a work list the kernel reads the tables only up to each row's context, so one
        # graph per batch bucket, over the buffer's full width, serves every width.
        width = self.max_blocks if self._planner is not None else _width_bucket(w)
        graph = self._graphs.get((batch, width)) or self._capture(batch, width)
        pad = [np.zeros(batch - s, np.int64), np.full(batch - s, -1, np.int64)]   # padding rows: 0, slot -1
        plan = np.zeros(0, np.int32)
        if self._planner is not None:
            plan = self._planner.plan(np.concatenate([np.asarray(step.context_lens, np.int32),
                                                      np.zeros(batch - s, np.int32)]))
        plan64 = np.concatenate([plan, np.zeros(len(plan) % 2, np.int32)]).view(np.int64)   # rides as int64 pairs
        fed = [] if step.feedback_rows is None else [step.feedback_rows]
        staged = self.model.staging.upload([step.token_ids, pad[0], step.positions, pad[0], step.slot_mapping, pad[1],
                                            step.context_lens, pad[0], plan64, *fed, step.block_tables], np.int64)
        self._longs[:, :batch].copy_(staged[:3 * batch].view(3, batch))
        self._context[:batch].copy_(staged[3 * batch:4 * batch])
        rows_at = 4 * batch + len(plan64)
        tables_at = rows_at + (s if fed else 0)
        if fed:
            feed_tokens(self._longs[0, :s], staged[rows_at:tables_at], previous_ids)
        if len(plan):
            self._work[:len(plan)].copy_(staged[4 * batch:rows_at].view(torch.int32)[:len(plan)])
        self._tables[:s, :w].copy_(staged[tables_at:].view(s, w))
        self.cache.wait()
        graph.replay()
        return self.model.logits(self._hidden[:s])

    def capture_all(self) -> int:
        """Capture every batch bucket now (with a work list one graph per bucket serves every
        table width), so that no step of a serving run waits for a capture; returns how many were
        captured. Without a work list the widths are open-ended: nothing is captured ahead (0)."""
        if self._planner is None:
            return 0
        todo = [b for b in self.batch_buckets if (b, self.max_blocks) not in self._graphs]
        for batch in todo:
            self._capture(batch, self.max_blocks)
        return len(todo)

    def _layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.blocks[:, layer, 0], self.cache.blocks[:, layer, 1]

    def _body(self, batch: int, width: int) -> None:
        tokens, positions, slots = self._longs[:, :batch]
        plan = None
        if self._planner is not None:   # the bucket's prefix of the static work list, the graph's own workspace
            plan = self._planner.step_plan(self._work[:self._planner.plan_size(batch)], batch, self._workspace)
        hidden = self.model.decode_hidden(tokens, positions, slots, self._tables[:batch, :width],
                                          self._context[:batch], self._layer_cache, plan=plan)
        self._hidden[:batch].copy_(hidden)

    def _capture(self, batch: int, width: int) -> torch.cuda.CUDAGraph:
        """Capture the shape on a side stream, with padding in every row it reads (the static
        buffers may hold a previous step's rows: they are reset to padding first)."""
        started = time.perf_counter()
        dev = self.cache.device
        self._longs[:2, :batch].zero_()
        self._longs[2, :batch].fill_(-1)
        self._context[:batch].zero_()
        if self._planner is not None:
            plan = self._planner.plan(np.zeros(batch, np.int32))   # all padding: what the warm-up runs
            self._work[:len(plan)].copy_(torch.from_numpy(plan))
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            if not self._warm:   # lazy initialisations (cuBLAS handles, kernel loading) happen outside a capture
                self._body(batch, width)
                self._warm = True
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                self._body(batch, width)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(batch, width)] = graph
        spent = time.perf_counter() - started
        self.capture_seconds += spent
        log.info("captured the decode step for batch %d, table width %d in %.0f ms (%d shapes)", batch, width,
                 spent * 1e3, len(self._graphs))
        return graph


def _width_bucket(width: int) -> int:
    """The smallest power of two >= width, at least MIN_WIDTH."""
    return max(MIN_WIDTH, 1 << (max(width, 1) - 1).bit_length())
