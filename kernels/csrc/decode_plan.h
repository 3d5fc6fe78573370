// Host-side planning of the paged decode launch (FlashInfer's plan/run split): the kernel
// instance, the head tile, the grid or work-list geometry and the step's work list are chosen
// HERE, once per step (or once per model for the work-list geometry); the launcher
// (launch.cu launch_paged_decode) only checks and launches what a plan says. Every heuristic of
// the decode path lives in this header's .cu; kernels/decode_plan.py is the numpy twin of
// plan_decode_work (the reference the GPU tests compare it with).
//
// No torch types here either: decode_plan.cu compiles with nvcc alone.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>
#include <string>

#include "launch.h"

namespace kvpager {

// Heuristic constants (benchmarks/kernels.py --only quick,ragged sweeps them on an H100).
constexpr int kMinPartitionTokens = 1024;          // automatic grid splits are at least this long ...
constexpr int kMinPartitionTokensSmall = 256;      // ... or this, when longer ones leave SMs without blocks
constexpr int kMinPartitionTokensFewLoads = 2048;  // splits of the 2-loads kernel instance, unless unsplit
constexpr int kWorkDefaultLoads = 2;               // kernel instance of work-list launches (a full resident grid) ...
// ... or 4 loads in flight per lane over 16-bit caches where DRAM peaks at this or more (an
// H200's ~4.9 TB/s; not an H100's 3.35): on the H200, work lists with 4 loads read 5-21 points of
// the copy ceiling more on long and ragged steps and the same on short ones; on the H100 they
// were 1-8% slower on large steps (benchmarks/kernels.py --only list_loads, docs/performance.md).
constexpr double kFourLoadsBandwidth = 4.2e12;
constexpr int kWorkRounds[] = {1, 2, 4, 8, 16};    // items per worker the work-list planner tries (decode_plan.py ROUNDS)
// KVPAGER_PLAN_DIVISOR_SIZES=0: the work-list planner's candidate piece sizes without the sizes
// that cut the longest context into equal pieces (plan_decode_work), to A/B them.
#ifndef KVPAGER_PLAN_DIVISOR_SIZES
#define KVPAGER_PLAN_DIVISOR_SIZES 1
#endif
// Whether plans over fp8 e4m3 caches take the tensor-core instance (paged_decode_mma.cuh) where it
// is built (head_dim 64/128); requested_mma overrides it (kernels/debug.py: side-by-side runs).
constexpr bool kDecodeMmaDefault = true;
// The same over 16-bit caches (the query's dtype, head_dim 64/128): taken where DRAM peaks at
// kDecodeMma16Bandwidth or more (an H200's ~4.9 TB/s; not an H100's 3.35). There the FMA instance
// tops out near 3.4 TB/s, 60-81% of the copy ceiling (most likely issue-bound), and the tensor-core
// one, a fifth of the instructions, reads 6-24% faster on every step, 14-21% with a clean L2 (64 x
// 4K 92-93% against 77-78%; 8 x 4K 71% against 60%); on the H100 it is no faster with a clean L2 and
// slower on long steps
// (benchmarks/decode_turns.py --mma, docs/performance.md). KVPAGER_DECODE_MMA16=1 builds plans
// that take it on every device, for A/B timing against the FMA instance.
#ifndef KVPAGER_DECODE_MMA16
#define KVPAGER_DECODE_MMA16 0
#endif
constexpr bool kDecodeMma16Default = KVPAGER_DECODE_MMA16 != 0;
// Where plans take a tensor-core instance over a 16-bit cache on Hopper: the one whose K/V the
// copy engine stages (mma 2, paged_decode_bulk.cuh) with KVPAGER_DECODE_MMA_BULK=1, else the
// register one (mma 1). Not the default: on an H200 it reads large steps 3-8 points nearer the copy
// ceiling and small steps and short ragged batches 2-6 points further (docs/performance.md, "The
// tensor-core decode staged by the copy engine").
#ifndef KVPAGER_DECODE_MMA_BULK
#define KVPAGER_DECODE_MMA_BULK 0
#endif
constexpr bool kDecodeMmaBulkDefault = KVPAGER_DECODE_MMA_BULK != 0;
constexpr double kDecodeMma16Bandwidth = 4.2e12;

// The launch sizes a plan is made for (the run's DecodeArgs must carry the same).
struct DecodeSizes {
  int num_seqs, num_q_heads, num_kv_heads, head_dim, block_size;
  int max_blocks_per_seq;          // the block table's width (grid mode plans from it: no device sync)
};

// A grid-mode plan: one thread block per (KV head chunk, sequence, split), splits cut from the
// table's width. requested_* (benchmarks and tests only; 0 = automatic): num_splits and the
// kernel instance (2 or 4 loads in flight per lane; requested_mma: -1 automatic, 0 the FMA
// instance, 1 the tensor-core one).
struct DecodeGridPlan {
  int loads;                       // 16-byte K (and V) loads in flight per lane: 2 or 4
  int head_tile;                   // query heads per thread block (1, 2, 4 or 8)
  int mma;                         // 1, 2: a tensor-core instance (DecodeArgs::mma)
  int num_splits;                  // 1 = unsplit (no merge kernel, no workspace)
  int partition_tokens;            // tokens per split (a multiple of kPartitionAlign and of block_size)
};

// The work-list geometry: fixed by the model's head counts, dtypes and the device (not by the
// step), so a CUDA graph captured with it serves every later plan of the same size.
struct DecodeWorkGeometry {
  int loads, head_tile;
  int mma;                         // 1, 2: a tensor-core instance (DecodeArgs::mma)
  int workers;                     // thread blocks per (KV head, head chunk): one resident wave
  int longest_item;                // tokens one item may hold (its table slice fits the reserved smem)
};

// Which instance plans for these on `device` take (0 FMA, 1 tensor cores, 2 tensor cores staged by
// the copy engine): requested_mma 0 no tensor cores, 1 or 2 that one (when built), -1 where built
// (and built with 4 loads if requested_loads is 4): over fp8 caches kDecodeMmaDefault, over 16-bit
// ones kDecodeMma16Default or DRAM peaking at >= kDecodeMma16Bandwidth (then 2 with
// kDecodeMmaBulkDefault, where built). Returns -1 for a request of an instance that is not built.
int decode_use_mma(DType dtype, DType cache_dtype, int head_dim, int requested_mma, int requested_loads, int device);

// Query heads per thread block for this (dtype, cache dtype, head_dim, GQA group, instance): the
// whole group up to 8 (1, 2, 4 or 8); the FMA instance at most the lanes sharing a token row and
// at most kMaxTileElems / (elements per lane); the tensor-core one the group rounded up to a power
// of two (its mma tile holds 8 heads whatever the tile). 0 when no kernel instance serves these sizes.
int decode_head_tile(DType dtype, DType cache_dtype, int head_dim, int group, int mma);

// Grid-mode plan for these sizes. Returns cudaErrorInvalidValue for unsupported sizes or a
// requested split count whose splits cannot stage their table slice.
cudaError_t plan_decode_grid(DType dtype, DType cache_dtype, const DecodeSizes& sizes, int requested_splits,
                             int requested_loads, int requested_mma, int device, DecodeGridPlan* plan);

// Work-list geometry for these sizes (num_seqs and max_blocks_per_seq unused).
cudaError_t plan_decode_work_geometry(DType dtype, DType cache_dtype, const DecodeSizes& sizes, int requested_loads,
                                      int requested_mma, int device, DecodeWorkGeometry* geometry);

// The step's work list (DecodeArgs::work layout) planned on the HOST from its context lengths:
// pieces of one size P cut every sequence (P chosen among whole sequences, total / (R * workers)
// for R in kWorkRounds and, beside each of those, the longest context / m for m = longest / it
// rounded down, at least min_item tokens, by the exact busiest-worker cost,
// tokens plus item_cost per item), sorted longest first and dealt over the workers in rounds,
// odd rounds in reverse, and stored in that order (work_snake_worker). out: work_list_ints(capacity,
// num_seqs) ints.
// Returns the item count, or < 0: -1 bad sizes, -2 a context too long for kMaxSplits pieces of
// longest_item tokens, -3 more items than capacity.
int plan_decode_work(const int32_t* context_lens, int num_seqs, int workers, int longest_item, int capacity,
                     int min_item, int item_cost, int32_t* out);
// What plan_decode_work's refusal `code` (< 0) means, for the callers' error messages.
std::string plan_decode_work_refusal(int code, int num_seqs, int capacity, int longest_item);

}  // namespace kvpager
