"""Start a tensor-parallel group of cache workers on this machine and keep it up (`kvpager worker`).

The workers are Ray actors (`worker.ray_group`), one per rank, all placed on this machine's Ray
node; each allocates its KV cache, serves the manager's plans over gRPC and registers with the
block manager at --manager. Ray is, in order of preference:

- with --join: a Ray node this command starts on this machine (`ray start --address
  RAY_ADDRESS --block`, as a child process it stops on exit), joining the cluster at
  --ray-address: how a container or a new machine adds its GPUs to a cluster;
- with --ray-address alone: that cluster, through the Ray node already running on this machine;
- otherwise: a Ray cluster of its own on loopback (127.0.0.2), started and stopped with the
  command, which prints its address (`Ray: started a local cluster at HOST:PORT ...`): another
  `kvpager worker --ray-address HOST:PORT --join --node-ip 127.0.0.3` on this machine can join it.

The default cache sizes agree with `kvpager manager`'s default pools: on the CPU the device cache
is host RAM and takes at most 256 MiB per rank (on CUDA: --memory-fraction of the free GPU
memory), and the swap space is 4096 blocks per rank, at most 4 GiB. A --block-size,
--tensor-parallel-size or cache smaller than the manager's pools that the manager would refuse
ends the command with one line naming both values and the flags to change (exit 1): before Ray
starts where the manager shows the worker its stats (an --insecure one does), else at registration.

The actors are named (`kvpager-worker-rank<r>` in --namespace), so a scheduler in another
process connected to the same cluster can drive the model on them
(`RayWorkerGroup.attach`, `kvpager demo --manager ... --ray-address ...`). Once every rank
registered it prints one line per rank (its addresses and cache) and `workers ready`, then
watches the ranks' gRPC health until SIGTERM or SIGINT, when it stops them (exit 0); a rank that
stops answering ends the command with exit 1, so a supervisor can restart it. It watches the
manager too: one line when it stops answering, one when it is back (the ranks register again by
themselves), and exit 1 if it came back with flags these workers do not fit.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import time
from typing import Callable, Optional

from kvpager.commands import cli, security
from kvpager.commands.ray_cluster import RayNode, connect_ray, local_ray_line, present_ray_token

log = logging.getLogger("kvpager.worker")
# The default sizes (worker/cache_worker.py imports torch: these are their values, checked by a test).
CPU_CACHE_BYTES = 256 << 20
DEFAULT_SWAP_BLOCKS = 4096
SWAP_BYTES = 4 << 30
WATCH_INTERVAL_S = 5.0      # how often the ranks' gRPC health is checked
WATCH_FAILURES = 3          # consecutive failed checks of one rank before giving up


def _mib(size: int) -> str:
    return f"{size >> 30} GiB" if size % (1 << 30) == 0 else f"{size >> 20} MiB"


def configure(parser: argparse.ArgumentParser) -> None:
    f = cli.flag
    f(parser, "--manager", env="KVPAGER_MANAGER_ADDRESS", type=cli.address, required=True,
      help="the block manager the workers register with")
    f(parser, "--ray-address", env="KVPAGER_RAY_ADDRESS", type=cli.address,
      default_help="unset: a local cluster of its own on loopback, its address printed", help="the Ray cluster (GCS address) to run on")
    f(parser, "--join", env="KVPAGER_RAY_JOIN", type=bool, default=False,
      help="first start a Ray node on this machine that joins --ray-address (stopped on exit)")
    f(parser, "--node-ip", env="KVPAGER_RAY_NODE_IP", metavar="IP", default_help="Ray's detection",
      help="the IP this machine's Ray node advertises (the private one too; Ray turns 127.0.0.1 into "
           "the machine's address, 127.0.0.2 stays on loopback)")
    f(parser, "--namespace", env="KVPAGER_RAY_NAMESPACE", default="kvpager",
      help="Ray namespace of the named worker actors")
    f(parser, "--tensor-parallel-size", env="KVPAGER_TENSOR_PARALLEL_SIZE", type=cli.positive_int, default=1,
      metavar="N", help="ranks (one worker each; one GPU each on CUDA)")
    cli.device_flag(parser, "CUDA when this Ray node has a GPU per rank, else the CPU")
    f(parser, "--model", env="KVPAGER_MODEL", metavar="DIR",
      default_help="the random-weight preset small on CUDA, tiny on the CPU",
      help="a local Hugging Face checkpoint directory (nothing is downloaded), or a random-weight preset: "
           "tiny or small (worker.model.PRESETS)")
    cli.dtype_flag(parser)
    f(parser, "--max-model-len", env="KVPAGER_MAX_MODEL_LEN", type=cli.positive_int, metavar="N",
      default_help="the checkpoint's max_position_embeddings", help="longest sequence served (prompt + new tokens)")
    cli.kv_cache_flags(parser)
    f(parser, "--cuda-graph-max-batch", env="KVPAGER_CUDA_GRAPH_MAX_BATCH", type=cli.non_negative_int, default=512,
      metavar="N", help="decode steps of up to N sequences replay CUDA graphs (a single-rank CUDA worker; "
                        "0: every step eager)")
    f(parser, "--block-size", env="KVPAGER_BLOCK_SIZE", type=cli.positive_int, default=16, metavar="N",
      help="tokens per KV block (must equal the manager's)")
    f(parser, "--num-gpu-blocks", env="KVPAGER_WORKER_NUM_GPU_BLOCKS", type=cli.positive_int, metavar="N",
      default_help=f"on CUDA, free GPU memory x --memory-fraction; on the CPU, at most {_mib(CPU_CACHE_BYTES)} per rank",
      help="device cache size per rank, in blocks (at least the manager's --num-gpu-blocks pool, unless it is 0)")
    f(parser, "--memory-fraction", env="KVPAGER_WORKER_MEMORY_FRACTION", type=cli.fraction, default=0.5, metavar="X",
      help="share of free device memory for the cache when --num-gpu-blocks is unset (on the CPU: of the "
           f"available RAM, divided among the ranks, and at most {_mib(CPU_CACHE_BYTES)} per rank)")
    f(parser, "--num-cpu-blocks", env="KVPAGER_WORKER_NUM_CPU_BLOCKS", type=cli.non_negative_int, metavar="N",
      default_help=f"{DEFAULT_SWAP_BLOCKS}, the manager's default pool; at most {_mib(SWAP_BYTES)} per rank",
      help="CPU swap space per rank, in blocks (at least the manager's --num-cpu-blocks pool, unless its "
           "--num-gpu-blocks is 0)")
    f(parser, "--host", env="KVPAGER_WORKER_HOST", default="127.0.0.1", metavar="HOST",
      help="bind address of the workers' gRPC and metrics servers (0.0.0.0 in containers)")
    f(parser, "--advertise-host", env="KVPAGER_WORKER_ADVERTISE_HOST", metavar="HOST",
      default_help="--host, or this Ray node's IP when --host is a wildcard",
      help="the host the manager and Prometheus reach the workers at")
    f(parser, "--metrics-port", env="KVPAGER_WORKER_METRICS_PORT", type=cli.port_number, metavar="PORT",
      default_help="unset: no metrics",
      help="rank r serves Prometheus /metrics on PORT + r (0: free ports); HTTPS with --tls-cert, and without it "
           "only on a loopback --host unless --insecure")
    security_flags(parser)


# The workers' credential files: (flag, environment variable, without it, help).
_CREDENTIAL_FILES = (
    ("--auth-token", "KVPAGER_AUTH_TOKEN", "none sent",
     "file holding this group's worker-role token (RegisterWorker and Heartbeat on the manager)"),
    ("--manager-token", "KVPAGER_MANAGER_TOKEN", "no token check",
     "file holding the token the manager presents (its --worker-service-token): the ranks' CacheWorker service "
     "accepts only calls that carry it"),
    ("--tls-ca", "KVPAGER_TLS_CA", "plaintext to the manager",
     "connect to the manager over TLS, verifying its certificate with this PEM CA (also used to verify the ranks' "
     "own certificates in this command's health checks)"),
)


def security_flags(parser: argparse.ArgumentParser) -> None:
    """TLS, tokens and --insecure (docs/security.md)."""
    security.insecure_flag(
        parser, "run without credentials: the ranks' CacheWorker service accepts plans from anyone who reaches it. "
                "Required unless --auth-token and one of --manager-token or --tls-client-ca are given")
    security.tls_server_flags(parser, "the ranks", "to the manager")
    security.file_flags(parser, _CREDENTIAL_FILES)


def credentials(args: argparse.Namespace):
    """The ranks' WorkerCredentials from the flags (None: --insecure without any); refuses to run
    without credentials unless --insecure."""
    from kvpager import auth

    guarded = bool(args.manager_token or args.tls_client_ca)
    if not args.insecure and not (args.auth_token and guarded):
        raise cli.Failure("no credentials: pass --auth-token FILE (the worker-role token) and --manager-token FILE "
                          "or --tls-client-ca FILE (to accept plans only from the manager), or --insecure")
    security.check_mutual_tls(args)
    if args.metrics_port is not None:  # the ranks' /metrics: HTTPS with --tls-cert, else loopback unless --insecure
        from kvpager.metrics_http import check_bind

        try:
            check_bind(args.host, bool(args.tls_cert), args.insecure, flag="--host")
        except ValueError as err:
            raise cli.Failure(str(err)) from err
    with security.reading_credentials():
        tls = auth.TLS.load(args.tls_cert, args.tls_key, args.tls_client_ca, args.tls_ca)
        creds = auth.WorkerCredentials(tls=tls, auth_token=auth.read_token(args.auth_token, "--auth-token file"),
                                       manager_token=auth.read_token(args.manager_token, "--manager-token file"))
    if creds == auth.WorkerCredentials():
        return None
    return creds


def run(args: argparse.Namespace) -> int:
    if args.join and not args.ray_address:
        raise cli.UsageError("--join needs --ray-address (the cluster to join)")
    cli.log_to_stderr()
    if args.ray_address:
        present_ray_token()
    creds = credentials(args)
    _stop_on_signals()
    check_manager(args.manager, credentials=creds)
    check_manager_agrees(args, credentials=creds)
    check_model(args)
    check_metrics_ports(args)
    node: Optional[RayNode] = None
    group = None
    try:
        if args.join:
            node = RayNode.start(args.ray_address, args.node_ip, args.device, args.tensor_parallel_size)
        node_id, gpus = connect(args)
        _stop_on_signals()  # ray.init installs its own SIGTERM handler
        group = start_group(args, node_id, gpus, creds)
        _stop_on_signals()
        try:  # from "workers ready" on, SIGTERM or SIGINT is the normal way to stop (exit 0)
            announce(group, args, creds)
            watch(group.addresses, creds, ManagerWatch(args, creds))  # returns only by raising
        except KeyboardInterrupt:
            pass
    finally:
        _stop(group, node)
    print("workers stopped", flush=True)
    return 0


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


def _stop_on_signals() -> None:
    def stop(signum, _frame):
        raise _Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _stop(group, node: Optional["RayNode"]) -> None:
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


# ---- the manager ----------------------------------------------------------------------------------
def check_manager(target: str, timeout: float = 5.0, credentials=None) -> None:
    """Fail with one clear line unless the block manager answers a health check (open to all: the
    worker-role token may not call Ping), over TLS when the credentials say so."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpager import auth

    creds = credentials or auth.WorkerCredentials()
    with creds.manager_channel(target) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as err:
            code = err.code()
            why = f"{code.name if code else 'UNKNOWN'}: {cli.why_unreachable(err.details() or '')}"
            raise cli.Failure(f"cannot reach the block manager at {target}: {why}") from err


