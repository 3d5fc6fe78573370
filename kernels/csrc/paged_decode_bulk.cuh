// Paged decode attention on tensor cores over a 16-bit cache, its K/V staged through shared memory
// by the copy engine (Hopper, issue 13): the same work items, DecodeArgs, grid and work-list modes
// and outputs as paged_decode_mma_kernel (paged_decode_mma.cuh), whose fragment algebra it keeps
// (S = Q K^T with the query heads as M, O^T = V^T P^T with the head dims as M, online softmax per
// head in the log2 domain); only the data path differs.
//
// Why: the register instance holds one iteration of K/V in flight per warp (the registers double
// as buffers) and is long-scoreboard bound on an H200, 10-14% slower than cuDNN's decode on long
// steps (docs/performance.md, "Decode on an H200"). Here each warp owns a ring of kBulkStages
// stages in shared memory, filled kBulkStages - 1 iterations ahead: per iteration (16 tokens) its
// 32 lanes each copy one token row (K rows by lanes 0-15, V rows by 16-31) with one
// cp.async.bulk of D * 2 bytes into the stage, completing on the stage's mbarrier (lane 0 arrives
// with the stage's byte count). No register holds data in flight and a copy costs one instruction
// per 256 bytes, not per 16.
//
// Stage layout: 32 rows (K rows 0-15, V rows 16-31) of BulkShape::ROW_STRIDE = D * 2 + 16 bytes. The
// 16-byte pad puts consecutive rows 4 banks apart, and the lanes' chunks are chosen so that every
// quarter-warp's 16-byte shared loads hit 32 distinct banks:
//   - K: lane (g, c) reads row g of each n-tile, chunks (16-byte, 8 elements) 2c, 2c + 1, 2c + 8,
//     2c + 9 (D = 128; 2c, 2c + 1 for D = 64): k-step s takes chunk s / 2, words 2 (s % 2) and
//     2 (s % 2) + 1, and the query fragment takes the same physical dims (the reduction's order is
//     free as long as Q and K agree);
//   - V: lane (g, c) reads rows 2c, 2c + 1 of both n-tiles, chunks g and g + 8 (D = 128; g for
//     D = 64): m-tile m's rows g, g + 8 are dims 8 (g + 8 (m / 4)) + 2 (m % 4) and + 1, which is
//     where the accumulators are written out.
// Rows that are not copied (past the item's end, or of a block whose table entry is not a valid
// id) keep stale bytes: their scores become -inf (as in the register instance) and, in an
// iteration that has any, their V words are zeroed in registers before P V (stale bytes may be a
// NaN pattern, and 0 * NaN is NaN).
//
// Synchronization, per warp: the mbarrier of a stage completes when lane 0 has arrived (with the
// expected bytes) and the copies have landed; every lane waits on it (parity = the fill's round).
// A stage is refilled only after a __syncwarp that follows its last reads. The ring position
// `fills` runs across the worker's items: the next item's first kBulkStages - 1 iterations are
// copied behind the current item's last ones (KVPAGER_DECODE_BULK_NEXT), so at an item's end the
// one stage no copy is in flight to, its last iteration's, takes the warp's accumulators for the
// cross-warp merge. Those are ordinary stores: a proxy fence orders them before later copies.
//
// Shared memory bounds it: 2 blocks of 4 warps an SM at D = 128 (3 stages, ~110 KB a block), one
// fewer than the register instance. Measured on an H200 (docs/performance.md, "The tensor-core
// decode staged by the copy engine"): large steps 3-8 points nearer the copy ceiling, small steps
// and short ragged batches 2-6 points further. So plans take it (mma 2) only when asked, or by
// default when built with KVPAGER_DECODE_MMA_BULK=1 (decode_plan.h).
#pragma once

#include "mbarrier.cuh"
#include "mma_sync.cuh"
#include "paged_decode.cuh"
#include "paged_decode_mma.cuh"

#ifndef KVPAGER_DECODE_BULK_STAGES
#define KVPAGER_DECODE_BULK_STAGES 3
#endif
// KVPAGER_DECODE_BULK_NEXT=0: a worker's next item starts its copies at its own start, not behind
// the current item's last iterations.
#ifndef KVPAGER_DECODE_BULK_NEXT
#define KVPAGER_DECODE_BULK_NEXT 1
#endif

