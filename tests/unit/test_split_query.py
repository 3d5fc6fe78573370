"""The split query format's torch reference (``kernels/split_query.py``), on the CPU: what its bytes
hold, where each byte goes, and the per-row factors' layout. The CUDA op is checked against it
bit for bit in tests/gpu/test_split_query_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kvpager.kernels.split_query import SplitQuery, _byte_order, joined_query, split_query_chunk, split_query_reference


@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_byte_of_a_split_row_has_one_place(head_dim):
    order = _byte_order(head_dim)
    assert sorted(order.tolist()) == list(range(2 * head_dim))
    chunks = {split_query_chunk(kk, t4) for kk in range(head_dim // 32) for t4 in range(4)}
    assert chunks == set(range(head_dim // 8))
    # A load phase's 8 lanes (two rows g, g + 1; t4 0-3) read chunks in 8 distinct bank groups of
    # the kernel's swizzled tile (chunk c of row r at c ^ (r % 8) within its 128-byte panel row).
    for kk in range(head_dim // 32):
        for g in range(0, 8, 2):
            groups = {(split_query_chunk(kk, t4) & 7) ^ r for r in (g, g + 1) for t4 in range(4)}
            assert len(groups) == 8


@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_terms_hold_the_query(head_dim):
    gen = torch.Generator().manual_seed(13)
    tokens, heads, kv_heads = 50, 8, 2
    scales = torch.logspace(-30, 30, tokens * heads)[torch.randperm(tokens * heads, generator=gen)]
    q = (torch.randn(tokens, heads, head_dim, generator=gen) * scales.view(tokens, heads, 1)).to(torch.bfloat16)
    q[3, 5] = 0
    split = split_query_reference(q, kv_heads)
    assert split.shape == (tokens, heads, head_dim) and split.kv_heads == kv_heads
    x, joined = q.float(), joined_query(split)
    largest = x.abs().amax(-1, keepdim=True)
    near = x.abs() >= largest * 2 ** -9
    assert torch.equal(joined[near], x[near])                                  # exact near the row's largest
    assert ((joined - x).abs() <= largest * 2 ** -17).all()                     # and off by <= 2^-17 of it below
    # each row's largest, scaled, in [2^7, 2^8]; an all-zero row takes f = 7
    down = split.down.transpose(0, 1).reshape(tokens, heads)
    scaled = largest[..., 0] / down
    nonzero = largest[..., 0] > 0
    assert ((scaled[nonzero] >= 128) & (scaled[nonzero] <= 256)).all()
    assert down[3, 5] == 2.0 ** -7 and not split.data[3, 5].any()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_terms_hold_an_fp16_query_as_bf16_would(head_dim):
    """fp16's 11 significant bits in two e4m3 terms of 4: each value within 2^-9 of itself (what
    rounding to bf16 would leave), but for values far under their row's largest (2^-17 of it);
    exactly those fp16 values that have no more than bf16's 8 bits; never further than rounding
    the value to bf16 is, by more than that 2^-17."""
    gen = torch.Generator().manual_seed(14)
    tokens, heads, kv_heads = 50, 8, 2
    scales = torch.logspace(-4, 4, tokens * heads)[torch.randperm(tokens * heads, generator=gen)]
    q = (torch.randn(tokens, heads, head_dim, generator=gen) * scales.view(tokens, heads, 1)).half()
    q[3, 5] = 0
    q[7, 1, :4] = torch.tensor([65504.0, -2.0 ** -24, 2.0 ** -14, 1.0])   # fp16's largest and smallest
    split = split_query_reference(q, kv_heads)
    assert split.dtype == torch.float16
    x, joined = q.float(), joined_query(split)
    largest = x.abs().amax(-1, keepdim=True)
    err = (joined - x).abs()
    assert (err <= torch.maximum(x.abs() * 2 ** -9, largest * 2 ** -17)).all()
    to_bf16 = (x.to(torch.bfloat16).float() - x).abs()
    assert (err <= to_bf16 + largest * 2 ** -17).all()
    near = x.abs() >= largest * 2 ** -5
    exact = x.to(torch.bfloat16).float() == x                    # values with at most 8 significant bits
    assert torch.equal(joined[near & exact], x[near & exact])
    assert (err[near] > 0).any()                                  # and the others rounded: not exact in general
    down = split.down.transpose(0, 1).reshape(tokens, heads)
    scaled = largest[..., 0] / down
    nonzero = largest[..., 0] > 0
    assert ((scaled[nonzero] >= 128) & (scaled[nonzero] <= 256)).all()


def test_factors_are_laid_out_by_kv_head_then_token():
    q = torch.ones(3, 4, 64, dtype=torch.bfloat16) * torch.tensor([1.0, 2.0, 4.0, 8.0]).view(1, 4, 1)
    q[1] *= 16
    split = split_query_reference(q.to(torch.bfloat16), kv_heads=2)
    # row (token t, head h) at [h // 2, t, h % 2]: 2^-f with f = 7 - floor(log2 |q|)
    assert split.down[1, 1, 0].item() == 2.0 ** -(7 - 6)   # token 1, head 2: 4 * 16 = 2^6
    assert split.down[0, 2, 1].item() == 2.0 ** -(7 - 1)   # token 2, head 1: 2


def test_split_query_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="bf16 or fp16"):
        split_query_reference(torch.zeros(2, 4, 64, dtype=torch.float32), 2)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        SplitQuery.empty(2, 4, 64, 2, "cpu", torch.float32)
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        split_query_reference(torch.zeros(2, 4, 96, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="not a multiple"):
        SplitQuery.empty(2, 6, 64, 4, "cpu")


def test_a_plan_without_the_kernel_refuses_a_split_query():
    """On the CPU (no kernel reads one) a prefill plan says so and its run refuses a split query."""
    from kvpager.kernels import prefill

    q = torch.randn(10, 4, 64).to(torch.bfloat16)
    k_cache = torch.zeros(4, 2, 16, 64, dtype=torch.float8_e4m3fn)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens, starts = torch.tensor([10], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32)
    plan = prefill.plan(q, k_cache, tables, lens, starts, 0.125)
    assert not plan.split_query
    with pytest.raises(ValueError, match="does not take a split query"):
        prefill.run(plan, split_query_reference(q, 2), k_cache, k_cache)
