"""The decoder the workers run: a Hugging Face Llama-family model (Llama, Mistral, Qwen2, Qwen3;
``worker.hf_config``) loaded from a local checkpoint, or seeded random weights of the same
layout (``worker.checkpoint``), computed as transformers computes it: RMSNorm in float32 with
the weight applied after casting back, rotate-half RoPE from float32 inverse frequencies (llama3
scaling included) cast to the activations' dtype, GQA attention, SiLU-gated MLP. The elementwise
ops between the matmuls (residual add fused with the next RMSNorm, RoPE, SiLU * up) go through
``kernels.ops``: three CUDA kernels of ours per layer on a GPU, the same torch formulas elsewhere.

Its attention reads and writes the worker's paged KV cache (``forward_paged``, one
``kvpager.step.StepInput``); the same weights also run over a plain contiguous cache
(``forward_contiguous``: past keys and values concatenated per step), the oracle the paged path
must match token for token. Both share one per-layer body.

Tensor parallelism (Megatron style, over ``torch.distributed``): rank r of N keeps its heads'
rows of q/k/v (fused into one projection), its slice of gate/up (fused) and the matching
columns of o_proj and down_proj; the partial sums after attention and after the MLP are
all-reduced. The embedding and lm_head are split by vocabulary rows: each rank embeds the ids
in its range (the partial embeddings are all-reduced) and computes its slice of the logits,
which rank 0 gathers. Each rank reads only its slices of the checkpoint.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from kvpager.kernels import ops
from kvpager.kernels.reference import quantize_fp8
from kvpager.kernels.split_query import SplitQuery
from kvpager.step import StepInput

if TYPE_CHECKING:
    from kvpager.kernels.cuda import DecodePlan

from . import checkpoint
from .hf_config import PRESETS, ModelConfig, UnsupportedModel, preset
from .staging import StagingRing

__all__ = ["Decoder", "ModelConfig", "PRESETS", "UnsupportedModel", "preset"]

LayerCache = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor                   # [(q + 2 kv) local heads * head_dim, hidden]
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]      # [head_dim] (Qwen3)
    k_norm: Optional[torch.Tensor]
    o: torch.Tensor                     # [hidden, local q heads * head_dim]
    o_bias: Optional[torch.Tensor]      # added after the all-reduce
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor               # [2 * local intermediate, hidden]
    gate_up_bias: Optional[torch.Tensor]
    down: torch.Tensor                  # [hidden, local intermediate]
    down_bias: Optional[torch.Tensor]   # added after the all-reduce


def feed_tokens(tokens: torch.Tensor, rows: torch.Tensor, previous: torch.Tensor) -> None:
    """``tokens[i] = previous[rows[i]]`` where ``rows[i] >= 0``, in place, on the device: no host
    sync (the tokens of a step sent before the previous step's output came back)."""
    tokens.copy_(torch.where(rows >= 0, previous[rows.clamp(min=0)], tokens))


class Decoder:
    # Prefill over fp8 caches on Hopper: RoPE writes q split for the attention kernel
    # (ops.rope_split_query) instead of rotating it in place, where the step's plan takes it.
    # Measured on the H100 (docs/performance.md, "The split writer at RoPE's cost"): writing q
    # split takes 128 us for 16K tokens against 135 us for RoPE in place, and the kernel over it
    # saves what splitting q itself costs (32 x 512 prompts: 0.95x SDPA end to end, from 0.83x).
    # False: RoPE in place, the kernel splitting q (kept for A/B timing and tests).
    write_split_query = True

    def __init__(self, cfg: ModelConfig, rank: int = 0, tp_size: int = 1, device: torch.device | str = "cpu",
                 group: Optional["torch.distributed.ProcessGroup"] = None) -> None:
        """Rank ``rank`` of ``tp_size``'s shard of ``cfg``'s model on ``device``. With
        ``tp_size`` > 1, ``torch.distributed`` must be initialized; ``group`` (default: the
        default group) holds the ranks, group rank 0 receiving the logits."""
        cfg.check_tensor_parallel(tp_size)
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} outside a tensor-parallel group of {tp_size}")
        self.cfg = cfg
        self.rank, self.tp_size = rank, tp_size
        self.device = torch.device(device)
        self.q_heads = cfg.num_q_heads // tp_size
        self.kv_heads = cfg.num_kv_heads // tp_size
        self.scale = cfg.head_dim ** -0.5
        self._group = group
        self._dist = None
        self._planner: Optional[ops.DecodePlanner] = None
        self._planner_known = False
        self.staging = StagingRing(self.device)   # the steps' integer inputs go up through its pinned buffers
        if tp_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError(f"tensor-parallel rank {rank} of {tp_size}: torch.distributed is not initialized")
            self._dist = dist
            self._gather_dst = 0 if group is None else dist.get_global_rank(group, 0)
        self.vocab_start, _, self.vocab_rows = checkpoint.vocab_range(cfg.vocab_size, rank, tp_size)

        w = checkpoint.load_shard(cfg, rank, tp_size, self.device)
        self.embed = self._pad_vocab(w.pop("model.embed_tokens.weight"))
        self.lm_head = self.embed if cfg.tie_word_embeddings else self._pad_vocab(w.pop("lm_head.weight"))
        self.final_norm = w.pop("model.norm.weight")
        self.layers = [self._layer(w, f"model.layers.{i}.") for i in range(cfg.num_layers)]
        assert not w, f"tensors loaded but unused: {sorted(w)}"
        self._inv_freq = cfg.rope.inv_freq(cfg.head_dim).to(self.device)

    def _pad_vocab(self, rows: torch.Tensor) -> torch.Tensor:
        missing = self.vocab_rows - rows.shape[0]
        return rows if not missing else torch.cat([rows, rows.new_zeros(missing, rows.shape[1])])

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], p: str) -> _Layer:
        def fused(*names: str) -> Optional[torch.Tensor]:
            parts = [w.pop(p + n) for n in names if p + n in w]
            return torch.cat(parts) if parts else None

        return _Layer(attn_norm=w.pop(p + "input_layernorm.weight"),
                      qkv=fused("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                      qkv_bias=fused("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                      q_norm=w.pop(p + "self_attn.q_norm.weight", None),
                      k_norm=w.pop(p + "self_attn.k_norm.weight", None),
                      o=w.pop(p + "self_attn.o_proj.weight"), o_bias=w.pop(p + "self_attn.o_proj.bias", None),
                      mlp_norm=w.pop(p + "post_attention_layernorm.weight"),
                      gate_up=fused("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                      gate_up_bias=fused("mlp.gate_proj.bias", "mlp.up_proj.bias"),
                      down=w.pop(p + "mlp.down_proj.weight"), down_bias=w.pop(p + "mlp.down_proj.bias", None))

    # ---- the two ways to run ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward_paged(self, step: StepInput, layer_cache: LayerCache,
                      attention_timer: Optional[AbstractContextManager] = None,
                      previous_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Compute the step's tokens over the paged cache. Returns, on rank 0, the float32 logits
        ``[sequences with query_len > 0, vocab]`` of each such sequence's last token (in the
        step's order); None on the other ranks. ``layer_cache(l)`` gives layer l's K and V views.
        ``attention_timer``, if given, is entered around every layer's attention call (after
        the cache's wait for the plan and the K/V write, so neither counts as attention); a
        reusable context manager that must not make the host wait (``worker.metrics.Span``).
        ``previous_ids``: the previous greedy step's ids on the device, for the tokens that
        ``step.feedback_rows`` takes from them."""
        timer = attention_timer if attention_timer is not None else nullcontext()
        n = len(step.token_ids)
        # Two host-to-device copies: the int64 token data, the int32 tables and lengths.
        fed = [] if step.feedback_rows is None else [step.feedback_rows]
        longs = self.staging.upload([step.token_ids, step.positions, step.slot_mapping, *fed], np.int64)
        tokens, positions, slots = longs[:n], longs[n:2 * n], longs[2 * n:3 * n]
        if fed:
            feed_tokens(tokens, longs[3 * n:], previous_ids)
        num_seqs = step.num_seqs
        table_len = num_seqs * step.max_blocks
        computing = [i for i, q in enumerate(step.query_lens) if q] if 0 in step.query_lens else None
        if computing is None:
            query_lens, context_lens = step.query_lens, step.context_lens
        else:  # sequences that compute nothing (forked, swapped in) leave the batch
            query_lens = [step.query_lens[i] for i in computing]
            context_lens = [step.context_lens[i] for i in computing]
        starts = [0, *accumulate(query_lens)]
        # The step's decode plan, made once here (FlashInfer's plan/run split): a work list from
        # the host lengths of the rows that decode (all of a decode step's; the one-token rows of
        # a mixed step), uploaded with the other ints; every layer's attention runs it.
        planner = self.decode_planner(layer_cache)
        decoding = None if step.decode_only else [i for i, q in enumerate(query_lens) if q == 1]
        decode_lens = context_lens if decoding is None else [context_lens[i] for i in decoding]
        plan = [planner.plan(decode_lens)] if planner is not None and decode_lens else []
        rows = [] if computing is None else [computing]
        # The plan first, so it starts 16-byte aligned (the kernel reads its header as one 16-byte load).
        ints = self.staging.upload([*plan, step.block_tables, context_lens, starts, *rows], np.int32)
        at = len(plan[0]) if plan else 0
        tables = ints[at:at + table_len].view(num_seqs, step.max_blocks)
        if computing is not None:
            tables = tables.index_select(0, ints[len(ints) - len(computing):])
        at += table_len
        context = ints[at:at + len(context_lens)]
        at += len(context_lens)
        query_starts = ints[at:at + len(starts)]
        decode_plan = None
        if plan:
            decode_plan = planner.step_plan(ints[:len(plan[0])], len(decode_lens))
        if step.decode_only:
            return self.logits(self.decode_hidden(tokens, positions, slots, tables, context, layer_cache, timer,
                                                  decode_plan))
        k_scale, v_scale = self.cfg.cache_scales
        # The step's prefill plan, made once here too: our kernel or gather + SDPA groups, the
        # kernel's work list or the groups' block ids and masks, and the one-token rows bound to
        # the decode plan above; every layer's attention runs it without re-planning.
        prefill_plan = ops.plan_prefill(self._query_like(), layer_cache(0)[0], tables, context, query_starts,
                                        self.scale, host_lengths=(starts, context_lens), decode_plan=decode_plan)

        def attention(q, k_cache, v_cache):
            return ops.paged_prefill_run(prefill_plan, q, k_cache, v_cache, k_scale, v_scale)

        rope = None
        if prefill_plan.split_query and self.write_split_query:
            # 16-bit over an fp8 cache on Hopper: RoPE writes q split for the kernel (kernels/split_query.py),
            # into one buffer every layer reuses (each layer's attention reads it before the next writes).
            split = SplitQuery.empty(n, self.q_heads, self.cfg.head_dim, self.kv_heads, self.device,
                                     self.embed.dtype)

            def rope(q, k, cos, sin):   # (a mixed step's one-token rows rotated in place too, keep_rows)
                return ops.rope_split_query(q, k, cos, sin, self.kv_heads, out=split, keep=prefill_plan.keep_rows)

        hidden = self._run_layers(tokens, positions, self._paged_attend(layer_cache, slots, timer, attention), rope)
        return self.logits(hidden.index_select(0, query_starts[1:].long() - 1))

    def decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      tables: torch.Tensor, context: torch.Tensor, layer_cache: LayerCache,
                      attention_timer: Optional[AbstractContextManager] = None,
                      plan: Optional[DecodePlan] = None) -> torch.Tensor:
        """The last hidden states ``[B, hidden]`` (before the final norm) of a pure decode batch:
        one token per sequence, every input already on the device (``tables`` ``[B, width]``
        int32, ``context`` ``[B]`` int32). Reads nothing from the host and never syncs, so a
        CUDA graph can capture it (``worker.decode_graphs``); a row with context 0 and slot -1
        is padding (writes nothing, attends to nothing). ``logits`` turns the rows into logits.
        ``plan``: the step's decode plan (``decode_planner(...).step_plan`` of the work list
        planned from ``context``'s values, on the device), made once; every layer's attention
        runs it. None: a grid plan from the table's width, made here once for every layer (or
        the reference, where our kernel does not serve)."""
        k_scale, v_scale = self.cfg.cache_scales
        if plan is None:
            k_cache, v_cache = layer_cache(0)
            query_like = torch.empty(len(context), self.q_heads, self.cfg.head_dim, dtype=self.embed.dtype,
                                     device=self.device)
            grid = ops.plan_decode_grid(query_like, k_cache, v_cache, tables, context)

            def attention(q, k_cache, v_cache):
                return ops.paged_decode_grid_run(grid, q, k_cache, v_cache, tables, context, self.scale, k_scale,
                                                 v_scale)
        else:
            def attention(q, k_cache, v_cache):
                return ops.paged_decode_run(plan, q, k_cache, v_cache, tables, context, self.scale, k_scale, v_scale)

        timer = attention_timer if attention_timer is not None else nullcontext()
        return self._run_layers(tokens, positions, self._paged_attend(layer_cache, slots, timer, attention))

    def _query_like(self) -> torch.Tensor:
        """[0, local q heads, head_dim] of the activations' dtype and device: what planners read."""
        return torch.empty(0, self.q_heads, self.cfg.head_dim, dtype=self.embed.dtype, device=self.device)

    def decode_planner(self, layer_cache: LayerCache) -> Optional[ops.DecodePlanner]:
        """The planner of our CUDA decode kernel for this model over this cache (one per worker:
        the cache never changes), or None where attention runs the per-call path."""
        if not self._planner_known:
            k_cache, _ = layer_cache(0)
            self._planner = ops.decode_planner(self._query_like(), k_cache)
            self._planner_known = True
        return self._planner

    def _paged_attend(self, layer_cache: LayerCache, slots: torch.Tensor, timer: AbstractContextManager,
                      attention: Callable[..., torch.Tensor]):
        """A layer's attention over the paged cache: write the new K/V into their slots, then
        ``attention(q, k_cache, v_cache)`` (timed by ``timer``)."""
        k_scale, v_scale = self.cfg.cache_scales

        def attend(layer: int, q, k, v):
            k_cache, v_cache = layer_cache(layer)
            ops.write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
            with timer:
                return attention(q, k_cache, v_cache)
        return attend

    @torch.inference_mode()
    def forward_contiguous(self, token_ids: list[int], start_pos: int,
                           past: list[tuple[torch.Tensor, torch.Tensor]]) -> Optional[torch.Tensor]:
        """One sequence over a contiguous cache (the oracle; meant for tensor-parallel size 1):
        ``past[l]`` is layer l's (K, V), each ``[tokens, kv_heads, head_dim]``, extended in place
        of the list. Returns the float32 logits of the last token, ``[vocab]`` (None off rank 0)."""
        dev = self.device
        tokens = torch.tensor(token_ids, dtype=torch.long, device=dev)
        positions = torch.arange(start_pos, start_pos + len(token_ids), device=dev)
        group = self.q_heads // self.kv_heads
        fp8 = self.cfg.kv_cache_dtype == "fp8_e4m3"
        k_scale, v_scale = self.cfg.cache_scales

        def attend(layer: int, q, k, v):
            if fp8:   # the values an fp8 cache gives back
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
        logits = self.logits(hidden[-1:])
        return None if logits is None else logits[0]

    # ---- shared body ------------------------------------------------------------------------------
    def _run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, attend,
                    rope: Optional[Callable] = None) -> torch.Tensor:
        """The hidden states after the last layer. Each residual add is fused with the norm that
        follows it (``ops.add_rms_norm`` adds into ``x`` in place), so ``delta`` carries a
        sub-layer's output to the next norm, and the last one is added at the end. ``rope``: what
        rotates q and k for ``attend`` (default ``ops.rope``; a prefill step may have q written split)."""
        rotate = ops.rope if rope is None else rope
        d, hq, hkv, eps = self.cfg.head_dim, self.q_heads, self.kv_heads, self.cfg.rms_eps
        x = self._embed(tokens)
        cos, sin = self._rope(positions, x.dtype)
        delta: Optional[torch.Tensor] = None
        for index, layer in enumerate(self.layers):
            h = ops.add_rms_norm(x, delta, layer.attn_norm, eps)
            q, k, v = F.linear(h, layer.qkv, layer.qkv_bias).split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
            if layer.q_norm is not None:
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
            q, k = rotate(q, k, cos, sin)
            out = attend(index, q, k, v).reshape(-1, hq * d)
            delta = self._reduce(F.linear(out, layer.o), layer.o_bias)
            h = ops.add_rms_norm(x, delta, layer.mlp_norm, eps)
            gate_up = F.linear(h, layer.gate_up, layer.gate_up_bias)
            delta = self._reduce(F.linear(ops.silu_and_mul(gate_up), layer.down), layer.down_bias)
        return x if delta is None else x.add_(delta)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._dist is None:
            return F.embedding(tokens, self.embed)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill(outside[:, None], 0)
        self._dist.all_reduce(x, group=self._group)
        return x

    def logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Float32 logits ``[rows, vocab]`` of these last hidden states (the final norm, then
        lm_head; the whole vocabulary, gathered on rank 0); None on the other ranks. ``out``: a
        float32 ``[rows, vocab]`` tensor to write them into (single-rank models)."""
        local = F.linear(self._norm(hidden, self.final_norm), self.lm_head)
        if self._dist is None:
            return local.float() if out is None else out.copy_(local)
        if out is not None:
            raise ValueError("logits(out=...) serves single-rank models only")
        parts = [torch.empty_like(local) for _ in range(self.tp_size)] if self.rank == 0 else None
        self._dist.gather(local, parts, dst=self._gather_dst, group=self._group)
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=-1)[:, :self.cfg.vocab_size].float()

    def _reduce(self, partial: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self._dist is not None:
            self._dist.all_reduce(partial, group=self._group)
        return partial if bias is None else partial + bias

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.add_rms_norm(x, None, weight, self.cfg.rms_eps)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[tokens, head_dim]`` in the activations' dtype (once per step, shared
        by every layer)."""
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        scaling = self.cfg.rope.attention_scaling
        return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)
