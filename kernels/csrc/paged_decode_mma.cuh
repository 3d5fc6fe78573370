// Paged decode attention on tensor cores (issue 13), over an fp8 (e4m3) cache or a 16-bit one of
// the query's dtype (C == T, below the fp8 description): the same work items,
// DecodeArgs, grid and work-list modes and outputs as paged_decode_kernel (paged_decode.cuh), with
// the GQA group's dot products done by mma.sync m16n8k16 (f16 inputs, fp32 accumulators) instead
// of per-element FMAs. The FMA path converts every fp8 byte to fp32 and spends one FMA per head
// per element for K and again for V (~11 issued instructions per byte: issue-bound at 50-66% of
// the copy ceiling on an H100); here a byte costs about half a cvt (fp8x2 -> f16x2, exact) and a
// share of an mma.
//
// Per warp and iteration: TOK = 16 * CH tokens (CH = 1 or 2), i.e. 2 * CH n-tiles of 8 tokens;
// every n-tile lies inside one cache block (iterations start at multiples of 16 and blocks hold a
// power of two >= 8 tokens), so its block-table entry is warp-uniform. Lane (g, c) = (lane / 4,
// lane % 4), as in the mma fragment layouts.
//
//   S = Q K^T per n-tile: M = query heads (rows 0..7 = the tile's heads, rows 8..15 zero padding),
//   N = 8 tokens, K = head dims, D / 16 k-steps. The reduction dims are permuted (the sum does not
//   care, as long as Q and K agree): at k-step s, lane c's logical dims (2c, 2c+1, 2c+8, 2c+9)
//   are the physical dims c * D/4 + 4s + (0, 1, 2, 3) (MmaShape::k_dim(c, 4s + ...); by default
//   (whole sectors), at D = 128 the lane's two chunks are the row's chunks c and 4 + c). So lane
//   (g, c) reads D/4 bytes of token g's K row (one or two 16-byte loads), and k-step s takes its
//   32-bit word s: the low
//   two bytes -> f16x2 -> b0b1, the high two -> b2b3. The Q fragment (a0a1 = Q[g][c*D/4 + 4s +
//   0..1], a4a5 = ... + 2..3, a2a3 = a6a7 = 0) is converted once per item. The C fragment gives
//   lane (g, c) the scores of head g for tokens 2c, 2c+1 of the n-tile.
//
//   O^T = V^T P^T per 16 tokens (n-tiles 2j, 2j+1): M = head dims (D / 16 m-tiles), N = 8 heads,
//   K = 16 tokens. B = P^T: lane (g, c) needs P[head g][tokens 2c, 2c+1] and [8+2c, 9+2c]: the C
//   fragments of the two S n-tiles, packed to f16x2 (P in [0, 1]). A = V^T (dims x tokens): the
//   rows (dims) are permuted too: lane (g, c) reads D/8 contiguous bytes (from byte g * D/8) of
//   each of the token rows 2c, 2c+1 of both n-tiles; from word w of rows (t0, t1) one byte
//   permute gives (t0[4w], t1[4w], t0[4w+1], t1[4w+1]): cvt of its low half -> a0a1 of m-tile 2w
//   (row g = dim g*D/8 + 4w), high half -> a2a3 (row g+8 = dim g*D/8 + 4w + 1); a second permute
//   (bytes 2, 3) gives m-tile 2w+1 (dims + 4w + 2, + 4w + 3); the rows of the second n-tile give
//   a4..a7 alike. The accumulators then hold, per m-tile, O[heads 2c, 2c+1][dims rho(g), rho(g+8)],
//   written out through shared memory.
//
//   Online softmax per head in fp32, log2 domain: the running max is reduced over the 4 lanes of
//   quad g; the rescale factors of the accumulator columns (heads 2c, 2c+1) come from quads 2c,
//   2c+1 by shuffles; the running sum stays per lane (the quad's lanes share the max) and is
//   reduced at the end.
//
//   Scaling: the query times scale_log2 (k_scale included) could overflow f16, or underflow it for
//   tiny scales, so each warp converts it with a power-of-two factor 2^e putting the tile's max
//   |q| in [2^13, 2^14), and the scores are multiplied by 2^-e after the mma (exact).
//
// A 16-bit cache (C == T, f16 or bf16; mma.sync in T): the same fragments without conversions.
// Lane (g, c)'s K slice of token g is D/4 elements (D/2 bytes), its 16-byte chunks j taken from
// chunk 4j + c of the row so that a warp's load reads whole sectors (MmaShape::k_dim; the query's
// loads follow it); k-step s takes the slice's words 2s and 2s + 1 as b0b1 and b2b3 as they are.
// The query's fragments are its own 16-bit values, unscaled (exact), and the scores are
// multiplied by scale_log2 in fp32 after the mma. V: lane (g, c) reads D/8 elements of each token
// row, its chunks j from chunk 8j + g (MmaShape::v_dim); word w of its slices of rows (t0, t1)
// gives, by two 16-bit permutes, (t0[2w], t1[2w]) -> a0a1 and (t0[2w+1], t1[2w+1]) -> a2a3 of
// m-tile w, whose rows g, g + 8 are the dims v_dim(g, 2w), + 1 (at D = 64, one chunk: g * D/8 +
// 2w, the fp8 path's dims, 4 (m/2) + 2 (m%2) = 2m).
// P goes to the mma as T pairs. Against the FMA instance it issues far fewer instructions per
// byte (ncu, H100, 8 x 4K: the FMA kernel 27.2 M instructions and 59% of issue slots, cuDNN's
// tensor-core decode 5.4 M and 14%).
//
// Loads are pipelined as in paged_decode_kernel: the next iteration's K is issued right after the
// S mma, its V right after P V (the registers double as buffers), block slabs can be prefetched into
// L2 a.prefetch_steps iterations ahead (0 by default for this instance, kDefaultPrefetchStepsMma:
// it measured slower), and the item's block-table slice is staged in shared memory. Tokens at or past `end` and blocks whose table entry is not a valid id are never loaded
// (zeros; their scores are -inf). Warps take interleaved token tiles and are merged through shared
// memory at the end, as in decode_item.
#pragma once

