// Launchers: raw pointers, element strides, sizes and a cudaStream_t in; no torch here.
// Instantiates the decode kernel for fp32/fp16/bf16 x head_dim 64/128/256 x head tile 1/2/4/8 x
// 2/4 loads in flight.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "cache_ops.cuh"
#include "launch.h"
#include "paged_decode.cuh"

namespace kvpager {
namespace {

template <typename T_, typename C_, int D_, int HT_, int LOADS_>
struct DecodeCfg {
  using T = T_;   // query and output
  using C = C_;   // cache
  static constexpr int D = D_;
  static constexpr int HT = HT_;
  static constexpr int LOADS = LOADS_;
};

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

// (query, cache) types: the same 32/16-bit type, or a 16-bit query over an fp8 e4m3 cache.
template <typename F>
bool dispatch_decode(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, F&& f) {
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

// Elements per 16-byte vector of a cache of this type (Elem<C>::kVec in paged_decode.cuh).
int vec_elems(DType dtype) { return dtype == kFloat32 ? 4 : dtype == kFloat8E4M3 ? 16 : 8; }

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

int sm_count(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 1;
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

template <typename Cfg>
int decode_smem_bytes(int partition_tokens, int block_size) {
  const int table = (partition_tokens / block_size) * static_cast<int>(sizeof(int));
  return std::max(table, decode_merge_smem_bytes<Cfg::D, Cfg::HT>());
}

// Resident decode blocks per SM for this kernel instance (1 if the query fails). Cached: the
// occupancy query costs microseconds of host time, as much as a small decode kernel takes.
int decode_occupancy(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, int device) {
  constexpr int kDevices = 16;
  static std::atomic<int> cache[kDevices][3][2][3][4][2];   // [device][dtype][fp8?][dim][tile][loads]; 0 = unknown
  const int dim_i = head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2;
  const int tile_i = head_tile == 1 ? 0 : head_tile == 2 ? 1 : head_tile == 4 ? 2 : 3;
  const bool cacheable = device >= 0 && device < kDevices && dtype >= 0 && dtype < 3;
  const int fp8_i = cache_dtype == kFloat8E4M3 ? 1 : 0;
  std::atomic<int>* slot = cacheable ? &cache[device][dtype][fp8_i][dim_i][tile_i][loads == 2 ? 0 : 1] : nullptr;
  if (slot != nullptr && slot->load(std::memory_order_relaxed) > 0) return slot->load(std::memory_order_relaxed);
  int occupancy = 1;
  dispatch_decode(dtype, cache_dtype, head_dim, head_tile, loads, [&](auto cfg) {
    using Cfg = decltype(cfg);
    const int smem = decode_merge_smem_bytes<Cfg::D, Cfg::HT>();
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &occupancy, paged_decode_kernel<typename Cfg::T, typename Cfg::C, Cfg::D, Cfg::HT, Cfg::LOADS>,
            kDecodeWarps * 32,
            smem) != cudaSuccess)
      occupancy = 1;
  });
  occupancy = std::max(occupancy, 1);
  if (slot != nullptr) slot->store(occupancy, std::memory_order_relaxed);
  return occupancy;
}

int64_t partition_for(int64_t max_ctx, int splits) {
  return static_cast<int64_t>(ceil_div(ceil_div(max_ctx, splits), kPartitionAlign)) * kPartitionAlign;
}

// The share of the launched waves' block slots that hold a block: blocks / (ceil(waves) * slots).
double wave_fill(int64_t blocks, int64_t slots) {
  const int64_t waves = (blocks + slots - 1) / slots;
  return static_cast<double>(blocks) / static_cast<double>(waves * slots);
}

// Split count for the many-loads kernel (the older heuristic, measured on an H100 with
// benchmarks/kernels.py sweeps): long splits beat short ones (each split pays a prologue, an
// epilogue and merge traffic), a grid under one wave is fine once it gives every SM about two
// blocks, and a grid over one wave wants a nearly full last wave. So: the fewest splits giving
// >= 2.5 waves of resident blocks with the last >= 90% full; failing that, among the split
// counts giving >= 1.9 blocks per SM, the best-filled last wave (a grid of at most one wave
// counts as full), fewest splits on ties.
int splits_for_few_blocks(int64_t units, int64_t slots, int64_t sms, int max_s, int64_t max_ctx) {
  const int64_t want_blocks = (19 * sms + 9) / 10;
  int best = max_s;
  double best_fill = -1.0;
  for (int s = 1; s <= max_s; ++s) {
    const int64_t blocks = units * ceil_div(max_ctx, partition_for(max_ctx, s));
    const double waves = static_cast<double>(blocks) / static_cast<double>(slots);
    const double fill = waves <= 1.0 ? 1.0 : wave_fill(blocks, slots);
    if (waves >= 2.5 && fill >= 0.9) return s;
    if (blocks >= want_blocks && fill > best_fill + 1e-9) {
      best = s;
      best_fill = fill;
    }
  }
  return best;
}

// Split count for the few-loads kernel, which needs full waves (it has no loads to spare for
// an idle SM): the fewest splits whose grid fills at least one wave with >= 90% of its slots
// used, without cutting sequences into splits shorter than kMinPartitionTokensFewLoads (short
// splits cost more in prologue, epilogue and merge than the extra warps win: on an H100,
// 32 x 2048 ran at 78% of the copy ceiling with 2 loads and 2 splits of 1,024, 81% with 4 loads
// unsplit); 0 when no split count qualifies.
int splits_for_full_waves(int64_t units, int64_t slots, int max_s, int64_t max_ctx) {
  for (int s = 1; s <= max_s; ++s) {
    const int64_t partition = partition_for(max_ctx, s);
    if (s > 1 && partition < kMinPartitionTokensFewLoads) break;
    const int64_t blocks = units * ceil_div(max_ctx, partition);
    if (blocks * 10 >= slots * 9 && wave_fill(blocks, slots) >= 0.9) return s;
  }
  return 0;
}

// Query heads per thread block: the whole GQA group up to 8 (1, 2, 4 or 8) ... at most the
// lanes sharing a token row (one per vector of the row, at most 32), and at most
// kMaxTileElems / E heads, E = head_dim / row_lanes elements per lane (fp8: 4 heads). False when
// no kernel instance serves these sizes.
bool choose_head_tile(DType dtype, DType cache_dtype, DecodeArgs* a) {
  const int group = a->num_q_heads / a->num_kv_heads;
  a->head_tile = group >= 8 ? 8 : group > 2 ? 4 : group;
  const int row_lanes = std::min(32, a->head_dim / vec_elems(cache_dtype));
  const int lane_elems = a->head_dim / row_lanes;
  a->head_tile = std::max(1, std::min({a->head_tile, row_lanes, kMaxTileElems / lane_elems}));
  a->head_chunks = ceil_div(group, a->head_tile);
  return dispatch_decode(dtype, cache_dtype, a->head_dim, a->head_tile, 4, [](auto) {});
}

bool valid_sizes(const DecodeArgs* a) {
  return a->num_kv_heads > 0 && a->num_q_heads % a->num_kv_heads == 0 && a->block_size > 0 &&
         (a->block_size & (a->block_size - 1)) == 0 && a->block_size <= kPartitionAlign &&
         (a->requested_loads == 0 || a->requested_loads == 2 || a->requested_loads == 4);
}

}  // namespace


namespace {

int64_t align_up(int64_t x) { return (x + kPartitionAlign - 1) / kPartitionAlign * kPartitionAlign; }

// The worker of the k-th longest item: dealt in rounds over the workers, odd rounds in reverse.
int snake_worker(int64_t k, int workers) {
  const int j = static_cast<int>(k % workers);
  return (k / workers) % 2 == 1 ? workers - 1 - j : j;
}

}  // namespace

int plan_decode_work(const int32_t* context_lens, int num_seqs, int workers, int longest_item, int capacity,
                     int min_item, int item_cost, int32_t* out) {
  if (workers < 1 || capacity < num_seqs || num_seqs < 0 || num_seqs > 65535) return -1;
  std::vector<int64_t> ctx(num_seqs);
  int64_t total = 0, longest = 0;
  for (int i = 0; i < num_seqs; ++i) {
    ctx[i] = std::max<int32_t>(0, context_lens[i]);
    total += ctx[i];
    longest = std::max(longest, ctx[i]);
  }
  const int64_t hi = longest_item / kPartitionAlign * kPartitionAlign;
  const int64_t lo = std::max<int64_t>(kPartitionAlign, align_up((longest + kMaxSplits - 1) / kMaxSplits));
  if (hi < lo) return -2;
  const int64_t floor = std::max(lo, std::min<int64_t>(min_item, hi));
  std::vector<int64_t> sizes = {hi};
  for (int rounds : kWorkRounds)
    sizes.push_back(std::min(hi, std::max(floor, align_up((total + rounds * workers - 1) / (int64_t{rounds} * workers)))));
  std::sort(sizes.begin(), sizes.end(), std::greater<int64_t>());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());

