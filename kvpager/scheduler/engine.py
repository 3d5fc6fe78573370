"""Continuous batching over the block manager (gRPC) and the workers (a ``runner`` callable).

Each iteration: frees finished sequences, appends every running sequence's last sampled
token, swaps preempted requests back in when room returns, admits waiting requests (their
prompts, with cached prefixes skipped, and ``n > 1`` samples forked from the prompt), all
in one ``Step``; the manager has the workers execute the step's swaps and copies before it
answers; then the runner computes the step's tokens and the scheduler samples. When the
next appends would not fit, the most recently admitted requests are preempted by swapping
them out in a step of their own first (blocks freed in a step are only reusable after it),
or, when the CPU pool is full too, freed and restarted from scratch.

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
so the GPU goes from step N to N+1 without waiting for this loop; the loop then takes the tokens
of the oldest step in flight only once ``PIPELINE_DEPTH`` (2) are out, so while it prepares step
N+2 the GPU has N+1 queued behind N. A step that needs a token no step in flight can feed (a
sequence that skipped a step) first takes every step in flight. Steps that may move blocks
(swap-ins, preemption, forked samples whose appends may copy on write) first wait for every step
in flight, so a plan never reaches the workers ahead of a step queued before it. The tokens are
those of the plain loop.

Workers lost (a Step answers UNAVAILABLE, or the runner raises WorkerDied): the K/V of every
live sequence may be gone, on the GPU and in the workers' CPU swap space alike. The scheduler
calls ``recover`` (if given) for a runner over replacement workers, waits until the manager
serves again, frees every live sequence and restarts each unfinished request from scratch
(its samples' seeds restart too, so the outputs are those an undisturbed run gives). A Step
that answers DATA_LOSS (a replaced worker group lost the sequences' K/V) is recovered the same way.
A restarted request's tokens are not streamed again (``on_token`` carries on after the last one
it had: greedy and seeded sampling recompute the same tokens).

Manager restarted (its Step cannot reach it): with ``--state-dir`` the manager recovers its
state, so the scheduler waits (pinging with backoff, up to ``recover_timeout``) and sends the
same Step again with the same request id: applied once, answered once, and the run carries on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from kvpager import client as C
from kvpager import errors
from kvpager.numeric import ceil_div
from kvpager.step import StepInput, WorkerDied
from kvpager.v1 import block_manager_pb2 as pb

from .batch_inputs import batch_inputs
from .manager_link import ManagerLink
from .request import Group, Request, RequestOutput, SeqState, sample

# Runs one step on the workers: for each sequence that computed tokens, the float32 logits of its
# last token, or (a greedy step) their argmax. A runner may also have ``submit(step)``, which
# starts the step and returns a callable that waits for and returns the same (overlap); the
# callable may have ``prefetch()``, asking for the result early without waiting.
Runner = Callable[[StepInput], torch.Tensor]
# Called for every sampled token: (request id, sample index, token id, finish reason or "").
TokenCallback = Callable[[str, int, int, str], None]
# Called as each timed stage of an iteration ends: (stage, seconds it took, the step it ran or None).
# Stages: "step_rpc" (a Step RPC's round trip, retries included; no step), "model" (a runner call
# that computed the step and returned its rows), "submit" (handing the step to a runner that
# computes it while the scheduler goes on: overlap), "wait" (waiting for a submitted step's rows).
# A submitted step's model time runs from its "submit" to the end of its "wait". For benchmarks
# and profilers (benchmarks/serving.py); the scheduler reads no clock for it when it is None.
StageCallback = Callable[[str, float, Optional[StepInput]], None]


@dataclass(slots=True)
class _InFlight:
    """A step the workers compute while the scheduler goes on (overlap)."""
    wait: Callable[[], torch.Tensor]          # returns the step's rows
    computed: list[tuple[SeqState, int]]      # (sequence, its context length after the step)
    greedy: bool
    step: StepInput                           # what the workers compute (its step_id: the manager's id)
    seq_ids: frozenset[str] = frozenset()     # of ``computed``: O(1) membership


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    tokens_computed: int = 0       # prompt + decode tokens the model ran
    tokens_generated: int = 0
    requests_finished: int = 0
    preemptions: int = 0           # groups swapped out
    restarts: int = 0              # groups freed and recomputed (no CPU room, or workers lost)
    recoveries: int = 0            # times workers were lost and the live requests restarted
    overlapped_steps: int = 0      # Step RPCs sent while the previous step computed (overlap)
    fed_steps: int = 0             # steps sent before the previous one's tokens came back (overlap)
    step_latencies: list[float] = field(default_factory=list)  # Step RPC round trips, seconds


class Scheduler:
    # Steps in flight at most (overlap with tokens fed back on the worker): the GPU computes one
    # while the next waits behind it, and this loop prepares the one after.
    PIPELINE_DEPTH = 2

    def __init__(self, client: C.BlockManagerClient, runner: Runner, block_size: int,
                 max_batch_tokens: int = 4096, on_step: Optional[Callable[["Scheduler"], None]] = None,
                 recover: Optional[Callable[[], Runner]] = None, recover_timeout: float = 60.0,
                 on_token: Optional[TokenCallback] = None, max_model_len: Optional[int] = None,
                 overlap: bool = False, on_stage: Optional[StageCallback] = None) -> None:
        """``on_token``: streaming, called for each token as it is sampled; ``max_model_len``: the
        longest sequence (prompt + new tokens) the model serves; longer requests are refused;
        ``overlap``: run each Step RPC while the previous step computes (module docstring),
        where the runner can (``submit``); ``on_stage``: told how long each stage of an
        iteration took (``StageCallback``)."""
        self.client = client
        self.on_token = on_token
        self.on_stage = on_stage
        self.max_model_len = max_model_len
        self.runner = runner
        self.overlap = overlap
        # Steps in flight, oldest first (overlap only): their tokens are not taken yet.
        self._steps_in_flight: deque[_InFlight] = deque()
        self.recover = recover
        self.recover_timeout = recover_timeout
        self._link = ManagerLink(client)
        self._in_flight: list[Group] = []   # groups out of every queue while a Step is on the wire
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.on_step = on_step
        self.stats = SchedulerStats()
        self.waiting: deque[Group] = deque()
        self.running: list[Group] = []
        self.swapped: deque[Group] = deque()
        self.outputs: dict[str, RequestOutput] = {}
        self._seqs: dict[str, SeqState] = {}
        self._group_of: dict[str, Group] = {}
        self._to_free: list[SeqState] = []
        stats = client.get_stats()
        self._available = stats.gpu.free_blocks + stats.gpu.cached_blocks
        self._reserve = stats.watermark_blocks

    def add(self, request: Request) -> None:
        """Queue a request; ValueError (nothing queued) when it cannot be served."""
        if not request.prompt:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        total = len(request.prompt) + request.params.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: {len(request.prompt)} prompt tokens + "
                             f"{request.params.max_new_tokens} new tokens exceed the model's context of "
                             f"{self.max_model_len} tokens")
        self.waiting.append(self._new_group(request))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._to_free or self._steps_in_flight)

    def run(self, requests: Iterable[Request] = ()) -> dict[str, RequestOutput]:
        for request in requests:
            self.add(request)
        idle = 0
        while self.has_work:
            idle = 0 if self.step() else idle + 1
            if idle > 3:
                raise RuntimeError("no progress: the GPU pool is too small for the requests that remain")
        return self.outputs

    # ---- one iteration ------------------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration; returns whether any token was computed."""
        try:
            return self._iterate()
        except (errors.Unavailable, WorkerDied, errors.DataLoss):  # DataLoss: a replaced worker group lost our K/V
            self._restart_after_worker_loss()
            return False

    def _iterate(self) -> bool:
        if self._steps_in_flight and not self._may_overlap():
            self._settle()
        if len(self._steps_in_flight) >= self.PIPELINE_DEPTH:
            # Its tokens are taken after this iteration's launch: ask for them now, so that the
            # workers answer while the Step RPC runs instead of after that launch.
            prefetch = getattr(self._steps_in_flight[0].wait, "prefetch", None)
            if prefetch is not None:
                prefetch()
        self._preempt_if_short()
        ops, handlers = [], []

        def add(op: pb.Operation, handler) -> None:
            ops.append(op)
            handlers.append(handler)

        freeing = len(self._to_free)     # dropped from the list once the Step has applied them
        for seq in self._to_free:
            add(C.free_op(seq.seq_id), None)
        in_flight = bool(self._steps_in_flight)
        decoding = [seq for group in self.running for seq in group.seqs
                    if not seq.finish_reason and not self._ends_in_flight(seq, group)]
        if decoding:   # in flight: step N's tokens are not known yet, so the appends reserve slots only
            tokens = [] if in_flight else [s.next_token for s in decoding]
            add(C.append_batch_op([s.seq_id for s in decoding], tokens), self._appended)
        room = self._room()
        while self.swapped and not in_flight and self._blocks(self.swapped[0]) <= room:
            group = self.swapped.popleft()
            self._in_flight.append(group)
            room -= self._blocks(group)
            add(C.swap_in_op([s.seq_id for s in group.unfinished()]), self._placed(group, self.swapped))
        budget = self.max_batch_tokens
        while self.waiting and not self.swapped:
            group = self.waiting[0]
            prompt, n = group.request.prompt, group.request.params.n
            need = ceil_div(len(prompt), self.block_size) + (n - 1)
            if need > room or (len(prompt) > budget and budget < self.max_batch_tokens):
                break
            self.waiting.popleft()
            self._in_flight.append(group)
            room, budget = room - need, budget - len(prompt)
            parent = group.seqs[0]
            add(C.allocate_op(parent.seq_id, prompt, namespace=group.request.namespace),
                self._placed(group, self.waiting))
            for child in group.seqs[1:]:
                add(C.fork_op(parent.seq_id, child.seq_id), None)

        reply = self._step(ops)
        self._in_flight.clear()
        del self._to_free[:freeing]
        if in_flight and _moves_blocks(reply):
            raise RuntimeError(f"step {reply.step_id} moved blocks while step of the previous iteration was in "
                               "flight: the scheduler's overlap rule missed a case (a bug)")
        for result, handler in zip(reply.results, handlers):
            err = C.result_error(result)
            if handler is not None:
                handler(result, err)
            elif err is not None:
                raise err  # a fork or free the scheduler believed valid
        # The newest step in flight's greedy tokens can feed this one on the worker (device-side):
        # send it before they come back, so the GPU goes from one step to the next without this
        # loop; then take the tokens of the oldest steps, keeping PIPELINE_DEPTH in flight.
        feed = self._steps_in_flight[-1] if self._may_feed() else None
        if feed is None:
            settled = self._settle()
            return self._launch(reply) or settled
        if not self._launch(reply, feed):
            return self._settle()
        while len(self._steps_in_flight) > self.PIPELINE_DEPTH:
            self._take_oldest()
        return True

    def _may_feed(self) -> bool:
        """Whether the next step may go out before the one in flight returns: both greedy (the
        worker keeps the argmax on the device) and a runner that feeds tokens back (one rank)."""
        pending = self._steps_in_flight[-1] if self._steps_in_flight else None
        return (pending is not None and pending.greedy and getattr(self.runner, "feeds_back", False)
                and all(group.request.params.temperature <= 0 for group in self.running))

    def _may_overlap(self) -> bool:
        """Whether the next Step may go out while a step is in flight: it moves no blocks (no
        swapped group has room to come back in this step, and no running group has forked samples
        whose appends may copy on write); preemption settles on its own (``_preempt_if_short``).
        A swapped group that does not fit yet waits while steps overlap. O(running groups)."""
        if self.swapped and self._blocks(self.swapped[0]) <= self._room():
            return False
        return all(len(group.seqs) == 1 for group in self.running)

    def _ends_in_flight(self, seq: SeqState, group: Group) -> bool:
        """The steps in flight give this sequence its last token (its limit), so it needs no
        slot. O(1) unless it is that close to its limit, then O(steps in flight)."""
        left = group.request.params.max_new_tokens - seq.num_generated
        if left > len(self._steps_in_flight):
            return False
        return sum(seq.seq_id in p.seq_ids for p in self._steps_in_flight) >= left

    def _launch(self, reply: pb.StepResponse, feed: Optional[_InFlight] = None) -> bool:
        """Start the model on the tokens of the step's batch (its tables as the manager sent them);
        with overlap leave it in flight, else wait for it and take its tokens. Rows of sequences
        that already finished (a stop token in a step before) compute a token that is dropped.
        ``feed``: the newest step in flight, whose greedy tokens this step may take on the worker;
        when it cannot (a token it does not compute is unknown, or this step samples), every
        step in flight is taken first. O(S + T)."""
        inputs = self._inputs(reply, feed)
        if inputs is None:   # needs a token an older step in flight computes: take them all first
            self._settle()
            feed, inputs = None, self._inputs(reply, None)
        token_ids, positions, computed, rows = inputs
        if not computed:
            return False
        # All greedy: the workers pick the tokens, and only their ids cross the wire.
        greedy = all(self._group_of[seq.seq_id].request.params.temperature <= 0 for seq, _ in computed)
        if rows is not None and not greedy:
            self._settle()
            feed = None
            token_ids, positions, computed, rows = self._inputs(reply, None)
        step = StepInput.from_step_reply(reply, token_ids, positions, greedy=greedy, feedback_rows=rows,
                                         feedback_step=feed.step.step_id if rows is not None else 0)
        self.stats.tokens_computed += len(token_ids)
        self.stats.fed_steps += rows is not None
        submit = getattr(self.runner, "submit", None) if self.overlap else None
        started = time.perf_counter() if self.on_stage is not None else 0.0
        if submit is None:
            rows_out = self.runner(step)
            if self.on_stage is not None:
                self.on_stage("model", time.perf_counter() - started, step)
            self._take(computed, greedy, rows_out)
        else:
            self._steps_in_flight.append(_InFlight(submit(step), computed, greedy, step,
                                                   frozenset(s.seq_id for s, _ in computed)))
            if self.on_stage is not None:
                self.on_stage("submit", time.perf_counter() - started, step)
        return True

    def _inputs(self, reply: pb.StepResponse, feed: Optional[_InFlight]):
        """The step's batch inputs (``batch_inputs``), ``feed``'s rows naming the tokens it computes."""
        fed_row = {seq.seq_id: i for i, (seq, _) in enumerate(feed.computed)} if feed is not None else {}
        return batch_inputs(reply.batch, self._seqs, fed_row)

    def _settle(self) -> bool:
        """Wait for every step in flight, oldest first, and take their tokens; whether there was any."""
        if not self._steps_in_flight:
            return False
        while self._steps_in_flight:
            self._take_oldest()
        return True

    def _take_oldest(self) -> None:
        """Wait for the oldest step in flight and take its tokens."""
        pending = self._steps_in_flight.popleft()
        if self.on_stage is None:
            rows = pending.wait()
        else:
            started = time.perf_counter()
            rows = pending.wait()
            self.on_stage("wait", time.perf_counter() - started, pending.step)
        self._take(pending.computed, pending.greedy, rows)

    def _take(self, computed: list[tuple[SeqState, int]], greedy: bool, rows: torch.Tensor) -> None:
        """Emit each computed sequence's token(s). O(S) (greedy ids leave the tensor in one call)."""
        for (seq, ctx), row in zip(computed, rows.tolist() if greedy else rows):
            seq.num_cached = ctx
            if seq.finish_reason:      # finished while this step was in flight: its token is dropped
                continue
            group = self._group_of[seq.seq_id]
            # A prompt just computed gives the first token of every sample of its request.
            targets = group.seqs if ctx == len(group.request.prompt) and seq is group.seqs[0] else [seq]
            for target in targets:
                target.num_cached = ctx
                token = row if greedy else sample(row, group.request.params, target.generator)
                self._emit(group, target, token)

    # ---- results of operations -------------------------------------------------------------------------
    @staticmethod
    def _appended(result: pb.OperationResult, err: Optional[errors.ManagerError]) -> None:
        # A sequence whose append found no room simply waits (preemption makes room).
        for _, failure in C.batch_failures(result):
            if not isinstance(failure, errors.ResourceExhausted):
                raise failure
        if err is not None:
            raise err

    def _placed(self, group: Group, retry: deque[Group]):
        """The handler of a group's admission or swap-in: running once the manager placed it; back
        at the front of ``retry`` (the waiting or the swapped queue) when it found no room."""
        def handle(result: pb.OperationResult, err: Optional[errors.ManagerError]) -> None:
            if err is None:
                self.running.append(group)
            elif isinstance(err, errors.ResourceExhausted):
                retry.appendleft(group)  # try again when room returns
            else:
                raise err
        return handle

    def _emit(self, group: Group, seq: SeqState, token: int) -> None:
        params = group.request.params
        seq.tokens.append(token)
        seq.num_generated += 1
        self.stats.tokens_generated += 1
        if token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif seq.num_generated == params.max_new_tokens:
            seq.finish_reason = "length"
        if self.on_token is not None and (seq.num_generated > seq.streamed or seq.finish_reason):
            # A restarted request recomputes its tokens (the same ones, greedy or seeded): the
            # stream carries on where it was instead of repeating them.
            self.on_token(group.request.request_id, group.seqs.index(seq), token, seq.finish_reason)
        if seq.finish_reason:
            self._to_free.append(seq)
            if group.done:
                self.running.remove(group)
                self.stats.requests_finished += 1
                prompt_len = len(group.request.prompt)
                self.outputs[group.request.request_id] = RequestOutput(
                    group.request.request_id, [s.tokens[prompt_len:] for s in group.seqs],
                    [s.finish_reason for s in group.seqs])

    # ---- losing the workers ----------------------------------------------------------------------------
    def _restart_after_worker_loss(self) -> None:
        """Free every sequence the manager holds for us and queue each unfinished request again
        from scratch, ahead of the waiting ones (module docstring)."""
        self.stats.recoveries += 1
        self._steps_in_flight.clear()   # their workers are gone; their groups restart below
        if self.recover is not None:
            self.runner = self.recover()
        self._link.wait_until_serving(self.recover_timeout)
        # Every group the manager may hold: running, swapped, and those a failed Step carried
        # (an admission the manager never applied frees as NOT_FOUND, which is fine).
        groups = list(dict.fromkeys([*self._in_flight, *self.running, *self.swapped]))
        seq_ids = [s.seq_id for g in groups for s in g.seqs] + [s.seq_id for s in self._to_free]
        reply = self._step([C.free_op(i) for i in dict.fromkeys(seq_ids)])
        for result in reply.results:
            err = C.result_error(result)
            if err is not None and not isinstance(err, errors.NotFound):
                raise err
        unfinished = [g for g in groups if g.request.request_id not in self.outputs]
        self.waiting.extendleft(self._new_group(g.request, g) for g in reversed(unfinished))
        self.stats.restarts += len(unfinished)
        self.running.clear()
        self.swapped.clear()
        self._to_free.clear()
        self._in_flight.clear()

    # ---- preemption ------------------------------------------------------------------------------------
    def _preempt_if_short(self) -> None:
        while self._short():
            self._settle()   # a swap-out must not reach the workers ahead of the step in flight
            if not self._short():
                break
            victim = self.running.pop()
            live = victim.unfinished()
            self._in_flight.append(victim)
            reply = self._step([C.swap_out_op([s.seq_id for s in live])])
            self._in_flight.clear()
            err = C.result_error(reply.results[0])
            if err is None:
                self.swapped.append(victim)
                self.stats.preemptions += 1
            elif isinstance(err, (errors.ResourceExhausted, errors.OutOfRange)):
                finished = [s for s in self._to_free if s in victim.seqs]
                self._to_free = [s for s in self._to_free if s not in victim.seqs]
                self._step([C.free_op(s.seq_id) for s in live + finished])  # no CPU room: recompute later
                self.waiting.appendleft(self._new_group(victim.request, victim))
                self.stats.restarts += 1
            else:
                raise err

    def _short(self) -> bool:
        """The running groups' next appends may not fit, and one of them can make room by leaving."""
        return self._append_need() > self._available and len(self.running) > 1

    def _room(self) -> int:
        """GPU blocks this step may still give to swap-ins and admissions: those free or evictable
        above the manager's watermark reserve (its admission check, ``manager/state.py`` ``_admit``,
        mirrored so that a step asks only for what it will be given), after the running groups'
        next appends. The one place the scheduler applies the watermark. O(running groups)."""
        return self._available - self._reserve - self._append_need()

    def _append_need(self) -> int:
        """Blocks the next appends may take: a new block at each block boundary, and a
        copy-on-write block for samples that may still share a partial last block."""
        need, B = 0, self.block_size
        for group in self.running:
            seqs = group.seqs
            if len(seqs) == 1:   # the common case, without building a list
                need += not seqs[0].finish_reason and seqs[0].num_cached % B == 0
                continue
            live = group.unfinished()
            if len(live) == 1:
                need += live[0].num_cached % B == 0
            else:
                need += len(live)
        return need

    def _blocks(self, group: Group) -> int:
        """GPU blocks the group's live samples hold once swapped back in, with room for their next
        token. Samples forked from one prompt share its full blocks: counted once."""
        B = self.block_size
        shared = len(group.request.prompt) // B if len(group.seqs) > 1 else 0
        return shared + sum(ceil_div(s.num_cached + 1, B) - shared for s in group.unfinished())

    # ---- plumbing ---------------------------------------------------------------------------------------
    def _step(self, ops: list[pb.Operation]) -> pb.StepResponse:
        """One Step RPC, asking for the padded block tables only (all that ``StepInput`` reads), packed:
        the cheapest form on both sides (docs/performance.md, "Step RPC for a decode batch")."""
        self.stats.overlapped_steps += bool(self._steps_in_flight)
        started = time.perf_counter()
        reply = self._link.step(ops, self.recover_timeout)
        took = time.perf_counter() - started
        self.stats.step_latencies.append(took)
        if self.on_stage is not None:
            self.on_stage("step_rpc", took, None)
        self.stats.steps += 1
        self._available = reply.gpu_blocks_available
        if self.on_step is not None:
            self.on_step(self)
        return reply

    def _new_group(self, request: Request, previous: Optional[Group] = None) -> Group:
        """The request's sequences, from its prompt; ``previous``: the group it restarts, whose
        streamed tokens are not streamed again."""
        params = request.params
        group = Group(request)
        for i in range(params.n):
            seq_id = request.request_id if i == 0 else f"{request.request_id}#{i}"
            generator = None
            if params.temperature > 0:
                generator = torch.Generator().manual_seed((params.seed or 0) * 1000003 + i)
            streamed = 0
            if previous is not None:
                old = previous.seqs[i]
                streamed = max(old.streamed, old.num_generated)
            seq = SeqState(seq_id, list(request.prompt), generator=generator, streamed=streamed)
            group.seqs.append(seq)
            self._seqs[seq_id] = seq
        for seq in group.seqs:
            self._group_of[seq.seq_id] = group
        return group


def _moves_blocks(reply: pb.StepResponse) -> bool:
    plan = reply.plan
    return bool(plan.blocks_to_swap_out.src or plan.blocks_to_swap_in.src or plan.blocks_to_copy.src)
