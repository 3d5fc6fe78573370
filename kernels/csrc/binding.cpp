// Torch extension over launch.cu: checks every input, fills the launchers' structs of raw
// pointers and element strides, and launches on the current CUDA stream of the tensors' device.
// Data-dependent checks that would need a device sync (block ids in range, context_lens within
// the table) are not done here; the kernels guard them instead: an out-of-range block id or
// slot is skipped (never dereferenced), and a context longer than its table row is clamped.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "decode_plan.h"
#include "launch.h"
#include "layer_ops.h"

// Invalid arguments raise Python's ValueError (as kernels/reference.py does). Messages are
// concatenated as std::strings (std::to_string for numbers), not streamed: on the GPU image,
// streaming an integer through c10::str from this extension crashed the process (seen with
// torch 2.11+cu130), while strings were fine.
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

namespace {

using torch::Tensor;

kvpager::DType to_dtype(const Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return kvpager::kFloat32;
    case torch::kFloat16: return kvpager::kFloat16;
    case torch::kBFloat16: return kvpager::kBFloat16;
    default: KV_CHECK(false, what, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return kvpager::kFloat32;
}

// A cache may also hold fp8 e4m3 (with a 16-bit query / key / value).
kvpager::DType to_cache_dtype(const Tensor& t) {
  if (t.scalar_type() == torch::kFloat8_e4m3fn) return kvpager::kFloat8E4M3;
  return to_dtype(t, "cache (or float8_e4m3fn)");
}

void check_kv_scales(double k_scale, double v_scale) {
  KV_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
           "k_scale and v_scale must be finite and > 0, got ", k_scale, " and ", v_scale);
}

void check_cuda(const Tensor& t, const char* what, const torch::Device& device) {
  KV_CHECK(t.is_cuda(), what, " must be a CUDA tensor, got one on ", t.device());
  KV_CHECK(t.device() == device, what, " is on ", t.device(), " but the other inputs on ", device);
}

// "[a, b, c]", formatted here rather than through c10's stream operators.
std::string dims(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// [num_blocks, num_heads, block_size, head_dim] with packed inner dims and a 16-byte-aligned block stride.
void check_cache_view(const Tensor& c, const char* what) {
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

void check_cache_pair(const Tensor& k, const Tensor& v) {
  check_cache_view(k, "k_cache");
  check_cache_view(v, "v_cache");
  KV_CHECK(k.sizes() == v.sizes(), "k_cache ", dims(k.sizes()), " and v_cache ", dims(v.sizes()), " differ in shape");
  KV_CHECK(k.scalar_type() == v.scalar_type(), "k_cache is ", k.scalar_type(), ", v_cache ",
                    v.scalar_type());
  KV_CHECK(k.device() == v.device(), "k_cache on ", k.device(), ", v_cache on ", v.device());
}

// [n, heads, head_dim] with a contiguous last dim and 16-byte-aligned rows.
void check_rows(const Tensor& t, const char* what) {
  KV_CHECK(t.dim() == 3, what, " must be 3-D [n, heads, head_dim], got ", dims(t.sizes()));
  const int64_t vec = 16 / t.element_size();
  KV_CHECK(t.size(2) == 1 || t.stride(2) == 1, what, " must be contiguous in head_dim, got strides ",
                    dims(t.strides()));
  KV_CHECK((t.size(0) <= 1 || t.stride(0) % vec == 0) && (t.size(1) <= 1 || t.stride(1) % vec == 0),
                    what, " strides ", dims(t.strides()), " must be multiples of 16 bytes");
  KV_CHECK(aligned16(t), what, " data must be 16-byte aligned");
}

int log2_exact(int64_t x) {
  int r = 0;
  while ((int64_t{1} << r) < x) ++r;
  return r;
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

// The fields DecodeArgs and PrefillArgs share: the query's head stride, the caches, the tables,
// the sizes they imply and the scales (the caller has checked the inputs).
template <typename Args>
void fill_cache_fields(Args& a, const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
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
kvpager::DecodeArgs decode_args(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                                const Tensor& block_tables, const Tensor& context_lens, double scale,
                                double k_scale, double v_scale) {
  const torch::Device device = query.device();
  check_cuda(query, "query", device);
  check_cuda(k_cache, "k_cache", device);
  check_cuda(v_cache, "v_cache", device);
  check_cuda(block_tables, "block_tables", device);
  check_cuda(context_lens, "context_lens", device);
  to_dtype(query, "query");
  check_cache_pair(k_cache, v_cache);
  const bool fp8 = to_cache_dtype(k_cache) == kvpager::kFloat8E4M3;
  KV_CHECK(query.scalar_type() == k_cache.scalar_type() ||
               (fp8 && (query.scalar_type() == torch::kFloat16 || query.scalar_type() == torch::kBFloat16)),
           "query dtype ", query.scalar_type(), " does not go with cache dtype ", k_cache.scalar_type(),
           " (the same dtype, or a float16/bfloat16 query over a float8_e4m3fn cache)");
  check_kv_scales(k_scale, v_scale);
  KV_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), "k_scale and v_scale apply to fp8 caches only");
  check_rows(query, "query");
  KV_CHECK(k_cache.stride(0) == v_cache.stride(0), "k_cache and v_cache must share a block stride, got ",
                    k_cache.stride(0), " and ", v_cache.stride(0));
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  KV_CHECK(head_dim == k_cache.size(3), "query head_dim ", head_dim, " != cache head_dim ", k_cache.size(3));
  KV_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256, "head_dim must be 64, 128 or 256, got ",
                    head_dim);
  KV_CHECK(block_size == 8 || block_size == 16 || block_size == 32, "block_size must be 8, 16 or 32, got ",
                    block_size);
  KV_CHECK(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0, num_q_heads,
                    " query heads are not a multiple of ", num_kv_heads, " KV heads (GQA)");
  KV_CHECK(num_seqs <= 65535, "at most 65535 sequences per call, got ", num_seqs);
  KV_CHECK(num_kv_heads * num_q_heads <= 65535 * 8, "too many heads");
  KV_CHECK(block_tables.scalar_type() == torch::kInt32, "block_tables must be int32, got ",
                    block_tables.scalar_type());
  KV_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
                    "block_tables must be [num_seqs, max_blocks] = [", num_seqs, ", *], got ", dims(block_tables.sizes()));
  KV_CHECK(block_tables.size(1) <= 1 || block_tables.stride(1) == 1,
                    "block_tables must be contiguous along max_blocks, got strides ", dims(block_tables.strides()));
  KV_CHECK(block_tables.size(1) * block_size <= std::numeric_limits<int32_t>::max() / 2,
                    "block_tables is too wide");
  KV_CHECK(context_lens.scalar_type() == torch::kInt32, "context_lens must be int32, got ",
                    context_lens.scalar_type());
  KV_CHECK(context_lens.dim() == 1 && context_lens.size(0) == num_seqs, "context_lens must be [", num_seqs,
                    "], got ", dims(context_lens.sizes()));
  KV_CHECK(context_lens.is_contiguous(), "context_lens must be contiguous");
  KV_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);

