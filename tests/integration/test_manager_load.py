"""A soak of the manager alone: the synthetic scheduler of benchmarks/manager_load.py with
preemption, forks and prefix sharing; it exits non-zero if any invariant breaks or any block
is left in use."""

import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "manager_load.py"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_synthetic_load_keeps_invariants(seed, capsys):
    spec = importlib.util.spec_from_file_location("manager_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.main(["--requests", "60", "--seed", str(seed), "--gpu-blocks", "300", "--quiet"]) == 0
    assert "invariants: OK" in capsys.readouterr().out
