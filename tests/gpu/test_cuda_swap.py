"""Swaps on CUDA: ``cuda.swap_blocks`` in every mode (``debug.swap_blocks``), and ``KVCache.execute``
on its own swap stream ordered by events against the compute stream.

Destinations are poisoned (NaN) before each swap; results must equal the source bit for bit,
and every block a plan does not name must stay as it was. Ordering cases delay one stream with
a spin kernel (``torch.cuda._sleep``) so that a missing wait shows up as wrong data.
"""

from __future__ import annotations

import pytest
import torch

from kvpager.kernels import cuda, debug, ops, reference
from kvpager.worker.block_plan import BlockMoves, BlockPlan
from kvpager.worker.kv_cache import CacheSpec, KVCache

pytestmark = pytest.mark.gpu
DEV = "cuda"
SPIN = 50_000_000   # cycles: ~25 ms at 2 GHz, far longer than any copy here


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cuda.available(), cuda.load_error()


def _caches(dtype, gpu_blocks=24, cpu_blocks=20, layers=3, heads=2, block=16, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, heads, block, dim)
    gpu = torch.randn(gpu_blocks, *shape, generator=gen).to(DEV, dtype)
    cpu = torch.full((cpu_blocks, *shape), float("nan"), dtype=dtype).pin_memory()
    return gpu, cpu


@pytest.mark.parametrize("mode", cuda.SWAP_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_swap_out_and_in_exact_other_blocks_untouched(mode, dtype):
    gpu, cpu = _caches(dtype)
    gpu_before = gpu.clone()
    # Scattered ids, plus a run of consecutive pairs (coalesced into one copy by the DMA path).
    src = torch.tensor([17, 3, 9, 10, 11, 12, 0, 23])
    dst = torch.tensor([4, 19, 6, 7, 8, 9, 0, 13])
    cpu_before = cpu.clone()
    debug.swap_blocks(gpu, cpu, src, dst, mode)
    torch.cuda.synchronize()
    assert torch.equal(cpu[dst], gpu_before[src.to(DEV)].cpu())
    others = [i for i in range(cpu.shape[0]) if i not in dst.tolist()]
    assert cpu[others].isnan().all() and cpu_before[others].isnan().all()
    # ... and back into poisoned device blocks.
    back = torch.tensor([1, 2, 5, 14, 15, 16, 20, 22])
    gpu[back.to(DEV)] = float("nan")
    gpu_mid = gpu.clone()
    debug.swap_blocks(cpu, gpu, dst, back, mode)
    torch.cuda.synchronize()
    assert torch.equal(gpu[back.to(DEV)], gpu_before[src.to(DEV)])
    rest = torch.tensor([i for i in range(gpu.shape[0]) if i not in back.tolist()], device=DEV)
    assert torch.equal(gpu[rest], gpu_mid[rest])


@pytest.mark.parametrize("mode", cuda.SWAP_MODES)
def test_swap_many_large_blocks_matches_reference(mode):
    gen = torch.Generator().manual_seed(3)
    gpu = torch.randn(300, 4, 2, 8, 16, 128, generator=gen).to(DEV, torch.bfloat16)
    cpu = torch.zeros(200, *gpu.shape[1:], dtype=torch.bfloat16).pin_memory()
    src, dst = torch.randperm(300, generator=gen)[:150], torch.randperm(200, generator=gen)[:150]
    expect = cpu.clone()
    reference.swap_blocks(gpu, expect, src, dst)
    debug.swap_blocks(gpu, cpu, src, dst, mode)
    torch.cuda.synchronize()
    assert torch.equal(cpu, expect)


def test_out_of_range_pairs_are_skipped():
    gpu, cpu = _caches(torch.float32)
    for mode in cuda.SWAP_MODES:
        debug.swap_blocks(gpu, cpu, torch.tensor([0, 99, -1]), torch.tensor([1, 2, 3]), mode)
    torch.cuda.synchronize()
    assert torch.equal(cpu[1], gpu[0].cpu()) and cpu[[0, 2, 3]].isnan().all()


def test_swap_rejects_bad_inputs():
    gpu, cpu = _caches(torch.float32)
    with pytest.raises(ValueError):
        cuda.swap_blocks(gpu, cpu.to(torch.float16).pin_memory(), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError):
        cuda.swap_blocks(gpu, torch.zeros_like(cpu), torch.tensor([0]), torch.tensor([0]))   # not pinned
    with pytest.raises(ValueError):
        debug.swap_blocks(gpu, cpu, torch.tensor([0]), torch.tensor([0]), "nope")


# ---- KVCache on the swap stream ----------------------------------------------------------------------
SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16)


def _kv(gpu_blocks=16, cpu_blocks=8, seed=0) -> KVCache:
    cache = KVCache(SPEC, gpu_blocks, cpu_blocks, DEV)
    gen = torch.Generator().manual_seed(seed)
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=gen))
    cache.swap_space.copy_(torch.randn(cache.swap_space.shape, generator=gen))
    torch.cuda.synchronize()
    return cache


