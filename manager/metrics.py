"""The manager's Prometheus metrics (docs/metrics.md lists every one).

Pool, sequence, worker and operation figures are read from the manager itself at scrape time,
under the service lock (``ManagerStateCollector``), so a scrape agrees with ``GetStats`` and
nothing on the hot path updates a metric object per block. What only exists as it happens is
recorded then: RPC latency and status (``RpcMetricsInterceptor``), the time to send a plan to
the workers, and the bytes swaps moved (blocks times each worker rank's block size).
"""

from __future__ import annotations

import time
from typing import Callable, ContextManager, Iterator, Optional, Protocol

import grpc
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvpager import package_version
from kvpager.v1 import block_manager_pb2
from .block_manager import BlockManager
from .config import ManagerConfig
from .plan import ExecutionPlan
from .wal import StateDir
from .workers import WorkerRegistry

TIERS = ("gpu", "cpu")
OPERATIONS = ("allocate", "append", "fork", "free", "swap_out", "swap_in", "copy_on_write")
# RPCs take ~50 µs (Ping) to seconds (a Step waiting on a slow worker).
RPC_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Served(Protocol):
    """What the metrics read of the service that owns them (``BlockManagerService``), so that
    this module needs nothing of the service's."""

    config: ManagerConfig
    manager: Optional[BlockManager]
    registry: WorkerRegistry

    @property
    def state_lock(self) -> ContextManager[bool]: ...


class ManagerMetrics:
    """One registry per service (never prometheus-client's global one), so several managers
    can live in one process without their series mixing."""

    def __init__(self, service: Served) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        config = service.config
        Info("kvpager_manager", "The manager's version and settings.", registry=self.registry).info(
            {"version": package_version(), "block_size": str(config.block_size),
             "prefix_caching": str(config.enable_prefix_caching).lower()})
        self.rpc_duration = Histogram("kvpager_rpc_duration_seconds", "Time to answer an RPC, by method.",
                                      ["method"], buckets=RPC_BUCKETS, registry=self.registry)
        self.rpc_requests = Counter("kvpager_rpc_requests", "RPCs answered, by method and gRPC status.",
                                    ["method", "code"], registry=self.registry)
        self.plan_dispatch = Histogram("kvpager_plan_dispatch_duration_seconds",
                                       "Time to send one step's plan to every worker rank and get their acknowledgements.",
                                       buckets=RPC_BUCKETS, registry=self.registry)
        self.swapped_bytes = Counter("kvpager_swapped_bytes", "Bytes moved by swaps, summed over worker ranks.",
                                     ["direction"], registry=self.registry)
        for direction in ("out", "in"):
            self.swapped_bytes.labels(direction)
        # The write-ahead log of --state-dir (manager/wal.py); zero without one.
        self.wal_appends = Histogram("kvpager_wal_append_duration_seconds",
                                     "Time to write one log record and fsync it as --fsync says (the time every "
                                     "mutating answer waits for).", buckets=RPC_BUCKETS, registry=self.registry)
        self.wal_bytes = Counter("kvpager_wal_bytes", "Bytes appended to the write-ahead log.", registry=self.registry)
        self.wal_snapshots = Histogram("kvpager_wal_snapshot_duration_seconds",
                                       "Time to write one snapshot (the log is truncated after it).",
                                       buckets=RPC_BUCKETS, registry=self.registry)
        self.registry.register(ManagerStateCollector(service))

    def watch_state_dir(self, state_dir: StateDir) -> None:
        """Observe the log's appends and snapshots (a ``wal.StateDir``)."""
        def appended(nbytes: int, seconds: float) -> None:
            self.wal_appends.observe(seconds)
            self.wal_bytes.inc(nbytes)

        state_dir.on_append = appended
        state_dir.on_snapshot = lambda nbytes, seconds: self.wal_snapshots.observe(seconds)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_duration.labels(method).observe(seconds)
        self.rpc_requests.labels(method, code).inc()

    def observe_dispatch(self, plan: ExecutionPlan, seconds: float, bytes_per_block: int) -> None:
        """A plan the workers acknowledged: its time and the bytes its swaps moved."""
        self.plan_dispatch.observe(seconds)
        self.swapped_bytes.labels("out").inc(len(plan.blocks_to_swap_out.src) * bytes_per_block)
        self.swapped_bytes.labels("in").inc(len(plan.blocks_to_swap_in.src) * bytes_per_block)


