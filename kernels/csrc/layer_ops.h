// Host-side interface of the decoder's per-layer elementwise kernels (layer_ops.cu): fused
// residual add + RMSNorm, rotary embedding in place, SiLU-gated product. Raw pointers, element
// strides and a cudaStream_t; no torch types (binding.cpp checks the tensors and fills these).
//
// Each kernel computes what the decoder's torch formulas compute in the same dtype, rounding
// where torch rounds (every torch op on 16-bit tensors computes in float32 and rounds its
// result), with no fused multiply-add where torch has two operations; only RMSNorm's sum of
// squares may add in another order (float32, so the norm may differ in its last bits).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "launch.h"

namespace kvpager {

// Rows of x (optionally after x += delta, in place, rounded to the dtype) normalized:
//   out = weight * dtype(x_f32 * rsqrt(mean(x_f32^2) + eps))
struct RMSNormArgs {
  void* out;                // [rows, hidden], inner dim contiguous
  void* x;                  // [rows, hidden], inner dim contiguous; updated in place when delta is set
  const void* delta;        // [rows, hidden] or nullptr
  const void* weight;       // [hidden]
  int64_t out_stride, x_stride, delta_stride;   // elements between rows
  int rows, hidden;
  float eps;
};
cudaError_t launch_add_rms_norm(DType dtype, const RMSNormArgs& args, cudaStream_t stream);

// Rotate-half rotary embedding of q and k in place: x = x * cos + rotate_half(x) * sin, with
// rotate_half(x) = cat(-x[half:], x[:half]) and cos/sin [tokens, head_dim] in the dtype.
struct RopeArgs {
  void* q;                  // [tokens, q_heads, head_dim], inner dim contiguous
  void* k;                  // [tokens, k_heads, head_dim], inner dim contiguous
  const void* cos;          // [tokens, head_dim], rows cos_stride apart
  const void* sin;
  int64_t q_stride_tok, q_stride_head, k_stride_tok, k_stride_head, cos_stride;
  int tokens, q_heads, k_heads, head_dim;
  // 1: four pairs a thread, by loads and stores of 4 elements: every row of q, k, cos and sin
  // starts at an address aligned to 4 elements and head_dim / 2 is a multiple of 4 (the caller
  // checks); 0: a pair a thread, any alignment. The same arithmetic either way.
  int quads;
};
cudaError_t launch_rope(DType dtype, const RopeArgs& args, cudaStream_t stream);

// The same rotation with q written split (split_query.cuh) for the fp8 prefill kernel, instead of
// in place: bf16 or fp16 (`dtype`), head_dim 64 or 128. k (k_heads may be 0) is rotated in place as
// launch_rope does; q's rows, rotated and rounded to dtype as launch_rope would leave them, are
// split into q_split and q_down, q left as it is but for the tokens `keep` marks (a mixed step's
// one-token rows, which decode attention reads unsplit), rotated in place as well. cos == nullptr: no rotation (q split
// as it is, k untouched, keep ignored).
struct RopeSplitArgs {
  RopeArgs rope;            // q, k, cos, sin and their strides, as for launch_rope
  void* q_split;            // [tokens, q_heads, 2 * head_dim] bytes, inner dim contiguous
  float* q_down;            // [q_heads / group, tokens, group]: [tokens, group] contiguous
  int64_t split_stride_tok, split_stride_head;   // bytes
  int64_t down_stride;      // floats between KV heads of q_down
  int group;                // query heads per KV head
  const int32_t* keep;      // [tokens]: nonzero where q's rows are rotated in place too; or nullptr
};
cudaError_t launch_rope_split_query(DType dtype, const RopeSplitArgs& args, cudaStream_t stream);

// out = dtype(silu(gate)) * up, with gate_up = [gate | up] along the last dim.
struct SiluMulArgs {
  void* out;                // [rows, width]
  const void* gate_up;      // [rows, 2 * width]
  int64_t out_stride, gate_up_stride;
  int rows, width;
};
cudaError_t launch_silu_and_mul(DType dtype, const SiluMulArgs& args, cudaStream_t stream);

}  // namespace kvpager
