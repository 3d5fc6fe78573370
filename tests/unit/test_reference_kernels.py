"""The pure-torch reference kernels against a plain float64 attention over contiguous K/V.

Every attention case builds ground-truth contiguous K/V per sequence, scatters it into one
layer's views of a block-major cache through shuffled, non-contiguous block tables (randperm),
leaves every other slot NaN and pads the tables with out-of-range ids, so a kernel that reads
past a context or dereferences a padding entry fails loudly.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kvpager.kernels import prefill as sdpa_prefill
from kvpager.kernels.reference import (FP8, copy_blocks, paged_decode_attention, paged_prefill_attention,
                                       quantize_fp8, swap_blocks, write_kv)
from kvpager.numeric import ceil_div

NUM_LAYERS, LAYER, NUM_KV_HEADS = 3, 1, 2
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
PAD_BLOCK = 10_000  # block-table padding: an id no cache has


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """These tensors are tiny: intra-op threads only add overhead (several times the runtime on a
    loaded machine). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


class Paged:
    """Sequences of ground-truth contiguous K/V, and the same data in a paged block-major cache."""

    def __init__(self, context_lens, block_size, head_dim, dtype, gen, spare_blocks=5):
        self.block_size, self.dtype = block_size, dtype
        needed = [ceil_div(c, block_size) for c in context_lens]
        num_blocks = sum(needed) + spare_blocks
        self.kv_cache = torch.full((num_blocks, NUM_LAYERS, 2, NUM_KV_HEADS, block_size, head_dim),
                                   float("nan"), dtype=dtype)
        self.k_cache, self.v_cache = self.kv_cache[:, LAYER, 0], self.kv_cache[:, LAYER, 1]
        ids = torch.randperm(num_blocks, generator=gen)
        self.block_tables = torch.full((len(context_lens), max(needed) + 2), PAD_BLOCK, dtype=torch.int32)
        self.keys, self.values = [], []
        taken = 0
        for i, ctx in enumerate(context_lens):
            blocks = ids[taken:taken + needed[i]]
            taken += needed[i]
            self.block_tables[i, :needed[i]] = blocks.to(torch.int32)
            k = torch.randn(ctx, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
            v = torch.randn(ctx, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
            self.keys.append(k)
            self.values.append(v)
            for t in range(ctx):  # the test's own, plain scatter (not write_kv)
                b, off = blocks[t // block_size], t % block_size
                self.k_cache[b, :, off] = k[t]
                self.v_cache[b, :, off] = v[t]
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32)


def reference_attention(queries, paged: Paged, scale):
    """float64 causal attention per sequence; queries[i] is [q_len, num_q_heads, head_dim]."""
    outs = []
    for q, k, v in zip(queries, paged.keys, paged.values):
        q, k, v = q.double(), k.double(), v.double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        ctx, q_len = k.shape[0], q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def edge_lens(block_size):
    return [1, block_size - 1, block_size, block_size + 1, 7 * block_size + 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_matches_reference(dtype, group, head_dim, block_size):
    gen = seeded("decode", dtype, group, head_dim, block_size)
    lens = edge_lens(block_size)
    paged = Paged(lens, block_size, head_dim, dtype, gen)
    query = torch.randn(len(lens), NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    assert not paged.k_cache.is_contiguous()
    out = paged_decode_attention(query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, scale)
    assert out.shape == query.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = reference_attention([query[i:i + 1] for i in range(len(lens))], paged, scale)
    assert rel_err(out, ref) < TOL[dtype]
    # Per sequence too, so a short sequence's error cannot hide behind the long one's norm.
    for i in range(len(lens)):
        assert rel_err(out[i], ref[i]) < TOL[dtype], f"sequence {i} (context {lens[i]})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(8, 128), (16, 64)])
@pytest.mark.parametrize("impl", [paged_prefill_attention, sdpa_prefill.paged_prefill_attention],
                         ids=["reference", "sdpa"])
def test_prefill_matches_reference(dtype, group, block_size, head_dim, impl):
    gen = seeded("prefill", dtype, group, block_size)
    b = block_size
    # (context_len, query_len): no prefix (q == ctx), a cached prefix (q < ctx), q == 1.
    cases = [(1, 1), (b - 1, b - 1), (b, 3), (b + 1, 1), (7 * b + 3, 7 * b + 3), (5 * b + 2, 2 * b + 5),
             (2 * b, b)]
    lens = [c for c, _ in cases]
    paged = Paged(lens, block_size, head_dim, dtype, gen)
    queries = [torch.randn(q, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype) for _, q in cases]
    starts = torch.tensor([0] + [q for _, q in cases], dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    out = impl(torch.cat(queries), paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, starts,
               scale)
    assert out.shape == (int(starts[-1]), NUM_KV_HEADS * group, head_dim) and out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = reference_attention(queries, paged, scale)
    assert rel_err(out, ref) < TOL[dtype]
    for i, (ctx, q_len) in enumerate(cases):
        s, e = int(starts[i]), int(starts[i + 1])
        assert rel_err(out[s:e], ref[s:e]) < TOL[dtype], f"sequence {i} (context {ctx}, queries {q_len})"


def test_prefill_of_one_token_per_sequence_is_decode():
    gen = torch.Generator().manual_seed(7)
    lens = edge_lens(16)
    paged = Paged(lens, 16, 64, torch.float32, gen)
    query = torch.randn(len(lens), 8, 64, generator=gen)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    decode = paged_decode_attention(query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.1)
    prefill = paged_prefill_attention(query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens,
                                      starts, 0.1)
    assert torch.equal(decode, prefill)


@pytest.mark.parametrize("impl", [paged_prefill_attention, sdpa_prefill.paged_prefill_attention],
                         ids=["reference", "sdpa"])
def test_prefill_skips_a_sequence_with_no_new_tokens(impl):
    gen = torch.Generator().manual_seed(8)
    paged = Paged([5, 9, 12], 8, 64, torch.float32, gen)
    queries = [torch.randn(n, 2, 64, generator=gen) for n in (2, 0, 4)]
    starts = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    out = impl(torch.cat(queries), paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, starts,
               0.125)
    assert rel_err(out, reference_attention(queries, paged, 0.125)) < TOL[torch.float32]


def test_a_prefill_plan_made_once_serves_every_layer():
    """kernels/prefill.py's plan/run split on CPU (its gather + SDPA path): one plan for the step
    holds the groups (two sequences of one shape share a group, non-adjacent) and the one-token
    rows; runs of it over two layers' caches equal one-shot calls, and the plan is never rebuilt."""
    gen = seeded("prefill plan")
    b, head_dim = 8, 64
    cases = [(2 * b, b), (b + 1, 1), (2 * b, b), (3 * b + 2, 3 * b + 2), (4 * b, 1)]
    paged = Paged([c for c, _ in cases], b, head_dim, torch.float32, gen)
    other = 0 if LAYER else 1                     # a second layer, its own values in the same blocks
    paged.kv_cache[:, other] = torch.randn(paged.kv_cache[:, other].shape, generator=gen)
    queries = [torch.randn(q, NUM_KV_HEADS * 4, head_dim, generator=gen) for _, q in cases]
    query = torch.cat(queries)
    starts = torch.tensor([0] + [q for _, q in cases]).cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    decodes = []

    def decode(*args, **kwargs):
        decodes.append(args[0].shape[0])
        return paged_decode_attention(*args, **kwargs)

    plan = sdpa_prefill.plan(query, paged.k_cache, paged.block_tables, paged.context_lens, starts, scale,
                             host_lengths=(starts.tolist(), paged.context_lens.tolist()), decode=decode)
    assert sorted((g.q, g.c, g.n) for g in plan.groups) == [(b, 2 * b, 2), (3 * b + 2, 3 * b + 2, 1)]
    assert plan.decodes is not None and plan.kernel is None and not plan.reference
    for layer in (LAYER, other):
        k_cache, v_cache = paged.kv_cache[:, layer, 0], paged.kv_cache[:, layer, 1]
        out = sdpa_prefill.run(plan, query, k_cache, v_cache)
        once = sdpa_prefill.paged_prefill_attention(query, k_cache, v_cache, paged.block_tables, paged.context_lens,
                                                    starts, scale)
        assert torch.equal(out, once)
        if layer == LAYER:
            assert rel_err(out, reference_attention(queries, paged, scale)) < TOL[torch.float32]
    assert decodes == [2, 2]                      # the two one-token rows, one decode call per layer
    with pytest.raises(ValueError, match="plan"):
        sdpa_prefill.run(plan, query[1:], paged.k_cache, paged.v_cache)


def test_empty_batch():
    cache = torch.zeros(4, NUM_KV_HEADS, 8, 64)
    out = paged_decode_attention(torch.zeros(0, 2, 64), cache, cache, torch.zeros(0, 3, dtype=torch.int32),
                                 torch.zeros(0, dtype=torch.int32), 1.0)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_write_kv_scatters_into_layer_views_and_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, head_dim = 6, 8, 64
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, NUM_KV_HEADS, block_size, head_dim, generator=gen).to(dtype)
    before = kv_cache.clone()
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    num_tokens = 20
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 7, 8, 19]] = torch.tensor([-1, -1, -5, -1])
    key = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)

    write_kv(key, value, k_cache, v_cache, slots)

    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, LAYER, 0, :, slot % block_size] = key[t]
            expected[slot // block_size, LAYER, 1, :, slot % block_size] = value[t]
    # Exact: written slots hold the new K/V, every other slot (padding targets, other layers) is untouched.
    assert torch.equal(kv_cache, expected)
    assert not torch.equal(kv_cache, before)


def test_write_kv_then_prefill_with_cached_prefix_end_to_end():
    """Write a prefix, then a step's new tokens, through write_kv; attend over both."""
    gen = torch.Generator().manual_seed(12)
    block_size, head_dim, group = 16, 64, 4
    ctx_lens, q_lens = [40, 17, 3], [9, 17, 1]
    paged = Paged(ctx_lens, block_size, head_dim, torch.float32, gen)
    paged.kv_cache.fill_(float("nan"))  # forget the data; write_kv must put it back

    def slots_of(i, positions):
        table = paged.block_tables[i].long()
        return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])

    def write(positions_per_seq):
        slots, ks, vs = [], [], []
        for i, positions in enumerate(positions_per_seq):
            slots.append(slots_of(i, positions))
            ks.append(paged.keys[i][list(positions)])
            vs.append(paged.values[i][list(positions)])
        slots.append(torch.tensor([-1, -1]))  # padding tokens
        ks.append(torch.full((2, NUM_KV_HEADS, head_dim), float("nan")))
        vs.append(torch.full((2, NUM_KV_HEADS, head_dim), float("nan")))
        write_kv(torch.cat(ks), torch.cat(vs), paged.k_cache, paged.v_cache, torch.cat(slots))

    write([range(c - q) for c, q in zip(ctx_lens, q_lens)])          # the cached prefix
    write([range(c - q, c) for c, q in zip(ctx_lens, q_lens)])       # this step's tokens
    queries = [torch.randn(q, NUM_KV_HEADS * group, head_dim, generator=gen) for q in q_lens]
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    out = paged_prefill_attention(torch.cat(queries), paged.k_cache, paged.v_cache, paged.block_tables,
                                  paged.context_lens, starts, 0.125)
    assert rel_err(out, reference_attention(queries, paged, 0.125)) < TOL[torch.float32]


