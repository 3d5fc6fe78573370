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

#include <type_traits>

#include "fp8_convert.cuh"
#include "launch.h"
#include "prefill_tensor_ops.cuh"

namespace kvpager {
namespace prefill_detail {

constexpr int kBN = 64;   // K/V positions per tile

}  // namespace prefill_detail

// Shared memory of one block: the Q tile [BM, D], one K tile and one V tile [kBN, D] (16-bit;
// an fp8 cache is dequantized into them), plus 1 KB to align the tiles to 1024 bytes.
template <int D, int WARPS>
constexpr int prefill_smem_bytes() {
  return (16 * WARPS + 2 * prefill_detail::kBN) * D * 2 + 1024;
}

// The wgmma version keeps kWgmmaStages K/V tiles of kWgmmaBN positions (loads run a tile ahead, and P_{j-1} V_{j-1} runs
// while S_j is computed).
constexpr int kWgmmaStages = 3;
constexpr int kWgmmaBN = 128;   // K/V positions per tile of the wgmma version
template <int D, int WARPS>
constexpr int prefill_wgmma_smem_bytes() {
  return (16 * WARPS + 2 * kWgmmaStages * kWgmmaBN) * D * 2 + 1024;
}

namespace prefill_detail {

// A work item's sequence and row tile with that sequence's lengths, as read from the work list
// and the length arrays (load_item): what a block needs to set up the item.
struct PrefillItem {
  int seq, tile, q_start, q_end, ctx;
};

__device__ __forceinline__ PrefillItem load_item(const PrefillArgs& a, int item) {
  PrefillItem it;
  it.seq = a.work[2 * item];
  it.tile = a.work[2 * item + 1];
  it.q_start = a.query_start_loc[it.seq];
  it.q_end = a.query_start_loc[it.seq + 1];
  it.ctx = min(a.context_lens[it.seq], a.max_blocks_per_seq << a.log2_block_size);
  return it;
}

// A thread's rows of an item's Q tile into the shared tile at `dst` (ROWS rows, tile_off layout),
// by cp.async, for NT threads copying it: rows my_row + i * RS (RS = NT / (D / 8), i < ROWS / RS),
// 16-byte chunk my_ch of each. Row r is token r / G, query head kvh * G + r % G: divided once,
// then each row steps token and head by constants (a division per row cost ~40 instructions).
// Padding rows are zero-filled, never read. Blk: PrefillBlock (its item, KV head and args).
template <typename T, int D, int ROWS, int NT, typename Blk>
__device__ __forceinline__ void load_q_rows(const Blk& blk, uint32_t dst, int my_row, int my_ch) {
  constexpr int RS = NT / (D / 8), RPT = ROWS / RS;
  static_assert(NT % (D / 8) == 0 && RS * RPT == ROWS, "the Q tile's rows split evenly over the threads");
  static_assert(RS % 8 == 0, "every row of a thread has the same swizzle (tile_off)");
  const PrefillArgs& a = blk.a;
  const int G = blk.G, step_head = RS % G;
  const int gr = blk.row0 + my_row;
  int head = gr % G;
  // Element steps of the source from one of this thread's rows to the next, and back a token's
  // worth of heads when the head index wraps past G.
  const int64_t step = static_cast<int64_t>(RS / G) * a.q_stride_tok + static_cast<int64_t>(step_head) * a.q_stride_head;
  const int64_t wrap = a.q_stride_tok - static_cast<int64_t>(G) * a.q_stride_head;
  const T* src = static_cast<const T*>(a.query) + static_cast<int64_t>(blk.q_start + gr / G) * a.q_stride_tok +
                 static_cast<int64_t>(blk.kvh * G + head) * a.q_stride_head + my_ch * 8;
  const uint32_t d0 = dst + 2 * tile_off<ROWS>(my_row, my_ch);
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const bool valid = gr + i * RS < blk.rows;   // past the last row: src is never read
    cp_async16(d0 + i * RS * 128, src, valid);
    src += step;
    head += step_head;
    if (head >= G) {
      head -= G;
      src += wrap;
    }
  }
}

// What one work item computes, and its Q and K/V tile loads from the pages: BM_ query rows, K/V
// tiles of BN_ positions, loaded by NT_ threads (loader thread indices 0..NT_ - 1).
template <typename T, typename C, int D, int BM_, int BN_, int NT_>
struct PrefillBlock {
  static constexpr int BM = BM_, BN = BN_, NT = NT_;
  static constexpr int CPR = D / 8;                      // 16-byte chunks of T per row
  static constexpr bool kFp8 = sizeof(C) == 1;
  static constexpr int CCPR = kFp8 ? D / 16 : CPR;       // 16-byte chunks of C per cache row
  static constexpr int RPT = BN * CCPR / NT;             // cache rows (of a tile) per thread
  static constexpr int ROW_STEP = NT / CCPR;
  static_assert(BN * CCPR % NT == 0 && NT % CCPR == 0, "tile loads must split evenly");
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");