  std::vector<int64_t> pieces(num_seqs), last(num_seqs), loads(workers);
  std::vector<int> by_last(num_seqs);
  // Items longest first: every piece but a sequence's last (seq-major), then the last pieces by
  // length (stable); fn(k, seq, piece, cost) for each.
  auto for_each_item = [&](int64_t size, auto&& fn) {
    int64_t k = 0;
    for (int i = 0; i < num_seqs; ++i)
      for (int64_t p = 0; p + 1 < pieces[i]; ++p) fn(k++, i, p, size + item_cost);
    for (int i : by_last) fn(k++, i, pieces[i] - 1, last[i] + item_cost);
  };
  auto layout = [&](int64_t size) {   // pieces, last and by_last for this size; returns the item count
    int64_t n = 0;
    for (int i = 0; i < num_seqs; ++i) {
      pieces[i] = std::max<int64_t>(1, (ctx[i] + size - 1) / size);
      last[i] = ctx[i] - (pieces[i] - 1) * size;
      n += pieces[i];
    }
    for (int i = 0; i < num_seqs; ++i) by_last[i] = i;
    std::stable_sort(by_last.begin(), by_last.end(), [&](int a, int b) { return last[a] > last[b]; });
    return n;
  };
  int64_t best_size = 0, best_span = 0;
  for (const int64_t size : sizes) {   // largest first: ties keep the larger size
    if (layout(size) > capacity) continue;
    std::fill(loads.begin(), loads.end(), 0);
    for_each_item(size, [&](int64_t k, int, int64_t, int64_t cost) { loads[snake_worker(k, workers)] += cost; });
    const int64_t span = *std::max_element(loads.begin(), loads.end());
    if (best_size == 0 || span < best_span) {
      best_size = size;
      best_span = span;
    }
  }
  if (best_size == 0) return -3;
  const int64_t n = layout(best_size);
  int32_t* offsets = out + kWorkHeader;
  int32_t* items = offsets + workers + 1;
  int32_t* spans = items + capacity;
  std::fill(out, out + kWorkHeader + workers + 1, 0);
  out[0] = static_cast<int32_t>(n);
  out[1] = static_cast<int32_t>(best_size);
  for (int64_t k = 0; k < n; ++k) ++offsets[snake_worker(k, workers) + 1];
  for (int w = 0; w < workers; ++w) offsets[w + 1] += offsets[w];
  std::vector<int32_t> cursor(offsets, offsets + workers);
  for_each_item(best_size, [&](int64_t k, int seq, int64_t piece, int64_t) {
    items[cursor[snake_worker(k, workers)]++] =
        static_cast<int32_t>((static_cast<uint32_t>(seq) << 16) | static_cast<uint32_t>(piece));
  });
  std::fill(items + n, items + capacity, 0);
  int64_t first = 0;
  for (int i = 0; i < num_seqs; ++i) {
    spans[2 * i] = static_cast<int32_t>(first);
    spans[2 * i + 1] = static_cast<int32_t>(pieces[i]);
    first += pieces[i];
  }
  return static_cast<int>(n);
}

