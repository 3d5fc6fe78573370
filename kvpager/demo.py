"""The main job (``make demo``): the whole system serving a few hundred requests on one machine.

It starts the block manager (gRPC, on a loopback port), a local Ray cluster with two
tensor-parallel CPU workers (or one worker per GPU it finds, up to two), and the reference
scheduler. Requests arrive over time with shared system prompts, varied lengths and parallel
sampling; the pool is small enough that requests get preempted by swap. At the end it checks
every generated token against the same model with a plain contiguous cache, checks the
manager's invariants, and prints throughput and memory figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time

import torch

from kvpager import client as C
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.scheduler import Request, SamplingParams, Scheduler
from kvpager.scheduler.reference import generate_contiguous
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.model import Llama, ModelConfig

MODEL = ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=16,
                    intermediate_size=256, seed=7)
# On GPUs: a head dim our CUDA decode kernel is built for (64, 128 or 256).
GPU_MODEL = ModelConfig(vocab_size=256, hidden_size=256, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=64,
                        intermediate_size=512, seed=7)


def make_requests(count: int, seed: int) -> list[tuple[int, Request]]:
    """(arrival step, request): Poisson arrivals, shared system prompts, n of 1 to 3."""
    rng = random.Random(seed)
    systems = [[rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(32, 96))] for _ in range(5)]
    out, step = [], 0
    for i in range(count):
        step += int(rng.expovariate(1 / 1.5))
        system = rng.choice(systems) if rng.random() < 0.7 else []
        prompt = system + [rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(4, 60))]
        params = SamplingParams(max_new_tokens=rng.randint(4, 48), n=rng.choice([1, 1, 1, 2, 3]))
        out.append((step, Request(f"req-{i:04d}", prompt, params)))
    return out


class Progress:
    """A one-line progress bar on stderr (a line every 10% when stderr is not a terminal)."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet, self.tty = total, quiet, sys.stderr.isatty()
        self._last_decile = -1

    def update(self, done: int, running: int, swapped: int, util: float) -> None:
        if self.quiet:
            return
        filled = 30 * done // self.total
        line = (f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} done  running {running:3d}  "
                f"swapped {swapped:2d}  KV util {util:4.0%}")
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif 10 * done // self.total > self._last_decile:
            self._last_decile = 10 * done // self.total
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr)


def start_workers(model: ModelConfig, target: str, block_size: int, gpu_blocks: int, use_ray: bool):
    """Two tensor-parallel workers as Ray actors (GPU ones when there are GPUs), or one in-process."""
    config = WorkerConfig(model=model, block_size=block_size, num_gpu_blocks=gpu_blocks, num_cpu_blocks=4 * gpu_blocks,
                          manager_address=target)
    if not use_ray:
        worker = CacheWorker(config)
        worker.start()
        return worker.execute_model, worker.stop, "1 in-process worker"
    from kvpager.worker.ray_group import RayWorkerGroup, init_local_ray

    gpus = torch.cuda.device_count()
    init_local_ray(num_cpus=4, num_gpus=gpus)
    tp = min(2, gpus) if gpus else 2
    group = RayWorkerGroup(config, tensor_parallel_size=tp, use_gpu=gpus > 0)
    kind = f"{tp} Ray {'GPU' if gpus else 'CPU'} worker(s), tensor parallel {tp}"
    return group, group.stop, kind


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpager.demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-blocks", type=int, default=160, help="KV blocks per worker (small: forces swaps)")
    parser.add_argument("--no-ray", action="store_true", help="one worker in this process instead of Ray actors")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                        help="KV storage: the model's dtype, or fp8 e4m3 with --kv-scale")
    parser.add_argument("--kv-scale", type=float, default=0.25, help="per-tensor K/V scale of an fp8 cache")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    config = ManagerConfig(block_size=args.block_size, num_gpu_blocks=0, num_cpu_blocks=0, watermark=0.01)
    server, port, service, _ = create_server(config, "127.0.0.1:0")
    server.start()
    client = C.BlockManagerClient(f"127.0.0.1:{port}")
    model = GPU_MODEL if torch.cuda.is_available() else MODEL
    if args.kv_cache_dtype != "auto":
        model = dataclasses.replace(model, kv_cache_dtype=args.kv_cache_dtype, kv_scale=args.kv_scale)
    runner, stop_workers, kind = start_workers(model, client.target, args.block_size, args.gpu_blocks, not args.no_ray)
    try:
        arrivals = make_requests(args.requests, args.seed)
        progress = Progress(len(arrivals), args.quiet)
        utils, frags = [], []

        def on_step(s: Scheduler) -> None:
            st = client.get_stats()
            utils.append(st.gpu_utilization)
            frags.append(st.internal_fragmentation)
            progress.update(s.stats.requests_finished, len(s.running), len(s.swapped), st.gpu_utilization)

        scheduler = Scheduler(client, runner, args.block_size, on_step=on_step)
        started, iteration, pending = time.perf_counter(), 0, list(arrivals)
        while pending or scheduler.has_work:
            while pending and pending[0][0] <= iteration:
                scheduler.add(pending.pop(0)[1])
            scheduler.step()
            iteration += 1
        elapsed = time.perf_counter() - started
        progress.close()

        requests = [r for _, r in arrivals]
        expected = generate_contiguous(Llama(model), requests)
        matches = sum(scheduler.outputs[r.request_id].samples == expected[r.request_id] for r in requests)
        final = client.get_stats()
        with service.lock:
            service.manager.check_invariants()
        st, lat = scheduler.stats, [t * 1e3 for t in scheduler.stats.step_latencies]
        hit = final.prefix_hit_tokens / final.prefix_query_tokens if final.prefix_query_tokens else 0.0
        print(f"kvpager demo: {len(requests)} requests on {kind}, block size {args.block_size}, "
              f"{final.gpu.total_blocks} GPU / {final.cpu.total_blocks} CPU blocks, KV cache "
              f"{str(model.cache_dtype).removeprefix('torch.')}")
        print(f"  generated          {st.tokens_generated} tokens ({st.tokens_computed} computed) in {elapsed:.1f} s: "
              f"{st.tokens_generated / elapsed:.0f} tokens/s, {st.steps} steps")
        print(f"  KV utilization     peak {max(utils):.1%}, mean {statistics.fmean(utils):.1%}")
        print(f"  fragmentation      {statistics.fmean(frags):.1%} of allocated slots unfilled (mean over steps)")
        print(f"  prefix cache       {hit:.1%} of prompt tokens hit ({final.prefix_hit_tokens}/{final.prefix_query_tokens})")
        print(f"  swaps              {st.preemptions} preemptions, {final.blocks_swapped_out} blocks out, "
              f"{final.blocks_swapped_in} in; {st.restarts} restarts")
        print(f"  copy-on-write      {final.cow_copies} block copies")
        print(f"  Step latency       p50 {percentile(lat, 0.5):.2f} ms, p99 {percentile(lat, 0.99):.2f} ms")
        print(f"  correctness        {matches}/{len(requests)} requests equal the contiguous-cache reference")
        leftover = final.running_sequences + final.swapped_sequences + final.gpu.used_blocks + final.cpu.used_blocks
        print(f"  invariants         OK{'' if not leftover else f' but {leftover} sequences/blocks left over'}")
        return 0 if matches == len(requests) and not leftover else 1
    finally:
        stop_workers()
        client.close()
        server.stop(None)
        service.close()


if __name__ == "__main__":
    sys.exit(main())