  const PrefillArgs& a;
  T* sQ;
  T* sK;
  T* sV;
  int kvh, G, q_start, q_len, rows, row0, offset, t_first, kv_end, n_tiles;
  bool live;
  const int32_t* table;
  const C* kbase;
  const C* vbase;
  int loader, my_ch, my_row;
  int bid[RPT];   // block ids of this thread's rows of the located tile; -1: zero-fill

  // index: (work item, KV head) pair index, item-major (index / num_kv_heads is the item);
  // loader_thread: this thread's index among the NT loading threads.
  __device__ __forceinline__ PrefillBlock(const PrefillArgs& args, unsigned char* smem_raw, int index, int loader_thread)
      : PrefillBlock(args, smem_raw, load_item(args, index / args.num_kv_heads), index % args.num_kv_heads,
                     loader_thread) {}

  // The item `it` (load_item's) for KV head kv_head.
  __device__ __forceinline__ PrefillBlock(const PrefillArgs& args, unsigned char* smem_raw, const PrefillItem& it,
                                          int kv_head, int loader_thread)
      : a(args), kvh(kv_head), loader(loader_thread) {
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
    sQ = reinterpret_cast<T*>(base);
    sK = sQ + BM * D;
    sV = sK + BN * D;
    const int seq = it.seq, ctx = it.ctx;
    G = a.num_q_heads / a.num_kv_heads;
    q_start = it.q_start;
    q_len = it.q_end - q_start;
    rows = q_len * G;
    row0 = it.tile * BM;
    live = q_len > 0 && row0 < rows;
    offset = ctx - q_len;                                  // position of token 0
    t_first = row0 / G;
    const int t_last = (min(rows, row0 + BM) - 1) / G;
    kv_end = live ? max(0, min(ctx, offset + t_last + 1)) : 0;   // positions [0, kv_end) are read
    n_tiles = (kv_end + BN - 1) / BN;
    table = a.block_tables + static_cast<int64_t>(seq) * a.table_stride;
    kbase = static_cast<const C*>(a.k_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head;
    vbase = static_cast<const C*>(a.v_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head;
    my_ch = loader % CCPR;
    my_row = loader / CCPR;
  }

  // Q tile -> shared (cp.async); padding rows are zero-filled. By load_q_rows, as the
  // warp-specialized kernel's producer copies Q: one division by G per item, not two per row
  // (the mma.sync instances 4-10% faster on 32 x 512 prompts, H100, 2026-11-26, seventh session).
  __device__ __forceinline__ void load_q() {
    load_q_rows<T, D, BM, NT>(*this, smem_addr(sQ), loader / CPR, loader % CPR);
  }

  // This thread's rows of the tile starting at position kv0: their block ids.
  __device__ __forceinline__ void locate(int kv0) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int pos = kv0 + my_row + i * ROW_STEP;
      int b = -1;
      if (pos < kv_end) {
        b = __ldg(table + (pos >> a.log2_block_size));
        if (b < 0 || b >= a.num_cache_blocks) b = -1;
      }
      bid[i] = b;
    }
  }

  // The located rows of K (or V) into dst: cp.async for 16-bit caches; fp8 is loaded,
  // converted (exactly) and stored.
  // kv0: the located tile's first position (rows' slots within their blocks follow from it).
  __device__ __forceinline__ void load_tile(T* dst, const C* base, int kv0) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = my_row + i * ROW_STEP;
      const bool valid = bid[i] >= 0;
      const int64_t off = valid ? static_cast<int64_t>(bid[i]) * a.kv_stride_block +
                                      ((kv0 + r) & (a.block_size - 1)) * D : 0;
      if constexpr (!kFp8) {
        cp_async16(smem_addr(dst + tile_off<BN>(r, my_ch)), base + off + my_ch * 8, valid);
      } else {
        uint4 u = make_uint4(0, 0, 0, 0);
        if (valid) u = __ldg(reinterpret_cast<const uint4*>(base + off + my_ch * 16));
        uint4 lo, hi;
        fp8x16_to<T>(u, lo, hi);
        *reinterpret_cast<uint4*>(dst + tile_off<BN>(r, 2 * my_ch)) = lo;
        *reinterpret_cast<uint4*>(dst + tile_off<BN>(r, 2 * my_ch + 1)) = hi;
      }
    }
  }
};

