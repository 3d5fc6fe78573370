"""Pure-torch reference kernels over the paged KV cache.

These are the oracle that the CUDA kernels must match, and what runs where there is no GPU.
They are device-agnostic (CPU or CUDA tensors), take fp32/fp16/bf16 inputs, and do the
softmax and its accumulation in float32 (float64 inputs stay float64).

Cache layout (fixed by the project, see ``kvpager.worker.kv_cache``). A worker's whole cache is
one block-major tensor::

    kv_cache  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]

with K at index 0 and V at index 1 of dim 2, so one block's data for every layer is one
contiguous chunk: copy and swap move one chunk per block. Attention reads one layer through
the views::

    k_cache = kv_cache[:, layer, 0]  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache = kv_cache[:, layer, 1]  # same shape

which are NOT contiguous (the block stride is num_layers * 2 * num_kv_heads * block_size *
head_dim); every function here accepts such views and writes through them in place.
A token's slot is ``block_id * block_size + offset``. Sequence i's tokens live in the blocks
``block_tables[i, 0], block_tables[i, 1], ...``, in order; table entries past its context are
padding and never dereferenced, nor is any slot past its context read into a result.
"""

from __future__ import annotations

import torch

from kvpager.numeric import ceil_div

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks", "swap_blocks",
           "FP8", "FP8_MAX", "quantize_fp8"]

