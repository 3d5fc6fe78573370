// The decoder's per-layer elementwise kernels (see layer_ops.h for what each computes). They
// replace about a dozen torch launches per layer with three; no torch here (nvcc alone builds it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "layer_ops.h"
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

// Four consecutive elements, as one aligned access.
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

// rope_pairs with a thread per four consecutive pairs (RopeArgs::quads): pairs i .. i + 3 and
// their partners i + half .. i + half + 3, each loaded and stored as one access.
template <typename T>
__device__ __forceinline__ void rope_quads(const RopeArgs& a, int first_head) {
  using E = Elem<T>;
  const int64_t t = blockIdx.x;
  const int half = a.head_dim / 2, quads = half / 4;
  const T* cos = static_cast<const T*>(a.cos) + t * a.cos_stride;
  const T* sin = static_cast<const T*>(a.sin) + t * a.cos_stride;
  for (int idx = threadIdx.x + first_head * quads; idx < (a.q_heads + a.k_heads) * quads; idx += blockDim.x) {
    const int h = idx / quads, i = (idx % quads) * 4;
    T* x = h < a.q_heads ? static_cast<T*>(a.q) + t * a.q_stride_tok + h * a.q_stride_head
                         : static_cast<T*>(a.k) + t * a.k_stride_tok + (h - a.q_heads) * a.k_stride_head;
    const Quad<T> x1 = *reinterpret_cast<const Quad<T>*>(x + i), x2 = *reinterpret_cast<const Quad<T>*>(x + i + half);
    const Quad<T> c1 = *reinterpret_cast<const Quad<T>*>(cos + i), s1 = *reinterpret_cast<const Quad<T>*>(sin + i);
    const Quad<T> c2 = *reinterpret_cast<const Quad<T>*>(cos + i + half);
    const Quad<T> s2 = *reinterpret_cast<const Quad<T>*>(sin + i + half);
    Quad<T> lo, hi;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float v1 = E::load(x1.v[j]), v2 = E::load(x2.v[j]);
      lo.v[j] = E::store(rotated<T>(v1, v2, E::load(c1.v[j]), E::load(s1.v[j]), true));
      hi.v[j] = E::store(rotated<T>(v2, v1, E::load(c2.v[j]), E::load(s2.v[j]), false));
    }
    *reinterpret_cast<Quad<T>*>(x + i) = lo;
    *reinterpret_cast<Quad<T>*>(x + i + half) = hi;
  }
}

template <typename T>
__global__ void rope_kernel(RopeArgs a) {
  if (a.quads)
    rope_quads<T>(a, 0);
  else
    rope_pairs<T>(a, 0);
}

