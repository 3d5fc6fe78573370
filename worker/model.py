"""A small Llama-style decoder (RoPE, RMSNorm, GQA, SwiGLU) with deterministic random weights.

Its attention reads and writes the worker's paged KV cache (``forward_paged``); the same
weights also run over a plain contiguous cache (``forward_contiguous``: past keys and values
concatenated per step), which is the oracle the paged path must match token for token.

Tensor parallelism (Megatron style): rank r of N keeps query heads and KV heads
[r*H/N, (r+1)*H/N), the matching columns of the Q/K/V and gate/up projections and rows of
the output and down projections; the partial sums after attention and after the MLP are
all-reduced. Every rank builds the full weights from the seed and keeps its slice.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from kvpager.kernels import ops
from kvpager.kernels.reference import quantize_fp8


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    dtype: str = "float32"
    # KV cache storage: "auto" (the model's dtype) or "fp8_e4m3" (K / kv_scale and V / kv_scale
    # in float8_e4m3fn, half the bytes of a 16-bit cache; kv_scale per tensor, every layer).
    kv_cache_dtype: str = "auto"
    kv_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        if not 0 < self.kv_scale < float("inf"):
            raise ValueError(f"kv_scale must be finite and > 0, got {self.kv_scale}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8_e4m3" else self.torch_dtype

    @property
    def cache_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) for the kernels: 1 unless the cache is fp8."""
        return (self.kv_scale, self.kv_scale) if self.kv_cache_dtype == "fp8_e4m3" else (1.0, 1.0)


# The named models of `kvpager worker --model` and the demo: "tiny" runs anywhere; "small" has a
# head dim the CUDA decode kernel is built for (64, 128 or 256), so it is the default on GPUs.
PRESETS = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=16,
                        intermediate_size=256, seed=7),
    "small": ModelConfig(vocab_size=256, hidden_size=256, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=64,
                         intermediate_size=512, seed=7),
}


def preset(name: str, kv_cache_dtype: str = "auto", kv_scale: float = 1.0) -> ModelConfig:
    """A named model (``PRESETS``) with the KV storage asked for."""
    model = PRESETS[name]
    if kv_cache_dtype == "auto":
        return model
    return replace(model, kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale)


@dataclass(slots=True)
class ModelInput:
    """The tokens to compute in one step, sequence after sequence (S sequences, T tokens)."""

    token_ids: list[int]        # [T]
    positions: list[int]        # [T] position of each token in its sequence
    slot_mapping: list[int]     # [T] cache slot each token's K/V is written to
    query_start_loc: list[int]  # [S+1] sequence i's tokens are [query_start_loc[i], query_start_loc[i+1])
    context_lens: list[int]     # [S] tokens in the cache after this step, the new ones included
    block_tables: list[list[int]]  # [S][blocks] each sequence's block table


def _full_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[0] ** 0.5  # keeps activations O(1)

    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    weights = {"embed": torch.randn(cfg.vocab_size, h, generator=gen), "lm_head": rand(h, cfg.vocab_size),
               "final_norm": 1 + 0.1 * torch.randn(h, generator=gen)}
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        weights |= {
            p + "attn_norm": 1 + 0.1 * torch.randn(h, generator=gen),
            p + "wq": rand(h, cfg.num_q_heads * d), p + "wk": rand(h, cfg.num_kv_heads * d),
            p + "wv": rand(h, cfg.num_kv_heads * d), p + "wo": rand(cfg.num_q_heads * d, h),
            p + "mlp_norm": 1 + 0.1 * torch.randn(h, generator=gen),
            p + "w_gate": rand(h, i), p + "w_up": rand(h, i), p + "w_down": rand(i, h),
        }
    return weights


