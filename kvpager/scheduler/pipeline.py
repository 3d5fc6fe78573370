"""The model steps: each Step's batch handed to the runner, and its tokens taken, in order.

Overlap (``overlap=True``, with a runner that has ``submit``, as ``RayWorkerGroup``): the Step
RPC of iteration N+1 runs while the workers compute step N. Its appends cannot carry step N's
tokens yet, so they reserve the slots only (count-only appends: the manager's prefix cache then
never indexes generated tokens, only prompts); the step's inputs are built once step N's
tokens are in. A sequence that ends by its token limit in step N gets no append; one that
samples a stop token in step N was already given a slot: it computes one token more, which is
dropped, and is freed a step later. When both steps are greedy and the runner ``feeds_back`` (a
single-rank Ray group), step N+1 goes to the workers before step N's tokens come back: its
tokens that step N computes are named by their row of step N's output
(``StepInput.feedback_rows``) and the worker takes them from the argmax it kept on the device,
so the GPU goes from step N to N+1 without waiting for the scheduler's loop; the loop then takes
the tokens of the oldest step in flight only once ``PIPELINE_DEPTH`` (2) are out, so while it
prepares step N+2 the GPU has N+1 queued behind N. A step that needs a token no step in flight
can feed (a sequence that skipped a step) first takes every step in flight. Steps that may move
blocks (swap-ins, preemption, the first appends of forked samples, which copy on write) first wait for
every step in flight, so a plan never reaches the workers ahead of a step queued before it. The
tokens are those of the plain loop.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvpager.step import StepInput
from kvpager.v1 import block_manager_pb2 as pb

from .batch_inputs import batch_inputs
from .outputs import OutputCollector
from .queues import RequestQueues
from .request import Group, SeqState
from .stats import SchedulerStats

# Runs one step on the workers: for each sequence that computed tokens, the float32 logits of its
# last token, or (a greedy step) their argmax. A runner may also have ``submit(step)``, which
# starts the step and returns a callable that waits for and returns the same (overlap); the
# callable may have ``prefetch()``, asking for the result early without waiting.
Runner = Callable[[StepInput], torch.Tensor]
# Called as each timed stage of an iteration ends: (stage, seconds it took, the step it ran or None).
# Stages: "step_rpc" (a Step RPC's round trip, retries included; no step), "model" (a runner call
# that computed the step and returned its rows), "submit" (handing the step to a runner that
# computes it while the scheduler goes on: overlap), "wait" (waiting for a submitted step's rows).
# A submitted step's model time runs from its "submit" to the end of its "wait". For benchmarks
# and profilers (benchmarks/serving.py); the scheduler reads no clock for it when it is None.
StageCallback = Callable[[str, float, Optional[StepInput]], None]


@dataclass(slots=True)
class InFlight:
    """A step the workers compute while the scheduler goes on (overlap)."""
    wait: Callable[[], torch.Tensor]          # returns the step's rows
    computed: list[tuple[SeqState, int]]      # (sequence, its context length after the step)
    greedy: bool
    step: StepInput                           # what the workers compute (its step_id: the manager's id)
    seq_ids: frozenset[str] = frozenset()     # of ``computed``: O(1) membership


class StepPipeline:
    """Runs each step's batch on ``runner``; with overlap, keeps the steps in flight (oldest
    first) whose tokens are not taken yet, and hands their rows to ``outputs`` in order."""

    # Steps in flight at most (overlap with tokens fed back on the worker): the GPU computes one
    # while the next waits behind it, and the scheduler's loop prepares the one after.
    PIPELINE_DEPTH = 2

    def __init__(self, runner: Runner, queues: RequestQueues, outputs: OutputCollector, stats: SchedulerStats,
                 overlap: bool, on_stage: Optional[StageCallback]) -> None:
        self.runner = runner
        self.overlap = overlap
        self.on_stage = on_stage
        self._queues = queues
        self._outputs = outputs
        self._stats = stats
        self._steps: deque[InFlight] = deque()

    def __len__(self) -> int:
        """Steps in flight."""
        return len(self._steps)

    def clear(self) -> None:
        """Forget the steps in flight (their workers are gone)."""
        self._steps.clear()

    # ---- what the next Step may do while steps are in flight ------------------------------------------
    def may_overlap(self) -> bool:
        """Whether the next Step may go out while a step is in flight: it moves no blocks (no
        swapped group has room to come back in this step, and no append may copy on write);
        preemption settles on its own (``Scheduler``'s ``_preempt_if_short``). A swapped group
        that does not fit yet waits while steps overlap. O(running sequences)."""
        if self._queues.swap_in_fits():
            return False
        return not any(_may_copy_on_write(group) for group in self._queues.running)

    def ends_in_flight(self, seq: SeqState, group: Group) -> bool:
        """The steps in flight give this sequence its last token (its limit), so it needs no
        slot. O(1) unless it is that close to its limit, then O(steps in flight)."""
        left = group.request.params.max_new_tokens - seq.num_generated
        if left > len(self._steps):
            return False
        return sum(seq.seq_id in p.seq_ids for p in self._steps) >= left

    def prefetch_oldest(self) -> None:
        """With ``PIPELINE_DEPTH`` steps in flight, the oldest one's tokens are taken after this
        iteration's launch: ask for them now, so that the workers answer while the Step RPC runs
        instead of after that launch."""
        if len(self._steps) >= self.PIPELINE_DEPTH:
            prefetch = getattr(self._steps[0].wait, "prefetch", None)
            if prefetch is not None:
                prefetch()

    # ---- running a step ------------------------------------------------------------------------------
    def compute(self, reply: pb.StepResponse) -> bool:
        """Run the step the manager answered with; whether any step's tokens were computed."""
        # The newest step in flight's greedy tokens can feed this one on the worker (device-side):
        # send it before they come back, so the GPU goes from one step to the next without this
        # loop; then take the tokens of the oldest steps, keeping PIPELINE_DEPTH in flight.
        feed = self._steps[-1] if self._may_feed() else None
        if feed is None:
            settled = self.settle()
            return self._launch(reply) or settled
        if not self._launch(reply, feed):
            return self.settle()
        while len(self._steps) > self.PIPELINE_DEPTH:
            self._take_oldest()
        return True

    def _may_feed(self) -> bool:
        """Whether the next step may go out before the one in flight returns: both greedy (the
        worker keeps the argmax on the device) and a runner that feeds tokens back (one rank)."""
        pending = self._steps[-1] if self._steps else None
        return (pending is not None and pending.greedy and getattr(self.runner, "feeds_back", False)
                and all(group.request.params.temperature <= 0 for group in self._queues.running))

    def _launch(self, reply: pb.StepResponse, feed: Optional[InFlight] = None) -> bool:
        """Start the model on the tokens of the step's batch (its tables as the manager sent them);
        with overlap leave it in flight, else wait for it and take its tokens. Rows of sequences
        that already finished (a stop token in a step before) compute a token that is dropped.
        ``feed``: the newest step in flight, whose greedy tokens this step may take on the worker;
        when it cannot (a token it does not compute is unknown, or this step samples), every
        step in flight is taken first. O(S + T)."""
        inputs = self._inputs(reply, feed)
        if inputs is None:   # needs a token an older step in flight computes: take them all first
            self.settle()
            feed, inputs = None, self._inputs(reply, None)
        token_ids, positions, computed, rows = inputs
        if not computed:
            return False
        # All greedy: the workers pick the tokens, and only their ids cross the wire.
        greedy = all(self._queues.group_of[seq.seq_id].request.params.temperature <= 0 for seq, _ in computed)
        if rows is not None and not greedy:
            self.settle()
            feed = None
            token_ids, positions, computed, rows = self._inputs(reply, None)
        step = StepInput.from_step_reply(reply, token_ids, positions, greedy=greedy, feedback_rows=rows,
                                         feedback_step=feed.step.step_id if rows is not None else 0)
        self._stats.tokens_computed += len(token_ids)
        self._stats.fed_steps += rows is not None
        submit = getattr(self.runner, "submit", None) if self.overlap else None
        started = time.perf_counter() if self.on_stage is not None else 0.0
        if submit is None:
            rows_out = self.runner(step)
            if self.on_stage is not None:
                self.on_stage("model", time.perf_counter() - started, step)
            self._outputs.take(computed, greedy, rows_out)
        else:
            self._steps.append(InFlight(submit(step), computed, greedy, step,
                                        frozenset(s.seq_id for s, _ in computed)))
            if self.on_stage is not None:
                self.on_stage("submit", time.perf_counter() - started, step)
        return True

    def _inputs(self, reply: pb.StepResponse, feed: Optional[InFlight]):
        """The step's batch inputs (``batch_inputs``), ``feed``'s rows naming the tokens it computes."""
        fed_row = {seq.seq_id: i for i, (seq, _) in enumerate(feed.computed)} if feed is not None else {}
        return batch_inputs(reply.batch, self._queues.seqs, fed_row)

    # ---- taking tokens -------------------------------------------------------------------------------
    def settle(self) -> bool:
        """Wait for every step in flight, oldest first, and take their tokens; whether there was any."""
        if not self._steps:
            return False
        while self._steps:
            self._take_oldest()
        return True

    def _take_oldest(self) -> None:
        """Wait for the oldest step in flight and take its tokens."""
        pending = self._steps.popleft()
        if self.on_stage is None:
            rows = pending.wait()
        else:
            started = time.perf_counter()
            rows = pending.wait()
            self.on_stage("wait", time.perf_counter() - started, pending.step)
        self._outputs.take(pending.computed, pending.greedy, rows)


def _may_copy_on_write(group: Group) -> bool:
    """Whether an append of ``group`` may copy a block on write: its samples, forked from the
    prompt, share the prompt's last (partly filled) block until each has appended its first
    token into its own copy; taken as done once every unfinished sample's cache holds more than
    the prompt (an answer still in flight keeps it True: the safe side). O(samples)."""
    if len(group.seqs) == 1:
        return False
    prompt = len(group.request.prompt)
    return any(seq.num_cached <= prompt for seq in group.unfinished())