def check_manager_agrees(args: argparse.Namespace, credentials=None, timeout: float = 5.0) -> None:
    """Fail at once, before Ray starts, where the manager would refuse these workers at
    registration (block size, group size, pools), as far as its stats tell: a manager with tokens
    keeps them from the worker role, and one whose pools wait for the workers has none yet. There
    registration decides, and ``start_group`` reports its refusal in the same words."""
    stats = manager_stats(args.manager, credentials, timeout)
    if stats is None:
        return
    if stats.block_size != args.block_size:
        raise cli.Failure(block_size_refusal(args.manager, stats.block_size, args.block_size))
    if stats.workers_expected and stats.workers_expected != args.tensor_parallel_size:
        raise cli.Failure(group_size_refusal(args.manager, stats.workers_expected, args.tensor_parallel_size))
    # GetStats counts the GPU blocks that can be handed out; the pool has one more, the null block
    # (manager/block_pool.py), and a worker must hold every block of it.
    pools = (stats.gpu.total_blocks + 1 if stats.gpu.total_blocks else 0, stats.cpu.total_blocks)
    if too_small((args.num_gpu_blocks, args.num_cpu_blocks), pools):
        raise cli.Failure(capacity_refusal(args.manager, (args.num_gpu_blocks, args.num_cpu_blocks), pools))


