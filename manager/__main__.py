"""``python -m kvpager.manager --port P`` (or ``kvpager-manager``): serve the block manager."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading

from grpc_health.v1 import health_pb2

from . import config as config_mod
from .errors import ManagerError
from .service import SERVICE_NAME, create_server

log = logging.getLogger("kvpager.manager")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpager-manager", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one (default 50051)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds to finish RPCs in flight on shutdown")
    config_mod.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_mod.from_args(args)
    except ManagerError as err:
        parser.error(str(err))

    server, port, service, health_servicer = create_server(config, f"{args.host}:{args.port}")
    # The pools are hundreds of thousands of long-lived objects: keep the collector from
    # rescanning them (a full collection would otherwise stall every RPC for ~0.1-0.4 s), and
    # collect the young generation less often (each Step allocates thousands of short-lived ones).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    log.info("block manager listening on %s:%d (%s)", args.host, port, config)
    print(f"listening on {args.host}:{port}", flush=True)
    stop.wait()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(args.grace).wait()
    service.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
