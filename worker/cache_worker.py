"""A GPU worker: owns one tensor-parallel rank's KV cache and model shard, serves the manager's
plans over gRPC, and runs the model step by step.

A plain class, made a Ray actor where it is created (``ray.remote(num_gpus=1)(CacheWorker)``
on a GPU node, CPU-only otherwise), so it is unit-tested without Ray and touches the device
only once Ray has assigned one. Its configuration is a ``WorkerConfig`` (``worker.config``).
``start()`` sizes (a size the configuration leaves unset: ``worker.cache_sizing``) and allocates
the cache, joins the tensor-parallel group, starts the gRPC server (and, with ``metrics_port``,
the Prometheus /metrics server: ``worker.metrics``) and registers with the manager; a daemon
thread then sends heartbeats (registering again if the manager forgot it:
``worker.registration``). Plans (from the gRPC thread) and model steps (from the actor's caller)
are serialized by one lock; the manager's Step answers only after every worker enqueued its
plan, and the scheduler runs the model only after Step answered, so each step's plan precedes
its K/V writes (on CUDA the plan runs on the cache's swap stream and the model's compute stream
waits for its event before the first write or attention: see ``worker.kv_cache``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import uuid
from concurrent import futures
from typing import Callable, Hashable, Optional

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpager import auth
from kvpager.kernels import cuda as cuda_kernels
from kvpager.kernels import ops
from kvpager.metrics_http import MetricsServer
from kvpager.numeric import ceil_div
from kvpager.step import FeedbackUnavailable, PlanNotApplied, StepInput
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import worker_pb2_grpc

from .addresses import advertised_host, host_port
from .applied_plans import AppliedPlans
from .block_plan import BlockPlan
from .cache_sizing import default_device_blocks, default_swap_blocks
from .config import WorkerConfig
from .kv_cache import CacheSpec, KVCache, PlanExpired
from .launched_steps import LaunchedSteps
from .memory_stats import MemoryStats, PlanCounts
from .metrics import StepTiming, WorkerInfo, WorkerMetrics
from .decode_graphs import DecodeGraphs, supported as graphs_supported
from .model import Decoder
from .registration import ManagerRegistration
from .service import CacheWorkerService

log = logging.getLogger("kvpager.worker")


class CacheWorker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.worker_id = ""        # the manager's id for this worker, set by each registration
        # This process's cache: a restarted worker sends another, and the manager marks the
        # sequences whose K/V was here lost (manager/epochs.py).
        self.cache_id = uuid.uuid4().hex
        self.address = ""          # host:port of the gRPC service, as advertised to the manager
        self.metrics_address = ""  # host:port of /metrics, as advertised; empty when metrics are off
        self.cache: Optional[KVCache] = None
        self.model: Optional[Decoder] = None
        self.graphs: Optional[DecodeGraphs] = None   # CUDA graphs for decode steps, where they apply
        self.metrics: Optional[WorkerMetrics] = None
        self._lock = threading.Lock()
        self._server: Optional[grpc.Server] = None
        self._metrics_server: Optional[MetricsServer] = None
        self._registration: Optional[ManagerRegistration] = None   # with a manager_address, once started
        self._plan_counts = PlanCounts()
        self._applied_plans = AppliedPlans()       # for the PlanNotApplied check of each step
        # The last greedy step's token ids, on the device, for a step that takes its tokens from
        # them (StepInput.feedback_rows); its step id (0: none).
        self._last_ids: Optional[torch.Tensor] = None
        self._last_ids_step = 0
        self._launched = LaunchedSteps()           # steps launched, their outputs not fetched yet
        self._tickets = itertools.count(1)         # execute_model's own tickets

    # ---- life cycle ------------------------------------------------------------------------------------
    def start(self) -> str:
        """Allocate the cache, load the model shard, serve, register. Returns the gRPC host:port
        (``endpoints()`` has the metrics address too)."""
        cfg = self.config
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cfg.model.check_tensor_parallel(cfg.tensor_parallel_size)
        if cfg.tensor_parallel_size > 1:
            import torch.distributed as dist

            if device.type == "cpu":
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep traffic on loopback
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=cfg.dist_init_method,
                                    rank=cfg.rank, world_size=cfg.tensor_parallel_size)
        self.model = Decoder(cfg.model, cfg.rank, cfg.tensor_parallel_size, device)
        if device.type == "cuda" and cfg.model.head_dim not in cuda_kernels.HEAD_DIMS:
            log.warning("rank %d: our CUDA decode kernel serves head dims %s, not %d: decode attention runs on the "
                        "torch reference (slow)", cfg.rank, cuda_kernels.HEAD_DIMS, cfg.model.head_dim)
        spec = CacheSpec(cfg.model.num_layers, self.model.kv_heads, cfg.model.head_dim, cfg.block_size,
                         cfg.model.cache_dtype)
        # Ranks on the CPU share one host's memory (each rank of a GPU group has its own device).
        sharing = cfg.tensor_parallel_size if device.type == "cpu" else 1
        num_blocks = cfg.num_gpu_blocks or default_device_blocks(device, spec.block_bytes, cfg.memory_fraction,
                                                                 sharing)
        if num_blocks < 1:
            raise RuntimeError(f"no room for a single {spec.block_bytes}-byte KV block on {device}")
        num_swap_blocks = default_swap_blocks(spec.block_bytes) if cfg.num_cpu_blocks is None else cfg.num_cpu_blocks
        self.cache = KVCache(spec, num_blocks, num_swap_blocks, device)
        self.graphs = self._decode_graphs()
        self._serve()
        if cfg.metrics_port is not None:
            self._serve_metrics()
        if cfg.manager_address:
            self._registration = ManagerRegistration(cfg.manager_address, cfg.credentials, self._registration_request,
                                                     self._registered)
            self._registration.start()
        log.info("worker rank %d on %s: %d cache + %d swap blocks of %d bytes, serving %s, metrics %s", cfg.rank,
                 device, num_blocks, num_swap_blocks, spec.block_bytes, self.address, self.metrics_address or "off")
        return self.address

    def _decode_graphs(self) -> Optional[DecodeGraphs]:
        cfg = self.config
        if cfg.cuda_graph_max_batch <= 0:
            return None
        reason = graphs_supported(self.model, self.cache)
        if reason is not None:
            if self.cache.device.type == "cuda":
                log.info("rank %d: decode steps run eagerly: %s", cfg.rank, reason)
            return None
        max_blocks = ceil_div(cfg.model.context_len, cfg.block_size)
        graphs = DecodeGraphs(self.model, self.cache, cfg.cuda_graph_max_batch, max_blocks)
        captured = graphs.capture_all()   # before serving: no step waits for a capture
        if captured:
            log.info("rank %d: captured %d decode CUDA graphs (batches up to %d) in %.1f s", cfg.rank, captured,
                     graphs.max_batch, graphs.capture_seconds)
        return graphs

    def endpoints(self) -> dict[str, str]:
        """The advertised addresses: ``grpc`` and ``metrics`` (empty when metrics are off)."""
        return dict(grpc=self.address, metrics=self.metrics_address)

    def worker_config(self) -> WorkerConfig:
        """This rank's configuration: a process attaching to a running group learns the group's
        size from it and builds the same model (``.model``) for its reference check. Without
        its credentials: they stay in this actor."""
        return dataclasses.replace(self.config, credentials=None)

    def stop(self) -> None:
        if self._registration is not None:
            self._registration.stop()
        if self._server is not None:
            self._server.stop(None)
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if self.config.tensor_parallel_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def _serve(self) -> None:
        creds = self.config.credentials or auth.WorkerCredentials()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvpager-worker"),
                             interceptors=creds.interceptors())
        worker_pb2_grpc.add_CacheWorkerServicer_to_server(CacheWorkerService(self), server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        port = auth.add_port(server, host_port(self.config.host, 0), creds.tls)
        server.start()
        self._server = server
        self.address = host_port(advertised_host(self.config.host, self.config.advertise_host), port)

    def _serve_metrics(self) -> None:
        cfg = self.config
        self.metrics = WorkerMetrics(self.cache, self._info())
        tls = (cfg.credentials or auth.WorkerCredentials()).tls   # /metrics over HTTPS with the gRPC certificate
        self._metrics_server = MetricsServer(self.metrics.registry, host=cfg.host, port=cfg.metrics_port,
                                             tls=tls if tls.serves else None)
        self.metrics_address = host_port(advertised_host(cfg.host, cfg.advertise_host), self._metrics_server.port)

    def _info(self) -> WorkerInfo:
        # The tensor's device names the index ("cuda:0") where the configured one may not ("cuda").
        cache, cfg = self.cache, self.config
        return WorkerInfo(rank=cfg.rank, tensor_parallel_size=cfg.tensor_parallel_size,
                          device=str(cache.blocks.device), attention_backend=self._attention_backend(),
                          kv_cache_dtype=str(cache.spec.dtype).removeprefix("torch."))

    def _attention_backend(self) -> str:
        return ops.backend(self.cache.blocks[:, 0, 0])  # layer 0's K view, without KVCache.layer's stream wait

    def _registration_request(self) -> pb.RegisterWorkerRequest:
        cfg = self.config
        return pb.RegisterWorkerRequest(
            address=self.address, rank=cfg.rank, tensor_parallel_size=cfg.tensor_parallel_size,
            num_gpu_blocks=self.cache.num_blocks, num_cpu_blocks=self.cache.num_swap_blocks,
            block_size=cfg.block_size, metrics_address=self.metrics_address,
            block_bytes=self.cache.spec.block_bytes, cache_id=self.cache_id)

    def _registered(self, worker_id: str) -> None:
        """Called by each registration (the heartbeat thread's too) with the manager's id."""
        self.worker_id = worker_id

    # ---- work ----------------------------------------------------------------------------------------
    def execute_plan(self, step_id: int, plan: BlockPlan, still_wanted: Optional[Callable[[], bool]] = None) -> None:
        """Enqueue step ``step_id``'s swaps and copies. A bad plan raises PlanRejected, nothing
        applied (``KVCache.execute``). ``still_wanted`` (the gRPC call's ``is_active``) is
        asked under the lock, right before anything moves: a plan whose sender stopped waiting
        (its deadline passed while this worker was stopped or busy, so the manager rolled the
        step back and may have given its blocks out again) raises PlanExpired, nothing applied."""
        metrics = self.metrics
        with self._lock:
            if still_wanted is not None and not still_wanted():
                raise PlanExpired(f"step {step_id}: the manager stopped waiting for this plan (its deadline passed); "
                                  "not applied")
            # Acknowledged means ENQUEUED (on the cache's swap stream), not done: the compute
            # stream waits for the plan's event at the model's first cache access (KVCache.layer),
            # and the next plan's swap stream waits for the compute stream, so every ordering
            # the plan needs holds on the device without a host sync here. Metrics time the
            # parts with events on that stream, read later (worker.metrics), for the same reason.
            if metrics is None:
                self.cache.execute(plan)
            else:
                metrics.poll()
                self.cache.execute(plan, time_part=metrics.time_plan_part)
                metrics.observe_plan(plan)
            counts = self._plan_counts
            counts.plans_executed += 1
            counts.blocks_swapped_out += len(plan.swap_out)
            counts.blocks_swapped_in += len(plan.swap_in)
            counts.blocks_copied += len(plan.copy)
            counts.last_step_id = step_id
            self._applied_plans.add(step_id)

    def execute_model(self, step: StepInput) -> Optional[torch.Tensor]:
        """Run one step (``kvpager.step``); rank 0 returns, on the CPU, for each sequence that
        computed tokens, its last token's float32 logits ``[S, vocab]`` or, for a greedy step,
        their argmax ``[S]`` (int64). Raises ValueError for an inconsistent input (one naming
        a block or slot outside the cache included) and PlanNotApplied when the plan the step
        needs has not been applied here; in both cases nothing ran. ``launch_model`` and
        ``fetch_output`` are its two halves."""
        ticket = ("execute", next(self._tickets))
        self.launch_model(step, ticket)
        return self.fetch_output(ticket)

    def launch_model(self, step: StepInput, ticket: Hashable) -> None:
        """Enqueue one step and the copy of its output to the host, and return without waiting
        for the device (``worker.launched_steps``); ``fetch_output(ticket)`` gives what
        ``execute_model`` returns. A step launched while another runs on the GPU queues behind
        it. Refuses as ``execute_model`` does, with nothing run and nothing kept."""
        called = time.perf_counter()
        step.check()
        self.cache.check_step(step)
        metrics = self.metrics
        with self._lock:
            if ticket in self._launched:   # before anything runs: a refusal writes no K/V
                raise ValueError(f"step ticket {ticket!r} was launched twice")
            self._require_plan(step)
            previous = self._fed_tokens(step)
            if metrics is None:
                logits, ids = self._forward(step, previous_ids=previous)
            else:
                metrics.poll()
                attention = metrics.attention_span()
                start = metrics.timeline.begin()
                logits, ids = self._forward(step, attention, previous)
            out = self._output(step, logits, ids) if self.config.rank == 0 else None
            self._launched.add(ticket, out, self.cache.device)
            if metrics is not None:
                metrics.observe_model_step(step.step_id, len(step.token_ids), start, attention,
                                           time.perf_counter() - called)

    def fetch_output(self, ticket: Hashable) -> Optional[torch.Tensor]:
        """The output of the step launched under ``ticket`` (None on ranks > 0), once it is on the
        host; waits for the device, never for the worker's lock. StepNotLaunched when there is
        none (its launch failed)."""
        return self._launched.take(ticket)

    def step_timings(self) -> list[StepTiming]:
        """The recent model steps' device time and the idle gap before each (needs metrics on;
        empty otherwise): what the serving benchmark reads for its roofline and idle figures."""
        if self.metrics is None:
            return []
        self.metrics.poll()
        return list(self.metrics.timeline.recent)

    def _forward(self, step: StepInput, attention_timer=None,
                 previous_ids: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Under the lock: the model on the step, from a CUDA graph when one serves it (then the
        attention is not timed per layer: the graph runs as one launch); its logits, and their
        argmax where the graph computed it (None: eager)."""
        if self.graphs is not None and self.graphs.serves(step):
            return self.graphs.run(step, previous_ids), self.graphs.last_ids(step.num_seqs)
        return self.model.forward_paged(step, self.cache.layer, attention_timer=attention_timer,
                                        previous_ids=previous_ids), None

    def _output(self, step: StepInput, logits: torch.Tensor, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Under the lock, on rank 0: what goes back (still on the device; the caller copies it
        to the host): the logits, or their argmax for a greedy step (``ids`` when a graph
        computed it), kept for a next step that takes its tokens from them
        (``StepInput.feedback_rows``). A graph's logits and ids are its static outputs: the copy
        to the host is enqueued before any later step can overwrite them."""
        if not step.greedy:
            self._last_ids, self._last_ids_step = None, 0
            return logits
        if ids is None:
            ids = logits.argmax(dim=-1)
        self._last_ids, self._last_ids_step = ids, step.step_id
        return ids

    def _fed_tokens(self, step: StepInput) -> Optional[torch.Tensor]:
        """Under the lock: the previous greedy step's ids a step takes tokens from (None if it
        takes none); FeedbackUnavailable when this worker does not hold them."""
        if step.feedback_rows is None:
            return None
        if self.config.tensor_parallel_size > 1 or self._last_ids_step != step.feedback_step:
            raise FeedbackUnavailable(
                f"rank {self.config.rank}: step {step.step_id} takes tokens from step {step.feedback_step}'s output, "
                f"but this worker holds {self._last_ids_step or 'none'} (single-rank groups only); nothing was run")
        last_row = max(step.feedback_rows)
        if last_row >= len(self._last_ids):
            raise ValueError(f"step {step.step_id} takes tokens from row {last_row} of step {step.feedback_step}'s "
                             f"output, which has {len(self._last_ids)} rows; nothing was run")
        return self._last_ids

    def _require_plan(self, step: StepInput) -> None:
        """Under the lock: refuse a step whose plan has not been applied (delayed, dropped or
        reordered on the way), before any K/V is written."""
        if step.plan_step_id and step.plan_step_id not in self._applied_plans:
            last = self._applied_plans.last
            last = "none" if last is None else last
            raise PlanNotApplied(
                f"rank {self.config.rank}: step {step.step_id} needs the swap/copy plan of step "
                f"{step.plan_step_id}, which this worker has not applied (last applied plan: step {last}); "
                "nothing was run")

    def memory_stats(self) -> MemoryStats:
        """The cache's size and the plans applied so far (``worker.memory_stats``)."""
        cache = self.cache
        # Read without the lock, so the stats answer while a model step holds it: a plan applied
        # meanwhile may show in some counts and not yet in others.
        counts = dataclasses.asdict(self._plan_counts)
        return MemoryStats(
            worker_id=self.worker_id, device=str(cache.device), num_gpu_blocks=cache.num_blocks,
            num_cpu_blocks=cache.num_swap_blocks, block_bytes=cache.spec.block_bytes,
            gpu_cache_bytes=cache.blocks.nbytes, cpu_cache_bytes=cache.swap_space.nbytes,
            attention_backend=self._attention_backend(), **counts)
