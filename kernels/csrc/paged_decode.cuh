// Paged decode attention: one query token per sequence over its paged K/V cache.
//
// One thread block handles one work item at a time, a (KV head, sequence, token range), for up to
// HT query heads of that KV head's GQA group, so each K/V byte of the range is read once for the
// whole group. Ranges come either from the grid (split-KV planned from the table's width) or
// from the step's work list (planned once per step from the real lengths, kernels/decode_plan.py).
// Work split inside the block:
//   - a token row of D elements is read as D / VEC 16-byte vectors; LPT = min(32, D / VEC)
//     lanes share a row ("lane group"), each lane holding VPL = D / VEC / LPT vectors of it,
//     so a warp reads TPW = 32 / LPT rows per load instruction (e.g. bf16, D = 128: 16 lanes a
//     row, 2 rows a warp, 512 contiguous bytes when the rows sit in one block);
//   - every lane keeps its slice of the query for all HT heads (fp32, pre-scaled by
//     scale * log2 e) and fp32 accumulators for the same slice of V, for all HT heads;
//   - each iteration a warp takes U rows per lane group (U * TPW tokens); loads of the next
//     iteration's K are issued right after the dot products and those of V right after the
//     P*V products (software pipelining: the registers are reused, no extra buffers);
//   - dot products are reduced across the lane group with a "reduce-scatter" butterfly: HT
//     partial sums shrink to one per lane in log2(HT) exchange steps, so lane r ends up owning
//     head r / (LPT / HT); that owner runs the online softmax (fp32, log2 domain) of its head,
//     and the probabilities are broadcast back with one shuffle per head;
//   - each lane group keeps its own online-softmax state; states are merged across lane groups
//     by shuffles and across warps through shared memory at the end.
// Tokens at or past the context, and tokens whose block-table entry is not a valid block id,
// are never loaded (their score is -inf and their V is zero).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "launch.h"
#include "decode_timeline.cuh"
#include "pdl.cuh"

namespace kvpager {

// Tuning knobs fixed at build time (benchmarks/kernels.py --variants rebuilds with others):
// warps per thread block, and (KVPAGER_DECODE_MIN_BLOCKS, default: decode_min_blocks below)
// the minimum resident blocks per SM asked of the register allocator. (Rows in flight, the
// third knob, is a template parameter the planner picks.)
#ifndef KVPAGER_DECODE_WARPS
#define KVPAGER_DECODE_WARPS 4
#endif

// KVPAGER_DECODE_STAGE_BATCH: block-table entries a thread reads at once when it stages an item's
// slice (ItemTable::stage); 1 reads them one at a time, each store waiting on its load (the code
// before 2026-11-26, fifth session; docs/performance.md has both timed).
#ifndef KVPAGER_DECODE_STAGE_BATCH
#define KVPAGER_DECODE_STAGE_BATCH 4
#endif

// KVPAGER_DECODE_QUERY_FENCE=0: no fence on the query in the register-capped instances (decode_item),
// to A/B it.
#ifndef KVPAGER_DECODE_QUERY_FENCE
#define KVPAGER_DECODE_QUERY_FENCE 1
#endif

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kDecodeWarps = KVPAGER_DECODE_WARPS;

// ---------------------------------------------------------------------------------------------
// Element types: 16 bytes of T <-> floats.

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kVec = 4;
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
  }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

