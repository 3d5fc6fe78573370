"""Fetch the system programs some tests run (Prometheus, promtool, docker-compose, wget) as files.

    python3 tests/support/fetch_tools.py      # what `make tools` (and so `make test`) runs

Nothing is installed: Debian's packages are downloaded with ``apt-get download`` (into a
temporary folder, deleted after) and unpacked with ``dpkg-deb -x`` into ``.cache/tools/root``, so no
maintainer script runs (Debian's prometheus package would otherwise start a system service) and
nothing under /usr or /etc changes. ``.cache/tools/bin`` then holds one entry per program:
links to the unpacked binaries, and for docker-compose (a Python program) a wrapper that runs
it on the system's python3 with only the unpacked libraries on its path.

The outcome is recorded in ``.cache/tools/manifest.json``, which the tests read
(:mod:`tests.support.tools`). A program is either ready, *unavailable* (it could not be fetched
here: no apt-get, no network, not root for a needed ``apt-get update``; the tests that need it
are skipped with that reason) or *broken* (fetched, but it does not run; those tests fail).
This step never fails because of the machine: it prints one line saying what it has and exits
0. A second run with the same package lists finds the manifest and returns at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "tools"
MANIFEST = CACHE / "manifest.json"
SYSTEM_PYTHON = "/usr/bin/python3"  # the interpreter Debian's python3-* packages are built for
APT_TIMEOUT = 300


@dataclass(frozen=True)
class Tool:
    """Debian packages to unpack, the programs they provide, and a command proving they run."""

    name: str
    packages: tuple[str, ...]
    programs: tuple[str, ...]
    check: tuple[str, ...]


# docker-compose's packages are the smallest set with which `docker-compose config` runs on an
# isolated interpreter (python3 -S: none of the system's own dist-packages). python3-chardet,
# not python3-charset-normalizer: Debian's requests warns on every run without chardet.
TOOLS = (
    Tool("prometheus", ("prometheus",), ("prometheus", "promtool"), ("prometheus", "--version")),
    Tool("docker-compose",
         ("docker-compose", "python3-attr", "python3-certifi", "python3-chardet", "python3-distro",
          "python3-docker", "python3-dockerpty", "python3-docopt", "python3-dotenv", "python3-idna",
          "python3-jsonschema", "python3-pyrsistent", "python3-requests", "python3-six", "python3-texttable",
          "python3-urllib3", "python3-websocket", "python3-yaml"),
         ("docker-compose", "compose-python"), ("docker-compose", "version")),
    Tool("wget", ("wget",), ("wget",), ("wget", "--version")),  # the compose file's Prometheus health check
)

# Bump when the layout of the cache or the wrappers changes, so that old caches are rebuilt.
LAYOUT_VERSION = 1


def spec_key() -> str:
    """Identifies what a cache must hold; a manifest with another key is stale."""
    spec = [LAYOUT_VERSION, SYSTEM_PYTHON, [(t.name, t.packages, t.programs) for t in TOOLS]]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def read_manifest() -> Optional[dict]:
    try:
        return json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return None


def is_current(manifest: Optional[dict]) -> bool:
    """The manifest is for these package lists, every tool is ready, and its files are there."""
    if not manifest or manifest.get("spec") != spec_key():
        return False
    if manifest.get("unavailable") or manifest.get("broken"):
        return False  # try again: the network or the package lists may be back
    return all((CACHE / "bin" / p).exists() for t in TOOLS for p in t.programs)


# -- apt ----------------------------------------------------------------------------------------

def _apt_get(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # APT::Sandbox::User=root: as root, apt downloads as _apt, which cannot write into our folder.
    sandbox = ["-o", "APT::Sandbox::User=root"] if os.geteuid() == 0 else []
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    argv = ["apt-get", "-qq", *sandbox, *args]
    try:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT)
    except subprocess.TimeoutExpired:  # a network that drops packets rather than refusing
        return subprocess.CompletedProcess(argv, 124, "", f"apt-get {args[0]} took over {APT_TIMEOUT} s")


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


class Fetcher:
    """Downloads packages, running ``apt-get update`` at most once when a download fails."""

    def __init__(self, debs: Path) -> None:
        self.debs = debs
        self.updated = False

    def download(self, packages: tuple[str, ...]) -> Optional[str]:
        """None once every package's .deb is in ``debs``; otherwise why not."""
        done = _apt_get(["download", *packages], self.debs)
        if done.returncode == 0:
            return None
        if self.updated:
            return f"apt-get download failed: {_last_line(done)}"
        if os.geteuid() != 0:
            return f"apt-get download failed ({_last_line(done)}) and apt-get update needs root"
        self.updated = True
        update = _apt_get(["update"], self.debs)
        if update.returncode != 0:
            return f"apt-get update failed: {_last_line(update)}"
        done = _apt_get(["download", *packages], self.debs)
        return None if done.returncode == 0 else f"apt-get download failed: {_last_line(done)}"


def _deb_files(debs: Path, packages: tuple[str, ...]) -> list[Path]:
    """The downloaded file of each package (apt names them PACKAGE_VERSION_ARCH.deb)."""
    return [next(debs.glob(f"{package}_*.deb")) for package in packages]


