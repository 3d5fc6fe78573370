"""A kernel's SASS without a GPU: where ptxas put an instruction, and how many of each opcode.

Compiles one CUDA source of kernels/csrc for sm_90a (nvcc, as the extension builds it, plus any
-D flags), disassembles the cubin with nvdisasm, and prints for each kernel whose mangled name
matches --kernel its static opcode counts and, with --around, the opcode sequence (runs
compressed: FMNMXx63) around each instruction of that opcode. This is how the seventh session of
2026-11-26 found that ptxas moves the warp-specialized consumer's wait for P V above the softmax
(docs/performance.md, "Beside cuDNN's kernel"):

    python benchmarks/sass_static.py kernels/csrc/paged_prefill.cu \\
        --kernel "paged_prefill_ws_kernel.*bfloat16.*Li128" --around WARPGROUP.DEPBAR

nvdisasm is not in the CUDA toolkit here; PyPI has it: `pip download --no-deps
nvidia-cuda-nvdisasm`, unzip the wheel, and pass --nvdisasm (or set NVDISASM) to its
nvidia/cu13/bin/nvdisasm. Static counts are per instruction in the code, not per execution
(ncu_sass_summary.py --opcodes gives those, from a profile).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

from ncu_sass_summary import opcode  # benchmarks/ (this script's folder)

INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,6}\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"^\s*\.text\.(\S+):")


def disassemble(source: str, flags: list[str], nvdisasm: str) -> str:
    """The SASS of `source` built for sm_90a (-O3, C++17, kernels/csrc on the include path)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run(["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-std=c++17", "-O3",
                        "-I", os.path.dirname(os.path.abspath(source)), *flags, "-cubin", source, "-o", cubin],
                       check=True)
        return subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout


def functions(sass: str) -> dict[str, list[str]]:
    """Each kernel's instructions (text without address and semicolon), by mangled name."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = INSTRUCTION.search(line)
        if m and current is not None:
            current.append(m.group(1))
    return out


def label(instruction: str) -> str:
    """The opcode, keeping the first modifier of WARPGROUP ones (ARRIVE, DEPBAR)."""
    op = opcode(instruction)
    if op == "WARPGROUP":
        words = instruction.split()
        word = words[1] if words[0].startswith("@") else words[0]
        return ".".join(word.split(".")[:2])
    return op


def compressed(ops: list[str]) -> str:
    """Runs of one opcode as OPxN."""
    out, prev, n = [], None, 0
    for op in ops + [None]:
        if op == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev}x{n}" if n > 1 else prev)
        prev, n = op, 1
    return " ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="a .cu file of kernels/csrc")
    ap.add_argument("--kernel", default=".", help="regex on the mangled kernel names (default: all)")
    ap.add_argument("--around", default="", help="an opcode label (e.g. WARPGROUP.DEPBAR, MUFU): the sequence around each")
    ap.add_argument("--window", type=int, default=40, help="instructions shown before and after with --around")
    ap.add_argument("--top", type=int, default=25, help="opcodes counted per kernel")
    ap.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro for nvcc, as -D NAME=VALUE")
    args = ap.parse_args()
    sass = disassemble(args.source, [f"-D{d}" for d in args.defines], args.nvdisasm)
    for name, instructions in functions(sass).items():
        if not re.search(args.kernel, name):
            continue
        ops = [label(i) for i in instructions]
        print(f"\n{name}: {len(ops)} instructions; " +
              ", ".join(f"{op} {n}" for op, n in Counter(ops).most_common(args.top)))
        if args.around:
            for k, op in enumerate(ops):
                if op == args.around:
                    lo, hi = max(0, k - args.window), k + args.window + 1
                    print(f"  [{k}] {compressed(ops[lo:k])} >>{op}<< {compressed(ops[k + 1:hi])}")


if __name__ == "__main__":
    main()
