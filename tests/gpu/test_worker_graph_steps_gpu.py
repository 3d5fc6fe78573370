"""On a CUDA device: a worker's greedy decode steps replayed from CUDA graphs and fed from the
previous step's ids on the device, two launched before either is fetched (as the overlapped
scheduler sends them), give token for token what the same steps with their tokens given give.

The fed chain's ids are the graph's own argmax (``DecodeGraphs.last_ids``, no argmax launch
after the replay); the given chain runs on a second worker of the same weights, so both replay the same
graphs and agree bit for bit. The first step is an eager prefill, whose ids the first fed step
takes.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from kvpager.step import StepInput  # noqa: E402
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig  # noqa: E402
from kvpager.worker.model import ModelConfig  # noqa: E402

BLOCK = 16
WIDTH = 8   # blocks per sequence: contexts up to 128 tokens
PROMPTS = [[5, 17, 3], [9] * 20, [1, 2, 3, 4, 5, 6, 7], [300, 12], [44] * 33]


def worker() -> CacheWorker:
    model = ModelConfig(num_layers=2, hidden_size=256, num_q_heads=4, num_kv_heads=2, head_dim=64,
                        intermediate_size=512, vocab_size=512, seed=7)
    w = CacheWorker(WorkerConfig(model=model, block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=8,
                                 cuda_graph_max_batch=16))
    w.start()
    return w


def table(i: int) -> list[int]:
    return [1 + i * WIDTH + b for b in range(WIDTH)]


def slot(i: int, pos: int) -> int:
    return table(i)[pos // BLOCK] * BLOCK + pos % BLOCK


def prefill() -> StepInput:
    tokens = [t for p in PROMPTS for t in p]
    positions = [pos for p in PROMPTS for pos in range(len(p))]
    slots = [slot(i, pos) for i, p in enumerate(PROMPTS) for pos in range(len(p))]
    lens = [len(p) for p in PROMPTS]
    return StepInput(step_id=1, plan_step_id=0, token_ids=tokens, positions=positions, slot_mapping=slots,
                     query_lens=lens, context_lens=lens, block_tables=[b for i in range(len(PROMPTS)) for b in table(i)],
                     max_blocks=WIDTH, greedy=True)


def decode(step_id: int, lens: list[int], tokens: list[int] | None) -> StepInput:
    """Each sequence's next token (context ``lens[i]`` after it): given, or fed (None) from row i
    of step ``step_id - 1``'s ids."""
    n = len(lens)
    fed = tokens is None
    return StepInput(step_id=step_id, plan_step_id=0, token_ids=[0] * n if fed else tokens,
                     positions=[c - 1 for c in lens], slot_mapping=[slot(i, c - 1) for i, c in enumerate(lens)],
                     query_lens=[1] * n, context_lens=lens,
                     block_tables=[b for i in range(n) for b in table(i)],
                     max_blocks=WIDTH, greedy=True, feedback_rows=list(range(n)) if fed else None,
                     feedback_step=step_id - 1 if fed else 0)


def test_fed_graph_steps_equal_given_ones():
    fed_worker, given_worker = worker(), worker()
    try:
        assert fed_worker.graphs is not None, "this device should run decode steps as CUDA graphs"
        first = fed_worker.execute_model(prefill())
        assert torch.equal(given_worker.execute_model(prefill()), first)
        steps = 8
        lens = [[len(p) + k for p in PROMPTS] for k in range(1, steps + 1)]
        # Fed: step k + 2 takes its tokens from step k + 1's ids on the device; two in flight.
        fed_ids = []
        fed_worker.launch_model(decode(2, lens[0], None), 2)
        for k in range(1, steps):
            fed_worker.launch_model(decode(k + 2, lens[k], None), k + 2)
            fed_ids.append(fed_worker.fetch_output(k + 1))
        fed_ids.append(fed_worker.fetch_output(steps + 1))
        # Given: the same steps one by one, each with the previous step's ids as its tokens.
        previous = first
        for k in range(steps):
            ids = given_worker.execute_model(decode(k + 2, lens[k], previous.tolist()))
            assert torch.equal(ids, fed_ids[k]), f"step {k + 2}: fed {fed_ids[k].tolist()} != given {ids.tolist()}"
            previous = ids
        assert fed_worker.graphs.shapes == given_worker.graphs.shapes
    finally:
        fed_worker.stop()
        given_worker.stop()
