// The torch bindings' shared checks (binding_*.cpp): invalid arguments raise Python's ValueError
// (as kernels/reference.py does) through KV_CHECK, with a message that names the input and what
// it must be; the dtype mapping onto launch.h's DType; the cache, row and device checks the
// bindings share; and the fields of the decode and prefill launchers' structs.
//
// Data-dependent checks that would need a device sync (block ids in range, context_lens within
// the table) are not done here; the kernels guard them instead: an out-of-range block id or
// slot is skipped (never dereferenced), and a context longer than its table row is clamped.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "launch.h"

// Messages are concatenated as std::strings (std::to_string for numbers), not streamed: on the GPU
// image, streaming an integer through c10::str from this extension crashed the process (seen
// with torch 2.11+cu130), while strings were fine.
namespace kvmsg {
inline std::string part(const char* s) { return s; }
inline std::string part(const std::string& s) { return s; }
template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
std::string part(I v) { return std::to_string(v); }
inline std::string part(double v) { return std::to_string(v); }
inline std::string part(c10::ScalarType t) { return c10::toString(t); }
inline std::string part(const c10::Device& d) { return d.str(); }
template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  ((s += part(a)), ...);
  return s;
}
}  // namespace kvmsg

#define KV_CHECK(cond, ...)                                               \
  do {                                                                    \
    if (!(cond)) throw pybind11::value_error(kvmsg::cat(__VA_ARGS__));    \
  } while (0)

namespace kvbind {

using torch::Tensor;

inline kvpager::DType to_dtype(const Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return kvpager::kFloat32;
    case torch::kFloat16: return kvpager::kFloat16;
    case torch::kBFloat16: return kvpager::kBFloat16;
    default: KV_CHECK(false, what, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return kvpager::kFloat32;
}

// A cache may also hold fp8 e4m3 (with a 16-bit query / key / value).
inline kvpager::DType to_cache_dtype(const Tensor& t) {
  if (t.scalar_type() == torch::kFloat8_e4m3fn) return kvpager::kFloat8E4M3;
  return to_dtype(t, "cache (or float8_e4m3fn)");
}

inline void check_kv_scales(double k_scale, double v_scale) {
  KV_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
           "k_scale and v_scale must be finite and > 0, got ", k_scale, " and ", v_scale);
}

inline void check_cuda(const Tensor& t, const char* what, const torch::Device& device) {
  KV_CHECK(t.is_cuda(), what, " must be a CUDA tensor, got one on ", t.device());
  KV_CHECK(t.device() == device, what, " is on ", t.device(), " but the other inputs on ", device);
}

// "[a, b, c]", formatted here rather than through c10's stream operators.
inline std::string dims(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

inline bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// [num_blocks, num_heads, block_size, head_dim] with packed inner dims and a 16-byte-aligned block stride.
inline void check_cache_view(const Tensor& c, const char* what) {
  KV_CHECK(c.dim() == 4, what, " must be [num_blocks, num_kv_heads, block_size, head_dim], got ",
                    dims(c.sizes()));
  const int64_t B = c.size(2), D = c.size(3), es = c.element_size();
  KV_CHECK(c.stride(3) == 1 && c.stride(2) == D && c.stride(1) == B * D, what,
                    " must have packed inner dims (strides [*, block_size*head_dim, head_dim, 1]), got strides ",
                    dims(c.strides()));
  KV_CHECK(c.size(0) <= 1 || (c.stride(0) * es) % 16 == 0, what,
                    " block stride must be a multiple of 16 bytes, got ", c.stride(0), " elements");
  KV_CHECK(c.size(0) <= std::numeric_limits<int32_t>::max(), what, " has too many blocks");
  KV_CHECK(aligned16(c), what, " data must be 16-byte aligned");
}

inline void check_cache_pair(const Tensor& k, const Tensor& v) {
  check_cache_view(k, "k_cache");
  check_cache_view(v, "v_cache");
  KV_CHECK(k.sizes() == v.sizes(), "k_cache ", dims(k.sizes()), " and v_cache ", dims(v.sizes()), " differ in shape");
  KV_CHECK(k.scalar_type() == v.scalar_type(), "k_cache is ", k.scalar_type(), ", v_cache ",
                    v.scalar_type());
  KV_CHECK(k.device() == v.device(), "k_cache on ", k.device(), ", v_cache on ", v.device());
}

// [n, heads, head_dim] with a contiguous last dim and 16-byte-aligned rows.
inline void check_rows(const Tensor& t, const char* what) {
  KV_CHECK(t.dim() == 3, what, " must be 3-D [n, heads, head_dim], got ", dims(t.sizes()));
  const int64_t vec = 16 / t.element_size();
  KV_CHECK(t.size(2) == 1 || t.stride(2) == 1, what, " must be contiguous in head_dim, got strides ",
                    dims(t.strides()));
  KV_CHECK((t.size(0) <= 1 || t.stride(0) % vec == 0) && (t.size(1) <= 1 || t.stride(1) % vec == 0),
                    what, " strides ", dims(t.strides()), " must be multiples of 16 bytes");
  KV_CHECK(aligned16(t), what, " data must be 16-byte aligned");
}

inline int log2_exact(int64_t x) {
  int r = 0;
  while ((int64_t{1} << r) < x) ++r;
  return r;
}

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

// The fields DecodeArgs and PrefillArgs share: the query's head stride, the caches, the tables,
// the sizes they imply and the scales (the caller has checked the inputs).
template <typename Args>
inline void fill_cache_fields(Args& a, const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& block_tables, const Tensor& context_lens, double scale, double k_scale,
                       double v_scale) {
  a.query = query.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.context_lens = context_lens.data_ptr<int32_t>();
  a.q_stride_head = query.stride(1);
  a.kv_stride_block = k_cache.stride(0);
  a.kv_stride_head = k_cache.stride(1);
  a.table_stride = block_tables.stride(0);
  a.num_q_heads = static_cast<int>(query.size(1));
  a.num_kv_heads = static_cast<int>(k_cache.size(1));
  a.head_dim = static_cast<int>(query.size(2));
  a.block_size = static_cast<int>(k_cache.size(2));
  a.log2_block_size = log2_exact(k_cache.size(2));
  a.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  a.num_cache_blocks = static_cast<int>(k_cache.size(0));
  a.scale_log2 = static_cast<float>(scale * 1.4426950408889634 * k_scale);
  a.v_scale = static_cast<float>(v_scale);
}

// Validates the decode inputs and fills the size/stride/pointer fields of DecodeArgs (no plan yet).

}  // namespace kvbind
