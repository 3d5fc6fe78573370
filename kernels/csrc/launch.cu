// Launchers: raw pointers, element strides, sizes and a cudaStream_t in; no torch here.
// Instantiates the decode kernel for fp32/fp16/bf16 x head_dim 64/128/256 x head tile 1/2/4/8.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cache_ops.cuh"
#include "launch.h"
#include "paged_decode.cuh"

namespace kvpager {
namespace {

template <typename T_, int D_, int HT_>
struct DecodeCfg {
  using T = T_;
  static constexpr int D = D_;
  static constexpr int HT = HT_;
};

template <typename T, int D, typename F>
bool dispatch_tile(int head_tile, F&& f) {
  switch (head_tile) {
    case 1: f(DecodeCfg<T, D, 1>{}); return true;
    case 2: f(DecodeCfg<T, D, 2>{}); return true;
    case 4: f(DecodeCfg<T, D, 4>{}); return true;
    case 8: f(DecodeCfg<T, D, 8>{}); return true;
    default: return false;
  }
}

template <typename T, typename F>
bool dispatch_dim(int head_dim, int head_tile, F&& f) {
  switch (head_dim) {
    case 64: return dispatch_tile<T, 64>(head_tile, f);
    case 128: return dispatch_tile<T, 128>(head_tile, f);
    case 256: return dispatch_tile<T, 256>(head_tile, f);
    default: return false;
  }
}

template <typename F>
bool dispatch_decode(DType dtype, int head_dim, int head_tile, F&& f) {
  switch (dtype) {
    case kFloat32: return dispatch_dim<float>(head_dim, head_tile, f);
    case kFloat16: return dispatch_dim<__half>(head_dim, head_tile, f);
    case kBFloat16: return dispatch_dim<__nv_bfloat16>(head_dim, head_tile, f);
    default: return false;
  }
}

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

}  // namespace

cudaError_t plan_paged_decode(DType dtype, int requested_splits, int device, DecodeArgs* a) {
  if (a->num_kv_heads <= 0 || a->num_q_heads % a->num_kv_heads != 0 || a->block_size <= 0 ||
      (a->block_size & (a->block_size - 1)) != 0 || a->block_size > kPartitionAlign)
    return cudaErrorInvalidValue;
  const int group = a->num_q_heads / a->num_kv_heads;
  a->head_tile = group >= 8 ? 8 : group > 2 ? 4 : group;   // 1, 2, 4 or 8
  a->head_chunks = ceil_div(group, a->head_tile);
  const int64_t max_ctx = static_cast<int64_t>(a->max_blocks_per_seq) * a->block_size;
  const int64_t max_partition = static_cast<int64_t>(kMaxTableEntries) * a->block_size;
  if (max_ctx <= 0) {
    a->num_splits = 1;
    a->partition_tokens = kPartitionAlign;
    return cudaSuccess;
  }
  int splits;
  if (requested_splits > 0) {
    splits = requested_splits;
  } else {
    int occupancy = 1;
    const bool ok = dispatch_decode(dtype, a->head_dim, a->head_tile, [&](auto cfg) {
      using Cfg = decltype(cfg);
      const int smem = decode_merge_smem_bytes<Cfg::D, Cfg::HT>();
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, paged_decode_kernel<typename Cfg::T, Cfg::D, Cfg::HT>,
                                                        kDecodeWarps * 32, smem) != cudaSuccess)
        occupancy = 1;
    });
    if (!ok) return cudaErrorInvalidValue;
    occupancy = std::max(occupancy, 1);
    const int64_t units = static_cast<int64_t>(a->num_seqs) * a->num_kv_heads * a->head_chunks;
    const int64_t slots = static_cast<int64_t>(sm_count(device)) * occupancy;
    // Measured on an H100 (benchmarks/kernels.py sweeps): long splits beat short ones (each
    // split pays a prologue, an epilogue and merge traffic), a grid under one wave is fine once
    // it gives every SM about two blocks, and a grid over one wave wants a nearly full last wave.
    // So: the fewest splits giving >= 2.5 waves of resident blocks with the last >= 90% full;
    // failing that, among the split counts giving >= 1.9 blocks per SM, the best-filled last
    // wave (a grid of at most one wave counts as full), fewest splits on ties. Splits stay
    // >= kMinPartitionTokens long unless that leaves fewer than 1.9 blocks per SM.
    const int64_t sms = sm_count(device);
    const int64_t want_blocks = (19 * sms + 9) / 10;
    int max_s = std::max(1, ceil_div(max_ctx, kMinPartitionTokens));
    if (units * max_s < want_blocks) max_s = std::max(max_s, ceil_div(max_ctx, kMinPartitionTokensSmall));
    max_s = std::min(max_s, kMaxSplits);
    splits = 0;
    int best = max_s;
    double best_fill = -1.0;
    for (int s = 1; s <= max_s; ++s) {
      const int64_t part = static_cast<int64_t>(ceil_div(ceil_div(max_ctx, s), kPartitionAlign)) * kPartitionAlign;
      const int64_t blocks = units * ceil_div(max_ctx, part);
      const double waves = static_cast<double>(blocks) / static_cast<double>(slots);
      const double fill = waves <= 1.0 ? 1.0 : waves / std::ceil(waves);
      if (waves >= 2.5 && fill >= 0.9) {
        splits = s;
        break;
      }
      if (blocks >= want_blocks && fill > best_fill + 1e-9) {
        best = s;
        best_fill = fill;
      }
    }
    if (splits == 0) splits = best;
    splits = std::max(splits, ceil_div(max_ctx, max_partition));   // the table slice must fit
    splits = std::min(splits, kMaxSplits);
  }
  int64_t partition = ceil_div(max_ctx, splits);
  partition = ceil_div(partition, kPartitionAlign) * static_cast<int64_t>(kPartitionAlign);
  if (partition > max_partition || splits > kMaxSplits) return cudaErrorInvalidValue;
  a->partition_tokens = static_cast<int>(partition);
  a->num_splits = ceil_div(max_ctx, partition);
  return cudaSuccess;
}

