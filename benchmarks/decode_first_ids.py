"""Experiment: a work item's first block ids read with its record, so the first K/V loads wait on
one memory latency (the record) instead of two (the record, then the item's table slice). Runs
only in a build with ``-DKVPAGER_DECODE_FIRST_IDS=1`` (kernels/csrc/paged_decode.cuh work_item),
whose kernels read 8 ids before every list: every list run here carries them, and header[3] says
whether the kernel uses them (1) or stages the table first as the default build does (0).

By turns, under both L2 flushes: ours without and with the ids (the tensor-core instance: the
H200's planner list, ``--mma`` on an H100), the same over an e4m3 copy of the cache with
``--fp8``, and SDPA over the contiguous cache; % of the copy ceiling and SDPA's time over ours.

    KVPAGER_EXT_CUDA_FLAGS=-DKVPAGER_DECODE_FIRST_IDS=1 KVPAGER_EXT_DIR=build/x_ids \
        python3 benchmarks/decode_first_ids.py --shapes 8x4096,1x32768 --fp8
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import kernels as bench  # benchmarks/kernels.py (this script's folder): shapes, flush and timers
import torch

from decode_turns import FP8_SCALE, TURNS, fp8_views

from kvpager.kernels import cuda, debug

IDS = 8   # ids an item carries (paged_decode.cuh work_item)


def with_first_ids(step: cuda.DecodePlan, tables: torch.Tensor, num_seqs: int, use: bool) -> cuda.DecodePlan:
    """``step`` over a copy of its work list preceded by each item's first IDS table entries
    (item k's at work[-IDS (k + 1)], -1 past the item's blocks), header[3] = ``use``."""
    host = step.work.cpu()
    capacity = (host.numel() - 4 - 2 * num_seqs) // 2
    n, partition = int(host[0]), int(host[1])
    records = host[4:4 + 2 * capacity].view(capacity, 2)
    table = tables.cpu()
    block = bench.B
    ids = torch.full((capacity, IDS), -1, dtype=torch.int32)
    for k in range(n):
        code, end = int(records[k, 0]), int(records[k, 1])
        seq, piece = code >> 16, code & 0xFFFF
        first = piece * partition // block
        count = min(IDS, -(-end // block) - first)
        ids[k, :count] = table[seq, first:first + count]
    whole = torch.cat([ids.flip(0).reshape(-1), host]).to(step.work.device)
    whole[IDS * capacity + 3] = int(use)
    return dataclasses.replace(step, work=whole[IDS * capacity:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x4096,1x32768", help="batch x context, comma-separated")
    ap.add_argument("--mma", action="store_true", help="the tensor-core instance whatever the planner takes")
    ap.add_argument("--fp8", action="store_true", help="also over an e4m3 copy of the cache")
    args = ap.parse_args()
    if "-DKVPAGER_DECODE_FIRST_IDS=1" not in os.environ.get("KVPAGER_EXT_CUDA_FLAGS", ""):
        raise SystemExit("needs a build with KVPAGER_EXT_CUDA_FLAGS=-DKVPAGER_DECODE_FIRST_IDS=1")
    ceiling = bench.copy_ceiling()
    gen = torch.Generator(device="cuda").manual_seed(2)
    for spec in args.shapes.split(","):
        batch, ctx = (int(x) for x in spec.split("x"))
        c = bench.decode_layer(batch, ctx, gen)
        scale = c.q.shape[-1] ** -0.5
        lens = c.lens.tolist()
        caches = {"": (c.k, c.v, 1.0)}
        if args.fp8:
            k8, v8 = fp8_views(c.k, c.v)
            caches[", fp8"] = (k8, v8, FP8_SCALE)
        runs, sizes, outs = {"SDPA": c.sdpa}, {}, {}
        for suffix, (k, v, s) in caches.items():
            geometry = debug.decode_work_geometry(c.q, k, mma=True) if args.mma else cuda.decode_work_geometry(c.q, k)
            step = bench.work_step(lens, geometry)
            for label, use in (("", False), (", first ids", True)):
                plan = with_first_ids(step, c.tables, batch, use)
                out = outs[suffix + label] = torch.empty_like(c.out)
                name = f"ours{suffix}{label}"
                runs[name] = (lambda plan=plan, k=k, v=v, s=s, out=out: cuda.paged_decode_run(
                    plan, c.q, k, v, c.tables, c.lens, scale, out=out, k_scale=s, v_scale=s))
                runs[name]()
                if suffix:
                    sizes[name] = c.nbytes // 2
            same = torch.equal(outs[suffix], outs[suffix + ", first ids"])
            err = (outs[suffix].float() - c.sdpa().view_as(c.out).float()).abs().max().item()
            print(f"{batch} x {ctx}{suffix}: {'tensor cores' if geometry.mma else 'FMA'}, {geometry.workers} workers "
                  f"a KV head; with the ids bitwise equal: {same}; largest error against SDPA {err:.1e}", flush=True)
            if not same:
                raise SystemExit("the first-ids run differs")

        def pct(name, t):
            return 100 * sizes.get(name, c.nbytes) / t / ceiling

        for mode in ("write", "clean"):
            times = {name: [] for name in runs}
            for _ in range(TURNS):
                for name, fn in runs.items():
                    bench.warm_up(fn, 0.1)
                    times[name].append(bench.timed(fn, flush=mode))
            cells = [f"{name} {min(pct(name, x) for x in t):.1f}-{max(pct(name, x) for x in t):.1f}%"
                     for name, t in times.items()]
            ratios = [f"{name} {min(b / a for a, b in zip(t, times['SDPA'])):.3f}-"
                      f"{max(b / a for a, b in zip(t, times['SDPA'])):.3f}"
                      for name, t in times.items() if name != "SDPA"]
            print(f"{batch} x {ctx} {mode}: {', '.join(cells)}; SDPA time over: {'; '.join(ratios)}", flush=True)
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
