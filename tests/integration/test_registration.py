"""RegisterWorker refusals leave no trace: a worker refused for its capacity does not fix the
group's tensor-parallel size (nor, for a manager sized by its workers, join the registry), and
the manager logs each refusal as one line."""

from __future__ import annotations

import logging

import grpc
import pytest

from kvpager.manager import ManagerConfig
from kvpager.manager.service import create_server
from kvpager.v1 import block_manager_pb2 as pb
from kvpager.v1 import block_manager_pb2_grpc as pb_grpc


def register(stub, tp: int, gpu: int, cpu: int = 8):
    return stub.RegisterWorker(pb.RegisterWorkerRequest(
        address="127.0.0.1:1", rank=0, tensor_parallel_size=tp, num_gpu_blocks=gpu, num_cpu_blocks=cpu,
        block_size=4), timeout=5)


def test_a_refused_worker_leaves_no_group_size_and_is_logged(caplog):
    server, port, service, _ = create_server(ManagerConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.BlockManagerStub(channel)
            with caplog.at_level(logging.WARNING, logger="kvpager.manager"):
                with pytest.raises(grpc.RpcError) as refused:
                    register(stub, tp=1, gpu=16)            # below the manager's 32-block pool
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            lines = [r.getMessage() for r in caplog.records if "refused the worker" in r.getMessage()]
            assert len(lines) == 1 and "'127.0.0.1:1' (rank 0)" in lines[0] and "below the manager's pools" in lines[0]
            assert service.registry.tensor_parallel_size is None and not service.registry.workers()
            assert register(stub, tp=2, gpu=32).worker_id       # a group of 2 is welcome: nothing was fixed
            assert service.registry.tensor_parallel_size == 2
    finally:
        server.stop(None)
        service.close()


def test_a_worker_too_small_for_a_manager_sized_by_its_workers_is_refused_before_it_joins():
    # num_gpu_blocks=0: the pools are sized from the workers; GPU block 0 is the null block, so a
    # worker with fewer than 2 GPU blocks could never size them.
    server, port, service, _ = create_server(ManagerConfig(block_size=4, num_gpu_blocks=0, num_cpu_blocks=0))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.BlockManagerStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                register(stub, tp=1, gpu=1)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "capacity must be >= 2 GPU blocks" in refused.value.details()
            assert service.registry.tensor_parallel_size is None and not service.registry.workers()
            assert service.manager is None
            answer = register(stub, tp=2, gpu=16)      # a group of 2 is welcome: nothing was fixed
            assert answer.worker_id and service.registry.tensor_parallel_size == 2
    finally:
        server.stop(None)
        service.close()
