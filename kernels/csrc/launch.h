// Host-side interface of kvpager's CUDA kernels: plain structs of raw pointers, element
// strides and sizes, and launchers that take a cudaStream_t. No torch types here: launch.cu
// compiles with nvcc alone, and binding.cpp (the torch extension) checks every tensor and
// fills these structs.
//
// Cache layout (see kernels/reference.py): per-layer views
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
// with the inner dims packed (head stride = block_size * head_dim, token stride = head_dim,
// element stride 1) and any block stride (the block-major cache puts num_layers * 2 layer
// blocks between two blocks of one layer). Strides are in ELEMENTS.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace kvpager {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3 };   // kFloat8E4M3: caches only

// Limits the launchers enforce (and binding.cpp checks first, with clearer messages).
constexpr int kMaxSplits = 256;            // split-KV partitions of one sequence
constexpr int kMaxTableEntries = 8192;     // block-table entries one thread block stages in shared memory
constexpr int kPartitionAlign = 64;        // a split's token count is a multiple of this (and of block_size)
constexpr int kDefaultPrefetchSteps = 1;       // L2 prefetch distance (benchmarks/kernels.py sweeps it)
constexpr int kDefaultPrefetchStepsMma = 0;    // ... of the tensor-core fp8 instance: none (--only fp8_sweep on an
                                               // H100: 87.1% of the copy ceiling at 64 x 4096 without, 83.7% with 1)
constexpr int kWorkHeader = 4;                 // ints before a work list's items (see DecodeArgs::work)
constexpr int kMaxTileElems = 64;              // decode head tile x elements per lane (query + accumulators in registers)

// A work list's size in ints for `capacity` item records and `num_seqs` sequences, and the
// capacity a list of `ints` ints holds (DecodeArgs::work).
constexpr int64_t work_list_ints(int64_t capacity, int64_t num_seqs) { return kWorkHeader + 2 * capacity + 2 * num_seqs; }
constexpr int64_t work_list_capacity(int64_t ints, int64_t num_seqs) { return (ints - kWorkHeader - 2 * num_seqs) / 2; }

// The worker that runs item k of a work list: items are dealt in rounds of `workers`, every other
// round in reverse (a snake), so no worker gets the longest item of every round.
__host__ __device__ constexpr int work_snake_worker(int64_t k, int workers) {
  return (k / workers) % 2 == 1 ? workers - 1 - static_cast<int>(k % workers) : static_cast<int>(k % workers);
}
// The index of worker y's item of round r (the inverse of work_snake_worker).
__host__ __device__ constexpr int64_t work_item_index(int r, int y, int workers) {
  return static_cast<int64_t>(r) * workers + (r % 2 == 1 ? workers - 1 - y : y);
}

struct DecodeArgs {
  void* out;                       // [num_seqs, num_q_heads, head_dim], query dtype
  const void* query;               // [num_seqs, num_q_heads, head_dim], inner dim contiguous
  const void* k_cache;             // [num_cache_blocks, num_kv_heads, block_size, head_dim] view
  const void* v_cache;             // same shape and strides as k_cache
  const int32_t* block_tables;     // [num_seqs, max_blocks_per_seq], inner dim contiguous
  const int32_t* context_lens;     // [num_seqs]
  float* part_out;                 // split-KV workspace, fp32 partial outputs (rows: see `work` below)
  float* part_ml;                  // fp32 (max, sum) of each partial row, log2 domain
  int64_t q_stride_seq, q_stride_head;
  int64_t o_stride_seq, o_stride_head;
  int64_t kv_stride_block;         // elements between two blocks (K and V views share it)
  int64_t kv_stride_head;          // = block_size * head_dim
  int64_t table_stride;            // elements between two block-table rows
  int num_seqs, num_q_heads, num_kv_heads, head_dim;
  int block_size, log2_block_size, max_blocks_per_seq, num_cache_blocks;
  float scale_log2;                // softmax scale * log2(e) * k_scale: scores are kept in the log2 domain
  float v_scale;                   // multiplies the output: 1, or the fp8 cache's V scale
  int prefetch_steps;              // L2 prefetch distance in block iterations (0 = none; Hopper only)
  // Work-list mode (planned once per step on the host, kernels/decode_plan.py) when non-null:
  // a DEVICE int32 array of work_list_ints(work_capacity, num_seqs) ints, 16-byte aligned:
  //   [0] items n, [1] tokens per piece (partition, a multiple of kPartitionAlign), [2] the block
  //   tables' row stride when > 0 (0: table_stride; the planner writes 0), [3] unused;
  //   work_capacity item records of 2 ints (seq << 16 | piece, end): the item covers tokens
  //   [piece * partition, end) of seq; the first n are used, in the order they are dealt: item k
  //   runs on worker (blockIdx.y) work_snake_worker(k, work_workers), in its round k / work_workers,
  //   so worker y finds its r-th item at a computed index, with no offsets to read first;
  //   per sequence (first partial row, piece count): count >= 1 and <= kMaxSplits; a sequence
  //   of one piece is written directly, others through partial rows first .. first + count - 1.
  // part_out / part_ml then hold one row per item: [work_capacity, num_q_heads, head_dim] and
  // [work_capacity, num_q_heads, 2]. (Grid mode: [num_seqs * num_splits, num_q_heads, ...].)
  const int32_t* work;
  int work_capacity;
  int work_workers;                // work-list mode: thread blocks per (KV head, head chunk)
  // The plan (decode_plan.h: plan_decode_grid, or plan_decode_work_geometry for a work list):
  int loads;                       // 16-byte K (and V) loads in flight per lane: 2 or 4 (tensor-core
                                   // instance: 16 or 32 tokens per warp iteration)
  int head_tile;                   // query heads per thread block (1, 2, 4 or 8)
  int mma;                         // 1: the tensor-core instance (head_dim 64/128; paged_decode_mma.cuh); 2: the one
                                   // staged by the copy engine (16-bit caches, Hopper; paged_decode_bulk.cuh)
  int head_chunks;                 // ceil(group / head_tile) thread blocks per KV head
  int num_splits;                  // grid mode: 1 = unsplit path (no merge kernel)
  int partition_tokens;            // grid mode: tokens per split (multiple of kPartitionAlign and of block_size)
};

