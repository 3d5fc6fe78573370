// A per-block timeline of the decode kernels, for benchmarks/decode_timeline.py: compiled in only
// with -DKVPAGER_DECODE_TIMELINE=1 (a variant build, never the default). Thread 0 of each decode
// block reads %globaltimer (nanoseconds, one clock for the whole GPU) at the block's entry and at
// each work item's start, first use of K/V (after warp 0's first scores), halfway (warp 0's scores
// of the item's middle iteration) and end, into a device
// buffer. The merge kernel of the same launch prints them once the decode grid is done (past its
// griddepcontrol.wait), with its own block's entry, wait and end, one line each:
//
//   KVTL d <sm> <block x> <block y> <block z> <round> <entry> <start> <first> <end> <tokens> <mid>
//   KVTL m <sm> <block x> <block y> <entry> <waited> <end>
//
// so the decode kernel itself never calls printf (which would change its registers and slow the
// blocks still running). A launch without a merge (grid plans of one split) prints nothing; its
// records are printed by the next merge, and told apart by their times.
//
// Off (the default), every call here compiles to nothing.
#pragma once

#ifndef KVPAGER_DECODE_TIMELINE
#define KVPAGER_DECODE_TIMELINE 0
#endif

#if KVPAGER_DECODE_TIMELINE
#include <cstdio>

#include "pdl.cuh"
#endif

namespace kvpager {

#if KVPAGER_DECODE_TIMELINE
__device__ __forceinline__ unsigned long long timeline_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned timeline_sm() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// When warp 0 of this block first had its K/V (the current item's first iteration) and reached
// its middle iteration, set by timeline_progress.
__shared__ unsigned long long timeline_first_ns, timeline_mid_ns;
#endif

// In a decode item's loop, after warp 0's scores of iteration `it` of n_iter.
__device__ __forceinline__ void timeline_progress(int it, int n_iter) {
#if KVPAGER_DECODE_TIMELINE
  if (threadIdx.x == 0) {
    if (it == 0) timeline_first_ns = timeline_ns();
    if (it == n_iter / 2) timeline_mid_ns = timeline_ns();
  }
#endif
}

#if KVPAGER_DECODE_TIMELINE
constexpr int kTimelineBlocks = 16384;   // blocks recorded per launch (higher block ids are not)
constexpr int kTimelineItems = 8;        // items recorded per block (a work list's worker has a few)

__device__ __forceinline__ int timeline_block() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

struct DecodeRecord {
  unsigned long long entry, start[kTimelineItems], first[kTimelineItems], mid[kTimelineItems], end[kTimelineItems];
  int tokens[kTimelineItems];
  int n, sm, bx, by, bz;
};
static __device__ DecodeRecord g_decode_records[kTimelineBlocks];

#endif

// Thread 0 stores each mark straight into the block's record, so no pointer or count is held in
// registers across an item (held, they made the 2-loads FMA instance spill 44 bytes; this way it
// does not spill, ptxas -v, sm_90a).
#if KVPAGER_DECODE_TIMELINE
__device__ __forceinline__ DecodeRecord* timeline_record() {
  const int b = timeline_block();
  return threadIdx.x == 0 && b < kTimelineBlocks ? &g_decode_records[b] : nullptr;
}
#endif

// At a decode block's entry.
__device__ __forceinline__ void timeline_block_entry() {
#if KVPAGER_DECODE_TIMELINE
  DecodeRecord* rec = timeline_record();
  if (rec == nullptr) return;
  rec->n = 0;
  rec->sm = static_cast<int>(timeline_sm());
  rec->bx = blockIdx.x;
  rec->by = blockIdx.y;
  rec->bz = blockIdx.z;
  rec->entry = timeline_ns();
#endif
}

// Before and after the block's item of round r (0 in grid mode).
__device__ __forceinline__ void timeline_item_start(int r) {
#if KVPAGER_DECODE_TIMELINE
  DecodeRecord* rec = timeline_record();
  if (rec == nullptr || r >= kTimelineItems) return;
  rec->start[r] = timeline_ns();
  timeline_first_ns = 0;
  timeline_mid_ns = 0;
#endif
}

__device__ __forceinline__ void timeline_item_end(int r, int tokens) {
#if KVPAGER_DECODE_TIMELINE
  DecodeRecord* rec = timeline_record();
  if (rec == nullptr || r >= kTimelineItems) return;
  rec->end[r] = timeline_ns();
  rec->first[r] = timeline_first_ns;
  rec->mid[r] = timeline_mid_ns;
  rec->tokens[r] = tokens;
  rec->n = r + 1;
#endif
}

// A merge block's marks; when it leaves, thread 0 prints them and decode records m, m + merge
// blocks, ... (m: this merge block), clearing each (a record with no items prints nothing).
struct MergeTimeline {
#if KVPAGER_DECODE_TIMELINE
  unsigned long long entry, waited = 0;
  __device__ __forceinline__ MergeTimeline() : entry(timeline_ns()) {}
  __device__ __forceinline__ void mark_waited() { waited = timeline_ns(); }
  __device__ __forceinline__ ~MergeTimeline() {
    const unsigned long long end = timeline_ns();
    if (threadIdx.x != 0) return;
    if (waited == 0) wait_for_prerequisite_grids();   // left early: the decode records only after the grid
    printf("KVTL m %u %d %d %llu %llu %llu\n", timeline_sm(), blockIdx.x, blockIdx.y, entry, waited, end);
    const int blocks = gridDim.x * gridDim.y * gridDim.z;
    for (int b = timeline_block(); b < kTimelineBlocks; b += blocks) {
      DecodeRecord& rec = g_decode_records[b];
      for (int i = 0; i < rec.n && i < kTimelineItems; ++i)
        printf("KVTL d %d %d %d %d %d %llu %llu %llu %llu %d %llu\n", rec.sm, rec.bx, rec.by, rec.bz, i, rec.entry,
               rec.start[i], rec.first[i], rec.end[i], rec.tokens[i], rec.mid[i]);
      rec.n = 0;
    }
  }
#else
  __device__ __forceinline__ void mark_waited() {}
#endif
};

}  // namespace kvpager