template <>
struct Elem<__half> {
  static constexpr int kVec = 8;
  static __device__ __forceinline__ float2 pair(uint32_t w) {
    __half2 h;
    static_assert(sizeof(h) == sizeof(w), "half2 is 4 bytes");
    memcpy(&h, &w, sizeof(w));
    return __half22float2(h);
  }
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    const float2 a = pair(u.x), b = pair(u.y), c = pair(u.z), d = pair(u.w);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
    f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    // bf16 is the top half of an fp32: widening is a shift or a mask.
    f[0] = __uint_as_float(u.x << 16); f[1] = __uint_as_float(u.x & 0xffff0000u);
    f[2] = __uint_as_float(u.y << 16); f[3] = __uint_as_float(u.y & 0xffff0000u);
    f[4] = __uint_as_float(u.z << 16); f[5] = __uint_as_float(u.z & 0xffff0000u);
    f[6] = __uint_as_float(u.w << 16); f[7] = __uint_as_float(u.w & 0xffff0000u);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// fp8 e4m3 KV storage (read only here; write_kv quantizes): the stored value times the
// tensor's scale is the real one; the kernel folds k_scale into the query and applies v_scale
// to the output. 16 elements per 16-byte vector, so a lane holds twice the elements of a row
// that it holds with a 16-bit cache (more registers; 8-byte vectors with the same registers as
// 16-bit caches measured slower on an H100, docs/performance.md).
template <>
struct Elem<__nv_fp8_e4m3> {
  static constexpr int kVec = 16;
  static __device__ __forceinline__ float2 pair(uint32_t w) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3);
    return __half22float2(__half2(h));
  }
  static __device__ __forceinline__ void unpack(const uint4& u, float* f) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 lo = pair(w[i] & 0xffffu), hi = pair(w[i] >> 16);
      f[4 * i] = lo.x; f[4 * i + 1] = lo.y; f[4 * i + 2] = hi.x; f[4 * i + 3] = hi.y;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Small device helpers.

