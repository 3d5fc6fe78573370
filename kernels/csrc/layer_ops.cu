// The decoder's per-layer elementwise kernels (see layer_ops.h for what each computes). They
// replace about a dozen torch launches per layer with three; no torch here (nvcc alone builds it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "layer_ops.h"
#include "pair_of.cuh"
#include "split_query.cuh"

namespace kvpager {
namespace {

// Load as float32, and round a float32 result to the storage type (round to nearest even, as
// torch does); rounded() is that value back in float32, where torch would round in between.
template <typename T> struct Elem;
template <> struct Elem<float> {
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
  static __device__ __forceinline__ float rounded(float x) { return x; }
};
template <> struct Elem<__half> {
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float rounded(float x) { return __half2float(__float2half_rn(x)); }
};
template <> struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ float rounded(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
};

constexpr int kNormThreads = 256;

template <int kThreads>
__device__ float block_sum(float v) {
  __shared__ float partial[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.f;
  if (threadIdx.x < 32) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (threadIdx.x == 0) partial[0] = v;
  }
  __syncthreads();
  return partial[0];
}

// One thread block per row: pass 1 adds delta (rounded, written back) and sums squares; pass 2
// re-reads the row (now in L1/L2) and writes the normalized, weighted values.
template <typename T>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(RMSNormArgs a) {
  using E = Elem<T>;
  const int64_t row = blockIdx.x;
  T* x = static_cast<T*>(a.x) + row * a.x_stride;
  const T* delta = a.delta ? static_cast<const T*>(a.delta) + row * a.delta_stride : nullptr;
  const T* weight = static_cast<const T*>(a.weight);
  float squares = 0.f;
  for (int i = threadIdx.x; i < a.hidden; i += kNormThreads) {
    float v = E::load(x[i]);
    if (delta != nullptr) {
      const T sum = E::store(__fadd_rn(v, E::load(delta[i])));
      x[i] = sum;
      v = E::load(sum);
    }
    squares = fmaf(v, v, squares);
  }
  const float mean = __fmul_rn(block_sum<kNormThreads>(squares), 1.f / static_cast<float>(a.hidden));
  const float inv = rsqrtf(__fadd_rn(mean, a.eps));
  T* out = static_cast<T*>(a.out) + row * a.out_stride;
  for (int i = threadIdx.x; i < a.hidden; i += kNormThreads) {
    const float normed = E::rounded(__fmul_rn(E::load(x[i]), inv));
    out[i] = E::store(__fmul_rn(E::load(weight[i]), normed));
  }
}

// Column c of a rotated row x (head_dim 2 half): x[c] cos[c] - x[c + half] sin[c] below half,
// x[c] cos[c] + x[c - half] sin[c] from it, each product rounded to T as torch rounds it.
template <typename T>
__device__ __forceinline__ float rotated(float xc, float partner, float cos_c, float sin_c, bool low_half) {
  using E = Elem<T>;
  return __fadd_rn(E::rounded(__fmul_rn(xc, cos_c)), E::rounded(__fmul_rn(low_half ? -partner : partner, sin_c)));
}

// One thread block per token; a thread per (head, i < half) pair rotates x[i] and x[i + half].
// Heads from `first_head` on (the split kernel rotates k alone here).
template <typename T>
__device__ __forceinline__ void rope_pairs(const RopeArgs& a, int first_head) {
  using E = Elem<T>;
  const int64_t t = blockIdx.x;
  const int half = a.head_dim / 2;
  const T* cos = static_cast<const T*>(a.cos) + t * a.cos_stride;
  const T* sin = static_cast<const T*>(a.sin) + t * a.cos_stride;
  for (int idx = threadIdx.x + first_head * half; idx < (a.q_heads + a.k_heads) * half; idx += blockDim.x) {
    const int h = idx / half, i = idx % half;
    T* x = h < a.q_heads ? static_cast<T*>(a.q) + t * a.q_stride_tok + h * a.q_stride_head
                         : static_cast<T*>(a.k) + t * a.k_stride_tok + (h - a.q_heads) * a.k_stride_head;
    const float x1 = E::load(x[i]), x2 = E::load(x[i + half]);
    const float lo = rotated<T>(x1, x2, E::load(cos[i]), E::load(sin[i]), true);
    const float hi = rotated<T>(x2, x1, E::load(cos[i + half]), E::load(sin[i + half]), false);
    x[i] = E::store(lo);
    x[i + half] = E::store(hi);
  }
}

// Four consecutive elements of T as two pairs, loaded or stored as one aligned access.
template <typename T>
struct alignas(4 * sizeof(T)) QuadPairs {
  typename PairOf<T>::P p[2];
  static __device__ __forceinline__ QuadPairs at(const T* x) { return *reinterpret_cast<const QuadPairs*>(x); }
};

// The rotation of four pairs of columns (rope_quad, and the split writer's rotated_x4_pair):
// x1 = a row's columns i .. i + 3 (below half), x2 = their partners i + half .. i + half + 3;
// (c1, s1) and (c2, s2) the token's cos and sin at those columns. lo, hi: the rotated columns.
template <typename T>
__device__ __forceinline__ void rotate_quad(const QuadPairs<T>& x1, const QuadPairs<T>& x2, const QuadPairs<T>& c1,
                                            const QuadPairs<T>& s1, const QuadPairs<T>& c2, const QuadPairs<T>& s2,
                                            QuadPairs<T>& lo, QuadPairs<T>& hi) {
  using F = PairOf<T>;
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const float2 a = F::unpack(x1.p[w]), b = F::unpack(x2.p[w]);
    const float2 ca = F::unpack(c1.p[w]), sa = F::unpack(s1.p[w]), cb = F::unpack(c2.p[w]), sb = F::unpack(s2.p[w]);
    lo.p[w] = F::pack(rotated<T>(a.x, b.x, ca.x, sa.x, true), rotated<T>(a.y, b.y, ca.y, sa.y, true));
    hi.p[w] = F::pack(rotated<T>(b.x, a.x, cb.x, sb.x, false), rotated<T>(b.y, a.y, cb.y, sb.y, false));
  }
}

// Pairs i .. i + 3 of row x and their partners i + half .. i + half + 3 rotated in place, each
// four loaded and stored as one access (cos, sin: the token's rows).
template <typename T>
__device__ __forceinline__ void rope_quad(T* x, const T* cos, const T* sin, int half, int i) {
  using Q = QuadPairs<T>;
  Q lo, hi;
  rotate_quad(Q::at(x + i), Q::at(x + i + half), Q::at(cos + i), Q::at(sin + i), Q::at(cos + i + half),
              Q::at(sin + i + half), lo, hi);
  *reinterpret_cast<Q*>(x + i) = lo;
  *reinterpret_cast<Q*>(x + i + half) = hi;
}

// rope_pairs with a thread per four consecutive pairs (RopeArgs::quads): every row of q, k, cos
// and sin aligned to 4 elements.
template <typename T>
__device__ __forceinline__ void rope_quads(const RopeArgs& a, int first_head) {
  const int64_t t = blockIdx.x;
  const int half = a.head_dim / 2, quads = half / 4;
  const T* cos = static_cast<const T*>(a.cos) + t * a.cos_stride;
  const T* sin = static_cast<const T*>(a.sin) + t * a.cos_stride;
  for (int idx = threadIdx.x + first_head * quads; idx < (a.q_heads + a.k_heads) * quads; idx += blockDim.x) {
    const int h = idx / quads;
    T* x = h < a.q_heads ? static_cast<T*>(a.q) + t * a.q_stride_tok + h * a.q_stride_head
                         : static_cast<T*>(a.k) + t * a.k_stride_tok + (h - a.q_heads) * a.k_stride_head;
    rope_quad<T>(x, cos, sin, half, (idx % quads) * 4);
  }
}

template <typename T>
__global__ void rope_kernel(RopeArgs a) {
  if (a.quads)
    rope_quads<T>(a, 0);
  else
    rope_pairs<T>(a, 0);
}

// How rope_split_query rotates k, for A/B timing: 2 (default, where rows align) four pairs a
// thread in the same pass as q's split, a block's threads taking q's rows, then k's quads; 1 four
// pairs a thread after q; 0 a pair a thread after q (as where rows do not align).
#ifndef KVPAGER_ROPE_SPLIT_K
#define KVPAGER_ROPE_SPLIT_K 2
#endif

// Four columns c .. c + 3 below half (lo) and their partners c + half .. c + half + 3 (hi), loaded
// by the caller, rotated (rotate_quad; cos/sin rows given; none: as they are): low and high, two
// words of T pairs each.
template <typename T, int D>
__device__ __forceinline__ void rotated_x4_pair(QuadPairs<T> lo, QuadPairs<T> hi, const T* cos, const T* sin, int c,
                                                uint2& low, uint2& high) {
  using Q = QuadPairs<T>;
  constexpr int half = D / 2;
  if (cos != nullptr) {
    const Q x1 = lo, x2 = hi;
    rotate_quad(x1, x2, Q::at(cos + c), Q::at(sin + c), Q::at(cos + c + half), Q::at(sin + c + half), lo, hi);
  }
  low = make_uint2(lo.p[0], lo.p[1]);
  high = make_uint2(hi.p[0], hi.p[1]);
}

// Four words (8 values of T: columns c .. c + 3 and c + 16 .. c + 19) split under `up` (2^f) into
// their 16-byte chunk of a split row (split_query.cuh): hi terms, then lo terms.
template <typename T>
__device__ __forceinline__ uint4 split_chunk(const uint32_t (&w)[4], float up) {
  uint32_t hi[4], lo[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) split_query_pair<T>(w[i], up, hi[i], lo[i]);
  return make_uint4(hi[0] | (hi[1] << 16), hi[2] | (hi[3] << 16), lo[0] | (lo[1] << 16), lo[2] | (lo[3] << 16));
}

// A row of q (head h of token t) rotated and split: D / 16 consecutive threads per row, this one
// its j-th. It rotates columns c .. c + 3 and c + 16 .. c + 19 of k-step kk (< D / 64) with their
// partners half a row on (k-step kk + D / 64), so that it reads only its own columns, and writes
// those two k-steps' 16-byte chunks of the split row (a kept token's rotated values in place too);
// the row's largest |q| is shared by shuffles among the row's threads (`group`, within a warp).
template <typename T, int D>
__device__ __forceinline__ void split_query_part(const RopeSplitArgs& s, const T* cos, const T* sin, int64_t t, int h,
                                                 int j, bool keep_q, unsigned group) {
  constexpr int TPR = D / 16, KS = D / 32;   // threads per row; k-steps of 32 columns
  const RopeArgs& a = s.rope;
  const int kk = j >> 2, t4 = j & 3, c = kk * 32 + 4 * t4;   // kk < KS / 2: c and c + 16 below half
  T* x = static_cast<T*>(a.q) + t * a.q_stride_tok + h * a.q_stride_head;
  // The thread's four loads of q issued together, before either rotation's cos/sin branch (loaded
  // inside each rotation, the second pair's waited behind the first's rotation: two DRAM round trips
  // a thread, and the writer 4.5-6 us slower than RoPE in place at 16K tokens; now as fast).
  using Q = QuadPairs<T>;
  const Q qa = Q::at(x + c), qa_half = Q::at(x + c + D / 2), qb = Q::at(x + c + 16), qb_half = Q::at(x + c + 16 + D / 2);
  uint2 lo_a, hi_a, lo_b, hi_b;   // columns c (a) and c + 16 (b), below half (lo) and half on (hi)
  rotated_x4_pair<T, D>(qa, qa_half, cos, sin, c, lo_a, hi_a);
  rotated_x4_pair<T, D>(qb, qb_half, cos, sin, c + 16, lo_b, hi_b);
  if (keep_q) {
    *reinterpret_cast<uint2*>(x + c) = lo_a;
    *reinterpret_cast<uint2*>(x + c + 16) = lo_b;
    *reinterpret_cast<uint2*>(x + c + D / 2) = hi_a;
    *reinterpret_cast<uint2*>(x + c + D / 2 + 16) = hi_b;
  }
  const uint32_t low[4] = {lo_a.x, lo_a.y, lo_b.x, lo_b.y}, high[4] = {hi_a.x, hi_a.y, hi_b.x, hi_b.y};
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) m = __vmaxu2(m, __vmaxu2(low[i] & 0x7fff7fffu, high[i] & 0x7fff7fffu));
  m = max(m & 0xffffu, m >> 16);
#pragma unroll
  for (int off = TPR / 2; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(group, m, off));
  const int f = split_query_exponent<T>(m);
  const float up = split_query_pow2(f);
  unsigned char* row = static_cast<unsigned char*>(s.q_split) + t * s.split_stride_tok + h * s.split_stride_head;
  *reinterpret_cast<uint4*>(row + 16 * split_query_chunk(kk, t4)) = split_chunk<T>(low, up);
  *reinterpret_cast<uint4*>(row + 16 * split_query_chunk(kk + KS / 2, t4)) = split_chunk<T>(high, up);
  if (j == 0) s.q_down[(h / s.group) * s.down_stride + t * s.group + h % s.group] = split_query_pow2(-f);
}

