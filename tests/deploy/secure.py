"""What "secure by default" means for a compose configuration, checked against the credentials
that the compose file's own certs command makes (:func:`assert_secure`)."""

from __future__ import annotations

import re
from pathlib import Path

from kvpager import devcerts

from .compose import GRPC_SERVICES, RAY_SERVICES, WORKER_SERVICES


def _strings(service: dict) -> list[str]:
    """Every string a service runs with: entrypoint, command, environment values, health check."""
    out = [str(a) for a in (service.get("entrypoint") or []) + (service.get("command") or [])]
    out += [str(v) for v in (service.get("environment") or {}).values() if v is not None]
    out += [str(a) for a in (service.get("healthcheck") or {}).get("test", [])]
    return out


def _flags(service: dict) -> dict[str, str]:
    return dict(a.split("=", 1) if "=" in a else (a, "") for a in service.get("command") or [] if a.startswith("--"))


def _san_names(cert_path: Path) -> set[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n.value) for n in sans}


def _verifies(cert_path: Path, ca_path: Path) -> bool:
    from cryptography import x509

    try:
        x509.load_pem_x509_certificate(cert_path.read_bytes()).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca_path.read_bytes()))
    except Exception:  # noqa: BLE001
        return False
    return True


def assert_secure(services: dict, tmp_path: Path, monkeypatch) -> None:
    """The security properties of a compose configuration (as `config` prints it):

    - nothing runs --insecure; every gRPC server has TLS and requires tokens, and the workers
      accept plans only from the manager; metrics beyond loopback are HTTPS;
    - the certs service runs first, and what every service reads under /run/secrets is a file
      that its command (python -m kvpager.devcerts, run here) makes, in a volume the service
      mounts read-only; the CA's key is in a volume only certs mounts;
    - the certificates verify against the CA and name the hosts they are dialed at;
    - every Ray node runs with token authentication and publishes no port;
    - Grafana has no anonymous access and its admin password comes from the generated file."""
    certs = services["certs"]
    assert certs["command"][:3] == ["python", "-m", "kvpager.devcerts"]
    # Run the certs service's own command (less --owner: that needs root) into a local folder.
    root = tmp_path / "certs-root"
    container_root = certs["command"][3]
    monkeypatch.setenv("KVPAGER_CERT_SANS", certs.get("environment", {}).get("KVPAGER_CERT_SANS") or "")
    assert devcerts.main([str(root), *[a for a in certs["command"][4:] if not a.startswith("--owner")]]) == 0
    volume_folder = {}
    for volume in certs["volumes"]:
        source, target = volume.split(":")[:2]
        assert target.startswith(container_root + "/"), volume
        volume_folder[source] = root / target[len(container_root) + 1:]

    for name, service in services.items():
        strings = _strings(service)
        assert not any("--insecure" in a for a in strings), name
        assert (service.get("environment") or {}).get("KVPAGER_INSECURE") in (None, "", "false", "0"), name
        if name == "certs":
            continue
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        mounts = {}
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            if source.startswith("secrets-"):
                assert source != "secrets-ca", f"{name} mounts the CA's private key"
                assert mode == ["ro"], f"{name} mounts {source} writable"
                mounts[target] = volume_folder[source]
        paths = [p for a in strings for p in re.findall(r"/run/secrets/[\w./-]+\w", a)]
        for path in paths:
            target = max((t for t in mounts if path.startswith(t + "/")), key=len, default=None)
            assert target, f"{name} reads {path}, which no secrets volume it mounts holds"
            assert (mounts[target] / path[len(target) + 1:]).is_file(), f"{name}: certs makes no {path}"

        def local(path: str) -> Path:
            target = max(t for t in mounts if path.startswith(t + "/"))
            return mounts[target] / path[len(target) + 1:]

        flags = _flags(service)
        if name in GRPC_SERVICES:
            assert {"--tls-cert", "--tls-key"} <= set(flags), name
            assert _verifies(local(flags["--tls-cert"]), local(next(p for p in paths if p.endswith("ca.pem"))))
        if name == "manager":
            assert {"--auth-tokens", "--worker-tls-ca", "--worker-service-token", "--metrics-token"} <= set(flags)
            assert "manager" in _san_names(local(flags["--tls-cert"]))
        if name in WORKER_SERVICES:
            assert {"--auth-token", "--tls-ca"} <= set(flags) and ({"--manager-token", "--tls-client-ca"} & set(flags))
            names = _san_names(local(flags["--tls-cert"]))
            assert service["environment"]["KVPAGER_WORKER_ADVERTISE_HOST"] in names, name  # what the manager dials
            manager_host = flags["--manager"].rsplit(":", 1)[0]
            manager_cert = volume_folder["secrets-manager"] / "tls.pem"
            assert manager_host in _san_names(manager_cert), f"{name} dials {manager_host}"
        if name in RAY_SERVICES:
            env = service["environment"]
            assert env["RAY_AUTH_MODE"] == "token", name
            assert local(env["RAY_AUTH_TOKEN_PATH"]).read_text().strip(), name
        if name.startswith("ray-head"):
            assert not service.get("ports"), f"{name} publishes Ray's ports"
        if name == "grafana":
            env = service["environment"]
            assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
            assert "GF_SECURITY_ADMIN_PASSWORD" not in env
            assert len(local(env["GF_SECURITY_ADMIN_PASSWORD__FILE"]).read_text()) >= 16
        if name == "prometheus":
            assert any(v.startswith("secrets-prometheus:") for v in service["volumes"])

