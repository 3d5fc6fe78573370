"""CPU check that the worker's C++ work-list planner (kernels/csrc/decode_plan.cu) plans exactly
what kernels/decode_plan.py plans, on random ragged lengths (padding rows, lengths past a worker
count's whole rounds, too-long contexts that neither can plan). The GPU suite compares them
through the extension too (tests/gpu/test_cuda_kernels.py); this one needs only nvcc, compiling
the planner's host code with tests/support/decode_plan_main.cu. Skipped where nvcc is not on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvpager.kernels import decode_plan

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kernels" / "csrc"


@pytest.fixture(scope="module")
def planner(tmp_path_factory) -> Path:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    exe = tmp_path_factory.mktemp("planner") / "decode_plan_main"
    cmd = ["nvcc", "-std=c++17", "-O2", "-I", str(CSRC), str(ROOT / "tests" / "support" / "decode_plan_main.cu"),
           str(CSRC / "decode_plan.cu"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=lambda: os.nice(19))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return exe


def test_cpp_planner_equals_the_python_one(planner):
    rng = np.random.default_rng(13)
    cases = []
    for trial in range(300):
        rows = int(rng.integers(1, 600))
        longest_ctx = [300, 5000, 40000, 2234][trial % 4]
        lens = rng.integers(-2, longest_ctx, rows)
        cases.append((lens, int(rng.choice([1, 7, 49, 66, 132])), int(rng.choice([1024, 2048, 4096]))))
    cases.append((np.zeros(5, np.int64), 66, 1024))   # all padding rows
    cases.append((np.array([300000, 5]), 66, 1024))   # more than 256 pieces of 1024 tokens: refused
    text = "".join(f"{len(lens)} {workers} {longest} {decode_plan.capacity_for(len(lens), workers)} "
                   f"{decode_plan.MIN_ITEM} {decode_plan.ITEM_COST}\n{' '.join(map(str, lens))}\n"
                   for lens, workers, longest in cases)
    proc = subprocess.run([str(planner)], input=text, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(cases)
    refused = 0
    for (lens, workers, longest), line in zip(cases, lines):
        got = np.array(line.split(), dtype=np.int64)
        try:
            want = decode_plan.plan_decode_work(lens, workers, longest)
        except ValueError:
            refused += 1
            assert got[0] < 0, (len(lens), workers, longest)
            continue
        assert got[0] == want[0] and np.array_equal(got[1:], want), (len(lens), workers, longest)
    # Both refuse the too-long context, and steps whose pieces overflow a small worker count's capacity.
    assert 1 <= refused <= len(cases) // 2