class Llama:
    def __init__(self, cfg: ModelConfig, rank: int = 0, tp_size: int = 1, device: torch.device | str = "cpu",
                 all_reduce: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        if cfg.num_q_heads % cfg.num_kv_heads or cfg.num_kv_heads % tp_size or cfg.intermediate_size % tp_size:
            raise ValueError(f"heads {cfg.num_q_heads}/{cfg.num_kv_heads} and intermediate size "
                             f"{cfg.intermediate_size} must divide evenly over {tp_size} ranks")
        self.cfg = cfg
        self.device = torch.device(device)
        self.q_heads = cfg.num_q_heads // tp_size
        self.kv_heads = cfg.num_kv_heads // tp_size
        self.scale = cfg.head_dim ** -0.5
        self._all_reduce = all_reduce if tp_size > 1 else None
        d, i = cfg.head_dim, cfg.intermediate_size // tp_size

        def cols(w: torch.Tensor, width: int) -> torch.Tensor:
            return w[:, rank * width:(rank + 1) * width]

        def rows(w: torch.Tensor, height: int) -> torch.Tensor:
            return w[rank * height:(rank + 1) * height]

        shard = {}
        for name, w in _full_weights(cfg).items():
            kind = name.rsplit(".", 1)[-1]
            if kind == "wq":
                w = cols(w, self.q_heads * d)
            elif kind in ("wk", "wv"):
                w = cols(w, self.kv_heads * d)
            elif kind == "wo":
                w = rows(w, self.q_heads * d)
            elif kind in ("w_gate", "w_up"):
                w = cols(w, i)
            elif kind == "w_down":
                w = rows(w, i)
            shard[name] = w.contiguous().to(device=self.device, dtype=cfg.torch_dtype)
        self.w = shard
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self._inv_freq = inv_freq.to(self.device)

    # ---- the two ways to run ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward_paged(self, inp: ModelInput, layer_cache: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                      attention_timer: Optional[AbstractContextManager] = None) -> torch.Tensor:
        """Compute the step's tokens over the paged cache; returns float32 logits of each
        sequence's last token, ``[S, vocab]``. ``layer_cache(l)`` gives layer l's K and V views.
        ``attention_timer``, if given, is entered around every layer's attention call (after
        the cache's wait for the plan and the K/V write, so neither counts as attention); a
        reusable context manager that must not make the host wait (``worker.metrics.Span``)."""
        timer = attention_timer if attention_timer is not None else nullcontext()
        dev = self.device
        tokens = torch.tensor(inp.token_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(inp.positions, dtype=torch.long, device=dev)
        slots = torch.tensor(inp.slot_mapping, dtype=torch.long, device=dev)
        starts = torch.tensor(inp.query_start_loc, dtype=torch.int32, device=dev)
        context_lens = torch.tensor(inp.context_lens, dtype=torch.int32, device=dev)
        width = max(len(t) for t in inp.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in inp.block_tables], dtype=torch.int32, device=dev)
        decode_only = len(inp.token_ids) == len(inp.context_lens)

        k_scale, v_scale = self.cfg.cache_scales

        def attend(layer: int, q, k, v):
            k_cache, v_cache = layer_cache(layer)
            ops.write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
            with timer:
                if decode_only:
                    return ops.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, self.scale, k_scale,
                                                      v_scale)
                return ops.paged_prefill_attention(q, k_cache, v_cache, tables, context_lens, starts, self.scale,
                                                   k_scale, v_scale,
                                                   host_lengths=(inp.query_start_loc, inp.context_lens))

        hidden = self._run_layers(tokens, positions, attend)
        last = starts[1:].long() - 1
        return self._logits(hidden[last])

    @torch.inference_mode()
    def forward_contiguous(self, token_ids: list[int], start_pos: int,
                           past: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One sequence over a contiguous cache: ``past[l]`` is layer l's (K, V), each
        ``[tokens, kv_heads, head_dim]``, extended in place of the list. Returns the float32
        logits of the last token, ``[vocab]``."""
        dev = self.device
        tokens = torch.tensor(token_ids, dtype=torch.long, device=dev)
        positions = torch.arange(start_pos, start_pos + len(token_ids), device=dev)
        group = self.q_heads // self.kv_heads

        k_scale, v_scale = self.cfg.cache_scales

        def attend(layer: int, q, k, v):
            if self.cfg.kv_cache_dtype == "fp8_e4m3":   # the values an fp8 cache gives back
                k = (quantize_fp8(k, k_scale).float() * k_scale).to(k.dtype)
                v = (quantize_fp8(v, v_scale).float() * v_scale).to(v.dtype)
            if len(past) <= layer:
                past.append((k, v))
            else:
                past[layer] = (torch.cat([past[layer][0], k]), torch.cat([past[layer][1], v]))
            keys, values = past[layer]
            keys = keys.float().repeat_interleave(group, dim=1)
            values = values.float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * self.scale
            k_pos = torch.arange(keys.shape[0], device=dev)
            scores = scores.masked_fill(k_pos[None, None, :] > positions[None, :, None], float("-inf"))
            return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)

        hidden = self._run_layers(tokens, positions, attend)
        return self._logits(hidden[-1:])[0]

    # ---- shared body ------------------------------------------------------------------------------
    def _run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        cfg, w, d = self.cfg, self.w, self.cfg.head_dim
        x = w["embed"][tokens]
        cos, sin = self._rope(positions)
        for layer in range(cfg.num_layers):
            p = f"layers.{layer}."
            h = self._norm(x, w[p + "attn_norm"])
            q = (h @ w[p + "wq"]).view(-1, self.q_heads, d)
            k = (h @ w[p + "wk"]).view(-1, self.kv_heads, d)
            v = (h @ w[p + "wv"]).view(-1, self.kv_heads, d)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            out = attend(layer, q, k, v).reshape(-1, self.q_heads * d) @ w[p + "wo"]
            x = x + self._reduce(out)
            h = self._norm(x, w[p + "mlp_norm"])
            mlp = (torch.nn.functional.silu(h @ w[p + "w_gate"]) * (h @ w[p + "w_up"])) @ w[p + "w_down"]
            x = x + self._reduce(mlp)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self._norm(hidden, self.w["final_norm"]) @ self.w["lm_head"]).float()

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self._all_reduce is not None:
            self._all_reduce(partial)
        return partial

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)).to(x.dtype) * weight

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self._inv_freq[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
