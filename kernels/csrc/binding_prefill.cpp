// Torch binding of the paged prefill kernel (paged_prefill.cu): whether it serves a query and
// cache, and one launch over a work list planned for the step (kernels/prefill.py).
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "binding_checks.h"

namespace {

using namespace kvbind;
using torch::Tensor;

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

// A split query's factors (split_query.cuh; query: its bytes viewed as its type before the split,
// bf16 or fp16 [tokens, heads, head_dim]): float32 [num_kv_heads, tokens, G], [tokens, G]
// contiguous, for the kernel that reads them. Sets a.query_down and its stride.
void check_split_query_down(const Tensor& down, const Tensor& query, const Tensor& k_cache, const torch::Device& device,
                            int64_t warps, bool wgmma, kvpager::PrefillArgs& a) {
  check_cuda(down, "query_down", device);
  const int64_t head_dim = query.size(2), kv_heads = k_cache.size(1), tokens = query.size(0);
  const bool sixteen = query.scalar_type() == torch::kBFloat16 || query.scalar_type() == torch::kFloat16;
  KV_CHECK(sixteen && k_cache.scalar_type() == torch::kFloat8_e4m3fn &&
               kvpager::paged_prefill_split_query_supported(to_dtype(query, "query"), kvpager::kFloat8E4M3,
                                                            static_cast<int>(head_dim), device.index()),
           "a split query is read by the Hopper warp-specialized prefill kernel alone (bf16 or fp16 over a "
           "float8_e4m3fn cache, head_dim 64 or 128, built for sm_90a); got a ", query.scalar_type(),
           " query over a ", k_cache.scalar_type(), " cache, head_dim ", head_dim, ", on ", device);
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

}  // namespace

void bind_prefill(pybind11::module_& m) {
  m.def("prefill_supported", &prefill_supported, "whether the paged prefill kernel serves these inputs",
        py::arg("query"), py::arg("k_cache"), py::arg("warps"));
  m.def("paged_prefill", &paged_prefill, "paged prefill attention of a work list's rows into out", py::arg("out"),
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("query_start_loc"), py::arg("work"), py::arg("scale"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("warps"), py::arg("wgmma"), py::arg("counter") = py::none(), py::arg("query_down") = py::none());
  m.def("prefill_split_query_supported", [](Tensor query, Tensor k_cache) {
          const auto dtype = query.scalar_type();
          if (!query.is_cuda() || (dtype != torch::kBFloat16 && dtype != torch::kFloat16) ||
              k_cache.scalar_type() != torch::kFloat8_e4m3fn || k_cache.dim() != 4)
            return false;
          const c10::cuda::CUDAGuard guard(query.device());
          return kvpager::paged_prefill_split_query_supported(to_dtype(query, "query"), kvpager::kFloat8E4M3,
                                                              static_cast<int>(k_cache.size(3)),
                                                              query.device().index());
        },
        "whether paged_prefill takes a split query for these (bf16 or fp16 over fp8, Hopper's warp-specialized "
        "kernel)",
        py::arg("query"), py::arg("k_cache"));
  m.def("prefill_has_wgmma", [](int64_t device) {
          const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
          return kvpager::paged_prefill_has_wgmma(static_cast<int>(device));
        },
        "whether the prefill kernel's wgmma instances were built for sm_90a (else they run mma.sync)",
        py::arg("device"));
}
