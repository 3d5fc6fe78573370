// Launchers: raw pointers, element strides, sizes and a cudaStream_t in; no torch here. They
// check and launch what a plan says (decode_plan.cu makes the plans; no heuristics here).
// Instantiates the decode kernel for fp32/fp16/bf16 x head_dim 64/128/256 x head tile 1/2/4/8 x
// 2/4 loads in flight, and the tensor-core decode kernel (paged_decode_mma.cuh) for fp16/bf16
// queries over fp8 e4m3 caches x head_dim 64/128 x 16 or 32 tokens per warp iteration (the plan's
// loads 2 or 4), and over caches of their own dtype x 16 tokens (loads 2), any head tile up to 8;
// and on Hopper paged_decode_bulk.cuh's over 16-bit caches (mma 2: K/V staged by the copy engine).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cache_ops.cuh"
#include "launch.h"
#include "paged_decode.cuh"
#include "paged_decode_merge.cuh"
#include "paged_decode_mma.cuh"
#include "paged_decode_bulk.cuh"

namespace kvpager {
namespace {

template <typename T_, typename C_, int D_, int HT_, int LOADS_>
struct DecodeCfg {
  using T = T_;   // query and output
  static constexpr int MERGE_SMEM = decode_merge_smem_bytes<D_, HT_>();   // the table slice reuses it
  static constexpr int EXTRA_SMEM = 0;                                     // before the table slice
  static constexpr auto kernel() { return paged_decode_kernel<T_, C_, D_, HT_, LOADS_>; }
};

// The tensor-core instance (an fp8 e4m3 cache, or a 16-bit one of the query's dtype): CH
// 16-token chunks per warp iteration.
template <typename T_, typename C_, int D_, int CH_>
struct MmaCfg {
  using T = T_;
  static constexpr int MERGE_SMEM = decode_merge_smem_bytes<D_, kMmaHeads>();
  static constexpr int EXTRA_SMEM = decode_mma_q_bytes<D_>();   // the query fragments
  static constexpr auto kernel() { return paged_decode_mma_kernel<T_, C_, D_, CH_>; }
};

// The tensor-core instance over a 16-bit cache with its K/V staged by the copy engine (Hopper,
// paged_decode_bulk.cuh): the table slice gets BulkShape<D>::TABLE_BYTES, which bounds a work
// item's tokens.
template <typename T_, int D_>
struct BulkCfg {
  using T = T_;
  static constexpr int MERGE_SMEM = BulkShape<D_>::TABLE_BYTES;
  static constexpr int EXTRA_SMEM = decode_bulk_extra_bytes<D_>();   // query fragments, mbarriers, rings
  static constexpr auto kernel() { return paged_decode_bulk_kernel<T_, D_>; }
};

int current_device_major();

// Build-time switch of the tensor-core instances (0: not built, so never planned).
#ifndef KVPAGER_DECODE_MMA
#define KVPAGER_DECODE_MMA 1
#endif

// 16 tokens a warp iteration for loads 2, 32 for loads 4. Over a 16-bit cache only 16 are built:
// 32 would double the K and V registers of a lane that already holds twice the fp8 instance's.
// mma 2 names the instance whose K/V the copy engine stages (16-bit caches, loads 2, Hopper only).
template <typename T, typename C, int D, typename F>
bool dispatch_mma_chunks(int loads, int mma, F&& f) {
  if constexpr (std::is_same_v<C, __nv_fp8_e4m3>) {
    if (mma != 1) return false;
    if (loads == 4) {
      f(MmaCfg<T, C, D, 2>{});
      return true;
    }
  } else {
    if (mma == 2) {
      if (current_device_major() < 9) return false;
      f(BulkCfg<T, D>{});
      return true;
    }
    if (mma != 1) return false;
  }
  f(MmaCfg<T, C, D, 1>{});
  return true;
}

template <typename T, typename C, typename F>
bool dispatch_mma(int head_dim, int head_tile, int loads, int mma, F&& f) {
#if KVPAGER_DECODE_MMA
  if (head_tile != 1 && head_tile != 2 && head_tile != 4 && head_tile != 8) return false;
  if (loads != 2 && (loads != 4 || !std::is_same_v<C, __nv_fp8_e4m3>)) return false;
  switch (head_dim) {
    case 64: return dispatch_mma_chunks<T, C, 64>(loads, mma, f);
    case 128: return dispatch_mma_chunks<T, C, 128>(loads, mma, f);
    default: return false;
  }
#else
  (void)head_dim; (void)head_tile; (void)loads; (void)mma; (void)f;
  return false;
#endif
}

template <typename T, typename C, int D, int HT, typename F>
bool dispatch_loads(int loads, F&& f) {
  switch (loads) {
    case 2: f(DecodeCfg<T, C, D, HT, 2>{}); return true;
    case 4: f(DecodeCfg<T, C, D, HT, 4>{}); return true;
    default: return false;
  }
}

template <typename T, typename C, int D, int HT, typename F>
bool dispatch_tile_if_fits(int loads, F&& f) {
  // A lane group (the lanes sharing a token row) needs a lane per head of the tile, and a
  // lane's query and accumulator registers (2 * HT * E floats) must leave room (no spills).
  using S = DecodeShape<C, D, 2>;
  if constexpr (HT <= S::LPT && HT * S::E <= kMaxTileElems) {
    return dispatch_loads<T, C, D, HT>(loads, f);
  } else {
    return false;
  }
}

template <typename T, typename C, int D, typename F>
bool dispatch_tile(int head_tile, int loads, F&& f) {
  switch (head_tile) {
    case 1: return dispatch_tile_if_fits<T, C, D, 1>(loads, f);
    case 2: return dispatch_tile_if_fits<T, C, D, 2>(loads, f);
    case 4: return dispatch_tile_if_fits<T, C, D, 4>(loads, f);
    case 8: return dispatch_tile_if_fits<T, C, D, 8>(loads, f);
    default: return false;
  }
}

template <typename T, typename C, typename F>
bool dispatch_dim(int head_dim, int head_tile, int loads, F&& f) {
  switch (head_dim) {
    case 64: return dispatch_tile<T, C, 64>(head_tile, loads, f);
    case 128: return dispatch_tile<T, C, 128>(head_tile, loads, f);
    case 256: return dispatch_tile<T, C, 256>(head_tile, loads, f);
    default: return false;
  }
}

// (query, cache) types: the same 32/16-bit type, or a 16-bit query over an fp8 e4m3 cache; mma 1
// names the tensor-core instance, 2 the one staged by the copy engine (16-bit caches, Hopper).
template <typename F>
bool dispatch_decode(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, int mma, F&& f) {
  if (mma != 0) {
    if (cache_dtype == kFloat8E4M3) {
      switch (dtype) {
        case kFloat16: return dispatch_mma<__half, __nv_fp8_e4m3>(head_dim, head_tile, loads, mma, f);
        case kBFloat16: return dispatch_mma<__nv_bfloat16, __nv_fp8_e4m3>(head_dim, head_tile, loads, mma, f);
        default: return false;
      }
    }
    if (cache_dtype != dtype) return false;
    switch (dtype) {
      case kFloat16: return dispatch_mma<__half, __half>(head_dim, head_tile, loads, mma, f);
      case kBFloat16: return dispatch_mma<__nv_bfloat16, __nv_bfloat16>(head_dim, head_tile, loads, mma, f);
      default: return false;
    }
  }
  if (cache_dtype == dtype) {
    switch (dtype) {
      case kFloat32: return dispatch_dim<float, float>(head_dim, head_tile, loads, f);
      case kFloat16: return dispatch_dim<__half, __half>(head_dim, head_tile, loads, f);
      case kBFloat16: return dispatch_dim<__nv_bfloat16, __nv_bfloat16>(head_dim, head_tile, loads, f);
      default: return false;
    }
  }
  if (cache_dtype == kFloat8E4M3) {
    switch (dtype) {
      case kFloat16: return dispatch_dim<__half, __nv_fp8_e4m3>(head_dim, head_tile, loads, f);
      case kBFloat16: return dispatch_dim<__nv_bfloat16, __nv_fp8_e4m3>(head_dim, head_tile, loads, f);
      default: return false;
    }
  }
  return false;
}

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// A positive device attribute, cached per device (a query costs microseconds of host time, as
// much as a small kernel); `fallback` when it cannot be had (not cached). Attributes by slot:
enum CachedAttribute : int { kSmCount = 0, kCcMajor = 1, kMemoryKhz = 2, kBusBits = 3, kCachedAttributes = 4 };

int cached_device_attribute(CachedAttribute slot, int device, int fallback) {
  static constexpr cudaDeviceAttr kAttr[kCachedAttributes] = {
      cudaDevAttrMultiProcessorCount, cudaDevAttrComputeCapabilityMajor, cudaDevAttrMemoryClockRate,
      cudaDevAttrGlobalMemoryBusWidth};
  static std::atomic<int> cached[kCachedAttributes][64] = {};
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable) {
    const int known = cached[slot][device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, kAttr[slot], device) != cudaSuccess || value <= 0) return fallback;
  if (cacheable) cached[slot][device].store(value, std::memory_order_relaxed);
  return value;
}

// Compute capability major of the current device (PDL needs 9 or more); 0 if unknown.
int current_device_major() {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess ? cached_device_attribute(kCcMajor, device, 0) : 0;
}

// Dynamic shared memory above 48 KB is opted into per kernel and device (the bulk-staged instance
// asks for ~110 KB): once, for the most any launch of the kernel asks (grid mode: the longest table slice).
template <typename Cfg>
cudaError_t allow_dynamic_smem() {
  constexpr int most = Cfg::EXTRA_SMEM + std::max(Cfg::MERGE_SMEM, kMaxTableEntries * static_cast<int>(sizeof(int)));
  if constexpr (Cfg::EXTRA_SMEM + Cfg::MERGE_SMEM <= 48 * 1024) {
    return cudaSuccess;
  } else {
    static std::atomic<bool> done[64] = {};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return cudaErrorInvalidDevice;
    if (device >= 0 && device < 64 && done[device].load(std::memory_order_relaxed)) return cudaSuccess;
    const cudaError_t err = cudaFuncSetAttribute(Cfg::kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, most);
    if (err == cudaSuccess && device >= 0 && device < 64) done[device].store(true, std::memory_order_relaxed);
    return err;
  }
}

template <typename Cfg>
int decode_smem_bytes(int partition_tokens, int block_size) {
  const int table = (partition_tokens / block_size) * static_cast<int>(sizeof(int));
  return Cfg::EXTRA_SMEM + std::max(table, Cfg::MERGE_SMEM);
}

}  // namespace

