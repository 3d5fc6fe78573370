// fp8 e4m3 -> fp16, exactly (e4m3 fits fp16: every value, subnormals included), for the kernels
// that multiply an fp8 cache's values in fp16 on tensor cores (paged_decode_mma.cuh,
// paged_prefill.cuh). No torch here.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace kvpager {

// Two values (the low 16 bits of w, low byte first) -> f16x2 (low byte in the low half).
__device__ __forceinline__ uint32_t fp8x2_to_h2(uint32_t w) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// Four values (a word, low byte first) -> two f16x2: x from the low 16 bits, y from the high 16.
// On sm_89+ one cvt each, the high pair read as the word's upper half (F2FP ... .H1, given the word
// split by mov.b32 {l, h}); fp8x2_to_h2(w >> 16) shifts first, an instruction more. Measured
// (H200, 2026-11-26, tenth session): the fp8 prefill 3-5% faster, the tensor-core fp8 decode 0-2%.
__device__ __forceinline__ uint2 fp8x4_to_h2x2(uint32_t w) {
  uint2 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(r.x), "=r"(r.y)
      : "r"(w));
#else
  r.x = fp8x2_to_h2(w);
  r.y = fp8x2_to_h2(w >> 16);
#endif
  return r;
}

}  // namespace kvpager
