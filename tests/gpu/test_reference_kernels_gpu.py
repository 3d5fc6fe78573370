"""The torch reference kernels on CUDA tensors agree with float64 attention, and the cache
operations move exactly the right blocks between device and pinned host memory."""

from __future__ import annotations

import pytest
import torch

from kvpager.kernels import reference
from kvpager.numeric import ceil_div

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _paged(num_blocks, num_kv_heads, block_size, head_dim, dtype, context_lens, gen):
    """A random contiguous K/V per sequence, scattered into a shuffled block-major cache."""
    layers = 2
    cache = torch.randn(num_blocks, layers, 2, num_kv_heads, block_size, head_dim, generator=gen).to(DEV, dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(ceil_div(c, block_size) for c in context_lens)
    tables, truth = [], []
    for ctx in context_lens:
        n = ceil_div(ctx, block_size)
        table = [perm.pop() for _ in range(n)]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(DEV, dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(DEV, dtype)
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(ctx)], device=DEV)
        reference.write_kv(k, v, cache[:, 1, 0], cache[:, 1, 1], slots)
        tables.append(table + [0] * (max_blocks - n))
        truth.append((k.double(), v.double()))
    return cache, torch.tensor(tables, dtype=torch.int32, device=DEV), truth


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_float64(dtype, tol, group):
    gen = torch.Generator().manual_seed(group)
    block_size, kv_heads, head_dim = 16, 2, 128
    lens = [1, block_size - 1, block_size, block_size + 1, 700]
    cache, tables, truth = _paged(128, kv_heads, block_size, head_dim, dtype, lens, gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(DEV, dtype)
    out = reference.paged_decode_attention(q, cache[:, 1, 0], cache[:, 1, 1], tables,
                                           torch.tensor(lens, dtype=torch.int32, device=DEV), head_dim ** -0.5)
    for i, (k, v) in enumerate(truth):
        kq = k.repeat_interleave(group, dim=1)
        vq = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), kq) * head_dim ** -0.5
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), vq)
        err = (out[i].double() - ref).norm() / ref.norm()
        assert err < tol, (i, float(err))


def test_swap_between_device_and_pinned_host_moves_exact_blocks():
    gen = torch.Generator().manual_seed(0)
    gpu = torch.randn(64, 2, 2, 2, 16, 64, generator=gen).to(DEV, torch.bfloat16)
    cpu = torch.randn(32, 2, 2, 2, 16, 64, generator=gen).to(torch.bfloat16).pin_memory()
    gpu_before, cpu_before = gpu.clone(), cpu.clone()
    src, dst = torch.tensor([5, 9, 63, 0]), torch.tensor([31, 2, 7, 8])
    reference.swap_blocks(gpu, cpu, src, dst)
    torch.cuda.synchronize()
    assert torch.equal(cpu[dst], gpu_before[src].cpu())
    others = [i for i in range(32) if i not in dst.tolist()]
    assert torch.equal(cpu[others], cpu_before[others])
    reference.swap_blocks(cpu, gpu, torch.tensor([31]), torch.tensor([40]))
    torch.cuda.synchronize()
    assert torch.equal(gpu[40], gpu_before[5])
    reference.copy_blocks(gpu, torch.tensor([40]), torch.tensor([41]))
    assert torch.equal(gpu[41], gpu_before[5])
