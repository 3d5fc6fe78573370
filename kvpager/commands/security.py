"""The security flags of the commands, in one place (docs/security.md): a client's (``demo``,
``stats``: a token and a CA), and a gRPC server's (``manager``, ``worker``: ``--insecure``,
token files, ``--tls-cert``/``--tls-key``/``--tls-client-ca``), and the checks they share."""

from __future__ import annotations

import argparse
import contextlib
from typing import Iterator

from kvpager.commands import cli


def file_flag(parser: argparse.ArgumentParser, name: str, env: str, unset: str, help: str) -> None:
    """A flag naming a file of credentials (a token, a certificate, a key); ``unset``: what
    happens without it."""
    cli.flag(parser, name, env=env, metavar="FILE", default_help=f"unset: {unset}", help=help)


# A command's own credential files: (flag, environment variable, what happens without it, help).
CredentialFiles = tuple[tuple[str, str, str, str], ...]


def server_security_flags(parser: argparse.ArgumentParser, who: str, client_role: str, insecure: str,
                          credential_files: CredentialFiles) -> None:
    """The security flags of a command that serves gRPC (docs/security.md): ``--insecure`` (run
    without credentials; ``insecure`` says who may then do what), ``--tls-cert``, ``--tls-key`` and
    ``--tls-client-ca`` (``who`` serves; its certificate is also its client certificate towards
    ``client_role``'s peer), then the command's own ``credential_files``."""
    cli.flag(parser, "--insecure", env="KVPAGER_INSECURE", type=bool, default=False, help=insecure)
    file_flag(parser, "--tls-cert", "KVPAGER_TLS_CERT", "plaintext",
              f"PEM certificate (chain) {who} serve(s) TLS with (with --tls-key); also the client certificate "
              f"shown {client_role}")
    cli.flag(parser, "--tls-key", env="KVPAGER_TLS_KEY", metavar="FILE", help="PEM private key of --tls-cert")
    file_flag(parser, "--tls-client-ca", "KVPAGER_TLS_CLIENT_CA", "no client certificate",
              f"mutual TLS on {who}'s service: accept only clients with a certificate signed by this PEM CA")
    for name, env, unset, text in credential_files:
        file_flag(parser, name, env, unset, text)


def check_mutual_tls(args: argparse.Namespace) -> None:
    """--tls-client-ca asks for mutual TLS, which needs the server's own certificate."""
    if args.tls_client_ca and not args.tls_cert:
        raise cli.UsageError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")


@contextlib.contextmanager
def reading_credentials() -> Iterator[None]:
    """A credential file that cannot be read or parsed fails the command in one line."""
    from kvpager import auth

    try:
        yield
    except auth.CredentialError as err:
        raise cli.Failure(str(err)) from err


def client_security_flags(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--auth-token`` and ``--tls-ca``: how a client reaches a secured manager (docs/security.md)."""
    file_flag(parser, "--auth-token", "KVPAGER_AUTH_TOKEN", "none sent",
              f"file holding the bearer token to send the manager (a scheduler or admin role){note}")
    file_flag(parser, "--tls-ca", "KVPAGER_TLS_CA", "plaintext",
              f"connect over TLS, verifying the manager's certificate with this PEM CA{note}")


def client_security(args: argparse.Namespace) -> dict:
    """BlockManagerClient's token and root_certificates from ``client_security_flags``."""
    from kvpager import auth

    with reading_credentials():
        return dict(token=auth.read_token(args.auth_token, "--auth-token file"),
                    root_certificates=auth.read_bytes(args.tls_ca, "--tls-ca file"))
