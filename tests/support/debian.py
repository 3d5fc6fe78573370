"""Make sure a program from a Debian package is installed, installing it with apt-get if not.

Tests that need a system program (``docker-compose``, ``prometheus``) call
:func:`ensure_program` from a session-scoped fixture. The install runs at most once per package
and process; a second call returns the cached answer. When installing is impossible here (not
root, no apt-get) it raises :class:`Unavailable`, which the fixture turns into a skip with the
reason; an install that was possible but failed raises ``RuntimeError`` with apt's output, a
failure rather than a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

_APT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "APT_LISTCHANGES_FRONTEND": "none"}
_cache: dict[tuple[str, str], str] = {}


class Unavailable(Exception):
    """The program is missing and cannot be installed on this machine; str() says why."""


def _apt_get(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["apt-get", *args], env={**os.environ, **_APT_ENV}, capture_output=True, text=True,
                          timeout=timeout)


def ensure_program(program: str, package: Optional[str] = None, timeout: float = 300.0) -> str:
    """The path of ``program``, first installing Debian's ``package`` (default: the program's
    name) with ``apt-get install --no-install-recommends`` when it is not on PATH; when that
    fails it runs ``apt-get update`` once and tries again."""
    package = package or program
    key = (program, package)
    if key in _cache:
        return _cache[key]
    path = shutil.which(program)
    if path is None:
        if shutil.which("apt-get") is None:
            raise Unavailable(f"{program} is not installed and this machine has no apt-get to install "
                              f"Debian's {package} package")
        if os.geteuid() != 0:
            raise Unavailable(f"{program} is not installed and installing Debian's {package} package needs root")
        install = ["install", "-y", "-qq", "--no-install-recommends", package]
        done = _apt_get(install, timeout)
        if done.returncode != 0:  # often a stale or missing package list
            update = _apt_get(["update", "-qq"], timeout)
            done = _apt_get(install, timeout) if update.returncode == 0 else update
        path = shutil.which(program)
        if done.returncode != 0 or path is None:
            raise RuntimeError(f"could not install Debian's {package} package for {program} "
                               f"(apt-get exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    _cache[key] = path
    return path