  kvpager::DecodeArgs a{};
  fill_cache_fields(a, query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale);
  a.q_stride_seq = query.stride(0);
  a.num_seqs = static_cast<int>(num_seqs);
  return a;
}

kvpager::DecodeSizes decode_sizes(const kvpager::DecodeArgs& a) {
  return {a.num_seqs, a.num_q_heads, a.num_kv_heads, a.head_dim, a.block_size, a.max_blocks_per_seq};
}

void check_loads(int64_t loads) {
  KV_CHECK(loads == 0 || loads == 2 || loads == 4, "loads must be 2 or 4 (or 0: the planner's choice), got ", loads);
}

void check_out(const Tensor& out, const Tensor& query) {
  check_cuda(out, "out", query.device());
  KV_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(), "out must be ",
           dims(query.sizes()), " ", query.scalar_type(), ", got ", dims(out.sizes()), " ", out.scalar_type());
  KV_CHECK(out.stride(2) == 1 || out.size(2) == 1, "out must be contiguous in head_dim");
}

// A split-KV workspace of `rows` partial rows: part_out [rows, num_q_heads, head_dim] and
// part_ml [rows, num_q_heads, 2], contiguous float32 (at least `rows` rows).
void check_workspace(const Tensor& part_out, const Tensor& part_ml, const Tensor& query, int64_t rows) {
  check_cuda(part_out, "part_out", query.device());
  check_cuda(part_ml, "part_ml", query.device());
  KV_CHECK(part_out.scalar_type() == torch::kFloat32 && part_out.is_contiguous() && part_out.dim() == 3 &&
               part_out.size(0) >= rows && part_out.size(1) == query.size(1) && part_out.size(2) == query.size(2),
           "part_out must be contiguous float32 [>= ", rows, ", ", query.size(1), ", ", query.size(2), "], got ",
           dims(part_out.sizes()));
  KV_CHECK(part_ml.scalar_type() == torch::kFloat32 && part_ml.is_contiguous() && part_ml.dim() == 3 &&
               part_ml.size(0) >= rows && part_ml.size(1) == query.size(1) && part_ml.size(2) == 2,
           "part_ml must be contiguous float32 [>= ", rows, ", ", query.size(1), ", 2], got ", dims(part_ml.sizes()));
}

void check_mma(int64_t mma) {
  KV_CHECK(mma >= -1 && mma <= 1, "mma must be -1 (the planner's choice), 0 or 1, got ", mma);
}

// The grid plan (decode_plan.h plan_decode_grid) for these inputs: (num_splits, partition_tokens,
// head_tile, loads, mma). num_splits / loads 0, mma -1: the planner's choice (else: benchmarks and tests).
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> decode_grid_plan(Tensor query, Tensor k_cache, Tensor v_cache,
                                                                         Tensor block_tables, Tensor context_lens,
                                                                         int64_t num_splits, int64_t loads,
                                                                         int64_t mma) {
  const c10::cuda::CUDAGuard guard(query.device());
  const kvpager::DecodeArgs a = decode_args(query, k_cache, v_cache, block_tables, context_lens, 1.0, 1.0, 1.0);
  KV_CHECK(num_splits >= 0 && num_splits <= kvpager::kMaxSplits, "num_splits must be in [1, ",
           kvpager::kMaxSplits, "] (or None/0 for automatic), got ", num_splits);
  check_loads(loads);
  check_mma(mma);
  kvpager::DecodeGridPlan plan{};
  const cudaError_t err = kvpager::plan_decode_grid(to_dtype(query, "query"), to_cache_dtype(k_cache), decode_sizes(a),
                                                    static_cast<int>(num_splits), static_cast<int>(loads),
                                                    static_cast<int>(mma), query.device().index(), &plan);
  KV_CHECK(err == cudaSuccess, "no decode plan for these sizes with num_splits=", num_splits, ", mma=", mma,
           " (each split stages at most ", kvpager::kMaxTableEntries,
           " block-table entries: ask for more splits; the tensor-core instance serves fp8 caches of head_dim 64/128)");
  return {plan.num_splits, plan.partition_tokens, plan.head_tile, plan.loads, plan.mma};
}

// Grid-mode decode as a plan says (decode_grid_plan, made once for the step's sizes): checks the
// inputs and that the plan covers the table's width, then launches; never re-plans.
// part_out / part_ml: the split-KV workspace (>= num_seqs * num_splits rows) when num_splits > 1.
void paged_decode(Tensor out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables,
                  Tensor context_lens, c10::optional<Tensor> part_out, c10::optional<Tensor> part_ml,
                  int64_t num_splits, int64_t partition_tokens, int64_t head_tile, int64_t loads, int64_t mma,
                  int64_t prefetch_steps, double scale, double k_scale, double v_scale) {
  const c10::cuda::CUDAGuard guard(query.device());
  kvpager::DecodeArgs a = decode_args(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale);
  check_out(out, query);
  KV_CHECK(prefetch_steps >= -1 && prefetch_steps <= 64, "prefetch_steps must be in [0, 64] (or -1: default)");
  const int default_prefetch = mma != 0 ? kvpager::kDefaultPrefetchStepsMma : kvpager::kDefaultPrefetchSteps;
  a.prefetch_steps = prefetch_steps < 0 ? default_prefetch : static_cast<int>(prefetch_steps);
  a.out = out.data_ptr();
  a.o_stride_seq = out.stride(0);
  a.o_stride_head = out.stride(1);
  if (a.num_seqs == 0) return;
  const int64_t width = static_cast<int64_t>(a.max_blocks_per_seq) * a.block_size;
  KV_CHECK(num_splits >= 1 && num_splits <= kvpager::kMaxSplits && partition_tokens >= kvpager::kPartitionAlign &&
               partition_tokens % kvpager::kPartitionAlign == 0 &&
               partition_tokens / a.block_size <= kvpager::kMaxTableEntries && num_splits * partition_tokens >= width,
           "the decode plan (", num_splits, " splits of ", partition_tokens, " tokens) does not cover tables of ",
           width, " tokens: plan for these inputs");
  check_loads(loads);
  KV_CHECK(mma == 0 || mma == 1, "mma must be 0 or 1, got ", mma);
  a.loads = static_cast<int>(loads);
  a.mma = static_cast<int>(mma);
  a.head_tile = static_cast<int>(head_tile);
  a.head_chunks = static_cast<int>((a.num_q_heads / a.num_kv_heads + head_tile - 1) / std::max<int64_t>(head_tile, 1));
  a.num_splits = static_cast<int>(num_splits);
  a.partition_tokens = static_cast<int>(partition_tokens);
  if (num_splits > 1) {
    KV_CHECK(part_out.has_value() && part_ml.has_value(), "a split plan needs its workspace (part_out, part_ml)");
    check_workspace(*part_out, *part_ml, query, a.num_seqs * num_splits);
    a.part_out = part_out->data_ptr<float>();
    a.part_ml = part_ml->data_ptr<float>();
  }
  check_launch(kvpager::launch_paged_decode(to_dtype(query, "query"), to_cache_dtype(k_cache), a,
                                            at::cuda::getCurrentCUDAStream()),
               "paged_decode launch (no kernel instance for the plan's head_tile / loads?)");
}