def manager_stats(target: str, credentials=None, timeout: float = 5.0):
    """The manager's GetStatsResponse, or None where it does not answer them to this worker."""
    import grpc

    from kvpager import auth
    from kvpager.v1 import block_manager_pb2 as pb
    from kvpager.v1 import block_manager_pb2_grpc as pb_grpc

    creds = credentials or auth.WorkerCredentials()
    with creds.manager_channel(target) as channel:
        try:
            return pb_grpc.BlockManagerStub(channel).GetStats(pb.GetStatsRequest(), timeout=timeout)
        except grpc.RpcError as err:  # no permission, no pools yet: registration will tell
            log.debug("manager stats unavailable before registration: %s", err.code())
            return None


def too_small(capacity: tuple[Optional[int], Optional[int]], pools: tuple[int, int]) -> bool:
    """Whether a known capacity (GPU, CPU blocks; None: not known yet) is below the manager's pools."""
    return any(have is not None and have < need for have, need in zip(capacity, pools))


def block_size_refusal(manager: str, manager_size: int, worker_size: int) -> str:
    return (f"block size mismatch: the block manager at {manager} uses --block-size {manager_size}, these workers "
            f"--block-size {worker_size}: start both with the same --block-size (KVPAGER_BLOCK_SIZE)")


def group_size_refusal(manager: str, group_size: int, worker_size: int) -> str:
    return (f"tensor-parallel size mismatch: the block manager at {manager} serves a group of {group_size} rank(s), "
            f"these workers --tensor-parallel-size {worker_size}: pass --tensor-parallel-size {group_size}, or "
            "restart the manager (it keeps the size of the first group that registered)")


