// Paged prefill attention on tensor cores (FlashAttention-2 style, mma.sync m16n8k16): the new
// tokens of every sequence of a ragged batch attend, causally, over their whole context (cached
// prefix + themselves) read straight from the paged cache through the block table. No gather.
//
// One thread block per (work item, KV head); a work item is a tile of BM = 16 * WARPS query
// "rows" of one sequence, where the rows of a sequence are its (token, head of the GQA group)
// pairs, token-major: row r is token r / G, query head kv_head * G + r % G. So a K/V tile loaded
// into shared memory serves the whole GQA group at once (G x fewer K/V bytes than one block per
// query head), and any G works (rows past q_len * G are padding, never written).
//
// Per block: Q tile [BM, D] -> shared -> registers (A fragments, once); then for each K/V tile of
// BN = 64 positions from 0 up to the last position the tile's last token sees:
//   S = Q K^T (fp32 accumulators, scaled into the log2 domain), causal mask only on tiles that
//   reach past the first token's position (bottom-right causal: token j of a q-token chunk over
//   c positions sits at c - q + j), online softmax in fp32 (running max m, sum l per row),
//   P (rounded to the input type, straight from the accumulator registers) times V into fp32
//   output accumulators.
// Each warp owns 16 rows. K and V tiles come from the pages by cp.async (16 bytes a lane; rows
// of a tile are D contiguous elements of one block slot, so a tile is BN / block_size slabs),
// into XOR-swizzled shared memory (conflict-free ldmatrix). Loads overlap compute as in FA2:
// V_j is fetched while S_j is computed, K_{j+1} while P_j V_j is. fp8 e4m3 caches are
// dequantized as tiles load (16 fp8 values -> 16 halves/bf16s into shared memory; the
// per-tensor k_scale goes into the softmax scale, v_scale into the output).
//
// Positions at or past the context, and block-table entries that are not valid block ids, are
// never dereferenced: their shared-memory rows are zero-filled (their scores are masked anyway).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch.h"

namespace kvpager {
namespace prefill_detail {

constexpr int kBN = 64;   // K/V positions per tile

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  // Two fp8 e4m3 values (low byte first) -> two bf16, exactly.
  static __device__ __forceinline__ uint32_t from_fp8x2(uint16_t w) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3);
    __half2 hh;
    memcpy(&hh, &h, sizeof(hh));
    const float2 f = __half22float2(hh);
    return pack(f.x, f.y);
  }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ uint32_t from_fp8x2(uint16_t w) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3);
    uint32_t r;
    memcpy(&r, &h, sizeof(r));
    return r;
  }
};

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows, D] tile of 16-bit elements,
// XOR-swizzled over groups of 8 chunks: the 8 rows an ldmatrix reads at one logical chunk hit 8
// different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }

}  // namespace prefill_detail

template <int D, int WARPS>
constexpr int prefill_smem_bytes() {
  return (16 * WARPS + 2 * prefill_detail::kBN) * D * 2;
}