// ---- kernel facts the planner reads (decode_plan.cu) ----

int device_sm_count(int device) { return cached_device_attribute(kSmCount, device, 1); }

double device_memory_bandwidth(int device) {
  const int khz = cached_device_attribute(kMemoryKhz, device, 0), bits = cached_device_attribute(kBusBits, device, 0);
  return 2.0 * 1e3 * khz * (bits / 8);
}

bool decode_instance_built(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, int mma) {
  return dispatch_decode(dtype, cache_dtype, head_dim, head_tile, loads, mma, [](auto) {});
}

int decode_merge_smem(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, int mma) {
  int bytes = 0;
  dispatch_decode(dtype, cache_dtype, head_dim, head_tile, loads, mma, [&](auto cfg) {
    bytes = decltype(cfg)::MERGE_SMEM;
  });
  return bytes;
}

// Cached: the occupancy query costs microseconds of host time, as much as a small decode kernel takes.
int decode_blocks_per_sm(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, int mma,
                        int device) {
  constexpr int kDevices = 16;
  static std::atomic<int> cache[kDevices][3][2][3][4][2][3];   // [device][dtype][fp8?][dim][tile][loads][mma]; 0 = unknown
  const int dim_i = head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2;
  const int tile_i = head_tile == 1 ? 0 : head_tile == 2 ? 1 : head_tile == 4 ? 2 : 3;
  const bool cacheable = device >= 0 && device < kDevices && dtype >= 0 && dtype < 3;
  const int fp8_i = cache_dtype == kFloat8E4M3 ? 1 : 0;
  std::atomic<int>* slot = cacheable ? &cache[device][dtype][fp8_i][dim_i][tile_i][loads == 2 ? 0 : 1][mma == 2 ? 2 : mma != 0 ? 1 : 0]
                                       : nullptr;
  if (slot != nullptr && slot->load(std::memory_order_relaxed) > 0) return slot->load(std::memory_order_relaxed);
  int occupancy = 1;
  dispatch_decode(dtype, cache_dtype, head_dim, head_tile, loads, mma, [&](auto cfg) {
    using Cfg = decltype(cfg);
    if (allow_dynamic_smem<Cfg>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, Cfg::kernel(), kDecodeWarps * 32,
                                                      Cfg::EXTRA_SMEM + Cfg::MERGE_SMEM) != cudaSuccess)
      occupancy = 1;
  });
  occupancy = std::max(occupancy, 1);
  if (slot != nullptr) slot->store(occupancy, std::memory_order_relaxed);
  return occupancy;
}