// Kernel facts the planner (decode_plan.cu) reads; the launcher owns the kernel instances.
// Whether a decode instance exists for (dtype, cache dtype, head_dim, head_tile, loads, mma); mma != 0:
// the tensor-core instance (fp8 e4m3 caches with fp16/bf16 queries, head_dim 64/128, head tiles up to 8).
bool decode_instance_built(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, int mma);
// Shared memory a work-list launch reserves per block (the merge's; an item's table slice reuses it); 0 if no instance.
int decode_merge_smem(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, int mma);
// Resident blocks per SM of that instance at that shared memory (cached per device; 1 if unknown).
int decode_blocks_per_sm(DType dtype, DType cache_dtype, int head_dim, int head_tile, int loads, int mma, int device);
int device_sm_count(int device);   // cached per device
// Peak DRAM bandwidth in bytes/s from the memory clock and bus width (double data rate), cached
// per device; 0 if unknown.
double device_memory_bandwidth(int device);

// Launches the decode kernel (and, when num_splits > 1 or in work-list mode, the merge kernel) on
// `stream`, as the plan fields say (checked, never re-planned: cudaErrorInvalidValue when the
// plan does not fit the sizes or names no kernel instance).
cudaError_t launch_paged_decode(DType dtype, DType cache_dtype, const DecodeArgs& args, cudaStream_t stream);

// Paged prefill (paged_prefill.cuh, launched by paged_prefill.cu): the new tokens of a ragged
// batch over their paged context, causal, on tensor cores. One launch for the whole batch: a
// host-built work list of (sequence, row tile) items, each run for every KV head. A sequence's
// rows are its (token, query head of the GQA group) pairs, token-major; a row tile holds
// prefill_tile_rows(warps) of them.
struct PrefillArgs {
  void* out;                       // [num_tokens, num_q_heads, head_dim], query dtype
  const void* query;               // [num_tokens, num_q_heads, head_dim], inner dim contiguous
  const void* k_cache;             // [num_cache_blocks, num_kv_heads, block_size, head_dim] view
  const void* v_cache;             // same shape and strides as k_cache
  const int32_t* block_tables;     // [num_seqs, max_blocks_per_seq], inner dim contiguous
  const int32_t* context_lens;     // [num_seqs]: positions in cache, the new tokens included
  const int32_t* query_start_loc;  // [num_seqs + 1] CSR offsets of each sequence's queries
  const int32_t* work;             // DEVICE [num_items, 2]: (sequence, row tile), in the order to run them
  // DEVICE int32 [2], zero before the launch and left zero after it, or nullptr. Read by the
  // Hopper warp-specialized kernel alone: with it, each block takes its next (work item, KV head)
  // pair from this counter as it frees up (dynamic schedule: balanced whatever the list's order);
  // without it, block b takes pairs b, 2G - 1 - b, 2G + b, ... of G blocks (static snake, balanced
  // for a list sorted heaviest first). One launch at a time per counter.
  int32_t* ws_counter;
  int64_t q_stride_tok, q_stride_head;
  int64_t o_stride_tok, o_stride_head;
  int64_t kv_stride_block, kv_stride_head, table_stride;
  int num_items, num_q_heads, num_kv_heads, head_dim;
  int block_size, log2_block_size, max_blocks_per_seq, num_cache_blocks;
  float scale_log2;                // softmax scale * log2(e) * k_scale
  float v_scale;                   // multiplies the output: 1, or the fp8 cache's V scale
  int warps;                       // 4 or 8 warps per block (16 rows each)
  int wgmma;                       // 1: the warpgroup (wgmma) instances (8 warps only), where built for sm_90a
  // A split query (split_query.cuh), or nullptr: `query` then holds each row's split bytes (2 *
  // head_dim, strides counted in 2-byte units like a 16-bit query's) and this the rows' factors 2^-f,
  // float32 [num_kv_heads, num_tokens, G] (G = num_q_heads / num_kv_heads; row (token, head) at
  // [head / G][token][head % G]), [num_tokens, G] contiguous, query_down_stride floats between KV
  // heads. Output in `dtype` (the query's before its split), over fp8 caches on the warp-specialized
  // kernel only (paged_prefill_split_query_supported).
  const float* query_down;
  int64_t query_down_stride;
};

