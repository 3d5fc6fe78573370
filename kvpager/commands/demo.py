"""The main job (`make demo`, `kvpager demo`): the whole system serving a few hundred requests.

By default everything runs on this machine: it starts the block manager (gRPC, on a loopback
port), a local Ray cluster with two tensor-parallel CPU workers (or one worker per GPU it
finds, up to two), and the reference scheduler. Requests arrive over time with shared system
prompts, varied lengths and parallel sampling; the pool is small enough that requests get
preempted by swap. At the end it checks every generated token against the same model with a
plain contiguous cache, checks the manager's invariants, and prints throughput and memory
figures. The manager and every worker serve Prometheus /metrics on 127.0.0.1 while it runs; at
the end it scrapes them all and checks them against the manager's own stats.

It says on stderr what it is doing as it goes (starting, serving, checking: a progress bar on a
terminal, else a line per tenth of the work or every 5 s); --quiet leaves only the report.

With --manager and --ray-address it serves the same mix on a running deployment instead: the
manager at --manager and the workers that `kvpager worker` started on that Ray cluster (found
by name in --namespace), with the model the workers run. The manager's invariants cannot be
checked from outside; it checks instead that the run left no sequence or block behind.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import sys
import tempfile
import time
import uuid
from typing import Callable, Iterator

import torch

from kvpager.commands import cli, security
from kvpager.commands.progress import Progress
from kvpager import client as C
from kvpager import errors
from kvpager.numeric import percentile
from kvpager.scheduler import Request, SamplingParams, Scheduler
from kvpager.scheduler.reference import generate_contiguous
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.worker.model import Decoder, ModelConfig


PROGRESS_EVERY_S = 5.0   # without a terminal, a progress line at least this often


def make_requests(count: int, seed: int, vocab_size: int = 256, prefix: str = "req") -> list[tuple[int, Request]]:
    """(arrival step, request): Poisson arrivals, shared system prompts, n of 1 to 3."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab_size) for _ in range(rng.randint(32, 96))] for _ in range(5)]
    out, step = [], 0
    for i in range(count):
        step += int(rng.expovariate(1 / 1.5))
        system = rng.choice(systems) if rng.random() < 0.7 else []
        prompt = system + [rng.randrange(vocab_size) for _ in range(rng.randint(4, 60))]
        params = SamplingParams(max_new_tokens=rng.randint(4, 48), n=rng.choice([1, 1, 1, 2, 3]))
        out.append((step, Request(f"{prefix}-{i:04d}", prompt, params)))
    return out


@dataclasses.dataclass
class Deployment:
    """What the demo serves on: a manager client, a model runner, and how to check the end state."""

    client: C.BlockManagerClient
    runner: Callable
    model: ModelConfig
    kind: str                          # the workers, in words
    check: Callable[[], str]           # the invariants line of the report; raises when broken
    remote: bool = False
    metrics: list[str] = dataclasses.field(default_factory=list)  # /metrics URLs: the manager's, then each rank's


# The model `make demo` serves when no --model is given: a small Llama built here with random
# weights, saved in Hugging Face format with a tokenizer, and loaded like any checkpoint. Head
# dim 64 on CUDA (our decode kernel's), 16 on the CPU (fast).
def demo_checkpoint_shape(cuda: bool) -> dict:
    head_dim = 64 if cuda else 16
    return dict(num_layers=2, hidden_size=8 * head_dim, num_heads=8, num_kv_heads=4, head_dim=head_dim,
                intermediate_size=16 * head_dim, vocab_size=384)


@contextlib.contextmanager
def demo_model(args: argparse.Namespace) -> Iterator[ModelConfig]:
    """The model to serve: the checkpoint at --model, else a small random one built in a
    temporary directory (removed at the end)."""
    cuda = torch.cuda.is_available() and args.device != "cpu"
    dtype = cli.resolve_dtype(args.dtype, cuda and bool(args.model))  # the built-in model: float32, checked
    if args.model:
        yield ModelConfig.from_pretrained(args.model, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
                                          kv_scale=args.kv_scale)
        return
    from kvpager.checkpoints import build_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="kvpager-demo-model-") as path:
        build_random_checkpoint(path, "llama", seed=7, **demo_checkpoint_shape(cuda))
        yield ModelConfig.from_pretrained(path, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
                                          kv_scale=args.kv_scale)


