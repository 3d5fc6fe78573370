"""Prefill on CUDA (``ops.paged_prefill_attention``: gather + SDPA for prompts, our decode kernel
for the one-token sequences of a mixed step) against float64 attention, on fresh random K/V in
shuffled blocks (unused blocks poisoned with NaN) and random prompt / cached-prefix splits."""

from __future__ import annotations

import dataclasses

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
    _assert_each_sequence(out, ref, starts, cases, TOL[dtype])


def _assert_each_sequence(out, ref, starts, cases, tol):
    """Each sequence's rows of out within tol of float64 attention (relative error), one message a sequence."""
    for i, (ctx, q_len) in enumerate(cases):
        s, e = int(starts[i]), int(starts[i + 1])
        assert rel_err(out[s:e].cpu(), ref[s:e]) < tol, f"sequence {i} (context {ctx}, queries {q_len})"


# ---- our prefill kernel (kernels/csrc/paged_prefill.cuh), called directly --------------------------
from kvpager.kernels import cuda, debug, prefill  # noqa: E402
from kvpager.kernels.split_query import joined_query, split_query_reference  # noqa: E402
from tests.unit.test_reference_kernels import fp8_paged  # noqa: E402


def _kernel_case(gen, block_size, head_dim, dtype, group, cases, share=True, paged=None):
    """cases: (context, new tokens). Random shuffled tables (Paged); with share, the second
    sequence's table starts with the first's full blocks (a shared prefix), its truth likewise."""
    if paged is None:
        paged = Paged([c for c, _ in cases], block_size, head_dim, dtype, gen)
    if share and len(cases) > 1:
        n = min(cases[0][0], cases[1][0] - cases[1][1]) // block_size   # full blocks, all cached
        if n > 0:
            paged.block_tables[1, :n] = paged.block_tables[0, :n]
            paged.keys[1][:n * block_size] = paged.keys[0][:n * block_size]
            paged.values[1][:n * block_size] = paged.values[0][:n * block_size]
    qdtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    queries = [torch.randn(q, NUM_KV_HEADS * group, head_dim, generator=gen).to(qdtype) for _, q in cases]
    starts = torch.tensor([0] + [q for _, q in cases]).cumsum(0).to(torch.int32)
    return paged, queries, starts


FP8_SCALES = (0.05, 0.03)   # (k_scale, v_scale) of the fp8 cases


def _fp8_case(gen, block_size, head_dim, group, cases):
    """_kernel_case over an fp8 cache (fp8_paged, FP8_SCALES; no shared prefix), bf16 queries."""
    paged = fp8_paged([c for c, _ in cases], block_size, head_dim, gen, *FP8_SCALES)
    return _kernel_case(gen, block_size, head_dim, torch.float32, group, cases, share=False, paged=paged)


def _assert_fp8_attention(out, queries, paged, starts, cases, scale, query_dtype, wgmma):
    """out against float64 attention over the dequantized cache, within the queries' 16-bit
    tolerance; where Hopper's kernel splits fp16 queries into two e4m3 terms (which keep bf16's
    precision of them: kernels/split_query.py), within it of float64 over the values the split
    holds, and within bf16's of the queries' own float64 attention."""
    tol = TOL[query_dtype]
    probe = torch.empty(1, NUM_KV_HEADS, paged.kv_cache.shape[-1], dtype=query_dtype, device=DEV)
    if query_dtype == torch.float16 and wgmma and cuda.supports_split_query(probe, paged.kv_cache[:, LAYER, 0]):
        held = [joined_query(split_query_reference(q, NUM_KV_HEADS)) for q in queries]
        _assert_each_sequence(out, reference_attention(held, paged, scale), starts, cases, tol)
        tol = TOL[torch.bfloat16]
    _assert_each_sequence(out, reference_attention(queries, paged, scale), starts, cases, tol)


