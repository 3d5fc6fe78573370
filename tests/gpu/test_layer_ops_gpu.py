"""On a CUDA device: the decoder's per-layer elementwise kernels (``kernels/csrc/layer_ops.cu``)
against the torch formulas they replace (``kernels/layer_reference.py``), on random inputs.

RoPE and SiLU * up round where torch rounds, so they are bitwise equal in every dtype; the fused
residual add is bitwise equal too, and RMSNorm's output may differ by one unit in the last place
(its float32 sum of squares adds in another order). Inputs include strided views (q and k as
slices of a fused qkv projection), odd widths and empty batches; both are also checked against
a float64 computation within the dtype's rounding."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from kvpager.kernels import cuda, layer_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


@pytest.fixture(autouse=True)
def _needs_kernels():
    if not cuda.available():
        pytest.skip(cuda.load_error() or "kvpager CUDA kernels unavailable")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 1000), (130, 4096), (0, 256)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype, rows, hidden, with_delta):
    g = torch.Generator(device="cuda").manual_seed(rows * hidden + with_delta)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype) * 3
    delta = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype) if with_delta else None
    weight = (torch.rand(hidden, device="cuda", generator=g) + 0.5).to(dtype)
    x_ref = x.clone()
    want = layer_reference.add_rms_norm(x_ref, delta, weight, 1e-5)
    got = cuda.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, x_ref)                            # the residual add, in place
    ulp = ULP[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=2 * ulp)
    if rows:
        if dtype != torch.float32:   # float32 keeps the sum's last bits: they differ, rounded away in 16 bits
            assert (got == want).float().mean().item() > 0.9
        xf = x_ref.double()                                 # float64: within the dtype's rounding
        exact = weight.double() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        torch.testing.assert_close(got.double(), exact, rtol=4 * ulp, atol=4 * ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 32, 8, 128), (37, 4, 2, 64), (300, 8, 8, 256), (0, 4, 2, 64)])
def test_rope_on_views_of_a_fused_qkv(dtype, tokens, hq, hk, d):
    g = torch.Generator(device="cuda").manual_seed(tokens + hq + d)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda", generator=g).to(dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(-1, hq, d), k.view(-1, hk, d)
    angles = torch.rand(tokens, d // 2, device="cuda", generator=g).double() * 1000
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = layer_reference.rope(q.clone(), k.clone(), cos, sin)
    untouched = qkv[:, (hq + hk) * d:].clone()
    got_q, got_k = cuda.rope(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()                  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * d:], untouched)    # v not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset,d", [(1, 64), (0, 6), (2, 128)])
def test_rope_on_rows_four_elements_do_not_align(dtype, offset, d):
    """Rows that start off a 4-element boundary (a view `offset` elements into its storage) or a
    head_dim whose half is not a multiple of 4: a pair a thread instead of four, the same values."""
    g = torch.Generator(device="cuda").manual_seed(offset * 1000 + d)
    tokens, hq, hk = 9, 4, 2
    flat = torch.randn(tokens, offset + (hq + hk) * d, device="cuda", generator=g).to(dtype)[:, offset:]
    q, k = flat[:, :hq * d].view(tokens, hq, d), flat[:, hq * d:].view(tokens, hk, d)
    angles = torch.rand(tokens, d // 2, device="cuda", generator=g).double() * 1000
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = layer_reference.rope(q.clone(), k.clone(), cos, sin)
    got_q, got_k = cuda.rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 8192), (45, 1000), (513, 256), (0, 64)])
def test_silu_and_mul(dtype, rows, width):
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width, device="cuda", generator=g).to(dtype) * 4
    got = cuda.silu_and_mul(gate_up)
    assert torch.equal(got, layer_reference.silu_and_mul(gate_up))
    if rows:
        gate, up = gate_up.double().chunk(2, dim=-1)
        ulp = ULP[dtype]
        torch.testing.assert_close(got.double(), gate * torch.sigmoid(gate) * up, rtol=4 * ulp, atol=4 * ulp)


def test_bad_inputs_are_refused():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        cuda.add_rms_norm(x, None, torch.ones(32, device="cuda", dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="delta"):
        cuda.add_rms_norm(x, torch.randn(4, 32, device="cuda", dtype=torch.bfloat16), torch.ones(64, device="cuda",
                          dtype=torch.bfloat16), 1e-5)
    q = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cos"):
        cuda.rope(q, q[:, :2], torch.randn(3, 32, device="cuda", dtype=torch.bfloat16),
                  torch.randn(3, 32, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out"):
        cuda.silu_and_mul(torch.randn(2, 10, device="cuda", dtype=torch.float16),
                          out=torch.empty(2, 4, device="cuda", dtype=torch.float16))
