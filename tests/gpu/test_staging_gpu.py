"""On a CUDA device: the worker's pinned staging ring (``worker/staging.py``) uploads every part in
order, grows its buffers, and never refills a buffer before the device copy that last read it
has run, even when the stream is held back far behind the host (a sleep kernel queued first:
without the per-buffer event, later uploads would overwrite buffers still waiting to be copied)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from kvpager.worker.staging import StagingRing  # noqa: E402


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_uploads_behind_a_held_stream_keep_their_values(dtype):
    rng = np.random.default_rng(7)
    ring = StagingRing("cuda", slots=3)
    torch.cuda._sleep(200_000_000)   # ~0.1 s of GPU time queued before every copy below
    sent, got = [], []
    for i in range(12):   # four rounds over the three buffers, sizes growing and shrinking
        n = int(rng.integers(1, 5000)) * (1 + i % 4)
        parts = [list(rng.integers(-2**31, 2**31 - 1, n // 3).tolist()),
                 rng.integers(-2**31, 2**31 - 1, n - n // 3).astype(np.int32)]
        sent.append(np.concatenate([np.asarray(p, dtype=dtype) for p in parts]))
        got.append(ring.upload(parts, dtype))
    torch.cuda.synchronize()
    for want, out in zip(sent, got):
        assert out.device.type == "cuda" and out.dtype == (torch.int32 if dtype == np.int32 else torch.int64)
        assert np.array_equal(out.cpu().numpy(), want)


def test_an_empty_upload_is_an_empty_tensor():
    ring = StagingRing("cuda")
    out = ring.upload([[], np.zeros(0, np.int32)], np.int32)
    assert out.shape == (0,) and out.is_cuda
