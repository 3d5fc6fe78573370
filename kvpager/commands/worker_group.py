"""`kvpager worker`'s start on Ray: join Ray as a driver (``connect``: a local cluster of its own,
or the cluster at --ray-address through this machine's node), then create the group's named rank
actors there and start them, each registering with the manager (``start_group``).
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

from kvpager.commands import cli
from kvpager.commands.ray_cluster import connect_ray, local_ray_line
from kvpager.commands.worker_checks import check_gpus, model_config
from kvpager.commands.worker_refusals import explain_refusal, ray_error_cause


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
        raise cli.Failure(explain_refusal(ray_error_cause(err), args.manager)) from err