def test_copy_blocks_copies_whole_blocks_exactly():
    gen = torch.Generator().manual_seed(13)
    kv_cache = torch.randn(10, NUM_LAYERS, 2, NUM_KV_HEADS, 8, 64, generator=gen).to(torch.bfloat16)
    before = kv_cache.clone()
    src, dst = torch.tensor([3, 0, 7]), torch.tensor([5, 9, 2])
    copy_blocks(kv_cache, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(kv_cache[d], before[s])
    others = [b for b in range(10) if b not in dst.tolist()]
    assert torch.equal(kv_cache[others], before[others])
    copy_blocks(kv_cache, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    assert torch.equal(kv_cache[others], before[others])


@pytest.mark.parametrize("direction", ["out", "in"])
def test_swap_blocks_moves_blocks_between_caches_exactly(direction):
    gen = torch.Generator().manual_seed(14)
    shape = (NUM_LAYERS, 2, NUM_KV_HEADS, 8, 64)
    gpu = torch.randn(12, *shape, generator=gen).to(torch.float16)
    cpu = torch.randn(5, *shape, generator=gen).to(torch.float16)
    src_cache, dst_cache = (gpu, cpu) if direction == "out" else (cpu, gpu)
    src_before, dst_before = src_cache.clone(), dst_cache.clone()
    src = torch.randperm(src_cache.shape[0], generator=gen)[:3]
    dst = torch.randperm(dst_cache.shape[0], generator=gen)[:3]
    swap_blocks(src_cache, dst_cache, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(dst_cache[d], src_before[s])
    others = [b for b in range(dst_cache.shape[0]) if b not in dst.tolist()]
    assert torch.equal(dst_cache[others], dst_before[others])
    assert torch.equal(src_cache, src_before)


def _cache(num_blocks=4, block_size=8, head_dim=64, dtype=torch.float32):
    kv = torch.zeros(num_blocks, NUM_LAYERS, 2, NUM_KV_HEADS, block_size, head_dim, dtype=dtype)
    return kv, kv[:, 0, 0], kv[:, 0, 1]


def _decode(**over):
    kv, k, v = _cache()
    args = dict(query=torch.zeros(2, 4, 64), k_cache=k, v_cache=v, block_tables=torch.zeros(2, 3, dtype=torch.int32),
                context_lens=torch.tensor([3, 5], dtype=torch.int32), scale=1.0)
    args.update(over)
    return paged_decode_attention(**args)


@pytest.mark.parametrize("call,message", [
    (lambda: _decode(query=torch.zeros(2, 3, 64)), "multiple of 2 KV heads"),
    (lambda: _decode(query=torch.zeros(2, 4, 128)), "head_dim"),
    (lambda: _decode(query=torch.zeros(2, 4, 64, dtype=torch.float16)), "dtype"),
    (lambda: _decode(query=torch.zeros(2, 4)), "query must be"),
    (lambda: _decode(query=torch.zeros(3, 4, 64)), "disagree on num_seqs"),
    (lambda: _decode(v_cache=_cache(block_size=16)[2]), "k_cache and v_cache"),
    (lambda: _decode(v_cache=_cache(dtype=torch.float16)[2]), "v_cache"),
    (lambda: _decode(block_tables=torch.zeros(3, 3, dtype=torch.int32)), "block_tables"),
    (lambda: _decode(context_lens=torch.tensor([3, 25], dtype=torch.int32)), "exceeds"),
    (lambda: _decode(context_lens=torch.tensor([3, 0], dtype=torch.int32)), "more queries than context"),
    # An entry within a context that is no block of the 4 (past one, PAD_BLOCK-like ids are padding).
    (lambda: _decode(block_tables=torch.tensor([[-1, 0, 0], [1, 2, 0]], dtype=torch.int32)), "1 block_tables entries"),
    (lambda: _decode(block_tables=torch.tensor([[0, 9, 9], [1, 4, 9]], dtype=torch.int32),
                     context_lens=torch.tensor([3, 12], dtype=torch.int32)), r"not block ids \(negative or >= 4\)"),
    (lambda: paged_prefill_attention(torch.zeros(5, 2, 64), *_cache()[1:], torch.zeros(2, 3, dtype=torch.int32),
                                     torch.tensor([3, 5], dtype=torch.int32), torch.tensor([0, 2, 4]), 1.0),
     "query_start_loc"),
    (lambda: write_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 32), *_cache()[1:], torch.zeros(3, dtype=torch.long)),
     "key and value"),
    (lambda: write_kv(torch.zeros(3, 4, 64), torch.zeros(3, 4, 64), *_cache()[1:], torch.zeros(3, dtype=torch.long)),
     "do not match"),
    (lambda: write_kv(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), *_cache()[1:], torch.zeros(4, dtype=torch.long)),
     "slot_mapping"),
    (lambda: write_kv(torch.zeros(3, 2, 64, dtype=torch.bfloat16), torch.zeros(3, 2, 64, dtype=torch.bfloat16),
                      *_cache()[1:], torch.zeros(3, dtype=torch.long)), "dtype"),
    (lambda: copy_blocks(_cache()[0], torch.tensor([0, 1]), torch.tensor([2])), "src and dst"),
    (lambda: swap_blocks(_cache()[0], _cache(block_size=16)[0], torch.tensor([0]), torch.tensor([1])),
     "caches differ"),
    (lambda: swap_blocks(_cache()[0], _cache(dtype=torch.bfloat16)[0], torch.tensor([0]), torch.tensor([1])),
     "caches differ"),
])
def test_bad_inputs_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_sdpa_prefill_with_host_lengths_and_a_strided_query_matches_reference():
    """The worker's form: lengths passed as host lists (no sync), query a slice of a fused QKV."""
    gen = seeded("sdpa host lengths")
    # (context, new tokens): a group of two non-adjacent sequences, and one of two adjacent ones.
    cases = [(40, 40), (33, 17), (9, 1), (33, 17), (5, 1), (70, 6), (21, 4), (21, 4)]
    paged = Paged([c for c, _ in cases], 16, 64, torch.float32, gen)
    fused = torch.randn(sum(q for _, q in cases), NUM_KV_HEADS * 6, 64, generator=gen)
    query = fused[:, :NUM_KV_HEADS * 4]
    assert not query.is_contiguous()
    starts = [0]
    for _, q in cases:
        starts.append(starts[-1] + q)
    lens = [c for c, _ in cases]
    out = sdpa_prefill.paged_prefill_attention(query, paged.k_cache, paged.v_cache, paged.block_tables,
                                               paged.context_lens, torch.tensor(starts, dtype=torch.int32), 0.125,
                                               host_lengths=(starts, lens))
    ref = paged_prefill_attention(query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens,
                                  torch.tensor(starts, dtype=torch.int32), 0.125)
    assert rel_err(out, ref) < TOL[torch.float32]
    with pytest.raises(ValueError):
        sdpa_prefill.paged_prefill_attention(query, paged.k_cache, paged.v_cache, paged.block_tables,
                                             paged.context_lens, torch.tensor(starts, dtype=torch.int32), 0.125,
                                             host_lengths=(starts[:-1], lens))


