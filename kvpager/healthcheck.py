"""``python -m kvpager.healthcheck HOST:PORT [--service NAME]``: one gRPC health check.

Asks the standard gRPC health service (``grpc.health.v1.Health/Check``) at HOST:PORT and exits 0
when the answer is SERVING; otherwise it prints one line saying why on stderr and exits 1
(NOT_SERVING, an unknown service, no answer within the timeout). The container health checks
in ``deploy/docker-compose.yml`` and the images' HEALTHCHECKs run it.

The block manager answers for the empty service name (the whole server) and for
``kvpager.v1.BlockManager``; it reports NOT_SERVING while a tensor-parallel rank of its worker
group is missing, so the check also tells whether the workers are complete.
Needs only grpcio and grpcio-health-checking (no torch).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 3.0, ca: Optional[bytes] = None,
          cert: Optional[bytes] = None, key: Optional[bytes] = None) -> Optional[str]:
    """None when ``service`` at ``target`` is SERVING, else a one-line reason. ``ca``: over TLS,
    verifying the server with it (``cert``/``key``: a client certificate for mutual TLS)."""
    from kvpager import auth

    try:
        with auth.raw_channel(target, ca, cert, key) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as err:
        code = err.code()
        if code == grpc.StatusCode.NOT_FOUND:
            return f"{target}: unknown service {service!r}"
        lines = (err.details() or "").splitlines()
        name = code.name if code is not None else "UNKNOWN"
        return f"{target}: {name}{': ' + lines[0] if lines else ''}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target}: {service or '(server)'} is {status}"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpager.healthcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", metavar="HOST:PORT", help="the gRPC server to ask")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    parser.add_argument("--tls-ca", metavar="FILE", help="connect over TLS, verifying the server with this PEM CA")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--tls-key", metavar="FILE", help="its private key (PEM)")
    args = parser.parse_args(argv)
    from kvpager import auth

    try:
        if args.tls_cert and not args.tls_ca:   # else the check would go out in plaintext, the certificate unused
            raise auth.CredentialError("--tls-cert needs --tls-ca (the CA that verifies the server): TLS is used "
                                       "only with a CA to check the server against")
        tls = auth.TLS.load(args.tls_cert, args.tls_key, ca=args.tls_ca)
    except auth.CredentialError as err:
        print(f"unhealthy: {err}", file=sys.stderr)
        return 1
    reason = check(args.target, args.service, args.timeout, tls.ca, tls.cert, tls.key)
    if reason is not None:
        print(f"unhealthy: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
