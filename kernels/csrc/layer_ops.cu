// The decoder's per-layer elementwise kernels (see layer_ops.h for what each computes). They
// replace about a dozen torch launches per layer with three; no torch here (nvcc alone builds it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "layer_ops.h"

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

// One thread block per token; a thread per (head, i < half) pair rotates x[i] and x[i + half].
template <typename T>
__global__ void rope_kernel(RopeArgs a) {
  using E = Elem<T>;
  const int64_t t = blockIdx.x;
  const int half = a.head_dim / 2;
  const T* cos = static_cast<const T*>(a.cos) + t * a.cos_stride;
  const T* sin = static_cast<const T*>(a.sin) + t * a.cos_stride;
  for (int idx = threadIdx.x; idx < (a.q_heads + a.k_heads) * half; idx += blockDim.x) {
    const int h = idx / half, i = idx % half;
    T* x = h < a.q_heads ? static_cast<T*>(a.q) + t * a.q_stride_tok + h * a.q_stride_head
                         : static_cast<T*>(a.k) + t * a.k_stride_tok + (h - a.q_heads) * a.k_stride_head;
    const float x1 = E::load(x[i]), x2 = E::load(x[i + half]);
    const float lo = __fadd_rn(E::rounded(__fmul_rn(x1, E::load(cos[i]))),
                               E::rounded(__fmul_rn(-x2, E::load(sin[i]))));
    const float hi = __fadd_rn(E::rounded(__fmul_rn(x2, E::load(cos[i + half]))),
                               E::rounded(__fmul_rn(x1, E::load(sin[i + half]))));
    x[i] = E::store(lo);
    x[i + half] = E::store(hi);
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
  const int pairs = (a.q_heads + a.k_heads) * (a.head_dim / 2);
  const int threads = pairs >= 512 ? 512 : ((pairs + 31) / 32) * 32;
  return launch_typed<RopeLaunch>(dtype, dim3(a.tokens), dim3(threads), a, stream);
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
