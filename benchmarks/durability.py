"""The cost of the write-ahead log: a decode Step of 256 sequences against a manager without a
state directory and one with ``--state-dir`` (``--fsync always`` by default), side by side.

    .venv/bin/python benchmarks/durability.py [--seqs 256] [--steps 400] [--fsync always,batch]
                                              [--dir DIR] [--prompt 512] [--json PATH]

Each manager is a real ``python -m kvpager manager`` subprocess on 127.0.0.1 (its own GIL), with
the same pools. ``--seqs`` sequences with prompts of ``--prompt`` tokens (distinct token ids)
are allocated in each (untimed); then each round sends, to every manager in a shuffled order,
one decode Step: one AppendBatch operation appending one token to every sequence, with a
request id and packed padded tables, as ``kvpager.scheduler.engine`` sends it. Sequences are
freed and allocated again (untimed) every ``--reset-every`` steps so the shape stays steady.
Printed: p50/p99/mean of the Step round trip per manager and the ratio to the one without a
state directory; the log's bytes per Step. ``--dir``: where the state directories go (default:
a temporary directory under the current directory, i.e. on the local disk of the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

from kvpager import client as C
from kvpager.numeric import ceil_div, percentile
from kvpager.v1 import block_manager_pb2 as pb


def start(flags: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvpager", "manager", "--insecure", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    match = re.search(r"listening on (\S+)", proc.stdout.readline())
    if not match:
        proc.kill()
        raise SystemExit(f"manager did not start: {flags}")
    return proc, match.group(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reset-every", type=int, default=100)
    ap.add_argument("--fsync", default="always", help="comma-separated --fsync modes to compare (always,batch,never)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    base = tempfile.mkdtemp(prefix="kvpager-durability-bench-", dir=args.dir or os.getcwd())
    blocks = args.seqs * (ceil_div(args.prompt + args.reset_every + 1, 16) + 1) + 64
    pool = ["--block-size", "16", "--num-gpu-blocks", str(blocks), "--num-cpu-blocks", "64"]
    servers: dict[str, tuple] = {}
    try:
        servers["no state dir"] = start(pool)
        for mode in args.fsync.split(","):
            d = os.path.join(base, mode)
            servers[f"--fsync {mode}"] = start(pool + ["--state-dir", d, "--fsync", mode]) + (d,)
        clients = {name: C.BlockManagerClient(s[1], timeout=30) for name, s in servers.items()}
        ids = [f"seq-{i}" for i in range(args.seqs)]
        rng = random.Random(0)

        def reset(bm, first: bool) -> None:
            for i, seq_id in enumerate(ids):
                if not first:
                    bm.free(seq_id)
                bm.allocate(seq_id, token_ids=[(i * 7919 + j) % 32000 for j in range(args.prompt)])

        for bm in clients.values():
            reset(bm, True)
        times: dict[str, list[float]] = {name: [] for name in clients}
        for step in range(args.steps):
            if step and step % args.reset_every == 0:
                for bm in clients.values():
                    reset(bm, False)
            tokens = [rng.randrange(32000) for _ in ids]
            order = list(clients)
            rng.shuffle(order)
            for name in order:
                started = time.perf_counter()
                clients[name].step([C.append_batch_op(ids, tokens)], table_layout=pb.TABLE_LAYOUT_PADDED_PACKED)
                times[name].append(time.perf_counter() - started)
        log_bytes = {}
        for name, s in servers.items():
            if len(s) == 3:
                log_bytes[name] = sum(os.path.getsize(os.path.join(s[2], f)) for f in os.listdir(s[2])
                                      if f.startswith("wal."))
        ref = sorted(times["no state dir"])
        print(f"Step of {args.seqs} decode appends, {args.steps} rounds, packed tables; state dirs under {base} "
              f"(load average {os.getloadavg()[0]:.2f})")
        print(f"{'manager':<16} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'p50 ratio':>10} {'mean ratio':>10}")
        result = {}
        for name, xs in times.items():
            mean = sum(xs) / len(xs)
            result[name] = dict(p50_ms=percentile(xs, 50) * 1e3, p99_ms=percentile(xs, 99) * 1e3, mean_ms=mean * 1e3,
                                p50_ratio=percentile(xs, 50) / percentile(ref, 50), mean_ratio=mean / (sum(ref) / len(ref)))
            r = result[name]
            print(f"{name:<16} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['mean_ms']:8.2f} {r['p50_ratio']:10.2f} "
                  f"{r['mean_ratio']:10.2f}")
        for name, n in log_bytes.items():
            print(f"{name}: log segment now {n} bytes (snapshots rotate it)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(args=vars(args), result=result), f, indent=1)
        for bm in clients.values():
            bm.close()
    finally:
        for s in servers.values():
            s[0].kill()
            s[0].wait()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
