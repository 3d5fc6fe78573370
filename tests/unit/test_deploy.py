"""The compose file is valid (checked by docker-compose itself, which needs no engine for this)."""

import pathlib
import shutil
import subprocess

import pytest

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_compose_file_is_valid():
    out = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kvpager-manager" in out.stdout and "KVPAGER_NUM_GPU_BLOCKS" in out.stdout
