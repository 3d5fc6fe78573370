// The warp-specialized prefill kernel's consumers (paged_prefill_ws.cuh) take their rows of each
// item's query into registers, as the A operands of the S GEMMs: bf16 queries over fp8 caches as
// fp16 scaled into its range (ws_query_to_half, for the fp16 S path) or split into two e4m3 terms
// (WsQuerySplit, for the e4m3 S path, ws_raw_k: bf16 and, by default, fp16 queries).
#pragma once

#include "prefill_ws_shared.cuh"
#include "split_query.cuh"

namespace kvpager {
namespace prefill_detail {
#if KVPAGER_PREFILL_WGMMA

// A warp's bf16 query fragments (the A operands of its S GEMMs) -> fp16, times 2^f with f putting
// the warp's largest |q| in [2^14, 2^15): under fp16's largest value, and every q within 2^28 of
// it exact (bf16 has 8 significant bits, fp16 11); smaller ones add under 2^-28 of the largest
// term to a score. Returns 2^-f, the factor the warp's scores are to be scaled back by (folded
// into the softmax scale). Every lane of the warp must call it; once per item.
template <int KS>
__device__ __forceinline__ float ws_query_to_half(uint32_t (&qa)[KS][4]) {
  float mx = 0.f;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      mx = fmaxf(mx, fmaxf(fabsf(__uint_as_float(qa[kk][e] << 16)), fabsf(__uint_as_float(qa[kk][e] & 0xffff0000u))));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const int e = mx > 0.f ? static_cast<int>((__float_as_uint(mx) >> 23) & 0xff) - 127 : 0;   // floor(log2 mx)
  const int f = min(max(14 - e, -126), 126);
  const float up = __uint_as_float(static_cast<uint32_t>(127 + f) << 23);
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int e2 = 0; e2 < 4; ++e2) {
      const uint32_t w = qa[kk][e2];
      const __half2 h = __floats2half2_rn(__uint_as_float(w << 16) * up, __uint_as_float(w & 0xffff0000u) * up);
      qa[kk][e2] = *reinterpret_cast<const uint32_t*>(&h);
    }
  return __uint_as_float(static_cast<uint32_t>(127 - f) << 23);
}

// 16-bit queries over fp8 caches (ws_raw_k): the query as the A operands of e4m3 S GEMMs (wgmma k32).
// Each q is split into two e4m3 terms, hi = e4m3(q 2^f) and lo = e4m3(q 2^f - hi): hi + lo carries
// 8 significant bits, all of a bf16 value's (where lo is not below e4m3's normal range), and an
// fp16 value's to within 2^-9 of it (split_query.cuh). f, one a row, puts the row's largest |q| in
// [2^7, 2^8) (e4m3 reaches 448); q under 2^-5 of it lose bits below 2^-17 of the largest (e4m3's
// subnormal step).
// A consumer warp splits its own 16 rows: load (the 16-bit values, in place in the fragment
// registers, and each row's f: one pass over the tile, a quad's 2 shuffles, as a row's values are
// its quad's), then split_step per k-step. By default (ws_q_ahead) the whole query is split under
// the previous item's last P V; with KVPAGER_PREFILL_WS_Q_AHEAD=0 as the item starts, each k-step
// between the item's first S GEMMs (issue_s_e4m3). (Split before the first GEMM it held up both
// warpgroups' GEMMs; split by the producer it slowed the producer more: docs/performance.md,
// "fp8 prefill: K as e4m3".)
// Fragment layout: qa[kk] and qa[D / 32 + kk] are k-step kk's hi and lo terms; each register holds 4
// consecutive columns of a row (the 8-bit A layout: lane g, t4 holds row g's and row g + 8's columns
// 4 t4 .. 4 t4 + 3 and 16 more). Before the split they hold the same 4 values in 16 bits, the first
// two in qa[kk], the last two in qa[D / 32 + kk].
template <typename T, int D>
struct WsQuerySplit {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "16-bit queries");
  static constexpr int KS = D / 32;   // k-steps of 32 columns