#include <type_traits>

#include "fp8_convert.cuh"
#include "mma_sync.cuh"
#include "paged_decode.cuh"

namespace kvpager {

constexpr int kMmaHeads = 8;   // query heads of one tensor-core tile (the N of O^T = V^T P^T)

// Where a lane's K and V chunks lie (MmaShape::FULL): KVPAGER_DECODE_MMA_FULL_SECTORS=0 contiguous
// over every cache (half sectors a load), 1 whole sectors over 16-bit caches only, 2 (the default)
// over fp8 caches too (only the K slice at D = 128 differs there), to A/B the layouts.
#ifndef KVPAGER_DECODE_MMA_FULL_SECTORS
#define KVPAGER_DECODE_MMA_FULL_SECTORS 2
#endif

template <typename C, int D, int CH>
struct MmaShape {
  static_assert(D == 64 || D == 128, "tensor-core decode: head_dim 64 or 128");
  static constexpr int ES = sizeof(C);          // bytes of a cache element: 1 (fp8) or 2
  static constexpr int TOK = 16 * CH;           // tokens per warp iteration
  static constexpr int NT = 2 * CH;             // n-tiles of 8 tokens per warp iteration
  static constexpr int KSTEPS = D / 16;         // k-steps of S = Q K^T (one K word each, fp8; two, 16-bit)
  static constexpr int KVEC = 16 / ES;          // elements of a 16-byte load
  static constexpr int KVECS = D / 4 / KVEC;    // 16-byte K loads per lane and n-tile (D/4 elements)
  static constexpr int VELEMS = D / 8;          // elements of a V row one lane reads
  static constexpr int VWORDS = VELEMS * ES / 4;
  static constexpr int MT = D / 16;             // m-tiles of O^T
  static constexpr int QVECS = D / 4 * 2 / 16;  // 16-byte loads of the lane's D/4 query elements (16-bit)
  static constexpr int STEP = kDecodeWarps * TOK;   // tokens per block iteration
  // Where a lane's 16-byte chunks lie in its rows. By default (KVPAGER_DECODE_MMA_FULL_SECTORS 2;
  // 1: 16-bit caches only) each load instruction of the warp reads whole 32-byte sectors: lane c's
  // K chunk j is chunk 4j + c of its token row (the row's 4 lanes side by side), lane g's V chunk j
  // is chunk 8j + g. Otherwise a lane's chunks are contiguous, from element c * D/4 (K) or g * D/8
  // (V): each instruction then reads half of every sector it touches and the next instruction the
  // other half. On an H200 the half-sector loads over 16-bit caches read as fast at best but
  // dropped up to 12 points in some turns (twenty-second session); on an H100 over fp8 caches
  // whole sectors gain 1-2.5 points on steps of at most 64K tokens and tie on larger ones
  // (docs/performance.md, twenty-fourth session).
  static constexpr bool FULL = KVPAGER_DECODE_MMA_FULL_SECTORS >= 2 || (KVPAGER_DECODE_MMA_FULL_SECTORS == 1 && ES == 2);
  static constexpr int VCHUNK = VELEMS < 16 / ES ? VELEMS : 16 / ES;   // elements of one V load
  static constexpr int KSTRIDE = FULL ? 4 * KVEC : KVEC;              // elements between a lane's K chunks
  static constexpr int VSTRIDE = FULL ? 8 * VCHUNK : VCHUNK;          // ... and V chunks
  // The first element of lane c's K slice, and the row element holding its slice element e (the
  // query's loads follow it).
  __host__ __device__ static constexpr int k_first(int c) { return FULL ? c * KVEC : c * (D / 4); }
  __host__ __device__ static constexpr int k_dim(int c, int e) { return k_first(c) + e / KVEC * KSTRIDE + e % KVEC; }
  // The same for lane g's V slice (the output's dims follow it).
  __host__ __device__ static constexpr int v_first(int g) { return FULL ? g * VCHUNK : g * VELEMS; }
  __host__ __device__ static constexpr int v_dim(int g, int e) { return v_first(g) + e / VCHUNK * VSTRIDE + e % VCHUNK; }
  // Whether the 4 lanes' K slices (and the 8 lanes' V slices) of a row hold each of its D elements
  // exactly once, each 16-byte chunk whole (checked at compile time in decode_item_mma).
  __host__ __device__ static constexpr bool slices_tile_the_row() {
    bool k_seen[D] = {}, v_seen[D] = {};
    for (int c = 0; c < 4; ++c)
      for (int e = 0; e < D / 4; ++e) {
        const int d = k_dim(c, e);
        if (d < 0 || d >= D || k_seen[d] || (e % KVEC == 0 && d % KVEC != 0)) return false;
        k_seen[d] = true;
      }
    for (int g = 0; g < 8; ++g)
      for (int e = 0; e < VELEMS; ++e) {
        const int d = v_dim(g, e);
        if (d < 0 || d >= D || v_seen[d] || (e % VCHUNK == 0 && d % VCHUNK != 0)) return false;
        v_seen[d] = true;
      }
    return true;
  }
};

// Shared memory of the query fragments (before the table slice / merge area of decode_merge_smem_bytes<D, kMmaHeads>()).
template <int D>
__host__ __device__ constexpr int decode_mma_q_bytes() {
  return kDecodeWarps * (D / 16) * 32 * 8;
}

namespace mma_detail {

// 8-byte version of load_kv16 (paged_decode.cuh).
__device__ __forceinline__ uint2 load_kv8(const void* ptr, bool pred) {
  uint2 v;
  asm("{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %3, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  mov.b32 %1, 0;\n"
      "  @p ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];\n"
      "}\n"
      : "=r"(v.x), "=r"(v.y)
      : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

// A lane's VWORDS (a multiple of 4) words of a V row by 16-byte loads at p, p + STRIDE, ... elements
// (zeros where !pred).
template <typename C, int VWORDS, int STRIDE>
__device__ __forceinline__ void load_v_row(uint32_t (&dst)[VWORDS], const C* p, bool pred) {
#pragma unroll
  for (int j = 0; j < VWORDS / 4; ++j) {
    const uint4 u = load_kv16(p + j * STRIDE, pred);
    dst[4 * j] = u.x; dst[4 * j + 1] = u.y; dst[4 * j + 2] = u.z; dst[4 * j + 3] = u.w;
  }
}

__device__ __forceinline__ float pow2f(int e) { return __int_as_float((127 + e) << 23); }   // e in [-126, 127]

}  // namespace mma_detail

// One work item (decode_item's contract): tokens [start, end) of sequence seq for the block's (KV
// head, head chunk) of up to kMmaHeads heads; writes the output rows, or its partial row (o / l *
// v_scale, and (m, l) in the log2 domain) for paged_decode_merge_kernel (item_destination).
template <typename T, typename C, int D, int CH>
__device__ __forceinline__ void decode_item_mma(const DecodeArgs& a, unsigned char* smem, const WorkItem& it) {
  const int seq = it.seq, start = it.start, end = it.end;
  using namespace mma_detail;
  using S = MmaShape<C, D, CH>;
  constexpr int NT = S::NT, KSTEPS = S::KSTEPS, KVECS = S::KVECS, VWORDS = S::VWORDS, MT = S::MT, HT = kMmaHeads;
  constexpr int NTHREADS = kDecodeWarps * 32;
  constexpr bool kFp8 = std::is_same_v<C, __nv_fp8_e4m3>;
  static_assert(kFp8 || std::is_same_v<C, T>, "a 16-bit cache holds the query's dtype");
  static_assert(S::slices_tile_the_row(), "the lanes' K and V chunks cover every row element once");
  int* s_table = reinterpret_cast<int*>(smem + decode_mma_q_bytes<D>());   // after the query fragments

  // Laundered through empty asm: nothing derived from them is hoisted out of the work-list loop
  // (ptxas kept ~30 registers of such values live across items).
  int tid = threadIdx.x, bx = blockIdx.x;
  asm volatile("" : "+r"(tid), "+r"(bx));
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int kvh = bx / a.head_chunks, chunk = bx % a.head_chunks;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int head0 = kvh * group + chunk * a.head_tile;
  const int nheads = min(a.head_tile, group - chunk * a.head_tile);
  const int log2b = a.log2_block_size;

  // The item's block-table slice into shared memory (invalid ids -> -1), first slabs to L2
  // (ItemTable, paged_decode.cuh).
  const ItemTable<C, D, S::STEP> tbl(a, it, kvh);
  const int first_blk = tbl.first_blk;
  const C* kslab = tbl.kslab;
  const C* vslab = tbl.vslab;

  // The iteration in flight, per n-tile: first token, and its block (-1: not loaded; the 64-bit
  // offsets are formed at each load, which keeps fewer registers live); the K and V registers.
  int tb[NT], blk[NT];
  uint4 kr[NT][KVECS];
  uint32_t vr[NT][2][VWORDS];

  // Query: lane (g, c) takes head g's dims of its K slice (S::k_dim; zeros past the tile's heads),
  // loaded first (in flight with the table's loads below), then times scale_log2 and 2^e (per
  // warp: the max |q| of the tile in [2^13, 2^14)), as f16 pairs, into shared memory
  // (s_q[warp][k-step][lane]: conflict-free 8-byte reads, and 16 (D = 128) registers fewer in the
  // loop, which let 4 blocks fit per SM).
  uint4 qraw[S::QVECS];
  {
    const bool live = g < nheads;
    const T* qp = static_cast<const T*>(a.query) + static_cast<int64_t>(seq) * a.q_stride_seq +
                  static_cast<int64_t>(head0 + (live ? g : 0)) * a.q_stride_head;
#pragma unroll
    for (int i = 0; i < S::QVECS; ++i) {   // slice elements 8i .. 8i + 7, where the lane's K has them
      qraw[i] = make_uint4(0, 0, 0, 0);
      if (live) qraw[i] = *reinterpret_cast<const uint4*>(qp + S::k_dim(c, 8 * i));
    }
  }

  tbl.template stage<NTHREADS>(a, s_table, tid);

  uint2* s_q = reinterpret_cast<uint2*>(smem) + warp * KSTEPS * 32 + lane;
  float inv_qscale;   // what the mma's sums are multiplied by: 2^-e (fp8), scale_log2 (16-bit)
  if constexpr (!kFp8) {   // the query's own values: k-step s, its words 2s and 2s + 1
    inv_qscale = a.scale_log2;
#pragma unroll
    for (int i = 0; i < S::QVECS; ++i) {
      s_q[(2 * i) * 32] = make_uint2(qraw[i].x, qraw[i].y);
      s_q[(2 * i + 1) * 32] = make_uint2(qraw[i].z, qraw[i].w);
    }
  } else {
    float qf[D / 4];
#pragma unroll
    for (int i = 0; i < S::QVECS; ++i) Elem<T>::unpack(qraw[i], &qf[i * 8]);
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < D / 4; ++e) {
      qf[e] *= a.scale_log2;
      amax = fmaxf(amax, fabsf(qf[e]));
    }
#pragma unroll
    for (int mask = 16; mask >= 1; mask >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, mask));
    int ex = 0;
    if (amax > 0.f && amax <= 3.0e38f) frexpf(amax, &ex);   // amax < 2^ex
    const int shift = max(-100, min(100, 14 - ex));
    const float qscale = pow2f(shift);
    inv_qscale = pow2f(-shift);
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s)
      s_q[s * 32] = make_uint2(Mma<__half>::pack(qf[4 * s] * qscale, qf[4 * s + 1] * qscale),
                               Mma<__half>::pack(qf[4 * s + 2] * qscale, qf[4 * s + 3] * qscale));
  }
  __syncthreads();   // s_table ready