def _run_kernel(paged, queries, starts, scale, warps, k_scale=1.0, v_scale=1.0, wgmma=False):
    kv = paged.kv_cache.to(DEV)
    query = torch.cat(queries).to(DEV)
    out = torch.full_like(query, float("nan"))       # poisoned: every row must be written
    host = (starts.tolist(), paged.context_lens.tolist())
    debug.paged_prefill_attention(query, kv[:, LAYER, 0], kv[:, LAYER, 1], paged.block_tables.to(DEV),
                                  paged.context_lens.to(DEV), starts.to(DEV), scale, k_scale, v_scale,
                                  host_lengths=host, out=out, warps=warps, wgmma=wgmma)
    torch.cuda.synchronize()
    return out.cpu()


def _cases(b, rng):
    """Whole prompts (q == c), chunked prefill over cached prefixes (q < c), single tokens, tile
    and block edges, and random ragged ones."""
    fixed = [(5 * b + 3, 2 * b + 1), (5 * b + 3, b + 2), (3 * b + 7, 3 * b + 7), (1, 1), (b, b), (b + 1, 1),
             (64, 64), (65, 17), (200, 130), (129, 128), (700, 37)]
    rand = []
    for _ in range(4):
        c = int(torch.randint(2, 900, (1,), generator=rng))
        q = int(torch.randint(1, c + 1, (1,), generator=rng))
        rand.append((c, q))
    return fixed + rand


def _instances():
    """(warps, wgmma) kernel instances: mma.sync with 4 and 8 warps, and the wgmma ones (which run
    mma.sync where the build has no sm_90a code)."""
    return [(4, False), (8, False), (8, True)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("warps,wgmma", _instances())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(8, 64), (8, 128), (16, 128), (32, 128), (16, 64), (64, 128)])