# ---- fp8 (e4m3) KV storage ---------------------------------------------------------------------------
def fp8_paged(context_lens, block_size, head_dim, gen, k_scale, v_scale) -> Paged:
    """A Paged case whose cache holds K / k_scale and V / v_scale in float8_e4m3fn; its ground
    truth becomes the dequantized values (what any fp8 reader must attend over)."""
    paged = Paged(context_lens, block_size, head_dim, torch.float32, gen)
    paged.kv_cache[:, :, 0] = quantize_fp8(paged.kv_cache[:, :, 0], k_scale).float()
    paged.kv_cache[:, :, 1] = quantize_fp8(paged.kv_cache[:, :, 1], v_scale).float()
    paged.kv_cache = paged.kv_cache.to(FP8)          # NaN poison stays NaN
    paged.k_cache, paged.v_cache = paged.kv_cache[:, LAYER, 0], paged.kv_cache[:, LAYER, 1]
    paged.keys = [quantize_fp8(k, k_scale).float() * k_scale for k in paged.keys]
    paged.values = [quantize_fp8(v, v_scale).float() * v_scale for v in paged.values]
    return paged


def test_fp8_write_kv_quantizes_with_the_scale_and_saturates():
    k_cache, v_cache = _cache(dtype=FP8)[1:]
    key = torch.tensor([[1.0, -3.0, 1000.0, -1e6] * 16] * 2)[None].repeat(2, 1, 1)   # [2 tokens, 2 heads, 64]
    value = -key
    write_kv(key, value, k_cache, v_cache, torch.tensor([3, -1]), k_scale=2.0, v_scale=0.5)
    got_k, got_v = k_cache[0, :, 3].float(), v_cache[0, :, 3].float()
    assert torch.equal(got_k[0, :4], torch.tensor([0.5, -1.5, 448.0, -448.0]))      # key / 2, saturated
    assert torch.equal(got_v[0, :4], torch.tensor([-2.0, 6.0, -448.0, 448.0]))      # value / 0.5
    with pytest.raises(ValueError):
        write_kv(key, value, *_cache()[1:], torch.tensor([3, -1]), k_scale=2.0)      # scales need an fp8 cache
    with pytest.raises(ValueError):
        write_kv(key, value, k_cache, v_cache, torch.tensor([3, -1]), k_scale=0.0)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("impl", [paged_prefill_attention, sdpa_prefill.paged_prefill_attention],
                         ids=["reference", "sdpa"])
def test_fp8_cache_attention_matches_float64_over_the_dequantized_values(query_dtype, group, impl):
    gen = seeded("fp8", query_dtype, group)
    b, k_scale, v_scale = 16, 0.05, 0.03
    cases = [(1, 1), (b + 1, 1), (5 * b + 2, 2 * b + 5), (3 * b, 3 * b), (2 * b, 1)]
    paged = fp8_paged([c for c, _ in cases], b, 64, gen, k_scale, v_scale)
    queries = [torch.randn(q, NUM_KV_HEADS * group, 64, generator=gen).to(query_dtype) for _, q in cases]
    starts = torch.tensor([0] + [q for _, q in cases]).cumsum(0).to(torch.int32)
    out = impl(torch.cat(queries), paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, starts,
               0.125, k_scale, v_scale)
    assert out.dtype == query_dtype and torch.isfinite(out).all()
    ref = reference_attention(queries, paged, 0.125)
    for i in range(len(cases)):
        s, e = int(starts[i]), int(starts[i + 1])
        assert rel_err(out[s:e], ref[s:e]) < TOL[query_dtype], f"sequence {i}"
