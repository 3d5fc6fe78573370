"""The step contract between scheduler and workers (``kvpager.step``): a worker runs a step only
after the swap/copy plan that step needs, whatever the order in which plans reach it.

Plans go through the worker's real gRPC service (ExecutePlan) on a loopback port; model steps
through ``CacheWorker.execute_model``, as a Ray actor or the in-process runner calls it. A
delayed, dropped or reordered plan makes the step fail with PlanNotApplied before any K/V is
written; once the plan arrives the same step runs, and its logits equal those of an
undisturbed worker.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from kvpager.step import PlanNotApplied, StepInput
from kvpager.v1 import plan_pb2, worker_pb2, worker_pb2_grpc
from kvpager.worker.block_plan import BlockMoves, BlockPlan
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.model import preset

BLOCK = 4


@pytest.fixture
def worker():
    w = CacheWorker(WorkerConfig(model=preset("tiny"), block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=8,
                                 device="cpu"))
    w.start()
    channel = grpc.insecure_channel(w.address)
    w.stub = worker_pb2_grpc.CacheWorkerStub(channel)
    yield w
    channel.close()
    w.stop()


def send_plan(w: CacheWorker, step_id: int, copy: tuple[list[int], list[int]] = ([], [])) -> None:
    plan = plan_pb2.ExecutionPlan(step_id=step_id, blocks_to_copy=plan_pb2.BlockMapping(src=copy[0], dst=copy[1]))
    w.stub.ExecutePlan(worker_pb2.ExecutePlanRequest(plan=plan), timeout=10)


def prefill(step_id: int, plan_step_id: int, tokens: list[int], table: list[int]) -> StepInput:
    """One sequence computing its whole prompt into the blocks of ``table``."""
    slots = [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(tokens))]
    return StepInput(step_id=step_id, plan_step_id=plan_step_id, token_ids=tokens, positions=list(range(len(tokens))),
                     slot_mapping=slots, query_lens=[len(tokens)], context_lens=[len(tokens)], block_tables=table,
                     max_blocks=len(table))


def test_a_delayed_plan_refuses_the_step_until_it_arrives(worker):
    before = worker.cache.blocks.clone()
    step = prefill(7, 7, [3, 1, 4, 1, 5, 9], [5, 2])
    with pytest.raises(PlanNotApplied, match="step 7 needs the swap/copy plan of step 7"):
        worker.execute_model(step)
    assert torch.equal(worker.cache.blocks, before), "a refused step wrote K/V"
    send_plan(worker, 7, copy=([9], [10]))  # the plan arrives late
    logits = worker.execute_model(step)
    assert logits.shape == (1, worker.config.model.vocab_size)


def test_a_dropped_plan_is_never_assumed(worker):
    send_plan(worker, 3, copy=([1], [2]))
    step = prefill(4, 4, [7, 7, 7], [6])  # plan 4 never arrives; plan 3 does not stand in for it
    for _ in range(2):
        with pytest.raises(PlanNotApplied, match="last applied plan: step 3"):
            worker.execute_model(step)


def test_reordered_plans_run_each_step_after_its_own(worker):
    reference = CacheWorker(WorkerConfig(model=preset("tiny"), block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=8,
                                         device="cpu"))
    reference.start()
    try:
        first = prefill(10, 0, [2, 7, 1, 8, 2, 8], [4, 11])
        second = StepInput(step_id=11, plan_step_id=11, token_ids=[5], positions=[6], slot_mapping=[11 * BLOCK + 2],
                           query_lens=[1], context_lens=[7], block_tables=[4, 11], max_blocks=2)
        expected_first = reference.execute_model(first)
        reference.execute_plan(11, BlockPlan(copy=BlockMoves([0], [1])))
        expected_second = reference.execute_model(second)

        send_plan(worker, 12, copy=([0], [3]))  # a later step's plan overtakes step 11's
        torch.testing.assert_close(worker.execute_model(first), expected_first, rtol=0, atol=0)  # needs no plan
        with pytest.raises(PlanNotApplied):
            worker.execute_model(second)
        send_plan(worker, 11, copy=([0], [1]))
        torch.testing.assert_close(worker.execute_model(second), expected_second, rtol=0, atol=0)
    finally:
        reference.stop()


@pytest.mark.parametrize("change, message", [
    (dict(positions=[0]), "positions"),
    (dict(query_lens=[2], context_lens=[2]), "add up"),
    (dict(block_tables=[1, 2, 3]), "not 1 rows of 2"),
    (dict(query_lens=[4], context_lens=[3]), "computes 4 tokens of a 3-token context"),
    (dict(token_ids=[1], positions=[0], slot_mapping=[4], query_lens=[1], context_lens=[0]),
     "computes 1 tokens of a 0-token context"),   # a decode step: past check's fast path
    # blocks and slots outside the worker's 16 blocks of 4 tokens
    (dict(block_tables=[1, 16]), r"row 0 names block 16, not a block of this cache \(0 to 15\)"),
    (dict(block_tables=np.array([1, -3], dtype="<i4")), "row 0 names block -3"),   # a packed table
    (dict(slot_mapping=[4, 5, 64, 7]), r"token 2 is written to slot 64, outside this cache's 64 slots"),
    (dict(slot_mapping=[-1, 5, 6, 7]), "token 0 is written to slot -1"),
    (dict(token_ids=[1, 2], positions=[3, 5], slot_mapping=[7, 9], query_lens=[1, 1], context_lens=[4, 6],
          block_tables=[1, 0, 2, 99]), "row 1 names block 99"),   # a decode step of two rows
])
def test_inconsistent_step_inputs_are_refused(worker, change, message):
    fields = dict(step_id=1, plan_step_id=0, token_ids=[1, 2, 3, 4], positions=[0, 1, 2, 3],
                  slot_mapping=[4, 5, 6, 7], query_lens=[4], context_lens=[4], block_tables=[1, 2], max_blocks=2)
    before = worker.cache.blocks.clone()
    with pytest.raises(ValueError, match=message):
        worker.execute_model(StepInput(**{**fields, **change}))
    assert torch.equal(worker.cache.blocks, before)
    logits = worker.execute_model(StepInput(**fields))   # the worker keeps serving
    assert logits.shape == (1, worker.config.model.vocab_size)


def test_fed_back_tokens_equal_sending_them(worker):
    """A step that takes its token from the previous greedy step's output on the worker
    (``feedback_rows``) computes what the same step with that token given computes; a step naming
    a previous step the worker did not run last is refused (FeedbackUnavailable) and writes nothing."""
    import dataclasses

    from kvpager.step import FeedbackUnavailable

    first = dataclasses.replace(prefill(1, 0, [3, 1, 4, 1, 5], [5, 2]), greedy=True)
    token = int(worker.execute_model(first)[0])
    given = StepInput(step_id=2, plan_step_id=0, token_ids=[token], positions=[5], slot_mapping=[2 * BLOCK + 1],
                      query_lens=[1], context_lens=[6], block_tables=[5, 2], max_blocks=2)
    fed = dataclasses.replace(given, token_ids=[0], feedback_rows=[0], feedback_step=1)
    expect = worker.execute_model(given)          # not greedy: the worker keeps no ids after it
    before = worker.cache.blocks.clone()
    with pytest.raises(FeedbackUnavailable, match="takes tokens from step 1's output"):
        worker.execute_model(fed)
    assert torch.equal(worker.cache.blocks, before), "a refused step wrote K/V"
    assert int(worker.execute_model(first)[0]) == token   # step 1 again: its ids are held now
    assert torch.equal(worker.execute_model(fed), expect)
    int(worker.execute_model(first)[0])
    before = worker.cache.blocks.clone()
    with pytest.raises(ValueError, match="row 1 of step 1's output, which has 1 rows"):
        worker.execute_model(dataclasses.replace(fed, feedback_rows=[1]))   # past the output's rows
    assert torch.equal(worker.cache.blocks, before), "a refused step wrote K/V"


def test_launched_steps_are_fetched_by_ticket_in_any_order(worker):
    """``launch_model`` then ``fetch_output`` is ``execute_model`` in two halves: two steps
    launched back to back (the second taking its token from the first's output on the worker, as
    an overlapped scheduler sends them) give, fetched in either order, what running them one by
    one gives; a refused launch keeps nothing, and its ticket fetches StepNotLaunched."""
    import dataclasses

    from kvpager.worker.launched_steps import StepNotLaunched

    first = dataclasses.replace(prefill(1, 0, [3, 1, 4, 1, 5], [5, 2]), greedy=True)
    token = int(worker.execute_model(first)[0])
    given = StepInput(step_id=2, plan_step_id=0, token_ids=[token], positions=[5], slot_mapping=[2 * BLOCK + 1],
                      query_lens=[1], context_lens=[6], block_tables=[5, 2], max_blocks=2, greedy=True)
    expect = worker.execute_model(given)
    fed = dataclasses.replace(given, token_ids=[0], feedback_rows=[0], feedback_step=1)
    worker.launch_model(first, "a")
    worker.launch_model(fed, "b")
    assert torch.equal(worker.fetch_output("b"), expect)
    assert int(worker.fetch_output("a")[0]) == token
    with pytest.raises(StepNotLaunched, match="ticket 'a'"):
        worker.fetch_output("a")      # fetched once only
    with pytest.raises(PlanNotApplied):
        worker.launch_model(prefill(9, 9, [1, 2], [3]), "c")
    with pytest.raises(StepNotLaunched, match="its launch failed"):
        worker.fetch_output("c")
    worker.launch_model(first, "d")
    before = worker.cache.blocks.clone()
    with pytest.raises(ValueError, match="launched twice"):
        worker.launch_model(dataclasses.replace(first, slot_mapping=[8, 9, 10, 11, 12]), "d")
    assert torch.equal(worker.cache.blocks, before), "a refused launch wrote K/V"


def test_steps_launched_and_never_fetched_are_dropped_oldest_first(worker):
    from kvpager.worker.launched_steps import LaunchedSteps, StepNotLaunched

    step = prefill(1, 0, [3, 1, 4], [5])
    for ticket in range(LaunchedSteps.KEPT + 2):
        worker.launch_model(step, ticket)
    for ticket in (0, 1):
        with pytest.raises(StepNotLaunched):
            worker.fetch_output(ticket)
    assert worker.fetch_output(LaunchedSteps.KEPT + 1).shape == (1, worker.config.model.vocab_size)


def test_a_plan_whose_sender_stopped_waiting_is_not_applied(worker):
    """A plan that waits in the worker past its deadline (the worker was busy or stopped, and the
    manager has rolled the step back): the worker answers DEADLINE_EXCEEDED and moves nothing,
    instead of copying into blocks that may have been given out again."""
    import threading
    import time

    before = worker.cache.blocks.clone()
    plan = plan_pb2.ExecutionPlan(step_id=11, blocks_to_copy=plan_pb2.BlockMapping(src=[1], dst=[2]))
    errors = []

    def send():
        try:
            worker.stub.ExecutePlan(worker_pb2.ExecutePlanRequest(plan=plan), timeout=0.3)
        except grpc.RpcError as err:
            errors.append(err.code())

    with worker._lock:   # busy (as a stopped process would be) until the deadline has passed
        sender = threading.Thread(target=send)
        sender.start()
        sender.join()
        time.sleep(0.2)
    time.sleep(0.3)   # the handler now gets the lock, finds the call gone, and applies nothing
    assert errors == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert torch.equal(worker.cache.blocks, before), "an expired plan moved blocks"
    assert worker.memory_stats().plans_executed == 0
    send_plan(worker, 12, copy=([1], [2]))    # a live plan still runs
    assert worker.memory_stats().plans_executed == 1
