"""A reference scheduler: continuous batching over the block manager and the cache workers."""

from .engine import Scheduler, SchedulerStats
from .request import Request, RequestOutput, SamplingParams

__all__ = ["Scheduler", "SchedulerStats", "Request", "RequestOutput", "SamplingParams"]
