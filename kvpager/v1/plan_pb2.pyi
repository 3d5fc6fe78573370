from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockMapping(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecutionPlan(_message.Message):
    __slots__ = ("step_id", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    blocks_to_swap_out: BlockMapping
    blocks_to_swap_in: BlockMapping
    blocks_to_copy: BlockMapping
    def __init__(self, step_id: _Optional[int] = ..., blocks_to_swap_out: _Optional[_Union[BlockMapping, _Mapping]] = ..., blocks_to_swap_in: _Optional[_Union[BlockMapping, _Mapping]] = ..., blocks_to_copy: _Optional[_Union[BlockMapping, _Mapping]] = ...) -> None: ...
