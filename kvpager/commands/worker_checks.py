"""`kvpager worker`'s checks before Ray starts: each fails at once with one line (``cli.Failure``)
where the group could not start or the manager would refuse it.

The manager must answer its health check, and where it shows this worker its stats, agree with
the flags (block size, group size, pools: ``worker_refusals`` words the refusals); --device cuda
needs a GPU per rank; every rank's --metrics-port must be free; --model must be a model these
flags can serve (``model_config``, which ``worker_group.start_group`` reads again for the ranks).
``worker_serving.ManagerWatch`` reuses the manager's two checks while the group serves.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from kvpager.commands import cli
from kvpager.commands.worker_refusals import block_size_refusal, capacity_refusal, group_size_refusal, too_small

log = logging.getLogger("kvpager.worker")


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



def check_gpus(args: argparse.Namespace, gpus: int) -> None:
    """--device cuda needs a GPU per rank on the node the ranks run on."""
    if args.device == "cuda" and gpus < args.tensor_parallel_size:
        raise cli.Failure(f"--device cuda needs {args.tensor_parallel_size} GPU(s) on this Ray node, it has {gpus}")


def check_metrics_ports(args: argparse.Namespace) -> None:
    """--metrics-port PORT: rank r serves on PORT + r; one already taken fails before Ray starts."""
    if not args.metrics_port:  # off, or free ports
        return
    last = args.metrics_port + args.tensor_parallel_size - 1
    if last > 65535:
        raise cli.Failure(f"--metrics-port {args.metrics_port}: rank r serves on it + r, and rank "
                          f"{args.tensor_parallel_size - 1}'s port {last} is beyond 65535")
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