// Online softmax of one warp's 16 rows over one S tile (BN columns, m16n8 accumulator layout:
// this thread holds rows g ("a") and g + 8 ("b")). Scores stay raw (the softmax scale, > 0, is
// folded into one fma per element); m is kept in the scaled log2 domain.
template <typename T, int D, int BN>
struct RowSoftmax {
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  int lim_a, lim_b;   // last visible position of rows a and b

  // s becomes P (fp32); m and l move on; returns the factors o must be rescaled by
  // (alpha_a, alpha_b), for the caller to apply when o may be touched.
  // NB: the 8-column groups of s that hold scores (the first NB; a narrowed last tile has fewer
  // than BN / 8, the rest are neither read nor written).
  // sl2: the softmax scale (log2 domain) of rows a and b's raw scores, or one for both.
  template <int NB = BN / 8>
  __device__ __forceinline__ float2 scores(float (&s)[BN / 8][4], int kv0, bool need_mask, float sl2, int t4) {
    return scores<NB>(s, kv0, need_mask, make_float2(sl2, sl2), t4);
  }
  template <int NB = BN / 8>
  __device__ __forceinline__ float2 scores(float (&s)[BN / 8][4], int kv0, bool need_mask, float2 sl2, int t4) {
    static_assert(NB > 0 && NB <= BN / 8 && NB % 2 == 0, "whole 16-column k-steps of P");
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < NB; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (kv0 + i * 8 + 2 * t4 + (e & 1) > (e < 2 ? lim_a : lim_b)) s[i][e] = -INFINITY;
    }
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      mx_a = fmaxf(mx_a, fmaxf(s[i][0], s[i][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[i][2], s[i][3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    mx_a = fmaxf(m_a, mx_a * sl2.x);
    mx_b = fmaxf(m_b, mx_b * sl2.y);
    // A row with nothing visible yet keeps m = -inf; 0 stands in so that no inf - inf appears.
    const float use_a = mx_a == -INFINITY ? 0.f : mx_a, use_b = mx_b == -INFINITY ? 0.f : mx_b;
    const float alpha_a = fast_exp2(m_a - use_a), alpha_b = fast_exp2(m_b - use_b);
    m_a = mx_a;
    m_b = mx_b;
    float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      s[i][0] = fast_exp2(fmaf(s[i][0], sl2.x, -use_a));
      s[i][1] = fast_exp2(fmaf(s[i][1], sl2.x, -use_a));
      s[i][2] = fast_exp2(fmaf(s[i][2], sl2.y, -use_b));
      s[i][3] = fast_exp2(fmaf(s[i][3], sl2.y, -use_b));
      sum_a += s[i][0] + s[i][1];
      sum_b += s[i][2] + s[i][3];
    }
    l_a = l_a * alpha_a + sum_a;
    l_b = l_b * alpha_b + sum_b;
    return make_float2(alpha_a, alpha_b);
  }

  // o *= alpha, skipped when no row of the warp changed its max (alpha == 1 everywhere: the
  // usual case once the first tiles have been seen).
  static __device__ __forceinline__ void rescale(float (&o)[D / 8][4], float2 alpha) {
    if (__all_sync(0xffffffffu, alpha.x == 1.f && alpha.y == 1.f)) return;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha.x;
      o[i][1] *= alpha.x;
      o[i][2] *= alpha.y;
      o[i][3] *= alpha.y;
    }
  }

  // P as A fragments (the m16n8 accumulator layout of two n-tiles is the m16k16 A layout).
  template <int NB = BN / 8>   // the first NB / 2 k-steps only (see scores)
  static __device__ __forceinline__ void pack(const float (&s)[BN / 8][4], uint32_t (&pa)[BN / 16][4]) {
    using M = Mma<T>;
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) {
      pa[kk][0] = M::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = M::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = M::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = M::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  }

  __device__ __forceinline__ void step(float (&s)[BN / 8][4], float (&o)[D / 8][4], uint32_t (&pa)[BN / 16][4],
                                       int kv0, bool need_mask, float sl2, int t4) {
    rescale(o, scores(s, kv0, need_mask, sl2, t4));
    pack(s, pa);
  }
};

// Within each quad (the 4 lanes of one accumulator row), w[c] of lane t (the two elements of
// 8-column group c at columns 2t, 2t + 1) goes to lane c as its word t: each lane ends with the 8
// contiguous elements of group t (16 bytes). Two exchanges (partners t ^ 1, then t ^ 2) of two
// words each; every lane of the warp must call it.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int t4) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit <<= 1) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int p = bit == 1 ? 2 * k : k, q = p + bit;   // the pair of words exchanged
      const bool high = (t4 & bit) != 0;
      const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? w[p] : w[q], bit);
      if (high)
        w[p] = got;
      else
        w[q] = got;
    }
  }
}

