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
import sys
from typing import Optional

from kvpager.commands import cli, security
from kvpager.commands.ray_cluster import RayNode, present_ray_token
from kvpager.commands.worker_checks import check_manager, check_manager_agrees, check_metrics_ports, check_model
from kvpager.commands.worker_group import connect, start_group
from kvpager.commands.worker_serving import ManagerWatch, announce, shut_down, stop_on_signals, watch
from kvpager.worker.cache_sizing import CPU_CACHE_BYTES, DEFAULT_SWAP_BLOCKS, SWAP_BYTES


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
    security.server_security_flags(parser, "the ranks", "to the manager", _INSECURE, _CREDENTIAL_FILES)


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


# --insecure's help: who may do what without credentials.
_INSECURE = ("run without credentials: the ranks' CacheWorker service accepts plans from anyone who reaches it. "
             "Required unless --auth-token and one of --manager-token or --tls-client-ca are given")


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
    stop_on_signals()
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
        stop_on_signals()  # ray.init installs its own SIGTERM handler
        group = start_group(args, node_id, gpus, creds)
        stop_on_signals()
        try:  # from "workers ready" on, SIGTERM or SIGINT is the normal way to stop (exit 0)
            announce(group, args, creds)
            watch(group.addresses, creds, ManagerWatch(args, creds))  # returns only by raising
        except KeyboardInterrupt:
            pass
    finally:
        shut_down(group, node)
    print("workers stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_main("kvpager worker", sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
