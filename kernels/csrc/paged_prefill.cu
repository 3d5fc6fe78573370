// Launcher of the paged prefill kernel (paged_prefill.cuh): fp16/bf16 queries over fp16/bf16 or
// fp8 e4m3 caches, head_dim 64/128; mma.sync with 4 or 8 warps per block, or (sm_90a) wgmma
// with 8 (two warpgroups). No torch here.
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "launch.h"
#include "paged_prefill.cuh"
#include "paged_prefill_ws.cuh"

// 0: the wgmma instances run the two-warpgroup kernel of paged_prefill.cuh instead of the
// warp-specialized persistent one of paged_prefill_ws.cuh, whatever the cache (for A/B timing).
#ifndef KVPAGER_PREFILL_WS
#define KVPAGER_PREFILL_WS 1
#endif
// 0: the wgmma instances over fp8 caches run the two-warpgroup kernel (every thread loads and
// dequantizes its rows, the code before 2026-11-26, ninth session) instead of the
// warp-specialized one (its producer dequantizes), for A/B timing.
#ifndef KVPAGER_PREFILL_WS_FP8
#define KVPAGER_PREFILL_WS_FP8 1
#endif

namespace kvpager {
namespace {

template <typename T_, typename C_, int D_, int W_, bool WG_>
struct PrefillCfg {
  using T = T_;
  using C = C_;
  static constexpr int D = D_;
  static constexpr int W = W_;
  static constexpr bool WG = WG_;
};

template <typename T, typename C, int D, typename F>
bool dispatch_warps(int warps, bool wgmma, F&& f) {
  // No 4-warp wgmma instance: one warpgroup holding its K/V tile offsets alone spills.
  switch (warps * 2 + (wgmma ? 1 : 0)) {
    case 8: f(PrefillCfg<T, C, D, 4, false>{}); return true;
    case 16: f(PrefillCfg<T, C, D, 8, false>{}); return true;
    case 17: f(PrefillCfg<T, C, D, 8, true>{}); return true;
    default: return false;
  }
}

template <typename T, typename C, typename F>
bool dispatch_dim(int head_dim, int warps, bool wgmma, F&& f) {
  switch (head_dim) {
    case 64: return dispatch_warps<T, C, 64>(warps, wgmma, f);
    case 128: return dispatch_warps<T, C, 128>(warps, wgmma, f);
    default: return false;
  }
}

template <typename F>
bool dispatch_prefill(DType dtype, DType cache_dtype, int head_dim, int warps, bool wgmma, F&& f) {
  if (dtype == kFloat16) {
    if (cache_dtype == kFloat16) return dispatch_dim<__half, __half>(head_dim, warps, wgmma, f);
    if (cache_dtype == kFloat8E4M3) return dispatch_dim<__half, __nv_fp8_e4m3>(head_dim, warps, wgmma, f);
  } else if (dtype == kBFloat16) {
    if (cache_dtype == kBFloat16) return dispatch_dim<__nv_bfloat16, __nv_bfloat16>(head_dim, warps, wgmma, f);
    if (cache_dtype == kFloat8E4M3) return dispatch_dim<__nv_bfloat16, __nv_fp8_e4m3>(head_dim, warps, wgmma, f);
  }
  return false;
}

bool block_size_ok(int b) { return b >= 8 && b <= 64 && (b & (b - 1)) == 0; }

}  // namespace

bool paged_prefill_supported(DType dtype, DType cache_dtype, int head_dim, int block_size, int warps) {
  return block_size_ok(block_size) && dispatch_prefill(dtype, cache_dtype, head_dim, warps, false, [](auto) {});
}

cudaError_t launch_paged_prefill(DType dtype, DType cache_dtype, const PrefillArgs& a, cudaStream_t stream) {
  if (a.num_items == 0) return cudaSuccess;
  if (a.num_items < 0 || !block_size_ok(a.block_size) || (1 << a.log2_block_size) != a.block_size ||
      a.num_kv_heads < 1 || a.num_q_heads % a.num_kv_heads != 0 ||
      static_cast<int64_t>(a.num_items) * a.num_kv_heads > 0x7fffffffLL)
    return cudaErrorInvalidValue;
  cudaError_t err = cudaSuccess;
  int device = 0;
  if (a.wgmma != 0 && (err = cudaGetDevice(&device)) != cudaSuccess) return err;
  const bool ok = dispatch_prefill(dtype, cache_dtype, a.head_dim, a.warps, a.wgmma != 0, [&](auto cfg) {
    using Cfg = decltype(cfg);
    constexpr bool fp8 = !std::is_same_v<typename Cfg::T, typename Cfg::C>;
    if constexpr (Cfg::WG && KVPAGER_PREFILL_WS != 0 && (!fp8 || KVPAGER_PREFILL_WS_FP8 != 0)) {
      if (paged_prefill_has_wgmma(device)) {
        if (a.query_down != nullptr && !ws_q_ahead<typename Cfg::T, typename Cfg::C>) {
          err = cudaErrorInvalidValue;   // a split query is read by this kernel's split-query instances alone
          return;
        }
        // Persistent: one block per SM at most, each looping over (work item, KV head) pairs.
        auto ws = paged_prefill_ws_kernel<typename Cfg::T, typename Cfg::C, Cfg::D>;
        constexpr int ws_smem = prefill_ws_smem_bytes<typename Cfg::T, typename Cfg::C, Cfg::D>();
        err = cudaFuncSetAttribute(ws, cudaFuncAttributeMaxDynamicSharedMemorySize, ws_smem);
        if (err != cudaSuccess) return;
        const int64_t pairs = static_cast<int64_t>(a.num_items) * a.num_kv_heads;
        const int64_t blocks = pairs < device_sm_count(device) ? pairs : device_sm_count(device);
        ws<<<static_cast<unsigned>(blocks), kWsThreads, ws_smem, stream>>>(a);
        err = cudaGetLastError();
        return;
      }
    }
    if (a.query_down != nullptr) {
      err = cudaErrorInvalidValue;   // the other kernels read 16-bit queries only
      return;
    }
    auto kernel = paged_prefill_kernel<typename Cfg::T, typename Cfg::C, Cfg::D, Cfg::W, Cfg::WG>;
    constexpr int smem = Cfg::WG ? prefill_wgmma_smem_bytes<Cfg::D, Cfg::W>() : prefill_smem_bytes<Cfg::D, Cfg::W>();
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return;
    // grid: one block per (work item, KV head), item-major; block: 32 * W threads.
    kernel<<<static_cast<unsigned>(a.num_items) * a.num_kv_heads, 32 * Cfg::W, smem, stream>>>(a);
    err = cudaGetLastError();
  });
  return ok ? err : cudaErrorInvalidValue;
}

bool paged_prefill_split_query_supported(DType dtype, DType cache_dtype, int head_dim, int device) {
  if (cache_dtype != kFloat8E4M3 || (head_dim != 64 && head_dim != 128)) return false;
  constexpr bool kernel_built = KVPAGER_PREFILL_WS != 0 && KVPAGER_PREFILL_WS_FP8 != 0;
  bool built = false;
  if (dtype == kBFloat16) built = kernel_built && ws_q_ahead<__nv_bfloat16, __nv_fp8_e4m3>;
  if (dtype == kFloat16) built = kernel_built && ws_q_ahead<__half, __nv_fp8_e4m3>;
  return built && paged_prefill_has_wgmma(device);
}

bool paged_prefill_has_wgmma(int device) {
  static std::atomic<int> cached[64];   // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= 64) return false;
  const int known = cached[device].load();
  if (known != 0) return known == 2;
  int* flag = nullptr;
  int host = 0;
  bool yes = false;
  if (cudaMalloc(&flag, sizeof(int)) == cudaSuccess) {
    paged_prefill_wgmma_probe<<<1, 1>>>(flag);
    yes = cudaGetLastError() == cudaSuccess && cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess &&
          host == 1;
    cudaFree(flag);
  }
  cached[device].store(yes ? 2 : 1);
  return yes;
}

}  // namespace kvpager