// Whether rope_split_query rotates k in the same pass as q's split (four pairs a thread).
__host__ __device__ __forceinline__ bool rope_split_k_in_pass(const RopeArgs& a) {
  return KVPAGER_ROPE_SPLIT_K == 2 && a.quads && a.cos != nullptr;
}

// The pass's work items of a token: head_dim / 16 threads per row of q, then (k in the pass)
// head_dim / 8 quads per row of k.
__host__ __device__ __forceinline__ int rope_split_pass_items(const RopeArgs& a, bool k_in_pass) {
  return a.q_heads * (a.head_dim / 16) + (k_in_pass ? a.k_heads * (a.head_dim / 8) : 0);
}

// Blocks an SM is to hold (__launch_bounds__ of rope_split_query_kernel): 4 keeps its registers at
// 32, so that an SM holds 5 blocks of the 8B shape's 384 threads (94% occupancy) where 3 (42
// registers; 40 used) held 4 (75%), and the writer waited on memory with fewer warps than RoPE in
// place (ncu on the H200, 2026-11-27: 58% achieved occupancy against its 70%). On the H100 the
// writer's time above RoPE in place at 16K tokens went from 9.1 to 6.0 us (fp16; bf16 4.5 us), and
// to none with a thread's four q loads issued together (split_query_part): 121.7-122.0 against
// 121.7-121.8 us (fp16), 121.7-121.8 against 123.3-123.6 (bf16).
// (Hopper only: sm_80's build spills 40-56 bytes at 32 registers and keeps 3; unmeasured there.)
#ifndef KVPAGER_ROPE_SPLIT_MIN_BLOCKS
#define KVPAGER_ROPE_SPLIT_MIN_BLOCKS 4
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KVPAGER_ROPE_SPLIT_BLOCKS_HERE 3
#else
#define KVPAGER_ROPE_SPLIT_BLOCKS_HERE KVPAGER_ROPE_SPLIT_MIN_BLOCKS
#endif

