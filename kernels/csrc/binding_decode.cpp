// Torch binding of the decode launchers (launch.h, launch.cu): a grid plan or a work list planned
// once per step on the host (decode_plan.h), then every layer's launch, each checking its inputs.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <tuple>

#include "decode_plan.h"
#include "binding_checks.h"

namespace {

using namespace kvbind;
using torch::Tensor;

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
  KV_CHECK(mma >= -1 && mma <= 2, "mma must be -1 (the planner's choice), 0, 1 or 2, got ", mma);
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

// The L2 prefetch distance a launch takes: `requested` (kernels/debug.py's knob, 0..64), or the
// instance's default when it is -1.
int prefetch_distance(int64_t requested, int64_t mma) {
  KV_CHECK(requested >= -1 && requested <= 64, "prefetch_steps must be in [0, 64] (or -1: default)");
  if (requested >= 0) return static_cast<int>(requested);
  return mma != 0 ? kvpager::kDefaultPrefetchStepsMma : kvpager::kDefaultPrefetchSteps;
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
  a.prefetch_steps = prefetch_distance(prefetch_steps, mma);
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
  KV_CHECK(mma >= 0 && mma <= 2, "mma must be 0, 1 or 2, got ", mma);
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
                       int64_t loads, int64_t head_tile, int64_t mma, int64_t prefetch_steps, double scale,
                       double k_scale, double v_scale) {
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
  KV_CHECK(mma >= 0 && mma <= 2, "mma must be 0, 1 or 2, got ", mma);
  a.prefetch_steps = prefetch_distance(prefetch_steps, mma);
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

}  // namespace

void bind_decode(pybind11::module_& m) {
  m.def("device_memory_bandwidth", [](int64_t device) { return kvpager::device_memory_bandwidth(static_cast<int>(device)); },
        "peak DRAM bytes/s of a CUDA device (memory clock x bus width; 0 if unknown), as the decode planner reads it",
        py::arg("device"));
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
        py::arg("loads"), py::arg("head_tile"), py::arg("mma"), py::arg("prefetch_steps"), py::arg("scale"),
        py::arg("k_scale"), py::arg("v_scale"));
}