namespace kvpager {

constexpr int kBulkStages = KVPAGER_DECODE_BULK_STAGES;
static_assert(kBulkStages >= 2, "a ring of at least two stages");

template <int D>
struct BulkShape {
  static_assert(D == 64 || D == 128, "bulk-staged decode: head_dim 64 or 128");
  static constexpr int ROW_BYTES = D * 2;                  // one token row of K or V (16-bit)
  static constexpr int ROW_STRIDE = ROW_BYTES + 16;        // padded: rows 4 banks apart
  static constexpr int STAGE_BYTES = 32 * ROW_STRIDE;      // 16 K rows, then 16 V rows
  static constexpr int RING_BYTES = kDecodeWarps * kBulkStages * STAGE_BYTES;
  static constexpr int KSTEPS = D / 16;
  static constexpr int Q_BYTES = KSTEPS * 32 * 8;          // the query fragments, shared by the warps
  static constexpr int ML_BYTES = kDecodeWarps * kMmaHeads * 2 * 4;   // the warps' (max, sum) per head
  static constexpr int BAR_BYTES = 128;                    // kDecodeWarps * kBulkStages mbarriers, padded
  static constexpr int EXTRA_BYTES = Q_BYTES + ML_BYTES + BAR_BYTES + RING_BYTES;   // before the table slice
  static constexpr int BARS_AT = Q_BYTES + ML_BYTES;       // offsets of the mbarriers and the rings
  static constexpr int RING_AT = BARS_AT + BAR_BYTES;
  static constexpr int KCHUNKS = D / 64 * 2;               // 16-byte K chunks a lane reads per row
  static constexpr int VCHUNKS = D / 64;                   // 16-byte V chunks a lane reads per row
  static constexpr int MT = D / 16;                        // m-tiles of O^T
  static constexpr int STEP = kDecodeWarps * 16;           // tokens per block iteration
  // Blocks an SM holds (228 KB of shared memory, 1 KB of it reserved per block, at least 2 KB of
  // table each; 3 at most, what the registers allow), and the table slice the rest leaves each
  // (which bounds a work item's tokens), up to 32 KB, whole KB.
  static constexpr int SM_BYTES = 228 * 1024;
  static constexpr int BLOCKS = SM_BYTES / (EXTRA_BYTES + 1024 + 2048) < 3 ? SM_BYTES / (EXTRA_BYTES + 1024 + 2048) : 3;
  static constexpr int TABLE_LEFT = (SM_BYTES / (BLOCKS > 0 ? BLOCKS : 1) - 1024 - EXTRA_BYTES) / 1024 * 1024;
  static constexpr int TABLE_BYTES = TABLE_LEFT < 32768 ? TABLE_LEFT : 32768;
  static_assert(BLOCKS >= 1 && TABLE_BYTES >= 2048, "a block and its table fit an SM");
  static_assert(kDecodeWarps * kBulkStages * 8 <= BAR_BYTES, "mbarriers fit their area");
  static_assert(kMmaHeads * D * 4 <= STAGE_BYTES, "a warp's accumulators fit one stage of its ring");
  // Lane chunk j of a K row (c = lane % 4) and of a V row (g = lane / 4).
  static __device__ __forceinline__ int k_chunk(int c, int j) { return 2 * c + (j & 1) + 8 * (j >> 1); }
  static __device__ __forceinline__ int v_chunk(int g, int j) { return g + 8 * j; }
};

// Dynamic shared memory: the query fragments, the warps' (max, sum) pairs, the mbarriers, the rings
// (each warp's accumulators at an item's end), then the table slice.
template <int D>
__host__ __device__ constexpr int decode_bulk_extra_bytes() {
  return BulkShape<D>::EXTRA_BYTES;
}

namespace bulk_detail {
// (paged_decode_mma.cuh's loop does the same inline; kept so there, its code generation tuned.)
// One iteration's online softmax of head g (lane (g, c); the quad's 4 lanes hold its NT * 2
// scores sc, log2 domain, -inf where not loaded): updates the running max and this lane's part of
// the sum, rescales the accumulators' columns (heads 2c, 2c + 1: their factors from quads 2c,
// 2c + 1), and returns P as pairs of P (the P V mma's input type), per n-tile.
template <typename P, int NT, int MT>
__device__ __forceinline__ void online_softmax_step(const float (&sc)[NT][2], float& m_run, float& l_run,
                                                    float (&acc)[MT][4], uint32_t (&pb)[NT], int c) {
  float mx = m_run;
#pragma unroll
  for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(sc[n][0], sc[n][1]));
  mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
  const float alpha = exp2_diff(m_run, mx);
  float psum = 0.f;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const float p0 = exp2_diff(sc[n][0], mx), p1 = exp2_diff(sc[n][1], mx);
    psum += p0 + p1;
    pb[n] = Mma<P>::pack(p0, p1);
  }
  l_run = l_run * alpha + psum;
  m_run = mx;
  const float a_lo = __shfl_sync(kFullMask, alpha, 8 * c), a_hi = __shfl_sync(kFullMask, alpha, 8 * c + 4);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    acc[m][0] *= a_lo;
    acc[m][1] *= a_hi;
    acc[m][2] *= a_lo;
    acc[m][3] *= a_hi;
  }
}