cudaError_t plan_paged_decode_work(DType dtype, DType cache_dtype, int device, DecodeArgs* a) {
  if (!valid_sizes(a) || !choose_head_tile(dtype, cache_dtype, a)) return cudaErrorInvalidValue;
  a->loads = a->requested_loads != 0 ? a->requested_loads : kWorkDefaultLoads;
  const int64_t units = static_cast<int64_t>(a->num_kv_heads) * a->head_chunks;
  const int64_t slots = sm_count(device) * decode_occupancy(dtype, cache_dtype, a->head_dim, a->head_tile, a->loads,
                                                            device);
  a->work_workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(slots / units, 65535)));
  // The launch reserves the merge's shared memory, which the table slice reuses.
  int merge_smem = 0;
  dispatch_decode(dtype, cache_dtype, a->head_dim, a->head_tile, a->loads, [&](auto cfg) {
    using Cfg = decltype(cfg);
    merge_smem = decode_merge_smem_bytes<Cfg::D, Cfg::HT>();
  });
  const int64_t entries = std::min<int64_t>(merge_smem / static_cast<int>(sizeof(int)), kMaxTableEntries);
  a->partition_tokens = static_cast<int>(entries * a->block_size / kPartitionAlign * kPartitionAlign);
  a->num_splits = 0;
  return a->partition_tokens >= kPartitionAlign ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t plan_paged_decode(DType dtype, DType cache_dtype, int requested_splits, int device, DecodeArgs* a) {
  if (!valid_sizes(a)) return cudaErrorInvalidValue;
  a->work = nullptr;
  if (!choose_head_tile(dtype, cache_dtype, a)) return cudaErrorInvalidValue;
  const int64_t max_ctx = static_cast<int64_t>(a->max_blocks_per_seq) * a->block_size;
  const int64_t max_partition = static_cast<int64_t>(kMaxTableEntries) * a->block_size;
  a->loads = a->requested_loads != 0 ? a->requested_loads : 4;
  if (max_ctx <= 0) {
    a->num_splits = 1;
    a->partition_tokens = kPartitionAlign;
    return cudaSuccess;
  }
  // Two kernel instances: 4 loads in flight per lane (more registers, fewer resident blocks)
  // keeps small grids fed; 2 loads (more resident warps) reads faster once the grid fills
  // whole waves. benchmarks/kernels.py --only quick sweeps both.
  const int64_t units = static_cast<int64_t>(a->num_seqs) * a->num_kv_heads * a->head_chunks;
  const int64_t sms = sm_count(device);
  const int64_t slots2 = sms * decode_occupancy(dtype, cache_dtype, a->head_dim, a->head_tile, 2, device);
  int max_s = std::max(1, ceil_div(max_ctx, kMinPartitionTokens));
  if (units * max_s < (19 * sms + 9) / 10) max_s = std::max(max_s, ceil_div(max_ctx, kMinPartitionTokensSmall));
  max_s = std::min(max_s, kMaxSplits);
  int splits;
  if (requested_splits > 0) {
    splits = requested_splits;
    if (a->requested_loads == 0) {
      const int64_t blocks = units * ceil_div(max_ctx, partition_for(max_ctx, splits));
      a->loads = blocks * 10 >= slots2 * 9 ? 2 : 4;
    }
  } else {
    const int full = a->requested_loads == 4 ? 0 : splits_for_full_waves(units, slots2, max_s, max_ctx);
    if (a->requested_loads == 2 || (a->requested_loads == 0 && full > 0)) {
      a->loads = 2;
      splits = full > 0 ? full : max_s;
    } else {
      a->loads = 4;
      const int64_t slots4 = sms * decode_occupancy(dtype, cache_dtype, a->head_dim, a->head_tile, 4, device);
      splits = splits_for_few_blocks(units, slots4, sms, max_s, max_ctx);
    }
    splits = std::max(splits, ceil_div(max_ctx, max_partition));   // the table slice must fit
    splits = std::min(splits, kMaxSplits);
  }
  int64_t partition = partition_for(max_ctx, splits);
  if (partition > max_partition || splits > kMaxSplits) return cudaErrorInvalidValue;
  a->partition_tokens = static_cast<int>(partition);
  a->num_splits = ceil_div(max_ctx, partition);
  return cudaSuccess;
}