// 16-byte read-only streaming load, predicated: returns zeros (and touches no memory) when
// !pred. K/V are read once per kernel, so skip L1 and ask L2 to fetch 256-byte sectors.
__device__ __forceinline__ uint4 load_kv16(const void* ptr, bool pred) {
  uint4 v;
  asm("{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %5, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  mov.b32 %1, 0;\n"
      "  mov.b32 %2, 0;\n"
      "  mov.b32 %3, 0;\n"
      "  @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

// Asks L2 to fetch `bytes` (a multiple of 16, 16-byte aligned) at `ptr` ahead of the loads,
// without registers or shared memory: the bulk-copy engine keeps many more DRAM requests in
// flight than the warps' own loads do. Hopper only; a no-op on older GPUs.
__device__ __forceinline__ void prefetch_l2(const void* ptr, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
#else
  (void)ptr;
  (void)bytes;
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// exp2(x - m) with exp2(-inf - anything) = 0 (no NaN from -inf - -inf).
__device__ __forceinline__ float exp2_diff(float x, float m) {
  return x == -INFINITY ? 0.f : fast_exp2(x - m);
}

// One butterfly step of the reduce-scatter: CNT values per lane become CNT / 2, exchanging
// with the lane MASK apart; the lane whose MASK bit is set keeps the upper half.
template <int CNT, int MASK, int N>
__device__ __forceinline__ void scatter_steps(float (&v)[N], int lane) {
  if constexpr (CNT > 1) {
    const bool upper = (lane & MASK) != 0;
#pragma unroll
    for (int i = 0; i < CNT / 2; ++i) {
      const float send = upper ? v[i] : v[i + CNT / 2];
      const float keep = upper ? v[i + CNT / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(kFullMask, send, MASK);
    }
    scatter_steps<CNT / 2, MASK / 2, N>(v, lane);
  }
}

// Sums v[0..HT) over the LPT lanes of a lane group (LPT a power of two >= HT). Returns, in
// lane r of the group, the full sum of element r / (LPT / HT). log2(LPT) shuffles in all.
template <int HT, int LPT>
__device__ __forceinline__ float group_sum_scatter(float (&v)[HT], int lane) {
  static_assert(HT <= LPT, "a lane group must have at least one lane per head");
  scatter_steps<HT, LPT / 2, HT>(v, lane);
  float s = v[0];
#pragma unroll
  for (int mask = LPT / (2 * HT); mask >= 1; mask >>= 1) s += __shfl_xor_sync(kFullMask, s, mask);
  return s;
}

// C is the cache's element type (the layout follows its 16-byte vectors).
// LOADS: 16-byte loads of K (and as many of V) each lane has in flight per iteration, i.e.
// U = LOADS / VPL token rows per lane group. Fewer: fewer registers, more resident warps; more:
// more bytes in flight per warp. The planner picks per call (launch.cu).
template <typename C, int D, int LOADS>
struct DecodeShape {
  static constexpr int VEC = Elem<C>::kVec;           // elements per 16-byte vector
  static constexpr int ROW_VECS = D / VEC;            // vectors per token row
  static constexpr int LPT = ROW_VECS < 32 ? ROW_VECS : 32;   // lanes per token row
  static constexpr int VPL = ROW_VECS / LPT;          // vectors per lane per row
  static constexpr int TPW = 32 / LPT;                // rows per warp per load
  static constexpr int U_WANT = VPL >= LOADS ? 1 : LOADS / VPL;
  static constexpr int U_MAX = kPartitionAlign / (kDecodeWarps * TPW);   // whole iterations per partition
  static constexpr int U = U_WANT < U_MAX ? U_WANT : U_MAX;   // rows per lane group per iteration
  static constexpr int E = VPL * VEC;                 // elements per lane
  static constexpr int WARP_TOKENS = TPW * U;
  static constexpr int STEP = kDecodeWarps * WARP_TOKENS;   // tokens per block iteration
  static_assert(D % (VEC * LPT) == 0, "head_dim must split evenly over the lanes");
  static_assert(kPartitionAlign % STEP == 0, "a partition must be whole iterations");
};

// Minimum resident blocks per SM asked of the register allocator. The 2-loads instances exist
// to run 4 blocks (16 warps) per SM once a grid fills whole waves, so with 4 warps a block they
// ask for 4 (128 registers) where that fits without spills: head tiles up to 4 over 16- and
// 32-bit caches (ptxas -v, sm_90a: 109-128 registers, no spills; unbounded, bf16 d128 took 150
// registers, 3 blocks per SM, and the planner stopped picking the instance). Elsewhere 1.
template <typename C, int HT, int LOADS>
__host__ __device__ constexpr int decode_min_blocks() {
#ifdef KVPAGER_DECODE_MIN_BLOCKS
  return KVPAGER_DECODE_MIN_BLOCKS;
#else
  return kDecodeWarps == 4 && LOADS == 2 && HT <= 4 && sizeof(C) >= 2 ? 4 : 1;
#endif
}

// Shared memory (dynamic) of one decode block: the block-table slice during the main loop,
// then the per-warp partial results.
template <int D, int HT>
constexpr int decode_merge_smem_bytes() {
  return kDecodeWarps * HT * D * 4 + kDecodeWarps * HT * 2 * 4;
}

// ---------------------------------------------------------------------------------------------
// A work list as the decode kernels read it (layout: launch.h, DecodeArgs::work).
// Tokens [start, end) of sequence seq, its piece-th piece (split); its block ids in the table row
// seq, rows table_stride ints apart.
struct WorkItem {
  int seq, piece, start, end;
  int64_t table_stride;
};

// Per sequence of a work list: (first partial row, piece count).
__device__ __forceinline__ const int32_t* work_spans(const DecodeArgs& a) {
  return a.work + kWorkHeader + 2 * static_cast<int64_t>(a.work_capacity);
}

// Worker blockIdx.y's item of round r, its end clamped to `longest` (the tokens a table row holds);
// false past the worker's last item. The header (one 16-byte load) and the record are read
// together (the index is below capacity, so the read is in bounds), afresh per item, through a
// pointer laundered by empty asm so that the compiler hoists none of it out of the worker's loop.
// The sequence's span, which only the item's output needs, is read at its end (item_destination).
// (An L1 prefetch of it here, prefetch.global.L1 = CCTL.E.PF1, cost the work list 6-10 points of
// the copy ceiling on split sequences, H100: measured and dropped.)
__device__ __forceinline__ bool work_item(const DecodeArgs& a, int r, int longest, WorkItem* it) {
  const int32_t* work = a.work;
  asm volatile("" : "+l"(work));
  const int64_t k = work_item_index(r, blockIdx.y, a.work_workers);
  if (k >= a.work_capacity) return false;
  const int4 header = *reinterpret_cast<const int4*>(work);   // n, partition, table stride, 0
  const int2 rec = reinterpret_cast<const int2*>(work + kWorkHeader)[k];
  if (k >= header.x) return false;
  const uint32_t code = static_cast<uint32_t>(rec.x);
  it->seq = static_cast<int>(code >> 16);
  it->piece = static_cast<int>(code & 0xffffu);
  it->start = it->piece * header.y;
  it->end = max(0, min(rec.y, longest));
  it->table_stride = header.z > 0 ? header.z : a.table_stride;
  return true;
}

// Where an item's result goes: the output rows when `direct` (its sequence is one piece or one
// split), else partial row `row`. Read at the item's end, where it is needed, so nothing of it is
// held in registers across the main loop.
__device__ __forceinline__ void item_destination(const DecodeArgs& a, const WorkItem& it, bool* direct, int64_t* row) {
  if (a.work == nullptr) {
    *direct = a.num_splits == 1;
    *row = static_cast<int64_t>(it.seq) * a.num_splits + it.piece;
  } else {
    const int2 span = *reinterpret_cast<const int2*>(work_spans(a) + 2 * it.seq);   // (first row, pieces)
    *direct = span.y <= 1;
    *row = static_cast<int64_t>(span.x) + it.piece;
  }
}

// ---------------------------------------------------------------------------------------------
// A work item's block-table slice and the L2 prefetch of its block slabs, shared by both decode
// kernels (C: the cache's element type; STEP: tokens per block iteration). Slice entry i is the
// block holding the item's tokens [(first_blk + i) << log2_block_size, ...); entries that are not a
// valid block id (outside [0, num_cache_blocks)) become -1 and are never dereferenced. Block slabs
// (one head's block_size rows, contiguous) go to L2 a.prefetch_steps iterations ahead of their
// loads: the first ones while the table is staged, the others one iteration at a time.
template <typename C, int D, int STEP>
struct ItemTable {
  int log2b, first_blk, nblk;
  const int32_t* trow;   // the slice in the block table (global memory)
  const C* kslab;        // this KV head's K rows of block 0 (add b * kv_stride_block for block b)
  const C* vslab;
  uint32_t slab_bytes;
  int pd;                // a.prefetch_steps

  __device__ __forceinline__ ItemTable(const DecodeArgs& a, const WorkItem& it, int kvh) {
    log2b = a.log2_block_size;
    first_blk = it.start >> log2b;
    nblk = it.end > it.start ? ((it.end - 1) >> log2b) - first_blk + 1 : 0;
    trow = a.block_tables + static_cast<int64_t>(it.seq) * it.table_stride + first_blk;
    kslab = static_cast<const C*>(a.k_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head;
    vslab = static_cast<const C*>(a.v_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head;
    slab_bytes = static_cast<uint32_t>(a.block_size) * D * static_cast<uint32_t>(sizeof(C));
    pd = a.prefetch_steps;
  }

  // The slice into s_table (thread tid of NTHREADS), the first iterations' slabs into L2. The
  // caller syncs before anyone reads s_table. A thread's entries are read kStageBatch at a time,
  // all loads issued before the first store waits on one (indices clamped into the slice, so the
  // loads need no branch): a slice of up to kStageBatch * NTHREADS entries (8,192 tokens of block
  // 16 with 128 threads) costs one memory latency, not one per NTHREADS entries.
  template <int NTHREADS>
  __device__ __forceinline__ void stage(const DecodeArgs& a, int* s_table, int tid) const {
    constexpr int kStageBatch = KVPAGER_DECODE_STAGE_BATCH;
    const int first_prefetched = min(nblk, (pd * STEP + a.block_size - 1) >> log2b);
    for (int base = tid; base < nblk; base += kStageBatch * NTHREADS) {
      int b[kStageBatch];
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) b[j] = trow[min(base + j * NTHREADS, nblk - 1)];
#pragma unroll
      for (int j = 0; j < kStageBatch; ++j) {
        const int i = base + j * NTHREADS;
        const bool ok = b[j] >= 0 && b[j] < a.num_cache_blocks;
        if (i < nblk) s_table[i] = ok ? b[j] : -1;
        if (ok && i < first_prefetched) {
          prefetch_l2(kslab + static_cast<int64_t>(b[j]) * a.kv_stride_block, slab_bytes);
          prefetch_l2(vslab + static_cast<int64_t>(b[j]) * a.kv_stride_block, slab_bytes);
        }
      }
    }
  }

  // At iteration it: the blocks whose first token falls in iteration it + pd (none when pd is 0),
  // one thread per (block, K or V).
  __device__ __forceinline__ void prefetch_ahead(const DecodeArgs& a, const int* s_table, int it, int tid) const {
    if (pd > 0) {
      const int j = it + pd;
      const int b0 = (j * STEP + a.block_size - 1) >> log2b;
      const int b1 = min(nblk, ((j + 1) * STEP + a.block_size - 1) >> log2b);
      const int i = b0 + (tid >> 1);
      if (i < b1) {
        const int b = s_table[i];
        if (b >= 0) prefetch_l2(((tid & 1) ? vslab : kslab) + static_cast<int64_t>(b) * a.kv_stride_block, slab_bytes);
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Decode kernel.
// grid mode (a.work == nullptr): grid (num_kv_heads * head_chunks, num_seqs, num_splits), one
//   split of one sequence per block;
// work-list mode: grid (num_kv_heads * head_chunks, work_workers), block y running worker y's
//   items of the step's work list (launch.h, kernels/decode_plan.py).
// block: kDecodeWarps * 32 threads; dynamic smem: max(partition_tokens / block_size ints,
// decode_merge_smem_bytes<D, HT>()). T: query and output type; C: cache type (T, or fp8 e4m3
// with 16-bit T).

// The end of a work item, shared by the decode kernels: the warps' partial results (s_acc: per
// warp [HT][D] fp32 accumulators, warp w's at s_acc + w * warp_stride floats; s_ml:
// [kDecodeWarps][HT][2] running max and sum; in shared memory, filled and synced by the caller)
// merged per head, then written where item_destination says: the output rows or a partial row for
// the merge kernel (paged_decode_merge.cuh).
template <typename T, int D, int HT>
__device__ __forceinline__ void write_item_output(const DecodeArgs& a, const float* s_acc, const float* s_ml,
                                                  int nheads, int head0, const WorkItem& it, int warp_stride = HT * D) {
  bool direct;
  int64_t item;
  item_destination(a, it, &direct, &item);
  const int seq = it.seq;
  for (int idx = threadIdx.x; idx < nheads * D; idx += kDecodeWarps * 32) {
    const int g = idx / D, d = idx % D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) mm = fmaxf(mm, s_ml[(w * HT + g) * 2]);
    float ll = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float wt = exp2_diff(s_ml[(w * HT + g) * 2], mm);
      ll += wt * s_ml[(w * HT + g) * 2 + 1];
      o += wt * s_acc[w * warp_stride + g * D + d];
    }
    const float res = ll > 0.f ? o / ll * a.v_scale : 0.f;   // v_scale: 1 unless the cache is fp8
    const int h = head0 + g;
    if (direct) {
      T* op = static_cast<T*>(a.out) + static_cast<int64_t>(seq) * a.o_stride_seq + static_cast<int64_t>(h) * a.o_stride_head;
      op[d] = Elem<T>::from_float(res);
    } else {
      const int64_t row = item * a.num_q_heads + h;
      a.part_out[row * D + d] = res;
      if (d == 0) {
        a.part_ml[row * 2] = mm;
        a.part_ml[row * 2 + 1] = ll;
      }
    }
  }
}

// One work item (`it`: tokens [start, end) of sequence seq), for the query heads of the thread
// block's (KV head, head chunk). Writes the output rows when the item is the whole sequence, else
// its partial row (part_out[row][h][:], part_ml[row][h][:]) for the merge (item_destination).
// Uses the block's dynamic shared memory: the caller syncs before the next item reuses it.
template <typename T, typename C, int D, int HT, int LOADS>
__device__ __forceinline__ void decode_item(const DecodeArgs& a, unsigned char* smem, const WorkItem& it) {
  const int seq = it.seq, start = it.start, end = it.end;
  using S = DecodeShape<C, D, LOADS>;
  constexpr int VEC = S::VEC, LPT = S::LPT, VPL = S::VPL, TPW = S::TPW, U = S::U, E = S::E;
  constexpr int QVEC = Elem<T>::kVec;                   // query elements per 16-byte load
  static_assert(VEC % QVEC == 0, "a lane's cache vector must be whole query vectors");
  constexpr int NT = kDecodeWarps * 32;
  int* s_table = reinterpret_cast<int*>(smem);

  // Laundered through empty asm (as in decode_item_mma): nothing derived from them is hoisted out
  // of the work-list loop to stay live across items.
  int tid = threadIdx.x, bx = blockIdx.x;
  asm volatile("" : "+r"(tid), "+r"(bx));
  const int lane = tid & 31, warp = tid >> 5;
  const int grp = lane / LPT, r = lane % LPT;
  const int kvh = bx / a.head_chunks, chunk = bx % a.head_chunks;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int head0 = kvh * group + chunk * HT;
  const int nheads = min(HT, group - chunk * HT);
  const int log2b = a.log2_block_size;

  const ItemTable<C, D, S::STEP> tbl(a, it, kvh);
  const int first_blk = tbl.first_blk;

  // The iteration in flight: per row of this lane group, whether it is loaded (below end, in a
  // valid block), where, and its K and V vectors.
  bool valid[U];
  int64_t off[U];
  uint4 kr[U][VPL], vr[U][VPL];

  // Query slice for every head of the tile: its loads issued first, in flight with the table's.
  uint4 qraw[HT][VPL][VEC / QVEC];
#pragma unroll
  for (int g = 0; g < HT; ++g) {
    const bool live = g < nheads;
    const T* qp = static_cast<const T*>(a.query) + static_cast<int64_t>(seq) * a.q_stride_seq +
                  static_cast<int64_t>(head0 + (live ? g : 0)) * a.q_stride_head;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
#pragma unroll
      for (int i = 0; i < VEC / QVEC; ++i) {
        qraw[g][j][i] = make_uint4(0, 0, 0, 0);
        if (live) qraw[g][j][i] = *reinterpret_cast<const uint4*>(qp + (j * LPT + r) * VEC + i * QVEC);
      }
  }

  // This split's slice of the block table, once, into shared memory (invalid ids -1); the first
  // slabs to L2 right away, while the prologue runs.
  tbl.template stage<NT>(a, s_table, tid);

  // The query, pre-scaled into the log2 domain. In instances capped for several blocks per SM,
  // opaque to the compiler from here (empty asm): in the work-list copy of the loop it otherwise
  // kept the 16-bit query and unpacked and scaled it again in every iteration (SASS, bf16 d128
  // on sm_90a: 64 FMUL a loop, not 32, and 478 instructions against the grid copy's 405).
  // (Uncapped, the fence cost the 4-loads instance 9 registers and a block per SM.)
  constexpr bool kQueryFence = KVPAGER_DECODE_QUERY_FENCE && decode_min_blocks<C, HT, LOADS>() > 1;
  float q[HT][E];
#pragma unroll
  for (int g = 0; g < HT; ++g) {
#pragma unroll
    for (int j = 0; j < VPL; ++j)
#pragma unroll
      for (int i = 0; i < VEC / QVEC; ++i) Elem<T>::unpack(qraw[g][j][i], &q[g][j * VEC + i * QVEC]);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      q[g][e] *= a.scale_log2;
      if constexpr (kQueryFence) asm volatile("" : "+f"(q[g][e]));
    }
  }
  __syncthreads();   // s_table ready

  float acc[HT][E];
#pragma unroll
  for (int g = 0; g < HT; ++g)
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  float m_own = -INFINITY, l_own = 0.f;                 // online softmax of head r / (LPT / HT)
  const int group_lane0 = lane & ~(LPT - 1);

  const C* kbase = static_cast<const C*>(a.k_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head + r * VEC;
  const C* vbase = static_cast<const C*>(a.v_cache) + static_cast<int64_t>(kvh) * a.kv_stride_head + r * VEC;
  const int n_iter = end > start ? (end - start + S::STEP - 1) / S::STEP : 0;
  const int lane_tok0 = start + warp * S::WARP_TOKENS + grp;

  auto locate = [&](int it) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = lane_tok0 + it * S::STEP + u * TPW;
      bool ok = tok < end;
      const int blk = ok ? s_table[(tok >> log2b) - first_blk] : -1;
      ok = ok && blk >= 0;
      valid[u] = ok;
      off[u] = ok ? static_cast<int64_t>(blk) * a.kv_stride_block + (tok & (a.block_size - 1)) * D : 0;
    }
  };

  locate(0);
  // Everything above read only what was written before the kernel before this one (pdl.cuh): the
  // K/V (a write_kv launched just before may still be writing them) only from here.
  wait_for_prerequisite_grids();
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int j = 0; j < VPL; ++j) kr[u][j] = load_kv16(kbase + off[u] + j * LPT * VEC, valid[u]);
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int j = 0; j < VPL; ++j) vr[u][j] = load_kv16(vbase + off[u] + j * LPT * VEC, valid[u]);

  for (int it = 0; it < n_iter; ++it) {
    tbl.prefetch_ahead(a, s_table, it, tid);
    // Scores of this lane group's U tokens, all heads; reduce-scattered to the head owners.
    float s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float part[HT];
#pragma unroll
      for (int g = 0; g < HT; ++g) part[g] = 0.f;
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        float kf[VEC];
        Elem<C>::unpack(kr[u][j], kf);
#pragma unroll
        for (int g = 0; g < HT; ++g)
#pragma unroll
          for (int t = 0; t < VEC; ++t) part[g] = fmaf(q[g][j * VEC + t], kf[t], part[g]);
      }
      s[u] = group_sum_scatter<HT, LPT>(part, lane);
      if (!valid[u]) s[u] = -INFINITY;
    }
    timeline_progress(it, n_iter);

    // Next iteration's K, into the registers just consumed (valid/off move on to it + 1; this
    // iteration's V is already in registers).
    const bool more = it + 1 < n_iter;
    if (more) {
      locate(it + 1);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < VPL; ++j) kr[u][j] = load_kv16(kbase + off[u] + j * LPT * VEC, valid[u]);
    }

    // Online softmax of the owned head.
    float m_new = m_own;
#pragma unroll
    for (int u = 0; u < U; ++u) m_new = fmaxf(m_new, s[u]);
    const float alpha = exp2_diff(m_own, m_new);
    float p[U];
    float psum = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      p[u] = exp2_diff(s[u], m_new);
      psum += p[u];
    }
    l_own = l_own * alpha + psum;
    m_own = m_new;

    // Rescale, then accumulate P * V for every head (probabilities broadcast from the owners).
#pragma unroll
    for (int g = 0; g < HT; ++g) {
      const float ag = __shfl_sync(kFullMask, alpha, group_lane0 + g * (LPT / HT));
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= ag;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float pg[HT];
#pragma unroll
      for (int g = 0; g < HT; ++g) pg[g] = __shfl_sync(kFullMask, p[u], group_lane0 + g * (LPT / HT));
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        float vf[VEC];
        Elem<C>::unpack(vr[u][j], vf);
#pragma unroll
        for (int g = 0; g < HT; ++g)
#pragma unroll
          for (int t = 0; t < VEC; ++t) acc[g][j * VEC + t] = fmaf(pg[g], vf[t], acc[g][j * VEC + t]);
      }
    }

    // Next iteration's V.
    if (more) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < VPL; ++j) vr[u][j] = load_kv16(vbase + off[u] + j * LPT * VEC, valid[u]);
    }
  }

  // Every head's (max, sum) in every lane, then merge the TPW lane groups of the warp.
  float mg[HT], lg[HT];