def test_prefill_kernel_matches_float64(warps, wgmma, dtype, group, block_size, head_dim):
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill kernel", warps, wgmma, dtype, group, block_size, head_dim)
    cases = _cases(block_size, gen)
    paged, queries, starts = _kernel_case(gen, block_size, head_dim, dtype, group, cases)
    scale = head_dim ** -0.5
    out = _run_kernel(paged, queries, starts, scale, warps, wgmma=wgmma)
    assert out.dtype == dtype and torch.isfinite(out).all(), "unwritten or non-finite rows"
    ref = reference_attention(queries, paged, scale)
    _assert_each_sequence(out, ref, starts, cases, TOL[dtype])



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [4, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_narrowed_last_tile_matches_float64(dtype, group, head_dim):
    """The warp-specialized kernel computes an item's last K/V tile only as far as each consumer
    warpgroup's rows can see, rounded up to 32 positions: whole prompts whose items end a quarter,
    half, three quarters and all the way into a tile, and chunks over cached prefixes whose first
    warpgroup sees nothing of its item's last tile (prefix 100: rows at positions 100-115 against a
    tile from 128)."""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("narrowed last tiles", dtype, group, head_dim)
    cases = [(512, 512), (612, 512), (140, 40), (130, 30), (164, 64), (1000, 1000), (229, 101)]
    paged, queries, starts = _kernel_case(gen, 16, head_dim, dtype, group, cases, share=False)
    scale = head_dim ** -0.5
    out = _run_kernel(paged, queries, starts, scale, 8, wgmma=True)
    assert torch.isfinite(out).all(), "unwritten or non-finite rows"
    ref = reference_attention(queries, paged, scale)
    _assert_each_sequence(out, ref, starts, cases, TOL[dtype])

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("warps,wgmma", _instances())
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(8, 128), (16, 128), (32, 64), (64, 128), (8, 64)])
def test_prefill_kernel_fp8_cache_matches_float64(warps, wgmma, query_dtype, group, block_size, head_dim):
    """Over an fp8 cache (on Hopper the wgmma instance is the warp-specialized kernel, whose
    producer dequantizes V tiles, while queries meet K as e4m3 in two e4m3 terms, exact for bf16
    and bf16's precision for fp16; every block size it compiles a copy loop for), against float64
    attention over the dequantized cache (_assert_fp8_attention): the 16-bit tolerance holds
    against what the kernel multiplies."""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill kernel fp8", warps, wgmma, query_dtype, group, block_size, head_dim)
    cases = _cases(block_size, gen)
    paged, queries, starts = _fp8_case(gen, block_size, head_dim, group, cases)
    k_scale, v_scale = FP8_SCALES
    queries = [q.to(query_dtype) for q in queries]
    scale = head_dim ** -0.5
    out = _run_kernel(paged, queries, starts, scale, warps, k_scale, v_scale, wgmma=wgmma)
    assert torch.isfinite(out).all()
    _assert_fp8_attention(out, queries, paged, starts, cases, scale, query_dtype, wgmma)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("magnitude", [1e-7, 3e5])
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("block_size,head_dim", [(16, 128), (32, 64)])
def test_fp8_cache_bf16_queries_beyond_fp16s_range(magnitude, group, block_size, head_dim):
    """bf16 queries far below and above e4m3's and fp16's ranges over an fp8 cache: on Hopper the
    warp-specialized kernel splits each query row into two e4m3 terms under a scale of the row's own
    (unscaled, 3e5 overflows both types and 1e-7 is below their smallest subnormal steps). The
    softmax scale is divided by the magnitude, so that the scores, and so the float64 truth, stay
    ordinary."""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill fp8 query range", magnitude, group, block_size, head_dim)
    cases = _cases(block_size, gen)
    paged, queries, starts = _fp8_case(gen, block_size, head_dim, group, cases)
    k_scale, v_scale = FP8_SCALES
    queries = [(q.float() * magnitude).to(torch.bfloat16) for q in queries]
    scale = head_dim ** -0.5 / magnitude
    out = _run_kernel(paged, queries, starts, scale, 8, k_scale, v_scale, wgmma=True)
    assert torch.isfinite(out).all()
    ref = reference_attention(queries, paged, scale)
    _assert_each_sequence(out, ref, starts, cases, TOL[torch.bfloat16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("magnitude", [1e-4, 1e4])
@pytest.mark.parametrize("block_size,head_dim", [(16, 128), (32, 64)])
def test_fp8_cache_fp16_queries_at_the_ends_of_fp16s_range(magnitude, block_size, head_dim):
    """fp16 queries near fp16's largest values (up to ~5e4 of 65504) and among its subnormals
    (1e-4: most values under its smallest normal 6.1e-5) over an fp8 cache: split into two e4m3
    terms under each row's own scale, as ordinary rows are (_assert_fp8_attention)."""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill fp8 fp16 query range", magnitude, block_size, head_dim)
    cases = _cases(block_size, gen)
    paged, queries, starts = _fp8_case(gen, block_size, head_dim, 4, cases)
    k_scale, v_scale = FP8_SCALES
    queries = [(q.float() * magnitude).to(torch.float16) for q in queries]
    assert all(torch.isfinite(q).all() for q in queries)
    scale = head_dim ** -0.5 / magnitude
    out = _run_kernel(paged, queries, starts, scale, 8, k_scale, v_scale, wgmma=True)
    assert torch.isfinite(out).all()
    _assert_fp8_attention(out, queries, paged, starts, cases, scale, torch.float16, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size,head_dim", [(16, 128), (32, 64)])
def test_fp8_cache_query_rows_of_every_magnitude(query_dtype, group, block_size, head_dim):
    """16-bit queries over an fp8 cache, whose rows the warp-specialized kernel (on Hopper) splits into
    two e4m3 terms, each row under a scale of its own: rows of one item 2^0 to 2^-12 apart, rows of
    zeros, and rows with one element 16 times the others, against float64. The largest rows' scores
    are ordinary ones, the smallest rows' softmax flat. (Scores far larger, in the thousands, lose
    more than 16-bit math would: the e4m3 tensor cores add with about 14 bits; docs/performance.md.)"""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill fp8 query rows", query_dtype, group, block_size, head_dim)
    cases = [(300, 300), (700, 129), (129, 129), (5 * block_size + 3, 2 * block_size + 1)]
    paged, queries, starts = _fp8_case(gen, block_size, head_dim, group, cases)
    k_scale, v_scale = FP8_SCALES
    shaped = []
    for q in queries:
        rows = q.float() * torch.exp2(-torch.randint(0, 13, q.shape[:-1], generator=gen).float())[..., None]
        pick = torch.rand(q.shape[:-1], generator=gen)
        rows[pick < 0.05] = 0.0
        spike = (pick >= 0.05) & (pick < 0.1)
        rows[..., 0] = torch.where(spike, rows[..., 0] * 16, rows[..., 0])
        shaped.append(rows.to(query_dtype))
    scale = head_dim ** -0.5
    out = _run_kernel(paged, shaped, starts, scale, 8, k_scale, v_scale, wgmma=True)
    assert torch.isfinite(out).all()
    if query_dtype == torch.bfloat16:
        _assert_each_sequence(out, reference_attention(shaped, paged, scale), starts, cases, TOL[torch.bfloat16])
    else:
        _assert_fp8_attention(out, shaped, paged, starts, cases, scale, query_dtype, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size,head_dim", [(16, 128), (8, 128), (32, 64)])
@pytest.mark.parametrize("bad_id", [-1, 10**6])
def test_fp8_cache_block_ids_that_are_not_blocks_read_as_zeros(query_dtype, block_size, head_dim, bad_id):
    """A table entry inside a context that is no block of the cache (negative or past the last):
    its rows are never read (the cache's NaN poison would show) and attend as zero K and V, whole
    tiles and partial ones alike (on Hopper the warp-specialized kernel's producer takes its general
    path for a tile with such a page, its fast path for the others)."""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill fp8 bad block ids", query_dtype, block_size, head_dim, bad_id)
    cases = [(20 * block_size, 20 * block_size), (12 * block_size + 5, 3 * block_size), (9 * block_size, 9 * block_size)]
    paged, queries, starts = _fp8_case(gen, block_size, head_dim, 4, cases)
    k_scale, v_scale = FP8_SCALES
    queries = [q.to(query_dtype) for q in queries]
    for seq, entry in ((0, 3), (0, 17), (1, 0), (2, 8)):   # a whole tile's page, a partial tile's, the first, the last
        paged.block_tables[seq, entry] = bad_id
        paged.keys[seq][entry * block_size:(entry + 1) * block_size] = 0
        paged.values[seq][entry * block_size:(entry + 1) * block_size] = 0
    scale = head_dim ** -0.5
    out = _run_kernel(paged, queries, starts, scale, 8, k_scale, v_scale, wgmma=True)
    assert torch.isfinite(out).all()
    _assert_fp8_attention(out, queries, paged, starts, cases, scale, query_dtype, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_kernel", [True, False])
def test_prefill_dispatch_with_and_without_the_kernel(use_kernel, monkeypatch):
    """ops → prefill.py with the kernel forced on and off: a mixed step (decodes ride along)."""
    if use_kernel and torch.cuda.get_device_capability() == (9, 0) and cuda.available():
        assert cuda.has_wgmma(torch.device(DEV)), "a Hopper build must hold the wgmma instances"
    monkeypatch.setattr(prefill, "use_kernel", use_kernel)
    gen = seeded("prefill dispatch", use_kernel)
    b, head_dim, dtype = 16, 128, torch.bfloat16
    cases = [(40, 40), (3 * b, 1), (300, 100), (17, 1), (90, 2)]
    paged, queries, starts = _kernel_case(gen, b, head_dim, dtype, 4, cases)
    kv = paged.kv_cache.to(DEV)
    scale = head_dim ** -0.5
    out = ops.paged_prefill_attention(torch.cat(queries).to(DEV), kv[:, LAYER, 0], kv[:, LAYER, 1],
                                      paged.block_tables.to(DEV), paged.context_lens.to(DEV), starts.to(DEV), scale,
                                      host_lengths=(starts.tolist(), paged.context_lens.tolist())).cpu()
    ref = reference_attention(queries, paged, scale)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_step_plan_serves_every_layer_like_one_shot_calls(use_kernel, monkeypatch):
    """Plan once per step (``ops.plan_prefill``, the one-token rows on the step's decode work
    list), run per layer (``ops.paged_prefill_run``) over two layers' caches: equal to one-shot
    calls of each layer with the same decode plan, and to float64 on the first."""
    monkeypatch.setattr(prefill, "use_kernel", use_kernel)
    gen = seeded("prefill plan gpu", use_kernel)
    b, head_dim, dtype = 16, 128, torch.bfloat16
    cases = [(300, 100), (3 * b, 1), (40, 40), (17, 1), (300, 100), (90, 2)]
    paged, queries, starts = _kernel_case(gen, b, head_dim, dtype, 4, cases, share=False)
    other = 0 if LAYER else 1
    paged.kv_cache[:, other] = torch.randn(paged.kv_cache[:, other].shape, generator=gen).to(dtype)
    kv = paged.kv_cache.to(DEV)
    query = torch.cat(queries).to(DEV)
    tables, lens, starts_d = paged.block_tables.to(DEV), paged.context_lens.to(DEV), starts.to(DEV)
    host = (starts.tolist(), paged.context_lens.tolist())
    scale = head_dim ** -0.5
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    planner = ops.DecodePlanner(query, kv[:, LAYER, 0])
    decode_lens = [c for c, q in cases if q == 1]
    decode_plan = planner.step_plan(torch.from_numpy(planner.plan(decode_lens)).to(DEV), len(decode_lens))
    step = ops.plan_prefill(query[:0], kv[:, LAYER, 0], tables, lens, starts_d, scale, host_lengths=host,
                            decode_plan=decode_plan)
    assert (step.kernel is not None) == use_kernel and (len(step.groups) > 0) != use_kernel
    assert step.decodes is not None

    def decode(q, kc, vc, bt, cl, sc, k_scale=1.0, v_scale=1.0):
        return ops.paged_decode_run(decode_plan, q, kc, vc, bt, cl, sc, k_scale, v_scale)

    for layer in (LAYER, other):
        out = ops.paged_prefill_run(step, query, kv[:, layer, 0], kv[:, layer, 1])
        once = ops.paged_prefill_attention(query, kv[:, layer, 0], kv[:, layer, 1], tables, lens, starts_d, scale,
                                           host_lengths=host, decode=decode)
        assert torch.equal(out, once)
        if layer == LAYER:
            assert rel_err(out.cpu(), reference_attention(queries, paged, scale)) < TOL[dtype]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("block_size,head_dim", [(8, 128), (16, 64), (16, 128), (64, 128)])
def test_dynamic_schedule_equals_the_static_one_and_leaves_its_counter_zero(dtype, group, block_size, head_dim):
    """The dynamic schedule (a device counter; the work list by sequence) against the static one
    on the same inputs: every (item, KV head) pair is computed the same way whichever block takes
    it, so the outputs are equal bit for bit, launch after launch of one plan (as a step's
    layers run it), and each launch leaves the counter zero. On a Hopper build this runs the
    warp-specialized kernel; elsewhere the grid kernel runs and "dynamic" plans as "static"."""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill dynamic schedule", dtype, group, block_size, head_dim)
    cases = _cases(block_size, gen) + [(4 * block_size + 5, 4 * block_size + 5)] * 3
    paged, queries, starts = _kernel_case(gen, block_size, head_dim, dtype, group, cases)
    _check_dynamic_equals_static(paged, queries, starts, head_dim, TOL[dtype])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size,head_dim", [(8, 128), (16, 64), (64, 128)])
def test_fp8_cache_dynamic_schedule_equals_the_static_one(group, block_size, head_dim):
    """The same over an fp8 cache (on Hopper the warp-specialized kernel's dequantizing producer)."""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill fp8 dynamic schedule", group, block_size, head_dim)
    cases = _cases(block_size, gen) + [(4 * block_size + 5, 4 * block_size + 5)] * 3
    paged, queries, starts = _fp8_case(gen, block_size, head_dim, group, cases)
    k_scale, v_scale = FP8_SCALES
    _check_dynamic_equals_static(paged, queries, starts, head_dim, TOL[torch.bfloat16], k_scale, v_scale)


def _check_dynamic_equals_static(paged, queries, starts, head_dim, tol, k_scale=1.0, v_scale=1.0):
    """Both schedules' plans on the case: the same items, outputs equal bit for bit over three
    launches of the dynamic plan, its counter zero after each (persistent kernel), and the
    static output within `tol` of float64 attention."""
    kv = paged.kv_cache.to(DEV)
    query = torch.cat(queries).to(DEV)
    tables, lens, starts_d = paged.block_tables.to(DEV), paged.context_lens.to(DEV), starts.to(DEV)
    host = (starts.tolist(), paged.context_lens.tolist())
    scale = head_dim ** -0.5
    k, v = kv[:, LAYER, 0], kv[:, LAYER, 1]
    static = cuda._plan_prefill(query, k, host, None, 8, None, "static")
    dynamic = cuda._plan_prefill(query, k, host, None, 8, None, "dynamic")
    persistent = cuda.prefill_wgmma(query.device)
    assert static.counter is None and (dynamic.counter is not None) == persistent
    assert sorted(map(tuple, static.work.tolist())) == sorted(map(tuple, dynamic.work.tolist()))
    want = cuda.paged_prefill_run(static, query, k, v, tables, lens, starts_d, scale, k_scale, v_scale)
    for _ in range(3):
        out = torch.full_like(query, float("nan"))
        cuda.paged_prefill_run(dynamic, query, k, v, tables, lens, starts_d, scale, k_scale, v_scale, out=out)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        if persistent:
            assert dynamic.counter.tolist() == [0, 0]
    assert rel_err(want.cpu(), reference_attention(queries, paged, scale)) < tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_counter_that_is_not_int32_pair_is_refused():
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill counter check")
    cases = [(40, 40)]
    paged, queries, starts = _kernel_case(gen, 16, 128, torch.bfloat16, 4, cases)
    kv = paged.kv_cache.to(DEV)
    query = torch.cat(queries).to(DEV)
    plan = cuda._plan_prefill(query, kv[:, LAYER, 0], (starts.tolist(), paged.context_lens.tolist()), None, 8, None,
                              "dynamic")
    bad = dataclasses.replace(plan, counter=torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="counter"):
        cuda.paged_prefill_run(bad, query, kv[:, LAYER, 0], kv[:, LAYER, 1], paged.block_tables.to(DEV),
                               paged.context_lens.to(DEV), starts.to(DEV), 128 ** -0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_query_and_out_not_on_16_bytes_are_refused():
    """The kernels copy Q and store O 16 bytes at a time: a query or output whose rows do not
    start on 16 bytes is refused (it would fault), and a good call after it still runs."""
    if not cuda.available():
        pytest.skip(cuda.load_error() or "no CUDA kernels")
    gen = seeded("prefill alignment check")
    paged, queries, starts = _kernel_case(gen, 16, 128, torch.bfloat16, 4, [(40, 40)])
    kv = paged.kv_cache.to(DEV)
    query = torch.cat(queries).to(DEV)
    host = (starts.tolist(), paged.context_lens.tolist())
    plan = cuda._plan_prefill(query, kv[:, LAYER, 0], host, None, 8, None)
    args = (kv[:, LAYER, 0], kv[:, LAYER, 1], paged.block_tables.to(DEV), paged.context_lens.to(DEV), starts.to(DEV),
            128 ** -0.5)
    padded = torch.empty(query.shape[0], query.shape[1], query.shape[2] + 4, dtype=query.dtype, device=DEV)
    odd_out = padded[:, :, :query.shape[2]]             # head stride 132 elements: not a multiple of 8
    with pytest.raises(ValueError, match="out strides .* must be multiples of 16 bytes"):
        cuda.paged_prefill_run(plan, query, *args, out=odd_out)
    padded[:, :, :query.shape[2]] = query
    with pytest.raises(ValueError, match="query strides .* must be multiples of 16 bytes"):
        cuda.paged_prefill_run(plan, padded[:, :, :query.shape[2]], *args)
    shifted = torch.empty(query.numel() + 4, dtype=query.dtype, device=DEV)[4:].view(query.shape)   # 8 bytes off
    with pytest.raises(ValueError, match="out data must be 16-byte aligned"):
        cuda.paged_prefill_run(plan, query, *args, out=shifted)
    want = cuda.paged_prefill_run(plan, query, *args)
    torch.cuda.synchronize()
    assert torch.isfinite(want).all()