def capacity_refusal(manager: str, capacity: tuple[Optional[int], Optional[int]], pools: tuple[int, int]) -> str:
    short = [(tier, have, need) for tier, have, need in zip(("gpu", "cpu"), capacity, pools)
             if have is not None and have < need]
    held = ", ".join(f"{have} {tier.upper()} blocks where its pool has {need}" for tier, have, need in short)
    flags = " and ".join(f"--num-{tier}-blocks {need}" for tier, _, need in short)
    return (f"cache smaller than the pools of the block manager at {manager}: each rank holds {held}; start the "
            f"workers with {flags} (or more), or the manager with --num-gpu-blocks 0 (pools sized from the workers)")


# What the manager says when it refuses a registration (manager/workers.py, manager/service.py),
# and the same line check_manager_agrees gives.
_REFUSALS = (
    (re.compile(r"block size (\d+) differs from the manager's (\d+)"),
     lambda m, manager: block_size_refusal(manager, int(m[2]), int(m[1]))),
    (re.compile(r"tensor_parallel_size (\d+) differs from the group's (\d+)"),
     lambda m, manager: group_size_refusal(manager, int(m[2]), int(m[1]))),
    (re.compile(r"capacity (\d+) GPU / (\d+) CPU blocks is below the manager's pools \((\d+) / (\d+)\)"),
     lambda m, manager: capacity_refusal(manager, (int(m[1]), int(m[2])), (int(m[3]), int(m[4])))),
)


def explain_refusal(cause: str, manager: str) -> str:
    """One line for a failed start: a registration the manager refused, in the words of
    ``check_manager_agrees``; anything else as it came."""
    for pattern, explain in _REFUSALS:
        match = pattern.search(cause)
        if match:
            return explain(match, manager)
    return f"the workers did not start: {cause}"


# ---- Ray --------------------------------------------------------------------------------------------
def connect(args: argparse.Namespace) -> tuple[Optional[str], int]:
    """Join Ray as a driver; (the node to place the ranks on or None for any, GPUs there)."""
    import ray

    if not args.ray_address:
        from kvpager.worker.ray_group import init_local_ray

        gpus = 0
        if args.device != "cpu":
            import torch

            gpus = torch.cuda.device_count()
        check_gpus(args, gpus)  # before Ray starts
        init_local_ray(num_cpus=args.tensor_parallel_size, num_gpus=gpus, namespace=args.namespace,
                       node_ip=args.node_ip)
        print(local_ray_line(ray.get_runtime_context().gcs_address), flush=True)
        return None, gpus
    connect_ray(args.ray_address, args.namespace, args.node_ip)
    node_id = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + 30
    while True:  # the node this driver attached to, alive in the cluster's view
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)
        if node is not None:
            break
        if time.monotonic() > deadline:
            raise cli.Failure(f"this machine's Ray node {node_id} is not alive in the cluster at {args.ray_address}")
        time.sleep(0.2)
    if args.node_ip and node["NodeManagerAddress"] != args.node_ip:
        raise cli.Failure(f"the local Ray node advertises {node['NodeManagerAddress']}, not --node-ip {args.node_ip}")
    print(f"Ray: on the cluster at {args.ray_address}, through this machine's node {node['NodeManagerAddress']}"
          f"{' (started here, stopped with this command)' if args.join else ''}", flush=True)
    return node_id, int(node["Resources"].get("GPU", 0))


