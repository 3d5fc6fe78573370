// Two consecutive 16-bit (or 32-bit) elements as one value and back: the word-level access the
// elementwise kernels (layer_ops.cu) and the query split (split_query.cuh) share. No torch here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <cstring>

namespace kvpager {

// A 32-bit value's bits as another 32-bit type (a bf16x2 or fp16x2 pair and its word).
template <typename To, typename From>
__device__ __forceinline__ To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To out;
  memcpy(&out, &v, sizeof(out));
  return out;
}

// Two consecutive elements of T as one value P (a 32-bit word for 16-bit types, the first element
// in its low half; a float2 for float), widened to floats and packed back: a bf16 pair widens by a
// shift and a mask and packs with one paired conversion (F2FP), where element-wise access costs a
// byte permute each way.
template <typename T>
struct PairOf;
template <>
struct PairOf<__nv_bfloat16> {
  using P = uint32_t;
  static __device__ __forceinline__ float2 unpack(P w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  static __device__ __forceinline__ P pack(float a, float b) { return bits_as<P>(__floats2bfloat162_rn(a, b)); }
};
template <>
struct PairOf<__half> {
  using P = uint32_t;
  static __device__ __forceinline__ float2 unpack(P w) { return __half22float2(bits_as<__half2>(w)); }
  static __device__ __forceinline__ P pack(float a, float b) { return bits_as<P>(__floats2half2_rn(a, b)); }
};
template <>
struct PairOf<float> {
  using P = float2;
  static __device__ __forceinline__ float2 unpack(P v) { return v; }
  static __device__ __forceinline__ P pack(float a, float b) { return make_float2(a, b); }
};

}  // namespace kvpager
