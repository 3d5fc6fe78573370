"""On a CUDA device: decode steps replayed from CUDA graphs (``worker.decode_graphs``) give what
the eager path gives, on random weights, random ragged contexts and shuffled block tables.

Each case runs the same step twice, eagerly over one copy of the cache and from a graph over
another: the logits and greedy tokens agree (the same kernels on the same data; only the GEMMs'
padded batch may pick other cuBLAS kernels, so bf16 agrees within rounding), the K/V each wrote
agree, and no block outside the step's tables changed (padding rows write nothing). Steps reuse
a captured shape with fewer sequences and narrower tables than the last (stale buffers), follow
a copy-on-write plan (the replay waits for it), and serve fp8 caches.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from kvpager.numeric import ceil_div  # noqa: E402
from kvpager.step import StepInput  # noqa: E402
from kvpager.worker.block_plan import BlockMoves, BlockPlan  # noqa: E402
from kvpager.worker.decode_graphs import DecodeGraphs, supported  # noqa: E402
from kvpager.worker.hf_config import PRESETS  # noqa: E402
from kvpager.worker.kv_cache import CacheSpec, KVCache  # noqa: E402
from kvpager.worker.model import Decoder  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 16000
SHAPES = {"d64": dict(head_dim=64), "d128": dict(head_dim=128, num_q_heads=8, num_kv_heads=2, hidden_size=512)}


def make(head: str, kv_cache_dtype: str = "auto"):
    cfg = replace(PRESETS["small"], dtype="bfloat16", num_layers=3, vocab_size=1000, max_model_len=4096,
                  kv_cache_dtype=kv_cache_dtype, kv_scale=0.05 if kv_cache_dtype != "auto" else 1.0,
                  **SHAPES[head])
    model = Decoder(cfg, device="cuda")
    spec = CacheSpec(cfg.num_layers, model.kv_heads, cfg.head_dim, BLOCK, cfg.cache_dtype)
    cache = KVCache(spec, NUM_BLOCKS, 4, "cuda")
    torch.manual_seed(0)
    cache.blocks.copy_((torch.randn(cache.blocks.shape, device="cuda") * 0.5).to(cache.blocks.dtype))
    return model, cache


def make_pair(head: str, kv_cache_dtype: str = "auto"):
    """The model, a cache for eager steps and a copy of it for graph steps (same random contents)."""
    model, eager_cache = make(head, kv_cache_dtype)
    _, graph_cache = make(head, kv_cache_dtype)
    graph_cache.blocks.copy_(eager_cache.blocks)
    return model, eager_cache, graph_cache


def random_step(rng: random.Random, model: Decoder, lens: list[int], step_id: int) -> tuple[StepInput, set[int]]:
    """A decode step over ``lens`` (each context including its new token) with shuffled tables
    padded to the widest row plus a few extra columns; returns it and the blocks it owns."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    width = max(ceil_div(n, BLOCK) for n in lens) + rng.randrange(3)
    rows, owned = [], set()
    for n in lens:
        row = [free.pop() for _ in range(ceil_div(n, BLOCK))]
        owned.update(row)
        rows.append(row + [rng.randrange(NUM_BLOCKS)] * (width - len(row)))   # padding: never read
    step = StepInput(step_id=step_id, plan_step_id=0, token_ids=[rng.randrange(model.cfg.vocab_size) for _ in lens],
                     positions=[n - 1 for n in lens],
                     slot_mapping=[r[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for r, n in zip(rows, lens)],
                     query_lens=[1] * len(lens), context_lens=lens, block_tables=[b for r in rows for b in r],
                     max_blocks=width, greedy=True)
    return step, owned


def compare(model: Decoder, eager_cache: KVCache, graph_cache: KVCache, graphs: DecodeGraphs, step: StepInput,
            owned: set[int], cache_tol: float = 0.05) -> None:
    """``cache_tol``: the K/V both paths wrote agree within this share of the cache's largest
    value (an fp8 cache may round one element to the neighbouring code)."""
    before = graph_cache.blocks.clone()
    want = model.forward_paged(step, eager_cache.layer)
    got = graphs.run(step)
    torch.cuda.synchronize()
    assert got.shape == want.shape == (step.num_seqs, model.cfg.vocab_size)
    scale = want.std().item()
    assert (got - want).abs().max().item() <= 0.05 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95   # bf16 near-ties may flip
    assert torch.equal(graphs.last_ids(step.num_seqs), got.argmax(-1))   # the graph's own argmax
    untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)
    untouched[sorted(owned)] = False
    assert torch.equal(graph_cache.blocks[untouched], before[untouched]), "a graph step wrote outside its tables"
    written = graph_cache.blocks.float() - eager_cache.blocks.float()
    assert written.abs().max().item() <= cache_tol * max(1.0, eager_cache.blocks.float().abs().max().item())


