"""What a cache worker is told at creation (``CacheWorker(config)``): one frozen record, shipped
to the Ray actor as it is (``worker.ray_group`` gives each rank a copy with its rank, the group's
size and rendezvous, and its metrics port)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvpager import auth

from .model import ModelConfig


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None  # explicit cache size; else cache_sizing.default_device_blocks()
    memory_fraction: float = 0.5
    num_cpu_blocks: Optional[int] = 256   # swap space; None: cache_sizing.default_swap_blocks()
    rank: int = 0
    tensor_parallel_size: int = 1
    manager_address: Optional[str] = None  # register with this block manager; None: standalone
    dist_init_method: Optional[str] = None  # torch.distributed rendezvous (tcp://127.0.0.1:PORT) when TP > 1
    host: str = "127.0.0.1"               # bind address of the worker's gRPC (and metrics) server
    advertise_host: Optional[str] = None  # the host the manager and Prometheus reach it at; default: host
    metrics_port: Optional[int] = None    # serve Prometheus /metrics here (0: a free port); None: off
    device: Optional[str] = None          # default: the CUDA device Ray assigned, else the CPU
    # TLS and tokens (kvpager.auth.WorkerCredentials); None: plaintext, no token check (loopback, tests).
    credentials: Optional[auth.WorkerCredentials] = None
    # Decode steps of up to this many sequences replay CUDA graphs (worker.decode_graphs); 0: eager.
    cuda_graph_max_batch: int = 512