// Query rows (token x GQA head pairs) per work item for a launch with `warps` warps.
constexpr int prefill_tile_rows(int warps) { return 16 * warps; }

// Whether launch_paged_prefill has a kernel for these: dtype fp16/bf16, cache dtype the same or
// fp8 e4m3, head_dim 64 or 128, block_size a power of two in [8, 64], warps 4 or 8.
bool paged_prefill_supported(DType dtype, DType cache_dtype, int head_dim, int block_size, int warps);

cudaError_t launch_paged_prefill(DType dtype, DType cache_dtype, const PrefillArgs& args, cudaStream_t stream);

// Whether launch_paged_prefill takes a split query (PrefillArgs::query_down) for these on `device`:
// bf16 or fp16 output (the query's type before its split) over an fp8 e4m3 cache, head_dim 64 or
// 128, 8 warps with wgmma, the warp-specialized kernel built for the device (sm_90a) with its query
// split ahead (KVPAGER_PREFILL_WS_Q_AHEAD; fp16: KVPAGER_PREFILL_WS_FP16_SPLIT).
bool paged_prefill_split_query_supported(DType dtype, DType cache_dtype, int head_dim, int device);

// Whether the wgmma instances were built for the current device as such (sm_90a device code);
// elsewhere they run the mma.sync version. Probed once per device (one tiny launch and copy).
bool paged_prefill_has_wgmma(int device);

struct WriteKVArgs {
  const void* key;                 // [num_tokens, num_heads, head_dim], inner dim contiguous
  const void* value;               // same shape
  void* k_cache;                   // [num_cache_blocks, num_heads, block_size, head_dim] view
  void* v_cache;
  const void* slot_mapping;        // [num_tokens] int32 or int64; negative = skip
  int slot_is_int64;
  int64_t key_stride_tok, key_stride_head;
  int64_t value_stride_tok, value_stride_head;
  int64_t k_stride_block, k_stride_head;   // token stride inside a block is head_dim
  int64_t v_stride_block, v_stride_head;
  int num_tokens, num_heads, head_dim, block_size, num_cache_blocks;
  int elem_size;                   // bytes per element; head_dim * elem_size % 16 == 0
  // fp8 e4m3 cache: key/value are this DType (kFloat16 or kBFloat16; elem_size is theirs) and
  // are stored times 1 / scale, saturated; kFloat8E4M3 never here. -1: no conversion.
  int quantize_from;
  float k_inv_scale, v_inv_scale;
};

cudaError_t launch_write_kv(const WriteKVArgs& args, cudaStream_t stream);

// Copies whole blocks of a contiguous block-major cache: cache[dst[i]] = cache[src[i]].
// block_bytes = num_layers * 2 * num_kv_heads * block_size * head_dim * elem_size, a multiple of 16.
cudaError_t launch_copy_blocks(void* cache, int64_t num_cache_blocks, int64_t block_bytes, const int64_t* src,
                               const int64_t* dst, int64_t num_pairs, cudaStream_t stream);

// Swaps (kernels/cuda.py swap_blocks): whole blocks between two contiguous block-major buffers
// of equal block_bytes, dst[dst_ids[i]] = src[src_ids[i]], one side on the device and the other
// in pinned host memory (or both on the device).
//
// DMA: the copy engines move each run of consecutive pairs (src and dst ids both ascending by
// one) as one cudaMemcpyAsync, or the whole list as one cudaMemcpyBatchAsync where the runtime
// has it (use_batch). The ids are HOST arrays; pairs outside [0, num_*_blocks) are skipped.
// No SM is used, so the copies overlap compute kernels fully.
cudaError_t launch_swap_dma(void* dst, int64_t num_dst_blocks, const void* src, int64_t num_src_blocks,
                            int64_t block_bytes, const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs,
                            bool use_batch, cudaStream_t stream);

// Zero-copy kernel: dst/src are DEVICE-accessible pointers (for the host side, the pointer
// cudaHostGetDevicePointer gives for pinned memory); the ids are DEVICE arrays.
// block_bytes must be a multiple of 16 and both bases 16-byte aligned.
cudaError_t launch_swap_kernel(void* dst, int64_t num_dst_blocks, const void* src, int64_t num_src_blocks,
                               int64_t block_bytes, const int64_t* src_ids, const int64_t* dst_ids, int64_t num_pairs,
                               cudaStream_t stream);

}  // namespace kvpager
