"""Where a decode step of the workers' model goes: host wall time against GPU kernel time, and
the top kernels and host-side ops, for a batch of ragged contexts over the paged cache.

    python benchmarks/model_step.py --checkpoint DIR [--batch 110] [--context 1430] [--steps 5]

Runs ``worker.model.Decoder.forward_paged`` in this process (no Ray, no manager) on one CUDA
device, in the checkpoint's dtype (bf16 by default), with random block tables; prints the step's
wall time, the sum of its GPU kernel times, their ratio (how launch-bound the step is) and its
HBM roofline (weights plus K/V bytes over a measured device copy ceiling). A tool for finding
what to fix; the serving figures come from benchmarks/serving.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch

from kvpager.numeric import ceil_div
from kvpager.step import StepInput
from kvpager.worker.decode_graphs import DecodeGraphs
from kvpager.worker.kv_cache import CacheSpec, KVCache
from kvpager.worker.model import Decoder, ModelConfig


def copy_ceiling(device: torch.device) -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write counted once each)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=110)
    ap.add_argument("--context", type=int, default=1430, help="mean context; lengths uniform in [context/4, 7/4]")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = ModelConfig.from_pretrained(args.checkpoint, dtype=args.dtype)
    model = Decoder(cfg, device=dev)
    rng = random.Random(0)
    lens = [rng.randint(args.context // 4, args.context * 7 // 4) for _ in range(args.batch)]
    B = args.block_size
    width = ceil_div(max(lens), B)
    num_blocks = sum(ceil_div(n, B) for n in lens) + 1
    cache = KVCache(CacheSpec(cfg.num_layers, model.kv_heads, cfg.head_dim, B, cfg.cache_dtype), num_blocks, 1, dev)
    cache.blocks.normal_()
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = []
    for n in lens:
        row = [free.pop() for _ in range(ceil_div(n, B))]
        tables.append(row + [0] * (width - len(row)))
    step = StepInput(step_id=1, plan_step_id=0, token_ids=[rng.randrange(cfg.vocab_size) for _ in lens],
                     positions=[n - 1 for n in lens], slot_mapping=[t[(n - 1) // B] * B + (n - 1) % B
                                                                  for t, n in zip(tables, lens)],
                     query_lens=[1] * len(lens), context_lens=lens, block_tables=[b for t in tables for b in t],
                     max_blocks=width, greedy=True)
    for _ in range(3):
        model.forward_paged(step, cache.layer).argmax(-1).cpu()
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        model.forward_paged(step, cache.layer).argmax(-1).cpu()
        walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(args.steps):
            model.forward_paged(step, cache.layer).argmax(-1).cpu()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / args.steps
    weight_bytes = sum(t.numel() * t.element_size() for t in [model.embed, model.final_norm]
                       + [getattr(layer, f.name) for layer in model.layers for f in dataclasses.fields(layer)
                          if getattr(layer, f.name) is not None])
    if not cfg.tie_word_embeddings:
        weight_bytes += model.lm_head.numel() * model.lm_head.element_size()
    kv_bytes = sum(lens) * cache.spec.block_bytes // B
    ceiling = copy_ceiling(dev)
    roofline_ms = (weight_bytes + kv_bytes) / ceiling * 1e3
    wall_ms = sorted(walls)[len(walls) // 2] * 1e3
    print(f"model {args.checkpoint}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {args.dtype}; batch "
          f"{args.batch}, {sum(lens):,} context tokens")
    print(f"decode step wall p50 {wall_ms:.2f} ms; GPU kernel time {gpu_us / 1e3:.2f} ms "
          f"({gpu_us / 1e3 / wall_ms:.0%} of the wall); roofline {roofline_ms:.2f} ms "
          f"(weights {weight_bytes / 1e9:.2f} GB + K/V {kv_bytes / 1e9:.2f} GB at {ceiling / 1e9:.0f} GB/s): "
          f"wall at {roofline_ms / wall_ms:.0%} of roofline, kernels at {roofline_ms / (gpu_us / 1e3):.0%}")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))

    # The same step replayed from a CUDA graph (what the worker runs for decode steps).
    graphs = DecodeGraphs(model, cache, max_batch=max(args.batch, 1), max_blocks=width)
    eager = model.forward_paged(step, cache.layer)
    replayed = graphs.run(step)
    agree = (eager.argmax(-1) == replayed.argmax(-1)).float().mean().item()
    for _ in range(3):
        graphs.run(step).argmax(-1).cpu()
    graph_walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        graphs.run(step).argmax(-1).cpu()
        graph_walls.append(time.perf_counter() - t0)
    graph_ms = sorted(graph_walls)[len(graph_walls) // 2] * 1e3
    print(f"CUDA graph: decode step wall p50 {graph_ms:.2f} ms ({eager_ms_label(wall_ms, graph_ms)}), at "
          f"{roofline_ms / graph_ms:.0%} of roofline; capture {graphs.capture_seconds * 1e3:.0f} ms; greedy tokens "
          f"equal to the eager step's for {agree:.0%} of the rows")


def eager_ms_label(eager_ms: float, graph_ms: float) -> str:
    return f"{eager_ms / graph_ms:.2f}x faster than eager {eager_ms:.2f} ms"


if __name__ == "__main__":
    main()
