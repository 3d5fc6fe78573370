"""Check the import layers (pyproject.toml's [tool.importlinter] contracts) with import-linter.

The repository's top-level folders are mapped onto the ``kvpager`` namespace by pyproject.toml
(``manager/`` is ``kvpager.manager``, ...), which import-linter cannot follow: it walks the root
package's folder. So this lays the namespace out as one tree in a temporary folder (a copy of the
Python files, a second or so) and runs ``lint-imports`` over it. ``make test`` runs it first.

    python tests/support/layers.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lay_out(into: str) -> None:
    """Copy each package folder of pyproject.toml's package-dir to its place under ``into``."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dir.items()):  # "kvpager" first, then its subpackages
        target = os.path.join(into, *package.split("."))
        shutil.copytree(os.path.join(ROOT, folder), target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "csrc", "*.so"))


def main() -> int:
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if lint is None:
        print("layers: lint-imports is not installed (pip install import-linter)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="kvpager-layers-") as tree:
        lay_out(tree)
        env = {**os.environ, "PYTHONPATH": tree}
        done = subprocess.run([lint, os.path.join(ROOT, "pyproject.toml")], cwd=tree, env=env,
                              capture_output=True, text=True)
    out = done.stdout.split("\n\n", 1)[-1] if done.returncode == 0 else done.stdout + done.stderr
    print(out.strip())
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
