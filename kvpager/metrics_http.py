"""A small HTTP server for Prometheus: ``/metrics`` from one registry, plus optional JSON routes.

The manager and every worker serve their own registry (not prometheus-client's global one),
so several of them can live in one process (tests, the demo) without their series mixing.
The manager adds ``/sd/workers``, a Prometheus HTTP service-discovery document listing the
registered workers' metrics endpoints. Needs only the standard library and prometheus-client.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families

JsonRoute = Callable[[], object]  # returns a JSON-serializable document


class MetricsServer:
    """Serves ``registry`` at /metrics and each ``routes[path]()`` as JSON, on a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 routes: Optional[dict[str, JsonRoute]] = None) -> None:
        handler = _handler(registry, dict(routes or {}))
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as err:
            raise OSError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}") from err
        self._httpd.daemon_threads = True
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvpager-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def scrape(url: str, timeout: float = 10.0) -> dict[tuple[str, tuple], float]:
    """Read a /metrics page: {(sample name, sorted (label, value) pairs): value}."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _handler(registry: CollectorRegistry, routes: dict[str, JsonRoute]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                    self._send(200, content_type, encoder(registry))
                elif path in routes:
                    self._send(200, "application/json", json.dumps(routes[path]()).encode())
                else:
                    known = ", ".join(["/metrics", *routes])
                    self._send(404, "text/plain; charset=utf-8", f"not found; this server has {known}\n".encode())
            except Exception as exc:  # a collector failed: say so, keep serving
                self._send(500, "text/plain; charset=utf-8", f"error: {exc!r}\n".encode())

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes are not worth a log line each
            pass

    return Handler
