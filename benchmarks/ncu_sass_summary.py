"""Where a warp-specialized kernel's warps wait, from an Nsight Compute source export.

Reads the CSV that ``ncu -i REPORT --page source --csv --print-source sass`` prints (a report taken
with ``--set full --import-source yes``; ``benchmarks/device_check.sh`` with ``PROFILE=1`` takes
and exports one for the prefill kernel) and prints, for each role of the kernel's warps, the share
of the warp-state samples and the stall reasons behind them, then the instructions holding the most
samples; with ``--opcodes``, also how many instructions of each opcode the role executed (the
export's "Instructions Executed" column: where two kernels' instruction counts differ). Roles are told apart by the ``setmaxnreg`` hand-over: the code after the register
increase (``USETMAXREG.TRY_ALLOC``) is the consumers', after the decrease (``DEALLOC``) the
producer's; a kernel without it is one role. Pure Python; runs anywhere.

    python benchmarks/ncu_sass_summary.py sass.csv [--top 30] [--opcodes 25]
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and instruction rows of the export (its first line names the kernel)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    return rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]


def roles(sass: list[str]) -> dict[str, range]:
    """Instruction ranges of the consumers and the producer, split at the setmaxnreg hand-over."""
    up = next((i for i, s in enumerate(sass) if "USETMAXREG.TRY_ALLOC" in s), None)
    down = next((i for i, s in enumerate(sass) if "USETMAXREG.DEALLOC" in s), None)
    if up is None or down is None:
        return {"kernel": range(len(sass))}
    if up < down:
        return {"set-up": range(0, up), "consumers": range(up, down), "producer": range(down, len(sass))}
    return {"set-up": range(0, down), "producer": range(down, up), "consumers": range(up, len(sass))}


EXECUTED = "Instructions Executed"


def opcode(instruction: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: "@!P0 LDG.E.128 R4, [R2]" -> "LDG"."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="instructions listed per role")
    ap.add_argument("--opcodes", type=int, default=0, help="also the N opcodes executed most per role")
    args = ap.parse_args()
    header, rows = read_rows(args.csv)
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    sass = [r[col["Source"]].strip() for r in rows]

    def samples(r: list[str], name: str = SAMPLES) -> int:
        v = r[col[name]].replace(",", "")   # counts may carry thousands separators
        return int(v) if v.isdigit() else 0

    total = sum(samples(r) for r in rows) or 1
    for role, span in roles(sass).items():
        n = sum(samples(rows[k]) for k in span)
        if n == 0:
            continue
        why = Counter({h[len("stall_"):]: sum(samples(rows[k], h) for k in span) for h in stalls})
        print(f"\n{role}: instructions {span.start}-{span.stop - 1}, {n} samples ({100 * n / total:.1f}%)")
        print("  " + ", ".join(f"{k} {100 * v / n:.1f}%" for k, v in why.most_common(8)))
        hot = sorted(sorted(span, key=lambda k: -samples(rows[k]))[:args.top])
        for k in hot:
            reasons = Counter({h[len("stall_"):]: samples(rows[k], h) for h in stalls}).most_common(2)
            print(f"  {k:5} {samples(rows[k]):6} {sass[k][:72]:72} " + " ".join(f"{a}:{b}" for a, b in reasons))
        if args.opcodes and EXECUTED in col:
            executed = Counter()
            for k in span:
                executed[opcode(sass[k])] += samples(rows[k], EXECUTED)
            print(f"  executed: {sum(executed.values()):,} warp instructions; " +
                  ", ".join(f"{op} {n:,}" for op, n in executed.most_common(args.opcodes)))


if __name__ == "__main__":
    main()
