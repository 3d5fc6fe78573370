"""The reference scheduler's host cost per decode iteration, against a real manager over gRPC.

A manager on 127.0.0.1 (in this process, as the embedded system runs it), ``--seqs`` requests with
prompts of 128-2,048 tokens admitted first, then ``--steps`` overlapped decode iterations timed,
with a runner that answers at once (it feeds tokens back, as a single-rank Ray group does): what
is left is the scheduler's own work and its Step RPC, the part of each step the GPU must hide.
Prints the iteration's wall time, its Step RPC and the rest (the scheduler's Python); with
``--profile``, a cProfile of the timed iterations.

    python benchmarks/scheduler_iteration.py [--seqs 331] [--steps 200] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch

from kvpager import client as C
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.scheduler import Request, SamplingParams, Scheduler


class InstantRunner:
    """Answers every step at once with token 0 for each computed sequence."""

    feeds_back = True

    def submit(self, step):
        out = torch.zeros(len(step.query_lens), dtype=torch.long)
        return lambda: out

    def __call__(self, step):
        return self.submit(step)()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=331, help="sequences decoding (default 331, the 1B serving p50)")
    ap.add_argument("--steps", type=int, default=200, help="timed iterations (default 200)")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the timed iterations")
    args = ap.parse_args()
    server, port, service, _ = create_server(
        ManagerConfig(block_size=16, num_gpu_blocks=args.seqs * 200, num_cpu_blocks=1024), "127.0.0.1:0")
    server.start()
    try:
        client = C.BlockManagerClient(f"127.0.0.1:{port}")
        rng = random.Random(0)
        sched = Scheduler(client, InstantRunner(), 16, max_batch_tokens=8192, overlap=True,
                          on_token=lambda *a: None)
        for i in range(args.seqs):
            prompt = [rng.randrange(32000) for _ in range(rng.randint(128, 2048))]
            sched.add(Request(f"r{i}", prompt, SamplingParams(max_new_tokens=args.steps + 50)))
        while sched.waiting:
            sched.step()
        sched.step()
        latencies = sched.stats.step_latencies
        walls, rpcs = [], []
        profile = cProfile.Profile() if args.profile else None
        for _ in range(args.steps):
            n = len(latencies)
            if profile:
                profile.enable()
            started = time.perf_counter()
            sched.step()
            walls.append(time.perf_counter() - started)
            if profile:
                profile.disable()
            rpcs.append(sum(latencies[n:]))
        wall, rpc = statistics.median(walls), statistics.median(rpcs)
        rest = statistics.median(w - r for w, r in zip(walls, rpcs))
        print(f"{len(sched.running)} sequences decoding, {args.steps} iterations: p50 iteration {wall * 1e3:.2f} ms, "
              f"Step RPC {rpc * 1e3:.2f} ms, scheduler Python {rest * 1e3:.2f} ms")
        if profile:
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    finally:
        server.stop(None)
        service.close()


if __name__ == "__main__":
    main()
