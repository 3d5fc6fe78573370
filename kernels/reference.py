"""Pure-torch reference kernels over the paged KV cache: the oracle for the CUDA kernels and
what runs where there is no GPU. Device-agnostic; softmax and accumulation in float32.

Cache layout (see ``kvpager.worker.kv_cache``): a worker's whole cache is block-major,
``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``; attention takes one
layer's views ``k_cache = cache[:, layer, 0]`` and ``v_cache = cache[:, layer, 1]``, each
``[num_blocks, num_kv_heads, block_size, head_dim]`` and not contiguous (any block stride).
A token's slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into their slots, in place; a negative slot is padding and skipped.

    key, value:       [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping:     [num_tokens] int64
    """
    _check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.shape[1:] != (k_cache.shape[1], k_cache.shape[3]):
        raise ValueError(f"key/value {tuple(key.shape)} do not fit a cache of {tuple(k_cache.shape)}")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value[keep].to(v_cache.dtype)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence over its block table (GQA, ragged lengths).

    query:        [num_seqs, num_q_heads, head_dim]
    block_tables: [num_seqs, max_blocks] int32 (entries past the context are never read)
    context_lens: [num_seqs] int32, each >= 1
    returns       [num_seqs, num_q_heads, head_dim] in query's dtype
    """
    starts = torch.arange(query.shape[0] + 1, device=query.device, dtype=torch.int32)
    return paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens, starts, scale)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cache (a cached prefix
    included); the new tokens' K/V must already be written.

    query:           [total_query_tokens, num_q_heads, head_dim], sequence after sequence
    query_start_loc: [num_seqs + 1] int32; sequence i's queries are rows [start[i], start[i+1])
    context_lens:    [num_seqs] int32: cached tokens after the write, the new ones included;
                     query j of sequence i sits at position context_len - query_len + j
    returns          [total_query_tokens, num_q_heads, head_dim] in query's dtype
    """
    _check_cache(k_cache, v_cache)
    num_q_heads, num_kv_heads = query.shape[1], k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {k_cache.shape[3]}")
    group, block_size = num_q_heads // num_kv_heads, k_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for i, ctx in enumerate(lens):
        q = query[starts[i]:starts[i + 1]].float()  # [q_len, Hq, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        num_blocks = -(-ctx // block_size)
        table = block_tables[i, :num_blocks].long()
        # [blocks, Hkv, B, D] -> [Hkv, ctx, D]
        keys = k_cache[table].transpose(0, 1).reshape(num_kv_heads, -1, k_cache.shape[3])[:, :ctx].float()
        values = v_cache[table].transpose(0, 1).reshape(num_kv_heads, -1, v_cache.shape[3])[:, :ctx].float()
        keys = keys.repeat_interleave(group, dim=0)      # [Hq, ctx, D]
        values = values.repeat_interleave(group, dim=0)
        scores = torch.einsum("qhd,hkd->hqk", q, keys) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        k_pos = torch.arange(ctx, device=query.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,hkd->qhd", scores.softmax(dim=-1), values).to(query.dtype)
    return out


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (all layers, K and V) within one block-major cache, in place.

    kv_cache: [num_blocks, ...]; src, dst: [num_pairs] int64. No dst may also be a src in the
    same call (the manager never plans such chains).
    """
    if src.shape != dst.shape:
        raise ValueError(f"{src.numel()} sources but {dst.numel()} destinations")
    if src.numel():
        kv_cache[dst.to(kv_cache.device)] = kv_cache[src.to(kv_cache.device)]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst_cache[dst[i]] = src_cache[src[i]]`` between two block-major caches (e.g. device and
    host): one gather, one copy across devices, one scatter, not one copy per block.
    """
    if src.shape != dst.shape:
        raise ValueError(f"{src.numel()} sources but {dst.numel()} destinations")
    if src_cache.shape[1:] != dst_cache.shape[1:] or src_cache.dtype != dst_cache.dtype:
        raise ValueError(f"caches differ: {tuple(src_cache.shape)} {src_cache.dtype} vs "
                         f"{tuple(dst_cache.shape)} {dst_cache.dtype}")
    if not src.numel():
        return
    gathered = src_cache[src.to(src_cache.device)]
    # Blocking: the scatter below reads the copied data at once. (The CUDA path overlaps.)
    dst_cache[dst.to(dst_cache.device)] = gathered.to(dst_cache.device)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v caches must be [num_blocks, num_kv_heads, block_size, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