@contextlib.contextmanager
def embedded(args: argparse.Namespace) -> Iterator[Deployment]:
    """A manager in this process (pools sized from the workers) and workers started here."""
    from kvpager.embedded import embedded as embedded_system

    workers = "one worker in this process" if args.no_ray else "its workers on a local Ray cluster (about 20 s)"
    say(args, f"starting the block manager and {workers}")
    with demo_model(args) as model, embedded_system(
            model, block_size=args.block_size, use_ray=not args.no_ray,
            tensor_parallel_size=1 if args.no_ray else None, num_gpu_blocks=args.gpu_blocks,
            num_cpu_blocks=4 * args.gpu_blocks, metrics_port=args.metrics_port,
            device="cpu" if args.device == "cpu" else None) as system:
        urls = [f"http://{a}/metrics" for a in [system.manager_metrics, *system.worker_metrics]]
        say(args, f"metrics on {urls[0]} (workers: {', '.join(urls[1:])})")

        def check() -> str:
            system.check_invariants()
            return "OK"

        yield Deployment(system.client, system.runner, model, system.kind, check, metrics=urls)


@contextlib.contextmanager
def remote(args: argparse.Namespace) -> Iterator[Deployment]:
    """The running manager at --manager and the named workers on the Ray cluster at --ray-address."""
    import ray

    from kvpager.commands.ray_cluster import connect_ray
    from kvpager.worker.ray_group import RayWorkerGroup

    client = C.BlockManagerClient(args.manager, **security.client_security(args))
    group = None
    try:
        try:
            client.ping()
        except errors.ManagerError as err:
            raise cli.Failure(f"cannot reach the block manager at {args.manager}: {cli.one_line(err)}") from err
        connect_ray(args.ray_address, args.namespace, args.node_ip)
        try:
            group = RayWorkerGroup.attach(args.namespace, timeout_s=30)
        except LookupError as err:
            raise cli.Failure(f"{err} on the Ray cluster at {args.ray_address}; "
                              "start them with kvpager worker") from err
        block_size = _wait_for_pools(client).block_size
        if block_size != group.configs[0].block_size:
            raise cli.Failure(f"the manager's block size {block_size} differs from the workers' "
                              f"{group.configs[0].block_size}")
        tp = len(group.actors)
        kind = (f"{tp} remote Ray {'GPU' if group.use_gpu else 'CPU'} worker(s), tensor parallel {tp}, "
                f"manager {args.manager}")
        yield Deployment(client, group, group.configs[0].model, kind, lambda: "not checked (remote manager)",
                         remote=True)
    finally:
        if group is not None:
            group.stop()  # attached: lets go of the actors, which keep serving
        if ray.is_initialized():
            ray.shutdown()
        client.close()