# -- the cache ----------------------------------------------------------------------------------

COMPOSE_WRAPPER = """#!/bin/sh
# Debian's docker-compose, unpacked (tests/support/fetch_tools.py), run on the system python3
# it was packaged for, with -S so that only the unpacked libraries are importable.
root="$(cd "$(dirname "$0")/.." && pwd)/root"
PYTHONPATH="$root/usr/lib/python3/dist-packages" exec {python} -S "$root/usr/bin/docker-compose" "$@"
"""

COMPOSE_PYTHON_WRAPPER = """#!/bin/sh
# The interpreter docker-compose runs on, with its libraries: for tests that ask its own code.
root="$(cd "$(dirname "$0")/.." && pwd)/root"
PYTHONPATH="$root/usr/lib/python3/dist-packages" exec {python} -S "$@"
"""


def unpack(debs: list[Path], root: Path) -> Optional[str]:
    """``dpkg-deb -x`` each package into ``root``: its files only, no maintainer script. None,
    or dpkg-deb's complaint."""
    for deb in debs:
        done = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True,
                              timeout=APT_TIMEOUT)
        if done.returncode != 0:
            return f"dpkg-deb -x {deb.name}: {_last_line(done)}"
    return None


def _write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def expose(tool: Tool, bin_dir: Path) -> Optional[str]:
    """Make ``bin_dir/<program>`` for each of the tool's programs; None, or why it cannot run here."""
    if tool.name == "docker-compose":
        if not os.access(SYSTEM_PYTHON, os.X_OK):
            return f"docker-compose runs on Debian's python3 ({SYSTEM_PYTHON}), which this machine lacks"
        _write_executable(bin_dir / "docker-compose", COMPOSE_WRAPPER.format(python=SYSTEM_PYTHON))
        _write_executable(bin_dir / "compose-python", COMPOSE_PYTHON_WRAPPER.format(python=SYSTEM_PYTHON))
        return None
    for program in tool.programs:
        (bin_dir / program).symlink_to(Path("..") / "root" / "usr" / "bin" / program)
    return None


def check(tool: Tool, bin_dir: Path) -> Optional[str]:
    """None when the tool's check command succeeds; otherwise its output's last line."""
    argv = [str(bin_dir / tool.check[0]), *tool.check[1:]]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{' '.join(tool.check)}: {err}"
    return None if done.returncode == 0 else f"{' '.join(tool.check)}: {_last_line(done)}"


def machine_problem() -> Optional[str]:
    """Why packages cannot be fetched on this machine at all, or None."""
    missing = [p for p in ("apt-get", "dpkg-deb") if shutil.which(p) is None]
    if missing:
        return f"{' and '.join(missing)} not found: Debian's packages cannot be fetched on this machine"
    return None


def build() -> dict:
    """Fetch and unpack every tool into a fresh cache; the manifest (also written to disk)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"spec": spec_key(), "programs": {}, "unavailable": {}, "broken": {}}
    problem = machine_problem()
    if problem:
        manifest["unavailable"] = {t.name: problem for t in TOOLS}
        return _save(manifest)
    staging = Path(tempfile.mkdtemp(prefix="new-", dir=CACHE))  # becomes root/ and bin/ when complete
    debs = staging / "debs"
    for folder in (debs, staging / "root", staging / "bin"):
        folder.mkdir()
    fetcher = Fetcher(debs)
    fetched = []
    for tool in TOOLS:
        why = fetcher.download(tool.packages)
        if why is None:
            why = expose(tool, staging / "bin")
        if why is not None:
            manifest["unavailable"][tool.name] = why
            continue
        broken = unpack(_deb_files(debs, tool.packages), staging / "root")
        if broken:
            manifest["broken"][tool.name] = broken
        else:
            fetched.append(tool)
    for name in ("root", "bin"):
        shutil.rmtree(CACHE / name, ignore_errors=True)
        (staging / name).rename(CACHE / name)
    shutil.rmtree(staging)  # the downloaded .debs
    for tool in fetched:
        why = check(tool, CACHE / "bin")
        if why is None:
            manifest["programs"].update({p: f"bin/{p}" for p in tool.programs})
        else:
            manifest["broken"][tool.name] = why
    return _save(manifest)


def _save(manifest: dict) -> dict:
    temp = MANIFEST.with_suffix(".tmp")
    temp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    temp.replace(MANIFEST)
    return manifest


def summary(manifest: dict) -> str:
    """One line: what is ready, and for each tool that is not, why."""
    parts = []
    if manifest["programs"]:
        parts.append(f"{', '.join(sorted(manifest['programs']))} ready in {CACHE.relative_to(REPO)}/bin")
    for state, label in (("unavailable", "unavailable"), ("broken", "BROKEN")):
        by_reason: dict[str, list[str]] = {}
        for name, why in sorted(manifest[state].items()):
            by_reason.setdefault(why, []).append(name)
        parts += [f"{', '.join(names)} {label}: {why}" for why, names in by_reason.items()]
    return "tools: " + "; ".join(parts)


def main() -> int:
    manifest = read_manifest()
    if is_current(manifest):
        print(summary(manifest) + " (cached)")
        return 0
    print(summary(build()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
