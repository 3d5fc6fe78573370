// Host-side planning of the paged decode launch (decode_plan.h says what and why). Measured
// heuristics: benchmarks/kernels.py --only quick (grid mode, loads x splits) and --only ragged
// (work lists, min_item x item_cost) on an H100; docs/performance.md has the numbers.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "decode_plan.h"

namespace kvpager {
namespace {

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Elements per 16-byte vector of a cache of this type (Elem<C>::kVec in paged_decode.cuh).
int vec_elems(DType dtype) { return dtype == kFloat32 ? 4 : dtype == kFloat8E4M3 ? 16 : 8; }

bool valid_sizes(const DecodeSizes& s, int requested_loads) {
  return s.num_kv_heads > 0 && s.num_q_heads % s.num_kv_heads == 0 && s.block_size > 0 &&
         (s.block_size & (s.block_size - 1)) == 0 && s.block_size <= kPartitionAlign &&
         (requested_loads == 0 || requested_loads == 2 || requested_loads == 4);
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

int64_t align_up(int64_t x) { return (x + kPartitionAlign - 1) / kPartitionAlign * kPartitionAlign; }

}  // namespace

int decode_use_mma(DType dtype, DType cache_dtype, int head_dim, int requested_mma, int requested_loads, int device) {
  if (requested_mma == 0) return 0;
  if (requested_mma > 0)
    return decode_instance_built(dtype, cache_dtype, head_dim, 1, 2, requested_mma) ? requested_mma : -1;
  if (!decode_instance_built(dtype, cache_dtype, head_dim, 1, 2, 1)) return 0;
  // 4 loads asked of an automatic choice: the instance that has them (the tensor-core ones over a
  // 16-bit cache have 2 only).
  if (requested_loads == 4 && !decode_instance_built(dtype, cache_dtype, head_dim, 1, 4, 1)) return 0;
  if (cache_dtype == kFloat8E4M3) return kDecodeMmaDefault ? 1 : 0;
  if (!kDecodeMma16Default && device_memory_bandwidth(device) < kDecodeMma16Bandwidth) return 0;
  return kDecodeMmaBulkDefault && decode_instance_built(dtype, cache_dtype, head_dim, 1, 2, 2) ? 2 : 1;
}

int decode_head_tile(DType dtype, DType cache_dtype, int head_dim, int group, int mma) {
  if (group < 1 || head_dim < 1) return 0;
  if (mma != 0) {
    const int tile = group > 4 ? 8 : group > 2 ? 4 : group;
    return decode_instance_built(dtype, cache_dtype, head_dim, tile, 2, 1) ? tile : 0;
  }
  int tile = group >= 8 ? 8 : group > 2 ? 4 : group;
  const int row_lanes = std::min(32, std::max(1, head_dim / vec_elems(cache_dtype)));
  const int lane_elems = std::max(1, head_dim / row_lanes);
  tile = std::max(1, std::min({tile, row_lanes, kMaxTileElems / lane_elems}));
  return decode_instance_built(dtype, cache_dtype, head_dim, tile, 4, 0) ? tile : 0;
}

cudaError_t plan_decode_grid(DType dtype, DType cache_dtype, const DecodeSizes& z, int requested_splits,
                             int requested_loads, int requested_mma, int device, DecodeGridPlan* plan) {
  if (!valid_sizes(z, requested_loads) || requested_splits < 0) return cudaErrorInvalidValue;
  const int group = z.num_q_heads / z.num_kv_heads;
  const int mma = decode_use_mma(dtype, cache_dtype, z.head_dim, requested_mma, requested_loads, device);
  if (mma < 0) return cudaErrorInvalidValue;
  plan->mma = mma;
  plan->head_tile = decode_head_tile(dtype, cache_dtype, z.head_dim, group, mma);
  if (plan->head_tile == 0) return cudaErrorInvalidValue;
  // The tensor-core instance over 16-bit caches has loads 2 only.
  if (!decode_instance_built(dtype, cache_dtype, z.head_dim, plan->head_tile, 4, mma)) {
    if (requested_loads == 4) return cudaErrorInvalidValue;
    requested_loads = 2;
  }
  const int head_chunks = ceil_div(group, plan->head_tile);
  const int64_t max_ctx = static_cast<int64_t>(z.max_blocks_per_seq) * z.block_size;
  const int64_t max_partition = static_cast<int64_t>(kMaxTableEntries) * z.block_size;
  plan->loads = requested_loads != 0 ? requested_loads : 4;
  if (max_ctx <= 0) {
    plan->num_splits = 1;
    plan->partition_tokens = kPartitionAlign;
    return cudaSuccess;
  }
  // Two kernel instances: 4 loads in flight per lane (more registers, fewer resident blocks)
  // keeps small grids fed; 2 loads (more resident warps) reads faster once the grid fills
  // whole waves.
  const int64_t units = static_cast<int64_t>(z.num_seqs) * z.num_kv_heads * head_chunks;
  const int64_t sms = device_sm_count(device);
  const int64_t slots2 = sms * decode_blocks_per_sm(dtype, cache_dtype, z.head_dim, plan->head_tile, 2, mma, device);
  int max_s = std::max(1, ceil_div(max_ctx, kMinPartitionTokens));
  if (units * max_s < (19 * sms + 9) / 10) max_s = std::max(max_s, ceil_div(max_ctx, kMinPartitionTokensSmall));
  max_s = std::min(max_s, kMaxSplits);
  int splits;
  if (requested_splits > 0) {
    splits = requested_splits;
    if (requested_loads == 0) {
      const int64_t blocks = units * ceil_div(max_ctx, partition_for(max_ctx, splits));
      plan->loads = blocks * 10 >= slots2 * 9 ? 2 : 4;
    }
  } else {
    const int full = requested_loads == 4 ? 0 : splits_for_full_waves(units, slots2, max_s, max_ctx);
    if (requested_loads == 2 || (requested_loads == 0 && full > 0)) {
      plan->loads = 2;
      splits = full > 0 ? full : max_s;
    } else {
      plan->loads = 4;
      const int64_t slots4 = sms * decode_blocks_per_sm(dtype, cache_dtype, z.head_dim, plan->head_tile, 4, mma, device);
      splits = splits_for_few_blocks(units, slots4, sms, max_s, max_ctx);
    }
    splits = std::max(splits, ceil_div(max_ctx, max_partition));   // the table slice must fit
    splits = std::min(splits, kMaxSplits);
  }
  const int64_t partition = partition_for(max_ctx, splits);
  if (partition > max_partition || splits > kMaxSplits) return cudaErrorInvalidValue;
  plan->partition_tokens = static_cast<int>(partition);
  plan->num_splits = ceil_div(max_ctx, partition);
  return cudaSuccess;
}

cudaError_t plan_decode_work_geometry(DType dtype, DType cache_dtype, const DecodeSizes& z, int requested_loads,
                                      int requested_mma, int device, DecodeWorkGeometry* g) {
  if (!valid_sizes(z, requested_loads)) return cudaErrorInvalidValue;
  const int group = z.num_q_heads / z.num_kv_heads;
  const int mma = decode_use_mma(dtype, cache_dtype, z.head_dim, requested_mma, requested_loads, device);
  if (mma < 0) return cudaErrorInvalidValue;
  g->mma = mma;
  g->head_tile = decode_head_tile(dtype, cache_dtype, z.head_dim, group, mma);
  if (g->head_tile == 0) return cudaErrorInvalidValue;
  g->loads = requested_loads != 0 ? requested_loads : kWorkDefaultLoads;
  if (!decode_instance_built(dtype, cache_dtype, z.head_dim, g->head_tile, g->loads, mma))
    return cudaErrorInvalidValue;   // (loads 4 of the tensor-core instance over a 16-bit cache)
  if (requested_loads == 0 && cache_dtype == dtype && device_memory_bandwidth(device) >= kFourLoadsBandwidth &&
      decode_instance_built(dtype, cache_dtype, z.head_dim, g->head_tile, 4, mma))
    g->loads = 4;
  const int64_t units = static_cast<int64_t>(z.num_kv_heads) * ceil_div(group, g->head_tile);
  const int64_t slots = static_cast<int64_t>(device_sm_count(device)) *
                        decode_blocks_per_sm(dtype, cache_dtype, z.head_dim, g->head_tile, g->loads, mma, device);
  g->workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(slots / units, 65535)));
  // The launch reserves the merge's shared memory, which an item's table slice reuses.
  const int merge_smem = decode_merge_smem(dtype, cache_dtype, z.head_dim, g->head_tile, g->loads, mma);
  const int64_t entries = std::min<int64_t>(merge_smem / static_cast<int>(sizeof(int)), kMaxTableEntries);
  g->longest_item = static_cast<int>(entries * z.block_size / kPartitionAlign * kPartitionAlign);
  return g->longest_item >= kPartitionAlign ? cudaSuccess : cudaErrorInvalidValue;
}

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
  // A size of at least the longest context leaves every sequence whole, as hi does: counted as hi.
  auto clamp = [&](int64_t size) {
    const int64_t aligned = std::min(hi, std::max(floor, align_up(size)));
    return aligned >= longest ? hi : aligned;
  };
  std::vector<int64_t> sizes = {hi};
  for (int rounds : kWorkRounds) {
    const int64_t even = clamp((total + rounds * workers - 1) / (int64_t{rounds} * workers));
    sizes.push_back(even);
#if KVPAGER_PLAN_DIVISOR_SIZES
    // Beside it, the size just above it that cuts the longest context into m equal pieces (m =
    // longest / even, rounded down): on uniform batches `even` leaves every sequence a short last
    // piece. (The size just below, m rounded up, never planned better: benchmarks/plan_balance.py.)
    if (longest > 0) {
      const int64_t m = std::max<int64_t>(1, longest / even);
      sizes.push_back(clamp((longest + m - 1) / m));
    }
#endif
  }
  std::sort(sizes.begin(), sizes.end(), std::greater<int64_t>());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());

  std::vector<int64_t> pieces(num_seqs), last(num_seqs), loads(workers);
  std::vector<int> by_last(num_seqs);
  std::vector<uint64_t> keys(num_seqs);
  // Items longest first: every piece but a sequence's last (seq-major), then the last pieces by
  // length (stable); fn(k, seq, piece, tokens) for each.
  auto for_each_item = [&](int64_t size, auto&& fn) {
    int64_t k = 0;
    for (int i = 0; i < num_seqs; ++i)
      for (int64_t p = 0; p + 1 < pieces[i]; ++p) fn(k++, i, p, size);
    for (int i : by_last) fn(k++, i, pieces[i] - 1, last[i]);
  };
  auto cut = [&](int64_t size) {   // pieces and last for this size; returns the item count
    int64_t n = 0;
    for (int i = 0; i < num_seqs; ++i) {
      pieces[i] = std::max<int64_t>(1, (ctx[i] + size - 1) / size);
      last[i] = ctx[i] - (pieces[i] - 1) * size;
      n += pieces[i];
    }
    return n;
  };
  auto order = [&]() {   // by_last (after cut): longest last piece first, ties by row (a stable
    // sort), as one sort of integer keys (row < 2^16, 0 <= last <= size < 2^31)
    for (int i = 0; i < num_seqs; ++i)
      keys[i] = (static_cast<uint64_t>(std::numeric_limits<int32_t>::max() - last[i]) << 16) | static_cast<uint64_t>(i);
    std::sort(keys.begin(), keys.end());
    for (int i = 0; i < num_seqs; ++i) by_last[i] = static_cast<int>(keys[i] & 0xFFFF);
  };
  // The busiest worker's cost for this size (after layout): the m inner pieces, all of one cost,
  // fill m / workers whole rounds and part of one more (the snake's direction by its parity), in
  // O(workers); the last pieces follow item by item.
  auto span_of = [&](int64_t size, int64_t n) {
    const int64_t m = n - num_seqs, cost = size + item_cost;
    const int64_t rounds = m / workers, rest = m % workers;
    std::fill(loads.begin(), loads.end(), rounds * cost);
    for (int64_t j = 0; j < rest; ++j) loads[rounds % 2 == 1 ? workers - 1 - j : j] += cost;
    int64_t k = m;
    for (int i : by_last) loads[work_snake_worker(k++, workers)] += last[i] + item_cost;
    return *std::max_element(loads.begin(), loads.end());
  };
  int64_t best_size = 0, best_span = 0;
  for (const int64_t size : sizes) {   // largest first: ties keep the larger size
    const int64_t n = cut(size);
    if (n > capacity) continue;
    // No worker carries less than the average load or the longest item: a size whose bound
    // already reaches the best span cannot beat it, and is left unsorted (plans unchanged).
    const int64_t bound = std::max(std::min(size, longest) + item_cost, (total + n * item_cost + workers - 1) / workers);
    if (best_size != 0 && bound >= best_span) continue;
    order();
    const int64_t span = span_of(size, n);
    if (best_size == 0 || span < best_span) {
      best_size = size;
      best_span = span;
    }
  }
  if (best_size == 0) return -3;
  const int64_t n = cut(best_size);
  order();
  int32_t* items = out + kWorkHeader;   // records (code, end), in the order dealt
  int32_t* spans = items + 2 * static_cast<int64_t>(capacity);
  std::fill(out, out + kWorkHeader, 0);
  out[0] = static_cast<int32_t>(n);
  out[1] = static_cast<int32_t>(best_size);
  for_each_item(best_size, [&](int64_t k, int seq, int64_t piece, int64_t tokens) {
    items[2 * k] = static_cast<int32_t>((static_cast<uint32_t>(seq) << 16) | static_cast<uint32_t>(piece));
    items[2 * k + 1] = static_cast<int32_t>(piece * best_size + tokens);   // its end token
  });
  std::fill(items + 2 * n, items + 2 * static_cast<int64_t>(capacity), 0);
  int64_t first = 0;
  for (int i = 0; i < num_seqs; ++i) {
    spans[2 * i] = static_cast<int32_t>(first);
    spans[2 * i + 1] = static_cast<int32_t>(pieces[i]);
    first += pieces[i];
  }
  return static_cast<int>(n);
}

std::string plan_decode_work_refusal(int code, int num_seqs, int capacity, int longest_item) {
  switch (code) {
    case -2:
      return "a context is longer than " + std::to_string(kMaxSplits) + " pieces of at most " +
             std::to_string(longest_item) + " tokens: the work-list decode cannot plan it";
    case -3:
      return std::to_string(num_seqs) + " sequences need more than the plan's " + std::to_string(capacity) + " items";
    default:
      return "bad sizes (" + std::to_string(num_seqs) + " sequences, capacity " + std::to_string(capacity) + ")";
  }
}

}  // namespace kvpager