def test_execute_uses_the_fast_path_and_keeps_plan_order():
    cache = _kv()
    gpu, cpu = cache.blocks.clone(), cache.swap_space.clone()
    cache.execute(BlockPlan(swap_out=BlockMoves([3, 7], [0, 5]), swap_in=BlockMoves([1], [3]),
                            copy=BlockMoves([3], [9])))
    cache.synchronize()
    assert torch.equal(cache.swap_space[0], gpu[3].cpu()) and torch.equal(cache.swap_space[5], gpu[7].cpu())
    assert torch.equal(cache.blocks[3], cpu[1].to(DEV)) and torch.equal(cache.blocks[9], cpu[1].to(DEV))
    untouched = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15], device=DEV)
    assert torch.equal(cache.blocks[untouched], gpu[untouched])
    assert torch.equal(cache.swap_space[[1, 2, 3, 4, 6, 7]], cpu[[1, 2, 3, 4, 6, 7]])


def test_swapped_out_copy_survives_a_later_plan_that_reuses_the_block():
    cache = _kv()
    x_data = cache.blocks[4].clone()
    with torch.cuda.stream(cache._swap_stream):
        torch.cuda._sleep(SPIN)          # the swap-out lags far behind the host
    cache.execute(BlockPlan(swap_out=BlockMoves([4], [2])))
    cache.execute(BlockPlan(swap_in=BlockMoves([6], [4])))     # other data into block 4
    cache.synchronize()
    assert torch.equal(cache.swap_space[2], x_data.cpu())
    assert torch.equal(cache.blocks[4], cache.swap_space[6].to(DEV))


def test_compute_writes_after_a_swap_out_wait_for_it():
    cache = _kv()
    x_data = cache.blocks[5].clone()
    with torch.cuda.stream(cache._swap_stream):
        torch.cuda._sleep(SPIN)
    cache.execute(BlockPlan(swap_out=BlockMoves([5], [1])))
    k, v = cache.layer(0)                 # the model's first access: the compute stream waits here
    new = torch.full((16, 2, 128), 3.0, dtype=torch.bfloat16, device=DEV)
    ops.write_kv(new, new, k, v, torch.arange(5 * 16, 6 * 16, device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(cache.swap_space[1], x_data.cpu())
    assert (cache.blocks[5, 0] == 3.0).all()


def test_swap_out_waits_for_earlier_compute_writes():
    cache = _kv()
    k, v = cache.layer(1)
    torch.cuda._sleep(SPIN)               # compute lags: the write below runs late
    new = torch.full((16, 2, 128), -2.0, dtype=torch.bfloat16, device=DEV)
    ops.write_kv(new, new, k, v, torch.arange(2 * 16, 3 * 16, device=DEV))
    cache.execute(BlockPlan(swap_out=BlockMoves([2], [3])))
    cache.synchronize()
    assert (cache.swap_space[3, 1] == -2.0).all()


def test_attention_right_after_swap_in_reads_the_swapped_in_data():
    cache = _kv(seed=5)
    torch.cuda.synchronize()
    blocks = [2, 11, 7]               # the sequence's table; its data comes from CPU blocks 4, 0, 6
    cache.blocks[blocks] = float("nan")  # poisoned: reading before the swap-in lands gives NaN
    with torch.cuda.stream(cache._swap_stream):
        torch.cuda._sleep(SPIN)
    cache.execute(BlockPlan(swap_in=BlockMoves([4, 0, 6], blocks)))
    k, v = cache.layer(1)
    q = torch.randn(1, 8, 128, dtype=torch.bfloat16, device=DEV)
    tables = torch.tensor([blocks], dtype=torch.int32, device=DEV)
    lens = torch.tensor([45], dtype=torch.int32, device=DEV)
    out = ops.paged_decode_attention(q, k, v, tables, lens, 128 ** -0.5)
    torch.cuda.synchronize()
    expect_cache = cache.blocks.clone()
    expect_cache[blocks] = cache.swap_space[[4, 0, 6]].to(DEV)
    ref = reference.paged_decode_attention(q, expect_cache[:, 1, 0], expect_cache[:, 1, 1], tables, lens,
                                           128 ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_swap_in_reads_cpu_data_written_by_an_earlier_swap_out():
    cache = _kv()
    x_data = cache.blocks[8].clone()
    with torch.cuda.stream(cache._swap_stream):
        torch.cuda._sleep(SPIN)
    cache.execute(BlockPlan(swap_out=BlockMoves([8], [7])))
    cache.execute(BlockPlan(swap_in=BlockMoves([7], [13])))
    cache.synchronize()
    assert torch.equal(cache.blocks[13], x_data)
