"""Serve the block manager over gRPC (``kvpager manager``; also ``python -m kvpager.manager`` and
``kvpager-manager``).

It serves the standard gRPC health service and reflection, prints ``listening on HOST:PORT``
(and ``metrics on HOST:PORT`` with --metrics-port) once it accepts calls, and stops gracefully
on SIGTERM or SIGINT. With --num-gpu-blocks 0 the pools are sized from the capacity of the
workers once every tensor-parallel rank registered.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
import sys
import threading
from dataclasses import fields

from grpc_health.v1 import health_pb2

from kvpager import cli

from . import config as config_mod
from .config import ManagerConfig
from .errors import ManagerError
from .service import SERVICE_NAME, create_server

log = logging.getLogger("kvpager.manager")

# What each ManagerConfig field means, for --help (the field's env var and default are added).
_CONFIG_HELP = {
    "block_size": "tokens per KV block",
    "num_gpu_blocks": "GPU pool size in blocks; 0: size both pools from the workers' capacity",
    "num_cpu_blocks": "CPU swap pool size in blocks",
    "watermark": "fraction of GPU blocks kept free at admission and swap-in",
    "enable_prefix_caching": "reuse cached full prompt blocks across sequences (true/false)",
    "max_seq_len": "longer sequences are rejected (INVALID_ARGUMENT)",
    "worker_heartbeat_timeout": "seconds without a heartbeat before a worker is dropped",
    "worker_plan_timeout": "deadline in seconds of one ExecutePlan call to a worker",
}
_KINDS = {bool: cli.parse_bool, "bool": cli.parse_bool, float: cli.number, "float": cli.number}
_METAVARS = {bool: "BOOL", "bool": "BOOL", float: "X", "float": "X"}


def configure(parser: argparse.ArgumentParser) -> None:
    cli.flag(parser, "--host", env="KVPAGER_HOST", default="127.0.0.1", metavar="HOST",
             help="address to bind the gRPC server (0.0.0.0: every interface)")
    cli.flag(parser, "--port", env="KVPAGER_PORT", type=cli.port_number, default=50051, metavar="PORT",
             help="gRPC port; 0 picks a free one")
    cli.flag(parser, "--grace", env="KVPAGER_GRACE", type=cli.number, default=5.0, metavar="SECONDS",
             help="seconds to finish RPCs in flight on shutdown")
    cli.flag(parser, "--metrics-host", env="KVPAGER_METRICS_HOST", default="127.0.0.1", metavar="HOST",
             help="address to bind the Prometheus /metrics endpoint")
    cli.flag(parser, "--metrics-port", env="KVPAGER_METRICS_PORT", type=cli.port_number, metavar="PORT",
             default_help="unset: no metrics endpoint",
             help="serve /metrics and /sd/workers on this port (0: a free one)")
    for f in fields(ManagerConfig):
        cli.flag(parser, f"--{f.name.replace('_', '-')}", env=f"KVPAGER_{f.name.upper()}", default=f.default,
                 type=_KINDS.get(f.type, cli.integer), metavar=_METAVARS.get(f.type, "N"),
                 help=_CONFIG_HELP.get(f.name, f.name.replace("_", " ")))


def run(args: argparse.Namespace) -> int:
    try:
        config = config_mod.from_args(args)
    except ManagerError as err:
        raise cli.UsageError(str(err)) from err
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()  # set by SIGTERM or SIGINT, even one that comes while starting

    def on_signal(signum, _frame):
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _check_bindable(args.host, args.port)
    try:
        server, port, service, health_servicer = create_server(config, f"{args.host}:{args.port}")
    except (OSError, RuntimeError) as err:  # grpc reports a failed bind as either
        raise cli.Failure(f"cannot serve on {args.host}:{args.port}: {cli.one_line(err)}") from err
    metrics = None
    if args.metrics_port is not None:
        try:
            metrics = service.serve_metrics(args.metrics_host, args.metrics_port)
        except OSError as err:
            service.close()
            raise cli.Failure(cli.one_line(err)) from err
    # The pools are hundreds of thousands of long-lived objects: keep the collector from
    # rescanning them (a full collection would otherwise stall every RPC for ~0.1-0.4 s), and
    # collect the young generation less often (each Step allocates thousands of short-lived ones).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
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