// Four consecutive bf16 values at p (8-byte aligned) as two words, the first value lowest.
__device__ __forceinline__ uint2 load_bf16x4(const __nv_bfloat16* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Columns c .. c + 3 of row x rotated (cos/sin rows given; none: as they are), as two bf16x2 words.
template <int D>
__device__ __forceinline__ uint2 rotated_bf16x4(const __nv_bfloat16* x, const __nv_bfloat16* cos,
                                                const __nv_bfloat16* sin, int c) {
  constexpr int half = D / 2;
  const uint2 own = load_bf16x4(x + c);
  if (cos == nullptr) return own;
  const bool low = c < half;
  const uint2 partner = load_bf16x4(x + (low ? c + half : c - half));
  const uint2 cs = load_bf16x4(cos + c), sn = load_bf16x4(sin + c);
  const uint32_t in[2] = {own.x, own.y}, pw[2] = {partner.x, partner.y}, cw[2] = {cs.x, cs.y}, sw[2] = {sn.x, sn.y};
  uint32_t out[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const float r0 = rotated<__nv_bfloat16>(bf16_lo(in[w]), bf16_lo(pw[w]), bf16_lo(cw[w]), bf16_lo(sw[w]), low);
    const float r1 = rotated<__nv_bfloat16>(bf16_hi(in[w]), bf16_hi(pw[w]), bf16_hi(cw[w]), bf16_hi(sw[w]), low);
    const __nv_bfloat162 b = __floats2bfloat162_rn(r0, r1);
    out[w] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return make_uint2(out[0], out[1]);
}

// One thread block per token. q: a group of D / 8 consecutive threads per row (a head of q), each
// writing one 16-byte chunk of the split row (split_query_chunk's inverse gives its columns; a kept
// token's rotated values in place too), the row's largest |q| shared by shuffles within the group;
// then k's pairs rotated in place.
template <int D>
__global__ void rope_split_query_kernel(RopeSplitArgs s) {
  constexpr int CPR = D / 8;   // chunks of a split row: threads per row
  static_assert(CPR <= 32 && (CPR & (CPR - 1)) == 0, "a row's threads share a warp");
  const RopeArgs& a = s.rope;
  const int64_t t = blockIdx.x;
  const __nv_bfloat16* cos = a.cos == nullptr ? nullptr : static_cast<const __nv_bfloat16*>(a.cos) + t * a.cos_stride;
  const __nv_bfloat16* sin = a.cos == nullptr ? nullptr : static_cast<const __nv_bfloat16*>(a.sin) + t * a.cos_stride;
  const int lane = threadIdx.x & 31;
  const unsigned group = CPR == 32 ? 0xffffffffu : ((1u << CPR) - 1u) << (lane & ~(CPR - 1));
  const bool keep_q = a.cos != nullptr && s.keep != nullptr && s.keep[t] != 0;   // block-uniform
  for (int idx = threadIdx.x; idx < a.q_heads * CPR; idx += blockDim.x) {
    const int h = idx / CPR, chunk = idx % CPR;
    const int kk = (chunk >> 3) * 2 + (chunk & 1), t4 = (chunk & 7) >> 1, c = kk * 32 + 4 * t4;
    __nv_bfloat16* x = static_cast<__nv_bfloat16*>(a.q) + t * a.q_stride_tok + h * a.q_stride_head;
    const uint2 first = rotated_bf16x4<D>(x, cos, sin, c), second = rotated_bf16x4<D>(x, cos, sin, c + 16);
    if (keep_q) {
      // The row's other threads have read their partner columns (the row's threads share a warp).
      __syncwarp(group);
      *reinterpret_cast<uint2*>(x + c) = first;
      *reinterpret_cast<uint2*>(x + c + 16) = second;
    }
    const uint32_t w[4] = {first.x, first.y, second.x, second.y};
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) m = __vmaxu2(m, w[i] & 0x7fff7fffu);
    m = max(m & 0xffffu, m >> 16);
#pragma unroll
    for (int off = CPR / 2; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(group, m, off));
    const int f = split_query_exponent(m);
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) split_query_pair(w[i], split_query_pow2(f), hi[i], lo[i]);
    unsigned char* row = static_cast<unsigned char*>(s.q_split) + t * s.split_stride_tok + h * s.split_stride_head;
    *reinterpret_cast<uint4*>(row + 16 * chunk) =
        make_uint4(hi[0] | (hi[1] << 16), hi[2] | (hi[3] << 16), lo[0] | (lo[1] << 16), lo[2] | (lo[3] << 16));
    if (chunk == 0) s.q_down[(h / s.group) * s.down_stride + t * s.group + h % s.group] = split_query_pow2(-f);
  }
  // (A pair a thread: with rope_quads here too the kernel took more registers and 17% more time,
  // H100, .gpu/run101.sh.)
  if (a.cos != nullptr) rope_pairs<__nv_bfloat16>(a, a.q_heads);
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

cudaError_t launch_rope_split_query(const RopeSplitArgs& s, cudaStream_t stream) {
  const RopeArgs& a = s.rope;
  if (a.tokens <= 0) return cudaSuccess;
  if ((a.head_dim != 64 && a.head_dim != 128) || s.group < 1 || a.q_heads % s.group != 0)
    return cudaErrorInvalidValue;
  const int work = max(a.q_heads * (a.head_dim / 8), a.k_heads * (a.head_dim / 2));
  const int threads = work >= 512 ? 512 : ((work + 31) / 32) * 32;
  if (a.head_dim == 64)
    rope_split_query_kernel<64><<<a.tokens, threads, 0, stream>>>(s);
  else
    rope_split_query_kernel<128><<<a.tokens, threads, 0, stream>>>(s);
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
