"""A small HTTP server for Prometheus: ``/metrics`` from one registry, plus optional JSON routes.

The manager and every worker serve their own registry (not prometheus-client's global one),
so several of them can live in one process (tests, the demo) without their series mixing.
The manager adds ``/sd/workers``, a Prometheus HTTP service-discovery document listing the
registered workers' metrics endpoints. Needs only the standard library and prometheus-client.

The page is prometheus-client's own exposition (``choose_encoder``: text or OpenMetrics, as the
scraper asks), without ``*_created`` series: loading this module turns them off for the process
(``disable_created_metrics``; prometheus-client has no per-registry switch), since no kvpager
dashboard or rule reads them and every counter and histogram would otherwise carry one more.
The server is ours, not prometheus-client's ``start_http_server``: that has no bearer-token
check and no JSON routes, and its TLS handshake runs on the accepting thread (one silent client
would stall every scrape), where ours runs it on the request's thread with a timeout.

Secured (docs/security.md): with ``tls`` (the process's gRPC certificate and key, or an
``ssl.SSLContext``) it serves HTTPS only, and with ``token`` every path needs
``Authorization: Bearer TOKEN`` (401 otherwise). ``check_bind`` is the rule the command lines
apply: a plaintext endpoint only on loopback, unless --insecure.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import ssl
import tempfile
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional, Union

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families

from kvpager.hosts import is_loopback

disable_created_metrics()

JsonRoute = Callable[[], object]  # returns a JSON-serializable document
HANDSHAKE_TIMEOUT_S = 10.0  # a client that opens a connection and says nothing holds one thread this long


def check_bind(host: str, tls: bool, insecure: bool, flag: str = "--metrics-host") -> None:
    """The rule for a metrics endpoint started from the command line: HTTPS (``tls``), or loopback
    only, unless ``insecure``. Raises ValueError with one line saying what to pass."""
    if not tls and not insecure and not is_loopback(host):
        raise ValueError(f"refusing to serve /metrics in plain HTTP on {host} ({flag}): pass --tls-cert and "
                         f"--tls-key to serve HTTPS, bind a loopback address, or pass --insecure")


def server_context(tls) -> ssl.SSLContext:
    """An HTTPS server context from ``tls``: an ``ssl.SSLContext`` as it is, or anything with PEM
    ``cert`` and ``key`` bytes (``kvpager.auth.TLS``; its client CA is not used here: scrapers
    authenticate with a token, not a client certificate)."""
    if isinstance(tls, ssl.SSLContext):
        return tls
    cert, key = getattr(tls, "cert", None), getattr(tls, "key", None)
    if not cert or not key:
        raise ValueError("serving HTTPS needs a certificate and its key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # ssl reads certificates only from files: write them to a private folder, load, remove.
    with tempfile.TemporaryDirectory(prefix="kvpager-tls-") as folder:
        paths = []
        for name, data in (("cert.pem", cert), ("key.pem", key)):
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            paths.append(path)
        try:
            context.load_cert_chain(*paths)
        except ssl.SSLError as err:
            raise ValueError(f"cannot serve HTTPS with this certificate and key: {err}") from err
    return context


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    context: Optional[ssl.SSLContext] = None

    def finish_request(self, request, client_address) -> None:
        # TLS: the handshake runs on the request's own thread, bounded in time, so a slow or
        # plaintext client never blocks accept().
        if self.context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            tls_request = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return  # not TLS (a plaintext client), or gone: nothing to answer
        try:
            tls_request.settimeout(None)
            super().finish_request(tls_request, client_address)
        finally:
            tls_request.close()

    def handle_error(self, request, client_address) -> None:  # a client that went away is not worth a traceback
        pass


class MetricsServer:
    """Serves ``registry`` at /metrics and each ``routes[path]()`` as JSON, on a daemon thread.

    ``tls``: serve HTTPS only (a ``kvpager.auth.TLS`` with a certificate and key, or an
    ``ssl.SSLContext``). ``token``: every request needs ``Authorization: Bearer TOKEN``."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 routes: Optional[dict[str, JsonRoute]] = None, tls=None, token: Optional[str] = None) -> None:
        context = server_context(tls) if tls is not None else None
        handler = _handler(registry, dict(routes or {}), token)
        try:
            self._httpd = _HTTPServer((host, port), handler)
        except OSError as err:
            raise OSError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}") from err
        self._httpd.context = context
        self.host = host
        self.port = self._httpd.server_address[1]
        self.scheme = "https" if context is not None else "http"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvpager-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The base URL, ``http(s)://host:port``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def fetch(url: str, timeout: float = 10.0, ca: Union[bytes, str, None] = None, token: Optional[str] = None,
          context: Optional[ssl.SSLContext] = None) -> bytes:
    """GET ``url``: over HTTPS verifying the server with ``ca`` (PEM bytes or a file; or a ready
    ``context``), sending ``Authorization: Bearer token`` when given."""
    if context is None and ca is not None:
        context = ssl.create_default_context(**({"cadata": ca.decode()} if isinstance(ca, bytes) else {"cafile": ca}))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
        return reply.read()


def scrape(url: str, timeout: float = 10.0, ca: Union[bytes, str, None] = None,
           token: Optional[str] = None) -> dict[tuple[str, tuple], float]:
    """Read a /metrics page: {(sample name, sorted (label, value) pairs): value}."""
    text = fetch(url, timeout, ca, token).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _bearer_digest(header: Optional[str]) -> Optional[bytes]:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return hashlib.sha256(token.strip().encode()).digest()


def _handler(registry: CollectorRegistry, routes: dict[str, JsonRoute],
             token: Optional[str] = None) -> type[BaseHTTPRequestHandler]:
    expected = hashlib.sha256(token.encode()).digest() if token else None

    class Handler(BaseHTTPRequestHandler):
        timeout = 30  # seconds a connection may stay silent

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if expected is not None:
                presented = _bearer_digest(self.headers.get("Authorization"))
                if presented is None or not hmac.compare_digest(presented, expected):
                    self._send(401, "text/plain; charset=utf-8", b"unauthorized: send 'Authorization: Bearer TOKEN'\n",
                               {"WWW-Authenticate": 'Bearer realm="kvpager metrics"'})
                    return
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

        def _send(self, status: int, content_type: str, body: bytes, headers: Optional[dict] = None) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes are not worth a log line each
            pass

    return Handler
