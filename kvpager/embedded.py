"""The whole system in this process: a block manager on a loopback port and its cache workers
(a tensor-parallel group of Ray actors on a private local Ray cluster, or one worker in this
process). What `kvpager demo` and `kvpager generate` serve on when no deployment is named.

The manager's pools are sized by the workers when they register (``num_gpu_blocks=0``), so the
model decides the block count: its layers, KV heads, head dim and cache dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

import torch

from kvpager import client as C
from kvpager.manager import ManagerConfig
from kvpager.manager.service import BlockManagerService, create_server
from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
from kvpager.worker.model import ModelConfig


@dataclasses.dataclass
class EmbeddedSystem:
    client: C.BlockManagerClient
    runner: Callable            # StepInput -> logits (a RayWorkerGroup or CacheWorker.execute_model)
    service: BlockManagerService
    kind: str                   # the workers, in words
    tensor_parallel_size: int
    manager_metrics: str = ""   # host:port of the manager's /metrics ("" when off)
    worker_metrics: list[str] = dataclasses.field(default_factory=list)  # each rank's /metrics host:port

    def check_invariants(self) -> None:
        with self.service.lock:
            self.service.manager.check_invariants()


def default_tensor_parallel_size() -> int:
    """Two ranks: two GPUs when there are, else two CPU ranks (one GPU: one rank)."""
    gpus = torch.cuda.device_count()
    return min(2, gpus) if gpus else 2


@contextlib.contextmanager
def embedded(model: ModelConfig, *, block_size: int = 16, tensor_parallel_size: Optional[int] = None,
             use_ray: bool = True, num_gpu_blocks: Optional[int] = None, num_cpu_blocks: int = 256,
             memory_fraction: float = 0.5, metrics_port: Optional[int] = None, watermark: float = 0.01,
             device: Optional[str] = None, cuda_graph_max_batch: int = 512) -> Iterator[EmbeddedSystem]:
    """Start a manager and workers serving ``model``; stop them on exit.

    ``num_gpu_blocks`` None sizes each rank's cache from ``memory_fraction`` of its free device
    memory (after the weights); ``metrics_port`` (0: a free one) serves the manager's and every
    rank's /metrics on 127.0.0.1. ``use_ray=False`` runs one worker in this process (TP 1).
    ``cuda_graph_max_batch``: decode steps of up to this many sequences replay CUDA graphs on a
    single-rank CUDA worker (0: every step eager)."""
    config = ManagerConfig(block_size=block_size, num_gpu_blocks=0, num_cpu_blocks=0, watermark=watermark)
    server, port, service, _ = create_server(config, "127.0.0.1:0")
    server.start()
    client = C.BlockManagerClient(f"127.0.0.1:{port}")
    stop_workers: Optional[Callable[[], None]] = None
    try:
        manager_metrics = ""
        if metrics_port is not None:
            manager_metrics = service.serve_metrics("127.0.0.1", metrics_port).address  # loopback only
        worker_config = WorkerConfig(model=model, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                     num_cpu_blocks=num_cpu_blocks, memory_fraction=memory_fraction,
                                     manager_address=client.target,
                                     metrics_port=None if metrics_port is None else 0,
                                     device=device, cuda_graph_max_batch=cuda_graph_max_batch)
        if not use_ray:
            if tensor_parallel_size not in (None, 1):
                raise ValueError("one in-process worker serves tensor parallel size 1 only (use Ray for more)")
            worker = CacheWorker(worker_config)
            stop_workers = worker.stop
            worker.start()
            yield EmbeddedSystem(client, worker.execute_model, service, "1 in-process worker", 1, manager_metrics,
                                 [worker.metrics_address] if worker.metrics_address else [])
            return
        from kvpager.worker.ray_group import RayWorkerGroup, init_local_ray

        tp = tensor_parallel_size or default_tensor_parallel_size()
        gpus = torch.cuda.device_count() if device != "cpu" else 0
        use_gpu = gpus >= tp
        init_local_ray(num_cpus=max(4, tp + 2), num_gpus=gpus)
        group = RayWorkerGroup(worker_config, tensor_parallel_size=tp, use_gpu=use_gpu)
        stop_workers = group.stop
        kind = f"{tp} Ray {'GPU' if use_gpu else 'CPU'} worker(s), tensor parallel {tp}"
        yield EmbeddedSystem(client, group, service, kind, tp, manager_metrics,
                             [a for a in group.metrics_addresses if a])
    finally:
        if stop_workers is not None:
            stop_workers()
        client.close()
        server.stop(None)
        service.close()