// Where one thread's two output rows go (warp rows g and g + 8 of an item), and their softmax sums.
struct OutRows {
  int rows, G, kvh, q_start, r_a;   // the item's rows, GQA group, KV head, first token; row g's index
  float l_a, l_b;                   // this thread's part of the two rows' sums of P
};

template <typename B, typename S>
__device__ __forceinline__ OutRows out_rows(const B& blk, const S& soft, int r_a) {
  return OutRows{blk.rows, blk.G, blk.kvh, blk.q_start, r_a, soft.l_a, soft.l_b};
}

// Normalizes and writes this thread's two rows of o: each quad's row transposed across its lanes
// (quad_transpose), so that every store is 16 contiguous bytes (4-byte stores took a fifth of a
// short item's time in the consumers, ncu 2026-11-26). Every lane of the warp must call it.
template <typename T, int D>
__device__ __forceinline__ void write_out_rows(const PrefillArgs& a, const OutRows& r, float (&o)[D / 8][4], int t4) {
  using M = Mma<T>;
  float l_a = r.l_a, l_b = r.l_b;
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = l_a > 0.f ? a.v_scale / l_a : 0.f, inv_b = l_b > 0.f ? a.v_scale / l_b : 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float inv = half == 0 ? inv_a : inv_b;
    uint32_t w[D / 32][4];   // [group of 4 column groups][column group in it]
#pragma unroll
    for (int i = 0; i < D / 8; ++i) w[i / 4][i % 4] = M::pack(o[i][2 * half] * inv, o[i][2 * half + 1] * inv);
#pragma unroll
    for (int q = 0; q < D / 32; ++q) quad_transpose(w[q], t4);
    const int gr = r.r_a + 8 * half;
    if (gr >= r.rows) continue;
    const int token = gr / r.G, h = r.kvh * r.G + gr % r.G;
    T* op = static_cast<T*>(a.out) + static_cast<int64_t>(r.q_start + token) * a.o_stride_tok +
            static_cast<int64_t>(h) * a.o_stride_head + 8 * t4;
#pragma unroll
    for (int q = 0; q < D / 32; ++q)
      *reinterpret_cast<uint4*>(op + 32 * q) = make_uint4(w[q][0], w[q][1], w[q][2], w[q][3]);
  }
}

template <typename T, int D, int BN, typename B>
__device__ __forceinline__ void write_rows(const B& blk, const RowSoftmax<T, D, BN>& sm, float (&o)[D / 8][4], int r_a,
                                           int t4) {
  write_out_rows<T, D>(blk.a, out_rows(blk, sm, r_a), o, t4);
}

