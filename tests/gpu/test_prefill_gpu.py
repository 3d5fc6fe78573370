"""Prefill on CUDA (``ops.paged_prefill_attention``: gather + SDPA for prompts, our decode kernel
for the one-token sequences of a mixed step) against float64 attention, on fresh random K/V in
shuffled blocks (unused blocks poisoned with NaN) and random prompt / cached-prefix splits."""

from __future__ import annotations

import pytest
import torch

from kvpager.kernels import ops
from tests.unit.test_reference_kernels import LAYER, NUM_KV_HEADS, TOL, Paged, reference_attention, rel_err, seeded

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(8, 128), (16, 64), (16, 128), (32, 256)])
def test_mixed_prefill_step_matches_float64(dtype, group, block_size, head_dim):
    gen = seeded("gpu prefill", dtype, group, block_size, head_dim)
    b = block_size
    # (context, new tokens): whole prompts, prompts over a cached prefix, decodes (1 new token),
    # two pairs of sequences of one shape (each pair one SDPA call; one pair adjacent, one not),
    # and a long one.
    cases = [(1, 1), (b - 1, b - 1), (b + 1, 1), (5 * b + 2, 2 * b + 5), (3 * b, 1), (2 * b, b), (2 * b, b),
             (5 * b + 2, 2 * b + 5), (40 * b + 7, 9 * b)]
    paged = Paged([c for c, _ in cases], block_size, head_dim, dtype, gen)
    queries = [torch.randn(q, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype) for _, q in cases]
    starts = torch.tensor([0] + [q for _, q in cases]).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    kv = paged.kv_cache.to(DEV)      # block-major; attention reads one layer's strided views
    out = ops.paged_prefill_attention(torch.cat(queries).to(DEV), kv[:, LAYER, 0], kv[:, LAYER, 1],
                                      paged.block_tables.to(DEV), paged.context_lens.to(DEV), starts.to(DEV), scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = reference_attention(queries, paged, scale)
    for i, (ctx, q_len) in enumerate(cases):
        s, e = int(starts[i]), int(starts[i + 1])
        assert rel_err(out[s:e].cpu(), ref[s:e]) < TOL[dtype], f"sequence {i} (context {ctx}, queries {q_len})"