def _wait_for_pools(client: C.BlockManagerClient, timeout: float = 30.0) -> pb.GetStatsResponse:
    """GetStats once the manager has pools (it answers UNAVAILABLE until every rank registered)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.get_stats()
        except errors.Unavailable as err:
            if time.monotonic() > deadline:
                raise cli.Failure(f"the block manager at {client.target} is not ready: {cli.one_line(err)}") from err
            time.sleep(0.5)


def say(args: argparse.Namespace, line: str) -> None:
    """A line about what the demo does now, on stderr (none with --quiet)."""
    if not args.quiet:
        print(line, file=sys.stderr, flush=True)


def live_state(stats: pb.GetStatsResponse) -> int:
    """Sequences and used blocks: what a finished run must give back."""
    return stats.running_sequences + stats.swapped_sequences + stats.gpu.used_blocks + stats.cpu.used_blocks


def serve(args: argparse.Namespace, d: Deployment) -> int:
    """Serve the request mix on ``d``, check it, print the report; 0 when everything matched."""
    client, model = d.client, d.model
    before = client.get_stats()
    block_size = before.block_size
    # A shared manager may serve other runs: ids of our own keep them apart.
    prefix = f"demo-{uuid.uuid4().hex[:8]}" if d.remote else "req"
    arrivals = make_requests(args.requests, args.seed, model.vocab_size, prefix)
    say(args, f"serving {len(arrivals)} requests on {d.kind}")
    progress = Progress(len(arrivals), quiet=args.quiet, every=PROGRESS_EVERY_S)
    utils, frags = [], []

    def on_step(s: Scheduler) -> None:
        st = client.get_stats()
        utils.append(st.gpu_utilization)
        frags.append(st.internal_fragmentation)
        progress.update(s.stats.requests_finished, f"running {len(s.running):3d}  swapped {len(s.swapped):2d}  "
                                                   f"KV util {st.gpu_utilization:4.0%}")

    scheduler = Scheduler(client, d.runner, block_size, on_step=on_step, overlap=True)
    started, iteration, pending = time.perf_counter(), 0, list(arrivals)
    while pending or scheduler.has_work:
        while pending and pending[0][0] <= iteration:
            scheduler.add(pending.pop(0)[1])
        scheduler.step()
        iteration += 1
    elapsed = time.perf_counter() - started
    progress.close()

    requests = [r for _, r in arrivals]
    check = args.check if args.check is not None else not args.model
    if check:  # the same weights in float32 on the CPU, over a contiguous cache
        reference = Decoder(dataclasses.replace(model, dtype="float32"))
        say(args, "checking every token against the same weights in float32 over a contiguous cache")
        checking = Progress(len(requests), "checked against a float32 contiguous-cache reference", quiet=args.quiet,
                            every=PROGRESS_EVERY_S)
        expected = generate_contiguous(reference, requests, on_request=checking.update)
        checking.close()
        matches = sum(scheduler.outputs[r.request_id].samples == expected[r.request_id] for r in requests)
    else:
        matches = len(requests)
    final = client.get_stats()
    invariants = d.check()
    st, lat = scheduler.stats, [t * 1e3 for t in scheduler.stats.step_latencies]

    def delta(field: str) -> int:  # a counter's growth during this run (a remote manager has a past)
        return getattr(final, field) - getattr(before, field)

    hits, queries = delta("prefix_hit_tokens"), delta("prefix_query_tokens")
    print(f"kvpager demo: {len(requests)} requests on {d.kind}, block size {block_size}, "
          f"{final.gpu.total_blocks} GPU / {final.cpu.total_blocks} CPU blocks, KV cache "
          f"{str(model.cache_dtype).removeprefix('torch.')}")
    print(f"  generated          {st.tokens_generated} tokens ({st.tokens_computed} computed) in {elapsed:.1f} s: "
          f"{st.tokens_generated / elapsed:.0f} tokens/s, {st.steps} steps")
    print(f"  KV utilization     peak {max(utils):.1%}, mean {statistics.fmean(utils):.1%}")
    print(f"  fragmentation      {statistics.fmean(frags):.1%} of allocated slots unfilled (mean over steps)")
    print(f"  prefix cache       {hits / queries if queries else 0.0:.1%} of prompt tokens hit ({hits}/{queries})")
    print(f"  swaps              {st.preemptions} preemptions, {delta('blocks_swapped_out')} blocks out, "
          f"{delta('blocks_swapped_in')} in; {st.restarts} restarts")
    print(f"  copy-on-write      {delta('cow_copies')} block copies")
    print(f"  Step latency       p50 {percentile(lat, 50):.2f} ms, p99 {percentile(lat, 99):.2f} ms; "
          f"{st.overlapped_steps} of {st.steps} Steps sent while the previous step computed")
    if check:
        print(f"  correctness        {matches}/{len(requests)} requests equal the contiguous-cache reference")
    else:
        print("  correctness        not checked (--check compares with a float32 contiguous-cache reference)")
    leftover = max(0, live_state(final) - live_state(before))  # others may hold state on a shared manager
    left = f" but {leftover} sequences/blocks left over" if leftover else (", nothing left over" if d.remote else "")
    print(f"  invariants         {invariants}{left}")
    metrics_ok = True
    if d.metrics:
        metrics_ok, line = check_metrics(d.metrics, final)
        print(f"  metrics            {line}")
    return 0 if matches == len(requests) and not leftover and metrics_ok else 1


def check_metrics(urls: list[str], stats: pb.GetStatsResponse) -> tuple[bool, str]:
    """Scrape the manager's and every rank's /metrics and check them against the manager's stats:
    what Prometheus would see of this run. Returns (all agree, a report line)."""
    from kvpager.metrics_http import scrape

    manager, *ranks = [scrape(url) for url in urls]
    want = {("kvpager_kv_cache_blocks", (("state", "used"), ("tier", "gpu"))): stats.gpu.used_blocks,
            ("kvpager_swapped_blocks_total", (("direction", "out"),)): stats.blocks_swapped_out,
            ("kvpager_swapped_blocks_total", (("direction", "in"),)): stats.blocks_swapped_in,
            ("kvpager_operations_total", (("op", "copy_on_write"),)): stats.cow_copies,
            ("kvpager_prefix_cache_hit_tokens_total", ()): stats.prefix_hit_tokens}
    wrong = [f"manager {name}{dict(labels)}" for (name, labels), value in want.items()
             if manager.get((name, labels)) != value]
    # Every rank executes every plan: each moved exactly the blocks the manager planned.
    moved = {"gpu_to_cpu": stats.blocks_swapped_out, "cpu_to_gpu": stats.blocks_swapped_in,
             "gpu_to_gpu": stats.cow_copies}
    for rank, samples in enumerate(ranks):
        wrong += [f"rank {rank} moved {direction}" for direction, blocks in moved.items()
                  if samples.get(("kvpager_worker_moved_blocks_total", (("direction", direction),))) != blocks]
    series = sum(len(m) for m in (manager, *ranks))
    if wrong:
        return False, f"{series} series scraped; DISAGREE with the manager's stats: {', '.join(wrong)}"
    return True, (f"{series} series scraped from the manager and {len(ranks)} rank(s); they agree with the "
                  f"manager's stats ({stats.blocks_swapped_out} blocks swapped out, {stats.blocks_swapped_in} in, "
                  f"{stats.cow_copies} copied by every rank)")


def configure(parser: argparse.ArgumentParser) -> None:
    f = cli.flag
    f(parser, "--requests", env="KVPAGER_DEMO_REQUESTS", type=cli.positive_int, default=240, metavar="N",
      help="requests to serve")
    f(parser, "--seed", env="KVPAGER_DEMO_SEED", type=cli.integer, default=0, metavar="N",
      help="seed of the request mix")
    f(parser, "--manager", env="KVPAGER_MANAGER_ADDRESS", type=cli.address,
      default_help="unset: a manager in this process",
      help="serve on the running block manager here (with --ray-address)")
    f(parser, "--ray-address", env="KVPAGER_RAY_ADDRESS", type=cli.address,
      help="with --manager: the Ray cluster whose workers `kvpager worker` started")
    f(parser, "--namespace", env="KVPAGER_RAY_NAMESPACE", default="kvpager",
      help="with --manager: the Ray namespace of those workers")
    f(parser, "--node-ip", env="KVPAGER_RAY_NODE_IP", metavar="IP", default_help="Ray's detection",
      help="with --manager: the IP of this machine's Ray node")
    security.client_security_flags(parser, " (with --manager)")
    f(parser, "--model", env="KVPAGER_MODEL", metavar="DIR", default_help="a small random Llama built here",
      help="a local Hugging Face checkpoint to serve (embedded)")
    cli.dtype_flag(parser, "bfloat16 for --model on CUDA, else float32 (embedded)")
    cli.device_flag(parser, "CUDA when there is a GPU (embedded)")
    f(parser, "--check", env="KVPAGER_DEMO_CHECK", type=cli.parse_bool, metavar="BOOL", default_help="on, off with --model",
      help="compare every token with a float32 contiguous-cache reference (true/false)")
    f(parser, "--block-size", env="KVPAGER_BLOCK_SIZE", type=cli.positive_int, default=16, metavar="N",
      help="tokens per KV block (embedded; a running manager has its own)")
    f(parser, "--gpu-blocks", env="KVPAGER_DEMO_GPU_BLOCKS", type=cli.positive_int, default=160, metavar="N",
      help="KV blocks per worker, small to force swaps (embedded)")
    f(parser, "--no-ray", env="KVPAGER_DEMO_NO_RAY", type=bool, default=False,
      help="one worker in this process instead of Ray actors (embedded)")
    cli.kv_cache_flags(parser, " (embedded)")
    f(parser, "--metrics-port", env="KVPAGER_DEMO_METRICS_PORT", type=cli.port_number, default=0, metavar="PORT",
      help="the embedded manager's /metrics port, on 127.0.0.1 (0: a free one; workers take free ports)")
    f(parser, "--quiet", env="KVPAGER_DEMO_QUIET", type=bool, default=False, help="no progress bar")


def check_block_size(block_size: int) -> None:
    """The embedded manager's check of --block-size, before anything starts, in the flag's words."""
    from kvpager.manager import ManagerConfig

    try:
        ManagerConfig(block_size=block_size)
    except errors.ManagerError as err:
        raise cli.UsageError(cli.fields_as_flags(str(err), ["block_size"])) from err


def run(args: argparse.Namespace) -> int:
    # A running deployment (--manager, --ray-address) or the embedded workers' own flags: where both
    # are set, the side typed wins over the side from the environment (cli.settle), else refused below.
    deployment = [dest for dest in ("manager", "ray_address") if getattr(args, dest)]
    embedded_only = [dest for dest in ("model", "no_ray") if getattr(args, dest)]
    if deployment and embedded_only:
        cli.settle(args, deployment, embedded_only)
    if args.manager and not args.ray_address:
        raise cli.UsageError("--manager needs --ray-address (where the workers run)")
    if args.ray_address and not args.manager:
        raise cli.UsageError("--ray-address needs --manager (the deployment's block manager)")
    if args.manager and args.model:
        raise cli.UsageError("--model is for the embedded workers: a running deployment serves its own")
    if args.manager and args.no_ray:
        raise cli.UsageError("--no-ray runs a worker in this process: not with --manager")
    if not args.manager:
        check_block_size(args.block_size)
    with (remote(args) if args.manager else embedded(args)) as deployment:
        return serve(args, deployment)


def main(argv: list[str] | None = None) -> int:
    return cli.run_main("kvpager demo", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