// Work-list geometry (decode_plan.h plan_decode_work_geometry) of queries like `query` ([*,
// num_q_heads, head_dim]) over k_cache's layout: (workers, loads, head_tile, longest item in
// tokens, mma). Fixed per (model, cache, device): the caller plans it once. mma -1: the planner's choice.
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> decode_work_geometry(Tensor query, Tensor k_cache,
                                                                             int64_t loads, int64_t mma) {
  const c10::cuda::CUDAGuard guard(query.device());
  check_cuda(query, "query", query.device());
  check_cuda(k_cache, "k_cache", query.device());
  KV_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query must be [*, num_q_heads, head_dim] and k_cache "
           "[num_blocks, num_kv_heads, block_size, head_dim]");
  check_loads(loads);
  const int64_t block_size = k_cache.size(2);
  KV_CHECK(block_size == 8 || block_size == 16 || block_size == 32, "block_size must be 8, 16 or 32, got ", block_size);
  KV_CHECK(query.size(2) == k_cache.size(3), "query head_dim ", query.size(2), " != cache head_dim ", k_cache.size(3));
  const kvpager::DecodeSizes sizes{0, static_cast<int>(query.size(1)), static_cast<int>(k_cache.size(1)),
                                   static_cast<int>(query.size(2)), static_cast<int>(block_size), 0};
  check_mma(mma);
  kvpager::DecodeWorkGeometry g{};
  const cudaError_t err = kvpager::plan_decode_work_geometry(to_dtype(query, "query"), to_cache_dtype(k_cache), sizes,
                                                             static_cast<int>(loads), static_cast<int>(mma),
                                                             query.device().index(), &g);
  KV_CHECK(err == cudaSuccess, "no work-list decode geometry for these sizes (mma=", mma, ")");
  return {g.workers, g.loads, g.head_tile, g.longest_item, g.mma};
}

// The step's work list, planned on the host into `out` (CPU int32, launch.h layout) from the
// host context lengths; returns the item count.
int64_t plan_decode_work(Tensor context_lens, int64_t workers, int64_t longest_item, int64_t min_item,
                         int64_t item_cost, Tensor out) {
  KV_CHECK(context_lens.device().is_cpu() && out.device().is_cpu(), "plan_decode_work plans on the host: "
           "context_lens and out must be CPU tensors");
  KV_CHECK(context_lens.scalar_type() == torch::kInt32 && context_lens.dim() == 1 && context_lens.is_contiguous(),
           "context_lens must be a contiguous 1-d int32 tensor");
  KV_CHECK(out.scalar_type() == torch::kInt32 && out.dim() == 1 && out.is_contiguous(),
           "out must be a contiguous 1-d int32 tensor");
  const int64_t num_seqs = context_lens.size(0);
  KV_CHECK(workers >= 1 && workers <= 65535, "workers must be in [1, 65535], got ", workers);
  const int64_t capacity = kvpager::work_list_capacity(out.size(0), num_seqs);
  KV_CHECK(capacity >= num_seqs && capacity <= std::numeric_limits<int32_t>::max(), "out holds ", out.size(0),
           " ints: too few for ", num_seqs, " sequences (kernels/decode_plan.py plan_size)");
  const int n = kvpager::plan_decode_work(context_lens.data_ptr<int32_t>(), static_cast<int>(num_seqs),
                                          static_cast<int>(workers), static_cast<int>(longest_item),
                                          static_cast<int>(capacity), static_cast<int>(min_item),
                                          static_cast<int>(item_cost), out.data_ptr<int32_t>());
  KV_CHECK(n >= 0, kvpager::plan_decode_work_refusal(n, static_cast<int>(num_seqs), static_cast<int>(capacity),
                                                     static_cast<int>(longest_item)));
  return n;
}

// Decode over a work list planned on the host for this step (kernels/decode_plan.py layout),
// already on the device, with the geometry it was planned for (decode_work_geometry: workers,
// loads, head_tile); part_out / part_ml hold one row per item of its capacity. Checks the inputs
// and launches; never re-plans.
void paged_decode_work(Tensor out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables,
                       Tensor context_lens, Tensor work, Tensor part_out, Tensor part_ml, int64_t workers,
                       int64_t loads, int64_t head_tile, int64_t mma, double scale, double k_scale, double v_scale) {
  const c10::cuda::CUDAGuard guard(query.device());
  kvpager::DecodeArgs a = decode_args(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale);
  check_out(out, query);
  check_cuda(work, "work", query.device());
  KV_CHECK(work.scalar_type() == torch::kInt32 && work.dim() == 1 && work.is_contiguous(),
           "work must be a contiguous 1-d int32 tensor");
  KV_CHECK(workers >= 1 && workers <= 65535, "workers must be in [1, 65535], got ", workers);
  KV_CHECK(reinterpret_cast<uintptr_t>(work.data_ptr()) % 16 == 0, "work must be 16-byte aligned (the kernel "
           "reads its header as one 16-byte load and its item records as pairs)");
  const int64_t capacity = kvpager::work_list_capacity(work.size(0), query.size(0));
  KV_CHECK(capacity >= query.size(0), "work holds ", work.size(0), " ints: too few for ", query.size(0),
           " sequences (kernels/decode_plan.py plan_size)");
  check_workspace(part_out, part_ml, query, capacity);
  KV_CHECK(loads == 2 || loads == 4, "loads must be 2 or 4, got ", loads);
  KV_CHECK(head_tile >= 1 && head_tile <= 8, "head_tile must be 1, 2, 4 or 8, got ", head_tile);
  KV_CHECK(mma == 0 || mma == 1, "mma must be 0 or 1, got ", mma);
  a.prefetch_steps = mma != 0 ? kvpager::kDefaultPrefetchStepsMma : kvpager::kDefaultPrefetchSteps;
  a.loads = static_cast<int>(loads);
  a.mma = static_cast<int>(mma);
  a.head_tile = static_cast<int>(head_tile);
  a.head_chunks = static_cast<int>((a.num_q_heads / a.num_kv_heads + head_tile - 1) / head_tile);
  a.out = out.data_ptr();
  a.o_stride_seq = out.stride(0);
  a.o_stride_head = out.stride(1);
  a.work = work.data_ptr<int32_t>();
  a.work_capacity = static_cast<int>(capacity);
  a.work_workers = static_cast<int>(workers);
  a.part_out = part_out.data_ptr<float>();
  a.part_ml = part_ml.data_ptr<float>();
  if (a.num_seqs == 0) return;
  check_launch(kvpager::launch_paged_decode(to_dtype(query, "query"), to_cache_dtype(k_cache), a,
                                            at::cuda::getCurrentCUDAStream()),
               "paged_decode (work list) launch (no kernel instance for the geometry's head_tile / loads?)");
}