// The sum over a quad's 4 lanes (lanes 4g .. 4g + 3).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 1);
  return x + __shfl_xor_sync(kFullMask, x, 2);
}

// A warp's end of an item (lane (g, c)), after quad_sum: the warp's accumulators into s_acc_warp
// ([kMmaHeads][D] fp32: m-tile m's rows g, g + 8 are dims dim_of(m)
// and + 1, its columns heads 2c, 2c + 1) and (max, sum) into s_ml_warp ([kMmaHeads][2]).
template <int D, int MT, typename DimOf>
__device__ __forceinline__ void store_warp_partials(float* s_acc_warp, float* s_ml_warp, const float (&acc)[MT][4],
                                                    float m_run, float l_run, int g, int c, DimOf dim_of) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float* lo = s_acc_warp + 2 * c * D + dim_of(m);   // head 2c
    float* hi = lo + D;                               // head 2c + 1
    lo[0] = acc[m][0];
    hi[0] = acc[m][1];
    lo[1] = acc[m][2];
    hi[1] = acc[m][3];
  }
  if (c == 0) {
    s_ml_warp[g * 2] = m_run;
    s_ml_warp[g * 2 + 1] = l_run;
  }
}

}  // namespace bulk_detail

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One work item (decode_item's contract), as decode_item_mma<T, T, D, 1> computes it. fills: the
// warp's ring position (in: this item's iteration 0; out: the next item's); pre: this item's
// iterations already filled (in), the next item's (out); next: the worker's next item, if has_next.
template <typename T, int D>
__device__ __forceinline__ void decode_item_bulk(const DecodeArgs& a, unsigned char* smem, const WorkItem& it,
                                                 uint32_t& fills, int& pre, const WorkItem& next, bool has_next) {
  using S = BulkShape<D>;
  constexpr int KSTEPS = S::KSTEPS, MT = S::MT, HT = kMmaHeads, NTHREADS = kDecodeWarps * 32;
  const int seq = it.seq, start = it.start, end = it.end;
  int* s_table = reinterpret_cast<int*>(smem + decode_bulk_extra_bytes<D>());

  int tid = threadIdx.x, bx = blockIdx.x;
  asm volatile("" : "+r"(tid), "+r"(bx));   // (decode_item_mma: nothing hoisted out of the item loop)
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int kvh = bx / a.head_chunks, chunk = bx % a.head_chunks;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int head0 = kvh * group + chunk * a.head_tile;
  const int nheads = min(a.head_tile, group - chunk * a.head_tile);
  const int log2b = a.log2_block_size;

  const ItemTable<T, D, S::STEP> tbl(a, it, kvh);
  const int first_blk = tbl.first_blk;

  // Query: lane (g, c) takes head g's chunks k_chunk(c, j) (zeros past the tile's heads), as they
  // are (16-bit, exact; the scores are scaled after the mma), into s_q[k-step][lane], which every
  // warp reads: warp w loads and stores chunks j = w, w + kDecodeWarps, ...
  constexpr int QPW = (S::KCHUNKS + kDecodeWarps - 1) / kDecodeWarps;   // chunks a warp stores (at most)
  uint4 qraw[QPW];
  const bool live = g < nheads;
  {
    const T* qp = static_cast<const T*>(a.query) + static_cast<int64_t>(seq) * a.q_stride_seq +
                  static_cast<int64_t>(head0 + (live ? g : 0)) * a.q_stride_head;
#pragma unroll
    for (int i = 0; i < QPW; ++i) {
      const int j = warp + i * kDecodeWarps;
      qraw[i] = make_uint4(0, 0, 0, 0);
      if (live && j < S::KCHUNKS) qraw[i] = *reinterpret_cast<const uint4*>(qp + 8 * S::k_chunk(c, j));
    }
  }
  tbl.template stage<NTHREADS>(a, s_table, tid);
  uint2* s_q = reinterpret_cast<uint2*>(smem) + lane;
#pragma unroll
  for (int i = 0; i < QPW; ++i) {
    const int j = warp + i * kDecodeWarps;
    if (j < S::KCHUNKS) {
      s_q[(2 * j) * 32] = make_uint2(qraw[i].x, qraw[i].y);
      s_q[(2 * j + 1) * 32] = make_uint2(qraw[i].z, qraw[i].w);
    }
  }
  __syncthreads();   // s_table and s_q ready

  const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(smem + S::BARS_AT)) +
                        8 * warp * kBulkStages;
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem + S::RING_AT)) +
                        warp * kBulkStages * S::STAGE_BYTES;
  const unsigned char* ring_g = smem + S::RING_AT + warp * kBulkStages * S::STAGE_BYTES;
  const int n_iter = end > start ? (end - start + S::STEP - 1) / S::STEP : 0;
  const int warp_tok0 = start + warp * 16;
  const uint32_t fills0 = fills;   // ring position of this item's iteration 0

  // One ring position's rows into its stage: lane l copies token t's row (l < 16: K, else V) from
  // block b (-1: nothing copied; the stage's byte count counts the copies made).
  const T* row_base = static_cast<const T*>(lane < 16 ? a.k_cache : a.v_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head;
  auto fill_at = [&](uint32_t pos, int t, int b) {
    const uint32_t st = pos % kBulkStages;
    const bool ok = b >= 0;
    const uint32_t copies = __popc(__ballot_sync(kFullMask, ok));
    if (lane == 0) mbar_arrive_expect(bars + 8 * st, copies * S::ROW_BYTES);
    if (ok)
      bulk_copy(ring + st * S::STAGE_BYTES + lane * S::ROW_STRIDE,
                row_base + static_cast<int64_t>(b) * a.kv_stride_block + (t & (a.block_size - 1)) * D, S::ROW_BYTES,
                bars + 8 * st);
  };
  auto fill = [&](int j) {   // this item's iteration j (block ids from the staged slice)
    const int t = warp_tok0 + j * S::STEP + (lane & 15);
    fill_at(fills0 + j, t, t < end ? s_table[(t >> log2b) - first_blk] : -1);
  };
  // The next item's first kBulkStages - 1 iterations go in behind this item's last ones (block ids
  // straight from the block table), so that its first copies are in flight while this item ends;
  // only behind an item of that many iterations (the ring positions line up).
  const bool ahead = has_next && n_iter >= kBulkStages - 1;
  const int next_iters = ahead ? (next.end - next.start + S::STEP - 1) / S::STEP : 0;
  const int next_first = ahead ? next.start >> log2b : 0;
  const int32_t* next_row = ahead ? a.block_tables + static_cast<int64_t>(next.seq) * next.table_stride + next_first : nullptr;
  auto fill_next = [&](int k) {
    const int t = next.start + warp * 16 + k * S::STEP + (lane & 15);
    int b = -1;
    if (t < next.end) {
      b = next_row[(t >> log2b) - next_first];
      if (b >= a.num_cache_blocks) b = -1;
    }
    fill_at(fills0 + n_iter + k, t, b);
  };

  fence_proxy_async();   // the previous item's stores into the rings before this item's copies
  wait_for_prerequisite_grids();   // the K/V only from here (pdl.cuh; paged_decode.cuh decode_item)
#pragma unroll
  for (int j = 0; j < kBulkStages - 1; ++j)
    if (j >= pre && j < n_iter) fill(j);   // (the first `pre` came in behind the previous item)

  float acc[MT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[m][e] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;

  for (int it = 0; it < n_iter; ++it) {
    tbl.prefetch_ahead(a, s_table, it, tid);
    if (it + kBulkStages - 1 < n_iter) {
      __syncwarp();   // every lane's reads of the stage refilled here (iteration it - 1's) are done
      fill(it + kBulkStages - 1);
    } else if (ahead && it + kBulkStages - 1 - n_iter < next_iters) {
      __syncwarp();
      fill_next(it + kBulkStages - 1 - n_iter);
    }
    // This iteration's n-tiles: first token and block (-1: not loaded), warp-uniform.
    int tb[2], blk[2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      tb[n] = warp_tok0 + it * S::STEP + 8 * n;
      blk[n] = tb[n] < end ? s_table[(tb[n] >> log2b) - first_blk] : -1;
    }
    const uint32_t round = fills0 + it;
    mbar_wait(bars + 8 * (round % kBulkStages), (round / kBulkStages) & 1);
    const unsigned char* stage = ring_g + (round % kBulkStages) * S::STAGE_BYTES;

    // Scores: head g, tokens 2c, 2c+1 of each n-tile (log2 domain; -inf where not loaded).
    uint4 kr[2][S::KCHUNKS];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int j = 0; j < S::KCHUNKS; ++j)
        kr[n][j] = *reinterpret_cast<const uint4*>(stage + (8 * n + g) * S::ROW_STRIDE + 16 * S::k_chunk(c, j));
    float d[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) d[n][e] = 0.f;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      const uint2 q = s_q[s * 32];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const uint4& v = kr[n][s / 2];
        Mma<T>::run(d[n], {q.x, 0u, q.y, 0u}, s % 2 ? v.z : v.x, s % 2 ? v.w : v.y);
      }
    }
    float sc[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const bool blk_ok = blk[n] >= 0;
      sc[n][0] = blk_ok && tb[n] + 2 * c < end ? d[n][0] * a.scale_log2 : -INFINITY;
      sc[n][1] = blk_ok && tb[n] + 2 * c + 1 < end ? d[n][1] * a.scale_log2 : -INFINITY;
    }
    timeline_progress(it, n_iter);

    // V: rows 2c, 2c + 1 of both n-tiles, chunks v_chunk(g, j) (word w: chunk w / 4, word w % 4).
    uint32_t vr[2][2][4 * S::VCHUNKS];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < S::VCHUNKS; ++j) {
          const uint4 u = *reinterpret_cast<const uint4*>(stage + (16 + 8 * n + 2 * c + r) * S::ROW_STRIDE +
                                                          16 * S::v_chunk(g, j));
          vr[n][r][4 * j] = u.x; vr[n][r][4 * j + 1] = u.y; vr[n][r][4 * j + 2] = u.z; vr[n][r][4 * j + 3] = u.w;
        }
    if (blk[0] < 0 || blk[1] < 0 || tb[1] + 8 > end) {   // rows not copied: their stale V zeroed
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t keep = blk[n] >= 0 && tb[n] + 2 * c + r < end ? ~0u : 0u;
#pragma unroll
          for (int w = 0; w < 4 * S::VCHUNKS; ++w) vr[n][r][w] &= keep;
        }
    }

    // Online softmax of head g (the quad's 4 lanes hold its 4 scores each).
    uint32_t pb[2];
    bulk_detail::online_softmax_step<T>(sc, m_run, l_run, acc, pb, c);
    // O^T += V^T P^T over the 16 tokens: m-tile w, rows g, g + 8 = the word's low and high elements.
