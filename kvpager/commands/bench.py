"""``kvpager bench NAME [ARGS...]``: run a benchmark script of the repository's benchmarks/
folder with this Python, passing ARGS through (``kvpager bench NAME --help`` shows its own
flags). Needs a source checkout: wheels do not ship benchmarks/."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

from kvpager.commands import cli

EPILOG = None  # no flags of its own read the environment
BENCHMARKS = {"manager": "manager_bench.py", "load": "manager_load.py", "step-rpc": "step_rpc.py",
              "layout": "cache_layout.py", "kernels": "kernels.py", "serving": "serving.py",
              "model-step": "model_step.py", "host-planner": "host_planner.py"}


def benchmarks_dir() -> Path:
    # An editable install imports kvpager from the repository, whose benchmarks/ sit beside it.
    return Path(__file__).resolve().parents[2] / "benchmarks"  # kvpager/commands/bench.py -> the repository


def summary(script: Path) -> str:
    """The first sentence of a script's docstring, on one line, read without importing the script
    (some need CUDA)."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".") + "." if first else ""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list", action="store_true", help="list the benchmarks with what each measures")
    parser.add_argument("name", nargs="?", choices=sorted(BENCHMARKS), metavar="NAME",
                        help=f"one of: {', '.join(f'{k} ({v})' for k, v in BENCHMARKS.items())}")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script")


def run(args: argparse.Namespace) -> int:
    folder = benchmarks_dir()
    if not folder.is_dir():
        raise cli.Failure(f"no benchmarks folder at {folder}: the benchmarks come with a source checkout "
                          "of kvpager (pip install -e .), not with the wheel")
    if args.list:
        name_width, file_width = max(map(len, BENCHMARKS)), max(map(len, BENCHMARKS.values()))
        for name, file in BENCHMARKS.items():
            print(f"{name:{name_width}s} {file:{file_width}s} {summary(folder / file)}")
        return 0
    if args.name is None:
        raise cli.UsageError("name a benchmark (or --list)")
    script = folder / BENCHMARKS[args.name]
    if not script.is_file():
        raise cli.Failure(f"benchmark script {script} is missing")
    code = subprocess.call([sys.executable, str(script), *args.args])
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number