void write_kv(Tensor key, Tensor value, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, double k_scale,
              double v_scale) {
  const torch::Device device = k_cache.device();
  const c10::cuda::CUDAGuard guard(device);
  check_cuda(k_cache, "k_cache", device);
  check_cuda(v_cache, "v_cache", device);
  check_cuda(key, "key", device);
  check_cuda(value, "value", device);
  check_cuda(slot_mapping, "slot_mapping", device);
  check_cache_pair(k_cache, v_cache);
  KV_CHECK(key.dim() == 3 && key.sizes() == value.sizes(),
                    "key and value must both be [num_tokens, num_kv_heads, head_dim], got ", dims(key.sizes()), " and ",
                    dims(value.sizes()));
  KV_CHECK(key.size(1) == k_cache.size(1) && key.size(2) == k_cache.size(3), "key/value heads and head_dim (",
                    key.size(1), ", ", key.size(2), ") do not match the cache's (", k_cache.size(1), ", ",
                    k_cache.size(3), ")");
  const bool fp8 = to_cache_dtype(k_cache) == kvpager::kFloat8E4M3;
  KV_CHECK(key.scalar_type() == value.scalar_type() &&
               (key.scalar_type() == k_cache.scalar_type() ||
                (fp8 && (key.scalar_type() == torch::kFloat16 || key.scalar_type() == torch::kBFloat16))),
           "key/value dtype ", key.scalar_type(), "/", value.scalar_type(), " does not go with cache dtype ",
           k_cache.scalar_type(), " (the same dtype, or float16/bfloat16 into a float8_e4m3fn cache)");
  check_kv_scales(k_scale, v_scale);
  KV_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), "k_scale and v_scale apply to fp8 caches only");
  KV_CHECK((k_cache.size(3) * key.element_size()) % 16 == 0, "head_dim * element size must be a "
                    "multiple of 16 bytes");
  check_rows(key, "key");
  check_rows(value, "value");
  KV_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping must be [",
                    key.size(0), "], got ", dims(slot_mapping.sizes()));
  KV_CHECK(slot_mapping.scalar_type() == torch::kInt64 || slot_mapping.scalar_type() == torch::kInt32,
                    "slot_mapping must be int32 or int64, got ", slot_mapping.scalar_type());
  KV_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  KV_CHECK(key.size(0) <= std::numeric_limits<int32_t>::max(), "too many tokens");
  if (key.size(0) == 0) return;
  kvpager::WriteKVArgs a{};
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr();
  a.slot_is_int64 = slot_mapping.scalar_type() == torch::kInt64;
  a.key_stride_tok = key.stride(0);
  a.key_stride_head = key.stride(1);
  a.value_stride_tok = value.stride(0);
  a.value_stride_head = value.stride(1);
  a.k_stride_block = k_cache.stride(0);
  a.k_stride_head = k_cache.stride(1);
  a.v_stride_block = v_cache.stride(0);
  a.v_stride_head = v_cache.stride(1);
  a.num_tokens = static_cast<int>(key.size(0));
  a.num_heads = static_cast<int>(key.size(1));
  a.head_dim = static_cast<int>(key.size(2));
  a.block_size = static_cast<int>(k_cache.size(2));
  a.num_cache_blocks = static_cast<int>(k_cache.size(0));
  a.elem_size = static_cast<int>(key.element_size());
  a.quantize_from = fp8 ? static_cast<int>(to_dtype(key, "key")) : -1;
  a.k_inv_scale = static_cast<float>(1.0 / k_scale);
  a.v_inv_scale = static_cast<float>(1.0 / v_scale);
  check_launch(kvpager::launch_write_kv(a, at::cuda::getCurrentCUDAStream()), "write_kv launch");
}

void copy_blocks(Tensor kv_cache, Tensor src, Tensor dst) {
  const torch::Device device = kv_cache.device();
  const c10::cuda::CUDAGuard guard(device);
  check_cuda(kv_cache, "kv_cache", device);
  check_cuda(src, "src", device);
  check_cuda(dst, "dst", device);
  KV_CHECK(kv_cache.dim() == 6, "kv_cache must be [num_blocks, num_layers, 2, num_kv_heads, block_size, "
                    "head_dim], got ", dims(kv_cache.sizes()));
  KV_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous (one chunk per block)");
  KV_CHECK(aligned16(kv_cache), "kv_cache data must be 16-byte aligned");
  KV_CHECK(src.dim() == 1 && src.sizes() == dst.sizes(), "src and dst must be [num_pairs], got ",
                    dims(src.sizes()), " and ", dims(dst.sizes()));
  KV_CHECK(src.scalar_type() == torch::kInt64 && dst.scalar_type() == torch::kInt64,
                    "src and dst must be int64");
  KV_CHECK(src.is_contiguous() && dst.is_contiguous(), "src and dst must be contiguous");
  if (src.numel() == 0 || kv_cache.numel() == 0) return;
  const int64_t block_bytes = kv_cache.stride(0) * kv_cache.element_size();
  KV_CHECK(block_bytes % 16 == 0, "a block must be a multiple of 16 bytes, got ", block_bytes);
  check_launch(kvpager::launch_copy_blocks(kv_cache.data_ptr(), kv_cache.size(0), block_bytes,
                                           src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(), src.numel(),
                                           at::cuda::getCurrentCUDAStream()),
               "copy_blocks launch");
}

// The block-major caches of a swap: contiguous, same block shape and dtype, 16-byte aligned.
int64_t check_swap_caches(const Tensor& src_cache, const Tensor& dst_cache) {
  KV_CHECK(src_cache.dim() == 6 && dst_cache.dim() == 6, "caches must be [num_blocks, num_layers, 2, num_kv_heads, "
           "block_size, head_dim], got ", dims(src_cache.sizes()), " and ", dims(dst_cache.sizes()));
  KV_CHECK(src_cache.sizes().slice(1) == dst_cache.sizes().slice(1) && src_cache.scalar_type() == dst_cache.scalar_type(),
           "caches differ beyond num_blocks: ", dims(src_cache.sizes()), " ", src_cache.scalar_type(), " vs ",
           dims(dst_cache.sizes()), " ", dst_cache.scalar_type());
  KV_CHECK(src_cache.is_contiguous() && dst_cache.is_contiguous(), "caches must be contiguous (one chunk per block)");
  KV_CHECK(aligned16(src_cache) && aligned16(dst_cache), "cache data must be 16-byte aligned");
  KV_CHECK(src_cache.is_cuda() || dst_cache.is_cuda(), "one of the caches must be on a CUDA device");
  for (const Tensor* t : {&src_cache, &dst_cache})
    KV_CHECK(t->is_cuda() || t->is_pinned(), "a host-side cache must be in pinned memory");
  const int64_t block_elems = src_cache.numel() / std::max<int64_t>(src_cache.size(0), 1);
  return block_elems * src_cache.element_size();
}

