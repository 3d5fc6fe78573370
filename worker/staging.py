"""A step's integer inputs (tokens, positions, slots, tables, lengths, work lists) onto the device
in one copy each, without making the host wait, through pinned buffers this module keeps.

``tensor.pin_memory()`` per step (what the worker did before) allocates from torch's caching
host allocator and copies the host data a second time; on the H100 host that cost ~0.2 ms per
upload of a 256-sequence decode step, a visible part of the step's CPU launch cost
(benchmarks/model_step.py --launch-cost). Here a ring of pinned buffers is filled in place by
numpy and reused in turn; a buffer is refilled only once the device copy that last read it has
run (one CUDA event per buffer). With several slots and at most two steps in flight that wait
is already over when it is asked.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


class StagingRing:
    def __init__(self, device: torch.device | str, slots: int = 8) -> None:
        """``slots`` pinned buffers used in turn (each grows to the largest upload it served)."""
        self.device = torch.device(device)
        self._buffers: list[Optional[torch.Tensor]] = [None] * slots
        self._copied: list[Optional[torch.cuda.Event]] = [None] * slots
        self._next = 0

    def upload(self, parts: Sequence[Sequence[int]], dtype: type) -> torch.Tensor:
        """The parts (lists or numpy arrays) one after the other as one 1-D tensor of ``dtype``
        (np.int32 or np.int64) on the device, copied in stream order behind the work already
        queued (no host wait). On a CPU device, the host tensor itself. O(total): one numpy
        conversion of each list, one fill of the pinned buffer, one copy."""
        arrays = [np.asarray(p, dtype=dtype) for p in parts]
        if self.device.type != "cuda":
            return torch.from_numpy(np.concatenate(arrays)).to(self.device)
        np_dtype = np.dtype(dtype)
        total = sum(a.size for a in arrays)
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        nbytes = total * np_dtype.itemsize
        host = self._free_buffer(slot, nbytes)[:nbytes].view(_TORCH_DTYPES[np_dtype])
        if total:
            np.concatenate(arrays, out=host.numpy())
        out = torch.empty(total, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        event = self._copied[slot]
        if event is None:   # one event per buffer, recorded again each time (_free_buffer waited for it)
            event = self._copied[slot] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return out

    def _free_buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Slot ``slot``'s pinned buffer (uint8, at least ``nbytes``), free to fill: the copy that
        last read it has run. O(1) (O(nbytes) when the buffer grows)."""
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()   # the copy that last read this buffer (several uploads ago)
        buffer = self._buffers[slot]
        need = max(nbytes, 1)
        if buffer is None or buffer.numel() < need:
            buffer = torch.empty(max(need, 2 * (0 if buffer is None else buffer.numel())), dtype=torch.uint8,
                                 pin_memory=True)
            self._buffers[slot] = buffer
        return buffer
