"""A tensor-parallel group of ``CacheWorker`` Ray actors, one per rank.

Each worker becomes an actor where it is created: ``num_gpus=1`` when the Ray cluster has a
GPU per rank, one CPU otherwise. Calls fan out once (``ray.get([...])``), never in a loop.

A group started with ``named=True`` (``kvpager worker`` does) names its actors
``kvpager-worker-rank<r>`` in the driver's Ray namespace, so that another process connected to
the same cluster (a scheduler, ``kvpager demo --manager ... --ray-address ...``) can drive them
with ``RayWorkerGroup.attach()``; the actors stay owned by the process that started them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import time
import uuid
from typing import Optional

import torch

from kvpager.step import StepInput, WorkerDied

from .cache_worker import CacheWorker, WorkerConfig
from .memory_stats import MemoryStats

log = logging.getLogger("kvpager.worker")



LOOPBACK_NODE_IP = "127.0.0.2"
STARTS = 3   # tries at starting a local Ray cluster that timed out starting (init_local_ray)
# Seconds Ray waits for its GCS to write its port file (Ray's default 30; an operator's
# RAY_gcs_server_port_wait_time_s is kept): CI on a loaded 2-core machine once saw three starts in a
# row time out, two of them here. With the raylet's fixed 30 s, three tries fit in five minutes.
GCS_PORT_WAIT_S = "60"
STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
# Tries at starting a tensor-parallel group whose rendezvous port was taken: the driver picks a
# free port, rank 0 listens on it seconds later (its actor starting first), and another process may
# bind it in between (seen once in CI: EADDRINUSE in rank 0's TCPStore).
RENDEZVOUS_TRIES = 3
PORT_TAKEN = ("EADDRINUSE", "address already in use")
# A model step that has not finished after this long is stuck (a stopped rank, or one waiting
# in a collective for a dead peer): far above any real step, prefill of a long prompt included.
DEFAULT_STEP_TIMEOUT_S = 300.0


def init_local_ray(num_cpus: int = 4, num_gpus: Optional[int] = None, namespace: Optional[str] = None,
                   node_ip: Optional[str] = None) -> None:
    """Start a private local Ray cluster on loopback (no traffic leaves the machine).

    The default node IP is 127.0.0.2, not 127.0.0.1: Ray replaces 127.0.0.1 (and "localhost")
    with the machine's outward address, while any other 127.x address stays on loopback.
    ``address="local"`` starts a new cluster, never one that ``ray start`` left on this machine."""
    import ray

    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_PORT_WAIT_S)
    for attempt in range(1, STARTS + 1):
        if ray.is_initialized():
            return
        try:
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                     log_to_driver=False, _node_ip_address=node_ip or LOOPBACK_NODE_IP, namespace=namespace)
        except Exception as exc:  # noqa: BLE001 - Ray raises a plain Exception (or RuntimeError) for these
            # On a loaded machine the raylet sometimes never registers within Ray's fixed 30 s
            # ("The current node timed out during startup"), or the GCS never writes its port file
            # in time ("Timed out waiting for file .../gcs_server_port_..."); both were seen twice
            # in a row on a shared 2-core machine, and a later start worked.
            if attempt == STARTS or not any(sign in str(exc) for sign in STARTUP_TIMEOUTS):
                raise
            log.warning("the local Ray cluster did not start (%s); starting it again (%d of %d)", exc, attempt + 1,
                        STARTS)
            ray.shutdown()
            time.sleep(3 * attempt)   # let the machine's load pass


def actor_name(rank: int) -> str:
    """The Ray name of a named group's rank (see ``RayWorkerGroup.attach``)."""
    return f"kvpager-worker-rank{rank}"