// mma.sync version (any sm_80+): each warp multiplies its 16 rows by the whole K/V tile, B
// fragments by ldmatrix; Q fragments stay in registers.
template <typename T, typename C, int D, int WARPS>
__device__ __forceinline__ void prefill_mma(const PrefillArgs& args, unsigned char* smem_raw) {
  using M = Mma<T>;
  using Blk = PrefillBlock<T, C, D, 16 * WARPS, kBN, 32 * WARPS>;
  constexpr int BM = Blk::BM, BN = Blk::BN;
  Blk blk(args, smem_raw, blockIdx.x, threadIdx.x);
  if (!blk.live) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  blk.load_q();
  if (blk.n_tiles > 0) {
    blk.locate(0);
    blk.load_tile(blk.sK, blk.kbase, 0);
  }
  cp_async_commit();

  RowSoftmax<T, D, BN> sm;
  const int r_a = blk.row0 + warp * 16 + g;
  sm.lim_a = blk.offset + min(r_a / blk.G, blk.q_len - 1);        // padding rows: the last token's limit
  sm.lim_b = blk.offset + min((r_a + 8) / blk.G, blk.q_len - 1);
  const int first_pos = blk.offset + blk.t_first;   // tiles ending at or before it need no mask

  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  for (int j = 0; j < blk.n_tiles; ++j) {
    const int kv0 = j * BN;
    cp_async_wait_all();
    __syncthreads();   // K_j (and Q) landed for everyone; everyone is done with V_{j-1}
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], smem_addr(blk.sQ + tile_off<BM>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4))));
    }
    blk.load_tile(blk.sV, blk.vbase, kv0);   // same positions as K_j (bid[] still holds them)
    cp_async_commit();

    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(blk.sK + tile_off<BN>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                       kk * 2 + ((lane >> 3) & 1))));
        M::run(s[2 * np], qf[kk], b[0], b[1]);
        M::run(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }
    uint32_t pa[BN / 16][4];
    sm.step(s, o, pa, kv0, kv0 + BN - 1 > first_pos, args.scale_log2, t4);

    cp_async_wait_all();
    __syncthreads();   // V_j landed for everyone; everyone is done with K_j
    if (j + 1 < blk.n_tiles) {
      blk.locate(kv0 + BN);
      blk.load_tile(blk.sK, blk.kbase, kv0 + BN);
    }
    cp_async_commit();

#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, smem_addr(blk.sV + tile_off<BN>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                             dp * 2 + (lane >> 4))));
        M::run(o[2 * dp], pa[kk], b[0], b[1]);
        M::run(o[2 * dp + 1], pa[kk], b[2], b[3]);
      }
    }
  }
  cp_async_wait_all();   // nothing may stay in flight into shared memory at exit
  write_rows<T, D, BN>(blk, sm, o, r_a, t4);
}

