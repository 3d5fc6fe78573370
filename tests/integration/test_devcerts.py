"""kvpager.devcerts, what the compose file's certs service runs: the certificates it makes verify
against its CA (checked with `cryptography`) and name what they must; the tokens file is one the
manager reads; reruns keep everything, --san and --renew reissue certificates from the same CA,
--rotate-tokens changes the tokens; and a real `kvpager manager` started with the files, as the
compose file starts it, serves TLS on 127.0.0.1 (gRPC and /metrics), refuses plaintext and
calls without a token, and answers the scheduler token."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from kvpager import auth, devcerts
from kvpager import client as C
from kvpager import errors
from kvpager.metrics_http import fetch, scrape

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_")}, "PYTHONUNBUFFERED": "1"}


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def sans(cert: x509.Certificate) -> list[str]:
    return [str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]


def token(path: Path) -> str:
    return path.read_text().strip()


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("credentials")
    done = subprocess.run([sys.executable, "-m", "kvpager.devcerts", str(root), "--san", "10.1.2.3",
                           "--san", "node.example"], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0, done.stderr
    return root


def test_certificates_verify_against_the_ca_and_name_their_hosts(made):
    ca = load_cert(made / "ca" / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for role, expected in (("manager", devcerts.MANAGER_NAMES), ("worker", devcerts.WORKER_NAMES)):
        cert = load_cert(made / role / "tls.pem")
        cert.verify_directly_issued_by(ca)  # raises if another key signed it
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert set(sans(cert)) == {*expected, "10.1.2.3", "node.example"}
        assert ipaddress.ip_address("127.0.0.1") in [n.value for n in cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value if isinstance(n, x509.IPAddress)]
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages
        key = serialization.load_pem_private_key((made / role / "tls.key").read_bytes(), password=None)
        assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    # The same CA in every folder that verifies with it.
    for role in ("manager", "worker", "prometheus", "client"):
        assert (made / role / "ca.pem").read_bytes() == (made / "ca" / "ca.pem").read_bytes()
    # The CA's key stays in ca/, nowhere else.
    ca_key = (made / "ca" / "ca.key").read_bytes()
    assert not [p for p in made.rglob("*") if p.is_file() and p.parent.name != "ca" and p.read_bytes() == ca_key]


def test_secrets_are_private_and_tokens_distinct(made):
    for path in made.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.is_dir():
            assert mode == 0o700, path
        elif path.name.endswith((".key", ".token", ".json")) or path.name == "admin-password":
            assert mode == 0o600, path
    values = [token(made / "client" / "scheduler.token"), token(made / "client" / "admin.token"),
              token(made / "worker" / "worker.token"), token(made / "worker" / "manager.token"),
              token(made / "manager" / "metrics.token"), token(made / "worker" / "ray.token"),
              (made / "grafana" / "admin-password").read_text()]
    assert len(set(values)) == len(values) and all(len(v) >= 32 for v in values)
    assert token(made / "worker" / "manager.token") == token(made / "manager" / "worker-service.token")
    assert token(made / "prometheus" / "metrics.token") == token(made / "manager" / "metrics.token")


def test_tokens_file_is_what_the_manager_reads(made):
    text = (made / "manager" / "tokens.json").read_text()
    table = auth.TokenTable.load(made / "manager" / "tokens.json")
    assert len(table) == 3
    for file, role in (("client/scheduler.token", "scheduler"), ("worker/worker.token", "worker"),
                       ("client/admin.token", "admin")):
        value = token(made / file)
        assert table.lookup(value).role == role
        assert value not in text  # digests only
    assert table.lookup(token(made / "worker" / "manager.token")) is None
    assert all("sha256" in entry for entry in json.loads(text)["tokens"])


def test_reruns_keep_what_is_good_and_renew_what_is_asked(tmp_path):
    root = tmp_path / "c"
    devcerts.ensure(root)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert devcerts.ensure(root) == {}  # nothing changed
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before

    # A new name: new leaf certificates (from the same CA), same tokens.
    written = devcerts.ensure(root, sans=["10.9.8.7"])
    assert set(written) == {"manager", "worker"} and "tls.pem" in written["worker"]
    assert "10.9.8.7" in sans(load_cert(root / "worker" / "tls.pem"))
    assert (root / "ca" / "ca.pem").read_bytes() == before[root / "ca" / "ca.pem"]
    load_cert(root / "worker" / "tls.pem").verify_directly_issued_by(load_cert(root / "ca" / "ca.pem"))
    assert (root / "client" / "admin.token").read_bytes() == before[root / "client" / "admin.token"]

    # A lost role folder (a removed volume) comes back with the same tokens.
    for path in (root / "prometheus").iterdir():
        path.unlink()
    devcerts.ensure(root, sans=["10.9.8.7"])
    assert (root / "prometheus" / "metrics.token").read_bytes() == before[root / "prometheus" / "metrics.token"]

    old_cert = (root / "manager" / "tls.pem").read_bytes()
    devcerts.ensure(root, sans=["10.9.8.7"], renew=True)
    assert (root / "manager" / "tls.pem").read_bytes() != old_cert

    devcerts.ensure(root, sans=["10.9.8.7"], rotate_tokens=True)
    assert (root / "client" / "admin.token").read_bytes() != before[root / "client" / "admin.token"]
    table = auth.TokenTable.load(root / "manager" / "tokens.json")
    assert table.lookup(token(root / "client" / "admin.token")).role == "admin"
    assert table.lookup(before[root / "client" / "admin.token"].decode().strip()) is None


def test_bad_input_ends_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvpager.devcerts", str(tmp_path / "x"), "--san", "a b"],
                          capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "not a host name" in done.stderr
    (tmp_path / "y" / "ca").mkdir(parents=True)
    (tmp_path / "y" / "ca" / "ca.pem").write_text("not a certificate")
    (tmp_path / "y" / "ca" / "ca.key").write_text("not a key")
    done = subprocess.run([sys.executable, "-m", "kvpager.devcerts", str(tmp_path / "y")], capture_output=True,
                          text=True, timeout=60, env=ENV)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "cannot read the CA" in done.stderr


def test_a_manager_started_with_them_serves_tls_and_requires_tokens(made):
    """`kvpager manager` with the generated files, flags as in deploy/docker-compose.yml."""
    m, c = made / "manager", made / "client"
    proc = subprocess.Popen([sys.executable, "-m", "kvpager", "manager", "--host", "127.0.0.1", "--port", "0",
                             "--metrics-host", "127.0.0.1", "--metrics-port", "0",
                             "--tls-cert", str(m / "tls.pem"), "--tls-key", str(m / "tls.key"),
                             "--auth-tokens", str(m / "tokens.json"), "--worker-tls-ca", str(m / "ca.pem"),
                             "--worker-service-token", str(m / "worker-service.token"),
                             "--metrics-token", str(m / "metrics.token"), "--num-gpu-blocks", "16",
                             "--num-cpu-blocks", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        first = proc.stdout.readline()
        match = re.match(r"listening on (\S+)", first)
        assert match, first + (proc.stderr.read() if proc.poll() is not None else "")
        target = match.group(1)
        metrics = re.match(r"metrics on (\S+)", proc.stdout.readline()).group(1)
        ca = (c / "ca.pem").read_bytes()

        with C.BlockManagerClient(target, token=token(c / "scheduler.token"), root_certificates=ca) as bm:
            assert bm.health() == "SERVING"
            bm.allocate("seq", num_tokens=4)
            assert bm.get_stats().running_sequences == 1
        with C.BlockManagerClient(target, retries=0, root_certificates=ca) as anonymous:
            with pytest.raises(errors.ManagerError) as refused:
                anonymous.get_stats()
            assert refused.value.code == "UNAUTHENTICATED"
        with C.BlockManagerClient(target, retries=0, token=token(made / "worker" / "worker.token"),
                                  root_certificates=ca) as worker:
            with pytest.raises(errors.ManagerError) as refused:
                worker.get_stats()
            assert refused.value.code == "PERMISSION_DENIED"
        with C.BlockManagerClient(target, timeout=5, retries=0, token=token(c / "scheduler.token")) as plaintext:
            with pytest.raises(errors.ManagerError) as refused:
                plaintext.get_stats()
            assert refused.value.code == "UNAVAILABLE"

        # /metrics and /sd/workers: HTTPS with the same certificate, and the metrics token.
        url = f"https://{metrics}"
        values = scrape(f"{url}/metrics", ca=ca, token=token(made / "prometheus" / "metrics.token"))
        assert values[("kvpager_sequences", (("state", "running"),))] == 1
        assert json.loads(fetch(f"{url}/sd/workers", ca=ca, token=token(made / "prometheus" / "metrics.token"))) == []
        with pytest.raises(urllib.error.HTTPError) as unauthorized:
            fetch(f"{url}/metrics", ca=ca)
        assert unauthorized.value.code == 401
        with pytest.raises((ConnectionError, urllib.error.URLError, OSError)):
            fetch(f"http://{metrics}/metrics", timeout=5)
    finally:
        proc.terminate()
        proc.wait(20)
    assert "WITHOUT authentication" not in proc.stderr.read()
