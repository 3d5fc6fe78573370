"""Continuous batching over the block manager (gRPC) and the workers (a ``runner`` callable).

Each iteration sends one ``Step``: it frees finished sequences, appends every running
sequence's last sampled token, swaps preempted requests back in when room returns and admits
waiting requests (their prompts, with cached prefixes skipped, and ``n > 1`` samples forked from
the prompt); when the next appends would not fit, requests are first preempted in Steps of
their own (``queues.py``: the queues, admission and preemption). The manager has the workers
execute the step's swaps and copies before it answers; then the runner computes the step's
tokens (``pipeline.py``; with ``overlap``, while the next iteration's Step RPC runs), and the
scheduler samples them and finishes the requests they end (``outputs.py``).

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
same Step again with the same request id: applied once, answered once, and the run carries on
(``manager_link.py``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable, Optional

from kvpager import client as C
from kvpager import errors
from kvpager.step import WorkerDied
from kvpager.v1 import block_manager_pb2 as pb

from .manager_link import ManagerLink
from .outputs import OutputCollector, TokenCallback
from .pipeline import Runner, StageCallback, StepPipeline
from .queues import RequestQueues, ResultHandler
from .request import Group, Request, RequestOutput
from .stats import SchedulerStats

__all__ = ["Runner", "Scheduler", "SchedulerStats", "StageCallback", "TokenCallback"]


class Scheduler:
    """Serves requests (``add``, then ``step`` or ``run``) by the loop of the module docstring;
    one thread drives it."""

    PIPELINE_DEPTH = StepPipeline.PIPELINE_DEPTH

    def __init__(self, client: C.BlockManagerClient, runner: Runner, block_size: int,
                 max_batch_tokens: int = 4096, on_step: Optional[Callable[["Scheduler"], None]] = None,
                 recover: Optional[Callable[[], Runner]] = None, recover_timeout: float = 60.0,
                 on_token: Optional[TokenCallback] = None, max_model_len: Optional[int] = None,
                 overlap: bool = False, on_stage: Optional[StageCallback] = None) -> None:
        """``on_token``: streaming, called for each token as it is sampled; ``max_model_len``: the
        longest sequence (prompt + new tokens) the model serves; longer requests are refused;
        ``overlap``: run each Step RPC while the previous step computes (``pipeline.py``),
        where the runner can (``submit``); ``on_stage``: told how long each stage of an
        iteration took (``StageCallback``)."""
        self.client = client
        self.on_stage = on_stage
        self.max_model_len = max_model_len
        self.recover = recover
        self.recover_timeout = recover_timeout
        self._link = ManagerLink(client)
        self.on_step = on_step
        self.stats = SchedulerStats()
        stats = client.get_stats()
        self._queues = RequestQueues(block_size, max_batch_tokens,
                                     available=stats.gpu.free_blocks + stats.gpu.cached_blocks,
                                     reserve=stats.watermark_blocks)
        self._outputs = OutputCollector(self._queues, self.stats, on_token)
        self.outputs: dict[str, RequestOutput] = self._outputs.finished
        self._pipeline = StepPipeline(runner, self._queues, self._outputs, self.stats, overlap, on_stage)

    @property
    def waiting(self) -> deque[Group]:
        return self._queues.waiting

    @property
    def running(self) -> list[Group]:
        return self._queues.running

    @property
    def swapped(self) -> deque[Group]:
        return self._queues.swapped

    @property
    def runner(self) -> Runner:
        return self._pipeline.runner

    @runner.setter
    def runner(self, runner: Runner) -> None:
        self._pipeline.runner = runner

    def add(self, request: Request) -> None:
        """Queue a request; ValueError (nothing queued) when it cannot be served."""
        if not request.prompt:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        total = len(request.prompt) + request.params.max_new_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: {len(request.prompt)} prompt tokens + "
                             f"{request.params.max_new_tokens} new tokens exceed the model's context of "
                             f"{self.max_model_len} tokens")
        self._queues.waiting.append(self._queues.new_group(request))

    @property
    def has_work(self) -> bool:
        queues = self._queues
        return bool(queues.waiting or queues.running or queues.swapped or queues.to_free or self._pipeline)

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
        queues, pipeline = self._queues, self._pipeline
        if pipeline and not pipeline.may_overlap():
            pipeline.settle()
        pipeline.prefetch_oldest()
        self._preempt_if_short()
        ops: list[pb.Operation] = []
        handlers: list[Optional[ResultHandler]] = []

        def add(op: pb.Operation, handler: Optional[ResultHandler]) -> None:
            ops.append(op)
            handlers.append(handler)

        freeing = len(queues.to_free)     # dropped from the list once the Step has applied them
        for seq in queues.to_free:
            add(C.free_op(seq.seq_id), None)
        in_flight = bool(pipeline)
        decoding = [seq for group in queues.running for seq in group.seqs
                    if not seq.finish_reason and not pipeline.ends_in_flight(seq, group)]
        if decoding:   # in flight: step N's tokens are not known yet, so the appends reserve slots only
            tokens = [] if in_flight else [s.next_token for s in decoding]
            add(C.append_batch_op([s.seq_id for s in decoding], tokens), self._appended)
        queues.schedule(add, swap_in=not in_flight)

        reply = self._step(ops)
        del queues.to_free[:freeing]
        if in_flight and _moves_blocks(reply):
            raise RuntimeError(f"step {reply.step_id} moved blocks while step of the previous iteration was in "
                               "flight: the scheduler's overlap rule missed a case (a bug)")
        for result, handler in zip(reply.results, handlers):
            err = C.result_error(result)
            if handler is not None:
                handler(result, err)
            elif err is not None:
                raise err  # a free the scheduler believed valid
        # Only now: a handler raising (a lost worker's DATA_LOSS) leaves the Step's groups where
        # the recovery (restart_all) finds them.
        queues.on_wire.clear()
        return pipeline.compute(reply)

    def _appended(self, result: pb.OperationResult, err: Optional[errors.ManagerError]) -> None:
        """The handler of the step's appends: a sequence whose append found no room simply waits,
        and the next iteration preempts a group to make room (``RequestQueues.short``), even when
        the pool looked roomy: a tenant's quota may be what refused it; any other failure raises."""
        refused = False
        for _, failure in C.batch_failures(result):
            if not isinstance(failure, errors.ResourceExhausted):
                raise failure
            refused = True
        if err is not None:
            raise err
        self._queues.appends_refused = refused

    def _preempt_if_short(self) -> None:
        while self._queues.short():
            self._pipeline.settle()   # a swap-out must not reach the workers ahead of the step in flight
            if not self._queues.short():
                break
            if self._queues.preempt(self._step):
                self.stats.preemptions += 1
            else:
                self.stats.restarts += 1

    # ---- losing the workers ----------------------------------------------------------------------------
    def _restart_after_worker_loss(self) -> None:
        """Free every sequence the manager holds for us and queue each unfinished request again
        from scratch, ahead of the waiting ones (module docstring)."""
        self.stats.recoveries += 1
        self._pipeline.clear()   # their workers are gone; their groups restart below
        if self.recover is not None:
            self.runner = self.recover()
        self._link.wait_until_serving(self.recover_timeout)
        self.stats.restarts += self._queues.restart_all(self._step, self.outputs)

    # ---- plumbing ---------------------------------------------------------------------------------------
    def _step(self, ops: list[pb.Operation]) -> pb.StepResponse:
        """One Step RPC, asking for the padded block tables only (all that ``StepInput`` reads), packed:
        the cheapest form on both sides (docs/performance.md, "Step RPC for a decode batch")."""
        self.stats.overlapped_steps += bool(self._pipeline)
        started = time.perf_counter()
        reply = self._link.step(ops, self.recover_timeout)
        took = time.perf_counter() - started
        self.stats.step_latencies.append(took)
        if self.on_stage is not None:
            self.on_stage("step_rpc", took, None)
        self.stats.steps += 1
        self._queues.available = reply.gpu_blocks_available
        if self.on_step is not None:
            self.on_step(self)
        return reply




def _moves_blocks(reply: pb.StepResponse) -> bool:
    plan = reply.plan
    return bool(plan.blocks_to_swap_out.src or plan.blocks_to_swap_in.src or plan.blocks_to_copy.src)
