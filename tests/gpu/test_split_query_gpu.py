"""A 16-bit query split before the fp8 prefill kernel (``kernels/split_query.py``): the CUDA op
that writes it (``cuda.rope_split_query``, ``cuda.split_query``) against the torch reference, bit
for bit, for bf16 and fp16 queries; the kernel reading it against the same kernel splitting the
query itself (bit for bit) and against float64 attention over the dequantized cache; and the
inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from kvpager.kernels import cuda, debug
from kvpager.kernels.split_query import SplitQuery, joined_query, split_query_reference
from tests.gpu.test_prefill_gpu import FP8_SCALES, _assert_fp8_attention, _cases, _fp8_case, _kernel_case
from tests.unit.test_reference_kernels import LAYER, NUM_KV_HEADS, seeded

pytestmark = pytest.mark.gpu
DEV = "cuda"


DTYPES = [torch.bfloat16, torch.float16]


def _needs_split_kernel(k_cache_like: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    probe = torch.empty(1, NUM_KV_HEADS, k_cache_like.shape[-1], dtype=dtype, device=DEV)
    if not cuda.supports_split_query(probe, k_cache_like.to(DEV)):
        pytest.skip("a split query is read by Hopper's warp-specialized prefill kernel (sm_90a) alone")


def _rope_tables(gen, tokens, head_dim, dtype=torch.bfloat16):
    """cos and sin [tokens, head_dim] (rotate-half layout) of random angles, on the device."""
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 1000
    return (torch.cat([angles.cos()] * 2, dim=-1).to(dtype).to(DEV),
            torch.cat([angles.sin()] * 2, dim=-1).to(dtype).to(DEV))


def _spread_queries(gen, tokens, heads, head_dim, dtype=torch.bfloat16):
    """Rows of every magnitude (bf16: 1e-30 to 1e30 by row; fp16: 1e-5 to 1e3, within its range),
    some all zero, some with zeros and values far under their row's largest (fp16's subnormals)."""
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    span = (-30, 30) if dtype == torch.bfloat16 else (-5, 3)
    q *= torch.logspace(*span, tokens * heads)[torch.randperm(tokens * heads, generator=gen)].view(tokens, heads, 1)
    q[0, 0] = 0
    q[1, :, :7] = torch.tensor([0.0, 1e-3, -1e-6, 2e-9, -1e-12, 3e-39, 1.0])
    return q.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_split_query_op_equals_the_reference_bit_for_bit(dtype, head_dim, group):
    _needs_split_kernel(torch.empty(1, NUM_KV_HEADS, 16, head_dim, dtype=torch.float8_e4m3fn), dtype)
    gen = seeded("split query op", dtype, head_dim, group)
    q = _spread_queries(gen, 37, NUM_KV_HEADS * group, head_dim, dtype)
    want = split_query_reference(q, NUM_KV_HEADS)
    got = cuda.split_query(q.to(DEV), NUM_KV_HEADS)
    assert got.dtype == dtype
    assert torch.equal(got.data.cpu(), want.data)
    assert torch.equal(got.down.cpu(), want.down)
    joined, x = joined_query(want), q.float()
    largest = x.abs().amax(-1, keepdim=True)
    if dtype == torch.bfloat16:   # exact near the row's largest
        assert torch.equal(joined[x.abs() >= largest * 2 ** -9], x[x.abs() >= largest * 2 ** -9])
    else:                         # within 2^-9 of each value (split_query.py's bound)
        assert ((joined - x).abs() <= torch.maximum(x.abs() * 2 ** -9, largest * 2 ** -17)).all()


def _k_rows(gen, tokens, kv_heads, head_dim, layout, dtype=torch.bfloat16):
    """k [tokens, kv_heads, head_dim] on the device: contiguous, a view of a fused qkv row, or at an
    address that is not 8-byte aligned (the writer's pair-a-thread path for k)."""
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    if layout == "contiguous":
        return k.to(DEV)
    pad = 3 * head_dim if layout == "fused" else 1
    rows = torch.zeros(tokens, kv_heads * head_dim + pad, dtype=dtype)
    rows[:, pad:] = k.view(tokens, -1)
    return rows.to(DEV)[:, pad:].view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,group", [(NUM_KV_HEADS, 4), (7, 1), (3, 5)])
@pytest.mark.parametrize("k_layout", ["contiguous", "fused", "unaligned"])
def test_rope_split_query_equals_rope_then_split(dtype, head_dim, kv_heads, group, k_layout):
    """The rotation written split is rope's rotation (rounded to q's type as rope rounds), split; k
    is rotated in place as rope rotates it, aligned or not; q is left as it was. (7 and 15 heads of
    q put a row's threads and k's across a warp's middle.)"""
    _needs_split_kernel(torch.empty(1, NUM_KV_HEADS, 16, head_dim, dtype=torch.float8_e4m3fn), dtype)
    gen = seeded("rope split", dtype, head_dim, kv_heads, group, k_layout)
    tokens, q_heads = 45, group * kv_heads
    q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype).to(DEV)
    k = _k_rows(gen, tokens, kv_heads, head_dim, k_layout, dtype)
    assert (k.data_ptr() % 8 != 0) == (k_layout == "unaligned")
    cos, sin = _rope_tables(gen, tokens, head_dim, dtype)
    q_rot, k_rot = cuda.rope(q.clone(), k.clone(), cos, sin)
    q_before = q.clone()
    got = cuda.rope_split_query(q, k, cos, sin, kv_heads)
    want = split_query_reference(q_rot.cpu(), kv_heads)
    assert torch.equal(got.data.cpu(), want.data) and torch.equal(got.down.cpu(), want.down)
    assert torch.equal(k, k_rot)
    assert torch.equal(q, q_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(16, 128), (32, 64), (8, 128), (64, 64)])