#pragma unroll
    for (int w = 0; w < MT; ++w) {
      const uint32_t t0 = vr[0][0][w], t1 = vr[0][1][w], t8 = vr[1][0][w], t9 = vr[1][1][w];
      Mma<T>::run(acc[w], {__byte_perm(t0, t1, 0x5410u), __byte_perm(t0, t1, 0x7632u),
                           __byte_perm(t8, t9, 0x5410u), __byte_perm(t8, t9, 0x7632u)}, pb[0], pb[1]);
    }
  }
  fills = fills0 + n_iter;
  pre = ahead ? min(kBulkStages - 1, next_iters) : 0;

  // Head g's sum over its quad; then across warps through shared memory: each warp's accumulators
  // in the stage of its last iteration (the only one no copy is in flight to), the (max, sum) pairs
  // in their own area.
  l_run = bulk_detail::quad_sum(l_run);
  const int last = static_cast<int>((fills + kBulkStages - 1) % kBulkStages);
  float* s_acc = reinterpret_cast<float*>(smem + S::RING_AT + last * S::STAGE_BYTES);   // warp w's: + w * acc_stride
  constexpr int acc_stride = kBulkStages * S::STAGE_BYTES / 4;
  float* s_ml = reinterpret_cast<float*>(smem + S::Q_BYTES);                            // [kDecodeWarps][HT][2]
  __syncwarp();   // every lane's reads of that stage (the last iteration's K and V) before these stores
  bulk_detail::store_warp_partials<D>(s_acc + warp * acc_stride, s_ml + warp * HT * 2, acc, m_run, l_run, g, c,
                         [&](int m) { return 8 * S::v_chunk(g, m / 4) + 2 * (m % 4); });
  fence_proxy_async();   // these stores before later copies into the same stage
  __syncthreads();

  write_item_output<T, D, HT>(a, s_acc, s_ml, nheads, head0, it, acc_stride);
}
#endif