#if KVPAGER_PREFILL_WGMMA
// wgmma version (sm_90a): each warpgroup (4 warps, 64 rows) runs S = Q K^T with Q and K from
// shared memory, and O += P V with P from registers and V from shared memory (N-major).
// kWgmmaStages K/V tiles: tile j + 1 loads while tile j is computed, and P_{j-1} V_{j-1} runs on
// the tensor cores while the softmax of S_j runs (FA3's intra-warpgroup overlap).
template <typename T, typename C, int D, int WARPS>
__device__ __forceinline__ void prefill_wgmma(const PrefillArgs& args, unsigned char* smem_raw) {
  using Blk = PrefillBlock<T, C, D, 16 * WARPS, kWgmmaBN, 32 * WARPS>;
  constexpr int BM = Blk::BM, BN = Blk::BN, S = kWgmmaStages;
  static_assert(WARPS % 4 == 0, "whole warpgroups");
  Blk blk(args, smem_raw, blockIdx.x, threadIdx.x);
  if (!blk.live) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
  const int g = lane >> 2, t4 = lane & 3;
  // Stage i: K at sK + i * 2 * BN * D, V right after it.
  auto k_tile = [&](int i) { return blk.sK + i * 2 * BN * D; };
  auto v_tile = [&](int i) { return blk.sK + i * 2 * BN * D + BN * D; };

  blk.load_q();
  if (blk.n_tiles > 0) {
    blk.locate(0);
    blk.load_tile(k_tile(0), blk.kbase, 0);
    blk.load_tile(v_tile(0), blk.vbase, 0);
  }
  cp_async_commit();
  if (blk.n_tiles > 1) blk.locate(BN);

  RowSoftmax<T, D, BN> sm;
  const int r_a = blk.row0 + warp * 16 + g;
  sm.lim_a = blk.offset + min(r_a / blk.G, blk.q_len - 1);
  sm.lim_b = blk.offset + min((r_a + 8) / blk.G, blk.q_len - 1);
  const int first_pos = blk.offset + blk.t_first;

  const uint32_t q_addr = smem_addr(blk.sQ + wg * 64 * 64);   // this warpgroup's 64 rows of each panel
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  uint32_t pa[BN / 16][4];   // P_{j-1}

  // Stages of tiles j - 1, j and j + 1 (rotating; kWgmmaStages == 3).
  static_assert(S == 3, "the stage rotation below assumes 3 stages");
  int st_prev = 2, st = 0, st_next = 1;
  for (int j = 0; j < blk.n_tiles; ++j) {
    const int kv0 = j * BN;
    cp_async_wait_all();
    fence_proxy_async();   // shared-memory writes, then reads by the tensor cores (async proxy)
    __syncthreads();       // tile j landed for everyone; everyone is done with iteration j - 1

    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    const uint32_t k_addr = smem_addr(k_tile(st));
    fence_regs(s);
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // k16 step kk: panel kk / 4, 32 bytes per step inside a 128-byte row.
      const uint32_t dq = (kk >> 2) * (BM * 128) + (kk & 3) * 32, dk = (kk >> 2) * (BN * 128) + (kk & 3) * 32;
      wgmma_ss(Tag<T>{}, s, gmma_desc(q_addr + dq, 16, 1024), gmma_desc(k_addr + dk, 16, 1024));
    }
    wgmma_commit();
    // Tile j + 1 into stage st_next (last read in iteration j - 1: K_{j-2}, V_{j-2}) while S_j
    // runs: a whole iteration to land. bid[] was located for it at the end of iteration j - 1,
    // so the block-table reads stay off this path.
    if (j + 1 < blk.n_tiles) {
      blk.load_tile(k_tile(st_next), blk.kbase, kv0 + BN);
      blk.load_tile(v_tile(st_next), blk.vbase, kv0 + BN);
    }
    cp_async_commit();
    if (j > 0) {   // O += P_{j-1} V_{j-1}, behind S_j on the tensor cores
      const uint32_t v_addr = smem_addr(v_tile(st_prev));
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)   // 16 positions = 2 groups of 8 rows = 2048 bytes per step
        wgmma_rs(Tag<T>{}, o, pa[kk], gmma_desc(v_addr + kk * 2048, BN * 128, 1024));
      wgmma_commit();
    }
    if (j > 0)
      wgmma_wait<1>();   // S_j done
    else
      wgmma_wait<0>();
    fence_regs(s);
    const float2 alpha = sm.scores(s, kv0, kv0 + BN - 1 > first_pos, args.scale_log2, t4);
    // Meant to run under P_{j-1} V_{j-1}; ptxas moves the wait above most of it (see
    // paged_prefill_ws.cuh, where keeping it below measured no faster).
    fence_regs(s);
    wgmma_wait<0>();       // P_{j-1} V_{j-1} done: o and pa are ours again
    fence_regs(o);
    fence_regs(pa);
    RowSoftmax<T, D, BN>::rescale(o, alpha);
    RowSoftmax<T, D, BN>::pack(s, pa);
    if (j + 2 < blk.n_tiles) blk.locate(kv0 + 2 * BN);   // table reads resolve during the next barrier
    st_prev = st;
    st = st_next;
    st_next = st_next == 2 ? 0 : st_next + 1;
  }
  if (blk.n_tiles > 0) {
    const uint32_t v_addr = smem_addr(v_tile(st_prev));
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_rs(Tag<T>{}, o, pa[kk], gmma_desc(v_addr + kk * 2048, BN * 128, 1024));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
  }
  cp_async_wait_all();
  write_rows<T, D, BN>(blk, sm, o, r_a, t4);
}
#endif

}  // namespace prefill_detail

// grid: num_items * num_kv_heads blocks, block b = (item b / num_kv_heads, KV head b % num_kv_heads)
// (item-major, so the heaviest items, listed first, start first); block: 32 * WARPS threads;
// dynamic smem: prefill_smem_bytes<D, WARPS>(). T: query/output type (fp16/bf16); C: cache type
// (T, or fp8 e4m3). WGMMA: the warpgroup version where built for sm_90a (else the mma.sync one).
template <typename T, typename C, int D, int WARPS, bool WGMMA>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 4 ? 2 : 1)
paged_prefill_kernel(const PrefillArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
#if KVPAGER_PREFILL_WGMMA
  if constexpr (WGMMA) {
    prefill_detail::prefill_wgmma<T, C, D, WARPS>(a, smem_raw);
    return;
  }
#endif
  prefill_detail::prefill_mma<T, C, D, WARPS>(a, smem_raw);
}

// Whether the WGMMA instances hold the warpgroup version (device code built for sm_90a): the
// kernel writes 1 to *flag there, else 0. One thread.
__global__ void paged_prefill_wgmma_probe(int* flag) {
#if KVPAGER_PREFILL_WGMMA
  *flag = 1;
#else
  *flag = 0;
#endif
}

}  // namespace kvpager