torch::Device swap_device(const Tensor& src_cache, const Tensor& dst_cache) {
  if (src_cache.is_cuda() && dst_cache.is_cuda())
    KV_CHECK(src_cache.device() == dst_cache.device(), "caches on two devices: ", src_cache.device(), " and ",
             dst_cache.device());
  return src_cache.is_cuda() ? src_cache.device() : dst_cache.device();
}

// DMA swap on the current stream: ids are CPU int64 tensors (the launcher reads them on the host).
void swap_blocks_dma(Tensor src_cache, Tensor dst_cache, Tensor src, Tensor dst, bool use_batch) {
  const int64_t block_bytes = check_swap_caches(src_cache, dst_cache);
  const c10::cuda::CUDAGuard guard(swap_device(src_cache, dst_cache));
  KV_CHECK(src.device().is_cpu() && dst.device().is_cpu(), "src and dst ids must be CPU tensors");
  KV_CHECK(src.dim() == 1 && src.sizes() == dst.sizes(), "src and dst must be [num_pairs], got ", dims(src.sizes()),
           " and ", dims(dst.sizes()));
  KV_CHECK(src.scalar_type() == torch::kInt64 && dst.scalar_type() == torch::kInt64 && src.is_contiguous() &&
           dst.is_contiguous(), "src and dst must be contiguous int64");
  if (src.numel() == 0 || block_bytes == 0) return;
  check_launch(kvpager::launch_swap_dma(dst_cache.data_ptr(), dst_cache.size(0), src_cache.data_ptr(), src_cache.size(0),
                                        block_bytes, src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(), src.numel(),
                                        use_batch, at::cuda::getCurrentCUDAStream()),
               "swap_blocks (dma)");
}

void* device_view(const Tensor& t) {
  if (t.is_cuda()) return t.data_ptr();
  void* p = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&p, t.data_ptr(), 0);
  KV_CHECK(err == cudaSuccess && p != nullptr, "pinned host cache is not mapped into the device's address space: ",
           cudaGetErrorString(err));
  return p;
}

// Zero-copy swap kernel on the current stream: ids are int64 tensors on the CUDA device.
void swap_blocks_kernel(Tensor src_cache, Tensor dst_cache, Tensor src, Tensor dst) {
  const int64_t block_bytes = check_swap_caches(src_cache, dst_cache);
  const torch::Device device = swap_device(src_cache, dst_cache);
  const c10::cuda::CUDAGuard guard(device);
  check_cuda(src, "src", device);
  check_cuda(dst, "dst", device);
  KV_CHECK(src.dim() == 1 && src.sizes() == dst.sizes(), "src and dst must be [num_pairs], got ", dims(src.sizes()),
           " and ", dims(dst.sizes()));
  KV_CHECK(src.scalar_type() == torch::kInt64 && dst.scalar_type() == torch::kInt64 && src.is_contiguous() &&
           dst.is_contiguous(), "src and dst must be contiguous int64");
  KV_CHECK(block_bytes % 16 == 0, "a block must be a multiple of 16 bytes, got ", block_bytes);
  if (src.numel() == 0 || block_bytes == 0) return;
  check_launch(kvpager::launch_swap_kernel(device_view(dst_cache), dst_cache.size(0), device_view(src_cache),
                                           src_cache.size(0), block_bytes, src.data_ptr<int64_t>(),
                                           dst.data_ptr<int64_t>(), src.numel(), at::cuda::getCurrentCUDAStream()),
               "swap_blocks (kernel)");
}

// ---- paged prefill (paged_prefill.cu) ----------------------------------------------------------

// Whether the prefill kernel serves these (query dtype, cache dtype, head_dim, block_size, warps).
bool prefill_supported(Tensor query, Tensor k_cache, int64_t warps) {
  if (query.scalar_type() != torch::kFloat16 && query.scalar_type() != torch::kBFloat16) return false;
  if (k_cache.dim() != 4) return false;
  const auto cs = k_cache.scalar_type();
  if (cs != query.scalar_type() && cs != torch::kFloat8_e4m3fn) return false;
  return kvpager::paged_prefill_supported(to_dtype(query, "query"), to_cache_dtype(k_cache),
                                          static_cast<int>(k_cache.size(3)), static_cast<int>(k_cache.size(2)),
                                          static_cast<int>(warps));
}

// A split query's factors (split_query.cuh; query: its bytes viewed as bf16 [tokens, heads,
// head_dim]): float32 [num_kv_heads, tokens, G], [tokens, G] contiguous, for the kernel that reads
// them. Sets a.query_down and its stride.
void check_split_query_down(const Tensor& down, const Tensor& query, const Tensor& k_cache, const torch::Device& device,
                            int64_t warps, bool wgmma, kvpager::PrefillArgs& a) {
  check_cuda(down, "query_down", device);
  const int64_t head_dim = query.size(2), kv_heads = k_cache.size(1), tokens = query.size(0);
  KV_CHECK(query.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kFloat8_e4m3fn &&
               kvpager::paged_prefill_split_query_supported(kvpager::kBFloat16, kvpager::kFloat8E4M3,
                                                            static_cast<int>(head_dim), device.index()),
           "a split query is read by the Hopper warp-specialized prefill kernel alone (bf16 over a float8_e4m3fn "
           "cache, head_dim 64 or 128, built for sm_90a); got a ", query.scalar_type(), " query over a ",
           k_cache.scalar_type(), " cache, head_dim ", head_dim, ", on ", device);
  KV_CHECK(wgmma && warps == 8, "a split query needs the 8-warp wgmma plan, got ", warps, " warps",
           wgmma ? "" : " without wgmma");
  KV_CHECK(kv_heads >= 1 && query.size(1) % kv_heads == 0, query.size(1),
           " query heads are not a multiple of ", kv_heads, " KV heads (GQA)");
  const int64_t group = query.size(1) / kv_heads;
  KV_CHECK(down.scalar_type() == torch::kFloat32 && down.dim() == 3 && down.size(0) == kv_heads &&
               down.size(1) == tokens && down.size(2) == group && (group == 1 || down.stride(2) == 1) &&
               (tokens <= 1 || down.stride(1) == group),
           "query_down must be float32 [", kv_heads, ", ", tokens, ", ", group,
           "] with its last two dims contiguous, got ", down.scalar_type(), " ", dims(down.sizes()), " strides ",
           dims(down.strides()));
  a.query_down = down.data_ptr<float>();
  a.query_down_stride = down.stride(0);
}