// grid and block as paged_decode_kernel; dynamic smem: decode_bulk_extra_bytes<D>() + the table
// slice (BulkShape<D>::TABLE_BYTES in work-list mode). Hopper only (the launcher never picks it
// elsewhere; built empty for older targets).
template <typename T, int D>
__global__ void __launch_bounds__(kDecodeWarps * 32, BulkShape<D>::BLOCKS) paged_decode_bulk_kernel(const DecodeArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  allow_dependent_launch();   // the merge kernel may start early (paged_decode_merge.cuh)
  timeline_block_entry();
  {
    const int warp = threadIdx.x >> 5;
    const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(smem + BulkShape<D>::BARS_AT)) +
                          8 * warp * kBulkStages;
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int st = 0; st < kBulkStages; ++st) mbar_init(bars + 8 * st, 1);
      fence_barrier_init();
    }
    __syncwarp();
  }
  uint32_t fills = 0;   // this warp's ring position
  int pre = 0;          // iterations of the next item already filled
  const int longest = a.max_blocks_per_seq << a.log2_block_size;
  if (a.work == nullptr) {
    const int seq = blockIdx.y, split = blockIdx.z;
    const int ctx = max(0, min(a.context_lens[seq], longest));
    const int start = split * a.partition_tokens;
    if (split > 0 && start >= ctx) return;
    const WorkItem it{seq, split, start, min(ctx, start + a.partition_tokens), a.table_stride};
    timeline_item_start(0);
    decode_item_bulk<T, D>(a, smem, it, fills, pre, it, false);
    timeline_item_end(0, it.end - it.start);
    return;
  }
  WorkItem it;
  if (!work_item(a, 0, longest, &it)) return;
  for (int r = 0;; ++r) {   // (paged_decode.cuh: work_item), each item's successor read at its start
    WorkItem next;
    const bool more = work_item(a, r + 1, longest, &next);
    timeline_item_start(r);
    decode_item_bulk<T, D>(a, smem, it, fills, pre, next, more && KVPAGER_DECODE_BULK_NEXT);
    timeline_item_end(r, it.end - it.start);
    __syncthreads();
    if (!more) break;
    it = next;
  }
#endif
}

}  // namespace kvpager
