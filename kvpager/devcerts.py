"""Credentials for a kvpager deployment: a private CA, certificates and tokens (``python -m kvpager.devcerts DIR``).

What deploy/docker-compose.yml's one-shot ``certs`` service runs on every start: it creates what
is missing and keeps what exists, so the first start makes everything and later starts change
nothing (but renew certificates that are expiring, or that lack a name asked for with --san).
Each consumer gets a folder of its own (in compose, a named volume of its own), holding only
what it needs:

====================  ==============================================================================
``ca/``               ``ca.pem``, ``ca.key`` (the CA's private key: only this command reads it) and
                      ``state.json``, the tokens every other file is made from
``manager/``          ``ca.pem``, ``tls.pem``/``tls.key`` (SANs: manager, localhost, 127.0.0.1 and
                      --san), ``tokens.json`` (the ``--auth-tokens`` file: SHA-256 digests only),
                      ``worker-service.token`` (``--worker-service-token``), ``metrics.token``
``worker/``           ``ca.pem``, ``tls.pem``/``tls.key`` (SANs: worker, worker-cpu, localhost,
                      127.0.0.1 and --san), ``worker.token`` (``--auth-token``), ``manager.token``
                      (``--manager-token``), ``scheduler.token`` (``kvpager demo``), ``ray.token``
                      (``RAY_AUTH_TOKEN_PATH``)
``prometheus/``       ``ca.pem``, ``metrics.token`` (scrapes of the manager)
``grafana/``          ``admin-password`` (``GF_SECURITY_ADMIN_PASSWORD__FILE``)
``client/``           ``ca.pem``, ``scheduler.token``, ``admin.token`` (``kvpager stats --auth-token``)
====================  ==============================================================================

Tokens are random (``secrets.token_urlsafe(32)``): one ``scheduler`` (tenant ``default``), one
``worker``, one ``admin``, the manager-to-workers token, the metrics token, Ray's token and
Grafana's admin password. ``--rotate-tokens`` makes new ones, ``--renew`` issues new
certificates from the same CA; removing ``ca/`` starts over. ``--owner ROLE=UID[:GID]`` gives a
folder to the user its container runs as (needs root); run as root without it, files take the
owner of their folder, so a rerun (``--renew``, ``--rotate-tokens``) needs no ``--owner``. Private keys and secrets are mode 0600,
folders 0700. Needs the ``cryptography`` package.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import ipaddress
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE_DAYS = 30
MANAGER_NAMES = ("manager", "localhost", "127.0.0.1")
WORKER_NAMES = ("worker", "worker-cpu", "localhost", "127.0.0.1")
ROLES = ("manager", "worker", "prometheus", "grafana", "client")
TOKEN_NAMES = ("scheduler", "worker", "admin", "worker_service", "metrics", "ray", "grafana_admin_password")
SCHEDULER_TENANT = "default"


class Failure(Exception):
    """One line for the user."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _general_name(name: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        if not name or any(c.isspace() or c in "/:@" for c in name):
            raise Failure(f"not a host name or IP address: {name!r}") from None
        return x509.DNSName(name)


def _names(names: Iterable[str]) -> list[str]:
    """Unique, in order."""
    seen: list[str] = []
    for name in names:
        name = name.strip()
        if name and name not in seen:
            seen.append(name)
    return seen


# ---- writing files ----------------------------------------------------------------------------------
def _write(path: Path, data: bytes, mode: int) -> bool:
    """Write ``data`` to ``path`` atomically with ``mode`` unless it holds that already; True if written."""
    try:
        if path.read_bytes() == data:
            os.chmod(path, mode)
            return False
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return True


