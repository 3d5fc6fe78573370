"""benchmarks/manager_load.py: the production scheduler with a stand-in model serving a simulated load
against a real manager over gRPC. Under a small GPU pool the run must preempt (swap out and back
in), hit the prefix cache, fork samples (copy on write), give every request its tokens, free
everything and keep the manager's invariants; the same seed gives the same run; and the end
checks fail the run when something is left."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import random
import re
import sys

import pytest

from kvpager import client as C
from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.step import StepInput

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "manager_load.py"
SMALL_POOL = ["--requests", "60", "--gpu-blocks", "300", "--quiet"]
TIMED = ("tokens generated", "wall time", "Step latency")  # rows that change from run to run


@pytest.fixture(scope="module")
def load():
    spec = importlib.util.spec_from_file_location("manager_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def run(load, capsys, *args: str) -> str:
    assert load.main([*SMALL_POOL, *args]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("invariants: OK")
    return out


def number(out: str, pattern: str) -> int:
    found = re.search(pattern, out)
    assert found, f"{pattern!r} not in the summary:\n{out}"
    return int(found.group(1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_small_pool_preempts_hits_prefixes_and_frees_everything(load, capsys, seed):
    out = run(load, capsys, "--seed", str(seed))
    assert number(out, r"requests completed\s+(\d+)") == 60
    assert number(out, r"swaps\s+(\d+) preemptions") > 0
    assert number(out, r"blocks out, (\d+) in") > 0
    assert number(out, r"prefix-cache hit rate\s+\S+\s+\((\d+) of") > 0
    assert number(out, r"copy-on-write copies\s+(\d+)") > 0
    forked = sum(a.request.params.n > 1 for a in load.make_workload(60, random.Random(seed)))
    assert number(out, r"\((\d+) with n > 1\)") == forked > 0


def test_a_seed_gives_the_same_run(load, capsys):
    def untimed(out: str) -> list[str]:
        return [line for line in out.splitlines() if not any(row in line for row in TIMED)]

    assert untimed(run(load, capsys, "--seed", "4")) == untimed(run(load, capsys, "--seed", "4"))


def test_the_end_checks_name_what_is_left(load):
    arrivals = load.make_workload(2, random.Random(0))
    server, port, service, _ = create_server(ManagerConfig(block_size=16, num_gpu_blocks=64, num_cpu_blocks=16))
    server.start()
    try:
        with C.BlockManagerClient(f"127.0.0.1:{port}") as client:
            client.allocate("leaked", list(range(20)))
            found = load.problems(arrivals, {}, client.get_stats(), service)
    finally:
        server.stop(None)
        service.close()
    wants = [[a.request.params.max_new_tokens] * a.request.params.n for a in arrivals]
    assert found == [f"req0000 asked for {wants[0]} tokens, got None", f"req0001 asked for {wants[1]} tokens, got None",
                     "1 running and 0 swapped sequences remain", "2 GPU and 0 CPU blocks still in use"]


def test_a_problem_fails_the_run(load, capsys, monkeypatch):
    monkeypatch.setattr(load, "problems", lambda *args: ["a block left in use"])
    assert load.main(["--requests", "3", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "error: a block left in use" in captured.err and "invariants: OK" not in captured.out


def test_the_stand_in_model_answers_a_token_per_computing_sequence(load):
    step = StepInput(step_id=1, plan_step_id=0, token_ids=[5, 6, 7], positions=[0, 1, 9], slot_mapping=[0, 1, 25],
                     query_lens=[2, 0, 1], context_lens=[2, 4, 10], block_tables=[0, 0, 2, 0, 1, 3],
                     max_blocks=2, greedy=True)
    tokens = load.RandomTokenRunner(0)(step)
    assert tokens.tolist() == load.RandomTokenRunner(0)(step).tolist() and len(tokens) == 2
    assert all(0 <= t < load.VOCAB for t in tokens.tolist())
    with pytest.raises(ValueError, match="greedy steps only"):
        load.RandomTokenRunner(0)(dataclasses.replace(step, greedy=False))
