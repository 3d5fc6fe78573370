// mma.sync m16n8k16 with fp32 accumulators over 16-bit inputs (Mma<T>, T = __half or
// __nv_bfloat16): the instruction, the packing of two floats into a T pair (an A or B fragment
// register), and two fp8 e4m3 values to a T pair, exactly. Shared by the decode kernel's
// tensor-core instance (paged_decode_mma.cuh) and the prefill kernels (prefill_tensor_ops.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "fp8_convert.cuh"

namespace kvpager {

template <typename T>
struct Mma {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "f16 or bf16 inputs");
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;

  // d += A B (A: a[0..3], B: b0, b1, in the m16n8k16 fragment layouts).
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#define KVPAGER_MMA16816(TYPE)                                                                            \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0, %1, %2, %3}, "          \
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                                        \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
    if constexpr (kBf16)
      KVPAGER_MMA16816("bf16");
    else
      KVPAGER_MMA16816("f16");
#undef KVPAGER_MMA16816
  }

  // (lo, hi) rounded to T, lo in the low half.
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    uint32_t r;
    if constexpr (kBf16) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      memcpy(&r, &v, sizeof(r));
    } else {
      const __half2 v = __floats2half2_rn(lo, hi);
      memcpy(&r, &v, sizeof(r));
    }
    return r;
  }

  // Two fp8 e4m3 values (low byte first) -> two T, exactly (through fp16, which holds every e4m3).
  static __device__ __forceinline__ uint32_t from_fp8x2(uint16_t w) {
    if constexpr (kBf16) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w), __NV_E4M3);
      __half2 hh;
      memcpy(&hh, &h, sizeof(hh));
      const float2 f = __half22float2(hh);
      return pack(f.x, f.y);
    } else {
      return fp8x2_to_h2(w);
    }
  }
};

}  // namespace kvpager
