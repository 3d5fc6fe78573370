"""A tensor-parallel group of ``CacheWorker`` Ray actors, one per rank.

Each worker becomes an actor where it is created: ``num_gpus=1`` when the Ray cluster has a
GPU per rank, one CPU otherwise. Calls fan out once (``ray.get([...])``), never in a loop.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Optional

import torch

from .cache_worker import CacheWorker, WorkerConfig
from .model import ModelInput


class WorkerDied(RuntimeError):
    """A rank of the group died during a call; the group is unusable (its tensor-parallel
    process group cannot take a new member) and must be replaced."""


def init_local_ray(num_cpus: int = 4, num_gpus: Optional[int] = None) -> None:
    """Start a local Ray cluster bound to loopback (no traffic leaves the machine)."""
    import ray

    if not ray.is_initialized():
        # address="local": a private cluster, never one that `ray start` left on this machine.
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_metrics_port(base: Optional[int], rank: int) -> Optional[int]:
    """Rank r serves metrics on base + r; 0 (a free port for each) and None (off) stay as they are."""
    return base + rank if base else base


class RayWorkerGroup:
    def __init__(self, config: WorkerConfig, tensor_parallel_size: int = 1, use_gpu: Optional[bool] = None) -> None:
        import ray

        self._ray = ray
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) >= tensor_parallel_size
        self.use_gpu = use_gpu
        resources = {"num_gpus": 1} if use_gpu else {"num_cpus": 1}
        if not use_gpu:  # a CPU actor on a GPU host still sees the GPUs: keep it off them
            config = dataclasses.replace(config, device=config.device or "cpu")
        actor = ray.remote(**resources)(CacheWorker)
        rendezvous = f"tcp://127.0.0.1:{_free_port()}" if tensor_parallel_size > 1 else None
        self.configs = [
            dataclasses.replace(config, rank=rank, tensor_parallel_size=tensor_parallel_size,
                                dist_init_method=rendezvous, metrics_port=_rank_metrics_port(config.metrics_port, rank))
            for rank in range(tensor_parallel_size)
        ]
        self.actors = [actor.remote(c) for c in self.configs]
        self.addresses: list[str] = ray.get([a.start.remote() for a in self.actors])
        # Each rank's /metrics host:port ("" where metrics are off).
        self.metrics_addresses: list[str] = [e["metrics"] for e in ray.get([a.endpoints.remote() for a in self.actors])]

    def __call__(self, inp: ModelInput) -> torch.Tensor:
        """Run one model step on every rank; rank 0's logits. Raises WorkerDied as soon as any
        rank's call fails (the others may be blocked in a collective waiting for it)."""
        refs = [a.execute_model.remote(inp) for a in self.actors]
        pending = list(refs)
        while pending:
            ready, pending = self._ray.wait(pending, num_returns=1)
            try:
                self._ray.get(ready)
            except self._ray.exceptions.RayActorError as exc:
                raise WorkerDied(f"rank {refs.index(ready[0])} died during a model step: {exc}") from exc
        return self._ray.get(refs[0])

    def memory_stats(self) -> list:
        return self._ray.get([a.memory_stats.remote() for a in self.actors])

    def kill(self, rank: int, wait_s: float = 30.0) -> None:
        """Kill one rank's actor outright (for failure tests); returns once it is gone."""
        self._ray.kill(self.actors[rank], no_restart=True)
        host, port = self.addresses[rank].rsplit(":", 1)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:  # Ray reports the actor dead before its process is gone
            with socket.socket() as sock:
                if sock.connect_ex((host, int(port))) != 0:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"rank {rank} still listens on {self.addresses[rank]} {wait_s}s after being killed")

    def abort(self) -> None:
        """Kill every rank at once, without a graceful stop (a group that lost a rank: its
        other ranks may be blocked in a collective and would not answer stop)."""
        for a in self.actors:
            self._ray.kill(a, no_restart=True)

    def stop(self) -> None:
        try:
            self._ray.get([a.stop.remote() for a in self.actors], timeout=30)
        except Exception:  # an actor already dead has nothing left to stop
            pass
        for a in self.actors:
            self._ray.kill(a, no_restart=True)
