"""The decoder's per-layer elementwise ops in torch: how transformers computes them (Llama,
Mistral, Qwen2/3), the oracle our CUDA versions (``kernels/csrc/layer_ops.cu``) must match, and
what runs on the CPU. ``kernels.ops`` picks the implementation per tensor.

- ``add_rms_norm``: the residual add (in place) fused with the next RMSNorm: float32 statistics,
  the normalized value cast back to the input's dtype before the weight multiplies it;
- ``rope``: rotate-half rotary embedding of q and k with cos/sin already in their dtype;
- ``silu_and_mul``: the gated MLP's SiLU(gate) * up over the fused gate/up projection.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["add_rms_norm", "rope", "silu_and_mul"]


def add_rms_norm(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (when given), then ``weight * RMSNorm(x)`` over the last dim, in
    x's dtype. Any leading dims."""
    if delta is not None:
        x.add_(delta)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]`` and k ``[T, Hk, D]`` rotated by cos/sin ``[T, D]`` (their dtype): new
    tensors (the CUDA version rotates in place; use the returned ones either way)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
