// Cache writes and copies, dtype-agnostic (they move 16-byte vectors), and write_kv into an
// fp8 cache (quantizing).
//
// write_kv: scatter each new token's K and V ([num_heads, head_dim] each) into its slot of the
// paged cache; a negative slot (padding) is skipped, and so is a slot past the cache.
// copy_blocks: every copy-on-write pair of a step, every layer, in one launch over the
// block-major cache, where one block is one contiguous chunk of block_bytes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstring>
#include <type_traits>

#include "launch.h"
#include "pdl.cuh"

namespace kvpager {

constexpr int kWriteKVThreads = 128;
constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;   // 16-byte vectors in flight per thread

// Token t's cache slot as (block, row in the block); false for a slot outside the cache (a padding
// token's -1, or any id past the last block): that token is not written.
template <typename Idx>
__device__ __forceinline__ bool token_slot(const WriteKVArgs& a, int t, int64_t* blk, int* off) {
  const int64_t slot = static_cast<int64_t>(static_cast<const Idx*>(a.slot_mapping)[t]);
  const int64_t num_slots = static_cast<int64_t>(a.num_cache_blocks) * a.block_size;
  if (slot < 0 || slot >= num_slots) return false;
  *blk = slot / a.block_size;
  *off = static_cast<int>(slot - *blk * a.block_size);
  return true;
}

// grid: (num_tokens, ceil(num_heads * head_dim * elem_size / 16 / kWriteKVThreads));
// block: kWriteKVThreads threads; thread i moves vector i of the token's [num_heads, head_dim]
// K and V (consecutive threads, consecutive 16 bytes of one head's row: coalesced).
template <typename Idx>
__global__ void __launch_bounds__(kWriteKVThreads) write_kv_kernel(const WriteKVArgs a) {
#if KVPAGER_DECODE_PDL_AFTER_WRITE
  allow_dependent_launch();   // the decode kernel after it may start (pdl.cuh)
#endif
  const int t = blockIdx.x;
  int64_t blk;
  int off;
  if (!token_slot<Idx>(a, t, &blk, &off)) return;
  const int row_vecs = a.head_dim * a.elem_size / 16;
  const int total = a.num_heads * row_vecs;
  const int64_t es = a.elem_size;
  const char* key = static_cast<const char*>(a.key);
  const char* value = static_cast<const char*>(a.value);
  char* kc = static_cast<char*>(a.k_cache);
  char* vc = static_cast<char*>(a.v_cache);
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < total; i += gridDim.y * blockDim.x) {
    const int h = i / row_vecs, c = i - h * row_vecs;
    const int64_t in_byte = static_cast<int64_t>(c) * 16;
    const int64_t k_src = (static_cast<int64_t>(t) * a.key_stride_tok + h * a.key_stride_head) * es + in_byte;
    const int64_t v_src = (static_cast<int64_t>(t) * a.value_stride_tok + h * a.value_stride_head) * es + in_byte;
    const int64_t k_dst =
        (blk * a.k_stride_block + h * a.k_stride_head + static_cast<int64_t>(off) * a.head_dim) * es + in_byte;
    const int64_t v_dst =
        (blk * a.v_stride_block + h * a.v_stride_head + static_cast<int64_t>(off) * a.head_dim) * es + in_byte;
    const uint4 kv = *reinterpret_cast<const uint4*>(key + k_src);
    const uint4 vv = *reinterpret_cast<const uint4*>(value + v_src);
    *reinterpret_cast<uint4*>(kc + k_dst) = kv;
    *reinterpret_cast<uint4*>(vc + v_dst) = vv;
  }
}

// Eight 16-bit values (one 16-byte vector) times inv_scale, to e4m3 with saturation (values
// beyond +-448 store as +-448, never NaN): eight bytes.
template <typename TIn>
__device__ __forceinline__ uint2 quantize8_e4m3(const uint4& u, float inv_scale) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  uint32_t out[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f;
    if constexpr (std::is_same_v<TIn, __half>) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      f = __half22float2(h);
    } else {
      f = make_float2(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xffff0000u));   // bf16
    }
    f.x *= inv_scale;
    f.y *= inv_scale;
    const uint32_t q = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);   // 2 bytes
    out[i / 2] |= q << (16 * (i % 2));
  }
  return make_uint2(out[0], out[1]);
}

