// A split query: 16-bit queries for the fp8 prefill kernel's e4m3 S GEMMs (paged_prefill_ws.cuh,
// ws_raw_k), split ahead of it by the op that writes them (layer_ops.cu, rope with a split output)
// instead of by the kernel's consumers, where the split took issue slots from the other warpgroup
// (docs/performance.md, "A query split before the kernel").
//
// Each row (a token's head: head_dim D values q, bf16 or fp16) becomes two e4m3 terms per value and
// one float:
//   f    = clamp(7 - floor(log2(max |q|)), -126, 126)   (0 for an all-zero row: f = 7)
//   hi   = e4m3(fp16(q 2^f))                             (round to nearest even)
//   lo   = e4m3(fp16(q 2^f) - fp16(hi))                  (the difference exact in fp16)
//   down = 2^-f                                          (the row's scores are scaled back by it)
// For bf16 queries hi + lo holds q 2^f exactly but for values under 2^-9 of the row's largest, which
// are off by at most 2^-17 of it (half e4m3's subnormal step, 2^-9). fp16 queries have 11
// significant bits, two terms 8: lo is rounded, and hi + lo is within 2^-9 of each value (besides
// the same 2^-17 of the row's largest), the bound of rounding to bf16 (docs/performance.md, "fp16
// queries over fp8 caches split too"). `down` goes to a float32 tensor [kv_heads, tokens, G]
// (PrefillArgs::query_down).
// The row's 2 D bytes (the size of its 16-bit values) hold 16-byte chunks, one per (k-step kk of 32
// columns, quad lane t4): chunk split_query_chunk(kk, t4) holds, with c = 32 kk + 4 t4,
//   hi[c .. c + 3], hi[c + 16 .. c + 19], lo[c .. c + 3], lo[c + 16 .. c + 19]
// which is what lane t4 of a consumer warp puts in its S GEMMs' A fragments for one row: one
// 16-byte shared-memory load. The chunks are placed so that the 8 lanes of a load phase (two rows,
// four t4) fall in 8 distinct bank groups of the kernel's swizzled Q tile (tile_off).
// kvpager.kernels.split_query.split_query_reference computes the same bytes in torch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "fp8_convert.cuh"
#include "pair_of.cuh"

namespace kvpager {

// The 16-byte chunk of a split row holding k-step kk's columns for quad lane t4 (see above).
__host__ __device__ constexpr int split_query_chunk(int kk, int t4) { return (kk >> 1) * 8 + 2 * t4 + (kk & 1); }

// f of a row whose largest |q|, as a 16-bit bit pattern of T without the sign, is max_abs_bits.
// (Non-negative bf16 and fp16 patterns order as their values do, so a row's largest is an unsigned
// maximum of patterns.)
template <typename T>
__device__ __forceinline__ int split_query_exponent(uint32_t max_abs_bits) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "16-bit queries");
  int ex = 0;   // floor(log2): of a bf16 pattern its exponent field; of fp16 through float (subnormals)
  if (max_abs_bits != 0) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      ex = static_cast<int>(max_abs_bits >> 7) - 127;
    else   // (through float: exact for subnormals too)
      ex = static_cast<int>(__float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(max_abs_bits))))
                            >> 23) - 127;
  }
  return min(max(7 - ex, -126), 126);
}

// 2^e as a float (-126 <= e <= 127).
__device__ __forceinline__ float split_query_pow2(int e) { return __uint_as_float(static_cast<uint32_t>(127 + e) << 23); }

// A word's two T values (the low one first) times `up` (2^f) as fp16 (exact: at most 11
// significant bits, the largest under 2^8; what falls under fp16's normal range is far below
// e4m3's subnormal step), then the two e4m3 terms of each: hi rounded, lo = e4m3(value - hi) (the
// difference exact in fp16; lo exact for bf16's 8 bits, rounded for fp16's 11). hi and lo: two
// bytes each, the low value's first.
template <typename T>
__device__ __forceinline__ void split_query_pair(uint32_t v, float up, uint32_t& hi, uint32_t& lo) {
  const float2 x = PairOf<T>::unpack(v);
  const __half2 q = __floats2half2_rn(x.x * up, x.y * up);
  const __nv_fp8x2_storage_t q8 = __nv_cvt_halfraw2_to_fp8x2(static_cast<__half2_raw>(q), __NV_SATFINITE, __NV_E4M3);
  const uint32_t back = fp8x2_to_h2(q8);   // hi as fp16 (exact)
  hi = q8;
  lo = __nv_cvt_halfraw2_to_fp8x2(static_cast<__half2_raw>(__hsub2(q, *reinterpret_cast<const __half2*>(&back))),
                                  __NV_SATFINITE, __NV_E4M3);
}

}  // namespace kvpager