def test_prefill_over_a_split_query_equals_the_kernels_own_split(dtype, group, block_size, head_dim):
    """The kernel loading a split query computes what it computes splitting the query itself (the
    same terms, scales and order of operations: bit for bit); against float64 as
    _assert_fp8_attention checks: within the 16-bit tolerance of the query's type over the values the
    split holds (a bf16 query itself), so the kernel adds no error of its own beyond 16-bit math's, and
    an fp16 query's own float64 attention within bf16's tolerance (the split keeps bf16's precision of
    it); padding rows of partial tiles read no factor."""
    gen = seeded("prefill split query", dtype, group, block_size, head_dim)
    cases = _cases(block_size, gen)
    paged, queries, starts = _fp8_case(gen, block_size, head_dim, group, cases)
    queries = [q.to(dtype) for q in queries]
    _needs_split_kernel(paged.kv_cache[:, LAYER, 0], dtype)
    k_scale, v_scale = FP8_SCALES
    scale = head_dim ** -0.5
    kv = paged.kv_cache.to(DEV)
    k_cache, v_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    query = torch.cat(queries).to(DEV)
    host = (starts.tolist(), paged.context_lens.tolist())
    plan = debug.plan_prefill(query, k_cache, host, warps=8, wgmma=True)
    args = (k_cache, v_cache, paged.block_tables.to(DEV), paged.context_lens.to(DEV), starts.to(DEV), scale, k_scale,
            v_scale)
    own = cuda.paged_prefill_run(plan, query, *args, out=torch.full_like(query, float("nan")))
    split = cuda.split_query(query, NUM_KV_HEADS)
    got = cuda.paged_prefill_run(plan, split, *args, out=torch.full_like(query, float("nan")))
    torch.cuda.synchronize()
    assert got.dtype == dtype and torch.equal(got, own)
    # (the split held by the CUDA op is split_query_reference's, bit for bit: the test above)
    _assert_fp8_attention(got.cpu(), queries, paged, starts, cases, scale, dtype, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_mixed_step_over_a_split_query_equals_the_plain_one(dtype):
    """A step with one-token rows (decode attention reads them unsplit): RoPE writes q split and
    rotates the kept tokens' rows in place too (plan.keep_rows); the step's attention equals the
    plain path's (rope in place, the kernel splitting), bit for bit; k equals rope's; q is left as
    it was at every other token; a split query without its bf16 rows is refused."""
    from kvpager.kernels import ops, prefill

    gen = seeded("mixed split query", dtype)
    cases = [(300, 300), (77, 1), (500, 120), (40, 1), (129, 128), (16, 1)]
    paged, queries, starts = _fp8_case(gen, 16, 128, 4, cases)
    _needs_split_kernel(paged.kv_cache[:, LAYER, 0], dtype)
    kv = paged.kv_cache.to(DEV)
    k8, v8 = kv[:, LAYER, 0], kv[:, LAYER, 1]
    query = torch.cat(queries).to(dtype).to(DEV)
    tokens = query.shape[0]
    k_new = torch.randn(tokens, NUM_KV_HEADS, 128, generator=gen).to(dtype).to(DEV)
    cos, sin = _rope_tables(gen, tokens, 128, dtype)
    plan = prefill.plan(query, k8, paged.block_tables.to(DEV), paged.context_lens.to(DEV), starts.to(DEV),
                        128 ** -0.5, host_lengths=(starts.tolist(), paged.context_lens.tolist()))
    assert plan.split_query and plan.keep_rows is not None and int(plan.keep_rows.sum()) == 3
    q_plain, k_plain = ops.rope(query.clone(), k_new.clone(), cos, sin)
    want = prefill.run(plan, q_plain, k8, v8, *FP8_SCALES)
    q_split, k_split = query.clone(), k_new.clone()
    split, _ = ops.rope_split_query(q_split, k_split, cos, sin, NUM_KV_HEADS, keep=plan.keep_rows)
    got = prefill.run(plan, split, k8, v8, *FP8_SCALES)
    torch.cuda.synchronize()
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(k_split, k_plain)
    kept = plan.keep_rows.bool()
    assert torch.equal(q_split[kept], q_plain[kept]) and torch.equal(q_split[~kept], query[~kept])
    with pytest.raises(ValueError, match="one-token rows attend over unsplit queries"):
        prefill.run(plan, SplitQuery(split.data, split.down, dtype=dtype), k8, v8, *FP8_SCALES)


def test_split_query_refused_where_no_kernel_reads_it():
    """A split query over a bf16 cache, on a plan without the wgmma instance, or with factors of
    the wrong shape: ValueError naming what is wrong, nothing launched."""
    _needs_split_kernel(torch.empty(1, NUM_KV_HEADS, 16, 128, dtype=torch.float8_e4m3fn))
    gen = seeded("split query refused")
    cases = [(40, 40), (70, 20)]
    paged, queries, starts = _fp8_case(gen, 16, 128, 4, cases)
    kv = paged.kv_cache.to(DEV)
    k8, v8 = kv[:, LAYER, 0], kv[:, LAYER, 1]
    query = torch.cat(queries).to(DEV)
    host = (starts.tolist(), paged.context_lens.tolist())
    tables, lens, starts_d = paged.block_tables.to(DEV), paged.context_lens.to(DEV), starts.to(DEV)
    split = cuda.split_query(query, NUM_KV_HEADS)

    bf16_paged, _, _ = _kernel_case(gen, 16, 128, torch.bfloat16, 4, cases, share=False)
    kv16 = bf16_paged.kv_cache.to(DEV)
    plan16 = debug.plan_prefill(query, kv16[:, LAYER, 0], host, warps=8, wgmma=True)
    with pytest.raises(ValueError, match="split query is read by the Hopper warp-specialized prefill kernel alone"):
        cuda.paged_prefill_run(plan16, split, kv16[:, LAYER, 0], kv16[:, LAYER, 1], tables, lens, starts_d, 0.1)

    mma_plan = debug.plan_prefill(query, k8, host, warps=8, wgmma=False)
    with pytest.raises(ValueError, match="needs the 8-warp wgmma plan"):
        cuda.paged_prefill_run(mma_plan, split, k8, v8, tables, lens, starts_d, 0.1)

    plan = debug.plan_prefill(query, k8, host, warps=8, wgmma=True)
    wrong = SplitQuery(split.data, split.down.transpose(0, 1).contiguous())   # [tokens, kv_heads, G]
    with pytest.raises(ValueError, match="query_down must be float32"):
        cuda.paged_prefill_run(plan, wrong, k8, v8, tables, lens, starts_d, 0.1)
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        cuda.split_query(torch.zeros(3, 8, 256, dtype=torch.bfloat16, device=DEV), NUM_KV_HEADS)
    with pytest.raises(ValueError, match="holds bf16 or fp16 queries"):
        cuda.split_query(query.float(), NUM_KV_HEADS)
    with pytest.raises(ValueError, match="out holds a split"):
        cuda.split_query(query.half(), NUM_KV_HEADS, out=split)
    out = cuda.paged_prefill_run(plan, split, k8, v8, tables, lens, starts_d, 0.1)   # still serving
    assert torch.isfinite(out).all()