  float acc[MT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[m][e] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;   // head g's running max (quad-uniform) and this lane's part of its sum

  const int k_lane = g * D + S::k_first(c);             // lane's first K element of token g of an n-tile
  const int v_lane = 2 * c * D + S::v_first(g);         // lane's first V element of token 2c of an n-tile
  const int n_iter = end > start ? (end - start + S::STEP - 1) / S::STEP : 0;
  const int warp_tok0 = start + warp * S::TOK;

  auto locate = [&](int it) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int t = warp_tok0 + it * S::STEP + 8 * n;
      tb[n] = t;
      blk[n] = t < end ? s_table[(t >> log2b) - first_blk] : -1;
    }
  };
  auto row_off = [&](int n, bool ok) -> int64_t {   // the n-tile's first row, in its block
    return ok ? static_cast<int64_t>(blk[n]) * a.kv_stride_block + (tb[n] & (a.block_size - 1)) * D : 0;
  };
  auto load_k = [&]() {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const bool ok = blk[n] >= 0 && tb[n] + g < end;
      const C* p = kslab + row_off(n, ok) + k_lane;
#pragma unroll
      for (int j = 0; j < KVECS; ++j) kr[n][j] = load_kv16(p + S::KSTRIDE * j, ok);
    }
  };
  auto load_v = [&]() {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool ok = blk[n] >= 0 && tb[n] + 2 * c + r < end;
        const C* p = vslab + row_off(n, ok) + v_lane + r * D;
        if constexpr (VWORDS == 4) {
          const uint4 u = load_kv16(p, ok);
          vr[n][r][0] = u.x; vr[n][r][1] = u.y; vr[n][r][2] = u.z; vr[n][r][3] = u.w;
        } else if constexpr (VWORDS == 2) {
          const uint2 u = load_kv8(p, ok);
          vr[n][r][0] = u.x; vr[n][r][1] = u.y;
        } else {
          load_v_row<C, VWORDS, S::VSTRIDE>(vr[n][r], p, ok);
        }
      }
  };
  locate(0);
  wait_for_prerequisite_grids();   // the K/V only from here (pdl.cuh; paged_decode.cuh decode_item)
  load_k();
  load_v();

  for (int it = 0; it < n_iter; ++it) {
    tbl.prefetch_ahead(a, s_table, it, tid);   // L2: blocks of iteration it + a.prefetch_steps
    // Scores: head g, tokens 2c, 2c+1 of each n-tile (log2 domain; -inf where not loaded).
    float sc[NT][2];
    float d[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) d[n][e] = 0.f;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      const uint2 q = s_q[s * 32];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if constexpr (kFp8) {
          const uint4& v = kr[n][s / 4];
          const uint32_t w = (s % 4 == 0) ? v.x : (s % 4 == 1) ? v.y : (s % 4 == 2) ? v.z : v.w;
          const uint2 kb = fp8x4_to_h2x2(w);
          Mma<__half>::run(d[n], {q.x, 0u, q.y, 0u}, kb.x, kb.y);
        } else {
          const uint4& v = kr[n][s / 2];
          Mma<T>::run(d[n], {q.x, 0u, q.y, 0u}, s % 2 ? v.z : v.x, s % 2 ? v.w : v.y);
        }
      }
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const bool blk_ok = blk[n] >= 0;
      sc[n][0] = blk_ok && tb[n] + 2 * c < end ? d[n][0] * inv_qscale : -INFINITY;
      sc[n][1] = blk_ok && tb[n] + 2 * c + 1 < end ? d[n][1] * inv_qscale : -INFINITY;
    }
    timeline_progress(it, n_iter);

    // Next iteration's K into the registers just consumed (off / tb move on to it + 1).
    const bool more = it + 1 < n_iter;
    if (more) {
      locate(it + 1);
      load_k();
    }

    // Online softmax of head g (the quad's 4 lanes hold its 2 * NT scores each).
    float mx = m_run;
