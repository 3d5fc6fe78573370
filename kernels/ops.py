"""The kernels the worker calls: our CUDA kernels for tensors on a CUDA device when the
extension builds, the torch reference everywhere else (and for what has no CUDA kernel yet:
prefill attention, which runs the reference's batched torch code on the GPU, and swaps).

Same signatures and semantics as ``kvpager.kernels.reference``.
"""

from __future__ import annotations

import torch

from . import reference


def _cuda(tensor: torch.Tensor):
    if tensor.device.type != "cuda":
        return None
    from . import cuda  # imported lazily: it needs no GPU to import, but builds on first use

    return cuda if cuda.available() else None


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    impl = _cuda(k_cache) or reference
    impl.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    impl = _cuda(query)
    if impl is None or not impl.supports_decode(query, k_cache):  # other head dims, block sizes: reference
        impl = reference
    return impl.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    return reference.paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens,
                                             query_start_loc, scale)


def copy_blocks(kv_cache, src, dst) -> None:
    impl = _cuda(kv_cache) if kv_cache.is_contiguous() else None
    (impl or reference).copy_blocks(kv_cache, src, dst)


def swap_blocks(src_cache, dst_cache, src, dst) -> None:
    reference.swap_blocks(src_cache, dst_cache, src, dst)


def backend(k_cache: torch.Tensor) -> str:
    """Which implementation runs decode attention over this (per-layer) cache: "cuda" or "reference"."""
    impl = _cuda(k_cache)
    return "cuda" if impl is not None and impl.supports_decode(k_cache, k_cache) else "reference"