// One thread block per token: q's rows split (split_query_part), k rotated in place, in the same
// pass as quads (rope_quad) where rows align, else after.
template <typename T, int D>
__global__ void __launch_bounds__(512, KVPAGER_ROPE_SPLIT_BLOCKS_HERE) rope_split_query_kernel(RopeSplitArgs s) {
  constexpr int TPR = D / 16;
  static_assert(TPR <= 32 && (TPR & (TPR - 1)) == 0, "a row's threads share a warp");
  const RopeArgs& a = s.rope;
  const int64_t t = blockIdx.x;
  const T* cos = a.cos == nullptr ? nullptr : static_cast<const T*>(a.cos) + t * a.cos_stride;
  const T* sin = a.cos == nullptr ? nullptr : static_cast<const T*>(a.sin) + t * a.cos_stride;
  const int lane = threadIdx.x & 31;
  const unsigned group = TPR == 32 ? 0xffffffffu : ((1u << TPR) - 1u) << (lane & ~(TPR - 1));
  const bool keep_q = a.cos != nullptr && s.keep != nullptr && s.keep[t] != 0;   // block-uniform
  const bool k_in_pass = rope_split_k_in_pass(a);
  const int q_items = a.q_heads * TPR, items = rope_split_pass_items(a, k_in_pass);
  // q_items is a multiple of TPR: a row's threads all take the q branch (their shuffles' group).
  for (int idx = threadIdx.x; idx < items; idx += blockDim.x) {
    if (idx < q_items) {
      split_query_part<T, D>(s, cos, sin, t, idx / TPR, idx % TPR, keep_q, group);
    } else {
      const int kq = idx - q_items, h = kq / (D / 8);
      rope_quad<T>(static_cast<T*>(a.k) + t * a.k_stride_tok + h * a.k_stride_head, cos, sin, D / 2, (kq % (D / 8)) * 4);
    }
  }
  if (a.cos != nullptr && !k_in_pass) {
    if (KVPAGER_ROPE_SPLIT_K == 1 && a.quads)
      rope_quads<T>(a, a.q_heads);
    else
      rope_pairs<T>(a, a.q_heads);
  }
}

