"""A real Prometheus server for tests: started on a free loopback port, queried, stopped.

    with PrometheusServer(config_text, tmp_path) as prom:   # or PrometheusAPI(url) for a running one
        prom.wait_for('up{job="kvpager-manager"} == 1', timeout=30)
        prom.query("kvpager_kv_cache_usage_ratio")      # -> the result list of /api/v1/query
        prom.targets()                                  # -> the active scrape targets

The binary is Debian's ``prometheus``, unpacked into the repository's tool cache (never the
system's, and never installed: see :mod:`tests.support.fetch_tools`); :meth:`PrometheusServer.start`
skips the calling test where it could not be fetched. Storage and configuration live under
``tmp_path``; the server listens on 127.0.0.1 only and is stopped with SIGTERM (then SIGKILL)
when the block exits, so no Prometheus outlives its test. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .tools import unpacked_tools


class PromQLError(Exception):
    """The query API answered status "error" (``error_type`` is e.g. "bad_data" for a syntax error)."""

    def __init__(self, expr: str, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message} (query: {expr})")
        self.expr, self.error_type, self.message = expr, error_type, message


def prometheus_binary() -> str:
    """Path of the unpacked prometheus program (the calling test is skipped where there is none)."""
    return unpacked_tools().require("prometheus")


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class PrometheusAPI:
    """The query API of a Prometheus at ``url`` (one this module started, or any other)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _api(self, path: str, params: Optional[dict] = None, timeout: float = 10.0) -> Any:
        data = urllib.parse.urlencode(params).encode() if params is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as err:  # 400/422/503 carry the error document
            body = err.read()
            try:
                return json.loads(body)
            except ValueError:
                raise RuntimeError(f"{path}: HTTP {err.code}: {body[:500]!r}") from err

    def query(self, expr: str, at: Optional[float] = None) -> list:
        """An instant query: the ``data.result`` list (samples of a vector; ``[time, value]`` of a
        scalar). Raises :class:`PromQLError` when Prometheus answers status "error"."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        doc = self._api("/api/v1/query", params)
        if doc.get("status") != "success":
            raise PromQLError(expr, doc.get("errorType", "?"), doc.get("error", json.dumps(doc)[:500]))
        return doc["data"]["result"]

    def wait_for(self, expr: str, timeout: float, poll: float = 0.5,
                 predicate: Optional[Callable[[list], bool]] = None) -> list:
        """Query ``expr`` until its result is non-empty (or ``predicate(result)`` holds) and
        return it; TimeoutError after ``timeout`` seconds, with the scrape targets' state."""
        deadline = time.monotonic() + timeout
        result: list = []
        while True:
            result = self.query(expr)
            if (predicate(result) if predicate is not None else bool(result)):
                return result
            if time.monotonic() >= deadline:
                break
            time.sleep(poll)
        summary = [(t.get("labels", {}).get("job"), t.get("scrapeUrl"), t.get("health"), t.get("lastError"))
                   for t in self.targets()]
        raise TimeoutError(f"{expr!r} gave {result!r} for {timeout:.0f} s; targets (job, url, health, error): {summary}")

    def targets(self, state: str = "active") -> list[dict]:
        """The scrape targets (``activeTargets`` of /api/v1/targets): labels, scrapeUrl, health, lastError."""
        doc = self._api(f"/api/v1/targets?state={state}")
        if doc.get("status") != "success":
            raise RuntimeError(f"/api/v1/targets: {doc}")
        return doc["data"].get("activeTargets" if state == "active" else "droppedTargets", [])


class PrometheusServer(PrometheusAPI):
    """Prometheus with ``config_text`` as its configuration and ``tmp_path`` for its files."""

    def __init__(self, config_text: str, tmp_path: os.PathLike | str, *, host: str = "127.0.0.1",
                 binary: Optional[str] = None, extra_args: Sequence[str] = (), ready_timeout: float = 30.0) -> None:
        self.dir = Path(tmp_path) / "prometheus"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(config_text)
        self.log_path = self.dir / "prometheus.log"
        self.host = host
        self.port = 0
        self._binary = binary
        self._extra_args = list(extra_args)
        self._ready_timeout = ready_timeout
        self._proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:  # type: ignore[override]  (known once started)
        return f"http://{self.host}:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "PrometheusServer":
        binary = self._binary or prometheus_binary()
        last = ""
        for _ in range(3):  # a free port can be taken between choosing it and binding it
            self.port = _free_port(self.host)
            args = [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address={self.host}:{self.port}", "--log.level=info", *self._extra_args]
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              cwd=self.dir)
            try:
                self._wait_ready()
                return self
            except RuntimeError as err:
                last = str(err)
                self.stop()
                if "address already in use" not in last:
                    break
        raise RuntimeError(last)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready on {self.url} after {self._ready_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
