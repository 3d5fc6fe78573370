// Torch binding of the decoder's per-layer elementwise ops (layer_ops.h): RMSNorm with the
// residual add, RoPE (in place, or writing q split for the fp8 prefill kernel), SiLU and mul.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "layer_ops.h"
#include "binding_checks.h"

namespace {

using namespace kvbind;
using torch::Tensor;

// A tensor of `rank` dims (`layout` names them) with a contiguous last dim, on `device`, of
// `dtype` (that of `like`).
void check_layout(const Tensor& t, const char* what, const torch::Device& device, c10::ScalarType dtype,
                  int64_t rank, const char* layout, const char* like) {
  check_cuda(t, what, device);
  KV_CHECK(t.scalar_type() == dtype, what, " must be ", dtype, " like ", like, ", got ", t.scalar_type());
  KV_CHECK(t.dim() == rank && (t.size(rank - 1) <= 1 || t.stride(rank - 1) == 1), what, " must be ", layout,
           " with a contiguous last dim, got sizes ", dims(t.sizes()), " strides ", dims(t.strides()));
}

// [rows, cols] with a contiguous last dim, on `device`, of `dtype`.
void check_matrix(const Tensor& t, const char* what, const torch::Device& device, c10::ScalarType dtype) {
  check_layout(t, what, device, dtype, 2, "[rows, cols]", "the other inputs");
}

void add_rms_norm(Tensor out, Tensor x, c10::optional<Tensor> delta, Tensor weight, double eps) {
  const torch::Device device = x.device();
  const c10::cuda::CUDAGuard guard(device);
  const auto dtype = x.scalar_type();
  check_matrix(x, "x", device, dtype);
  check_matrix(out, "out", device, dtype);
  KV_CHECK(out.sizes() == x.sizes(), "out must have x's shape ", dims(x.sizes()), ", got ", dims(out.sizes()));
  check_cuda(weight, "weight", device);
  KV_CHECK(weight.scalar_type() == dtype && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
           "weight must be a contiguous [", x.size(1), "] tensor of x's dtype");
  KV_CHECK(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got ", eps);
  kvpager::RMSNormArgs a{};
  if (delta.has_value()) {
    check_matrix(*delta, "delta", device, dtype);
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
  check_layout(t, what, device, dtype, 3, "[tokens, heads, head_dim]", "q");
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
  check_matrix(cos, "cos", device, dtype);
  check_matrix(sin, "sin", device, dtype);
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
// rotated in place. bf16 or fp16 (k, cos and sin of q's type), head_dim 64 or 128.
void rope_split_query(Tensor q, c10::optional<Tensor> k, c10::optional<Tensor> cos, c10::optional<Tensor> sin,
                      Tensor q_split, Tensor q_down, c10::optional<Tensor> keep) {
  const torch::Device device = q.device();
  const c10::cuda::CUDAGuard guard(device);
  const auto dtype = q.scalar_type();
  KV_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat16, "q must be bfloat16 or float16 to be split, got ",
           dtype);
  check_heads(q, "q", device, dtype);
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
    check_heads(*k, "k", device, dtype);
    KV_CHECK(k->size(0) == tokens && k->size(2) == head_dim, "k must be [", tokens, ", *, ", head_dim, "], got ",
             dims(k->sizes()));
    a.k = k->data_ptr();
    a.k_stride_tok = k->stride(0);
    a.k_stride_head = k->stride(1);
    a.k_heads = static_cast<int>(k->size(1));
    a.quads = rows_aligned(*k, 8);   // (cos and sin: 8-byte aligned rows, checked below; head_dim / 2: 32 or 64)
  }
  if (cos.has_value()) {
    check_matrix(*cos, "cos", device, dtype);
    check_matrix(*sin, "sin", device, dtype);
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
  check_launch(kvpager::launch_rope_split_query(to_dtype(q, "q"), s, at::cuda::getCurrentCUDAStream()),
               "rope_split_query");
}

void silu_and_mul(Tensor out, Tensor gate_up) {
  const torch::Device device = gate_up.device();
  const c10::cuda::CUDAGuard guard(device);
  const auto dtype = gate_up.scalar_type();
  check_matrix(gate_up, "gate_up", device, dtype);
  check_matrix(out, "out", device, dtype);
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

void bind_layer_ops(pybind11::module_& m) {
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
}
