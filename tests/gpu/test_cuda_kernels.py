"""kvpager's CUDA kernels against a float64 oracle (the torch reference run in float64).

Every decode case scatters fresh random K/V into one layer of a NaN-filled block-major cache
through shuffled block tables (randperm ids), pads the tables with the id of a NaN block, and
poisons the output and the split-KV workspace with NaN: reading past a context, dereferencing a
padding entry, or leaving an output unwritten all show up as NaN. Contexts 1, block-1, block,
block+1, a middling and a long one share each batch; the query is a strided slice of a fused
QKV tensor. Both the unsplit and the split (flash-decoding) paths run, forced and automatic.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from kvpager.kernels import cuda, debug, reference
from kvpager.numeric import ceil_div

pytestmark = pytest.mark.gpu
DEV = "cuda"
LAYERS, LAYER = 2, 1
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cuda.available(), cuda.load_error()


def _case(dtype, head_dim, block_size, num_kv_heads, group, lens, seed, cache_dtype=None, k_scale=1.0,
          v_scale=1.0, kv_mag=1.0):
    """(query, k view, v view, block_tables, context_lens) over a NaN-filled block-major cache
    (of cache_dtype, default dtype; an fp8 cache holds K / k_scale and V / v_scale); K is
    kv_mag times standard normal."""
    gen = torch.Generator().manual_seed(seed)
    need = [ceil_div(c, block_size) for c in lens]
    num_blocks = sum(need) + 3
    cache = torch.full((num_blocks, LAYERS, 2, num_kv_heads, block_size, head_dim), float("nan"),
                       dtype=cache_dtype or dtype, device=DEV)
    k_view, v_view = cache[:, LAYER, 0], cache[:, LAYER, 1]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block = perm.pop()          # never written: a padding entry that is read leaks NaN
    width = max(need)
    tables = []
    for ctx, n in zip(lens, need):
        ids = [perm.pop() for _ in range(n)]
        pos = torch.arange(ctx)
        slots = torch.tensor(ids)[pos // block_size] * block_size + pos % block_size
        k = (torch.randn(ctx, num_kv_heads, head_dim, generator=gen) * kv_mag).to(DEV, dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(DEV, dtype)
        reference.write_kv(k, v, k_view, v_view, slots.to(DEV), k_scale, v_scale)
        tables.append(ids + [nan_block] * (width - n))
    num_q_heads = num_kv_heads * group
    fused = torch.randn(len(lens), num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(DEV, dtype)
    query = fused[:, :num_q_heads]            # strided like a slice of a fused QKV projection
    block_tables = torch.tensor(tables, dtype=torch.int32, device=DEV)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return query, k_view, v_view, block_tables, context_lens


def _check_decode(query, k_view, v_view, block_tables, context_lens, num_splits, tol, k_scale=1.0, v_scale=1.0,
                  loads=None, mma=None):
    """A grid plan (forced splits / kernel instance, or the planner's) with a NaN-poisoned workspace."""
    scale = query.shape[-1] ** -0.5
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=DEV)
    got = debug.paged_decode_attention(query, k_view, v_view, block_tables, context_lens, scale, num_splits,
                                       loads=loads, poison_workspace=True, out=out, k_scale=k_scale, v_scale=v_scale,
                                       mma=mma)
    assert got is out
    if k_view.dtype == reference.FP8:   # float64 over the dequantized cache
        ref = reference.paged_decode_attention(query.double(), k_view, v_view, block_tables, context_lens, scale,
                                               k_scale, v_scale)
    else:
        ref = reference.paged_decode_attention(query.double(), k_view.double(), v_view.double(), block_tables,
                                               context_lens, scale)
    assert torch.isfinite(got).all(), "unwritten or NaN outputs"
    for i in range(query.shape[0]):
        err = float((got[i].double() - ref[i]).norm() / ref[i].norm())
        assert err < tol, (i, int(context_lens[i]), err)


@pytest.fixture(params=[None, 2, 4], ids=["loads-auto", "loads2", "loads4"])
def loads(request):
    """Both kernel instances (2 or 4 loads in flight per lane), forced, and the planner's pick."""
    return request.param