#pragma unroll
  for (int g = 0; g < HT; ++g) {
    mg[g] = __shfl_sync(kFullMask, m_own, group_lane0 + g * (LPT / HT));
    lg[g] = __shfl_sync(kFullMask, l_own, group_lane0 + g * (LPT / HT));
  }
#pragma unroll
  for (int mask = LPT; mask < 32; mask <<= 1) {
#pragma unroll
    for (int g = 0; g < HT; ++g) {
      const float mo = __shfl_xor_sync(kFullMask, mg[g], mask);
      const float lo = __shfl_xor_sync(kFullMask, lg[g], mask);
      const float mm = fmaxf(mg[g], mo);
      const float wa = exp2_diff(mg[g], mm), wb = exp2_diff(mo, mm);
      lg[g] = lg[g] * wa + lo * wb;
      mg[g] = mm;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * wa + __shfl_xor_sync(kFullMask, acc[g][e], mask) * wb;
    }
  }

  // Across warps, through shared memory (the table slice is dead now).
  __syncthreads();
  float* s_acc = reinterpret_cast<float*>(smem);            // [kDecodeWarps][HT][D]
  float* s_ml = s_acc + kDecodeWarps * HT * D;              // [kDecodeWarps][HT][2]
  if (grp == 0) {
#pragma unroll
    for (int g = 0; g < HT; ++g)
#pragma unroll
      for (int j = 0; j < VPL; ++j)
#pragma unroll
        for (int t = 0; t < VEC; ++t) s_acc[(warp * HT + g) * D + (j * LPT + r) * VEC + t] = acc[g][j * VEC + t];
    if (r == 0) {
#pragma unroll
      for (int g = 0; g < HT; ++g) {
        s_ml[(warp * HT + g) * 2] = mg[g];
        s_ml[(warp * HT + g) * 2 + 1] = lg[g];
      }
    }
  }
  __syncthreads();

  write_item_output<T, D, HT>(a, s_acc, s_ml, nheads, head0, it);
}