cudaError_t launch_paged_decode(DType dtype, DType cache_dtype, const DecodeArgs& a, cudaStream_t stream) {
  if (a.num_seqs == 0) return cudaSuccess;
  const bool listed = a.work != nullptr;
  if (a.num_kv_heads < 1 || a.head_tile < 1 || a.num_q_heads % a.num_kv_heads != 0 ||
      a.head_chunks != ceil_div(a.num_q_heads / a.num_kv_heads, a.head_tile))
    return cudaErrorInvalidValue;
  if (listed ? (a.work_capacity < a.num_seqs || a.work_workers < 1 || a.part_out == nullptr || a.part_ml == nullptr ||
                reinterpret_cast<uintptr_t>(a.work) % 16 != 0)
             : (a.num_splits < 1 || a.num_splits > kMaxSplits || a.partition_tokens % kPartitionAlign != 0 ||
                a.partition_tokens / a.block_size > kMaxTableEntries ||
                (a.num_splits > 1 && (a.part_out == nullptr || a.part_ml == nullptr))) ||
      a.num_seqs > 65535)
    return cudaErrorInvalidValue;
  cudaError_t err = cudaSuccess;
  const bool ok = dispatch_decode(dtype, cache_dtype, a.head_dim, a.head_tile, a.loads, a.mma, [&](auto cfg) {
    using Cfg = decltype(cfg);
    using T = typename Cfg::T;
    // Work-list mode: the merge's shared memory, which bounds an item's table slice
    // (decode_plan.cu plan_decode_work_geometry: longest_item).
    const int smem =
        listed ? Cfg::EXTRA_SMEM + Cfg::MERGE_SMEM : decode_smem_bytes<Cfg>(a.partition_tokens, a.block_size);
    // grid: (num_kv_heads * head_chunks, num_seqs, num_splits) or, with a work list,
    // (num_kv_heads * head_chunks, work_workers); block: kDecodeWarps warps.
    const dim3 grid = listed ? dim3(a.num_kv_heads * a.head_chunks, a.work_workers)
                             : dim3(a.num_kv_heads * a.head_chunks, a.num_seqs, a.num_splits);
    // Both launches are programmatic dependents of the kernel before them on Hopper (pdl.cuh):
    // the decode kernel of a write_kv (KVPAGER_DECODE_PDL_AFTER_WRITE), the merge of the decode.
    cudaLaunchAttribute pdl[1];
    pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    pdl[0].val.programmaticStreamSerializationAllowed = 1;
    const bool hopper = KVPAGER_DECODE_PDL && current_device_major() >= 9;
    cudaLaunchConfig_t decode = {};
    decode.gridDim = grid;
    decode.blockDim = dim3(kDecodeWarps * 32);
    decode.dynamicSmemBytes = smem;
    decode.stream = stream;
    decode.attrs = pdl;
    decode.numAttrs = hopper && KVPAGER_DECODE_PDL_AFTER_WRITE ? 1 : 0;
    err = allow_dynamic_smem<Cfg>();
    if (err == cudaSuccess) err = cudaLaunchKernelEx(&decode, Cfg::kernel(), a);
    if (err != cudaSuccess || (!listed && a.num_splits == 1)) return;
    // grid: (num_q_heads, num_seqs); block: kMergeThreads threads.
    cudaLaunchConfig_t merge = {};
    merge.gridDim = dim3(a.num_q_heads, a.num_seqs);
    merge.blockDim = dim3(kMergeThreads);
    merge.stream = stream;
    merge.attrs = pdl;
    merge.numAttrs = hopper ? 1 : 0;
    err = cudaLaunchKernelEx(&merge, paged_decode_merge_kernel<T>, a);
  });
  return ok ? err : cudaErrorInvalidValue;
}