// write_kv into an fp8 e4m3 cache from fp16 or bf16 K/V (TIn), quantizing with 1 / scale.
// grid: (num_tokens, ceil(num_heads * head_dim / 8 / kWriteKVThreads)); block: kWriteKVThreads;
// thread i converts eight elements (16 input bytes, 8 cache bytes) of the token's K and V.
template <typename Idx, typename TIn>
__global__ void __launch_bounds__(kWriteKVThreads) write_kv_fp8_kernel(const WriteKVArgs a) {
#if KVPAGER_DECODE_PDL_AFTER_WRITE
  allow_dependent_launch();   // the decode kernel after it may start (pdl.cuh)
#endif
  const int t = blockIdx.x;
  int64_t blk;
  int off;
  if (!token_slot<Idx>(a, t, &blk, &off)) return;
  const int row_chunks = a.head_dim / 8;
  const int total = a.num_heads * row_chunks;
  const TIn* key = static_cast<const TIn*>(a.key);
  const TIn* value = static_cast<const TIn*>(a.value);
  uint8_t* kc = static_cast<uint8_t*>(a.k_cache);
  uint8_t* vc = static_cast<uint8_t*>(a.v_cache);
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < total; i += gridDim.y * blockDim.x) {
    const int h = i / row_chunks, e = (i - h * row_chunks) * 8;
    const uint4 kv = *reinterpret_cast<const uint4*>(key + static_cast<int64_t>(t) * a.key_stride_tok +
                                                     h * a.key_stride_head + e);
    const uint4 vv = *reinterpret_cast<const uint4*>(value + static_cast<int64_t>(t) * a.value_stride_tok +
                                                     h * a.value_stride_head + e);
    const int64_t row = static_cast<int64_t>(off) * a.head_dim + e;
    *reinterpret_cast<uint2*>(kc + blk * a.k_stride_block + h * a.k_stride_head + row) =
        quantize8_e4m3<TIn>(kv, a.k_inv_scale);
    *reinterpret_cast<uint2*>(vc + blk * a.v_stride_block + h * a.v_stride_head + row) =
        quantize8_e4m3<TIn>(vv, a.v_inv_scale);
  }
}

// grid: (num_pairs, ceil(block_vecs / (kCopyThreads * kCopyUnroll))); block: kCopyThreads threads.
// Copies whole blocks between two block-major buffers, dst[dst_ids[i]] = src[src_ids[i]]: within
// one cache (copy_blocks: dst == src, pairs never chain) or across devices, where either side may
// be pinned host memory mapped into the device's address space (zero-copy swap: the SMs read or
// write host memory over PCIe, no staging buffer). Each thread issues kCopyUnroll 16-byte loads
// before any store, so each SM keeps many reads in flight. A pair with an id outside its buffer
// is skipped.
__global__ void __launch_bounds__(kCopyThreads)
copy_blocks_kernel(uint4* dst, int64_t num_dst_blocks, const uint4* src, int64_t num_src_blocks, int64_t block_vecs,
                   const int64_t* src_ids, const int64_t* dst_ids) {
  const int64_t p = blockIdx.x;
  const int64_t s = src_ids[p], d = dst_ids[p];
  if (s < 0 || s >= num_src_blocks || d < 0 || d >= num_dst_blocks) return;
  const uint4* from = src + s * block_vecs;
  uint4* to = dst + d * block_vecs;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * (kCopyThreads * kCopyUnroll) + threadIdx.x;
  uint4 buf[kCopyUnroll];
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t i = base + u * kCopyThreads;
    if (i < block_vecs) buf[u] = __ldcs(from + i);
  }
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t i = base + u * kCopyThreads;
    if (i < block_vecs) __stcs(to + i, buf[u]);
  }
}

}  // namespace kvpager