@pytest.mark.parametrize("num_splits", [1, 5, None], ids=["unsplit", "split5", "auto"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_decode_matches_float64(dtype, head_dim, block_size, group, num_splits, loads):
    lens = [1, block_size - 1, block_size, block_size + 1, 333, 2100]
    seed = zlib.crc32(repr((dtype, head_dim, block_size, group, num_splits, loads)).encode())
    case = _case(dtype, head_dim, block_size, 2, group, lens, seed)
    if loads is not None:
        assert debug.decode_plan(*case[:5], num_splits, loads=loads)[3] == loads
    _check_decode(*case, num_splits, TOL[dtype], loads=loads)


MMA_DIMS = (64, 128)   # head dims of the tensor-core fp8 instance (paged_decode_mma.cuh)


@pytest.fixture(params=[True, 2], ids=["mma", "bulk"])
def tc16(request):
    """The tensor-core instances over 16-bit caches: registers (True) and, on Hopper, K/V staged
    by the copy engine (2; elsewhere refused, then the test is skipped)."""
    if request.param == 2 and torch.cuda.get_device_capability(DEV) < (9, 0):
        q, k = _case(torch.bfloat16, 128, 16, 2, 4, [20], 1)[:2]
        with pytest.raises(ValueError, match="mma"):
            debug.decode_work_geometry(q, k, mma=2)
        pytest.skip("the bulk-staged instance is Hopper's")
    return request.param


@pytest.mark.parametrize("mma", [True, False], ids=["mma", "fma"])
@pytest.mark.parametrize("num_splits", [1, 5, None], ids=["unsplit", "split5", "auto"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_fp8_cache_decode_matches_float64(dtype, head_dim, block_size, group, num_splits, loads, mma):
    """fp8 e4m3 cache with per-tensor scales, 16-bit query: against float64 attention over the
    dequantized cache (so only the kernel's own error counts, not the quantization's), on the
    tensor-core instance (head dims 64/128; elsewhere it must be refused) and the FMA one."""
    lens = [1, block_size - 1, block_size, block_size + 1, 333, 2100]
    seed = zlib.crc32(repr(("fp8", dtype, head_dim, block_size, group, num_splits, loads, mma)).encode())
    k_scale, v_scale = 0.043, 0.021
    case = _case(dtype, head_dim, block_size, 2, group, lens, seed, reference.FP8, k_scale, v_scale)
    if mma and head_dim not in MMA_DIMS:
        with pytest.raises(ValueError, match="mma"):
            debug.plan_decode_grid(*case[:5], mma=True)
        return
    plan = debug.plan_decode_grid(*case[:5], num_splits=num_splits, loads=loads, mma=mma)
    assert plan.mma == mma and plan.head_tile == min(group, 8 if mma else 4)
    if loads is not None:
        assert plan.loads == loads
    _check_decode(*case, num_splits, TOL[dtype], k_scale, v_scale, loads=loads, mma=mma)


def test_fp8_decode_planner_takes_tensor_cores():
    """The planner's default over fp8 caches: the tensor-core instance where it is built (head dims
    64/128: the whole group of 8 in one tile), the FMA one elsewhere; over 16-bit caches only where
    DRAM peaks at >= 4.2 TB/s (an H200: test_16bit_decode_planner_follows_the_device). The
    tensor-core instance with 16 tokens a warp iteration (loads 2) holds 4 blocks per SM (124
    registers, ptxas -v sm_90a), so its work-list geometry has 4 * SMs / 8 workers per KV head."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for head_dim, expect in ((64, True), (128, True), (256, False)):
        case = _case(torch.bfloat16, head_dim, 16, 8, 8, [700, 33], 31, reference.FP8, 0.05, 0.05)
        plan = debug.plan_decode_grid(*case[:5])
        assert plan.mma == expect and plan.head_tile == (8 if expect else 4), head_dim
        assert not debug.plan_decode_grid(*case[:5], mma=False).mma
        geometry = cuda.decode_work_geometry(case[0], case[1])
        assert geometry.mma == expect
        if expect:
            assert debug.decode_work_geometry(case[0], case[1], loads=2).workers == 4 * sms // 8


def test_16bit_decode_planner_follows_the_device():
    """Over bf16 / fp16 caches the planner takes the tensor-core instance by default exactly where
    DRAM peaks at >= 4.2 TB/s (the extension's own reading of the device: an H200 yes, an H100 no),
    head dims 64/128; fp32 and head dim 256 always the FMA one."""
    bandwidth = cuda.load().device_memory_bandwidth(torch.device(DEV).index or 0)
    assert bandwidth > 0, "the planner cannot read this device's DRAM peak"
    expect = bandwidth >= 4.2e12
    name = torch.cuda.get_device_name(DEV)
    assert ("H200" not in name or expect) and ("H100" not in name or not expect), (name, bandwidth)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (64, 128, 256):
            case = _case(dtype, head_dim, 16, 2, 4, [70], 32)
            want = expect and dtype != torch.float32 and head_dim in MMA_DIMS
            assert bool(debug.plan_decode_grid(*case[:5]).mma) == want, (dtype, head_dim)
            geometry = cuda.decode_work_geometry(case[0], case[1])
            assert bool(geometry.mma) == want and (geometry.loads == 2 or not want), (dtype, head_dim)
            assert not debug.plan_decode_grid(*case[:5], mma=False).mma


@pytest.mark.parametrize("num_splits", [1, 5, None], ids=["unsplit", "split5", "auto"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_tensor_core_decode_over_16bit_cache_matches_float64(dtype, head_dim, block_size, group, num_splits, tc16):
    """The tensor-core instance over a cache of the query's dtype (mma.sync in that dtype, P
    rounded to it): against float64, head dims 64/128, 16 tokens a warp iteration (loads 2; 4 is
    refused, as is head_dim 256)."""
    lens = [1, block_size - 1, block_size, block_size + 1, 333, 2100]
    seed = zlib.crc32(repr(("mma16", dtype, head_dim, block_size, group, num_splits)).encode())
    case = _case(dtype, head_dim, block_size, 2, group, lens, seed)
    if head_dim not in MMA_DIMS:
        with pytest.raises(ValueError, match="mma"):
            debug.plan_decode_grid(*case[:5], mma=tc16)
        return
    plan = debug.plan_decode_grid(*case[:5], num_splits=num_splits, mma=tc16)
    assert plan.mma == tc16 and plan.loads == 2 and plan.head_tile == min(group, 8)
    with pytest.raises(ValueError, match="mma"):
        debug.plan_decode_grid(*case[:5], num_splits=num_splits, loads=4, mma=tc16)
    _check_decode(*case, num_splits, TOL[dtype], mma=tc16)


@pytest.mark.parametrize("group", [2, 3, 6, 16])
def test_tensor_core_decode_over_16bit_cache_other_gqa_ratios(group):
    case = _case(torch.bfloat16, 128, 16, 2, group, [1, 15, 16, 17, 1000], 100 + group)
    for splits in (1, 3):
        _check_decode(*case, splits, TOL[torch.bfloat16], mma=True)


@pytest.mark.parametrize("group", [2, 3, 6, 16])
def test_fp8_tensor_core_decode_other_gqa_ratios(group):
    """Partly used tensor-core tiles (3 of 4, 6 of 8 heads) and two tiles per KV head (16)."""
    k_scale, v_scale = 0.043, 0.021
    case = _case(torch.bfloat16, 128, 16, 2, group, [1, 15, 16, 17, 1000], group, reference.FP8, k_scale, v_scale)
    for splits in (1, 3):
        _check_decode(*case, splits, TOL[torch.bfloat16], k_scale, v_scale, mma=True)
        # The L2 prefetch (off by default on this instance) changes no result.
        runs = [debug.paged_decode_attention(*case, 128 ** -0.5, splits, prefetch_steps=pd, k_scale=k_scale,
                                             v_scale=v_scale, mma=True) for pd in (None, 2)]
        assert torch.equal(runs[0], runs[1])


def _score_gaps(query, k_view, tables, lens, scale, k_scale):
    """([rows, q heads] gap, in log2 units, between each head's two best scores over the
    dequantized cache (inf for a one-token row), [rows, q heads] largest |score|), float64."""
    group = query.shape[1] // k_view.shape[1]
    block = k_view.shape[2]
    gaps = torch.full(query.shape[:2], float("inf"), dtype=torch.float64)
    largest = torch.zeros(query.shape[:2], dtype=torch.float64)
    for i, n in enumerate(lens):
        blocks = tables[i, :ceil_div(n, block)].long()
        k = k_view[blocks].to(torch.float64).permute(1, 0, 2, 3).reshape(k_view.shape[1], -1, k_view.shape[3])[:, :n]
        q = query[i].to(torch.float64).view(k_view.shape[1], group, -1)
        scores = torch.einsum("hgd,htd->hgt", q, k).reshape(query.shape[1], n) * scale * k_scale / math.log(2)
        largest[i] = scores.abs().max(dim=1).values.cpu()
        if n > 1:
            top = scores.topk(2, dim=1).values
            gaps[i] = (top[:, 0] - top[:, 1]).cpu()
    return gaps, largest


@pytest.mark.parametrize("head_dim", list(MMA_DIMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_fp8_tensor_core_decode_extreme_query_scale(dtype, head_dim):
    """q * scale * log2(e) * k_scale far past the f16 range (~1e5: K stored near 1, k_scale 3000,
    the query x 100): the tensor-core instance converts the query to f16 with a power-of-two factor
    per warp and takes it back off the scores, so nothing overflows (inf scores would give NaN).
    Such scores make the softmax one-hot; heads whose two best scores lie within rounding reach of
    each other (f16 query: ~2^-12 of the score) are left out of the comparison, the rest must equal
    float64 attention. Both instances, grid (unsplit and split) and work list."""
    k_scale, v_scale = 3000.0, 0.5
    lens = [1, 2, 15, 16, 17, 700, 2100]
    seed = zlib.crc32(repr(("fp8-extreme", dtype, head_dim)).encode())
    query, k_view, v_view, tables, context = _case(dtype, head_dim, 16, 2, 4, lens, seed, reference.FP8, k_scale,
                                                   v_scale, kv_mag=k_scale)
    query = query * 100
    scale = head_dim ** -0.5
    assert float(query.abs().max()) * scale * 1.4427 * k_scale > 65504
    ref = reference.paged_decode_attention(query.double(), k_view, v_view, tables, context, scale, k_scale, v_scale)
    gaps, largest = _score_gaps(query, k_view, tables, lens, scale, k_scale)
    assert float(largest.max()) > 1e4                    # one-hot territory: what the test is about
    compared = gaps > 30 + 2e-3 * largest
    assert compared.float().mean() > 0.8
    outs = []
    for mma in (True, False):
        for splits in (1, 3):
            outs.append(debug.paged_decode_attention(query, k_view, v_view, tables, context, scale, splits,
                                                     poison_workspace=True, k_scale=k_scale, v_scale=v_scale, mma=mma))
    geometry = debug.decode_work_geometry(query, k_view, mma=True)
    step = debug.decode_plan_on(DEV, cuda.plan_decode_work(lens, geometry), geometry, len(lens),
                                num_q_heads=query.shape[1], head_dim=head_dim, poison_workspace=True)
    outs.append(cuda.paged_decode_run(step, query, k_view, v_view, tables, context, scale, k_scale=k_scale,
                                      v_scale=v_scale))
    for got in outs:
        assert torch.isfinite(got).all()
        err = ((got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).cpu()
        assert (err[compared] < TOL[dtype]).all(), err[compared].max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_write_kv_quantizes_like_the_reference(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    heads, num_blocks, block_size, tokens = 4, 37, 16, 100
    cache = torch.full((num_blocks, LAYERS, 2, heads, block_size, head_dim), float("nan"), dtype=reference.FP8,
                       device=DEV)
    fused = (torch.randn(tokens, 3 * heads, head_dim, generator=gen) * 30).to(DEV, dtype)   # some beyond 448 * scale
    key, value = fused[:, heads:2 * heads], fused[:, 2 * heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1
    slots = slots.to(DEV)
    for k_scale, v_scale in ((0.25, 0.125), (0.043, 0.021)):
        got, expect = cache.clone(), cache.clone()
        cuda.write_kv(key, value, got[:, LAYER, 0], got[:, LAYER, 1], slots, k_scale, v_scale)
        reference.write_kv(key, value, expect[:, LAYER, 0], expect[:, LAYER, 1], slots, k_scale, v_scale)
        same_nan = got.float().isnan() == expect.float().isnan()
        assert same_nan.all()
        g, e = got.float().nan_to_num(), expect.float().nan_to_num()
        if k_scale == 0.25:      # power-of-two scales: bit-exact
            assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))
        else:                    # x * (1 / s) vs x / s may round differently at a tie: one e4m3 step at most
            assert ((g - e).abs() <= e.abs() / 8 + 2 ** -9).all()
        assert g.abs().max() == 448.0                                       # saturated, not NaN


def test_decode_planner_picks_few_loads_for_full_waves_and_many_for_small_grids():
    """The FMA instance's loads (the planner's instance over bf16 on an H100; forced elsewhere)."""
    small = _case(torch.bfloat16, 128, 16, 8, 4, [32768], seed=11)
    assert debug.decode_plan(*small[:5], mma=False)[3] == 4
    full = _case(torch.bfloat16, 128, 16, 8, 4, [1024] * 128, seed=12)
    splits, _, _, loads = debug.decode_plan(*full[:5], mma=False)
    assert loads == 2
    _check_decode(*full, None, TOL[torch.bfloat16])


def test_two_loads_instance_runs_four_blocks_per_sm():
    """The 2-loads instance exists to hold 4 blocks (16 warps) per SM: its launch bound keeps it
    at 128 registers (unbounded, ptxas took 150 for bf16 d128 and 3 blocks fit: the planner then
    never picked it). The work-list geometry shows the residency: workers = blocks per SM * SMs /
    (KV heads x head chunks)."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q = torch.empty(1, 32, 128, dtype=dtype, device=DEV)
        k = torch.empty(4, 8, 16, 128, dtype=dtype, device=DEV)
        assert debug.decode_work_geometry(q, k, loads=2, mma=False).workers == 4 * sms // 8, dtype


def test_one_grid_plan_serves_every_layer():
    """A grid plan made once runs every layer (here two caches), each run equal to a one-shot
    call; a plan made for narrower tables than the run's is refused, not run short."""
    query, k_view, v_view, tables, lens = _case(torch.bfloat16, 128, 16, 8, 4, [700, 5000, 33], seed=21)
    scale = 128 ** -0.5
    plan = cuda.plan_decode_grid(query, k_view, v_view, tables, lens)
    assert plan.num_splits > 1 and plan.workspace is not None
    for k, v in ((k_view, v_view), (v_view, k_view)):
        got = cuda.paged_decode_grid_run(plan, query, k, v, tables, lens, scale)
        assert torch.equal(got, cuda.paged_decode_attention(query, k, v, tables, lens, scale))
    narrow = cuda.plan_decode_grid(query, k_view, v_view, tables[:, :4], lens)
    with pytest.raises(ValueError, match="does not cover"):
        cuda.paged_decode_grid_run(narrow, query, k_view, v_view, tables, lens, scale)


def test_work_list_prefetch_distance_changes_no_bit():
    """The L2 prefetch distance (kernels/debug.py's knob, for benchmarks) is a hint: every distance
    gives the default's output bit for bit, and a distance out of range is refused."""
    query, k_view, v_view, tables, lens = _case(torch.bfloat16, 128, 16, 8, 4, [700, 5000, 33, 4096], seed=23)
    geometry = cuda.decode_work_geometry(query, k_view)
    step = debug.decode_plan_on(DEV, cuda.plan_decode_work(lens.tolist(), geometry), geometry, 4, num_q_heads=32,
                                head_dim=128)
    want = cuda.paged_decode_run(step, query, k_view, v_view, tables, lens, 0.1)
    for pd in (0, 1, 2, 4, 8):
        assert torch.equal(debug.paged_decode_run(step, query, k_view, v_view, tables, lens, 0.1, prefetch_steps=pd),
                           want), pd
    with pytest.raises(ValueError, match="prefetch_steps"):
        debug.paged_decode_run(step, query, k_view, v_view, tables, lens, 0.1, prefetch_steps=65)


def test_work_list_run_checks_its_plan():
    query, k_view, v_view, tables, lens = _case(torch.bfloat16, 128, 16, 8, 4, [700, 5000, 33], seed=22)
    geometry = cuda.decode_work_geometry(query, k_view)
    work = torch.from_numpy(cuda.plan_decode_work(lens.tolist(), geometry)).to(DEV)
    small = cuda.DecodePlan(geometry, work, cuda.decode_workspace(3, 32, 128, DEV))
    with pytest.raises(ValueError, match="part_out"):
        cuda.paged_decode_run(small, query, k_view, v_view, tables, lens, 0.1)
    short = cuda.DecodePlan(geometry, work[:10], cuda.decode_workspace(geometry.capacity(3), 32, 128, DEV))
    with pytest.raises(ValueError, match="too few"):
        cuda.paged_decode_run(short, query, k_view, v_view, tables, lens, 0.1)


@pytest.mark.parametrize("group", [2, 3, 6, 16])
def test_decode_other_gqa_ratios(group):
    """Ratios that are not a head tile (3, 6: partly used tiles) or exceed one (16: two tiles)."""
    case = _case(torch.bfloat16, 128, 16, 2, group, [1, 15, 16, 17, 1000], seed=group)
    for splits in (1, 3):
        _check_decode(*case, splits, TOL[torch.bfloat16])


def test_decode_one_long_sequence_auto_splits_fill_the_gpu():
    case = _case(torch.bfloat16, 128, 16, 8, 4, [32768], seed=7)
    splits, partition, tile, _ = debug.decode_plan(*case[:5])
    assert splits > 8 and tile == 4 and partition * splits >= 32768
    _check_decode(*case, None, TOL[torch.bfloat16])


def test_decode_plan_unsplit_when_the_grid_is_large():
    case = _case(torch.bfloat16, 128, 16, 8, 4, [40] * 256, seed=3)
    assert debug.decode_plan(*case[:5])[0] == 1
    assert debug.decode_plan(*case[:5], num_splits=1)[0] == 1


def test_decode_out_of_range_ids_are_skipped_not_read():
    """Table ids outside the cache are masked (their tokens skipped), never dereferenced."""
    query, k_view, v_view, tables, lens = _case(torch.float32, 64, 16, 2, 2, [40, 40], seed=11)
    tables[1, 1] = 1 << 20                     # sequence 1's middle block: not a cache block
    out = cuda.paged_decode_attention(query, k_view, v_view, tables, lens, 0.125)
    ref0 = reference.paged_decode_attention(query[:1].double(), k_view.double(), v_view.double(), tables[:1],
                                            lens[:1], 0.125)
    assert float((out[0].double() - ref0[0]).norm() / ref0[0].norm()) < 1e-5
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("head_dim", list(MMA_DIMS))
def test_tensor_core_decode_over_16bit_cache_skips_out_of_range_ids(head_dim, tc16):
    """The tensor-core instances over a bf16 cache (the bulk-staged one never copies the rows of
    invalid blocks, and their stale shared memory must not leak): an id outside the cache
    mid-table, grid and work list, against float64 over the valid blocks only."""
    query, k_view, v_view, tables, lens = _case(torch.bfloat16, head_dim, 16, 2, 4, [200, 200, 37], seed=12)
    tables[1, 3] = 1 << 20                     # sequence 1's fourth block: not a cache block
    scale = head_dim ** -0.5
    ref = torch.empty(query.shape, dtype=torch.float64, device=DEV)
    ref[[0, 2]] = reference.paged_decode_attention(query[[0, 2]].double(), k_view.double(), v_view.double(),
                                                   tables[[0, 2]], lens[[0, 2]], scale)
    rows = tables[1].tolist()                  # sequence 1 over its valid blocks' 184 tokens only
    kept = [t for t in range(200) if not 48 <= t < 64]
    k1 = torch.stack([k_view[rows[t // 16], :, t % 16] for t in kept]).double()
    v1 = torch.stack([v_view[rows[t // 16], :, t % 16] for t in kept]).double()
    q1 = query[1].double().view(2, 4, head_dim)
    p = torch.softmax(torch.einsum("hgd,thd->hgt", q1, k1) * scale, dim=-1)
    ref[1] = torch.einsum("hgt,thd->hgd", p, v1).reshape(8, head_dim)
    geometry = debug.decode_work_geometry(query, k_view, mma=tc16)
    step = debug.decode_plan_on(DEV, cuda.plan_decode_work(lens.tolist(), geometry), geometry, 3,
                                num_q_heads=query.shape[1], head_dim=head_dim, poison_workspace=True)
    for got in (debug.paged_decode_attention(query, k_view, v_view, tables, lens, scale, 3, mma=tc16),
                cuda.paged_decode_run(step, query, k_view, v_view, tables, lens, scale)):
        assert torch.isfinite(got).all()
        for i in range(3):
            assert float((got[i].double() - ref[i]).norm() / ref[i].norm()) < TOL[torch.bfloat16], i


def test_decode_rejects_bad_inputs():
    query, k_view, v_view, tables, lens = _case(torch.bfloat16, 128, 16, 2, 4, [5, 20], seed=1)
    scale = 128 ** -0.5
    with pytest.raises(ValueError, match="dtype"):
        cuda.paged_decode_attention(query.half(), k_view, v_view, tables, lens, scale)
    with pytest.raises(ValueError, match="int32"):
        cuda.paged_decode_attention(query, k_view, v_view, tables.long(), lens, scale)
    with pytest.raises(ValueError, match="packed"):
        cuda.paged_decode_attention(query, k_view.transpose(1, 2), v_view.transpose(1, 2), tables, lens, scale)
    with pytest.raises(ValueError, match="GQA"):
        cuda.paged_decode_attention(query[:, :3], k_view, v_view, tables, lens, scale)
    cache96 = torch.zeros(8, 1, 2, 2, 16, 96, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="head_dim must be"):
        cuda.paged_decode_attention(torch.zeros(2, 8, 96, dtype=torch.bfloat16, device=DEV), cache96[:, 0, 0],
                                    cache96[:, 0, 1], tables, lens, scale)
    with pytest.raises(ValueError, match="CUDA"):
        cuda.paged_decode_attention(query, k_view, v_view, tables, lens.cpu(), scale)
    with pytest.raises(ValueError, match="num_seqs"):
        cuda.paged_decode_attention(query, k_view, v_view, tables[:1], lens, scale)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("head_dim, block_size", [(64, 8), (128, 16), (256, 32)])
def test_write_kv_matches_reference(dtype, head_dim, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(head_dim + block_size)
    heads, num_blocks, tokens = 4, 37, 100
    cache = torch.randn(num_blocks, LAYERS, 2, heads, block_size, head_dim, generator=gen).to(DEV, dtype)
    expect = cache.clone()
    fused = torch.randn(tokens, 3 * heads, head_dim, generator=gen).to(DEV, dtype)
    key, value = fused[:, heads:2 * heads], fused[:, 2 * heads:]          # strided slices
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1                                                       # padding: skipped
    slots = slots.to(DEV, slot_dtype)
    cuda.write_kv(key, value, cache[:, LAYER, 0], cache[:, LAYER, 1], slots)
    reference.write_kv(key, value, expect[:, LAYER, 0], expect[:, LAYER, 1], slots.long())
    assert torch.equal(cache, expect)


def test_write_kv_rejects_bad_inputs():
    cache = torch.zeros(4, 1, 2, 2, 16, 64, dtype=torch.float16, device=DEV)
    key = torch.zeros(3, 2, 64, dtype=torch.float16, device=DEV)
    slots = torch.tensor([0, 1, 2], device=DEV)
    with pytest.raises(ValueError, match="dtype"):
        cuda.write_kv(key.float(), key.float(), cache[:, 0, 0], cache[:, 0, 1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        cuda.write_kv(key, key, cache[:, 0, 0], cache[:, 0, 1], slots[:2])
    with pytest.raises(ValueError, match="heads"):
        cuda.write_kv(key[:, :1], key[:, :1], cache[:, 0, 0], cache[:, 0, 1], slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_copy_blocks_exact(dtype):
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(64, 3, 2, 4, 16, 128, generator=gen).to(DEV, dtype)
    expect = cache.clone()
    perm = torch.randperm(64, generator=gen)
    src, dst = perm[:20], perm[20:40]                   # CPU ids: moved by the wrapper
    cuda.copy_blocks(cache, src, dst)
    reference.copy_blocks(expect, src, dst)
    assert torch.equal(cache, expect)
    cuda.copy_blocks(cache, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    assert torch.equal(cache, expect)


def test_copy_blocks_odd_block_size_tail():
    """A block whose size is not a multiple of the per-block-tile vector count (partial tile)."""
    cache = torch.randn(9, 1, 2, 3, 8, 64, device=DEV, dtype=torch.float16)
    expect = cache.clone()
    src, dst = torch.tensor([0, 3, 8]), torch.tensor([1, 4, 5])
    cuda.copy_blocks(cache, src, dst)
    reference.copy_blocks(expect, src, dst)
    assert torch.equal(cache, expect)
    assert math.prod(cache.shape[1:]) * 2 % (256 * 4 * 16) != 0


# ---- decode over a work list planned once per step (kernels/decode_plan.py) ----

def _check_work(query, k_view, v_view, block_tables, context_lens, tol, k_scale=1.0, v_scale=1.0, host_lens=None,
                loads=None, mma=None):
    """The planned kernel against float64: NaN-poisoned output and workspace, the plan made on
    the host from ``host_lens`` (default: the context lengths), run twice (every layer of a step
    runs the same plan: the second run must not depend on what the first left in the workspace)."""
    geometry = debug.decode_work_geometry(query, k_view, loads=loads, mma=mma)
    if mma is not None:
        assert geometry.mma == mma
    lens = context_lens.tolist() if host_lens is None else host_lens
    plan = cuda.plan_decode_work(lens, geometry)
    step = debug.decode_plan_on(DEV, plan, geometry, len(lens), num_q_heads=query.shape[1], head_dim=query.shape[2],
                                poison_workspace=True)
    scale = query.shape[-1] ** -0.5
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=DEV)
    got = cuda.paged_decode_run(step, query, k_view, v_view, block_tables, context_lens, scale, out=out,
                                k_scale=k_scale, v_scale=v_scale)
    assert got is out
    again = cuda.paged_decode_run(step, query, k_view, v_view, block_tables, context_lens, scale, k_scale=k_scale,
                                  v_scale=v_scale)
    assert torch.equal(again, got)
    live = [i for i, n in enumerate(lens) if n > 0]   # the reference takes no empty rows
    args = (query[live].double(), k_view, v_view, block_tables[live], context_lens[live], scale)
    if k_view.dtype == reference.FP8:
        ref = reference.paged_decode_attention(*args, k_scale, v_scale)
    else:
        ref = reference.paged_decode_attention(args[0], k_view.double(), v_view.double(), *args[3:])
    assert torch.isfinite(got).all(), "unwritten or NaN outputs"
    assert (got[[i for i, n in enumerate(lens) if n <= 0]] == 0).all()
    for row, i in enumerate(live):
        err = float((got[i].double() - ref[row]).norm() / ref[row].norm())
        assert err < tol, (i, lens[i], err)
    return plan


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_work_list_decode_matches_float64(dtype, head_dim, block_size, group, loads):
    """Ragged random lengths (split into pieces and whole), edge lengths around a block."""
    seed = zlib.crc32(repr(("work", dtype, head_dim, block_size, group, loads)).encode())
    gen = torch.Generator().manual_seed(seed)
    lens = [1, block_size - 1, block_size, block_size + 1] + torch.randint(1, 3000, (12,), generator=gen).tolist()
    lens.append(9000)
    _check_work(*_case(dtype, head_dim, block_size, 2, group, lens, seed), TOL[dtype], loads=loads)


@pytest.mark.parametrize("mma", [True, False], ids=["mma", "fma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_work_list_decode_fp8_cache(dtype, head_dim, loads, mma):
    seed = zlib.crc32(repr(("work-fp8", dtype, head_dim, loads, mma)).encode())
    lens = [1, 17, 700, 2500, 64, 4097]
    k_scale, v_scale = 0.043, 0.021
    case = _case(dtype, head_dim, 16, 2, 4, lens, seed, reference.FP8, k_scale, v_scale)
    if mma and head_dim not in MMA_DIMS:
        with pytest.raises(ValueError, match="mma"):
            debug.decode_work_geometry(case[0], case[1], mma=True)
        return
    _check_work(*case, TOL[dtype], k_scale, v_scale, loads=loads, mma=mma)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", list(MMA_DIMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_work_list_decode_16bit_tensor_cores(dtype, head_dim, block_size, group, tc16):
    """The tensor-core instance over a 16-bit cache on ragged work lists; loads 4 refused."""
    seed = zlib.crc32(repr(("work-mma16", dtype, head_dim, block_size, group)).encode())
    gen = torch.Generator().manual_seed(seed)
    lens = [1, block_size - 1, block_size, block_size + 1] + torch.randint(1, 3000, (8,), generator=gen).tolist()
    lens.append(9000)
    case = _case(dtype, head_dim, block_size, 2, group, lens, seed)
    assert debug.decode_work_geometry(case[0], case[1], mma=tc16).loads == 2
    with pytest.raises(ValueError, match="mma"):
        debug.decode_work_geometry(case[0], case[1], loads=4, mma=tc16)
    _check_work(*case, TOL[dtype], mma=tc16)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", list(MMA_DIMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_work_list_decode_fp8_tensor_cores(dtype, head_dim, block_size, group):
    """The tensor-core instance over ragged work lists (pieces and whole sequences) at every block
    size and group, shuffled tables."""
    seed = zlib.crc32(repr(("work-fp8-mma", dtype, head_dim, block_size, group)).encode())
    gen = torch.Generator().manual_seed(seed)
    lens = [1, block_size - 1, block_size, block_size + 1] + torch.randint(1, 3000, (8,), generator=gen).tolist()
    lens.append(9000)
    k_scale, v_scale = 0.043, 0.021
    case = _case(dtype, head_dim, block_size, 2, group, lens, seed, reference.FP8, k_scale, v_scale)
    _check_work(*case, TOL[dtype], k_scale, v_scale, mma=True)


def test_work_list_decode_padding_rows_and_the_llama_shape():
    """32q/8kv d128 bf16 (the serving shape): a long sequence split into many pieces beside short
    ones, and padding rows (context 0) that must come out as zeros."""
    lens = [20000, 5, 0, 3000, 0, 129, 77, 4096]
    case = _case(torch.bfloat16, 128, 16, 8, 4, [max(n, 1) for n in lens], seed=5)
    query, k_view, v_view, tables, _ = case
    context = torch.tensor(lens, dtype=torch.int32, device=DEV)
    plan = _check_work(query, k_view, v_view, tables, context, TOL[torch.bfloat16], host_lens=lens)
    spans = plan[-2 * len(lens):].reshape(len(lens), 2)   # (first partial row, pieces) per row
    assert spans[0, 1] > 1 and (spans[[2, 4], 1] == 1).all()


@pytest.mark.parametrize("cache", ["bf16", "fp8-mma"])
def test_work_list_takes_the_tables_row_stride_from_its_header(cache):
    """A work list whose header int 2 holds W reads the block tables packed ``[S, W]`` at the
    start of a wider buffer (a CUDA graph's step, worker/decode_graphs.py): the same output as
    over the tables themselves, the buffer's other entries (invalid ids) never read."""
    lens = [700, 33, 2500, 1, 4097, 16]
    fp8 = cache == "fp8-mma"
    query, k_view, v_view, tables, context = _case(torch.bfloat16, 128, 16, 2, 4, lens, seed=11,
                                                   cache_dtype=reference.FP8 if fp8 else None)
    geometry = debug.decode_work_geometry(query, k_view, mma=True if fp8 else None)
    scale = query.shape[-1] ** -0.5
    plan = cuda.plan_decode_work(lens, geometry)
    rows, width = tables.shape

    def run(host_plan, block_tables):
        step = debug.decode_plan_on(DEV, host_plan, geometry, rows, num_q_heads=query.shape[1],
                                    head_dim=query.shape[2])
        return cuda.paged_decode_run(step, query, k_view, v_view, block_tables, context, scale)

    want = run(plan, tables)
    wide = torch.full((rows, width + 37), -7, dtype=torch.int32, device=DEV)
    wide.view(-1)[:rows * width] = tables.reshape(-1)
    packed = plan.copy()
    packed[2] = width
    assert torch.equal(run(packed, wide), want)
    assert not torch.equal(run(plan, wide), want)   # without the stride, the wide rows are read


def test_host_planners_agree():
    """The C++ planner the worker uses equals kernels/decode_plan.py's numpy one."""
    from kvpager.kernels import decode_plan
    q, k = torch.empty(1, 32, 128, dtype=torch.bfloat16, device=DEV), torch.empty(4, 8, 16, 128, dtype=torch.bfloat16,
                                                                                   device=DEV)
    geometry = cuda.decode_work_geometry(q, k)
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        rows = int(torch.randint(1, 600, (1,), generator=gen))
        lens = torch.randint(-2, [300, 5000, 40000][trial % 3], (rows,), generator=gen).tolist()
        expect = decode_plan.plan_decode_work(lens, geometry.workers, geometry.longest_item)
        assert (cuda.plan_decode_work(lens, geometry) == expect).all(), (trial, rows)


def test_fp8_work_lists_plan_with_the_fp8_item_cost():
    """Over an fp8 cache the geometry carries the fp8 item cost, and the worker's planner uses it
    (the numpy planner given the same cost plans the same)."""
    from kvpager.kernels import decode_plan
    q = torch.empty(1, 32, 128, dtype=torch.bfloat16, device=DEV)
    k8 = torch.empty(4, 8, 16, 128, dtype=cuda.FP8, device=DEV)
    geometry = cuda.decode_work_geometry(q, k8)
    assert geometry.item_cost == decode_plan.ITEM_COST_FP8
    assert cuda.decode_work_geometry(q, k8.to(torch.bfloat16)).item_cost == decode_plan.ITEM_COST
    gen = torch.Generator().manual_seed(4)
    for trial in range(50):
        lens = torch.randint(1, [2600, 8192][trial % 2], (int(torch.randint(64, 300, (1,), generator=gen)),),
                             generator=gen).tolist()
        expect = decode_plan.plan_decode_work(lens, geometry.workers, geometry.longest_item,
                                              item_cost=decode_plan.ITEM_COST_FP8)
        assert (cuda.plan_decode_work(lens, geometry) == expect).all(), trial