// Grid (column tiles, row groups; rows strided by gridDim.y): SiLU in float32 as torch computes
// it (x / (1 + exp(-x))), rounded, then the product rounded.
template <typename T>
__global__ void silu_and_mul_kernel(SiluMulArgs a) {
  using E = Elem<T>;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= a.width) return;
  for (int64_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    const T* gate_up = static_cast<const T*>(a.gate_up) + row * a.gate_up_stride;
    const float gate = E::load(gate_up[col]);
    const float silu = E::rounded(__fdiv_rn(gate, __fadd_rn(1.f, expf(-gate))));
    static_cast<T*>(a.out)[row * a.out_stride + col] = E::store(__fmul_rn(silu, E::load(gate_up[a.width + col])));
  }
}

template <template <typename> class Kernel, typename Args>
cudaError_t launch_typed(DType dtype, dim3 grid, dim3 block, const Args& args, cudaStream_t stream) {
  switch (dtype) {
    case kFloat32: Kernel<float>::launch(grid, block, args, stream); break;
    case kFloat16: Kernel<__half>::launch(grid, block, args, stream); break;
    case kBFloat16: Kernel<__nv_bfloat16>::launch(grid, block, args, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T> struct NormLaunch {
  static void launch(dim3 g, dim3 b, const RMSNormArgs& a, cudaStream_t s) { add_rms_norm_kernel<T><<<g, b, 0, s>>>(a); }
};
template <typename T> struct RopeLaunch {
  static void launch(dim3 g, dim3 b, const RopeArgs& a, cudaStream_t s) { rope_kernel<T><<<g, b, 0, s>>>(a); }
};
template <typename T> struct SiluLaunch {
  static void launch(dim3 g, dim3 b, const SiluMulArgs& a, cudaStream_t s) { silu_and_mul_kernel<T><<<g, b, 0, s>>>(a); }
};

}  // namespace

cudaError_t launch_add_rms_norm(DType dtype, const RMSNormArgs& a, cudaStream_t stream) {
  if (a.rows <= 0) return cudaSuccess;
  if (a.hidden <= 0) return cudaErrorInvalidValue;
  return launch_typed<NormLaunch>(dtype, dim3(a.rows), dim3(kNormThreads), a, stream);
}

cudaError_t launch_rope(DType dtype, const RopeArgs& a, cudaStream_t stream) {
  if (a.tokens <= 0) return cudaSuccess;
  if (a.head_dim <= 0 || a.head_dim % 2) return cudaErrorInvalidValue;
  if (a.quads && (a.head_dim / 2) % 4 != 0) return cudaErrorInvalidValue;
  const int work = (a.q_heads + a.k_heads) * (a.head_dim / 2) / (a.quads ? 4 : 1);   // threads' items
  const int threads = work >= 512 ? 512 : ((work + 31) / 32) * 32;
  return launch_typed<RopeLaunch>(dtype, dim3(a.tokens), dim3(threads), a, stream);
}

cudaError_t launch_rope_split_query(DType dtype, const RopeSplitArgs& s, cudaStream_t stream) {
  const RopeArgs& a = s.rope;
  if (a.tokens <= 0) return cudaSuccess;
  if ((a.head_dim != 64 && a.head_dim != 128) || s.group < 1 || a.q_heads % s.group != 0 ||
      (dtype != kBFloat16 && dtype != kFloat16))
    return cudaErrorInvalidValue;
  const bool k_in_pass = rope_split_k_in_pass(a), k_after = a.cos != nullptr && !k_in_pass;
  const int k_after_items = k_after ? a.k_heads * (a.head_dim / 2) / (KVPAGER_ROPE_SPLIT_K == 1 && a.quads ? 4 : 1) : 0;
  const int work = max(rope_split_pass_items(a, k_in_pass), k_after_items);
  const int threads = work >= 512 ? 512 : ((work + 31) / 32) * 32;
  const bool half = dtype == kFloat16;
  if (a.head_dim == 64) {
    if (half)
      rope_split_query_kernel<__half, 64><<<a.tokens, threads, 0, stream>>>(s);
    else
      rope_split_query_kernel<__nv_bfloat16, 64><<<a.tokens, threads, 0, stream>>>(s);
  } else {
    if (half)
      rope_split_query_kernel<__half, 128><<<a.tokens, threads, 0, stream>>>(s);
    else
      rope_split_query_kernel<__nv_bfloat16, 128><<<a.tokens, threads, 0, stream>>>(s);
  }
  return cudaGetLastError();
}

cudaError_t launch_silu_and_mul(DType dtype, const SiluMulArgs& a, cudaStream_t stream) {
  if (a.rows <= 0) return cudaSuccess;
  if (a.width <= 0) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  const unsigned row_groups = a.rows < 65535 ? a.rows : 65535;
  return launch_typed<SiluLaunch>(dtype, dim3((a.width + kThreads - 1) / kThreads, row_groups), dim3(kThreads), a,
                                  stream);
}

}  // namespace kvpager