@pytest.mark.parametrize("head", sorted(SHAPES))
def test_graph_steps_match_eager_steps(head):
    model, eager_cache, graph_cache = make_pair(head)
    assert supported(model, graph_cache) is None
    graphs = DecodeGraphs(model, graph_cache, max_batch=128, max_blocks=4096 // BLOCK)
    rng = random.Random(1)
    # Sizes that land in the middle and at the edge of buckets, a shape reused with fewer
    # sequences and a narrower table than its last step, and one wider table.
    for step_id, (batch, longest) in enumerate([(1, 40), (3, 700), (64, 1500), (50, 300), (100, 2500),
                                                (128, 2000), (7, 33)], start=1):
        lens = [rng.randint(1, longest) for _ in range(batch)]
        step, owned = random_step(rng, model, lens, step_id)
        if step_id % 2:   # the packed reply's tables: an int32 array (StepInput.from_step_reply)
            step = replace(step, block_tables=np.asarray(step.block_tables, dtype=np.int32))
        assert graphs.serves(step)
        compare(model, eager_cache, graph_cache, graphs, step, owned)
    if graphs._planner is not None:   # a work list: one graph per batch bucket, over the full width
        assert {b for b, _ in graphs.shapes} == {1, 4, 8, 64, 112, 128} and {w for _, w in graphs.shapes} == {256}
    else:                             # the per-call grid: a graph per (batch, width) bucket
        assert (64, 128) in graphs.shapes and (64, 32) in graphs.shapes
    # A step over the batch limit is not taken (the worker runs it eagerly).
    big, _ = random_step(rng, model, [10] * 129, 99)
    assert not graphs.serves(big)


def test_graph_steps_without_a_work_list(monkeypatch):
    """KVPAGER_DECODE_WORK_LIST=0: the per-call grid inside graphs of (batch, width) buckets, the
    tables copied into rows of the graph's width."""
    monkeypatch.setenv("KVPAGER_DECODE_WORK_LIST", "0")
    model, eager_cache, graph_cache = make_pair("d128")
    graphs = DecodeGraphs(model, graph_cache, max_batch=64, max_blocks=256)
    assert graphs._planner is None
    rng = random.Random(5)
    for step_id, (batch, longest) in enumerate([(20, 900), (33, 3000), (9, 200)], start=1):
        step, owned = random_step(rng, model, [rng.randint(1, longest) for _ in range(batch)], step_id)
        compare(model, eager_cache, graph_cache, graphs, step, owned)


def test_graph_step_waits_for_the_copy_plan():
    """A copy-on-write plan enqueued on the cache's swap stream right before the step: the
    replay reads the copied block (as the eager path does), not what was there before."""
    model, eager_cache, graph_cache = make_pair("d128")
    graphs = DecodeGraphs(model, graph_cache, max_batch=32, max_blocks=256)
    rng = random.Random(2)
    lens = [rng.randint(20, 900) for _ in range(20)]
    step, owned = random_step(rng, model, lens, 1)
    graphs.run(step)  # capture the shape first, so the replay below is a plain replay
    torch.cuda.synchronize()
    eager_cache.blocks.copy_(graph_cache.blocks)
    # Copy a block from outside the tables over the first block of each sequence.
    firsts = [step.block_tables[i * step.max_blocks] for i in range(step.num_seqs)]
    sources = [b for b in range(1, NUM_BLOCKS) if b not in owned][:len(firsts)]
    for cache in (eager_cache, graph_cache):
        cache.execute(BlockPlan(copy=BlockMoves(sources, firsts)))
    compare(model, eager_cache, graph_cache, graphs, replace(step, step_id=2), owned)


def test_graph_steps_on_an_fp8_cache():
    model, eager_cache, graph_cache = make_pair("d128", "fp8_e4m3")
    graphs = DecodeGraphs(model, graph_cache, max_batch=64, max_blocks=256)
    rng = random.Random(3)
    for step_id, batch in enumerate([5, 40], start=1):
        step, owned = random_step(rng, model, [rng.randint(1, 2000) for _ in range(batch)], step_id)
        compare(model, eager_cache, graph_cache, graphs, step, owned, cache_tol=0.25)


def test_fed_back_tokens_in_graph_and_eager_steps():
    """Tokens taken on the device from the previous step's ids (``feedback_rows``, rows shuffled,
    one token given) give what the same step with the tokens given gives, graph and eager."""
    model, eager_cache, graph_cache = make_pair("d128")
    graphs = DecodeGraphs(model, graph_cache, max_batch=64, max_blocks=256)
    rng = random.Random(4)
    step, owned = random_step(rng, model, [rng.randint(1, 1500) for _ in range(30)], 1)
    previous = torch.tensor([rng.randrange(model.cfg.vocab_size) for _ in range(40)], device="cuda")
    rows = list(range(40))
    rng.shuffle(rows)
    rows = rows[:30]
    rows[3] = -1   # given in token_ids
    given = replace(step, token_ids=[step.token_ids[3] if i == 3 else int(previous[r]) for i, r in enumerate(rows)])
    fed = replace(given, token_ids=[given.token_ids[3] if i == 3 else 0 for i in range(30)], feedback_rows=rows,
                  feedback_step=7)
    compare(model, eager_cache, graph_cache, graphs, given, owned)       # captures the shape
    want_eager = model.forward_paged(given, eager_cache.layer)
    got_eager = model.forward_paged(fed, eager_cache.layer, previous_ids=previous)
    assert torch.equal(got_eager, want_eager)
    want_graph = graphs.run(given).clone()   # run's logits are valid until the next run
    got_graph = graphs.run(fed, previous)
    assert torch.equal(got_graph, want_graph)
    # Ids of a previous step wider than the graph's buffers (an eager step of more rows): fed
    # before the replay instead of inside it, with the same result.
    wide = torch.tensor([rng.randrange(model.cfg.vocab_size) for _ in range(100)], device="cuda")
    wide[:40] = previous
    assert torch.equal(graphs.run(fed, wide), want_graph)
    # Serving's chain: each step fed from the last one's ids (``last_ids``, the argmax the graph
    # computed), against the same step with those tokens given.
    chain_rows = list(range(30))
    rng.shuffle(chain_rows)
    chain_rows[5] = -1
    chained = replace(fed, token_ids=[given.token_ids[5] if i == 5 else 0 for i in range(30)],
                      feedback_rows=chain_rows)
    assert torch.equal(graphs.last_ids(30), graphs.run(given).argmax(-1))
    for _ in range(3):
        ids = graphs.last_ids(30).clone()
        got = graphs.run(chained, graphs.last_ids(30)).clone()
        assert torch.equal(graphs.last_ids(30), got.argmax(-1))
        tokens = [given.token_ids[5] if i == 5 else int(ids[r]) for i, r in enumerate(chain_rows)]
        assert torch.equal(graphs.run(replace(given, token_ids=tokens)), got)


def test_graph_step_refuses_bad_input_and_serves_on():
    """A step the C++ stager cannot write (a token that is no integer, a table shorter than its
    rows) raises ValueError naming the field, with nothing run; the next good step is served."""
    model, eager_cache, graph_cache = make_pair("d128")
    graphs = DecodeGraphs(model, graph_cache, max_batch=64, max_blocks=256)
    rng = random.Random(6)
    step, owned = random_step(rng, model, [rng.randint(1, 900) for _ in range(12)], 1)
    compare(model, eager_cache, graph_cache, graphs, step, owned)
    before = graph_cache.blocks.clone()
    with pytest.raises(ValueError, match="token_ids: entry 2 is not an integer"):
        graphs.run(replace(step, token_ids=step.token_ids[:2] + [0.5] + step.token_ids[3:]))
    with pytest.raises(ValueError, match="block_tables: holds"):
        graphs.run(replace(step, block_tables=step.block_tables[:-1]))
    torch.cuda.synchronize()
    assert torch.equal(graph_cache.blocks, before)   # nothing ran
    step, owned = random_step(rng, model, [rng.randint(1, 900) for _ in range(12)], 2)
    compare(model, eager_cache, graph_cache, graphs, step, owned)