  // This warp's rows of the 16-bit Q tile at q_tile (tile_off layout) into qa, unsplit; returns 2^f
  // of rows g and g + 8 (`up`) and sets `down` to 2^-f, the factors their scores are to be scaled
  // back by (folded into the softmax scale).
  static __device__ __forceinline__ float2 load(uint32_t (&qa)[D / 16][4], uint32_t q_tile, int warp, int lane,
                                                float2& down) {
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = warp * 16 + g + (e & 1) * 8, col = kk * 32 + (e >> 1) * 16 + 4 * t4;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                     : "=r"(qa[kk][e]), "=r"(qa[KS + kk][e])
                     : "r"(q_tile + 2 * tile_off<kWsRows>(row, col >> 3) + 2 * (col & 7)));
      }
    // Each row's largest |q|: the bit patterns of non-negative 16-bit values order as their values do,
    // so 16-bit unsigned maxima of |q|'s patterns (row g's, then g + 8's in the high half), then
    // their exponents.
    uint32_t m[2] = {0u, 0u};
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        m[e & 1] = __vmaxu2(m[e & 1], __vmaxu2(qa[kk][e] & 0x7fff7fffu, qa[KS + kk][e] & 0x7fff7fffu));
    uint32_t mab = max(m[0] & 0xffffu, m[0] >> 16) | (max(m[1] & 0xffffu, m[1] >> 16) << 16);
    mab = __vmaxu2(mab, __shfl_xor_sync(0xffffffffu, mab, 1));
    mab = __vmaxu2(mab, __shfl_xor_sync(0xffffffffu, mab, 2));
    float up[2], dn[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int f = split_query_exponent<T>((mab >> (16 * r)) & 0xffffu);
      up[r] = split_query_pow2(f);
      dn[r] = split_query_pow2(-f);
    }
    down = make_float2(dn[0], dn[1]);
    return make_float2(up[0], up[1]);
  }

  // load, with this thread's rows' softmax scale (log2 domain) into sl2: scale_log2 times `down`.
  static __device__ __forceinline__ float2 load_scaled(uint32_t (&qa)[D / 16][4], uint32_t q_tile, int warp, int lane,
                                                       float scale_log2, float2& sl2) {
    float2 down;
    const float2 up = load(qa, q_tile, warp, lane, down);
    sl2 = make_float2(scale_log2 * down.x, scale_log2 * down.y);
    return up;
  }

  // k-step kk of qa split in place (load's layout -> the fragments').
  static __device__ __forceinline__ void split_step(uint32_t (&qa)[D / 16][4], int kk, float2 up) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float u = (e & 1) ? up.y : up.x;
      uint32_t h01, h23, l01, l23;
      split_query_pair<T>(qa[kk][e], u, h01, l01);
      split_query_pair<T>(qa[KS + kk][e], u, h23, l23);
      qa[kk][e] = h01 | (h23 << 16);
      qa[KS + kk][e] = l01 | (l23 << 16);
    }
  }

  // A query split before the kernel (split_query.cuh): this warp's rows of the Q tile at q_tile,
  // in the fragments' layout already, one 16-byte load per (k-step, row).
  static __device__ __forceinline__ void load_split(uint32_t (&qa)[D / 16][4], uint32_t q_tile, int warp, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(qa[kk][r]), "=r"(qa[kk][r + 2]), "=r"(qa[KS + kk][r]), "=r"(qa[KS + kk][r + 2])
                     : "r"(q_tile + 2 * tile_off<kWsRows>(warp * 16 + g + 8 * r, split_query_chunk(kk, t4))));
  }

  // A split query's `down` factors of this thread's rows (g and g + 8 of the warp), copied by the
  // producer with the Q tile (WsSmem::down; zeros for padding rows).
  static __device__ __forceinline__ float2 split_down(uint32_t down, int warp, int lane) {
    float2 dn;
    const uint32_t at = down + 4 * (warp * 16 + (lane >> 2));
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(dn.x) : "r"(at));
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(dn.y) : "r"(at + 32));
    return dn;
  }
};

#endif  // KVPAGER_PREFILL_WGMMA
}  // namespace prefill_detail
}  // namespace kvpager
