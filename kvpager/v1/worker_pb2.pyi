from kvpager.v1 import plan_pb2 as _plan_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecutePlanRequest(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: _plan_pb2.ExecutionPlan
    def __init__(self, plan: _Optional[_Union[_plan_pb2.ExecutionPlan, _Mapping]] = ...) -> None: ...

class ExecutePlanResponse(_message.Message):
    __slots__ = ("step_id", "elapsed_ms")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    elapsed_ms: float
    def __init__(self, step_id: _Optional[int] = ..., elapsed_ms: _Optional[float] = ...) -> None: ...

class GetMemoryStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerMemoryStats(_message.Message):
    __slots__ = ("worker_id", "device", "num_gpu_blocks", "num_cpu_blocks", "block_bytes", "gpu_cache_bytes", "cpu_cache_bytes", "last_step_id", "plans_executed", "blocks_swapped_out", "blocks_swapped_in", "blocks_copied", "attention_backend")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PLANS_EXECUTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SWAPPED_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SWAPPED_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_COPIED_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device: str
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int
    gpu_cache_bytes: int
    cpu_cache_bytes: int
    last_step_id: int
    plans_executed: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    blocks_copied: int
    attention_backend: str
    def __init__(self, worker_id: _Optional[str] = ..., device: _Optional[str] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., gpu_cache_bytes: _Optional[int] = ..., cpu_cache_bytes: _Optional[int] = ..., last_step_id: _Optional[int] = ..., plans_executed: _Optional[int] = ..., blocks_swapped_out: _Optional[int] = ..., blocks_swapped_in: _Optional[int] = ..., blocks_copied: _Optional[int] = ..., attention_backend: _Optional[str] = ...) -> None: ...