// grid: num_items * num_kv_heads blocks, block b = (item b / num_kv_heads, KV head b % num_kv_heads)
// (item-major, so the heaviest items, listed first, start first); block: 32 * WARPS threads;
// dynamic smem: prefill_smem_bytes<D, WARPS>(). T: query/output type (fp16/bf16); C: cache type
// (T, or fp8 e4m3).
template <typename T, typename C, int D, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 4 ? 2 : 1)
paged_prefill_kernel(const PrefillArgs a) {
  using namespace prefill_detail;
  using M = Mma<T>;
  constexpr int BM = 16 * WARPS, BN = kBN, NT = WARPS * 32;
  constexpr int CPR = D / 8;                            // 16-byte chunks of T per row
  constexpr bool kFp8 = sizeof(C) == 1;
  constexpr int CCPR = kFp8 ? D / 16 : CPR;             // 16-byte chunks of C per cache row
  constexpr int RPT = BN * CCPR / NT;                   // cache rows (of a tile) per thread
  constexpr int ROW_STEP = NT / CCPR;
  static_assert(BN * CCPR % NT == 0 && NT % CCPR == 0, "tile loads must split evenly");
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * D;
  T* sV = sK + BN * D;

  const int item = blockIdx.x / a.num_kv_heads, kvh = blockIdx.x % a.num_kv_heads;
  const int seq = a.work[2 * item], tile = a.work[2 * item + 1];
  const int G = a.num_q_heads / a.num_kv_heads;
  const int q_start = a.query_start_loc[seq];
  const int q_len = a.query_start_loc[seq + 1] - q_start;
  const int ctx = min(a.context_lens[seq], a.max_blocks_per_seq << a.log2_block_size);
  const int rows = q_len * G;
  const int row0 = tile * BM;
  if (q_len <= 0 || row0 >= rows) return;
  const int offset = ctx - q_len;                       // position of token 0
  const int t_first = row0 / G, t_last = (min(rows, row0 + BM) - 1) / G;
  const int kv_end = max(0, min(ctx, offset + t_last + 1));   // positions [0, kv_end) are read
  const int n_tiles = (kv_end + BN - 1) / BN;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  // ---- Q tile -> shared (cp.async) ----
  for (int idx = tid; idx < BM * CPR; idx += NT) {
    const int r = idx / CPR, ch = idx % CPR;
    const int gr = row0 + r;
    const bool valid = gr < rows;
    const int token = valid ? gr / G : 0, h = kvh * G + (valid ? gr % G : 0);
    const T* src = static_cast<const T*>(a.query) + static_cast<int64_t>(q_start + token) * a.q_stride_tok +
                   static_cast<int64_t>(h) * a.q_stride_head + ch * 8;
    cp_async16(smem_addr(sQ + swz<D>(r, ch)), src, valid);
  }

  // ---- K/V tile loads from the pages ----
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.table_stride;
  const C* kbase = static_cast<const C*>(a.k_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head;
  const C* vbase = static_cast<const C*>(a.v_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head;
  const int my_ch = tid % CCPR, my_row = tid / CCPR;
  int64_t off[RPT];       // element offsets of this thread's rows in the current tile; -1: zero-fill
  auto locate = [&](int kv0) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int pos = kv0 + my_row + i * ROW_STEP;
      int64_t o = -1;
      if (pos < kv_end) {
        const int blk = __ldg(table + (pos >> a.log2_block_size));
        if (blk >= 0 && blk < a.num_cache_blocks)
          o = static_cast<int64_t>(blk) * a.kv_stride_block + (pos & (a.block_size - 1)) * D;
      }
      off[i] = o;
    }
  };
  auto load_tile = [&](T* dst, const C* base) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = my_row + i * ROW_STEP;
      if constexpr (!kFp8) {
        const bool valid = off[i] >= 0;
        cp_async16(smem_addr(dst + swz<D>(r, my_ch)), base + (valid ? off[i] : 0) + my_ch * 8, valid);
      } else {
        // 16 fp8 values -> two 16-byte chunks of T (chunks 2 * my_ch and 2 * my_ch + 1).
        uint4 u = make_uint4(0, 0, 0, 0);
        if (off[i] >= 0) u = __ldg(reinterpret_cast<const uint4*>(base + off[i] + my_ch * 16));
        uint4 lo, hi;
        lo.x = M::from_fp8x2(static_cast<uint16_t>(u.x)); lo.y = M::from_fp8x2(static_cast<uint16_t>(u.x >> 16));
        lo.z = M::from_fp8x2(static_cast<uint16_t>(u.y)); lo.w = M::from_fp8x2(static_cast<uint16_t>(u.y >> 16));
        hi.x = M::from_fp8x2(static_cast<uint16_t>(u.z)); hi.y = M::from_fp8x2(static_cast<uint16_t>(u.z >> 16));
        hi.z = M::from_fp8x2(static_cast<uint16_t>(u.w)); hi.w = M::from_fp8x2(static_cast<uint16_t>(u.w >> 16));
        *reinterpret_cast<uint4*>(dst + swz<D>(r, 2 * my_ch)) = lo;
        *reinterpret_cast<uint4*>(dst + swz<D>(r, 2 * my_ch + 1)) = hi;
      }
    }
  };

  if (n_tiles > 0) {
    locate(0);
    load_tile(sK, kbase);
  }
  cp_async_commit();

  // Row limits of this thread's two rows (g and g + 8 of the warp's 16): the last visible
  // position. Padding rows take the last token's limit (they are never written).
  const int r_a = row0 + warp * 16 + g, r_b = r_a + 8;
  const int lim_a = offset + min(r_a / G, q_len - 1), lim_b = offset + min(r_b / G, q_len - 1);
  const int first_pos = offset + t_first;   // the block's smallest limit: tiles ending at or before it need no mask

  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  const float sl2 = a.scale_log2;

  for (int j = 0; j < n_tiles; ++j) {
    const int kv0 = j * BN;
    cp_async_wait_all();
    __syncthreads();   // K_j (and Q) landed for everyone; everyone is done with V_{j-1}
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], smem_addr(sQ + swz<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4))));
    }
    load_tile(sV, vbase);   // same positions as K_j (off[] still holds them)
    cp_async_commit();

    // S = Q K_j^T
    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(sK + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1))));
        M::run(s[2 * np], qf[kk], b[0], b[1]);
        M::run(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }

    // Scale into the log2 domain; causal mask on the diagonal tiles only.
    const bool need_mask = kv0 + BN - 1 > first_pos;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[i][e] * sl2;
        if (need_mask) {
          const int pos = kv0 + i * 8 + 2 * t4 + (e & 1);
          if (pos > (e < 2 ? lim_a : lim_b)) x = -INFINITY;
        }
        s[i][e] = x;
      }
    }

    // Online softmax (fp32, log2 domain); rows are spread over the 4 lanes of a quad.
    float mx_a = m_a, mx_b = m_b;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      mx_a = fmaxf(mx_a, fmaxf(s[i][0], s[i][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[i][2], s[i][3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float use_a = mx_a == -INFINITY ? 0.f : mx_a, use_b = mx_b == -INFINITY ? 0.f : mx_b;
    const float alpha_a = fast_exp2(m_a - use_a), alpha_b = fast_exp2(m_b - use_b);
    m_a = mx_a;
    m_b = mx_b;
    float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      s[i][0] = fast_exp2(s[i][0] - use_a);
      s[i][1] = fast_exp2(s[i][1] - use_a);
      s[i][2] = fast_exp2(s[i][2] - use_b);
      s[i][3] = fast_exp2(s[i][3] - use_b);
      sum_a += s[i][0] + s[i][1];
      sum_b += s[i][2] + s[i][3];
    }
    l_a = l_a * alpha_a + sum_a;
    l_b = l_b * alpha_b + sum_b;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha_a;
      o[i][1] *= alpha_a;
      o[i][2] *= alpha_b;
      o[i][3] *= alpha_b;
    }
    // P as A fragments (the m16n8 accumulator layout of two n-tiles is the m16k16 A layout).
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = M::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = M::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = M::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = M::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }

    cp_async_wait_all();
    __syncthreads();   // V_j landed for everyone; everyone is done with K_j
    if (j + 1 < n_tiles) {
      locate(kv0 + BN);
      load_tile(sK, kbase);
    }
    cp_async_commit();

    // O += P V_j
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, smem_addr(sV + swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                   dp * 2 + (lane >> 4))));
        M::run(o[2 * dp], pa[kk], b[0], b[1]);
        M::run(o[2 * dp + 1], pa[kk], b[2], b[3]);
      }
    }
  }
  cp_async_wait_all();   // nothing may stay in flight into shared memory at exit

  // ---- normalize and write ----
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = l_a > 0.f ? a.v_scale / l_a : 0.f, inv_b = l_b > 0.f ? a.v_scale / l_b : 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int gr = half == 0 ? r_a : r_b;
    if (gr >= rows) continue;
    const float inv = half == 0 ? inv_a : inv_b;
    const int token = gr / G, h = kvh * G + gr % G;
    T* op = static_cast<T*>(a.out) + static_cast<int64_t>(q_start + token) * a.o_stride_tok +
            static_cast<int64_t>(h) * a.o_stride_head + 2 * t4;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(op + i * 8) = M::pack(o[i][2 * half] * inv, o[i][2 * half + 1] * inv);
  }
}

}  // namespace kvpager
