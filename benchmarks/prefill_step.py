"""RoPE and attention of a prefill step in the workers' model, end to end: over an fp8 cache with
RoPE writing q split for the attention kernel (``Decoder.write_split_query``, the default) against
RoPE in place and the kernel splitting q itself, and the same step over a 16-bit cache. Kernel
times from the kernels' own durations (CUPTI, through torch.profiler), the three taken by turns.

    python benchmarks/prefill_step.py [--shapes 32x512,8x2048,1x4096] [--layers 2] [--rounds 3] [--dtype float16]

The model is an 8B-shaped Llama (32 q / 8 KV heads, d128, hidden 4096, intermediate 14336, bf16
(or --dtype) weights and activations, seeded random, ``--layers`` layers, vocab 32000), run by
``Decoder.forward_paged`` in this
process over random block tables, every prompt whole in one step. Per layer it prints the time of
the RoPE kernel and the prefill attention kernel (what the split changes) and of every kernel of
the step; the fp8 step's logits with q split and without must be equal, bit for bit.
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from kvpager.numeric import ceil_div
from kvpager.step import StepInput
from kvpager.worker.kv_cache import CacheSpec, KVCache
from kvpager.worker.model import Decoder, ModelConfig

BLOCK = 16
FP8_SCALE = 0.05   # K and V stored as value / scale (the kernels read the same bytes whatever it is)


def prefill_step(lens: list[int], vocab: int, num_blocks: int, rng: random.Random) -> StepInput:
    """Whole prompts of ``lens`` random tokens in one step, their blocks drawn at random."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    width = ceil_div(max(lens), BLOCK)
    tables, tokens, positions, slots = [], [], [], []
    for n in lens:
        row = [free.pop() for _ in range(ceil_div(n, BLOCK))]
        tables.append(row + [0] * (width - len(row)))
        tokens += [rng.randrange(vocab) for _ in range(n)]
        positions += list(range(n))
        slots += [row[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    return StepInput(step_id=1, plan_step_id=0, token_ids=tokens, positions=positions, slot_mapping=slots,
                     query_lens=list(lens), context_lens=list(lens),
                     block_tables=np.asarray([b for t in tables for b in t], dtype="<i4"), max_blocks=width,
                     greedy=True)


def step_kernels(run, reps: int) -> tuple[float, float]:
    """Seconds per call of run() in RoPE + prefill attention kernels, and in every kernel."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))]
    ours = sum(e.device_time for e in kernels if "rope" in e.name or "prefill" in e.name)
    return ours / reps / 1e6, sum(e.device_time for e in kernels) / reps / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32x512,8x2048,1x4096", help="prompts x tokens, comma-separated")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="the model's dtype")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shape = dict(num_layers=args.layers, hidden_size=4096, num_q_heads=32, num_kv_heads=8, head_dim=128,
                 intermediate_size=14336, vocab_size=32000, dtype=args.dtype, max_position_embeddings=8192, seed=0)
    models = {"fp8": Decoder(ModelConfig(**shape, kv_cache_dtype="fp8_e4m3", kv_scale=FP8_SCALE), device=dev),
              "16-bit": Decoder(ModelConfig(**shape), device=dev)}
    print(f"prefill step of an 8B-shaped {args.dtype} model ({args.layers} layers, random weights), kernel times per "
          f"layer (CUPTI), {args.rounds} rounds by turns; 'rope + attn': the RoPE and prefill attention kernels")
    print(f"{'shape':>9} | {'fp8, q split by RoPE':>20} | {'fp8, RoPE in place':>18} | {args.dtype + ' cache':>10} | "
          f"{'split / in place':>16} | {'all kernels ms (split, in place, 16-bit)':>38}")
    rng = random.Random(0)
    for spec in args.shapes.split(","):
        count, length = (int(x) for x in spec.split("x"))
        lens = [length] * count
        num_blocks = count * ceil_div(length, BLOCK) + 1
        caches = {name: KVCache(CacheSpec(args.layers, 8, 128, BLOCK, m.cfg.cache_dtype), num_blocks, 1, dev)
                  for name, m in models.items()}
        step = prefill_step(lens, 32000, num_blocks, rng)

        def run(name: str, split: bool):
            model = models[name]
            model.write_split_query = split
            with torch.inference_mode():
                return model.forward_paged(step, caches[name].layer)

        logits_split, logits_in_place = run("fp8", True), run("fp8", False)
        assert torch.equal(logits_split, logits_in_place), "q split by RoPE changed the fp8 step's logits"
        turns = [tuple(step_kernels(lambda: run(name, split), args.reps)
                       for name, split in (("fp8", True), ("fp8", False), ("16-bit", True)))
                 for _ in range(args.rounds)]
        per_layer = [[t[i][0] / args.layers * 1e6 for t in turns] for i in range(3)]
        total = [statistics.median(t[i][1] for t in turns) * 1e3 for i in range(3)]
        ratio = [t[0][0] / t[1][0] for t in turns]
        cells = [f"{min(x):.1f}-{max(x):.1f} us" for x in per_layer]
        print(f"{spec:>9} | {cells[0]:>20} | {cells[1]:>18} | {cells[2]:>10} | "
              f"{min(ratio):.3f}-{max(ratio):.3f}{'':>5} | {total[0]:12.2f} {total[1]:12.2f} {total[2]:12.2f}")
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
