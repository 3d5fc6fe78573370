"""`kvpager worker` once its group runs: ``announce`` it, ``watch`` the ranks' gRPC health and the
manager (``ManagerWatch``) until a signal or a failure, then ``shut_down``.

SIGTERM and SIGINT both raise KeyboardInterrupt in the main thread (``stop_on_signals``), so the
command's ``finally`` stops the group wherever the signal finds it; a rank that stops answering
raises ``cli.Failure`` out of ``watch``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING, Callable, Optional

from kvpager.commands import cli
from kvpager.commands.worker_checks import check_manager, check_manager_agrees

if TYPE_CHECKING:
    from kvpager.commands.ray_cluster import RayNode

log = logging.getLogger("kvpager.worker")
WATCH_INTERVAL_S = 5.0      # how often the ranks' gRPC health is checked
WATCH_FAILURES = 3          # consecutive failed checks of one rank before giving up


def announce(group, args: argparse.Namespace, creds) -> None:
    """The group serves: one line per rank, the warning of an open plan service, `workers ready`.
    (The warning waits for this: a start that fails ends with one line.)"""
    for rank, (grpc_address, metrics, memory) in enumerate(zip(group.addresses, group.metrics_addresses,
                                                               group.memory_stats())):
        print(f"rank {rank}: grpc {grpc_address}, metrics {metrics or 'off'}, {cache_summary(memory)}", flush=True)
    if creds is None or not (creds.manager_token or creds.tls.client_ca):
        log.warning("--insecure: the ranks' CacheWorker service accepts plans from anyone who reaches it")
    print(f"workers ready: tensor parallel {len(group.actors)} on {'CUDA' if group.use_gpu else 'CPU'}, "
          f"model {args.model or ('small' if group.use_gpu else 'tiny')}, block size {group.configs[0].block_size}, "
          f"registered with {args.manager}", flush=True)


def cache_summary(memory) -> str:
    """A rank's cache in one phrase, from its WorkerMemoryStats: blocks and bytes of each tier."""
    return (f"cache {memory.num_gpu_blocks} blocks on {memory.device} ({_size(memory.gpu_cache_bytes)}) + "
            f"{memory.num_cpu_blocks} swap blocks ({_size(memory.cpu_cache_bytes)})")


def _size(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.0f} MiB"


class _Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, like SIGINT's KeyboardInterrupt."""


def stop_on_signals() -> None:
    """SIGTERM raises ``_Stopped``, SIGINT KeyboardInterrupt, where the main thread is. Called again
    after ``ray.init``, which installs its own SIGTERM handler."""

    def stop(signum, _frame):
        raise _Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def shut_down(group, node: Optional[RayNode]) -> None:
    """Stop the ranks, leave Ray, stop the joined node (a second SIGTERM waits; Ctrl-C still
    skips to stopping the node)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if group is not None:
            group.stop()
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    finally:
        if node is not None:
            node.stop()


class ManagerWatch:
    """The block manager as ``watch`` sees it: one line when it stops answering (the ranks keep
    trying to register), one when it answers again; then, where it shows its stats, the check of
    the start (a manager restarted with another --block-size ends the command with that line)."""

    def __init__(self, args: argparse.Namespace, credentials=None) -> None:
        self.args, self.credentials, self.answering = args, credentials, True

    def __call__(self) -> None:
        try:
            check_manager(self.args.manager, timeout=WATCH_INTERVAL_S, credentials=self.credentials)
        except cli.Failure as err:
            if self.answering:
                log.warning("%s; the ranks register again once it answers", err)
            self.answering = False
            return
        if not self.answering:
            log.warning("the block manager at %s answers again", self.args.manager)
            self.answering = True
            check_manager_agrees(self.args, credentials=self.credentials)


def watch(addresses: list[str], credentials=None, manager: Optional[Callable[[], None]] = None) -> None:
    """Return never: check every rank's gRPC health every few seconds; fail when one stops answering.
    Over TLS when the ranks serve it (verified with --tls-ca, else with their own certificate).
    ``manager``, called as often, watches the block manager (``ManagerWatch``)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpager import auth

    tls = credentials.tls if credentials is not None else auth.TLS()
    channels = [auth.raw_channel(a, tls.ca or tls.cert, tls.cert, tls.key) if tls.serves else grpc.insecure_channel(a)
                for a in addresses]
    stubs = [health_pb2_grpc.HealthStub(c) for c in channels]
    failures = [0] * len(addresses)
    try:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if manager is not None:
                manager()
            for rank, stub in enumerate(stubs):
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=WATCH_INTERVAL_S)
                    failures[rank] = 0
                except grpc.RpcError as err:
                    failures[rank] += 1
                    if failures[rank] >= WATCH_FAILURES:
                        raise cli.Failure(f"rank {rank} at {addresses[rank]} stopped answering "
                                          f"({err.code().name}); stopping the group") from None
    finally:
        for channel in channels:
            channel.close()
