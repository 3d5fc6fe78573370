// Torch binding of the cache ops (launch.h): K/V written into their slots (quantized into an fp8
// cache), whole blocks copied (copy-on-write) and swapped between device and host.
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "binding_checks.h"

namespace {

using namespace kvbind;
using torch::Tensor;

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

}  // namespace

void bind_cache_ops(pybind11::module_& m) {
  m.def("write_kv", &write_kv, "scatter K/V into their cache slots (quantizing into an fp8 cache)",
        py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("copy_blocks", &copy_blocks, "copy whole blocks of a block-major cache", py::arg("kv_cache"), py::arg("src"),
        py::arg("dst"));
  m.def("swap_blocks_dma", &swap_blocks_dma, "swap whole blocks with the copy engines (ids on the host)",
        py::arg("src_cache"), py::arg("dst_cache"), py::arg("src"), py::arg("dst"), py::arg("use_batch"));
  m.def("swap_blocks_kernel", &swap_blocks_kernel, "swap whole blocks with a zero-copy kernel (ids on the device)",
        py::arg("src_cache"), py::arg("dst_cache"), py::arg("src"), py::arg("dst"));
}
