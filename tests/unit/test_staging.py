"""The staging ring on the CPU: the parts, converted and concatenated in order, no pinned memory."""

from __future__ import annotations

import numpy as np
import torch

from kvpager.worker.staging import StagingRing


def test_cpu_upload_is_the_concatenation_in_the_dtype():
    ring = StagingRing("cpu")
    out = ring.upload([[3, -1, 7], np.array([5, 6], np.int32), []], np.int64)
    assert out.dtype == torch.int64 and out.tolist() == [3, -1, 7, 5, 6]
    assert ring.upload([[1, 2]], np.int32).dtype == torch.int32
