"""Model steps between their launch and the fetch of their output: the worker's half of overlap.

``CacheWorker.launch_model`` enqueues a step's work and the copy of its output into pinned host
memory, keeps both here under the caller's ticket and returns at once; ``fetch_output`` waits
for that copy alone and hands the output over. So a step launched while the previous one still
runs on the GPU queues right behind it in the stream: the GPU goes from one step to the next
without waiting for the host (the host work of a launch never waits for the device:
``worker.model.to_device``). On the CPU the work is done when the launch returns.

Each rank records a done event even when it returns nothing (ranks > 0), so a fetch means "the
step has run here" on every rank. Steps launched and never fetched (a caller that gave up on
them) are dropped oldest first past ``KEPT``; fetching one then raises ``StepNotLaunched``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional

import torch

log = logging.getLogger("kvpager.worker")


class StepNotLaunched(LookupError):
    """A fetch named a ticket this worker holds no launched step for."""


@dataclass(slots=True)
class _Launched:
    output: Optional[torch.Tensor]        # on the host; complete once ``done`` has passed
    done: Optional["torch.cuda.Event"]    # None on the CPU: already complete


class LaunchedSteps:
    KEPT = 16   # launched steps waiting for their fetch; a caller keeps at most two in flight

    def __init__(self) -> None:
        self._steps: OrderedDict[Hashable, _Launched] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, ticket: Hashable, output: Optional[torch.Tensor], device: torch.device) -> None:
        """Keep a launched step: start the copy of its device ``output`` (None: this rank returns
        nothing) to the host behind the step's work on the current stream. Never waits. O(output)."""
        done = None
        if device.type == "cuda":
            if output is not None:
                host = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
                host.copy_(output, non_blocking=True)
                output = host
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
        with self._lock:
            if ticket in self._steps:
                raise ValueError(f"step ticket {ticket!r} was launched twice")
            self._steps[ticket] = _Launched(output, done)
            while len(self._steps) > self.KEPT:
                dropped, _ = self._steps.popitem(last=False)
                log.warning("dropped the output of step ticket %r: launched but never fetched", dropped)

    def take(self, ticket: Hashable) -> Optional[torch.Tensor]:
        """The step's output once it is on the host (waits for the device only, never for
        another step's launch); StepNotLaunched when there is none under ``ticket``."""
        with self._lock:
            launched = self._steps.pop(ticket, None)
        if launched is None:
            raise StepNotLaunched(f"no launched step under ticket {ticket!r}: its launch failed, or more than "
                                  f"{self.KEPT} steps were launched after it without being fetched")
        if launched.done is not None:
            launched.done.synchronize()
        return launched.output

    def __contains__(self, ticket: Hashable) -> bool:
        with self._lock:
            return ticket in self._steps

    def __len__(self) -> int:
        with self._lock:
            return len(self._steps)