template <typename T, typename C, int D, int HT, int LOADS>
__global__ void __launch_bounds__(kDecodeWarps * 32, decode_min_blocks<C, HT, LOADS>())
paged_decode_kernel(const DecodeArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  allow_dependent_launch();
  timeline_block_entry();   // decode_timeline.cuh: nothing unless built with KVPAGER_DECODE_TIMELINE
  const int longest = a.max_blocks_per_seq << a.log2_block_size;   // tokens a table row can hold
  if (a.work == nullptr) {
    const int seq = blockIdx.y, split = blockIdx.z;
    const int ctx = max(0, min(a.context_lens[seq], longest));
    const int start = split * a.partition_tokens;
    if (split > 0 && start >= ctx) return;   // whole block: nothing of this sequence here
    const WorkItem it{seq, split, start, min(ctx, start + a.partition_tokens), a.table_stride};
    timeline_item_start(0);
    decode_item<T, C, D, HT, LOADS>(a, smem, it);
    timeline_item_end(0, it.end - it.start);
    return;
  }
  // Worker y's items, round by round at computed indices (launch.h): its first record loads with
  // the header, so the first K load waits on that record and then the table, as in grid mode.
  for (int r = 0;; ++r) {
    WorkItem it;
    if (!work_item(a, r, longest, &it)) break;
    timeline_item_start(r);
    decode_item<T, C, D, HT, LOADS>(a, smem, it);
    timeline_item_end(r, it.end - it.start);
    __syncthreads();   // the next item rewrites the shared memory
  }
}

}  // namespace kvpager