# fp8 KV storage: a float8_e4m3fn cache holds K / k_scale and V / v_scale (per-tensor scales),
# saturated to the format's largest finite value; readers multiply the scale back in.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float8_e4m3fn, saturated to +-448 (round to nearest even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new K/V into their slots, in place. A negative slot is padding and is skipped;
    two tokens mapped to the same slot leave either one (the manager never plans that).

    key, value:       [num_tokens, num_kv_heads, head_dim], the cache's dtype (any float dtype
                      for a float8_e4m3fn cache, which stores them quantized with k_scale, v_scale)
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] (views allowed)
    slot_mapping:     [num_tokens] int64 (any integer dtype)
    """
    _check_caches(k_cache, v_cache)
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[1:] != (k_cache.shape[1], k_cache.shape[3]):
        raise ValueError(f"key/value heads and head_dim {tuple(key.shape[1:])} do not match the cache's "
                         f"{(k_cache.shape[1], k_cache.shape[3])}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    _check_scales(k_cache, k_scale, v_scale)
    if k_cache.dtype == FP8:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} != cache dtype {k_cache.dtype}")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // k_cache.shape[2], slots % k_cache.shape[2]
    # Indices on dims 0 and 2 around a slice: the indexed result is [n, num_kv_heads, head_dim].
    k_cache[blocks, :, offsets] = key[keep]
    v_cache[blocks, :, offsets] = value[keep]


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One new token per sequence attending to all of its cached tokens (its own included).

    query:            [num_seqs, num_q_heads, head_dim]
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] (views allowed)
    block_tables:     [num_seqs, max_blocks] int32, padded rows (entries within a context: block
                      ids, as in ``paged_prefill_attention``)
    context_lens:     [num_seqs] int32, ragged, each >= 1
    returns           [num_seqs, num_q_heads, head_dim] in query's dtype

    GQA: q head h reads kv head h // (num_q_heads // num_kv_heads). A float8_e4m3fn cache is
    read as stored * k_scale (K) and * v_scale (V), with a query of any float dtype.
    """
    if query.shape[:1] != context_lens.shape[:1]:
        raise ValueError(f"query {tuple(query.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"disagree on num_seqs")
    # Decode is prefill with one query per sequence.
    starts = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens, starts, scale,
                                   k_scale, v_scale)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cache, a cached prefix
    included. The new tokens' K/V must already be in the cache (``write_kv``).

    query:            [total_query_tokens, num_q_heads, head_dim], sequence after sequence
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] (views allowed)
    block_tables:     [num_seqs, max_blocks] int32, padded rows; an entry within a context that is
                      not a block id (negative or >= num_blocks) is refused with ValueError (the
                      CUDA kernels never dereference one: decode leaves its tokens out, prefill
                      reads them as zeros)
    context_lens:     [num_seqs] int32: tokens in cache after the write, the new ones included
    query_start_loc:  [num_seqs + 1] int32 CSR offsets; sequence i's queries are
                      query[query_start_loc[i]:query_start_loc[i + 1]]
    returns           [total_query_tokens, num_q_heads, head_dim] in query's dtype

    Query j of sequence i (query_len q_i, context c_i) sits at position c_i - q_i + j and sees
    the cache positions <= its own. GQA and fp8 caches as in ``paged_decode_attention``.

    Sequences are padded to the longest query and context of the batch (a reference, not a
    fast path): memory is O(num_seqs * num_q_heads * max_query_len * max_context_len).
    """
    num_tokens, num_q_heads, head_dim, num_seqs = _check_prefill(query, k_cache, v_cache, block_tables, context_lens,
                                                                 query_start_loc, k_scale, v_scale)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    dev = query.device
    starts = query_start_loc.to(dev, torch.int64)
    ctx = context_lens.to(dev, torch.int64)
    q_lens = starts[1:] - starts[:-1]

    # One host sync for every data-dependent check and size.
    entries = block_tables.to(dev, torch.int64)
    within = torch.arange(entries.shape[1], device=dev) * block_size < ctx[:, None]    # entries a context covers
    not_ids = (within & ((entries < 0) | (entries >= k_cache.shape[0]))).sum()
    first, last, max_ctx, max_q, min_q, too_long, bad_entries = torch.stack(
        [starts[0], starts[-1], ctx.max(), q_lens.max(), q_lens.min(), (q_lens > ctx).sum(), not_ids]).tolist()
    _check_lengths(first, last, min_q, too_long > 0, max_ctx, num_tokens, block_tables.shape[1] * block_size)
    if bad_entries:
        raise ValueError(f"{bad_entries} block_tables entries within their sequences' contexts are not block ids "
                         f"(negative or >= {k_cache.shape[0]}): a context's every block must be in its table")
    if num_tokens == 0:
        return out

    # Gather each sequence's K/V: [num_seqs, num_kv_heads, max_ctx_pad, head_dim].
    n_blocks = ceil_div(max_ctx, block_size)
    tables = entries[:, :n_blocks]                                                   # [S, n_blocks]
    tables = torch.where(within[:, :n_blocks], tables, torch.zeros_like(tables))  # padding entries never dereferenced
    acc = torch.promote_types(query.dtype, torch.float32)
    k_pos = torch.arange(n_blocks * block_size, device=dev)                          # [P]
    in_ctx = k_pos < ctx[:, None]                                                    # [S, P]

    def gather(cache: torch.Tensor, cache_scale: float) -> torch.Tensor:
        x = cache[tables]                              # [S, n_blocks, Hkv, B, D]
        x = x.transpose(1, 2).reshape(num_seqs, num_kv_heads, -1, head_dim).to(acc)   # [S, Hkv, P, D]
        if cache.dtype == FP8:
            x = x * cache_scale
        # Zero slots past the context, so stale NaN/inf there cannot leak in through 0 * x.
        return torch.where(in_ctx[:, None, :, None], x, torch.zeros((), dtype=acc, device=dev))

    keys, values = gather(k_cache, k_scale), gather(v_cache, v_scale)

    # Pad queries to [S, max_q, Hkv, group, D]; token t is query j of sequence seq[t].
    group = num_q_heads // num_kv_heads
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=dev), q_lens, output_size=num_tokens)  # [T]
    j = torch.arange(num_tokens, device=dev) - starts[seq]                                           # [T]
    q = torch.zeros(num_seqs, max_q, num_q_heads, head_dim, dtype=acc, device=dev)
    q[seq, j] = query.to(acc)
    q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim)

    q_pos = ctx[:, None] - q_lens[:, None] + torch.arange(max_q, device=dev)     # [S, max_q]
    visible = (k_pos <= q_pos[:, :, None]) & in_ctx[:, None, :]                  # [S, max_q, P]
    # Every real query sees at least its own token; padding rows (discarded) see the whole context.
    scores = torch.einsum("sqhgd,shpd->shgqp", q, keys) * scale                  # [S, Hkv, G, max_q, P]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    res = torch.einsum("shgqp,shpd->sqhgd", probs, values)                       # [S, max_q, Hkv, G, D]
    out.copy_(res.reshape(num_seqs, max_q, num_q_heads, head_dim)[seq, j])
    return out


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (every layer, K and V) within one block-major cache, in place:
    ``kv_cache[dst[i]] = kv_cache[src[i]]``.

    kv_cache: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
    src, dst: [num_pairs] int64 block ids, on any device

    Pairs must not chain: no dst is also a src in the same call, and no dst repeats (the
    manager guarantees both). Here the sources happen to be gathered before any write, but a
    kernel that copies pair by pair may not, so callers must not rely on an order.
    """
    _check_pairs(src, dst)
    if src.numel() == 0:
        return
    dev = kv_cache.device
    kv_cache = _as_bytes(kv_cache)
    kv_cache.index_copy_(0, dst.to(dev, torch.int64), kv_cache.index_select(0, src.to(dev, torch.int64)))


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move whole blocks between two block-major caches, e.g. the GPU cache and the CPU swap
    space: ``dst_cache[dst[i]] = src_cache[src[i]]``.

    src_cache: [num_src_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
    dst_cache: [num_dst_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], same dtype
    src, dst:  [num_pairs] int64 block ids, on any device

    The blocks are gathered into one contiguous tensor, moved across devices in one copy (not
    one per block), then scattered. When the host side is pinned, the copy is non_blocking:
    host-to-device stays ordered on the current stream before the scatter; device-to-host
    waits for that stream before the host reads the staging buffer.
    """
    _check_pairs(src, dst)
    if src_cache.shape[1:] != dst_cache.shape[1:] or src_cache.dtype != dst_cache.dtype:
        raise ValueError(f"caches differ beyond num_blocks: {tuple(src_cache.shape)} {src_cache.dtype} vs "
                         f"{tuple(dst_cache.shape)} {dst_cache.dtype}")
    if src.numel() == 0:
        return
    src_cache, dst_cache = _as_bytes(src_cache), _as_bytes(dst_cache)
    src_ids = src.to(src_cache.device, torch.int64)
    dst_ids = dst.to(dst_cache.device, torch.int64)
    if src_cache.device == dst_cache.device:
        dst_cache.index_copy_(0, dst_ids, src_cache.index_select(0, src_ids))
        return
    shape = (src.numel(), *src_cache.shape[1:])
    if src_cache.device.type == "cpu":                      # host -> device (swap-in)
        pinned = src_cache.is_pinned()
        staging = torch.empty(shape, dtype=src_cache.dtype, pin_memory=pinned)
        torch.index_select(src_cache, 0, src_ids, out=staging)
        # The caching host allocator keeps the pinned staging alive until the copy is done.
        dst_cache.index_copy_(0, dst_ids, staging.to(dst_cache.device, non_blocking=pinned))
    elif dst_cache.device.type == "cpu":                    # device -> host (swap-out)
        pinned = dst_cache.is_pinned()
        staging = torch.empty(shape, dtype=dst_cache.dtype, pin_memory=pinned)
        staging.copy_(src_cache.index_select(0, src_ids), non_blocking=pinned)
        if pinned:
            torch.cuda.current_stream(src_cache.device).synchronize()   # before the host reads it
        dst_cache.index_copy_(0, dst_ids, staging)
    else:                                                   # device -> another device
        dst_cache.index_copy_(0, dst_ids, src_cache.index_select(0, src_ids).to(dst_cache.device))


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, num_kv_heads, block_size, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError(f"k_cache is {k_cache.dtype} on {k_cache.device}, v_cache {v_cache.dtype} on {v_cache.device}")


def _check_tables(block_tables, context_lens, query_start_loc) -> int:
    """The number of sequences of a prefill's tables and lengths, checked to agree."""
    num_seqs = context_lens.shape[0]
    if context_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must be [num_seqs, max_blocks] and [num_seqs]")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    return num_seqs


def _check_prefill(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scale,
                   v_scale) -> tuple[int, int, int, int]:
    """Shapes and dtypes of a prefill call: (num_tokens, num_q_heads, head_dim, num_seqs)."""
    _check_caches(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = _check_query(query, k_cache)
    _check_scales(k_cache, k_scale, v_scale)
    num_seqs = _check_tables(block_tables, context_lens, query_start_loc)
    return num_tokens, num_q_heads, head_dim, num_seqs


def _check_lengths(first_start: int, last_start: int, min_query: int, too_many_queries: bool, max_context: int,
                   num_tokens: int, table_tokens: int) -> None:
    """The data-dependent checks of a prefill call, on host values."""
    if first_start != 0 or last_start != num_tokens or min_query < 0:
        raise ValueError(f"query_start_loc must rise from 0 to {num_tokens}")
    if too_many_queries:
        raise ValueError("a sequence has more queries than context tokens")
    if max_context > table_tokens:
        raise ValueError(f"context of {max_context} tokens exceeds the {table_tokens} tokens of block_tables")


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as uint8 (same memory): torch has no index_copy_ for float8 on the CPU, and
    moving blocks needs no arithmetic."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def _check_scales(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    if not (0 < k_scale < float("inf") and 0 < v_scale < float("inf")):
        raise ValueError(f"k_scale and v_scale must be finite and > 0, got {k_scale} and {v_scale}")
    if k_cache.dtype != FP8 and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError("k_scale and v_scale apply to float8_e4m3fn caches only")


def _check_query(query: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads (GQA)")
    if query.dtype != k_cache.dtype and not (k_cache.dtype == FP8 and query.dtype.is_floating_point
                                             and query.dtype != FP8):
        raise ValueError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype}")
    if query.device != k_cache.device:
        raise ValueError(f"query on {query.device} but cache on {k_cache.device}")
    return num_tokens, num_q_heads, head_dim


def _check_pairs(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dim() != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be [num_pairs], got {tuple(src.shape)} and {tuple(dst.shape)}")
