"""``python -m kvpager.manager`` as an operator runs it: flags, environment, graceful stop."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from kvpager.client import BlockManagerClient


def _start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpager.manager", "--insecure", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if not match:
        proc.kill()
        raise AssertionError(f"server did not start: {line!r} {proc.stderr.read()}")
    return proc, match.group(1)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serves_then_stops_gracefully_on_signal(signum):
    proc, target = _start("--block-size", "8", "--num-gpu-blocks", "64", "--num-cpu-blocks", "32",
                          "--enable-prefix-caching", "false", env={"KVPAGER_WATERMARK": "0.25"})
    try:
        with BlockManagerClient(target) as client:
            client.wait_ready()
            client.allocate("a", num_tokens=20)
            s = client.get_stats()
            assert (s.block_size, s.gpu.total_blocks, s.cpu.total_blocks) == (8, 63, 32)  # 64 but the null block
            assert s.watermark_blocks == 16 and not s.prefix_caching
            assert client.health() == "SERVING"
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == 0
        assert "shutting down" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_rejects_bad_configuration():
    proc = subprocess.run([sys.executable, "-m", "kvpager.manager", "--port", "0", "--watermark", "1.5"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "watermark must be in [0, 1)" in proc.stderr


def test_console_script_is_installed():
    script = shutil.which("kvpager-manager", path=os.path.dirname(sys.executable))
    assert script, "kvpager-manager console script missing from the environment"
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--num-gpu-blocks" in out.stdout