#pragma unroll
    for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(sc[n][0], sc[n][1]));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
    const float alpha = exp2_diff(m_run, mx);
    float psum = 0.f;
    uint32_t pb[NT];   // P of head g, tokens 2c, 2c+1 of n-tile n, as f16x2 (bf16x2: a bf16 cache)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float p0 = exp2_diff(sc[n][0], mx), p1 = exp2_diff(sc[n][1], mx);
      psum += p0 + p1;
      pb[n] = Mma<std::conditional_t<kFp8, __half, T>>::pack(p0, p1);
    }
    l_run = l_run * alpha + psum;
    m_run = mx;
    // Accumulator columns are heads 2c, 2c+1: their factors from quads 2c, 2c+1.
    const float a_lo = __shfl_sync(kFullMask, alpha, 8 * c), a_hi = __shfl_sync(kFullMask, alpha, 8 * c + 4);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      acc[m][0] *= a_lo;
      acc[m][1] *= a_hi;
      acc[m][2] *= a_lo;
      acc[m][3] *= a_hi;
    }
    // O^T += V^T P^T per 16 tokens (n-tiles 2h, 2h+1).
#pragma unroll
    for (int h = 0; h < CH; ++h) {
      const uint32_t b0 = pb[2 * h], b1 = pb[2 * h + 1];
#pragma unroll
      for (int w = 0; w < VWORDS; ++w) {
        if constexpr (kFp8) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t sel = half ? 0x7362u : 0x5140u;
            const uint32_t x01 = __byte_perm(vr[2 * h][0][w], vr[2 * h][1][w], sel);
            const uint32_t x23 = __byte_perm(vr[2 * h + 1][0][w], vr[2 * h + 1][1][w], sel);
            const uint2 a01 = fp8x4_to_h2x2(x01), a23 = fp8x4_to_h2x2(x23);
            Mma<__half>::run(acc[2 * w + half], {a01.x, a01.y, a23.x, a23.y}, b0, b1);
          }
        } else {   // m-tile w: rows g, g + 8 = the word's low and high elements
          const uint32_t t0 = vr[2 * h][0][w], t1 = vr[2 * h][1][w], t8 = vr[2 * h + 1][0][w], t9 = vr[2 * h + 1][1][w];
          Mma<T>::run(acc[w], {__byte_perm(t0, t1, 0x5410u), __byte_perm(t0, t1, 0x7632u),
                               __byte_perm(t8, t9, 0x5410u), __byte_perm(t8, t9, 0x7632u)}, b0, b1);
        }
      }
    }
    if (more) load_v();
  }

  // Head g's sum over its quad; then across warps through shared memory (the table slice is dead).
  l_run += __shfl_xor_sync(kFullMask, l_run, 1);
  l_run += __shfl_xor_sync(kFullMask, l_run, 2);
  __syncthreads();
  float* s_acc = reinterpret_cast<float*>(s_table);         // [kDecodeWarps][HT][D]
  float* s_ml = s_acc + kDecodeWarps * HT * D;              // [kDecodeWarps][HT][2]
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int dim = S::v_dim(g, 2 * m);   // row g of m-tile m (V slice element 2m); row g + 8 is dim + 1
    float* lo = s_acc + (warp * HT + 2 * c) * D + dim;       // head 2c
    float* hi = lo + D;                                      // head 2c + 1
    lo[0] = acc[m][0];
    hi[0] = acc[m][1];
    lo[1] = acc[m][2];
    hi[1] = acc[m][3];
  }
  if (c == 0) {
    s_ml[(warp * HT + g) * 2] = m_run;
    s_ml[(warp * HT + g) * 2 + 1] = l_run;
  }
  __syncthreads();

  write_item_output<T, D, HT>(a, s_acc, s_ml, nheads, head0, it);
}

