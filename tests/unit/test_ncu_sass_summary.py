"""benchmarks/ncu_sass_summary.py on a small export written like Nsight Compute's source page:
the roles split at the setmaxnreg hand-over, each role's share of the samples and its stall
reasons, and its hottest instructions; a kernel without the hand-over is one role."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ncu_sass_summary.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_barrier", "stall_long_sb", "stall_wait", "stall_barrier (Not Issued)"]


def write_export(path: Path, body: list[tuple[str, int, int, int, int]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "void k()"])
        w.writerow(HEADER)
        for k, (sass, barrier, long_sb, wait, executed) in enumerate(body):
            w.writerow([hex(0x1000 + 16 * k), sass, barrier + long_sb + wait, executed, barrier, long_sb, wait, 0])


def run(path: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_roles_split_at_the_register_hand_over(tmp_path):
    export = tmp_path / "sass.csv"
    write_export(export, [
        ("LDC R1, c[0x0][0x28]", 0, 0, 2, 10),
        ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 0, 0, 0, 10),
        ("HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR12], RZ, !UPT", 0, 0, 30, 100),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 50, 0, 0, 100),
        ("USETMAXREG.DEALLOC.CTAPOOL 0x38", 0, 0, 0, 5),
        ("LDG.E R4, desc[UR4][R2.64]", 0, 18, 0, 40),
    ])
    out = run(export, "--top", "1")
    assert "consumers: instructions 1-3, 80 samples (80.0%)" in out
    assert "barrier 62.5%, wait 37.5%" in out
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x0" in out and "barrier:50" in out
    assert "HGMMA" not in out   # --top 1: only the consumers' hottest instruction
    assert "producer: instructions 4-5, 18 samples (18.0%)" in out and "long_sb 100.0%" in out


def test_a_kernel_without_the_hand_over_is_one_role(tmp_path):
    export = tmp_path / "sass.csv"
    write_export(export, [("FFMA R1, R2, R3, R4", 0, 0, 4, 8), ("EXIT", 1, 0, 0, 8)])
    out = run(export)
    assert out.strip().startswith("kernel: instructions 0-1, 5 samples (100.0%)")


def test_opcodes_counts_each_roles_executed_instructions_by_opcode(tmp_path):
    export = tmp_path / "sass.csv"
    write_export(export, [
        ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 0, 0, 0, 10),
        ("@P0 FFMA R1, R2, R3, R4", 0, 0, 4, 1000),
        ("FFMA.FTZ R5, R2, R3, R4", 0, 0, 1, 500),
        ("MUFU.EX2 R6, R6", 0, 0, 1, 300),
        ("USETMAXREG.DEALLOC.CTAPOOL 0x38", 0, 0, 0, 5),
        ("@!P1 LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64], P1", 0, 9, 0, 2000),
    ])
    out = run(export, "--opcodes", "2")
    # predicates and modifiers dropped; the role's total, then its N commonest opcodes
    assert "executed: 1,810 warp instructions; FFMA 1,500, MUFU 300" in out
    assert "executed: 2,005 warp instructions; LDGSTS 2,000, USETMAXREG 5" in out
    assert "executed:" not in run(export)   # only with --opcodes