class ManagerStateCollector(Collector):
    """Reads pools, sequences, counters and workers when Prometheus scrapes. O(ranks + kinds)."""

    def __init__(self, service: Served) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service = self.service
        with service.state_lock:  # released while a dispatch waits on the workers: a scrape never waits behind one
            manager = service.manager
            stats = manager.stats() if manager is not None else None
            applied = dict(manager.op_counts.applied) if manager is not None else {}
            failed = dict(manager.op_counts.failed) if manager is not None else {}
        registry = service.registry
        workers = registry.workers()

        capacity = GaugeMetricFamily("kvpager_kv_cache_capacity_blocks", "Blocks in the pool.", labels=["tier"])
        blocks = GaugeMetricFamily("kvpager_kv_cache_blocks", "Blocks by state (the states partition the pool).",
                                   labels=["tier", "state"])
        usage = GaugeMetricFamily("kvpager_kv_cache_usage_ratio", "Used blocks / capacity.", labels=["tier"])
        for tier in TIERS:
            t = getattr(stats, tier) if stats is not None else None
            total = t.total_blocks if t else 0
            capacity.add_metric([tier], total)
            for state in ("used", "free", "cached"):
                blocks.add_metric([tier, state], getattr(t, f"{state}_blocks") if t else 0)
            usage.add_metric([tier], t.used_blocks / total if t and total else 0.0)
        yield from (capacity, blocks, usage)

        yield GaugeMetricFamily("kvpager_kv_cache_fragmentation_ratio",
                                "Unfilled token slots / slots of used GPU blocks.",
                                value=stats.internal_fragmentation if stats else 0.0)
        yield GaugeMetricFamily("kvpager_kv_cache_watermark_blocks", "GPU blocks kept free at admission and swap-in.",
                                value=stats.watermark_blocks if stats else 0)
        sequences = GaugeMetricFamily("kvpager_sequences", "Live sequences by state.", labels=["state"])
        sequences.add_metric(["running"], stats.running_sequences if stats else 0)
        sequences.add_metric(["swapped"], stats.swapped_sequences if stats else 0)
        yield sequences
        yield GaugeMetricFamily("kvpager_pool_ready", "1 once the pools exist.", value=int(stats is not None))
        yield GaugeMetricFamily("kvpager_workers_expected", "Tensor-parallel size of the worker group.",
                                value=registry.tensor_parallel_size or 0)
        yield GaugeMetricFamily("kvpager_workers_registered", "Worker ranks registered now.", value=len(workers))
        yield GaugeMetricFamily("kvpager_workers_healthy", "Registered workers heard from within two heartbeat "
                                "intervals.", value=len(registry.healthy()))

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield counter("kvpager_steps", "Manager steps (a single mutating RPC is a step of one).",
                      stats.steps if stats else 0)
        operations = CounterMetricFamily("kvpager_operations", "Operations applied, by kind.", labels=["op"])
        for op in OPERATIONS:
            value = stats.cow_copies if op == "copy_on_write" and stats else applied.get(op, 0)
            operations.add_metric([op], value)
        yield operations
        failures = CounterMetricFamily("kvpager_operation_failures", "Operations refused or rolled back, by kind "
                                       "and gRPC status.", labels=["op", "code"])
        for (op, code), value in sorted(failed.items()):
            failures.add_metric([op, code], value)
        yield failures
        for unit in ("tokens", "blocks"):
            yield counter(f"kvpager_prefix_cache_queried_{unit}", f"Prompt {unit} looked up in the prefix cache.",
                          getattr(stats, f"prefix_query_{unit}") if stats else 0)
            yield counter(f"kvpager_prefix_cache_hit_{unit}", f"Prompt {unit} found in the prefix cache.",
                          getattr(stats, f"prefix_hit_{unit}") if stats else 0)
        yield counter("kvpager_prefix_cache_evictions", "Cached blocks evicted to make room.",
                      stats.evictions if stats else 0)
        yield counter("kvpager_preemptions", "Sequences swapped out to the CPU pool.", stats.preemptions if stats else 0)
        swapped = CounterMetricFamily("kvpager_swapped_blocks", "Blocks moved by swaps.", labels=["direction"])
        swapped.add_metric(["out"], stats.blocks_swapped_out if stats else 0)
        swapped.add_metric(["in"], stats.blocks_swapped_in if stats else 0)
        yield swapped


# The methods the RPC metrics name; any other (a caller's made-up name, which the token check
# answers like a real one) is counted as "unknown", so anonymous callers cannot add series.
_KNOWN_METHODS = frozenset(
    [f"/{service.full_name}/{method.name}" for service in block_manager_pb2.DESCRIPTOR.services_by_name.values()
     for method in service.methods] + ["/grpc.health.v1.Health/Check"])


class RpcMetricsInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """Times every unary RPC and counts it by its final status code (methods outside the
    service's as ``unknown``)."""

    def __init__(self, metrics: ManagerMetrics) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Optional[grpc.RpcMethodHandler]],
                          handler_call_details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler]:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        full = handler_call_details.method
        method = full.rsplit("/", 1)[-1] if full in _KNOWN_METHODS else "unknown"
        behavior, observe = handler.unary_unary, self.metrics.observe_rpc

        def timed(request: Message, context: grpc.ServicerContext) -> Message:
            started = time.perf_counter()
            code = "OK"
            try:
                return behavior(request, context)
            except BaseException:
                status = context.code() if hasattr(context, "code") else None
                code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
                raise
            finally:
                observe(method, code, time.perf_counter() - started)

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
