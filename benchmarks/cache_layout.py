"""Why the worker's KV cache is block-major: swap-out cost by layout, on a CUDA device.

Moves 1,024 scattered blocks of a 32-layer, 8-KV-head, head-dim-128, block-16 bf16 cache
(2 MiB per block over all layers, 2 GiB in all) from the device to pinned host memory:

- ceiling:      one contiguous device->pinned copy of the same bytes;
- block-major:  cache [blocks, layers, 2, heads, block, dim]; one gather on the device, one copy;
- layer-major:  cache [layers, 2, blocks, heads, block, dim] (vLLM's per-layer tensors); one
                gather and one copy per layer;
- per block:    one copy per block (block-major), and one per block per layer (layer-major).

Run: python benchmarks/cache_layout.py   (prints GB/s; needs CUDA)
"""

from __future__ import annotations

import torch

LAYERS, HEADS, BLOCK, DIM, MOVED = 32, 8, 16, 128, 1024
DTYPE = torch.bfloat16


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def main() -> None:
    num_blocks = 2 * MOVED
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randperm(num_blocks, generator=gen, device="cuda")[:MOVED]
    block_major = torch.empty(num_blocks, LAYERS, 2, HEADS, BLOCK, DIM, dtype=DTYPE, device="cuda")
    staging = torch.empty(MOVED, LAYERS, 2, HEADS, BLOCK, DIM, dtype=DTYPE, device="cuda")
    host = torch.empty(MOVED, LAYERS, 2, HEADS, BLOCK, DIM, dtype=DTYPE).pin_memory()
    nbytes = host.numel() * host.element_size()

    def ceiling():
        host.copy_(staging, non_blocking=True)

    def block_major_gathered():
        torch.index_select(block_major, 0, src, out=staging)
        host.copy_(staging, non_blocking=True)

    src_list = src.tolist()

    def block_major_per_block():
        for i, b in enumerate(src_list):
            host[i].copy_(block_major[b], non_blocking=True)

    del block_major
    layer_major = torch.empty(LAYERS, 2, num_blocks, HEADS, BLOCK, DIM, dtype=DTYPE, device="cuda")
    layer_staging = staging.view(LAYERS, 2, MOVED, HEADS, BLOCK, DIM)
    layer_host = host.view(LAYERS, 2, MOVED, HEADS, BLOCK, DIM)

    def layer_major_gathered():
        for layer in range(LAYERS):
            torch.index_select(layer_major[layer], 1, src, out=layer_staging[layer])
            layer_host[layer].copy_(layer_staging[layer], non_blocking=True)

    def layer_major_per_block():
        for layer in range(LAYERS):
            for i, b in enumerate(src_list):
                layer_host[layer, :, i].copy_(layer_major[layer, :, b], non_blocking=True)

    results = {"ceiling (one pinned copy)": timed(ceiling)}
    results["layer-major, gather+copy per layer"] = timed(layer_major_gathered)
    results["layer-major, copy per block per layer"] = timed(layer_major_per_block, repeats=2)
    del layer_major
    block_major = torch.empty(num_blocks, LAYERS, 2, HEADS, BLOCK, DIM, dtype=DTYPE, device="cuda")
    results["block-major, one gather+copy"] = timed(block_major_gathered)
    results["block-major, copy per block"] = timed(block_major_per_block)
    print(f"swap-out of {MOVED} blocks, {nbytes / 2**30:.2f} GiB, {torch.cuda.get_device_name()}")
    ceiling_s = results["ceiling (one pinned copy)"]
    for name, seconds in results.items():
        print(f"  {name:40s} {nbytes / seconds / 1e9:7.1f} GB/s  ({ceiling_s / seconds:5.1%} of ceiling)")


if __name__ == "__main__":
    main()
