"""The worker's C++ work-list planner (kernels/csrc/decode_plan.cu) timed on this CPU, with no
GPU: the planner's host code is compiled with nvcc and tests/support/decode_plan_main.cu, then
each case is planned N times (best of N, microseconds). With --base DIR (a checkout, e.g.
``git archive <commit> | tar -x -C DIR``) the base tree's planner is timed beside this one, in
the same run. Cases: the decode steps of benchmarks/model_step.py --launch-cost (contexts uniform
in 319-2234) and longer ragged ones, 66 workers (the 1B shape on an H100), items of at most 1,024
tokens.

    python3 benchmarks/host_planner.py [--base DIR] [--reps 2000]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kvpager.kernels import decode_plan

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "support" / "decode_plan_main.cu"
CASES = [(32, 319, 2234), (64, 319, 2234), (128, 319, 2234), (256, 319, 2234), (512, 319, 2234), (64, 1, 32768)]
WORKERS, LONGEST = 66, 1024


def build(tree: Path, out: Path) -> Path:
    csrc = tree / "kernels" / "csrc"
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-I", str(csrc), str(DRIVER), str(csrc / "decode_plan.cu"), "-o", str(out)],
                   check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="a checkout whose planner to time beside this tree's")
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    text = ""
    for rows, lo, hi in CASES:
        lens = rng.integers(lo, hi, rows)
        text += (f"{rows} {WORKERS} {LONGEST} {decode_plan.capacity_for(rows, WORKERS)} {decode_plan.MIN_ITEM} "
                 f"{decode_plan.ITEM_COST}\n{' '.join(map(str, lens))}\n")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT} | ({"base": args.base} if args.base else {})
        times = {}
        for name, tree in trees.items():
            exe = build(tree, Path(tmp) / name.replace(" ", "_"))
            out = subprocess.run([str(exe), "--time", str(args.reps)], input=text, capture_output=True, text=True, check=True)
            times[name] = [float(x) for x in out.stdout.split()]
    print(f"C++ work-list planner, best of {args.reps} calls (us), {WORKERS} workers, items <= {LONGEST} tokens:")
    print(f"{'rows':>5} {'contexts':>12} " + " ".join(f"{n:>10}" for n in times) + ("   base / this" if args.base else ""))
    for i, (rows, lo, hi) in enumerate(CASES):
        cells = " ".join(f"{times[n][i]:10.2f}" for n in times)
        ratio = f"   {times['base'][i] / times['this tree'][i]:.2f}x" if args.base else ""
        print(f"{rows:>5} {f'{lo}-{hi}':>12} {cells}{ratio}")


if __name__ == "__main__":
    main()
