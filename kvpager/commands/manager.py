"""Serve the block manager over gRPC (``kvpager manager``; also ``python -m kvpager.manager`` and
``kvpager-manager``).

It serves the standard gRPC health service and reflection, prints ``listening on HOST:PORT``
(and ``metrics on HOST:PORT`` with --metrics-port: HTTPS when it serves TLS) once it accepts
calls, and stops gracefully on SIGTERM or SIGINT. With --num-gpu-blocks 0 the pools are sized from the capacity of the
workers once every tensor-parallel rank registered.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from dataclasses import fields

from grpc_health.v1 import health_pb2

from kvpager.commands import cli, security

from kvpager.manager import config as config_mod
from kvpager.manager.config import ManagerConfig
from kvpager.errors import ManagerError
from kvpager.manager.service import SERVICE_NAME, create_server, settle_garbage_collector
from kvpager.manager.wal import CorruptState

log = logging.getLogger("kvpager.manager")

# What each ManagerConfig field means, for --help (the field's env var and default are added).
_CONFIG_HELP = {
    "block_size": "tokens per KV block",
    "num_gpu_blocks": "GPU pool size in blocks (block 0 is the null block padding names); 0: size both pools "
                      "from the capacity of the workers that register",
    "num_cpu_blocks": "CPU swap pool size in blocks",
    "max_pool_blocks_from_workers": "largest pool sized from the workers' capacity (--num-gpu-blocks 0); a worker "
                                    "reporting more blocks is refused (INVALID_ARGUMENT) before anything is built",
    "watermark": "fraction of GPU blocks kept free at admission and swap-in",
    "enable_prefix_caching": "reuse cached full prompt blocks across sequences (true/false)",
    "max_seq_len": "longer sequences are rejected (INVALID_ARGUMENT)",
    "worker_heartbeat_timeout": "seconds without a heartbeat before a worker is dropped",
    "worker_plan_timeout": "deadline in seconds of one ExecutePlan call to a worker",
    "max_prompt_tokens": "longest prompt one Allocate may name (INVALID_ARGUMENT above)",
    "max_id_len": "longest seq_id, cache_namespace or request_id, in characters (INVALID_ARGUMENT above)",
    "max_step_operations": "most operations in one Step; each sequence of an append_batch, swap_out or swap_in "
                           "counts as one (INVALID_ARGUMENT above)",
    "max_step_forks": "most forks in one Step (INVALID_ARGUMENT above)",
    "max_sequences": "most sequences held at once: live ones, and lost ones until freed (an Allocate or Fork "
                     "above is refused RESOURCE_EXHAUSTED)",
    "max_block_table_entries": "most block-table entries of all live sequences together; a fork copies its "
                               "parent's table (an Allocate or Fork above is refused RESOURCE_EXHAUSTED)",
    "max_reply_bytes": "largest answer in bytes; a call whose answer would be larger is refused, nothing "
                       "applied (OUT_OF_RANGE)",
    "request_cache_entries": "answers kept by request id for retries, at most this many",
    "request_cache_bytes": "answers kept by request id, at most this many bytes (ids and answers)",
    "request_cache_ttl": "seconds an answer is kept by request id for retries",
    "state_dir": "directory of the write-ahead log and snapshots: every acknowledged change survives a crash "
                 "and is recovered at start (docs/durability.md)",
    "fsync": "when the log is fsynced: always (before each answer), batch (every 10 ms: a power loss may lose "
             "the last 10 ms, a crash of the process nothing), never (the OS decides)",
}
# Where the command's default differs from ManagerConfig's: the pools are sized from the workers
# that register, so `kvpager manager` and `kvpager worker` agree with no flags at all.
_CLI_DEFAULTS = {"num_gpu_blocks": 0}
_KINDS = {bool: cli.parse_bool, "bool": cli.parse_bool, float: cli.number, "float": cli.number, str: str, "str": str}
_METAVARS = {bool: "BOOL", "bool": "BOOL", float: "X", "float": "X", str: "S", "str": "S"}
_METAVARS_BY_NAME = {"state_dir": "DIR", "fsync": "always|batch|never"}


def configure(parser: argparse.ArgumentParser) -> None:
    cli.flag(parser, "--host", env="KVPAGER_HOST", default="127.0.0.1", metavar="HOST",
             help="address to bind the gRPC server (0.0.0.0: every interface)")
    cli.flag(parser, "--port", env="KVPAGER_PORT", type=cli.port_number, default=50051, metavar="PORT",
             help="gRPC port; 0 picks a free one")
    cli.flag(parser, "--grace", env="KVPAGER_GRACE", type=cli.number, default=5.0, metavar="SECONDS",
             help="seconds to finish RPCs in flight on shutdown")
    cli.flag(parser, "--metrics-host", env="KVPAGER_METRICS_HOST", default="127.0.0.1", metavar="HOST",
             help="address to bind the Prometheus /metrics endpoint (HTTPS with --tls-cert; without it, only a "
                  "loopback address unless --insecure)")
    cli.flag(parser, "--metrics-port", env="KVPAGER_METRICS_PORT", type=cli.port_number, metavar="PORT",
             default_help="unset: no metrics endpoint",
             help="serve /metrics and /sd/workers on this port (0: a free one)")
    security.server_security_flags(parser, "the manager", "to the workers", _INSECURE, _CREDENTIAL_FILES)
    for f in fields(ManagerConfig):
        cli.flag(parser, f"--{f.name.replace('_', '-')}", env=f"KVPAGER_{f.name.upper()}",
                 default=_CLI_DEFAULTS.get(f.name, f.default),
                 type=_KINDS.get(f.type, cli.integer),
                 metavar=_METAVARS_BY_NAME.get(f.name, _METAVARS.get(f.type, "N")),
                 default_help="unset: state in memory only" if f.name == "state_dir" else None,
                 help=_CONFIG_HELP.get(f.name, f.name.replace("_", " ")))


# The manager's credential files: (flag, environment variable, without it, help).
_CREDENTIAL_FILES = (
    ("--auth-tokens", "KVPAGER_AUTH_TOKENS", "no token check",
     'JSON {"tokens": [{"token" or "sha256": ..., "tenant": ..., "role": "scheduler|worker|admin"}]}: every call '
     "but health and reflection needs 'authorization: Bearer TOKEN' of a role allowed to make it"),
    ("--worker-tls-ca", "KVPAGER_WORKER_TLS_CA", "plaintext",
     "connect to the workers' CacheWorker service over TLS, verifying their certificates with this PEM CA"),
    ("--worker-service-token", "KVPAGER_WORKER_SERVICE_TOKEN", "none sent",
     "file holding the token the manager sends to the workers' CacheWorker service (the workers' --manager-token)"),
    ("--metrics-token", "KVPAGER_METRICS_TOKEN", "no token check",
     "file holding the token /metrics and /sd/workers require ('Authorization: Bearer TOKEN'; Prometheus: "
     "authorization.credentials_file)"),
)


# --insecure's help: who may do what without credentials.
_INSECURE = ("serve without credentials (no token check; plaintext unless --tls-cert): anyone who reaches the "
             "port can call everything, including RegisterWorker. Required when --auth-tokens is not given")


def server_security(args: argparse.Namespace) -> dict:
    """create_server's security arguments from the flags; refuses to run without credentials
    unless --insecure."""
    from kvpager import auth

    if args.auth_tokens is None and not args.insecure:
        raise cli.Failure("no credentials: pass --auth-tokens FILE (and --tls-cert FILE --tls-key FILE), or "
                          "--insecure to serve without authentication")
    security.check_mutual_tls(args)
    with security.reading_credentials():
        tokens = auth.TokenTable.load(args.auth_tokens) if args.auth_tokens else None
        tls = auth.TLS.load(args.tls_cert, args.tls_key, args.tls_client_ca)
        worker_token = auth.read_token(args.worker_service_token, "--worker-service-token file")
        worker_tls = None
        if args.worker_tls_ca:
            worker_tls = auth.TLS(cert=tls.cert, key=tls.key, ca=auth.read_bytes(args.worker_tls_ca, "--worker-tls-ca"))
    return dict(tokens=tokens, tls=tls if tls.serves else None, worker_tls=worker_tls, worker_token=worker_token)


def metrics_security(args: argparse.Namespace, secure: dict) -> dict:
    """MetricsServer's security arguments: HTTPS with the gRPC certificate, the --metrics-token;
    refuses plain HTTP beyond loopback unless --insecure."""
    from kvpager import auth
    from kvpager.metrics_http import check_bind

    if args.metrics_port is None:
        return {}
    try:
        check_bind(args.metrics_host, secure["tls"] is not None, args.insecure)
        token = auth.read_token(args.metrics_token, "--metrics-token file")
    except (ValueError, auth.CredentialError) as err:
        raise cli.Failure(str(err)) from err
    return dict(tls=secure["tls"], token=token)


def _warn_about_security(args: argparse.Namespace, secure: dict) -> None:
    from kvpager.hosts import is_loopback

    if secure["tokens"] is None:
        log.warning("--insecure: serving WITHOUT authentication on %s:%s; anyone who reaches it can read and "
                    "change every sequence and register workers", args.host, args.port)
    if secure["tls"] is None and not is_loopback(args.host):
        log.warning("serving plaintext gRPC on %s: tokens and data cross the network unencrypted "
                    "(pass --tls-cert and --tls-key)", args.host)
    if args.metrics_port is not None and not is_loopback(args.metrics_host):
        if secure["tls"] is None:
            log.warning("--insecure: /metrics and /sd/workers on %s are plain HTTP: keep them on a private network "
                        "(docs/security.md)", args.metrics_host)
        elif args.metrics_token is None:
            log.warning("/metrics and /sd/workers on %s need no token: anyone who reaches them can read them "
                        "(--metrics-token FILE)", args.metrics_host)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_mod.from_args(args)
    except ManagerError as err:
        names = [f.name for f in fields(ManagerConfig) if hasattr(args, f.name)]
        raise cli.UsageError(cli.fields_as_flags(str(err), names)) from err
    if args.metrics_token is not None and args.metrics_port is None:  # else the token would guard nothing, silently
        raise cli.UsageError("--metrics-token (or KVPAGER_METRICS_TOKEN) needs --metrics-port (or "
                             "KVPAGER_METRICS_PORT): only that endpoint takes the token")
    secure = server_security(args)
    metrics_secure = metrics_security(args, secure)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()  # set by SIGTERM or SIGINT, even one that comes while starting

    def on_signal(signum, _frame):
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _check_bindable(args.host, args.port)
    try:
        server, port, service, health_servicer = create_server(config, f"{args.host}:{args.port}", **secure)
    except CorruptState as err:  # --state-dir could not be recovered
        raise cli.Failure(f"cannot recover the manager's state: {cli.one_line(err)}") from err
    except (OSError, RuntimeError) as err:  # grpc reports a failed bind as either
        raise cli.Failure(f"cannot serve on {args.host}:{args.port}: {cli.one_line(err)}") from err
    metrics = None
    if args.metrics_port is not None:
        from kvpager.metrics_http import MetricsServer

        try:  # as service.serve_metrics does, with HTTPS and the token
            metrics = MetricsServer(service.metrics.registry, args.metrics_host, args.metrics_port,
                                    {"/sd/workers": service.worker_targets}, **metrics_secure)
        except (OSError, ValueError) as err:
            service.close()
            raise cli.Failure(cli.one_line(err)) from err
    _warn_about_security(args, secure)  # once it can serve: a failure to start stays one line
    settle_garbage_collector()   # a full collection would stall every RPC for ~0.1-0.4 s
    server.start()
    log.info("block manager listening on %s:%d (%s)", args.host, port, config)
    print(f"listening on {args.host}:{port}", flush=True)
    if metrics is not None:
        print(f"metrics on {metrics.address}", flush=True)
    stop.wait()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(args.grace).wait()
    if metrics is not None:
        metrics.close()
    service.close()
    log.info("stopped")
    return 0


def _check_bindable(host: str, port: int) -> None:
    """Bind the address once ourselves first, so that a port in use ends in one clear line
    (gRPC's C core reports a failed bind by logging its own lines to stderr)."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may leave TIME_WAIT
            sock.bind(sockaddr)
    except OSError as err:
        raise cli.Failure(f"cannot serve on {host}:{port}: {err.strerror or err}") from err


def main(argv: list[str] | None = None) -> int:
    return cli.run_main("kvpager-manager", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