cudaError_t launch_paged_decode(DType dtype, DType cache_dtype, const DecodeArgs& a, cudaStream_t stream) {
  if (a.num_seqs == 0) return cudaSuccess;
  const bool listed = a.work != nullptr;
  if (listed ? (a.work_capacity < a.num_seqs || a.work_workers < 1 || a.part_out == nullptr || a.part_ml == nullptr)
             : (a.num_splits < 1 || a.num_splits > kMaxSplits || a.partition_tokens % kPartitionAlign != 0 ||
                a.partition_tokens / a.block_size > kMaxTableEntries ||
                (a.num_splits > 1 && (a.part_out == nullptr || a.part_ml == nullptr))) ||
      a.num_seqs > 65535)
    return cudaErrorInvalidValue;
  cudaError_t err = cudaSuccess;
  const bool ok = dispatch_decode(dtype, cache_dtype, a.head_dim, a.head_tile, a.loads, [&](auto cfg) {
    using Cfg = decltype(cfg);
    using T = typename Cfg::T;
    // Work-list mode: the merge's shared memory, which bounds an item's table slice
    // (plan_paged_decode_work's partition_tokens).
    const int smem = listed ? decode_merge_smem_bytes<Cfg::D, Cfg::HT>()
                            : decode_smem_bytes<Cfg>(a.partition_tokens, a.block_size);
    // grid: (num_kv_heads * head_chunks, num_seqs, num_splits) or, with a work list,
    // (num_kv_heads * head_chunks, work_workers); block: kDecodeWarps warps.
    const dim3 grid = listed ? dim3(a.num_kv_heads * a.head_chunks, a.work_workers)
                             : dim3(a.num_kv_heads * a.head_chunks, a.num_seqs, a.num_splits);
    paged_decode_kernel<T, typename Cfg::C, Cfg::D, Cfg::HT, Cfg::LOADS><<<grid, kDecodeWarps * 32, smem, stream>>>(a);
    err = cudaGetLastError();
    if (err != cudaSuccess || (!listed && a.num_splits == 1)) return;
    // grid: (num_q_heads, num_seqs); block: kMergeThreads threads.
    paged_decode_merge_kernel<T><<<dim3(a.num_q_heads, a.num_seqs), kMergeThreads, 0, stream>>>(a);
    err = cudaGetLastError();
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