// Prefill attention of the work list's rows into out (rows of sequences not in the list are left
// as they are). work: device int32 [num_items, 2] of (sequence, row tile of 16 * warps rows).
// counter: optional device int32 [2], zero (the Hopper warp-specialized kernel then schedules
// its blocks dynamically and leaves it zero; PrefillArgs::ws_counter); one launch at a time.
void paged_prefill(Tensor out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables,
                   Tensor context_lens, Tensor query_start_loc, Tensor work, double scale, double k_scale,
                   double v_scale, int64_t warps, bool wgmma, c10::optional<Tensor> counter,
                   c10::optional<Tensor> query_down) {
  const torch::Device device = query.device();
  const c10::cuda::CUDAGuard guard(device);
  for (const auto& [t, what] : {std::pair<const Tensor*, const char*>{&out, "out"}, {&query, "query"},
                                {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&block_tables, "block_tables"},
                                {&context_lens, "context_lens"}, {&query_start_loc, "query_start_loc"},
                                {&work, "work"}})
    check_cuda(*t, what, device);
  const kvpager::DType dtype = to_dtype(query, "query");
  KV_CHECK(dtype != kvpager::kFloat32, "the prefill kernel takes float16/bfloat16 queries, got float32");
  check_cache_pair(k_cache, v_cache);
  const kvpager::DType cache_dtype = to_cache_dtype(k_cache);
  KV_CHECK(cache_dtype == dtype || cache_dtype == kvpager::kFloat8E4M3, "query dtype ", query.scalar_type(),
           " does not go with cache dtype ", k_cache.scalar_type());
  check_kv_scales(k_scale, v_scale);
  KV_CHECK(cache_dtype == kvpager::kFloat8E4M3 || (k_scale == 1.0 && v_scale == 1.0),
           "k_scale and v_scale apply to fp8 caches only");
  check_rows(query, "query");
  check_rows(out, "out");
  KV_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(), "out must be ",
           dims(query.sizes()), " ", query.scalar_type(), ", got ", dims(out.sizes()), " ", out.scalar_type());
  KV_CHECK(k_cache.stride(0) == v_cache.stride(0), "k_cache and v_cache must share a block stride");
  const int64_t num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  KV_CHECK(head_dim == k_cache.size(3), "query head_dim ", head_dim, " != cache head_dim ", k_cache.size(3));
  KV_CHECK(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0, num_q_heads,
           " query heads are not a multiple of ", num_kv_heads, " KV heads (GQA)");
  KV_CHECK(kvpager::paged_prefill_supported(dtype, cache_dtype, static_cast<int>(head_dim),
                                            static_cast<int>(block_size), static_cast<int>(warps)),
           "no prefill kernel for head_dim ", head_dim, ", block_size ", block_size, ", ", warps, " warps");
  KV_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 &&
               (block_tables.size(1) <= 1 || block_tables.stride(1) == 1),
           "block_tables must be int32 [num_seqs, max_blocks], contiguous along max_blocks");
  const int64_t num_seqs = block_tables.size(0);
  KV_CHECK(block_tables.size(1) * block_size <= std::numeric_limits<int32_t>::max() / 2, "block_tables is too wide");
  KV_CHECK(context_lens.scalar_type() == torch::kInt32 && context_lens.dim() == 1 && context_lens.is_contiguous() &&
               context_lens.size(0) == num_seqs,
           "context_lens must be contiguous int32 [", num_seqs, "]");
  KV_CHECK(query_start_loc.scalar_type() == torch::kInt32 && query_start_loc.dim() == 1 &&
               query_start_loc.is_contiguous() && query_start_loc.size(0) == num_seqs + 1,
           "query_start_loc must be contiguous int32 [", num_seqs + 1, "]");
  KV_CHECK(work.scalar_type() == torch::kInt32 && work.dim() == 2 && work.size(1) == 2 && work.is_contiguous(),
           "work must be contiguous int32 [num_items, 2]");
  KV_CHECK(std::isfinite(scale) && scale > 0, "the prefill kernel needs a finite scale > 0, got ", scale);
  KV_CHECK(!wgmma || warps == 8, "the wgmma prefill instances have 8 warps, got ", warps);
  KV_CHECK(work.size(0) * num_kv_heads <= std::numeric_limits<int32_t>::max(), "too many work items");
  if (counter.has_value()) {
    check_cuda(*counter, "counter", device);
    KV_CHECK(counter->scalar_type() == torch::kInt32 && counter->dim() == 1 && counter->size(0) == 2 &&
                 counter->is_contiguous(),
             "counter must be a contiguous int32 [2] tensor (zeros)");
  }
  kvpager::PrefillArgs a{};
  if (query_down.has_value()) check_split_query_down(*query_down, query, k_cache, device, warps, wgmma, a);
  fill_cache_fields(a, query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale);
  a.out = out.data_ptr();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.work = work.data_ptr<int32_t>();
  a.ws_counter = counter.has_value() ? counter->data_ptr<int32_t>() : nullptr;
  a.q_stride_tok = query.stride(0);
  a.o_stride_tok = out.stride(0);
  a.o_stride_head = out.stride(1);
  a.num_items = static_cast<int>(work.size(0));
  a.warps = static_cast<int>(warps);
  a.wgmma = wgmma ? 1 : 0;
  if (a.num_items == 0 || query.size(0) == 0) return;
  check_launch(kvpager::launch_paged_prefill(dtype, cache_dtype, a, at::cuda::getCurrentCUDAStream()),
               "paged_prefill launch");
}

// ---- the decoder's per-layer elementwise ops (layer_ops.cu) ----------------------------------------

// [rows, cols] with a contiguous last dim, on `device`, of `dtype`.
void check_rows(const Tensor& t, const char* what, const torch::Device& device, c10::ScalarType dtype) {
  check_cuda(t, what, device);
  KV_CHECK(t.scalar_type() == dtype, what, " must be ", dtype, " like the other inputs, got ", t.scalar_type());
  KV_CHECK(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1), what,
           " must be [rows, cols] with a contiguous last dim, got sizes ", dims(t.sizes()), " strides ",
           dims(t.strides()));
}

void add_rms_norm(Tensor out, Tensor x, c10::optional<Tensor> delta, Tensor weight, double eps) {
  const torch::Device device = x.device();
  const c10::cuda::CUDAGuard guard(device);
  const auto dtype = x.scalar_type();
  check_rows(x, "x", device, dtype);
  check_rows(out, "out", device, dtype);
  KV_CHECK(out.sizes() == x.sizes(), "out must have x's shape ", dims(x.sizes()), ", got ", dims(out.sizes()));
  check_cuda(weight, "weight", device);
  KV_CHECK(weight.scalar_type() == dtype && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
           "weight must be a contiguous [", x.size(1), "] tensor of x's dtype");
  KV_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  kvpager::RMSNormArgs a{};
  if (delta.has_value()) {
    check_rows(*delta, "delta", device, dtype);
    KV_CHECK(delta->sizes() == x.sizes(), "delta must have x's shape ", dims(x.sizes()), ", got ",
             dims(delta->sizes()));
    a.delta = delta->data_ptr();
    a.delta_stride = delta->stride(0);
  }
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.out_stride = out.stride(0);
  a.x_stride = x.stride(0);
  a.rows = static_cast<int>(x.size(0));
  a.hidden = static_cast<int>(x.size(1));
  a.eps = static_cast<float>(eps);
  if (a.rows == 0) return;
  check_launch(kvpager::launch_add_rms_norm(to_dtype(x, "x"), a, at::cuda::getCurrentCUDAStream()), "add_rms_norm");
}

