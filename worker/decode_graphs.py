"""Decode steps replayed from CUDA graphs: one launch per step instead of ~17 per layer.

A pure decode step (one token per sequence) of a single-rank model on CUDA runs the same
kernels every time; only their inputs change. ``DecodeGraphs`` captures ``Decoder.decode_hidden``
(embedding, every layer with its K/V write and our paged decode attention) once per shape and
replays it, the final norm, lm_head and argmax inside too. A step's host work is one C++ call
and the replay: the call (``ops.decode_step_stager``, kernels/csrc/decode_stage.h) writes its
tokens, positions, slots, feedback rows, context lengths and block tables straight from the
step's lists and arrays into one pinned buffer, plans its work list there, and sends it in one
copy into the static buffer the graph reads (``_Inputs``: each batch bucket has its fixed layout
there; the tables packed ``[S, W]``, their row stride W in the work list's header, so one graph
serves every width), with the fed ids copied beside it, and launches the graph, which picks the fed
tokens (``feed_tokens``' selection is its first kernel, from a static copy of the previous ids), runs
the model and writes the logits and their argmax into static outputs (``last_ids``: a greedy
step's ids with no argmax launch after the replay).

Shapes: a graph serves one batch bucket: a step of S sequences runs in the smallest bucket
B >= S (``BATCH_BUCKETS``, capped at ``max_batch``), its tables packed ``[S, W]`` (the kernel
takes their row stride from the work list and reads each row only up to its context). Without a
work list (``KVPAGER_DECODE_WORK_LIST=0``) the grid is planned from the table's width at capture,
so a graph serves one (batch bucket, power-of-two width >= W) for tables W blocks wide, copied
into rows of that width. Rows S..B-1 are padding: context 0 and slot -1, so they write nothing
and attend to nothing; table entries past a row's context are never read, so the buffers are not
cleared between steps.
Attention runs from the step's work list (``kernels/decode_plan.py``), planned on the host from
the real lengths and copied into a static buffer with the other inputs: the launch geometry is
fixed per model, so one graph serves every plan. The worker captures every bucket when it starts
(``capture_all``: about two eager steps' time each, one eager warm-up per process); shapes not
captured yet (no work list) are captured the first time they are seen. Graphs share one memory
pool: at most one runs at a time, and nothing a graph allocated outlives its replay; every graph
writes its logits into the same static buffer.

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
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kvpager.kernels import ops
from kvpager.numeric import ceil_div
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


@dataclass(frozen=True, slots=True)
class _Inputs:
    """Where a batch bucket's integer inputs lie, in bytes from the start of the static input
    buffer (and of the pinned buffer they are staged in): int64 ``[4, batch]`` rows (tokens,
    positions, slots, feedback rows) at 0, int32 context lengths at ``context_at``, the int32
    work list from ``work_at`` (a multiple of 16: the kernel reads its header as one 16-byte load) to
    ``work_end``, then the int32 block tables from ``tables_at``
    (a multiple of 16): packed ``[S, W]`` for a step of S rows W wide when a work list carries W
    as their row stride, else ``[batch, width]`` rows of the graph's width."""
    batch: int
    context_at: int
    work_at: int
    work_end: int
    tables_at: int

    @classmethod
    def of(cls, batch: int, work_ints: int) -> "_Inputs":
        context_at = 32 * batch
        work_at = ceil_div(context_at + 4 * batch, 16) * 16
        work_end = work_at + 4 * work_ints
        return cls(batch, context_at, work_at, work_end, ceil_div(work_end, 16) * 16)

    @property
    def offsets(self) -> tuple[int, int, int, int, int]:
        """(batch, context_at, work_at, work_end, tables_at), as ``ops.decode_step_stager`` takes them."""
        return self.batch, self.context_at, self.work_at, self.work_end, self.tables_at

    def nbytes(self, width: int) -> int:
        """Bytes of the layout with ``batch`` table rows ``width`` wide."""
        return self.tables_at + 4 * self.batch * width

    def views(self, buffer: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The longs ``[4, batch]``, context, work list and tables ``[batch, width]`` as typed
        views of ``buffer`` (uint8, device or host; at least ``nbytes(width)`` long)."""
        longs = buffer[:self.context_at].view(torch.int64).view(4, self.batch)
        tables = buffer[self.tables_at:self.nbytes(width)].view(torch.int32).view(self.batch, width)
        return (longs, buffer[self.context_at:self.context_at + 4 * self.batch].view(torch.int32),
                buffer[self.work_at:self.work_end].view(torch.int32), tables)


class DecodeGraphs:
    def __init__(self, model: Decoder, cache: KVCache, max_batch: int = 512, max_blocks: int = 8192) -> None:
        """Graphs for decode batches of up to ``max_batch`` sequences whose tables are up to
        ``max_blocks`` wide (the longest context the model serves over the block size). The
        static buffers take about ``max_batch * (max_blocks + 1.5 * vocab) * 4`` bytes (the
        tables, the logits and the graphs' bf16 logits)."""
        reason = supported(model, cache)
        if reason is not None:
            raise ValueError(f"decode steps cannot run as CUDA graphs: {reason}")
        self.model, self.cache = model, cache
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.max_batch, self.max_blocks = max_batch, _width_bucket(max_blocks)
        dev = cache.device
        # The step's work list and the split-KV workspace, sized for the largest bucket; a bucket
        # of B rows uses their prefixes. (No planner: KVPAGER_DECODE_WORK_LIST=0, the per-call
        # grid inside the graph, planned from the table's width at capture.)
        self._planner = model.decode_planner(self._layer_cache)
        self._inputs = {b: _Inputs.of(b, self._planner.plan_size(b) if self._planner is not None else 0) for b in self.batch_buckets}
        with torch.cuda.device(dev):
            # Every bucket's inputs (``_Inputs``) at the start of one buffer: a step's go up in one copy.
            self._staged = torch.zeros(self._inputs[max_batch].nbytes(self.max_blocks), dtype=torch.uint8, device=dev)
            self._logits = torch.zeros(max_batch, model.cfg.vocab_size, dtype=torch.float32, device=dev)
            self._ids = torch.zeros(max_batch, dtype=torch.long, device=dev)        # the last replay's argmax
            self._previous = torch.zeros(max_batch, dtype=torch.long, device=dev)   # the ids tokens are fed from
            if self._planner is not None:
                self._workspace = self._planner.workspace(max_batch)
        # A step's host path in one C++ call: its inputs written into a pinned buffer of its own
        # ring, the work list planned there, the copies and the graph's launch enqueued.
        self._stager = ops.decode_step_stager(self._staged, self._previous,
                                              [lay.offsets for lay in self._inputs.values()], self._planner)
        self._bucket_index = {b: i for i, b in enumerate(self._inputs)}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._execs: dict[tuple[int, int], int] = {}   # each graph's cudaGraphExec_t (0: replay() it)
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

    def run(self, step: StepInput, previous_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step's logits ``[S, vocab]`` (float32), as ``Decoder.forward_paged`` gives them,
        from one graph replay: a view of the graphs' static output, valid until the next ``run``
        (read it, or copy it, in stream order before then: the worker's argmax and its copy to
        the host do). The step must be one that ``serves`` takes. ``previous_ids``: as
        ``Decoder.forward_paged`` takes them (``step.feedback_rows``); the graph feeds the tokens.
        O(S * W) host work in one C++ call: the inputs, the work list and the tables written in
        place into a pinned buffer, from the step's lists or arrays as they are, then one
        host-to-device copy (and, for a fed step, one device copy of ``previous_ids``) and the
        graph's launch enqueued."""
        s, w = step.num_seqs, step.max_blocks
        batch = self.batch_buckets[bisect.bisect_left(self.batch_buckets, s)]
        # With a work list the kernel reads the tables only up to each row's context, so one
        # graph per batch bucket, over the buffer's full width, serves every width; the tables go
        # packed [s, w] (their stride in the list's header). Else in rows of the graph's width.
        width = self.max_blocks if self._planner is not None else _width_bucket(w)
        shape = (batch, width)
        graph = self._graphs.get(shape) or self._capture(batch, width)
        fed = step.feedback_rows is not None
        if fed and previous_ids is None:
            raise ValueError(f"step {step.step_id} takes tokens from step {step.feedback_step}'s ids: pass them")
        feed_in_graph = fed and len(previous_ids) <= self.max_batch
        # Ids of a step wider than the buffer are fed here, after the upload: the replay waits.
        launch = self._execs[shape] if feed_in_graph or not fed else 0
        self.cache.wait()
        # The fed ids are always copied, even ``last_ids``: feeding from the graph's own output
        # in place made this call 100-300 us slower on the H100 host (measured, not understood).
        self._stager.stage(self._bucket_index[batch], launch, step.token_ids, step.positions, step.slot_mapping,
                           step.feedback_rows if feed_in_graph else None, step.context_lens, step.block_tables,
                           s, w, w if self._planner is not None else width, previous_ids if feed_in_graph else None)
        if not launch:
            if fed and not feed_in_graph:
                with torch.inference_mode():
                    tokens = self._inputs[batch].views(self._staged, 0)[0][0, :s]
                    feed_tokens(tokens, torch.as_tensor(step.feedback_rows, device=tokens.device), previous_ids)
            graph.replay()
        return self._logits[:s]

    def last_ids(self, rows: int) -> torch.Tensor:
        """The argmax of the last ``run``'s logits, its first ``rows`` rows (int64, on the device,
        computed inside the graph): valid until the next ``run`` (which may take them as
        ``previous_ids``)."""
        return self._ids[:rows]

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
        (tokens, positions, slots, rows), context, work, tables = self._inputs[batch].views(self._staged, width)
        tokens = torch.where(rows >= 0, self._previous[rows.clamp(min=0)], tokens)   # ``feed_tokens``, out of place
        plan = None
        if self._planner is not None:   # the bucket's work list, the graph's own workspace
            plan = self._planner.step_plan(work, batch, self._workspace)
        hidden = self.model.decode_hidden(tokens, positions, slots, tables, context, self._layer_cache, plan=plan)
        torch.argmax(self.model.logits(hidden, out=self._logits[:batch]), dim=-1, out=self._ids[:batch])

    @torch.inference_mode()
    def _capture(self, batch: int, width: int) -> torch.cuda.CUDAGraph:
        """Capture the shape on a side stream, with padding in every row it reads (the static
        buffers may hold a previous step's rows: they are reset to padding first)."""
        started = time.perf_counter()
        dev = self.cache.device
        longs, context, work, _ = self._inputs[batch].views(self._staged, 0)
        longs[:2].zero_()
        longs[2:].fill_(-1)
        context.zero_()
        if self._planner is not None:
            work.copy_(torch.from_numpy(self._planner.plan(np.zeros(batch, np.int32))))   # all padding
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
        # The stager launches the graph itself (one launch; torch's replay() also refills the RNG's
        # graph-offset tensors, which this graph, argmax and no sampling, does not read).
        self._execs[(batch, width)] = graph.raw_cuda_graph_exec() if hasattr(graph, "raw_cuda_graph_exec") else 0
        spent = time.perf_counter() - started
        self.capture_seconds += spent
        log.info("captured the decode step for batch %d, table width %d in %.0f ms (%d shapes)", batch, width,
                 spent * 1e3, len(self._graphs))
        return graph


def _width_bucket(width: int) -> int:
    """The smallest power of two >= width, at least MIN_WIDTH."""
    return max(MIN_WIDTH, 1 << (max(width, 1) - 1).bit_length())
