"""Where a prefill step goes (kernels/prefill.py ``_kernel_pays``): our kernel or gather + SDPA,
by the shapes of the step and the kernel version that would run (the measured rule). Pure host
logic: no GPU needed."""

from __future__ import annotations

import pytest

from kvpager.kernels import prefill

WHOLE_PROMPTS = ([4096], [4096])                  # one shape of whole prompts
CHUNKS = ([512] * 8, [1536] * 8)                  # new tokens over a cached prefix
MANY_PROMPTS = (list(range(100, 900, 50)), list(range(100, 900, 50)))   # 16 distinct whole prompts


@pytest.fixture(autouse=True)
def measured_rule(monkeypatch):
    monkeypatch.setattr(prefill, "use_kernel", None)
    monkeypatch.delenv(prefill.KERNEL_ENV, raising=False)


def test_the_warp_specialized_kernel_takes_every_step():
    for q, c in (WHOLE_PROMPTS, CHUNKS, MANY_PROMPTS):
        assert prefill._kernel_pays(q, c, wgmma=True)


def test_the_mma_sync_kernel_takes_only_many_distinct_shapes():
    assert not prefill._kernel_pays(*WHOLE_PROMPTS, wgmma=False)
    assert not prefill._kernel_pays(*CHUNKS, wgmma=False)
    assert prefill._kernel_pays(*MANY_PROMPTS, wgmma=False)


def test_the_environment_forces_the_kernel(monkeypatch):
    monkeypatch.setenv(prefill.KERNEL_ENV, "1")
    assert prefill._kernel_pays(*WHOLE_PROMPTS, wgmma=False)