cudaError_t launch_write_kv(const WriteKVArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.elem_size <= 0 || (a.head_dim * a.elem_size) % 16 != 0 || a.block_size <= 0) return cudaErrorInvalidValue;
  if (a.quantize_from >= 0) {   // into an fp8 cache: eight elements per thread
    if (a.quantize_from != kFloat16 && a.quantize_from != kBFloat16) return cudaErrorInvalidValue;
    const int chunks = a.num_heads * (a.head_dim / 8);
    // grid: (num_tokens, ceil(chunks / kWriteKVThreads)); block: kWriteKVThreads threads.
    const dim3 grid(a.num_tokens, std::max(1, ceil_div(chunks, kWriteKVThreads)));
    const bool half = a.quantize_from == kFloat16;
    if (a.slot_is_int64 && half)
      write_kv_fp8_kernel<int64_t, __half><<<grid, kWriteKVThreads, 0, stream>>>(a);
    else if (a.slot_is_int64)
      write_kv_fp8_kernel<int64_t, __nv_bfloat16><<<grid, kWriteKVThreads, 0, stream>>>(a);
    else if (half)
      write_kv_fp8_kernel<int32_t, __half><<<grid, kWriteKVThreads, 0, stream>>>(a);
    else
      write_kv_fp8_kernel<int32_t, __nv_bfloat16><<<grid, kWriteKVThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  const int total = a.num_heads * (a.head_dim * a.elem_size / 16);
  // grid: (num_tokens, ceil(total / kWriteKVThreads)); block: kWriteKVThreads threads.
  const dim3 grid(a.num_tokens, std::max(1, ceil_div(total, kWriteKVThreads)));
  if (a.slot_is_int64)
    write_kv_kernel<int64_t><<<grid, kWriteKVThreads, 0, stream>>>(a);
  else
    write_kv_kernel<int32_t><<<grid, kWriteKVThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_copy_blocks(void* cache, int64_t num_cache_blocks, int64_t block_bytes, const int64_t* src,
                               const int64_t* dst, int64_t num_pairs, cudaStream_t stream) {
  return launch_swap_kernel(cache, num_cache_blocks, cache, num_cache_blocks, block_bytes, src, dst, num_pairs, stream);
}

cudaError_t launch_swap_dma(void* dst, int64_t num_dst_blocks, const void* src, int64_t num_src_blocks,
                            int64_t block_bytes, const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs,
                            bool use_batch, cudaStream_t stream) {
  if (num_pairs <= 0) return cudaSuccess;
  if (block_bytes <= 0) return cudaErrorInvalidValue;
  char* to = static_cast<char*>(dst);
  const char* from = static_cast<const char*>(src);
  auto valid = [&](int64_t i) {
    return src_ids[i] >= 0 && src_ids[i] < num_src_blocks && dst_ids[i] >= 0 && dst_ids[i] < num_dst_blocks;
  };
  // Runs of consecutive pairs become one copy each.
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(num_pairs);
  srcs.reserve(num_pairs);
  sizes.reserve(num_pairs);
  for (int64_t i = 0; i < num_pairs;) {
    if (!valid(i)) {
      ++i;
      continue;
    }
    int64_t run = 1;
    while (i + run < num_pairs && valid(i + run) && src_ids[i + run] == src_ids[i] + run &&
           dst_ids[i + run] == dst_ids[i] + run)
      ++run;
    dsts.push_back(to + dst_ids[i] * block_bytes);
    srcs.push_back(from + src_ids[i] * block_bytes);
    sizes.push_back(static_cast<size_t>(run * block_bytes));
    i += run;
  }
  if (dsts.empty()) return cudaSuccess;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
  if (use_batch && dsts.size() > 1 && stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread) {
    // (Not on the legacy default stream: the batch API refuses it.)
    // One attribute for every copy: the runtime infers the direction from the pointers (UVA)
    // and may run the copies in any order (they never overlap: destinations are distinct).
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
    return cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr, &attr_idx, 1, stream);
  }
#else
  (void)use_batch;
#endif
  for (size_t i = 0; i < dsts.size(); ++i) {
    const cudaError_t err = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_swap_kernel(void* dst, int64_t num_dst_blocks, const void* src, int64_t num_src_blocks,
                               int64_t block_bytes, const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs,
                               cudaStream_t stream) {
  if (num_pairs == 0) return cudaSuccess;
  if (block_bytes % 16 != 0 || num_pairs > 0x7fffffff || reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0)
    return cudaErrorInvalidValue;
  const int64_t block_vecs = block_bytes / 16;
  const int64_t tiles = (block_vecs + kCopyThreads * kCopyUnroll - 1) / (kCopyThreads * kCopyUnroll);
  if (tiles > 65535) return cudaErrorInvalidValue;
  // grid: (num_pairs, tiles of kCopyThreads * kCopyUnroll vectors); block: kCopyThreads threads.
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(std::max<int64_t>(tiles, 1)));
  copy_blocks_kernel<<<grid, kCopyThreads, 0, stream>>>(static_cast<uint4*>(dst), num_dst_blocks,
                                                        static_cast<const uint4*>(src), num_src_blocks, block_vecs,
                                                        src_ids, dst_ids);
  return cudaGetLastError();
}

}  // namespace kvpager
