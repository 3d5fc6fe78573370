"""Where the tests find the programs that tests/support/fetch_tools.py unpacked.

    tools = unpacked_tools()              # the session fixture of the same name wraps this
    tools.path("prometheus")              # .cache/tools/bin/prometheus, or Unavailable / Broken
    tools.require("prometheus")           # the same, skipping or failing the calling test instead
    tools.bin_dir                         # put first on a PATH to run them by name

Only the unpacked copies are used, never a program of the same name installed on the machine,
so every run tests the same versions and no test depends on (or starts) a system service.
When no manifest exists yet (pytest run without `make test`), the fetch step runs once first.
"""

from __future__ import annotations

from typing import Optional

import pytest

from . import fetch_tools


class Unavailable(Exception):
    """The program could not be fetched on this machine; str() says why. Tests skip."""


class Broken(Exception):
    """The program was fetched but does not run; str() says why. Tests fail."""


class UnpackedTools:
    """The fetch step's manifest, read once."""

    def __init__(self, manifest: dict) -> None:
        self._manifest = manifest
        self.bin_dir = fetch_tools.CACHE / "bin"

    def _tool_of(self, program: str) -> Optional[str]:
        return next((t.name for t in fetch_tools.TOOLS if program in t.programs), None)

    def path(self, program: str) -> str:
        """The unpacked ``program``'s path; raises :class:`Unavailable` or :class:`Broken`."""
        if program in self._manifest["programs"]:
            return str(fetch_tools.CACHE / self._manifest["programs"][program])
        tool = self._tool_of(program)
        if tool is None:
            raise KeyError(f"{program} is not one of the programs tests/support/fetch_tools.py fetches")
        if tool in self._manifest["broken"]:
            raise Broken(f"{program} was unpacked but does not run: {self._manifest['broken'][tool]}")
        raise Unavailable(f"{program}: {self._manifest['unavailable'].get(tool, 'not fetched')}")

    def require(self, program: str) -> str:
        """:meth:`path`, for a test or fixture: skipped where the program could not be fetched
        (saying why), failed where it was fetched and does not run."""
        try:
            return self.path(program)
        except Unavailable as why:
            pytest.skip(str(why))
        except Broken as why:
            pytest.fail(str(why), pytrace=False)


_loaded: Optional[UnpackedTools] = None


def unpacked_tools() -> UnpackedTools:
    """The tools of this run (the fetch step runs first when its manifest is missing or stale)."""
    global _loaded
    if _loaded is None:
        manifest = fetch_tools.read_manifest()
        if not _usable(manifest):
            manifest = fetch_tools.build()
        _loaded = UnpackedTools(manifest)
    return _loaded


def _usable(manifest: Optional[dict]) -> bool:
    """Made for these package lists, with the files it lists still there. (Unlike `make tools`,
    a run of the tests does not retry what could not be fetched: it skips those tests.)"""
    if not manifest or manifest.get("spec") != fetch_tools.spec_key():
        return False
    return all((fetch_tools.CACHE / path).exists() for path in manifest["programs"].values())
