"""On a CUDA device: Ray GPU workers generate exactly what the contiguous-cache model does,
with swaps between device memory and pinned host memory."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ray_gpu_cluster():
    ray = pytest.importorskip("ray")
    from kvpager.worker.ray_group import init_local_ray

    init_local_ray(num_cpus=4, num_gpus=torch.cuda.device_count())
    yield ray
    ray.shutdown()


def test_ray_gpu_workers_match_contiguous_reference(ray_gpu_cluster):
    from kvpager.worker.cache_worker import WorkerConfig
    from kvpager.worker.model import ModelConfig
    from kvpager.worker.ray_group import RayWorkerGroup

    from ..integration.test_generation import check_against_reference, make_requests, manager_sized_by_workers

    # Head dim 64 and block size 8: shapes our CUDA decode kernel is built for.
    model = ModelConfig(num_layers=2, hidden_size=128, num_q_heads=8, num_kv_heads=2, head_dim=64,
                        intermediate_size=256, vocab_size=128, seed=3)
    tp = min(2, torch.cuda.device_count())
    with manager_sized_by_workers(block_size=8) as (client, service):
        config = WorkerConfig(model=model, block_size=8, num_gpu_blocks=24, num_cpu_blocks=64,
                              manager_address=client.target)
        group = RayWorkerGroup(config, tensor_parallel_size=tp, use_gpu=True)
        try:
            mem = group.memory_stats()[0]
            assert mem.device.startswith("cuda") and mem.attention_backend == "cuda"  # our kernels
            scheduler, stats = check_against_reference(client, service, group, make_requests(24, 5), model, 8)
            assert scheduler.stats.preemptions > 0 and stats.blocks_swapped_in > 0 and stats.cow_copies > 0
        finally:
            group.stop()


def test_cache_sized_from_free_device_memory():
    # The worker serves gRPC health checks: skipped where grpcio-health-checking is not installed
    # (the lent GPU image has it only when the project's wheels are carried there).
    pytest.importorskip("grpc_health")
    from kvpager.worker.cache_worker import CacheWorker, WorkerConfig
    from kvpager.worker.model import ModelConfig

    model = ModelConfig(num_layers=2, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=128)
    free_before = torch.cuda.mem_get_info()[0]
    worker = CacheWorker(WorkerConfig(model=model, block_size=16, memory_fraction=0.05, num_cpu_blocks=8))
    worker.start()
    try:
        stats = worker.memory_stats()
        assert stats.device.startswith("cuda") and worker.cache.swap_space.is_pinned()
        expected = int(free_before * 0.05) // stats.block_bytes
        assert abs(stats.num_gpu_blocks - expected) <= expected * 0.02 + 1
    finally:
        worker.stop()
        del worker
        torch.cuda.empty_cache()