def _wait_names_free(ray, ranks: int, timeout_s: float = 30.0) -> None:
    """Return once no actor holds a named group's rank names (killed actors let go of them a
    little after ``ray.kill``); TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for rank in range(ranks):
        while True:
            try:
                ray.get_actor(actor_name(rank))
            except ValueError:   # no such actor: the name is free
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the Ray actor name {actor_name(rank)!r} is still taken {timeout_s:g} s after "
                                   f"its actor was killed")
            time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_metrics_port(base: Optional[int], rank: int) -> Optional[int]:
    """Rank r serves metrics on base + r; 0 (a free port for each) and None (off) stay as they are."""
    return base + rank if base else base


class SubmittedStep:
    """A step the group's ranks are launching (``RayWorkerGroup.submit``). Calling it waits for
    the step's output; ``prefetch`` asks the ranks for it early, without waiting, so that the
    fetch does not queue on the actors behind a step submitted later (the actors run their calls
    in order)."""

    __slots__ = ("_group", "_step", "_ticket", "_launches", "_deadline", "_fetches")

    def __init__(self, group: "RayWorkerGroup", step: StepInput, ticket: tuple, launches: list,
                 deadline: float) -> None:
        self._group, self._step, self._ticket = group, step, ticket
        self._launches, self._deadline = launches, deadline
        self._fetches: Optional[list] = None

    def prefetch(self) -> None:
        """Send the fetches now if every rank has launched the step (never waits); a launch
        not done yet, or refused, is left to the call."""
        if self._fetches is None:
            ray = self._group._ray
            done, _ = ray.wait(self._launches, num_returns=len(self._launches), timeout=0)
            if len(done) < len(self._launches):
                return
            try:
                ray.get(done)    # done already: this only tells whether a launch was refused
            except Exception:    # noqa: BLE001 - the call raises it
                return
            self._fetches = [a.fetch_output.remote(self._ticket) for a in self._group.actors]

    def __call__(self) -> torch.Tensor:
        group = self._group
        if self._fetches is None:
            group._wait(self._launches, self._step, self._deadline)   # a refused launch raises here
            self._fetches = [a.fetch_output.remote(self._ticket) for a in group.actors]
        else:
            group._wait(self._launches, self._step, self._deadline)
        group._wait(self._fetches, self._step, self._deadline)
        return group._ray.get(self._fetches[0])


class RayWorkerGroup:
    def __init__(self, config: WorkerConfig, tensor_parallel_size: int = 1, use_gpu: Optional[bool] = None,
                 named: bool = False, node_id: Optional[str] = None,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        """``named``: name the actors for ``attach``; ``node_id``: place every rank on that Ray node
        (the tensor-parallel rendezvous is on loopback, so the ranks must share a machine);
        ``step_timeout_s``: the longest a model step may take before the group counts as stuck."""
        import ray

        self._ray = ray
        self._owned = True
        self._caller, self._tickets = uuid.uuid4().hex, itertools.count(1)   # launch tickets: unique per group object
        self.step_timeout_s = step_timeout_s
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) >= tensor_parallel_size
        self.use_gpu = use_gpu
        resources = {"num_gpus": 1} if use_gpu else {"num_cpus": 1}
        if not use_gpu:  # a CPU actor on a GPU host still sees the GPUs: keep it off them
            config = dataclasses.replace(config, device=config.device or "cpu")
        actor = ray.remote(**resources)(CacheWorker)
        placement = {}
        if node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        for attempt in range(1, RENDEZVOUS_TRIES + 1):
            rendezvous = f"tcp://127.0.0.1:{_free_port()}" if tensor_parallel_size > 1 else None
            self.configs = [
                dataclasses.replace(config, rank=rank, tensor_parallel_size=tensor_parallel_size,
                                    dist_init_method=rendezvous,
                                    metrics_port=_rank_metrics_port(config.metrics_port, rank))
                for rank in range(tensor_parallel_size)
            ]
            self.actors = [actor.options(**placement, **({"name": actor_name(c.rank)} if named else {})).remote(c)
                           for c in self.configs]
            try:
                self.addresses: list[str] = self._started()
                break
            except Exception as exc:  # noqa: BLE001 - Ray wraps the rank's error in a RayTaskError
                for a in self.actors:   # the other ranks may wait on the rendezvous for ever
                    ray.kill(a, no_restart=True)
                if rendezvous is None or attempt == RENDEZVOUS_TRIES or not any(s in str(exc) for s in PORT_TAKEN):
                    raise
                if named:
                    _wait_names_free(ray, tensor_parallel_size)
                log.warning("rank 0 could not listen on the rendezvous %s (taken since it was chosen); starting "
                            "the group again on another port (%d of %d)", rendezvous, attempt + 1, RENDEZVOUS_TRIES)
        # Each rank's /metrics host:port ("" where metrics are off).
        self.metrics_addresses: list[str] = [e["metrics"] for e in ray.get([a.endpoints.remote() for a in self.actors])]

    def _started(self) -> list[str]:
        """Every rank started (``CacheWorker.start``), their gRPC addresses; a rank's refusal
        raised as soon as it comes, not after the others (which may wait on it in the rendezvous)."""
        refs = [a.start.remote() for a in self.actors]
        pending = list(refs)
        while pending:
            done, pending = self._ray.wait(pending, num_returns=1)
            self._ray.get(done)
        return self._ray.get(refs)

    @classmethod
    def attach(cls, namespace: Optional[str] = None, timeout_s: float = 30.0) -> "RayWorkerGroup":
        """The running named group in ``namespace`` (default: this driver's), found by its actors'
        names, waiting up to ``timeout_s`` for rank 0 to appear; its size comes from rank 0's
        config. Raises LookupError when there is none. Its ``stop()`` leaves the actors running:
        they belong to the process that started them."""
        import ray

        deadline = time.monotonic() + timeout_s

        def find(rank: int):
            while True:
                try:
                    return ray.get_actor(actor_name(rank), namespace=namespace)
                except ValueError:  # no such actor (yet)
                    if time.monotonic() >= deadline:
                        where = namespace or ray.get_runtime_context().namespace
                        raise LookupError(f"no kvpager worker group in Ray namespace {where!r} (no actor "
                                          f"{actor_name(rank)!r} after {timeout_s:g} s)") from None
                    time.sleep(0.2)

        first = find(0)
        size = ray.get(first.worker_config.remote(), timeout=timeout_s).tensor_parallel_size
        group = cls.__new__(cls)
        group._ray, group._owned, group.step_timeout_s = ray, False, DEFAULT_STEP_TIMEOUT_S
        group._caller, group._tickets = uuid.uuid4().hex, itertools.count(1)
        group.actors = [first] + [find(rank) for rank in range(1, size)]
        group.configs = ray.get([a.worker_config.remote() for a in group.actors], timeout=timeout_s)
        group.use_gpu = group.configs[0].device != "cpu"
        endpoints = ray.get([a.endpoints.remote() for a in group.actors], timeout=timeout_s)
        group.addresses = [e["grpc"] for e in endpoints]
        group.metrics_addresses = [e["metrics"] for e in endpoints]
        return group

    @property
    def feeds_back(self) -> bool:
        """Whether a step may take tokens from the previous greedy step's output on the worker
        (``StepInput.feedback_rows``): single-rank groups (one rank holds the argmax)."""
        return len(self.actors) == 1

    def __call__(self, step: StepInput) -> torch.Tensor:
        """Run one model step on every rank; rank 0's logits. Raises WorkerDied as soon as any
        rank's call fails (the others may be blocked in a collective waiting for it)."""
        return self.submit(step)()

    def submit(self, step: StepInput) -> "SubmittedStep":
        """Start one model step on every rank and return at once; calling the returned handle
        waits for the step and gives what ``__call__`` gives (raising as it does). Each actor runs
        its calls in order, so a step submitted after another computes after it: each rank
        launches the step (``CacheWorker.launch_model``: enqueued, not waited for), and the
        handle fetches its output, so a step submitted before the previous one's output is
        fetched is already queued on the GPU behind it. The step must finish within
        ``step_timeout_s`` of its submission, else WorkerDied."""
        ticket = (self._caller, next(self._tickets))
        launches = [a.launch_model.remote(step, ticket) for a in self.actors]
        return SubmittedStep(self, step, ticket, launches, time.monotonic() + self.step_timeout_s)

    def _wait(self, refs: list, step: StepInput, deadline: float) -> None:
        """Wait for one call per rank until ``deadline``; WorkerDied if a rank is stuck or died."""
        pending = list(refs)
        while pending:
            ready, pending = self._ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stuck = [refs.index(r) for r in pending]
                raise WorkerDied(f"rank(s) {stuck} did not finish model step {step.step_id} within "
                                 f"{self.step_timeout_s:g} s (stopped, or waiting in a collective for a dead "
                                 "peer): the group must be replaced")
            try:
                self._ray.get(ready)
            except self._ray.exceptions.RayActorError as exc:
                raise WorkerDied(f"rank {refs.index(ready[0])} died during a model step: {exc}") from exc

    def step_timings(self) -> list:
        """Rank 0's recent model steps as its device ran them (``CacheWorker.step_timings``)."""
        return self._ray.get(self.actors[0].step_timings.remote(), timeout=60)

    def memory_stats(self) -> list[MemoryStats]:
        """Each rank's ``CacheWorker.memory_stats``, in rank order."""
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
        """Stop and kill the ranks; an attached group only lets go of them."""
        if not self._owned:
            self.actors = []
            return
        try:
            self._ray.get([a.stop.remote() for a in self.actors], timeout=30)
        except Exception:  # an actor already dead has nothing left to stop
            pass
        for a in self.actors:
            self._ray.kill(a, no_restart=True)
