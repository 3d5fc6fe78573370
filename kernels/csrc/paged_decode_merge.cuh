// The split-KV merge (paged_decode.cuh's kernels leave a split sequence's pieces as partial rows):
// out = sum_i w_i o_i / sum_i w_i per (sequence, query head), launched after the decode kernel
// as its programmatic dependent (pdl.cuh) by launch.cu.
#pragma once

#include "paged_decode.cuh"

namespace kvpager {

// The merge's latency (defaults on since 2026-11-26; 0 for the older path, to A/B):
// KVPAGER_MERGE_META_FIRST=1: the merge reads its sequence's context length (grid mode) or span
//   (work list) before griddepcontrol.wait instead of after. Neither is written by the decode
//   kernel (both are inputs of it, written before it started, and it reads them itself without a
//   wait), so only the partial rows need the wait.
// KVPAGER_MERGE_EARLY_ROWS=N (N > 0): each merge warp loads its first N partial rows (splits warp,
//   warp + kMergeWarps, ...: N = 8 covers 32 splits) together with the (max, sum) pairs, before the
//   block reductions, instead of after them; same sums in the same order.
// On the H100 (benchmarks/kernels.py --variants ... --only flush, two runs) both together took the
// short steps 1.5-3.6 points of the copy ceiling higher under the write flush (1 x 32K: 66.0-66.5%
// -> 69.2-69.6% grid) and up to 2 under the clean one, the large ones unchanged. (One warp per
// (sequence, head) instead of a block was tried too: better at 8 x 4K, 5-9 points worse at 1 x 32K,
// where one warp sums 32+ rows in turn.)
#ifndef KVPAGER_MERGE_META_FIRST
#define KVPAGER_MERGE_META_FIRST 1
#endif
#ifndef KVPAGER_MERGE_EARLY_ROWS
#define KVPAGER_MERGE_EARLY_ROWS 8
#endif

constexpr int kMergeThreads = 128;

// Merge of the split-KV partials: out = sum_i w_i * o_i / sum_i w_i,
// w_i = exp2(m_i - max_j m_j) * l_i, over the splits that hold part of the context.
// grid: (num_q_heads, num_seqs); block: kMergeThreads threads; static smem: kMaxSplits weights,
// kMergeWarps x kMaxMergeDim partial sums, a few floats for the reductions.
// Latency-bound (a few KB per block): every read is issued in parallel, never one split after
// another. The threads read the splits' (max, sum) pairs strided, once, into registers (at most
// kMergePairs a thread), and reduce them across the block; then warp w sums splits w,
// w + kMergeWarps, ... over the whole row (16 bytes a lane, independent loads), and the warps'
// sums are added through shared memory. (The first version had every
// thread walk all splits in turn: 11 us for the 32 splits of one 32K sequence on an H100, a sixth
// of that decode step; ncu, 2026-11-25.)
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int kMaxMergeDim = 256;
constexpr int kMergePairs = (kMaxSplits + kMergeThreads - 1) / kMergeThreads;   // (max, sum) pairs a thread holds

// The block's max (MAX) or sum of v, in every thread. FIRST: no earlier reduction read s_red, so
// the barrier that waits for its readers is left out.
template <bool MAX, bool FIRST>
__device__ __forceinline__ float merge_block_reduce(float v, float* s_red) {
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) {
    const float o = __shfl_xor_sync(kFullMask, v, mask);
    v = MAX ? fmaxf(v, o) : v + o;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (!FIRST) __syncthreads();   // s_red free (a previous reduction's readers are done)
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  v = s_red[0];
#pragma unroll
  for (int w = 1; w < kMergeWarps; ++w) v = MAX ? fmaxf(v, s_red[w]) : v + s_red[w];
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
paged_decode_merge_kernel(const DecodeArgs a) {
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_red[kMergeWarps];
  __shared__ __align__(16) float s_sum[kMergeWarps][kMaxMergeDim];
  MergeTimeline tl;   // decode_timeline.cuh: empty unless built with KVPAGER_DECODE_TIMELINE
#if !KVPAGER_MERGE_META_FIRST
  wait_for_prerequisite_grids();   // every partial row written (PDL: this grid may start early)
  tl.mark_waited();
#endif
  const int h = blockIdx.x, seq = blockIdx.y, D = a.head_dim;
  int64_t first;
  int nvalid;
  if (a.work == nullptr) {
    const int ctx = max(0, min(a.context_lens[seq], a.max_blocks_per_seq << a.log2_block_size));
    first = static_cast<int64_t>(seq) * a.num_splits;
    nvalid = min(a.num_splits, (ctx + a.partition_tokens - 1) / a.partition_tokens);
  } else {
    const int32_t* spans = work_spans(a);
    first = spans[2 * seq];
    nvalid = min(spans[2 * seq + 1], kMaxSplits);   // the planner keeps it <= kMaxSplits
    if (nvalid <= 1) return;   // written directly by its only item
  }
#if KVPAGER_MERGE_META_FIRST
  wait_for_prerequisite_grids();   // every partial row written (PDL: this grid may start early)
  tl.mark_waited();
#endif
  // Partial i of this (sequence, head) is row (first + i) * num_q_heads + h.
  const int64_t stride = a.num_q_heads;
  const float* ml = a.part_ml + (first * stride + h) * 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // Splits tid, tid + kMergeThreads, ... (nvalid <= kMaxSplits): each (max, sum) read once, both
  // loads of every pair issued before the first reduction.
  static_assert(kMergePairs * kMergeThreads >= kMaxSplits, "a merge thread holds too few pairs");
  float pm[kMergePairs], pl[kMergePairs];
#pragma unroll
  for (int k = 0; k < kMergePairs; ++k) {
    const int i = tid + k * kMergeThreads;
    pm[k] = -INFINITY;
    pl[k] = 0.f;
    if (i < nvalid) {
      pm[k] = ml[2 * i * stride];
      pl[k] = ml[2 * i * stride + 1];
    }
  }
#if KVPAGER_MERGE_EARLY_ROWS > 0
  // This warp's first KVPAGER_MERGE_EARLY_ROWS partial rows (splits warp, warp + kMergeWarps, ...),
  // loaded now, in flight during the reductions below; summed first, in the same order as the loop.
  constexpr int kEarly = KVPAGER_MERGE_EARLY_ROWS;
  float4 early[kEarly][kMaxMergeDim / 128];
  {
    const float4* po = reinterpret_cast<const float4*>(a.part_out + (first * stride + h) * D);
    const int64_t row_vecs = stride * (D / 4);
#pragma unroll
    for (int e = 0; e < kEarly; ++e) {
      const int i = warp + e * kMergeWarps;
#pragma unroll
      for (int j = 0; j < kMaxMergeDim / 128; ++j) {
        const int c = lane + 32 * j;
        early[e][j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < nvalid && c < D / 4) early[e][j] = po[i * row_vecs + c];
      }
    }
  }
#else
  constexpr int kEarly = 0;
#endif
  float mm = -INFINITY;
#pragma unroll
  for (int k = 0; k < kMergePairs; ++k) mm = fmaxf(mm, pm[k]);
  mm = merge_block_reduce<true, true>(mm, s_red);
  float ll = 0.f;
#pragma unroll
  for (int k = 0; k < kMergePairs; ++k) {
    const int i = tid + k * kMergeThreads;
    if (i < nvalid) {
      const float w = exp2_diff(pm[k], mm) * pl[k];
      s_w[i] = w;
      ll += w;
    }
  }
  ll = merge_block_reduce<false, false>(ll, s_red);   // its barriers also publish s_w
  const float inv = ll > 0.f ? 1.f / ll : 0.f;

  // Warp w: splits w, w + kMergeWarps, ...; lane: float4 columns lane and lane + 32 of the row.
  const int vecs = D / 4;
  const float4* po = reinterpret_cast<const float4*>(a.part_out + (first * stride + h) * D);
  const int64_t row_vecs = stride * vecs;   // float4s between two partials of this head
  float4 acc[kMaxMergeDim / 128];
#pragma unroll
  for (int j = 0; j < kMaxMergeDim / 128; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
#if KVPAGER_MERGE_EARLY_ROWS > 0
#pragma unroll
  for (int e = 0; e < kEarly; ++e) {
    const int i = warp + e * kMergeWarps;
    if (i < nvalid) {
      const float w = s_w[i];
#pragma unroll
      for (int j = 0; j < kMaxMergeDim / 128; ++j) {
        acc[j].x = fmaf(w, early[e][j].x, acc[j].x);
        acc[j].y = fmaf(w, early[e][j].y, acc[j].y);
        acc[j].z = fmaf(w, early[e][j].z, acc[j].z);
        acc[j].w = fmaf(w, early[e][j].w, acc[j].w);
      }
    }
  }
#endif
#pragma unroll 4
  for (int i = warp + kEarly * kMergeWarps; i < nvalid; i += kMergeWarps) {
    const float w = s_w[i];
#pragma unroll
    for (int j = 0; j < kMaxMergeDim / 128; ++j) {
      const int c = lane + 32 * j;
      if (c < vecs) {
        const float4 v = po[i * row_vecs + c];
        acc[j].x = fmaf(w, v.x, acc[j].x);
        acc[j].y = fmaf(w, v.y, acc[j].y);
        acc[j].z = fmaf(w, v.z, acc[j].z);
        acc[j].w = fmaf(w, v.w, acc[j].w);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxMergeDim / 128; ++j) {
    const int c = lane + 32 * j;
    if (c < vecs) reinterpret_cast<float4*>(s_sum[warp])[c] = acc[j];
  }
  __syncthreads();
  T* op = static_cast<T*>(a.out) + static_cast<int64_t>(seq) * a.o_stride_seq + static_cast<int64_t>(h) * a.o_stride_head;
  for (int d = tid; d < D; d += kMergeThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) o += s_sum[w][d];
    op[d] = Elem<T>::from_float(o * inv);
  }
}

}  // namespace kvpager
