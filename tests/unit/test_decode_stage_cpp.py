"""CPU check of kernels/csrc/decode_stage.cpp, the C++ that writes a CUDA-graph decode step's inputs
into its pinned buffer (worker/decode_graphs.py): on random steps it writes exactly what numpy
writes into the same ``_Inputs`` layout, with the work list of kernels/decode_plan.py, from every
kind of sequence a step carries (lists, tuples, int32/int64 arrays), and refuses bad input with a
ValueError naming the field. Built with nvcc (tests/support/decode_stage_module.cpp, a plain
CPython module; no GPU); skipped where nvcc is not on PATH."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from kvpager.kernels import decode_plan
from kvpager.worker.decode_graphs import _Inputs

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kernels" / "csrc"
WORKERS, LONGEST = 66, 2048


@pytest.fixture(scope="module")
def stager(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    path = tmp_path_factory.mktemp("stage") / ("decode_stage_test" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = ["nvcc", "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC", "-I", str(CSRC),
           "-I", sysconfig.get_paths()["include"], str(ROOT / "tests" / "support" / "decode_stage_module.cpp"),
           str(CSRC / "decode_stage.cpp"), str(CSRC / "decode_plan.cu"), "-o", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=lambda: os.nice(19))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spec = importlib.util.spec_from_file_location("decode_stage_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def numpy_stage(buf: np.ndarray, lay: _Inputs, planned: bool, rows: int, step: dict, width: int, stride: int) -> int:
    """What DecodeGraphs.run wrote with numpy before the C++ (the reference)."""
    longs = buf[:lay.context_at].view(np.int64).reshape(4, lay.batch)
    context = buf[lay.context_at:lay.context_at + 4 * lay.batch].view(np.int32)
    longs[0, :rows], longs[1, :rows], longs[2, :rows] = step["tokens"], step["positions"], step["slots"]
    longs[3, :rows] = -1 if step["feedback"] is None else step["feedback"]
    longs[:2, rows:], longs[2:, rows:] = 0, -1
    context[:rows], context[rows:] = step["context"], 0
    if planned:
        work = buf[lay.work_at:lay.work_end].view(np.int32)
        work[:] = decode_plan.plan_decode_work(context, WORKERS, LONGEST)
        work[2] = stride
    end = lay.tables_at + 4 * rows * stride
    tables = buf[lay.tables_at:end].view(np.int32).reshape(rows, stride)
    tables[:, :width] = np.asarray(step["tables"]).reshape(rows, width)
    return end


def random_step(rng: np.random.Generator, rows: int, width: int, kind: str) -> dict:
    context = rng.integers(1, width * 16 + 1, rows)
    step = {"tokens": rng.integers(0, 128_000, rows), "positions": context - 1,
            "slots": rng.integers(0, 1 << 33, rows), "feedback": None if rng.random() < 0.5 else rng.permutation(rows),
            "context": context, "tables": rng.integers(0, 1 << 30, rows * width)}
    convert = {"list": lambda a: a.tolist(), "tuple": lambda a: tuple(a.tolist()),
               "int32": lambda a: a.astype(np.int32), "int64": lambda a: a.astype(np.int64),
               "strided": lambda a: np.repeat(a, 2)[::2]}[kind]   # a non-contiguous array
    return {k: None if v is None else convert(v) for k, v in step.items()}


@pytest.mark.parametrize("kind", ["list", "tuple", "int32", "int64", "strided"])
def test_stage_writes_what_numpy_wrote(stager, kind):
    rng = np.random.default_rng(len(kind))
    for trial in range(40):
        batch = int(rng.choice([1, 8, 32, 48, 256]))
        rows, width = int(rng.integers(1, batch + 1)), int(rng.integers(1, 64))
        planned = trial % 3 != 2   # else the graphs of KVPAGER_DECODE_WORK_LIST=0: no list, wider rows
        stride = width if planned else int(rng.integers(width, 2 * width + 1))
        lay = _Inputs.of(batch, decode_plan.plan_size(batch, decode_plan.capacity_for(batch, WORKERS))
                         if planned else 0)
        step = random_step(rng, rows, width, kind)
        garbage = rng.integers(0, 256, lay.tables_at + 4 * batch * stride, dtype=np.uint8)
        want, got = garbage.copy(), garbage.copy()
        end = numpy_stage(want, lay, planned, rows, step, width, stride)
        args = (step["tokens"], step["positions"], step["slots"], step["feedback"], step["context"], step["tables"])
        planner = (WORKERS, LONGEST, decode_plan.MIN_ITEM, decode_plan.ITEM_COST) if planned else (0, 0, 0, 0)
        layout = (batch, lay.context_at, lay.work_at, lay.work_end, lay.tables_at)
        assert stager.stage(got, layout, planner, rows, *args, width, stride) == end
        assert np.array_equal(got, want), (trial, batch, rows, width, stride, planned)


def test_stage_refuses_bad_input(stager):
    rng = np.random.default_rng(5)
    batch, rows, width = 32, 20, 8
    lay = _Inputs.of(batch, decode_plan.plan_size(batch, decode_plan.capacity_for(batch, WORKERS)))
    layout = (batch, lay.context_at, lay.work_at, lay.work_end, lay.tables_at)
    planner = (WORKERS, LONGEST, decode_plan.MIN_ITEM, decode_plan.ITEM_COST)
    buf = np.zeros(lay.nbytes(width), np.uint8)
    good = random_step(rng, rows, width, "list")

    def stage(rows=rows, width=width, stride=width, buffer=buf, **changes):
        s = {**good, **changes}
        return stager.stage(buffer, layout, planner, rows, s["tokens"], s["positions"], s["slots"], s["feedback"],
                            s["context"], s["tables"], width, stride)

    assert stage() == lay.tables_at + 4 * rows * width
    refusals = [
        ({"tokens": good["tokens"][:-1]}, "token_ids: holds 19 entries, not 20"),
        ({"positions": [1.5] * rows}, "positions: entry 0 is not an integer"),
        ({"slots": "x" * rows}, "slot_mapping: entry 0 is not an integer"),
        ({"slots": 7}, "slot_mapping: expected a sequence of ints, got int"),
        ({"feedback": np.zeros(rows + 1, np.int64)}, "feedback_rows: holds 21 entries"),
        ({"context": [1 << 31] * rows}, "context_lens: entry 0 = 2147483648 does not fit int32"),
        ({"context": [decode_plan.MAX_PIECES * LONGEST + 1] * rows}, "context_lens: a context is longer than"),
        ({"tables": np.full(rows * width, -(1 << 40))}, "block_tables: entry 0 = -1099511627776 does not fit"),
        ({"rows": batch + 1}, "rows: 33 is not in [1, 32]"),
        ({"stride": width - 1}, "tables: row stride 7 is below the width 8"),
        ({"buffer": buf[:lay.tables_at]}, "host buffer:"),
    ]
    for change, message in refusals:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            stage(**change)
    assert stage() == lay.tables_at + 4 * rows * width   # still serving after each refusal
