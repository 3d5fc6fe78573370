"""The model over an fp8 e4m3 KV cache on the GPU (our CUDA write_kv quantizing, our prefill kernel
over the pages, on Hopper also over a 16-bit query RoPE wrote split, where the model is set to; our
fp8 decode kernel) against the same model over a contiguous cache holding the same
quantized-then-dequantized K/V: a prefill step of ragged prompts in shuffled blocks, a mixed step
(a 3-token chunk beside one-token rows), then a decode step, logits compared by relative error."""

from __future__ import annotations

import pytest
import torch

from kvpager.kernels import cuda, ops
from kvpager.worker.kv_cache import CacheSpec, KVCache
from kvpager.step import StepInput
from kvpager.worker.model import Decoder, ModelConfig

pytestmark = pytest.mark.gpu
BLOCK = 16


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype,write_split", [("bfloat16", True), ("bfloat16", False), ("float16", True),
                                               ("float16", False)])
def test_fp8_cache_logits_match_the_contiguous_cache_of_the_same_values(dtype, write_split, monkeypatch):
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_q_heads=8, num_kv_heads=2, head_dim=64,
                      intermediate_size=256, vocab_size=128, seed=4, dtype=dtype, kv_cache_dtype="fp8_e4m3",
                      kv_scale=0.5)
    model = Decoder(cfg, device="cuda")
    model.write_split_query = write_split   # RoPE writing q split for the prefill kernel (on by default)
    cache = KVCache(CacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, cfg.cache_dtype), 64, 4, "cuda")
    assert ops.backend(cache.layer(0)[0]) == "cuda"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 20, 37, 16)]
    free = torch.randperm(64, generator=gen).tolist()
    tables = [[free.pop() for _ in range(4)] for _ in prompts]       # room for 64 tokens each
    past = [[] for _ in prompts]
    lens = [0] * len(prompts)
    step_tokens = prompts
    split_calls = []
    rope_split_query = ops.rope_split_query

    def counted(*args, **kwargs):
        split_calls.append(args[0].shape)
        return rope_split_query(*args, **kwargs)

    monkeypatch.setattr(ops, "rope_split_query", counted)
    q_like = torch.empty(1, cfg.num_q_heads, cfg.head_dim, dtype=getattr(torch, dtype), device="cuda")
    split_expected = write_split and cuda.supports_split_query(q_like, cache.layer(0)[0])   # on Hopper
    for step in range(3):
        token_ids, positions, slots = [], [], []
        for i, toks in enumerate(step_tokens):
            for t in toks:
                token_ids.append(t)
                positions.append(lens[i])
                slots.append(tables[i][lens[i] // BLOCK] * BLOCK + lens[i] % BLOCK)
                lens[i] += 1
        inp = StepInput(step_id=step + 1, plan_step_id=0, token_ids=token_ids, positions=positions,
                        slot_mapping=slots, query_lens=[len(t) for t in step_tokens], context_lens=list(lens),
                        block_tables=[b for t in tables for b in t], max_blocks=4)
        paged = model.forward_paged(inp, cache.layer)
        # The prefill step's and the mixed step's layers rotate q into a split query where the kernel
        # reads one (the mixed step's one-token rows rotated in place too); the decode step never does.
        assert len(split_calls) == (cfg.num_layers * min(step + 1, 2) if split_expected else 0), (step, split_calls)
        for i, toks in enumerate(step_tokens):
            contiguous = model.forward_contiguous(toks, lens[i] - len(toks), past[i])
            err = rel_err(paged[i], contiguous)
            assert err < 2e-2, (step, i, err)
        step_tokens = [[int(paged[i].argmax())] for i in range(len(prompts))]      # decode steps next
        if step == 0:   # a mixed step next: a chunk of 3 tokens for the first sequence, one for the others
            step_tokens[0] += [7, 11]