// [tokens, heads, head_dim] with a contiguous last dim.
void check_heads(const Tensor& t, const char* what, const torch::Device& device, c10::ScalarType dtype) {
  check_cuda(t, what, device);
  KV_CHECK(t.scalar_type() == dtype, what, " must be ", dtype, " like q, got ", t.scalar_type());
  KV_CHECK(t.dim() == 3 && (t.size(2) <= 1 || t.stride(2) == 1), what,
           " must be [tokens, heads, head_dim] with a contiguous last dim, got sizes ", dims(t.sizes()), " strides ",
           dims(t.strides()));
}

// Whether every row (the last dim) of t starts at a multiple of `bytes`: its pointer and its other
// dims' strides.
bool rows_aligned(const Tensor& t, int64_t bytes) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.stride(d) * t.element_size()) % bytes == 0;
  return ok;
}

void rope(Tensor q, Tensor k, Tensor cos, Tensor sin) {
  const torch::Device device = q.device();
  const c10::cuda::CUDAGuard guard(device);
  const auto dtype = q.scalar_type();
  check_heads(q, "q", device, dtype);
  check_heads(k, "k", device, dtype);
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  KV_CHECK(k.size(0) == tokens && k.size(2) == head_dim, "k must be [", tokens, ", *, ", head_dim, "], got ",
           dims(k.sizes()));
  KV_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  check_rows(cos, "cos", device, dtype);
  check_rows(sin, "sin", device, dtype);
  KV_CHECK(cos.size(0) == tokens && cos.size(1) == head_dim && sin.sizes() == cos.sizes() &&
           sin.stride(0) == cos.stride(0), "cos and sin must be [", tokens, ", ", head_dim,
           "] with equal strides, got ", dims(cos.sizes()), " and ", dims(sin.sizes()));
  kvpager::RopeArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.q_stride_tok = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.k_stride_tok = k.stride(0);
  a.k_stride_head = k.stride(1);
  a.cos_stride = cos.stride(0);
  a.tokens = static_cast<int>(tokens);
  a.q_heads = static_cast<int>(q.size(1));
  a.k_heads = static_cast<int>(k.size(1));
  a.head_dim = static_cast<int>(head_dim);
  const int64_t quad = 4 * q.element_size();   // four elements a thread where every row allows it
  a.quads = (head_dim / 2) % 4 == 0 && rows_aligned(q, quad) && rows_aligned(k, quad) && rows_aligned(cos, quad) &&
            rows_aligned(sin, quad);
  if (tokens == 0) return;
  check_launch(kvpager::launch_rope(to_dtype(q, "q"), a, at::cuda::getCurrentCUDAStream()), "rope");
}

// q rotated (cos/sin given) and split into q_split / q_down (split_query.cuh) for the fp8 prefill
// kernel, q left as it is but at the tokens `keep` marks (rotated in place there too); k (if given)
// rotated in place. bf16, head_dim 64 or 128.
void rope_split_query(Tensor q, c10::optional<Tensor> k, c10::optional<Tensor> cos, c10::optional<Tensor> sin,
                      Tensor q_split, Tensor q_down, c10::optional<Tensor> keep) {
  const torch::Device device = q.device();
  const c10::cuda::CUDAGuard guard(device);
  check_heads(q, "q", device, torch::kBFloat16);
  const int64_t tokens = q.size(0), q_heads = q.size(1), head_dim = q.size(2);
  KV_CHECK(head_dim == 64 || head_dim == 128, "a split query has head_dim 64 or 128, got ", head_dim);
  KV_CHECK(cos.has_value() == sin.has_value(), "give cos and sin together, or neither");
  KV_CHECK(!k.has_value() || cos.has_value(), "k is rotated by cos and sin: give them with it");
  // 8-byte loads of 4 values: rows (and cos/sin rows) at 8-byte aligned addresses.
  KV_CHECK(rows_aligned(q, 8), "q's rows must start at 8-byte aligned addresses, got strides ", dims(q.strides()));
  kvpager::RopeSplitArgs s{};
  kvpager::RopeArgs& a = s.rope;
  a.q = q.data_ptr();
  a.q_stride_tok = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.tokens = static_cast<int>(tokens);
  a.q_heads = static_cast<int>(q_heads);
  a.head_dim = static_cast<int>(head_dim);
  if (k.has_value()) {
    check_heads(*k, "k", device, torch::kBFloat16);
    KV_CHECK(k->size(0) == tokens && k->size(2) == head_dim, "k must be [", tokens, ", *, ", head_dim, "], got ",
             dims(k->sizes()));
    a.k = k->data_ptr();
    a.k_stride_tok = k->stride(0);
    a.k_stride_head = k->stride(1);
    a.k_heads = static_cast<int>(k->size(1));
    a.quads = rows_aligned(*k, 8);   // (cos and sin: 8-byte aligned rows, checked below; head_dim / 2: 32 or 64)
  }
  if (cos.has_value()) {
    check_rows(*cos, "cos", device, torch::kBFloat16);
    check_rows(*sin, "sin", device, torch::kBFloat16);
    KV_CHECK(cos->size(0) == tokens && cos->size(1) == head_dim && sin->sizes() == cos->sizes() &&
             sin->stride(0) == cos->stride(0), "cos and sin must be [", tokens, ", ", head_dim,
             "] with equal strides, got ", dims(cos->sizes()), " and ", dims(sin->sizes()));
    KV_CHECK(rows_aligned(*cos, 8) && rows_aligned(*sin, 8), "cos and sin rows must start at 8-byte aligned addresses");
    a.cos = cos->data_ptr();
    a.sin = sin->data_ptr();
    a.cos_stride = cos->stride(0);
  }
  check_cuda(q_split, "q_split", device);
  KV_CHECK(q_split.scalar_type() == torch::kUInt8 && q_split.dim() == 3 && q_split.size(0) == tokens &&
               q_split.size(1) == q_heads && q_split.size(2) == 2 * head_dim && q_split.stride(2) == 1 &&
               rows_aligned(q_split, 16),
           "q_split must be uint8 [", tokens, ", ", q_heads, ", ", 2 * head_dim,
           "], its rows contiguous and 16-byte aligned, got ", q_split.scalar_type(), " ", dims(q_split.sizes()),
           " strides ", dims(q_split.strides()));
  check_cuda(q_down, "q_down", device);
  KV_CHECK(q_down.scalar_type() == torch::kFloat32 && q_down.dim() == 3 && q_down.size(0) >= 1 &&
               q_heads % q_down.size(0) == 0, "q_down must be float32 [kv_heads, ", tokens,
           ", q_heads / kv_heads], got ", q_down.scalar_type(), " ", dims(q_down.sizes()));
  const int64_t group = q_heads / q_down.size(0);
  KV_CHECK(q_down.size(1) == tokens && q_down.size(2) == group && (group == 1 || q_down.stride(2) == 1) &&
               (tokens <= 1 || q_down.stride(1) == group),
           "q_down must be float32 [", q_down.size(0), ", ", tokens, ", ", group,
           "] with its last two dims contiguous, got ", dims(q_down.sizes()), " strides ", dims(q_down.strides()));
  s.q_split = q_split.data_ptr();
  s.q_down = q_down.data_ptr<float>();
  s.split_stride_tok = q_split.stride(0);
  s.split_stride_head = q_split.stride(1);
  s.down_stride = q_down.stride(0);
  s.group = static_cast<int>(group);
  if (keep.has_value()) {
    check_cuda(*keep, "keep", device);
    KV_CHECK(cos.has_value(), "keep marks tokens whose q is rotated in place: give cos and sin with it");
    KV_CHECK(keep->scalar_type() == torch::kInt32 && keep->dim() == 1 && keep->size(0) == tokens &&
                 keep->is_contiguous(),
             "keep must be a contiguous int32 [", tokens, "] tensor, got ", keep->scalar_type(), " ",
             dims(keep->sizes()));
    s.keep = keep->data_ptr<int32_t>();
  }
  if (tokens == 0) return;
  check_launch(kvpager::launch_rope_split_query(s, at::cuda::getCurrentCUDAStream()), "rope_split_query");
}

