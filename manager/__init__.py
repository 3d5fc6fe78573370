"""The block manager: pure-Python bookkeeping of KV blocks (no torch), served over gRPC."""

from .block_manager import BlockManager
from .config import ManagerConfig
from kvpager.errors import (
    Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, InvariantViolation, ManagerError, NotFound,
    OutOfRange, ResourceExhausted,
)

__all__ = [
    "BlockManager", "ManagerConfig", "ManagerError", "InvalidArgument", "NotFound", "AlreadyExists",
    "FailedPrecondition", "ResourceExhausted", "OutOfRange", "Aborted", "InvariantViolation",
]