cudaError_t launch_paged_decode(DType dtype, const DecodeArgs& a, cudaStream_t stream) {
  if (a.num_seqs == 0) return cudaSuccess;
  if (a.num_splits < 1 || a.num_splits > kMaxSplits || a.partition_tokens % kPartitionAlign != 0 ||
      a.partition_tokens / a.block_size > kMaxTableEntries || a.num_seqs > 65535 ||
      (a.num_splits > 1 && (a.part_out == nullptr || a.part_ml == nullptr)))
    return cudaErrorInvalidValue;
  cudaError_t err = cudaSuccess;
  const bool ok = dispatch_decode(dtype, a.head_dim, a.head_tile, [&](auto cfg) {
    using Cfg = decltype(cfg);
    using T = typename Cfg::T;
    const int smem = decode_smem_bytes<Cfg>(a.partition_tokens, a.block_size);
    // grid: (num_kv_heads * head_chunks, num_seqs, num_splits); block: kDecodeWarps warps.
    const dim3 grid(a.num_kv_heads * a.head_chunks, a.num_seqs, a.num_splits);
    paged_decode_kernel<T, Cfg::D, Cfg::HT><<<grid, kDecodeWarps * 32, smem, stream>>>(a);
    err = cudaGetLastError();
    if (err != cudaSuccess || a.num_splits == 1) return;
    // grid: (num_q_heads, num_seqs); block: kMergeThreads threads.
    paged_decode_merge_kernel<T><<<dim3(a.num_q_heads, a.num_seqs), kMergeThreads, 0, stream>>>(a);
    err = cudaGetLastError();
  });
  return ok ? err : cudaErrorInvalidValue;
}

cudaError_t launch_write_kv(const WriteKVArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.elem_size <= 0 || (a.head_dim * a.elem_size) % 16 != 0 || a.block_size <= 0) return cudaErrorInvalidValue;
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
  if (num_pairs == 0) return cudaSuccess;
  if (block_bytes % 16 != 0 || num_pairs > 0x7fffffff) return cudaErrorInvalidValue;
  const int64_t block_vecs = block_bytes / 16;
  const int64_t tiles = (block_vecs + kCopyThreads * kCopyUnroll - 1) / (kCopyThreads * kCopyUnroll);
  if (tiles > 65535) return cudaErrorInvalidValue;
  // grid: (num_pairs, tiles of kCopyThreads * kCopyUnroll vectors); block: kCopyThreads threads.
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(std::max<int64_t>(tiles, 1)));
  copy_blocks_kernel<<<grid, kCopyThreads, 0, stream>>>(static_cast<uint4*>(cache), num_cache_blocks, block_vecs, src,
                                                        dst);
  return cudaGetLastError();
}

}  // namespace kvpager