// Resident blocks per SM asked of the register allocator: 16 tokens a warp iteration fit 128
// registers (4 blocks of 4 warps); 32 tokens ask for 3.
// A 16-bit cache's K and V registers are twice the fp8 ones: 16 tokens a warp iteration ask for 3.
template <typename C, int CH>
constexpr int decode_mma_min_blocks() {
#ifdef KVPAGER_DECODE_MMA_MIN_BLOCKS
  return KVPAGER_DECODE_MMA_MIN_BLOCKS;
#else
  if constexpr (sizeof(C) == 1)
    return kDecodeWarps == 4 ? (CH == 1 ? 4 : 3) : 1;
  else
    return kDecodeWarps == 4 ? (CH == 1 ? 3 : 2) : 1;
#endif
}

// grid and block as paged_decode_kernel; dynamic smem: decode_mma_q_bytes<D>() + max(table slice,
// decode_merge_smem_bytes<D, kMmaHeads>()).
template <typename T, typename C, int D, int CH>
__global__ void __launch_bounds__(kDecodeWarps * 32, decode_mma_min_blocks<C, CH>())
paged_decode_mma_kernel(const DecodeArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  allow_dependent_launch();   // the merge kernel may start early (paged_decode_merge.cuh)
  timeline_block_entry();   // decode_timeline.cuh
  const int longest = a.max_blocks_per_seq << a.log2_block_size;
  if (a.work == nullptr) {
    const int seq = blockIdx.y, split = blockIdx.z;
    const int ctx = max(0, min(a.context_lens[seq], longest));
    const int start = split * a.partition_tokens;
    if (split > 0 && start >= ctx) return;
    const WorkItem it{seq, split, start, min(ctx, start + a.partition_tokens), a.table_stride};
    timeline_item_start(0);
    decode_item_mma<T, C, D, CH>(a, smem, it);
    timeline_item_end(0, it.end - it.start);
    return;
  }
  for (int r = 0;; ++r) {   // (paged_decode.cuh: work_item)
    WorkItem it;
    if (!work_item(a, r, longest, &it)) break;
    timeline_item_start(r);
    decode_item_mma<T, C, D, CH>(a, smem, it);
    timeline_item_end(r, it.end - it.start);
    __syncthreads();
  }
}

}  // namespace kvpager
