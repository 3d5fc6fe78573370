from kvpager.v1 import plan_pb2 as _plan_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TableLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TABLE_LAYOUT_BOTH: _ClassVar[TableLayout]
    TABLE_LAYOUT_PADDED: _ClassVar[TableLayout]
    TABLE_LAYOUT_CSR: _ClassVar[TableLayout]
    TABLE_LAYOUT_NONE: _ClassVar[TableLayout]
    TABLE_LAYOUT_PADDED_PACKED: _ClassVar[TableLayout]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
TABLE_LAYOUT_BOTH: TableLayout
TABLE_LAYOUT_PADDED: TableLayout
TABLE_LAYOUT_CSR: TableLayout
TABLE_LAYOUT_NONE: TableLayout
TABLE_LAYOUT_PADDED_PACKED: TableLayout
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_CPU: Tier

class AllocateRequest(_message.Message):
    __slots__ = ("request_id", "seq_id", "token_ids", "num_tokens", "cache_namespace")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    cache_namespace: str
    def __init__(self, request_id: _Optional[str] = ..., seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., cache_namespace: _Optional[str] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("seq_id", "block_ids", "slot_mapping", "num_cached_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., slot_mapping: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("request_id", "seq_id", "token_ids", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("seq_id", "slot_mapping", "new_block_ids", "copies", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    copies: _plan_pb2.BlockMapping
    num_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., slot_mapping: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., copies: _Optional[_Union[_plan_pb2.BlockMapping, _Mapping]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("request_id", "parent_seq_id", "child_seq_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    parent_seq_id: str
    child_seq_id: str
    def __init__(self, request_id: _Optional[str] = ..., parent_seq_id: _Optional[str] = ..., child_seq_id: _Optional[str] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("child_seq_id", "block_ids")
    CHILD_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    child_seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, child_seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("request_id", "seq_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_id: str
    def __init__(self, request_id: _Optional[str] = ..., seq_id: _Optional[str] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("seq_id", "num_blocks_released")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_blocks_released: int
    def __init__(self, seq_id: _Optional[str] = ..., num_blocks_released: _Optional[int] = ...) -> None: ...

class SwapOutRequest(_message.Message):
    __slots__ = ("request_id", "seq_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SwapOutResponse(_message.Message):
    __slots__ = ("mapping",)
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    mapping: _plan_pb2.BlockMapping
    def __init__(self, mapping: _Optional[_Union[_plan_pb2.BlockMapping, _Mapping]] = ...) -> None: ...

class SwapInRequest(_message.Message):
    __slots__ = ("request_id", "seq_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SwapInResponse(_message.Message):
    __slots__ = ("mapping", "num_blocks_reused")
    MAPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    mapping: _plan_pb2.BlockMapping
    num_blocks_reused: int
    def __init__(self, mapping: _Optional[_Union[_plan_pb2.BlockMapping, _Mapping]] = ..., num_blocks_reused: _Optional[int] = ...) -> None: ...

class AppendBatchRequest(_message.Message):
    __slots__ = ("seq_ids", "token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendBatchResponse(_message.Message):
    __slots__ = ("failed_indices", "failed_codes", "failed_messages")
    FAILED_INDICES_FIELD_NUMBER: _ClassVar[int]
    FAILED_CODES_FIELD_NUMBER: _ClassVar[int]
    FAILED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    failed_indices: _containers.RepeatedScalarFieldContainer[int]
    failed_codes: _containers.RepeatedScalarFieldContainer[int]
    failed_messages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, failed_indices: _Optional[_Iterable[int]] = ..., failed_codes: _Optional[_Iterable[int]] = ..., failed_messages: _Optional[_Iterable[str]] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("allocate", "append", "fork", "free", "swap_out", "swap_in", "append_batch")
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    APPEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    allocate: AllocateRequest
    append: AppendRequest
    fork: ForkRequest
    free: FreeRequest
    swap_out: SwapOutRequest
    swap_in: SwapInRequest
    append_batch: AppendBatchRequest
    def __init__(self, allocate: _Optional[_Union[AllocateRequest, _Mapping]] = ..., append: _Optional[_Union[AppendRequest, _Mapping]] = ..., fork: _Optional[_Union[ForkRequest, _Mapping]] = ..., free: _Optional[_Union[FreeRequest, _Mapping]] = ..., swap_out: _Optional[_Union[SwapOutRequest, _Mapping]] = ..., swap_in: _Optional[_Union[SwapInRequest, _Mapping]] = ..., append_batch: _Optional[_Union[AppendBatchRequest, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("request_id", "operations", "all_or_nothing", "table_layout")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    ALL_OR_NOTHING_FIELD_NUMBER: _ClassVar[int]
    TABLE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    operations: _containers.RepeatedCompositeFieldContainer[Operation]
    all_or_nothing: bool
    table_layout: TableLayout
    def __init__(self, request_id: _Optional[str] = ..., operations: _Optional[_Iterable[_Union[Operation, _Mapping]]] = ..., all_or_nothing: _Optional[bool] = ..., table_layout: _Optional[_Union[TableLayout, str]] = ...) -> None: ...

class OperationResult(_message.Message):
    __slots__ = ("code", "message", "allocate", "append", "fork", "free", "swap_out", "swap_in", "append_batch")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    APPEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    allocate: AllocateResponse
    append: AppendResponse
    fork: ForkResponse
    free: FreeResponse
    swap_out: SwapOutResponse
    swap_in: SwapInResponse
    append_batch: AppendBatchResponse
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., allocate: _Optional[_Union[AllocateResponse, _Mapping]] = ..., append: _Optional[_Union[AppendResponse, _Mapping]] = ..., fork: _Optional[_Union[ForkResponse, _Mapping]] = ..., free: _Optional[_Union[FreeResponse, _Mapping]] = ..., swap_out: _Optional[_Union[SwapOutResponse, _Mapping]] = ..., swap_in: _Optional[_Union[SwapInResponse, _Mapping]] = ..., append_batch: _Optional[_Union[AppendBatchResponse, _Mapping]] = ...) -> None: ...

class BatchTables(_message.Message):
    __slots__ = ("seq_ids", "context_lens", "query_lens", "slot_mapping", "max_blocks", "block_tables", "kv_indptr", "kv_indices", "kv_last_page_len", "block_tables_packed")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    QUERY_LENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    KV_INDPTR_FIELD_NUMBER: _ClassVar[int]
    KV_INDICES_FIELD_NUMBER: _ClassVar[int]
    KV_LAST_PAGE_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_PACKED_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    context_lens: _containers.RepeatedScalarFieldContainer[int]
    query_lens: _containers.RepeatedScalarFieldContainer[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    max_blocks: int
    block_tables: _containers.RepeatedScalarFieldContainer[int]
    kv_indptr: _containers.RepeatedScalarFieldContainer[int]
    kv_indices: _containers.RepeatedScalarFieldContainer[int]
    kv_last_page_len: _containers.RepeatedScalarFieldContainer[int]
    block_tables_packed: bytes
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., context_lens: _Optional[_Iterable[int]] = ..., query_lens: _Optional[_Iterable[int]] = ..., slot_mapping: _Optional[_Iterable[int]] = ..., max_blocks: _Optional[int] = ..., block_tables: _Optional[_Iterable[int]] = ..., kv_indptr: _Optional[_Iterable[int]] = ..., kv_indices: _Optional[_Iterable[int]] = ..., kv_last_page_len: _Optional[_Iterable[int]] = ..., block_tables_packed: _Optional[bytes] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "results", "applied", "plan", "batch", "gpu_blocks_available", "cpu_blocks_available")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    results: _containers.RepeatedCompositeFieldContainer[OperationResult]
    applied: bool
    plan: _plan_pb2.ExecutionPlan
    batch: BatchTables
    gpu_blocks_available: int
    cpu_blocks_available: int
    def __init__(self, step_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[OperationResult, _Mapping]]] = ..., applied: _Optional[bool] = ..., plan: _Optional[_Union[_plan_pb2.ExecutionPlan, _Mapping]] = ..., batch: _Optional[_Union[BatchTables, _Mapping]] = ..., gpu_blocks_available: _Optional[int] = ..., cpu_blocks_available: _Optional[int] = ...) -> None: ...

class GetBlockTableRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class GetBlockTableResponse(_message.Message):
    __slots__ = ("seq_id", "tier", "num_tokens", "block_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tier: Tier
    num_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., num_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("total_blocks", "used_blocks", "free_blocks", "cached_blocks")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    def __init__(self, total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("block_size", "gpu", "cpu", "running_sequences", "swapped_sequences", "gpu_utilization", "internal_fragmentation", "prefix_caching", "prefix_query_tokens", "prefix_hit_tokens", "cow_copies", "blocks_swapped_out", "blocks_swapped_in", "evictions", "watermark_blocks", "steps", "prefix_query_blocks", "prefix_hit_blocks", "preemptions", "workers_registered", "workers_expected", "epoch", "lost_sequences", "tenant", "tenants")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COW_COPIES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SWAPPED_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SWAPPED_IN_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOST_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    gpu: TierStats
    cpu: TierStats
    running_sequences: int
    swapped_sequences: int
    gpu_utilization: float
    internal_fragmentation: float
    prefix_caching: bool
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cow_copies: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    evictions: int
    watermark_blocks: int
    steps: int
    prefix_query_blocks: int
    prefix_hit_blocks: int
    preemptions: int
    workers_registered: int
    workers_expected: int
    epoch: int
    lost_sequences: int
    tenant: TenantStats
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    def __init__(self, block_size: _Optional[int] = ..., gpu: _Optional[_Union[TierStats, _Mapping]] = ..., cpu: _Optional[_Union[TierStats, _Mapping]] = ..., running_sequences: _Optional[int] = ..., swapped_sequences: _Optional[int] = ..., gpu_utilization: _Optional[float] = ..., internal_fragmentation: _Optional[float] = ..., prefix_caching: _Optional[bool] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., cow_copies: _Optional[int] = ..., blocks_swapped_out: _Optional[int] = ..., blocks_swapped_in: _Optional[int] = ..., evictions: _Optional[int] = ..., watermark_blocks: _Optional[int] = ..., steps: _Optional[int] = ..., prefix_query_blocks: _Optional[int] = ..., prefix_hit_blocks: _Optional[int] = ..., preemptions: _Optional[int] = ..., workers_registered: _Optional[int] = ..., workers_expected: _Optional[int] = ..., epoch: _Optional[int] = ..., lost_sequences: _Optional[int] = ..., tenant: _Optional[_Union[TenantStats, _Mapping]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "gpu_blocks", "cpu_blocks", "running_sequences", "swapped_sequences", "has_quota", "quota_blocks", "has_sequence_quota", "quota_sequences")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    HAS_QUOTA_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HAS_SEQUENCE_QUOTA_FIELD_NUMBER: _ClassVar[int]
    QUOTA_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    gpu_blocks: int
    cpu_blocks: int
    running_sequences: int
    swapped_sequences: int
    has_quota: bool
    quota_blocks: int
    has_sequence_quota: bool
    quota_sequences: int
    def __init__(self, tenant: _Optional[str] = ..., gpu_blocks: _Optional[int] = ..., cpu_blocks: _Optional[int] = ..., running_sequences: _Optional[int] = ..., swapped_sequences: _Optional[int] = ..., has_quota: _Optional[bool] = ..., quota_blocks: _Optional[int] = ..., has_sequence_quota: _Optional[bool] = ..., quota_sequences: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "rank", "tensor_parallel_size", "num_gpu_blocks", "num_cpu_blocks", "block_size", "metrics_address", "block_bytes", "cache_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    rank: int
    tensor_parallel_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    metrics_address: str
    block_bytes: int
    cache_id: str
    def __init__(self, address: _Optional[str] = ..., rank: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., metrics_address: _Optional[str] = ..., block_bytes: _Optional[int] = ..., cache_id: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s", "num_gpu_blocks", "num_cpu_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    num_gpu_blocks: int
    num_cpu_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("registered",)
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    registered: bool
    def __init__(self, registered: _Optional[bool] = ...) -> None: ...
