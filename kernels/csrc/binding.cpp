// The kvpager CUDA extension's module: each binding_*.cpp checks its inputs (binding_checks.h),
// fills its launchers' structs of raw pointers and element strides, and launches on the current
// CUDA stream of the tensors' device; this file only registers them.
#include <torch/extension.h>

void bind_decode(pybind11::module_& m);        // binding_decode.cpp
void bind_prefill(pybind11::module_& m);       // binding_prefill.cpp
void bind_cache_ops(pybind11::module_& m);     // binding_cache_ops.cpp
void bind_layer_ops(pybind11::module_& m);     // binding_layer_ops.cpp
void bind_decode_stage(pybind11::module_& m);  // decode_stage_binding.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvpager CUDA kernels (see kvpager.kernels.cuda for the typed wrappers)";
  bind_decode(m);
  bind_prefill(m);
  bind_cache_ops(m);
  bind_layer_ops(m);
  bind_decode_stage(m);
}
