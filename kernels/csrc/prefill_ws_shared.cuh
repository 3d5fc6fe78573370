// The warp-specialized prefill kernel's (paged_prefill_ws.cuh) build-time knobs, its shared memory
// layout and the synchronization its three warpgroups share: mbarriers (full/empty per K/V stage
// and Q buffer), named barriers (the consumers' turns, the producer's own), the register split
// (setmaxnreg), the record the producer hands the consumers with each item, stage cursors.
#pragma once

#include <type_traits>

#include "mbarrier.cuh"
#include "paged_prefill.cuh"

namespace kvpager {
// KVPAGER_PREFILL_WS_STAGES: K/V stages (default 3 with tiles of 128 positions, the most that fit
// at head_dim 128: 64 KB a stage, beside the 32 KB Q buffer, of the 227 KB a block can have; 6
// with tiles of 64).
// KVPAGER_PREFILL_WS_PINGPONG=0: the consumer warpgroups issue their GEMMs without taking turns.
#ifndef KVPAGER_PREFILL_WS_PINGPONG
#define KVPAGER_PREFILL_WS_PINGPONG 1
#endif
// KVPAGER_PREFILL_WS_BN: K/V positions per tile (default 128). 64 halves the masked work of an
// item's last tile, at twice the tiles: measured the same on 512-token prompts and 7-11% slower
// on long ones (H100, 2026-11-26).
#ifndef KVPAGER_PREFILL_WS_BN
#define KVPAGER_PREFILL_WS_BN 128
#endif
#ifndef KVPAGER_PREFILL_WS_STAGES
#define KVPAGER_PREFILL_WS_STAGES (384 / KVPAGER_PREFILL_WS_BN)
#endif
// (KVPAGER_PREFILL_WS_OVERLAP=1, removed 2026-11-26 in the eleventh session: a consumer left an
// item's last P V running under the next item's set-up. Measured mixed three times, eighth and
// tenth sessions; with narrowed last tiles ptxas serialized every wgmma of it, C7520.)
// Q buffers (KVPAGER_PREFILL_WS_QBUFS, default 1): the consumers copy their rows of Q to registers
// as an item starts, and the producer then loads the next item's Q into the buffer. Two buffers
// (at head_dim 128 they fit beside 2 K/V stages, not 3) measured no faster, both when Q stayed in
// shared memory for the whole item and since Q moved to registers (H100, 2026-11-26).
#ifndef KVPAGER_PREFILL_WS_QBUFS
#define KVPAGER_PREFILL_WS_QBUFS 1
#endif
constexpr int kWsQBufs = KVPAGER_PREFILL_WS_QBUFS;
// KVPAGER_PREFILL_WS_FP8_HALF=0: over fp8 caches the tensor cores multiply in the query's type
// (bf16: every pair of cache values costs the producer about four conversions, through fp32)
// instead of fp16, for A/B timing.
#ifndef KVPAGER_PREFILL_WS_FP8_HALF
#define KVPAGER_PREFILL_WS_FP8_HALF 1
#endif
// KVPAGER_PREFILL_WS_FP8_RAWK=0: over fp8 caches the producer converts K tiles to fp16 too (as
// before 2026-11-27), and S is computed in fp16, for A/B timing (ws_raw_k).
#ifndef KVPAGER_PREFILL_WS_FP8_RAWK
#define KVPAGER_PREFILL_WS_FP8_RAWK 1
#endif
// KVPAGER_PREFILL_WS_FP16_SPLIT=0: fp16 queries over fp8 caches keep K converted to fp16 and S in
// fp16, exact in the query (as before 2026-11-27), instead of splitting the query like bf16's.
#ifndef KVPAGER_PREFILL_WS_FP16_SPLIT
#define KVPAGER_PREFILL_WS_FP16_SPLIT 1
#endif
// Over fp8 caches, K tiles stay fp8 e4m3 in shared memory, as the cache holds them (copied by
// cp.async, rows padded to 128 bytes at head_dim 64), and S = Q K^T runs on the tensor cores in
// e4m3 (wgmma k32), each query split into two e4m3 terms (WsQuerySplit): the producer converts only
// V tiles. The split is exact for bf16 queries; fp16 queries keep 8 of their 11 significant bits
// (within 2^-9 of each value, as bf16 rounds, against the cache's own e4m3 K within 2^-4): on the
// H100 their attention is then 9e-4 (relative) from gather + SDPA's fp16 math over the same fp8
// cache, where the exact fp16 S path is 1e-5 from it and the fp8 cache itself 3.5e-2 from the
// 16-bit cache it was written from; and 0.93x SDPA on 32 x 512 prompts where the exact path is
// 0.79x (docs/performance.md, "fp16 queries over fp8 caches split too").
template <typename T, typename C>
constexpr bool ws_raw_k = sizeof(C) == 1 && KVPAGER_PREFILL_WS_FP8_RAWK != 0 &&
                          (std::is_same_v<T, __nv_bfloat16> || KVPAGER_PREFILL_WS_FP16_SPLIT != 0);
// KVPAGER_PREFILL_WS_Q_AHEAD=1 (default; with ws_raw_k): a consumer warp loads and splits the next
// item's query while its item's last P V runs; 0: at the next item's start, each k-step just before
// its first S GEMMs (the twelfth session's order). On the H100 1-2% faster on whole prompts, the same
// on cached prefixes (docs/performance.md, "The next item's query split under the last P V").
#ifndef KVPAGER_PREFILL_WS_Q_AHEAD
#define KVPAGER_PREFILL_WS_Q_AHEAD 1
#endif
template <typename T, typename C>
constexpr bool ws_q_ahead = ws_raw_k<T, C> && KVPAGER_PREFILL_WS_Q_AHEAD != 0;
// KVPAGER_PREFILL_WS_FP8_NARROW=1 (default; with ws_q_ahead): an item's last tile over an fp8 cache
// computed over 64 or 128 positions, as far as the warpgroup's rows see (ws_last_groups), instead of
// whole; 0: whole, for A/B timing. On the H100 4% off 32 x 512 prompts over a split query, 2-3% off
// them splitting in the kernel, the same elsewhere (docs/performance.md, "A query split before the
// kernel").
#ifndef KVPAGER_PREFILL_WS_FP8_NARROW
#define KVPAGER_PREFILL_WS_FP8_NARROW 1
#endif
template <typename T, typename C>
constexpr bool ws_fp8_narrow = ws_q_ahead<T, C> && KVPAGER_PREFILL_WS_FP8_NARROW != 0;
constexpr int kWsBN = KVPAGER_PREFILL_WS_BN;
constexpr int kWsStages = KVPAGER_PREFILL_WS_STAGES;   // K and V stages (tiles of kWsBN positions)
constexpr int kWsRows = 128;     // query rows per work item: 2 consumer warpgroups x 64
constexpr int kWsThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kWsBarrierBytes = (8 * (4 * kWsStages + 2 * kWsQBufs) + 15) / 16 * 16;   // full/empty K, V and Q
constexpr int kWsRecordBytes = 32;   // one WsRecord per Q buffer
constexpr int kWsTicketBytes = 16;   // the producer's broadcast of a dynamic-schedule ticket

constexpr int kWsSmemLimit = 227 * 1024;   // the shared memory a Hopper block can have

// The shared memory of one block: Q tiles (16-bit), S K and V stages, 1 KB of alignment slack, the
// mbarriers, the item records and the ticket word. V stages are 16-bit (fp8 tiles are converted into
// them), K stages too, except over fp8 caches (ws_raw_k: rows of e4m3 values, 128 bytes whatever the
// head_dim, so that wgmma reads them in the 128-byte swizzle). S: kWsStages, or fewer where they
// would not fit (two Q buffers at head_dim 128: 2 stages).
template <typename T, typename C, int D>
struct WsLayout {
  static_assert(D <= 128, "a raw fp8 K row fits 128 bytes");
  static constexpr int kKStage = kWsBN * (ws_raw_k<T, C> ? 128 : 2 * D);   // bytes of a K stage
  static constexpr int kVStage = kWsBN * D * 2;
  // A split query's row factors (PrefillArgs::query_down), a float per row of each Q buffer, copied
  // by the producer with the Q tile (ws_q_ahead instances only).
  static constexpr int kDownBytes = ws_q_ahead<T, C> ? kWsQBufs * kWsRows * 4 : 0;
  static constexpr int bytes(int stages) {
    return kWsQBufs * kWsRows * D * 2 + stages * (kKStage + kVStage) + 1024 + kWsBarrierBytes +
           kWsQBufs * kWsRecordBytes + kWsTicketBytes + kDownBytes;
  }
  static constexpr int fit() {
    int s = kWsStages;
    while (s > 2 && bytes(s) > kWsSmemLimit) --s;
    return s;
  }
  static constexpr int S = fit();
  static constexpr int kSmemBytes = bytes(S);
};
static_assert(WsLayout<__half, __half, 128>::kSmemBytes <= kWsSmemLimit &&
                  WsLayout<__half, __half, 64>::kSmemBytes <= kWsSmemLimit,
              "the Q buffer and K/V stages fit the 227 KB of shared memory a Hopper block can have "
              "(a stage of K and V is 64 KB at head_dim 128)");

template <typename T, typename C, int D>
constexpr int prefill_ws_smem_bytes() {
  return WsLayout<T, C, D>::kSmemBytes;
}

namespace prefill_detail {
#if KVPAGER_PREFILL_WGMMA

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival on bar once every cp.async this thread issued before has landed (.noinc: the
// arrival is one of the barrier's expected count). (mbar_init, mbar_wait: mbarrier.cuh.)
__device__ __forceinline__ void mbar_arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  if (KVPAGER_PREFILL_WS_PINGPONG) asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  if (KVPAGER_PREFILL_WS_PINGPONG) asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_down() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_up() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Registers per thread after the hand-over: 128 x 56 + 256 x 224 = 384 x 168, the block's allocation
// (__launch_bounds__(384, 1)): consumers asking for more than the producer gives back wait forever.
constexpr int kWsProducerRegs = 56;
constexpr int kWsConsumerRegs = 224;
static_assert(128 * kWsProducerRegs + 256 * kWsConsumerRegs <= 384 * 168 && kWsProducerRegs % 8 == 0 &&
                  kWsConsumerRegs % 8 == 0,
              "setmaxnreg: the warpgroups' registers fit the block's allocation, in steps of 8");
constexpr int kWsTurnBar = 1;   // named barriers 1 and 2: consumer warpgroup 0's and 1's turn to issue
constexpr int kWsProducerBar = 3;   // named barrier 3: the producer warpgroup's 128 threads

__device__ __forceinline__ void producer_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"r"(kWsProducerBar), "r"(128) : "memory");
}

// What the producer tells the consumers of the item whose Q it loads into a buffer, written with
// that buffer's q_full phase (thread 0's own arrival, a release): the pair (-1: no more items)
// and the item's sequence and lengths, so that the consumers set up the item without global loads.
struct WsRecord {
  int pair;
  PrefillItem item;
  int pad[2];
};
static_assert(sizeof(WsRecord) == kWsRecordBytes, "a record fills its bytes");

// Shared-memory addresses of one block's tiles and barriers (WsLayout<T, C, D>).
template <typename T, typename C, int D>
struct WsSmem {
  using L = WsLayout<T, C, D>;
  static constexpr int BN = kWsBN, S = L::S;
  uint32_t q0, tiles, bars;
  unsigned char* tail;   // generic address of the records and the ticket word (after the barriers)
  __device__ __forceinline__ explicit WsSmem(unsigned char* smem_raw) {
    const uint32_t raw = smem_addr(smem_raw);
    q0 = (raw + 1023) & ~1023u;
    tiles = q0 + kWsQBufs * kWsRows * D * 2;
    bars = tiles + S * (L::kKStage + L::kVStage);
    tail = smem_raw + (bars - raw) + kWsBarrierBytes;
  }
  __device__ __forceinline__ WsRecord* record(int qb) const { return reinterpret_cast<WsRecord*>(tail) + qb; }
  __device__ __forceinline__ int* ticket() const { return reinterpret_cast<int*>(tail + kWsQBufs * kWsRecordBytes); }
  // Q buffer qb's row factors (L::kDownBytes): row r's at down(qb) + 4 r.
  __device__ __forceinline__ uint32_t down(int qb) const {
    return bars + kWsBarrierBytes + kWsQBufs * kWsRecordBytes + kWsTicketBytes + qb * kWsRows * 4;
  }
  __device__ __forceinline__ uint32_t q(int qb) const { return q0 + qb * kWsRows * D * 2; }
  __device__ __forceinline__ uint32_t k_tile(int st) const { return tiles + st * (L::kKStage + L::kVStage); }
  __device__ __forceinline__ uint32_t v_tile(int st) const { return k_tile(st) + L::kKStage; }
  __device__ __forceinline__ uint32_t full_k(int st) const { return bars + 8 * st; }
  __device__ __forceinline__ uint32_t full_v(int st) const { return bars + 8 * (S + st); }
  __device__ __forceinline__ uint32_t empty_k(int st) const { return bars + 8 * (2 * S + st); }
  __device__ __forceinline__ uint32_t empty_v(int st) const { return bars + 8 * (3 * S + st); }
  __device__ __forceinline__ uint32_t q_full(int qb) const { return bars + 8 * (4 * S + qb); }
  __device__ __forceinline__ uint32_t q_empty(int qb) const { return bars + 8 * (4 * S + kWsQBufs + qb); }
};
static_assert(8 * (4 * kWsStages + 2 * kWsQBufs) <= kWsBarrierBytes, "barriers fit their bytes");

// The next stage of a ring of N (K/V stages or Q buffers), and the phase parity of its barriers.
template <int N>
struct StageCursor {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == N) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The 16-bit type the tensor cores multiply in: the query's, except over fp8 caches, where it is
// fp16 whatever the query's type. e4m3 -> fp16 is one cvt per pair of values, e4m3 -> bf16 about
// four (through fp32), and the producer converts every cache value; both are exact. A bf16 query
// is converted once per item (ws_query_to_half, scaled into fp16's range), P is packed to fp16
// (3 more bits than bf16), and the output is written in the query's type.
template <typename T, typename C>
using WsMma = std::conditional_t<sizeof(C) == 1 && KVPAGER_PREFILL_WS_FP8_HALF != 0, __half, T>;
#endif  // KVPAGER_PREFILL_WGMMA
}  // namespace prefill_detail
}  // namespace kvpager