void silu_and_mul(Tensor out, Tensor gate_up) {
  const torch::Device device = gate_up.device();
  const c10::cuda::CUDAGuard guard(device);
  const auto dtype = gate_up.scalar_type();
  check_rows(gate_up, "gate_up", device, dtype);
  check_rows(out, "out", device, dtype);
  KV_CHECK(gate_up.size(1) % 2 == 0 && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1),
           "out must be [rows, width] for gate_up [rows, 2 * width], got ", dims(out.sizes()), " and ",
           dims(gate_up.sizes()));
  kvpager::SiluMulArgs a{};
  a.out = out.data_ptr();
  a.gate_up = gate_up.data_ptr();
  a.out_stride = out.stride(0);
  a.gate_up_stride = gate_up.stride(0);
  a.rows = static_cast<int>(out.size(0));
  a.width = static_cast<int>(out.size(1));
  if (a.rows == 0 || a.width == 0) return;
  check_launch(kvpager::launch_silu_and_mul(to_dtype(gate_up, "gate_up"), a, at::cuda::getCurrentCUDAStream()),
               "silu_and_mul");
}

}  // namespace

void bind_decode_stage(py::module_& m);   // decode_stage_binding.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvpager CUDA kernels (see kvpager.kernels.cuda for the typed wrappers)";
  m.def("decode_grid_plan", &decode_grid_plan,
        "(num_splits, partition_tokens, head_tile, loads, mma) of a grid decode", py::arg("query"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("num_splits"), py::arg("loads"),
        py::arg("mma"));
  m.def("paged_decode", &paged_decode, "paged decode attention into out as a grid plan says", py::arg("out"),
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("part_out"), py::arg("part_ml"), py::arg("num_splits"), py::arg("partition_tokens"),
        py::arg("head_tile"), py::arg("loads"), py::arg("mma"), py::arg("prefetch_steps"), py::arg("scale"),
        py::arg("k_scale"),
        py::arg("v_scale"));
  m.def("decode_work_geometry", &decode_work_geometry,
        "(workers, loads, head_tile, longest item in tokens, mma) of work-list decode launches", py::arg("query"),
        py::arg("k_cache"), py::arg("loads"), py::arg("mma"));
  m.def("plan_decode_work", &plan_decode_work, "plan a step's decode work list on the host (launch.h layout)",
        py::arg("context_lens"), py::arg("workers"), py::arg("longest_item"), py::arg("min_item"),
        py::arg("item_cost"), py::arg("out"));
  m.def("paged_decode_work", &paged_decode_work, "paged decode attention over a work list planned for the step",
        py::arg("out"), py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("work"), py::arg("part_out"), py::arg("part_ml"), py::arg("workers"),
        py::arg("loads"), py::arg("head_tile"), py::arg("mma"), py::arg("scale"), py::arg("k_scale"),
        py::arg("v_scale"));
  m.def("prefill_supported", &prefill_supported, "whether the paged prefill kernel serves these inputs",
        py::arg("query"), py::arg("k_cache"), py::arg("warps"));
  m.def("paged_prefill", &paged_prefill, "paged prefill attention of a work list's rows into out", py::arg("out"),
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("query_start_loc"), py::arg("work"), py::arg("scale"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("warps"), py::arg("wgmma"), py::arg("counter") = py::none(), py::arg("query_down") = py::none());
  m.def("prefill_split_query_supported", [](Tensor query, Tensor k_cache) {
          if (!query.is_cuda() || query.scalar_type() != torch::kBFloat16 ||
              k_cache.scalar_type() != torch::kFloat8_e4m3fn || k_cache.dim() != 4)
            return false;
          const c10::cuda::CUDAGuard guard(query.device());
          return kvpager::paged_prefill_split_query_supported(kvpager::kBFloat16, kvpager::kFloat8E4M3,
                                                              static_cast<int>(k_cache.size(3)),
                                                              query.device().index());
        },
        "whether paged_prefill takes a split query for these (bf16 over fp8, Hopper's warp-specialized kernel)",
        py::arg("query"), py::arg("k_cache"));
  m.def("prefill_has_wgmma", [](int64_t device) {
          const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
          return kvpager::paged_prefill_has_wgmma(static_cast<int>(device));
        },
        "whether the prefill kernel's wgmma instances were built for sm_90a (else they run mma.sync)",
        py::arg("device"));
  m.def("write_kv", &write_kv, "scatter K/V into their cache slots (quantizing into an fp8 cache)",
        py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("copy_blocks", &copy_blocks, "copy whole blocks of a block-major cache", py::arg("kv_cache"), py::arg("src"),
        py::arg("dst"));
  m.def("swap_blocks_dma", &swap_blocks_dma, "swap whole blocks with the copy engines (ids on the host)",
        py::arg("src_cache"), py::arg("dst_cache"), py::arg("src"), py::arg("dst"), py::arg("use_batch"));
  m.def("swap_blocks_kernel", &swap_blocks_kernel, "swap whole blocks with a zero-copy kernel (ids on the device)",
        py::arg("src_cache"), py::arg("dst_cache"), py::arg("src"), py::arg("dst"));
  m.def("add_rms_norm", &add_rms_norm, "out = RMSNorm(x (+= delta, in place)) * weight", py::arg("out"),
        py::arg("x"), py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("rope", &rope, "rotate-half rotary embedding of q and k, in place", py::arg("q"), py::arg("k"),
        py::arg("cos"), py::arg("sin"));
  m.def("rope_split_query", &rope_split_query,
        "q rotated (cos/sin given) and split for the fp8 prefill kernel into q_split and q_down; k rotated in place",
        py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("q_split"), py::arg("q_down"),
        py::arg("keep") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up for gate_up = [gate | up]", py::arg("out"),
        py::arg("gate_up"));
  bind_decode_stage(m);
}
