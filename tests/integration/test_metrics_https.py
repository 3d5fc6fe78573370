"""/metrics and /sd over HTTPS (kvpager.metrics_http, docs/security.md): a real MetricsServer with
TLS on 127.0.0.1, fetched through urllib with the CA; plaintext, an untrusted client and a
missing or wrong token are refused; a client that never finishes its handshake holds no one
else up. The command lines refuse plain HTTP metrics beyond loopback unless --insecure."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvpager import auth
from kvpager.metrics_http import MetricsServer, check_bind, fetch, scrape
from tests.support.tls import CA, write

TOKEN = "metrics-token-0123456789abcdef"
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_")}, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def pki():
    ca = CA.create()
    return dict(ca=ca.cert, server=ca.issue("manager"), other_ca=CA.create("another CA"))


def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("kvpager_test_scrapes", "a counter", registry=reg).inc(3)
    return reg


@pytest.fixture
def https(pki):
    server = MetricsServer(registry(), "127.0.0.1", 0, {"/sd/workers": lambda: [{"targets": ["a:1"]}]},
                           tls=auth.TLS(pki["server"].cert, pki["server"].key))
    yield server
    server.close()


def test_https_with_the_ca(https, pki):
    assert https.url.startswith("https://127.0.0.1:")
    # Plain urllib and ssl, as any client would.
    context = ssl.create_default_context(cadata=pki["ca"].decode())
    with urllib.request.urlopen(f"{https.url}/metrics", timeout=5, context=context) as reply:
        assert reply.status == 200 and b"kvpager_test_scrapes_total 3.0" in reply.read()
    assert scrape(f"{https.url}/metrics", ca=pki["ca"])[("kvpager_test_scrapes_total", ())] == 3
    assert json.loads(fetch(f"{https.url}/sd/workers", ca=pki["ca"])) == [{"targets": ["a:1"]}]


def test_no_created_series_in_either_format():
    # prometheus-client would add a *_created sample beside each counter and histogram.
    reg = registry()
    Histogram("kvpager_test_seconds", "a histogram", registry=reg).observe(0.5)
    server = MetricsServer(reg, "127.0.0.1", 0)
    try:
        for accept in ("text/plain", "application/openmetrics-text; version=1.0.0"):
            request = urllib.request.Request(f"{server.url}/metrics", headers={"Accept": accept})
            with urllib.request.urlopen(request, timeout=5) as reply:
                page = reply.read().decode()
            assert "kvpager_test_scrapes_total 3.0" in page and "kvpager_test_seconds_count 1.0" in page, page
            assert "_created" not in page, (accept, page)
    finally:
        server.close()


def test_plaintext_and_untrusted_clients_are_refused(https, pki):
    with pytest.raises((ConnectionError, urllib.error.URLError, OSError)) as plain:
        fetch(f"http://127.0.0.1:{https.port}/metrics", timeout=5)
    assert not isinstance(plain.value, urllib.error.HTTPError)  # no HTTP answer at all
    with pytest.raises(urllib.error.URLError) as untrusted:
        fetch(f"{https.url}/metrics", timeout=5, ca=pki["other_ca"].cert)
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError)
    with pytest.raises(urllib.error.URLError):  # the system's CAs do not know ours
        urllib.request.urlopen(f"{https.url}/metrics", timeout=5)
    # ... and the server still serves.
    assert scrape(f"{https.url}/metrics", ca=pki["ca"])


def test_a_silent_client_holds_no_one_up(https, pki):
    with socket.create_connection(("127.0.0.1", https.port)) as silent:  # connects, never says hello
        started = time.monotonic()
        assert scrape(f"{https.url}/metrics", ca=pki["ca"], timeout=5)
        assert time.monotonic() - started < 3
        silent.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")  # plaintext on the TLS port: dropped


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
def test_a_token_for_scrapes(pki, tls):
    server = MetricsServer(registry(), "127.0.0.1", 0, {"/sd/workers": lambda: []}, token=TOKEN,
                           tls=auth.TLS(pki["server"].cert, pki["server"].key) if tls else None)
    ca = pki["ca"] if tls else None
    try:
        for path in ("/metrics", "/sd/workers", "/nothing"):
            for sent in (None, "wrong-token-0123456789abcdef"):
                with pytest.raises(urllib.error.HTTPError) as refused:
                    fetch(server.url + path, ca=ca, token=sent)
                assert refused.value.code == 401
                assert refused.value.headers["WWW-Authenticate"].startswith("Bearer")
        assert scrape(f"{server.url}/metrics", ca=ca, token=TOKEN)[("kvpager_test_scrapes_total", ())] == 3
        request = urllib.request.Request(f"{server.url}/metrics", headers={"Authorization": f"Basic {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=5, context=ssl.create_default_context(cadata=ca.decode())
                                   if ca else None)
    finally:
        server.close()


def test_an_ssl_context_serves_too(pki, tmp_path):
    files = write(tmp_path, cert=pki["server"].cert, key=pki["server"].key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files["cert"], files["key"])
    server = MetricsServer(registry(), "127.0.0.1", 0, tls=context)
    try:
        assert scrape(f"{server.url}/metrics", ca=pki["ca"])
    finally:
        server.close()
    with pytest.raises(ValueError, match="certificate and its key"):
        MetricsServer(registry(), "127.0.0.1", 0, tls=auth.TLS())
    with pytest.raises(ValueError, match="cannot serve HTTPS"):
        MetricsServer(registry(), "127.0.0.1", 0, tls=auth.TLS(pki["server"].cert, pki["other_ca"].cert))


def test_check_bind():
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        check_bind(host, tls=False, insecure=False)
    check_bind("0.0.0.0", tls=True, insecure=False)
    check_bind("0.0.0.0", tls=False, insecure=True)
    with pytest.raises(ValueError) as refused:
        check_bind("0.0.0.0", tls=False, insecure=False)
    assert "\n" not in str(refused.value) and "--tls-cert" in str(refused.value) and "--insecure" in str(refused.value)


def kvpager(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpager", *args], capture_output=True, text=True, env=ENV,
                          timeout=60)


def test_the_cli_refuses_plain_http_metrics_beyond_loopback(pki, tmp_path):
    files = write(tmp_path, tokens=json.dumps({"tokens": [{"token": TOKEN, "role": "admin"}]}), token=TOKEN)
    manager = kvpager("manager", "--port", "0", "--auth-tokens", files["tokens"], "--metrics-host", "0.0.0.0",
                      "--metrics-port", "0")
    worker = kvpager("worker", "--manager", "127.0.0.1:1", "--host", "0.0.0.0", "--metrics-port", "0",
                     "--auth-token", files["token"], "--manager-token", files["token"])
    for proc, flag in ((manager, "--metrics-host"), (worker, "--host")):
        assert proc.returncode == 1, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "refusing to serve /metrics in plain HTTP on 0.0.0.0" in lines[0], proc.stderr
        assert flag in lines[0] and "--tls-cert" in lines[0] and "--insecure" in lines[0]