# ---- the group --------------------------------------------------------------------------------------
def start_group(args: argparse.Namespace, node_id: Optional[str], gpus: int, credentials=None):
    """Create the named actors, start them (each registers with the manager) and return the group."""
    import ray

    from kvpager.worker.cache_worker import WorkerConfig
    from kvpager.worker.ray_group import RayWorkerGroup, actor_name

    tp = args.tensor_parallel_size
    check_gpus(args, gpus)
    use_gpu = args.device == "cuda" or (args.device == "auto" and gpus >= tp)
    try:
        ray.get_actor(actor_name(0))
    except ValueError:
        pass
    else:
        raise cli.Failure(f"a kvpager worker group already runs in Ray namespace {args.namespace!r}; "
                          "stop it or choose another --namespace")
    model = model_config(args, use_gpu)
    config = WorkerConfig(model=model, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                          memory_fraction=args.memory_fraction, num_cpu_blocks=args.num_cpu_blocks,
                          manager_address=args.manager, host=args.host, advertise_host=args.advertise_host,
                          metrics_port=args.metrics_port, device=None if use_gpu else "cpu",
                          credentials=credentials, cuda_graph_max_batch=args.cuda_graph_max_batch)
    try:
        return RayWorkerGroup(config, tensor_parallel_size=tp, use_gpu=use_gpu, named=True, node_id=node_id)
    except ray.exceptions.RayError as err:
        raise cli.Failure(explain_refusal(_cause(err), args.manager)) from err


def check_gpus(args: argparse.Namespace, gpus: int) -> None:
    """--device cuda needs a GPU per rank on the node the ranks run on."""
    if args.device == "cuda" and gpus < args.tensor_parallel_size:
        raise cli.Failure(f"--device cuda needs {args.tensor_parallel_size} GPU(s) on this Ray node, it has {gpus}")


def check_metrics_ports(args: argparse.Namespace) -> None:
    """--metrics-port PORT: rank r serves on PORT + r; one already taken fails before Ray starts."""
    if not args.metrics_port:  # off, or free ports
        return
    for rank in range(args.tensor_parallel_size):
        port = args.metrics_port + rank
        try:
            with socket.create_server((args.host, port)):
                pass
        except OSError as err:
            raise cli.Failure(f"--metrics-port {args.metrics_port}: rank {rank}'s port {port} on {args.host} is not "
                              f"free ({os.strerror(err.errno) if err.errno else err})") from err


def check_model(args: argparse.Namespace) -> None:
    """Read the model before Ray starts, with this machine's GPUs deciding CUDA or CPU (start_group
    reads it again with those of the Ray node): a model these flags cannot serve fails at once."""
    import torch

    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()
    model_config(args, use_gpu=args.device == "cuda" or (args.device == "auto" and gpus >= args.tensor_parallel_size))


def model_config(args: argparse.Namespace, use_gpu: bool):
    """The model the ranks serve: --model as a preset name or a checkpoint directory (whose
    config.json is read here), checked against --tensor-parallel-size, so a model that cannot be
    served fails before any actor starts."""
    from kvpager.worker.hf_config import UnsupportedModel
    from kvpager.worker.model import PRESETS, ModelConfig, preset

    name = args.model or ("small" if use_gpu else "tiny")
    try:
        if name in PRESETS:
            model = preset(name, args.kv_cache_dtype, args.kv_scale)
        else:
            model = ModelConfig.from_pretrained(name, dtype=cli.resolve_dtype(args.dtype, use_gpu),
                                                max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
                                                kv_scale=args.kv_scale)
        model.check_tensor_parallel(args.tensor_parallel_size)
    except (UnsupportedModel, ValueError, OSError) as err:
        raise cli.Failure(f"cannot serve --model {name}: {cli.model_error_as_flags(cli.one_line(err))}") from err
    return model


_RPC_STATUS = re.compile(r'status = StatusCode\.(\w+)\s+details = "([^"]*)"')


def _cause(err: BaseException) -> str:
    """The one-line reason inside a Ray error. A failed registration raised a grpc.RpcError in the
    actor, which Ray cannot pickle: its status and details survive only in the traceback text."""
    text = getattr(err, "traceback_str", "") or str(err)
    statuses = _RPC_STATUS.findall(text)
    if statuses:
        code, details = statuses[-1]
        return f"{code}: {details}"
    finals = [line for line in text.splitlines() if line.strip() and not line[0].isspace()
              and not line.startswith(("Traceback", "ray::", "\x1b"))]
    return finals[-1] if finals else cli.one_line(err)


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


def main(argv: list[str] | None = None) -> int:
    return cli.run_main("kvpager worker", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