# ---- the CA and the certificates ------------------------------------------------------------------
class Authority:
    def __init__(self, cert, key) -> None:
        self.cert, self.key = cert, key

    @property
    def pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def load_or_create(cls, folder: Path) -> tuple["Authority", bool]:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        cert_path, key_path = folder / "ca.pem", folder / "ca.key"
        if cert_path.exists() and key_path.exists():
            try:
                cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
                key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            except ValueError as err:
                raise Failure(f"cannot read the CA in {folder}: {err} (remove the folder to make a new CA)") from err
            if cert.not_valid_after_utc - _now() > datetime.timedelta(days=RENEW_BEFORE_DAYS):
                return cls(cert, key), False
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvpager deployment CA {secrets.token_hex(4)}")])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        authority = cls(cert, key)
        _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), 0o600)
        _write(cert_path, authority.pem, 0o644)
        return authority, True

    def issue(self, common_name: str, names: Sequence[str]) -> tuple[bytes, bytes]:
        """A server and client certificate (PEM) and its key for ``names`` (DNS names or IPs)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(min(now + datetime.timedelta(days=LEAF_DAYS), self.cert.not_valid_after_utc))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                             crl_sign=False, content_commitment=False, data_encipherment=False,
                                             key_agreement=True, encipher_only=False, decipher_only=False),
                               critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    def still_good(self, cert_pem: bytes, names: Sequence[str]) -> bool:
        """Whether ``cert_pem`` was issued by this CA, is valid for a while yet, and names ``names``."""
        from cryptography import x509

        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            cert.verify_directly_issued_by(self.cert)
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except Exception:  # noqa: BLE001 (unreadable, another CA's, no SANs: reissue)
            return False
        if cert.not_valid_after_utc - _now() < datetime.timedelta(days=RENEW_BEFORE_DAYS):
            return False
        return all(_general_name(n) in sans for n in names)


# ---- the whole set ----------------------------------------------------------------------------------
def _tokens_document(tokens: dict[str, str]) -> bytes:
    def sha(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    return (json.dumps({"tokens": [
        {"sha256": sha(tokens["scheduler"]), "tenant": SCHEDULER_TENANT, "role": "scheduler"},
        {"sha256": sha(tokens["worker"]), "tenant": "", "role": "worker"},
        {"sha256": sha(tokens["admin"]), "tenant": "", "role": "admin"},
    ]}, indent=2) + "\n").encode()


def _load_state(path: Path, rotate: bool) -> tuple[dict[str, str], bool]:
    state: dict[str, str] = {}
    if path.exists() and not rotate:
        try:
            loaded = json.loads(path.read_text())
        except ValueError as err:
            raise Failure(f"{path} is not JSON: {err} (remove it to make new tokens)") from err
        state = {k: v for k, v in loaded.get("tokens", {}).items() if isinstance(v, str) and len(v) >= 16}
    changed = False
    for name in TOKEN_NAMES:
        if name not in state:
            state[name] = new_token()
            changed = True
    return state, changed


def _chown(path: Path, owner: Optional[tuple[int, int]]) -> None:
    if owner is None:
        return
    try:
        os.chown(path, *owner)
    except PermissionError as err:
        raise Failure(f"cannot give {path} to uid {owner[0]}: {err.strerror} (--owner needs root)") from err


def parse_owner(text: str) -> tuple[str, tuple[int, int]]:
    role, sep, ids = text.partition("=")
    if not sep or role not in ROLES:
        raise argparse.ArgumentTypeError(f"expected ROLE=UID[:GID] with ROLE one of {', '.join(ROLES)}, got {text!r}")
    uid, _, gid = ids.partition(":")
    try:
        return role, (int(uid), int(gid or uid))
    except ValueError:
        raise argparse.ArgumentTypeError(f"UID and GID must be numbers, got {ids!r}") from None


def ensure(root: os.PathLike, sans: Sequence[str] = (), owners: Optional[dict[str, tuple[int, int]]] = None,
           renew: bool = False, rotate_tokens: bool = False) -> dict[str, list[str]]:
    """Make or complete the credentials under ``root``; returns {folder: [files written]}."""
    root = Path(root)
    owners = owners or {}
    written: dict[str, list[str]] = {}
    folders = {name: root / name for name in ("ca", *ROLES)}
    for name, folder in folders.items():
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
    authority, new_ca = Authority.load_or_create(folders["ca"])
    if new_ca:
        written["ca"] = ["ca.pem", "ca.key"]
    state_path = folders["ca"] / "state.json"
    tokens, changed = _load_state(state_path, rotate_tokens)
    if changed:
        _write(state_path, (json.dumps({"tokens": tokens}, indent=2) + "\n").encode(), 0o600)
        written.setdefault("ca", []).append("state.json")

    extra = _names(sans)
    manager_names = _names([*MANAGER_NAMES, *extra])
    worker_names = _names([*WORKER_NAMES, *extra])
    ca_pem = authority.pem
    public, secret = 0o644, 0o600
    files: dict[str, dict[str, tuple[bytes, int]]] = {
        "manager": {"ca.pem": (ca_pem, public), "tokens.json": (_tokens_document(tokens), secret),
                    "worker-service.token": (tokens["worker_service"].encode() + b"\n", secret),
                    "metrics.token": (tokens["metrics"].encode() + b"\n", secret)},
        "worker": {"ca.pem": (ca_pem, public), "worker.token": (tokens["worker"].encode() + b"\n", secret),
                   "manager.token": (tokens["worker_service"].encode() + b"\n", secret),
                   "scheduler.token": (tokens["scheduler"].encode() + b"\n", secret),
                   "ray.token": (tokens["ray"].encode(), secret)},
        "prometheus": {"ca.pem": (ca_pem, public), "metrics.token": (tokens["metrics"].encode() + b"\n", secret)},
        "grafana": {"admin-password": (tokens["grafana_admin_password"].encode(), secret)},
        "client": {"ca.pem": (ca_pem, public), "scheduler.token": (tokens["scheduler"].encode() + b"\n", secret),
                   "admin.token": (tokens["admin"].encode() + b"\n", secret)},
    }
    for role, names in (("manager", manager_names), ("worker", worker_names)):
        cert_path = folders[role] / "tls.pem"
        current = cert_path.read_bytes() if cert_path.exists() and (folders[role] / "tls.key").exists() else b""
        if renew or new_ca or not authority.still_good(current, names):
            cert, key = authority.issue(f"kvpager {role}", names)
            files[role]["tls.key"] = (key, secret)
            files[role]["tls.pem"] = (cert, public)
    for role in ROLES:
        owner = owners.get(role)
        if owner is None and os.geteuid() == 0:  # keep a folder's owner (a rerun without --owner)
            info = folders[role].stat()
            owner = (info.st_uid, info.st_gid)
        for name, (data, mode) in files[role].items():
            if _write(folders[role] / name, data, mode):
                written.setdefault(role, []).append(name)
            _chown(folders[role] / name, owner)
        _chown(folders[role], owner)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpager.devcerts",
        description="Make (or complete) a kvpager deployment's CA, certificates and tokens in DIR; "
                    "what exists and is still good is kept.")
    parser.add_argument("dir", metavar="DIR", help="where to write (subfolders ca, manager, worker, prometheus, "
                                                   "grafana, client)")
    parser.add_argument("--san", action="append", default=[], metavar="NAME",
                        help="another DNS name or IP address for the manager's and workers' certificates "
                             "(repeatable; also KVPAGER_CERT_SANS, comma-separated)")
    parser.add_argument("--owner", action="append", default=[], type=parse_owner, metavar="ROLE=UID[:GID]",
                        help="give ROLE's folder and files to this user (needs root)")
    parser.add_argument("--renew", action="store_true", help="issue new certificates from the same CA")
    parser.add_argument("--rotate-tokens", action="store_true",
                        help="make new tokens, Ray token and Grafana password (restart every service after)")
    args = parser.parse_args(argv)
    sans = [*args.san, *os.environ.get("KVPAGER_CERT_SANS", "").replace(" ", ",").split(",")]
    try:
        written = ensure(args.dir, sans, dict(args.owner), renew=args.renew, rotate_tokens=args.rotate_tokens)
    except (Failure, OSError) as err:
        print(f"devcerts: {err}", file=sys.stderr)
        return 1
    if not written:
        print(f"devcerts: {args.dir}: everything in place, nothing changed", flush=True)
    for folder, names in written.items():
        print(f"devcerts: {os.path.join(args.dir, folder)}: wrote {', '.join(names)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
