// Paged prefill attention on Hopper, warp-specialized and persistent (sm_90a only; the wgmma
// building blocks, the loads from the pages and the softmax are paged_prefill.cuh's).
//
// Why: the two-warpgroup kernel of paged_prefill.cuh (every thread loads and computes, one block
// barrier per K/V tile) keeps both warpgroups in lockstep, so their softmaxes run at the same
// time while the tensor cores wait, and a block's first loads overlap nothing (1 block per SM).
//
// A block of three warpgroups (384 threads) loops over (work item, KV head) pairs, which its
// producer picks (ws_next_pair): by default the list in stripes of gridDim.x, alternately forwards
// and backwards (static: balanced for a list sorted heaviest first); with a counter
// (PrefillArgs::ws_counter) the next unclaimed pair whenever the block is ready for one (dynamic:
// balanced whatever the order, so the list can keep a sequence's items together and the pairs
// running at once share their K/V in the L2). The producer hands each pair to the consumers in a
// record beside its Q buffer (WsRecord: the item's sequence and lengths, read once by the producer).
// - warpgroup 0, the producer, loads each item's Q tile and its K/V tiles with cp.async, straight
//   from the pages through the block table, into kWsStages K and V stages, and signals each with
//   an mbarrier that fires when its copies land (cp.async.mbarrier.arrive); it gives its registers
//   to the consumers (setmaxnreg). Its loop is built once per block size (8..64), so that each
//   thread's rows fall in pages and slots known at compile time: one shuffle and one address per
//   page, then one cp.async per row (about 4 instructions each; computing page and slot per row
//   took about 25, a third of the SM's issue slots on a 4K prompt, taken from the consumers);
// - warpgroups 1 and 2, the consumers, take 64 of the item's 128 query rows each, and copy their
//   rows of Q into registers (the A operand of every S GEMM), which frees the Q buffer at once, so
//   the producer loads the next item's Q while this one runs. For tile j:
//   wait K_j; issue S_j = Q K_j^T; wait V_{j-1}; issue O += P_{j-1} V_{j-1}; softmax of S_j (meant
//   to run under that P V: ptxas orders most of it after, see the loop); release K_j and V_{j-1}
//   to the producer (mbarrier arrivals, one per warp). An item's last tile is computed only as far
//   as the warpgroup's rows see (ws_last_groups: N = 32, 64, 96 or 128; 16-bit caches).
//   Descriptors are built once per tile and stepped by constants; S_j's first k-step ignores
//   the accumulators' old contents (scale_d 0) instead of zeroing them.
//   The two warpgroups take turns issuing their GEMMs (named barriers 1 and 2, FA3's ping-pong):
//   a warpgroup passes the turn once its S_j is done, so the other's GEMMs queue on the tensor
//   cores behind its P_{j-1} V_{j-1}, and one's softmax runs under the other's GEMMs.
// The producer moves on to the next item's Q and tiles as soon as it has issued this item's, so
// the consumers find them landed when they finish the item (its last P V and its output rows).
// fp8 e4m3 caches (since 2026-11-26; before, the two-warpgroup kernel ran them at 1.7-1.9x the
// 16-bit cache's time): the producer loads V tiles' fp8 rows into its registers, converts them
// into the stage (exact: e4m3 fits fp16) and arrives on its full barrier (Fp8TileLoader); P V runs
// in fp16 whatever the query's type (WsMma; the per-tensor k_scale is in the softmax scale, v_scale
// in the output). K tiles: with bf16 queries (since 2026-11-27) copied as they are and multiplied
// in e4m3, each query row split into two e4m3 terms (ws_raw_k, WsQuerySplit); with fp16 queries
// converted like V, S in fp16.
//
// Barrier counts: full barriers get one asynchronous arrival per producer thread (128), q_full
// one more (thread 0's, releasing the record); empty K/V barriers one arrival per consumer warp
// (8), q_empty one per consumer thread (256: each thread read the record and its Q fragments).
#pragma once

#include <type_traits>

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
// With bf16 queries over fp8 caches, K tiles stay fp8 e4m3 in shared memory, as the cache holds them
// (copied by cp.async, rows padded to 128 bytes at head_dim 64), and S = Q K^T runs on the tensor
// cores in e4m3 (wgmma k32), each query split into two e4m3 terms, exactly (WsQuerySplit): the
// producer converts only V tiles. fp16 queries keep K converted to fp16: two e4m3 terms carry 8 of
// their 11 significant bits (their attention 1-3e-3 off float64, against 1e-6 for bf16's; a CPU
// emulation, 2026-11-27).
template <typename T, typename C>
constexpr bool ws_raw_k = sizeof(C) == 1 && std::is_same_v<T, __nv_bfloat16> && KVPAGER_PREFILL_WS_FP8_RAWK != 0;
// KVPAGER_PREFILL_WS_Q_AHEAD=1 (default; with ws_raw_k): a consumer warp loads and splits the next
// item's query while its item's last P V runs; 0: at the next item's start, each k-step just before
// its first S GEMMs (the twelfth session's order). On the H100 1-2% faster on whole prompts, the same
// on cached prefixes (docs/performance.md, "The next item's query split under the last P V").
#ifndef KVPAGER_PREFILL_WS_Q_AHEAD
#define KVPAGER_PREFILL_WS_Q_AHEAD 1
#endif
template <typename T, typename C>
constexpr bool ws_q_ahead = ws_raw_k<T, C> && KVPAGER_PREFILL_WS_Q_AHEAD != 0;
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
  static constexpr int bytes(int stages) {
    return kWsQBufs * kWsRows * D * 2 + stages * (kKStage + kVStage) + 1024 + kWsBarrierBytes +
           kWsQBufs * kWsRecordBytes + kWsTicketBytes;
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

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival on bar once every cp.async this thread issued before has landed (.noinc: the
// arrival is one of the barrier's expected count).
__device__ __forceinline__ void mbar_arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
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

// A warp's bf16 query fragments (the A operands of its S GEMMs) -> fp16, times 2^f with f putting
// the warp's largest |q| in [2^14, 2^15): under fp16's largest value, and every q within 2^28 of
// it exact (bf16 has 8 significant bits, fp16 11); smaller ones add under 2^-28 of the largest
// term to a score. Returns 2^-f, the factor the warp's scores are to be scaled back by (folded
// into the softmax scale). Every lane of the warp must call it; once per item.
template <int KS>
__device__ __forceinline__ float ws_query_to_half(uint32_t (&qa)[KS][4]) {
  float mx = 0.f;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      mx = fmaxf(mx, fmaxf(fabsf(__uint_as_float(qa[kk][e] << 16)), fabsf(__uint_as_float(qa[kk][e] & 0xffff0000u))));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const int e = mx > 0.f ? static_cast<int>((__float_as_uint(mx) >> 23) & 0xff) - 127 : 0;   // floor(log2 mx)
  const int f = min(max(14 - e, -126), 126);
  const float up = __uint_as_float(static_cast<uint32_t>(127 + f) << 23);
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int e2 = 0; e2 < 4; ++e2) {
      const uint32_t w = qa[kk][e2];
      const __half2 h = __floats2half2_rn(__uint_as_float(w << 16) * up, __uint_as_float(w & 0xffff0000u) * up);
      qa[kk][e2] = *reinterpret_cast<const uint32_t*>(&h);
    }
  return __uint_as_float(static_cast<uint32_t>(127 - f) << 23);
}

// bf16 queries over fp8 caches (ws_raw_k): the query as the A operands of e4m3 S GEMMs (wgmma k32).
// Each q is split into two e4m3 terms, hi = e4m3(q 2^f) and lo = e4m3(q 2^f - hi): hi + lo carries
// 8 significant bits, all of a bf16 value's (where lo is not below e4m3's normal range). f, one a
// row, puts the row's largest |q| in [2^7, 2^8) (e4m3 reaches 448); q under 2^-5 of it lose bits
// below 2^-17 of the largest (e4m3's subnormal step).
// A consumer warp splits its own 16 rows: load (the 16-bit values, in place in the fragment
// registers, and each row's f: one pass over the tile, a quad's 2 shuffles, as a row's values are
// its quad's), then split_step per k-step. By default (ws_q_ahead) the whole query is split under
// the previous item's last P V; with KVPAGER_PREFILL_WS_Q_AHEAD=0 as the item starts, each k-step
// between the item's first S GEMMs (issue_s_e4m3). (Split before the first GEMM it held up both
// warpgroups' GEMMs; split by the producer it slowed the producer more: docs/performance.md,
// "fp8 prefill: K as e4m3".)
// Fragment layout: qa[kk] and qa[D / 32 + kk] are k-step kk's hi and lo terms; each register holds 4
// consecutive columns of a row (the 8-bit A layout: lane g, t4 holds row g's and row g + 8's columns
// 4 t4 .. 4 t4 + 3 and 16 more). Before the split they hold the same 4 values in 16 bits, the first
// two in qa[kk], the last two in qa[D / 32 + kk].
template <typename T, int D>
struct WsQuerySplit {
  static_assert(std::is_same_v<T, __nv_bfloat16>, "two e4m3 terms hold a bf16 query exactly, not an fp16 one");
  static constexpr int KS = D / 32;   // k-steps of 32 columns

  // This warp's rows of the 16-bit Q tile at q_tile (tile_off layout) into qa, unsplit; returns 2^f
  // of rows g and g + 8 (`up`) and sets `down` to 2^-f, the factors their scores are to be scaled
  // back by (folded into the softmax scale).
  static __device__ __forceinline__ float2 load(uint32_t (&qa)[D / 16][4], uint32_t q_tile, int warp, int lane,
                                                float2& down) {
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = warp * 16 + g + (e & 1) * 8, col = kk * 32 + (e >> 1) * 16 + 4 * t4;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                     : "=r"(qa[kk][e]), "=r"(qa[KS + kk][e])
                     : "r"(q_tile + 2 * tile_off<kWsRows>(row, col >> 3) + 2 * (col & 7)));
      }
    // Each row's largest |q|: the bit patterns of non-negative bf16 values order as their values do,
    // so 16-bit unsigned maxima of |q|'s patterns (row g's, then g + 8's in the high half), then
    // their exponents.
    uint32_t m[2] = {0u, 0u};
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        m[e & 1] = __vmaxu2(m[e & 1], __vmaxu2(qa[kk][e] & 0x7fff7fffu, qa[KS + kk][e] & 0x7fff7fffu));
    uint32_t mab = max(m[0] & 0xffffu, m[0] >> 16) | (max(m[1] & 0xffffu, m[1] >> 16) << 16);
    mab = __vmaxu2(mab, __shfl_xor_sync(0xffffffffu, mab, 1));
    mab = __vmaxu2(mab, __shfl_xor_sync(0xffffffffu, mab, 2));
    float up[2], dn[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t mx = (mab >> (16 * r)) & 0xffffu;
      const int ex = mx == 0 ? 0 : static_cast<int>(mx >> 7) - 127;   // floor(log2) of the row's largest |q|
      const int f = min(max(7 - ex, -126), 126);
      up[r] = __uint_as_float(static_cast<uint32_t>(127 + f) << 23);
      dn[r] = __uint_as_float(static_cast<uint32_t>(127 - f) << 23);
    }
    down = make_float2(dn[0], dn[1]);
    return make_float2(up[0], up[1]);
  }

  // k-step kk of qa split in place (load's layout -> the fragments').
  static __device__ __forceinline__ void split_step(uint32_t (&qa)[D / 16][4], int kk, float2 up) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float u = (e & 1) ? up.y : up.x;
      uint32_t h01, h23, l01, l23;
      split_pair(qa[kk][e], u, h01, l01);
      split_pair(qa[KS + kk][e], u, h23, l23);
      qa[kk][e] = h01 | (h23 << 16);
      qa[KS + kk][e] = l01 | (l23 << 16);
    }
  }

  // A word's two bf16 values (the low one first) times `up` (2^f) as fp16 (exact: 8 significant bits
  // fit, the largest under 2^8; what falls under fp16's normal range is far below e4m3's subnormal
  // step), then the two e4m3 terms of each: hi rounded, lo = e4m3(value - hi) (the difference exact
  // in fp16). hi and lo: two bytes each, the low value's first.
  static __device__ __forceinline__ void split_pair(uint32_t v, float up, uint32_t& hi, uint32_t& lo) {
    const float a = __uint_as_float(v << 16), b = __uint_as_float(v & 0xffff0000u);
    const __half2 q = __floats2half2_rn(a * up, b * up);
    const __nv_fp8x2_storage_t q8 = __nv_cvt_halfraw2_to_fp8x2(static_cast<__half2_raw>(q), __NV_SATFINITE, __NV_E4M3);
    const uint32_t back = fp8x2_to_h2(q8);   // hi as fp16 (exact)
    hi = q8;
    lo = __nv_cvt_halfraw2_to_fp8x2(static_cast<__half2_raw>(__hsub2(q, *reinterpret_cast<const __half2*>(&back))),
                                    __NV_SATFINITE, __NV_E4M3);
  }
};

// An item as the warp-specialized kernel runs it: 128 query rows, K/V tiles of kWsBN positions
// copied by the 128 producer threads (C: the cache's element type).
template <typename T, typename C, int D>
using WsBlock = PrefillBlock<T, C, D, kWsRows, kWsBN, 128>;
static_assert(WsBlock<__half, __half, 128>::ROW_STEP % 8 == 0 && WsBlock<__half, __half, 64>::ROW_STEP % 8 == 0 &&
                  WsBlock<__half, __nv_fp8_e4m3, 128>::ROW_STEP % 8 == 0 &&
                  WsBlock<__half, __nv_fp8_e4m3, 64>::ROW_STEP % 8 == 0,
              "RowCopier: every row of a thread has the same swizzle");

// The (work item, KV head) pair the producer loads next, in its round m; num_pairs when there
// are none left, -1 for none this round (the static schedule's last stripe). Static schedule
// (no counter): rounds run over the list in stripes of gridDim.x pairs, alternately forwards and
// backwards, so that with the list sorted heaviest first every block's sum of work comes out
// about the same. Dynamic (a.ws_counter): the next ticket, taken by thread 0 and read by the
// warpgroup through shared memory.
__device__ __forceinline__ int ws_next_pair(const PrefillArgs& a, int m, int num_pairs, int* ticket) {
  if (a.ws_counter == nullptr) {
    if (m * static_cast<int>(gridDim.x) >= num_pairs) return num_pairs;
    const int in_stripe = (m & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int pair = m * gridDim.x + in_stripe;
    return pair < num_pairs ? pair : -1;
  }
  producer_sync();   // every producer thread has read the previous ticket
  if (threadIdx.x == 0) *ticket = atomicAdd(a.ws_counter, 1);
  producer_sync();
  return *ticket;
}

// Once a block's producer has taken its last ticket: the last block to get here leaves the
// counter zero for the next launch (every block has taken all its tickets by then).
__device__ __forceinline__ void ws_release_counter(int32_t* counter) {
  __threadfence();
  if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    atomicExch(counter, 0);
    atomicExch(counter + 1, 0);
  }
}

// The block ids of the pages of the K/V tile at positions [kv0, kv0 + BN), one per lane: lane l
// holds page kv0 / block_size + l's id, or -1 where that page starts at or past kv_end or the id
// is not a valid block (BN / block_size <= 16 pages: block_size >= 8). One table read per lane,
// issued a tile ahead of its use, instead of one per row on the copy path.
template <typename Blk>
__device__ __forceinline__ int tile_pages(const Blk& blk, int kv0) {
  const int lane = threadIdx.x & 31, lg = blk.a.log2_block_size;
  int b = -1;
  if (lane < (Blk::BN >> lg) && kv0 + (lane << lg) < blk.kv_end) {
    b = __ldg(blk.table + (kv0 >> lg) + lane);
    if (b < 0 || b >= blk.a.num_cache_blocks) b = -1;
  }
  return b;
}

// threadIdx.x, read where it is used: what is computed from it then stays in the loop instead of
// being hoisted out and held in a register across the producer's loops (over fp8 caches they have
// none to spare: ptxas spilled).
__device__ __forceinline__ int thread_index_here() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}
// v, as a value computed where it is used, for the same reason.
__device__ __forceinline__ int opaque(int v) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(v));
  return v;
}

// The row (0 .. ROW_STEP - 1) and 16-byte chunk of a tile's fp8 rows that producer thread t loads
// and converts. At head_dim 128 the halves of each 8-lane group take adjacent rows (lanes 0-3:
// row 2r, chunks 0-3; lanes 4-7: row 2r + 1, chunks 4-7; the next 8 lanes the other way round),
// so that the 16-bit chunks an 8-lane phase stores fall in 8 distinct bank groups of the swizzled
// stage; row-major, lanes 0-7 would store chunks 0, 2, 4, 6 of both 64-column panels, a 2-way
// bank conflict. At head_dim 64 (4 lanes a row, two rows a phase) row-major has none.
template <int D>
__device__ __forceinline__ int2 fp8_row_chunk(int t) {
  constexpr int CCPR = D / 16;
  if constexpr (CCPR == 8)
    return make_int2(2 * (t >> 4) + (((t >> 3) ^ (t >> 2)) & 1), t & 7);
  else
    return make_int2(t / CCPR, t % CCPR);
}

// What a producer thread needs to read its rows of any K/V tile of an item, computed once per
// item: its rows are my_row + i * ROW_STEP (i < RPT), its 16-byte chunk of each (fp8 caches:
// fp8_row_chunk's). A 16-bit cache's rows are copied into a stage (copy): as ROW_STEP is a
// multiple of 8, the swizzled chunk position is the same in every row, so the destination of row
// i is dst + i * ROW_STEP * 128 bytes. An fp8 cache's rows are loaded into registers and converted
// into the stage by Fp8TileLoader (visit).
template <typename C, int D>
struct RowCopier {
  static constexpr bool kFp8 = sizeof(C) == 1;
  const C* k;       // the item's KV head in the K cache, at this thread's chunk
  const C* v;
  uint32_t dst;     // 16-bit caches: this thread's chunk of row my_row, from a stage's start (bytes)
  int stride;       // elements between consecutive blocks (checked < 2^31 by the launcher)
  int my_row, kv_end;

  template <typename Blk>
  __device__ __forceinline__ explicit RowCopier(const Blk& blk)
      : RowCopier(blk, kFp8 ? fp8_row_chunk<D>(blk.loader) : make_int2(blk.my_row, blk.my_ch)) {}

  // rc: this thread's (row, chunk).
  template <typename Blk>
  __device__ __forceinline__ RowCopier(const Blk& blk, int2 rc)
      : k(blk.kbase + rc.y * (16 / static_cast<int>(sizeof(C)))),
        v(blk.vbase + rc.y * (16 / static_cast<int>(sizeof(C)))),
        dst(2 * tile_off<Blk::BN>(rc.x, rc.y)),
        stride(static_cast<int>(blk.a.kv_stride_block)), my_row(rc.x), kv_end(blk.kv_end) {}

  // Calls emit(i, src, valid) for each of this thread's rows i (< RPT) of the tile at positions
  // [kv0, kv0 + BN) of `base` (k or v): src, the row's chunk in the cache; valid false for rows at
  // or past kv_end or in an invalid block (never to be read). Block ids come from `pages`
  // (tile_pages) by warp shuffles, one per page this thread touches (not one per row). LG: log2 of
  // the block size, so that which page and slot each row falls in is known at compile time; WHOLE:
  // every row of the tile is before kv_end.
  template <int BN, int RPT, int ROW_STEP, int LG, bool WHOLE, typename Emit>
  __device__ __forceinline__ void visit_rows(const C* base, int kv0, int pages, Emit&& emit) const {
    constexpr int BS = 1 << LG;
    const int row_pos = kv0 + my_row;   // the position of this thread's row i is row_pos + i * ROW_STEP
    if constexpr (ROW_STEP <= BS) {
      // A page holds SUBS of this thread's rows: my_row + ROW_STEP * (p * SUBS + s) is slot
      // my_row + ROW_STEP * s of the tile's page p.
      constexpr int SUBS = BS / ROW_STEP, NPG = RPT / SUBS;
      static_assert(RPT % SUBS == 0, "a tile holds whole pages");
#pragma unroll
      for (int p = 0; p < NPG; ++p) {
        const int b = __shfl_sync(0xffffffffu, pages, p);
        const C* src = base + static_cast<int64_t>(b >= 0 ? b : 0) * stride + my_row * D;
#pragma unroll
        for (int sub = 0; sub < SUBS; ++sub) {
          const int i = p * SUBS + sub;
          emit(i, src + sub * ROW_STEP * D, b >= 0 && (WHOLE || row_pos + i * ROW_STEP < kv_end));
        }
      }
    } else {
      // Each of this thread's rows is in a page of its own: page (my_row >> LG) + i * (ROW_STEP >> LG).
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const int b = __shfl_sync(0xffffffffu, pages, (my_row >> LG) + i * (ROW_STEP >> LG));
        const C* src = base + static_cast<int64_t>(b >= 0 ? b : 0) * stride + (my_row & (BS - 1)) * D;
        emit(i, src, b >= 0 && (WHOLE || row_pos + i * ROW_STEP < kv_end));
      }
    }
  }

  template <int BN, int RPT, int ROW_STEP, int LG, typename Emit>
  __device__ __forceinline__ void visit(const C* base, int kv0, int pages, Emit&& emit) const {
    if (kv0 + BN <= kv_end)
      visit_rows<BN, RPT, ROW_STEP, LG, true>(base, kv0, pages, emit);
    else
      visit_rows<BN, RPT, ROW_STEP, LG, false>(base, kv0, pages, emit);
  }

  // This thread's rows of the tile into the stage at `tile`, by cp.async; rows not valid are
  // zero-filled.
  template <int BN, int RPT, int ROW_STEP, int LG>
  __device__ __forceinline__ void copy(uint32_t tile, const C* base, int kv0, int pages) const {
    static_assert(!kFp8, "fp8 rows are converted on their way (Fp8TileLoader)");
    visit<BN, RPT, ROW_STEP, LG>(base, kv0, pages, [&](int i, const C* src, bool valid) {
      cp_async16(tile + dst + i * ROW_STEP * 128, src, valid);
    });
  }
};

// fp8 caches, a producer thread's side: each half tile (K, then V; V only where K stays e4m3,
// ws_raw_k, its rows then copied as they are by cp.async) loaded from the pages into its
// registers (RPT 16-byte loads: its chunk of rows my_row + i * ROW_STEP, fp8_row_chunk), then, once
// the stage is free, converted into it (e4m3 -> fp16 exactly, one cvt a pair: WsMma), the stage's
// full barrier getting a plain arrival per thread after a proxy fence (the stores are read by the
// tensor cores' async proxy). A thread converts only its own loads: no barrier among producers.
// The producer's instructions are what the fp8 cache's time above the 16-bit one follows, not the
// latency it waits out (H200, 2026-11-26, tenth session; docs/performance.md, "fp8 prefill: fp16
// math and rows through the producer's registers"): against copying the rows as they are into raw
// tiles in shared memory (cp.async, a tile ahead) and converting from there, this took 3-5% less
// time; the whole-tile path below (no zeroing or predicates a row) and the second chunk's stores at
// immediate offsets 2-4% less again; no shift before each high pair's cvt (fp8x16_to) 3-5% less
// again. Slower, not kept: e4m3 -> fp16 by integer ops (4 a pair, no cvt) 25% more; the loads a
// quarter tile ahead of the conversions (two buffers of 4 rows) 4-8% more.
template <typename T, int D>
struct Fp8TileLoader {
  static constexpr int CCPR = D / 16, ROW_STEP = 128 / CCPR, RPT = kWsBN / ROW_STEP;
  // This thread's 16-bit chunks 2c and 2c + 1 of row my_row in a stage (its fp8 chunk c, as
  // RowCopier reads): at lo and lo ^ 16 bytes (the same 128-byte row of the same panel, swizzled by
  // the same row bits). Computed where used (thread_index_here).
  static __device__ __forceinline__ uint32_t lo() {
    const int2 rc = fp8_row_chunk<D>(thread_index_here());
    return 2 * tile_off<kWsBN>(rc.x, 2 * rc.y);
  }

  // The item's tile at kv0 (block ids `pages`, tile_pages) into the stage at cur, which advances.
  // head_off: this thread's chunk of its KV head in a block (elements, < kv_stride_block < 2^31),
  // from the caches' base pointers (kernel parameters) where rows.k and rows.v would hold 64-bit
  // pointers: registers the producer does not have to spare (ptxas spilled).
  template <int LG, typename C, typename Blk, typename Q, typename Cursor>
  static __device__ __forceinline__ void load(const WsSmem<Q, C, D>& sm, const PrefillArgs& a, const RowCopier<C, D>& rows,
                                              uint32_t head_off, int kv0, int pages, Cursor& cur) {
    static_assert(Blk::RPT == RPT && Blk::ROW_STEP == ROW_STEP, "Fp8TileLoader and RowCopier split a tile alike");
    // Every row of the tile before kv_end and every page id valid (the usual case): rows loaded
    // without zeroing and predicates (3 instructions a row fewer).
    const int lane = threadIdx.x & 31;
    const bool whole = kv0 + kWsBN <= rows.kv_end &&
                       __all_sync(0xffffffffu, lane >= (kWsBN >> LG) || pages >= 0);
    const C* k_base = static_cast<const C*>(a.k_cache) + head_off;
    const C* v_base = static_cast<const C*>(a.v_cache) + head_off;
    uint4 u[RPT];
    if constexpr (ws_raw_k<Q, C>) {
      // K's rows copied as they are (cp.async, the full barrier's arrival when they land), then V's
      // into registers, to be converted into its stage.
      mbar_wait(sm.empty_k(cur.stage), cur.phase ^ 1);
      copy_raw<LG>(rows, k_base, kv0, pages, whole, sm.k_tile(cur.stage));
      mbar_arrive_on_copies(sm.full_k(cur.stage));
      read_rows<LG>(rows, v_base, kv0, pages, whole, u);
    } else {
      read_rows<LG>(rows, k_base, kv0, pages, whole, u);
      convert_rows<LG>(u, sm.k_tile(cur.stage), sm.empty_k(cur.stage), sm.full_k(cur.stage), cur.phase);
      read_rows<LG>(rows, v_base, kv0, pages, whole, u);
    }
    convert_rows<LG>(u, sm.v_tile(cur.stage), sm.empty_v(cur.stage), sm.full_v(cur.stage), cur.phase);
    cur.advance();
  }

  // This thread's fp8 rows of a half tile (K or V, from `base`) into u; rows not valid are zeros.
  template <int LG, typename C>
  static __device__ __forceinline__ void read_rows(const RowCopier<C, D>& rows, const C* base, int kv0, int pages,
                                                   bool whole, uint4 (&u)[RPT]) {
    // (Block size 8: at head_dim 128 a row a page, whose lane indices the two paths hold apart:
    // ptxas spilled. It takes the general path.)
    if (LG > 3 && whole) {
      rows.template visit_rows<kWsBN, RPT, ROW_STEP, LG, true>(
          base, kv0, pages, [&](int i, const C* src, bool) { u[i] = __ldg(reinterpret_cast<const uint4*>(src)); });
    } else {
      rows.template visit<kWsBN, RPT, ROW_STEP, LG>(base, kv0, pages, [&](int i, const C* src, bool valid) {
        u[i] = make_uint4(0u, 0u, 0u, 0u);   // rows not valid stay zeros
        if (valid) u[i] = __ldg(reinterpret_cast<const uint4*>(src));
      });
    }
  }

  // This thread's fp8 K rows into the raw K stage at `tile` by cp.async (ws_raw_k): its 16 bytes of
  // each 128-byte row land where a 16-bit row's chunk of the same index would (tile_off); rows not
  // valid are zero-filled.
  template <int LG, typename C>
  static __device__ __forceinline__ void copy_raw(const RowCopier<C, D>& rows, const C* base, int kv0, int pages,
                                                  bool whole, uint32_t tile) {
    const int2 rc = fp8_row_chunk<D>(thread_index_here());
    const uint32_t dst = tile + 2 * tile_off<kWsBN>(rc.x, rc.y);
    if (whole) {
      rows.template visit_rows<kWsBN, RPT, ROW_STEP, LG, true>(
          base, kv0, pages, [&](int i, const C* src, bool) { cp_async16(dst + i * ROW_STEP * 128, src, true); });
    } else {
      rows.template visit<kWsBN, RPT, ROW_STEP, LG>(base, kv0, pages, [&](int i, const C* src, bool valid) {
        cp_async16(dst + i * ROW_STEP * 128, src, valid);
      });
    }
  }

  // u (this thread's rows, read_rows) converted into the stage at `tile` once it is free (`empty`),
  // then one arrival on `full`.
  template <int LG>
  static __device__ __forceinline__ void convert_rows(const uint4 (&u)[RPT], uint32_t tile, uint32_t empty,
                                                      uint32_t full, uint32_t phase) {
    mbar_wait(empty, phase ^ 1);
    const uint32_t lo = tile + Fp8TileLoader::lo(), hi = lo ^ 16u;   // hi: plus an immediate offset a row
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      uint4 a, b;
      fp8x16_to<T, (LG > 3)>(u[i], a, b);   // (block size 8: the upper halves' form made ptxas spill)
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(lo + i * ROW_STEP * 128), "r"(a.x), "r"(a.y),
                   "r"(a.z), "r"(a.w)
                   : "memory");
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(hi + i * ROW_STEP * 128), "r"(b.x), "r"(b.y),
                   "r"(b.z), "r"(b.w)
                   : "memory");
    }
    fence_proxy_async();
    mbar_arrive(full);
  }
};

template <typename T, typename C, int D, int LG>
__device__ __forceinline__ void ws_produce_lg(const PrefillArgs& a, unsigned char* smem_raw, int num_pairs) {
  using Blk = WsBlock<T, C, D>;
  const WsSmem<T, C, D> sm(smem_raw);
  StageCursor<WsSmem<T, C, D>::S> cur;
  StageCursor<kWsQBufs> qcur;
  using Fp8 = Fp8TileLoader<WsMma<T, C>, D>;   // fp8 caches only
  for (int m = 0;; ++m) {
    const int pair = ws_next_pair(a, m, num_pairs, sm.ticket());
    if (pair >= num_pairs) break;
    if (pair < 0) continue;
    const PrefillItem item = load_item(a, pair / a.num_kv_heads);
    Blk blk(a, smem_raw, item, pair % a.num_kv_heads, threadIdx.x);
    if (!blk.live) continue;   // the consumers never hear of it
    int pages = tile_pages(blk, 0);   // the first tile's block ids: loads issued before the wait
    // Every consumer has its Q fragments of the item that used this buffer before.
    mbar_wait(sm.q_empty(qcur.stage), qcur.phase ^ 1);
    if (threadIdx.x == 0) {
      WsRecord* rec = sm.record(qcur.stage);
      rec->pair = pair;
      rec->item = item;
    }
    // Q's rows and chunks are those of a 16-bit row (an fp8 cache's rows have half the chunks).
    if constexpr (RowCopier<C, D>::kFp8) {
      const int t = thread_index_here();
      load_q_rows<T, D, kWsRows, 128>(blk, sm.q(qcur.stage), t / (D / 8), t % (D / 8));
    } else {
      load_q_rows<T, D, kWsRows, 128>(blk, sm.q(qcur.stage), blk.my_row, blk.my_ch);
    }
    mbar_arrive_on_copies(sm.q_full(qcur.stage));
    if (threadIdx.x == 0) mbar_arrive(sm.q_full(qcur.stage));   // releases the record
    qcur.advance();
    const RowCopier<C, D> rows(blk);
    uint32_t head_off = 0;   // fp8 caches (Fp8TileLoader::load)
    if constexpr (RowCopier<C, D>::kFp8)
      head_off = static_cast<uint32_t>(blk.kvh * a.kv_stride_head) + 16 * fp8_row_chunk<D>(thread_index_here()).y;
    for (int j = 0; j < blk.n_tiles; ++j) {
      const int kv0 = j * Blk::BN;
      int next_pages;   // lands during this tile
      if constexpr (RowCopier<C, D>::kFp8) {
        // The table row's pointer made where used (opaque): held across the loop, ptxas spilled it.
        Blk at = blk;
        at.table = a.block_tables + static_cast<int64_t>(opaque(item.seq)) * a.table_stride;
        next_pages = j + 1 < blk.n_tiles ? tile_pages(at, kv0 + Blk::BN) : -1;
        Fp8::template load<LG, C, Blk>(sm, a, rows, head_off, kv0, pages, cur);
      } else {
        next_pages = j + 1 < blk.n_tiles ? tile_pages(blk, kv0 + Blk::BN) : -1;
        mbar_wait(sm.empty_k(cur.stage), cur.phase ^ 1);
        rows.template copy<Blk::BN, Blk::RPT, Blk::ROW_STEP, LG>(sm.k_tile(cur.stage), rows.k, kv0, pages);
        mbar_arrive_on_copies(sm.full_k(cur.stage));
        mbar_wait(sm.empty_v(cur.stage), cur.phase ^ 1);
        rows.template copy<Blk::BN, Blk::RPT, Blk::ROW_STEP, LG>(sm.v_tile(cur.stage), rows.v, kv0, pages);
        mbar_arrive_on_copies(sm.full_v(cur.stage));
        cur.advance();
      }
      pages = next_pages;
    }
  }
  // The consumers' last record: no item.
  mbar_wait(sm.q_empty(qcur.stage), qcur.phase ^ 1);
  if (threadIdx.x == 0) sm.record(qcur.stage)->pair = -1;
  mbar_arrive(sm.q_full(qcur.stage));
  if (threadIdx.x == 0) {
    mbar_arrive(sm.q_full(qcur.stage));
    if (a.ws_counter != nullptr) ws_release_counter(a.ws_counter);
  }
  cp_async_wait_all();   // nothing in flight into shared memory when this warpgroup exits
}

// Block sizes 8..64 (the launcher checks): page and slot of every copied row known at compile time.
template <typename T, typename C, int D>
__device__ __forceinline__ void ws_produce(const PrefillArgs& a, unsigned char* smem_raw, int num_pairs) {
  switch (a.log2_block_size) {
    case 3: ws_produce_lg<T, C, D, 3>(a, smem_raw, num_pairs); break;
    case 4: ws_produce_lg<T, C, D, 4>(a, smem_raw, num_pairs); break;
    case 5: ws_produce_lg<T, C, D, 5>(a, smem_raw, num_pairs); break;
    default: ws_produce_lg<T, C, D, 6>(a, smem_raw, num_pairs); break;
  }
}

// O += P V over the first NB * 8 positions of the V tile at v_tile (N-major; NB / 2 k-steps of 16
// V rows), issued (not waited for).
template <typename T, int D, int BN, int NB = BN / 8>
__device__ __forceinline__ void issue_pv(float (&o)[D / 8][4], const uint32_t (&pa)[BN / 16][4], uint32_t v_tile) {
  const uint64_t v_desc = gmma_desc(v_tile, BN * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < NB / 2; ++kk) wgmma_rs(Tag<T>{}, o, pa[kk], v_desc + kk * (2048 >> 4));
}

// S = Q K^T over the tile's first NB * 8 key positions (the first NB column groups of s), issued.
template <typename T, int D, int BN, int NB>
__device__ __forceinline__ void issue_s(float (&s)[BN / 8][4], const uint32_t (&qa)[D / 16][4], uint32_t k_tile) {
  // The descriptors of a tile's k-steps are its first one's plus a constant (addresses stay
  // inside the descriptor's 18-bit field).
  const uint64_t k_desc = gmma_desc(k_tile, 16, 1024);
  auto& sn = reinterpret_cast<float (&)[NB][4]>(s);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t dk = (kk >> 2) * (BN * 128) + (kk & 3) * 32;
    wgmma_rs<0>(Tag<T>{}, sn, qa[kk], k_desc + (dk >> 4), kk == 0 ? 0 : 1);
  }
}

// S = Q K^T over a raw fp8 K tile (ws_raw_k), issued: per k-step of 32 columns, the query's two
// e4m3 terms (WsQuerySplit) against the same K columns. At twice fp16's rate on the tensor cores,
// the two GEMMs take the time of one fp16 GEMM over the converted tile. The whole tile (fp8 caches
// keep whole last tiles, ws_last_groups). split (KVPAGER_PREFILL_WS_Q_AHEAD=0): the item's first
// tile, whose query is still unsplit (WsQuerySplit::load): each k-step is split just before its
// GEMMs are issued, under the previous k-step's.
template <typename T, int D, int BN>
__device__ __forceinline__ void issue_s_e4m3(float (&s)[BN / 8][4], uint32_t (&qa)[D / 16][4], uint32_t k_tile,
                                             bool split, float2 up) {
  static_assert(BN == 128, "the e4m3 S GEMM is written for tiles of 128 positions");
  const uint64_t k_desc = gmma_desc(k_tile, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < D / 32; ++kk) {
    if (split) WsQuerySplit<T, D>::split_step(qa, kk, up);
    fence_regs(qa);
    wgmma_fence();
    wgmma_rs_e4m3(s, qa[kk], k_desc + ((kk * 32) >> 4), kk == 0 ? 0 : 1);
    wgmma_rs_e4m3(s, qa[D / 32 + kk], k_desc + ((kk * 32) >> 4));
  }
}

// KVPAGER_PREFILL_WS_NARROW=0: an item's last tile is computed whole (as before 2026-11-26,
// eleventh session), for A/B timing.
#ifndef KVPAGER_PREFILL_WS_NARROW
#define KVPAGER_PREFILL_WS_NARROW 1
#endif

// The column groups (of 8 positions) of an item's last K/V tile that a consumer warpgroup computes:
// its rows see positions up to `last_visible` (its last row's), so columns past it are all masked.
// Rounded up to 32 positions (N = 32, 64, 96 or 128 for the GEMMs): an item of 32 query positions
// (128 rows at G = 4) ends a quarter, half, three quarters or all the way into its last tile, so
// on whole prompts its S GEMM, P V and softmax there do 5/8 of the work on average. 16-bit caches
// only: over fp8, every arrangement tried left ptxas short of registers (the wgmmas serialized,
// C7511, or the producer spilled), and the producer, not the consumers, sets fp8's pace.
template <typename C>
__device__ __forceinline__ int ws_last_groups(int last_visible, int last_kv0) {
  if (KVPAGER_PREFILL_WS_NARROW == 0 || sizeof(C) == 1) return kWsBN / 8;
  const int cols = (last_visible + 1 - last_kv0 + 31) & ~31;
  return min(max(cols, 32), kWsBN) / 8;
}

// f(std::integral_constant<int, NB>) for the NB column groups a tile's GEMMs and softmax cover:
// the whole tile, or 4, 8 or 12 groups (ws_last_groups<C>). Warp-uniform. Over fp8 caches only
// the whole tile is compiled.
template <typename C, typename F>
__device__ __forceinline__ void ws_with_groups(int nb, F&& f) {
  static_assert(kWsBN == 128, "narrowed tiles are written for tiles of 128 positions");
  if constexpr (sizeof(C) == 1) {
    f(std::integral_constant<int, kWsBN / 8>{});
    return;
  }
  switch (nb) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 12: f(std::integral_constant<int, 12>{}); break;
    default: f(std::integral_constant<int, 16>{}); break;
  }
}

// Warpgroups 1 and 2: 64 rows each of every item, GEMMs issued in turns.
template <typename T, typename C, int D>
__device__ __forceinline__ void ws_consume(const PrefillArgs& a, unsigned char* smem_raw) {
  using Blk = WsBlock<T, C, D>;
  using MT = WsMma<T, C>;   // the tensor cores' type (P is packed to it)
  using Softmax = RowSoftmax<MT, D, kWsBN>;
  constexpr int BM = kWsRows, BN = kWsBN;
  const WsSmem<T, C, D> sm(smem_raw);
  const int wg = (threadIdx.x >> 7) - 1;      // 0 or 1
  const int warp = (threadIdx.x >> 5) - 4;    // the item's warp of 16 rows: 0..7
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const bool signals = lane == 0;             // one arrival per warp on the empty barriers
  const int my_turn = kWsTurnBar + wg, their_turn = kWsTurnBar + 1 - wg;
  StageCursor<WsSmem<T, C, D>::S> cur;
  StageCursor<kWsQBufs> qcur;
  if (wg == 1) named_arrive(kWsTurnBar, 256);   // warpgroup 0 issues first
  float o[D / 8][4];
  StageCursor<WsSmem<T, C, D>::S> prev;   // V_{j-1}'s stage

  // ws_q_ahead: the next item's record, and its query loaded and split whole (the S GEMMs' A fragments,
  // the scales of its scores), fetched before the first item and then under each item's last P V
  // (whose GEMM reads neither; the last S GEMM, which read qa, is done). The producer has that Q
  // buffer filled by then: it loads an item's Q once it has issued the item before's last tile.
  constexpr bool kAhead = ws_q_ahead<T, C>;
  uint32_t qa[D / 16][4];
  float2 q_up;   // fp8 caches: the query's scales, for its split
  float2 sl2;    // the softmax scale (log2 domain) of this thread's rows' raw scores (rows g and g + 8)
  PrefillItem next_item;
  int next_pair = -1;
  auto fetch_ahead = [&]() {
    if constexpr (kAhead) {
      const int qb = qcur.stage;
      mbar_wait(sm.q_full(qb), qcur.phase);
      qcur.advance();
      const WsRecord* rec = sm.record(qb);
      next_pair = rec->pair;
      if (next_pair >= 0) {
        next_item = rec->item;
        float2 down;
        q_up = WsQuerySplit<T, D>::load(qa, sm.q(qb), warp, lane, down);
        sl2 = make_float2(a.scale_log2 * down.x, a.scale_log2 * down.y);
        mbar_arrive(sm.q_empty(qb));
#pragma unroll
        for (int kk = 0; kk < D / 32; ++kk) WsQuerySplit<T, D>::split_step(qa, kk, q_up);
      }
    }
  };
  fetch_ahead();

  for (;;) {
    // The producer's next item: its Q tile and its record (ws_q_ahead: fetched already).
    const int qb = qcur.stage;
    const WsRecord* rec = sm.record(qb);
    if constexpr (!kAhead) {
      mbar_wait(sm.q_full(qb), qcur.phase);
      qcur.advance();
      next_pair = rec->pair;
    }
    const int pair = next_pair;
    if (pair < 0) break;
    Blk blk(a, smem_raw, kAhead ? next_item : rec->item, pair % a.num_kv_heads, 0);
    Softmax soft;
    const int r_a = blk.row0 + warp * 16 + g;
    soft.lim_a = blk.offset + min(r_a / blk.G, blk.q_len - 1);
    soft.lim_b = blk.offset + min((r_a + 8) / blk.G, blk.q_len - 1);
    const int first_pos = blk.offset + blk.t_first;   // tiles ending at or before it need no mask
    // The column groups of the item's last tile this warpgroup computes: as far as its last row
    // (its row 63) sees. 16-bit caches only (ws_last_groups says why).
    const int last_visible = blk.offset + min((blk.row0 + wg * 64 + 63) / blk.G, blk.q_len - 1);
    const int last_nb = ws_last_groups<C>(last_visible, (blk.n_tiles - 1) * BN);
    // This warp's 16 rows of Q, as the S GEMMs' A fragments (registers): once every consumer thread
    // has its fragments (and has read the record), the buffer is free (q_empty), and the producer
    // loads the next item's Q while this one runs. Each thread arrives itself, after its own reads
    // (racecheck flags an order that runs through __syncwarp and one lane's arrival). (ws_q_ahead:
    // done by fetch_ahead, under the previous item's last P V.)
    if constexpr (!kAhead) {
      sl2 = make_float2(a.scale_log2, a.scale_log2);
      if constexpr (ws_raw_k<T, C>) {
        float2 down;
        q_up = WsQuerySplit<T, D>::load(qa, sm.q(qb), warp, lane, down);
        sl2.x *= down.x;
        sl2.y *= down.y;
        mbar_arrive(sm.q_empty(qb));
      } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          ldmatrix_x4(qa[kk], sm.q(qb) + 2 * tile_off<BM>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
        mbar_arrive(sm.q_empty(qb));
        if constexpr (!std::is_same_v<MT, T>) {
          const float down = ws_query_to_half(qa);
          sl2.x *= down;
          sl2.y *= down;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    uint32_t pa[BN / 16][4];   // P_{j-1}

    // Tile j over its first NB column groups (decltype(n)::value): S_j issued, P_{j-1} V_{j-1}
    // issued behind it (j > 0), the softmax of S_j, then P_j packed for the next tile's P V.
    auto tile = [&](int j, auto n) {
      constexpr int NB = decltype(n)::value;
      const int kv0 = j * BN;
      float s[BN / 8][4];   // not zeroed: the first k-step's wgmma ignores its old contents (scale_d 0)
      mbar_wait(sm.full_k(cur.stage), cur.phase);
      fence_proxy_async();
      named_sync(my_turn, 256);
      fence_regs(s);
      fence_regs(o);
      fence_regs(pa);
      fence_regs(qa);
      wgmma_fence();
      if constexpr (ws_raw_k<T, C>)
        issue_s_e4m3<T, D, BN>(s, qa, sm.k_tile(cur.stage), !kAhead && j == 0, q_up);   // NB: the whole tile
      else
        issue_s<MT, D, BN, NB>(s, qa, sm.k_tile(cur.stage));
      wgmma_commit();
      if (j > 0) {   // O += P_{j-1} V_{j-1}, behind S_j on the tensor cores
        mbar_wait(sm.full_v(prev.stage), prev.phase);
        fence_proxy_async();
        issue_pv<MT, D, BN>(o, pa, sm.v_tile(prev.stage));
        wgmma_commit();
      }
      if (j > 0)
        wgmma_wait<1>();   // S_j done
      else
        wgmma_wait<0>();
      // The other warpgroup's turn: its GEMMs queue behind our P_{j-1} V_{j-1}. (Arriving before
      // the wait, as soon as both are issued, makes ptxas serialize the wgmmas: C7514.)
      named_arrive(their_turn, 256);
      fence_regs(s);
      __syncwarp();
      if (signals) mbar_arrive(sm.empty_k(cur.stage));
      const float2 alpha = soft.template scores<NB>(s, kv0, kv0 + BN - 1 > first_pos, sl2, t4);
      // P_j, meant to run under P_{j-1} V_{j-1}. Without the fence NVVM sinks most of the softmax
      // below the wait; with it the PTX has the intended order, but ptxas (nvcc 13.0) still moves
      // the wait up to just after the mask, so the max, exp and sums run after P V (read in the
      // SASS, 2026-11-26, seventh session). A wait ptxas cannot move (behind a branch on the row
      // sums) put the softmax under P V and measured 0.5-0.8% slower (ncu, one launch, clocks
      // locked): the other warpgroup's GEMMs already fill the tensor cores during it.
      fence_regs(s);
      wgmma_wait<0>();   // P_{j-1} V_{j-1} done: o and pa are ours again, V_{j-1} is free
      fence_regs(o);
      fence_regs(pa);
      __syncwarp();
      if (j > 0 && signals) mbar_arrive(sm.empty_v(prev.stage));
      Softmax::rescale(o, alpha);
      Softmax::template pack<NB>(s, pa);
      prev = cur;
      cur.advance();
    };
    for (int j = 0; j + 1 < blk.n_tiles; ++j) tile(j, std::integral_constant<int, BN / 8>{});
    if (blk.n_tiles > 0) {
      // The last tile and its P V over the columns its rows can see, each width one straight
      // path: a GEMM issued in one branch of a switch and waited for after it makes ptxas
      // serialize every wgmma of the kernel (C7520).
      auto last = [&](auto n) {
        tile(blk.n_tiles - 1, n);
        mbar_wait(sm.full_v(prev.stage), prev.phase);
        fence_proxy_async();
        fence_regs(o);
        fence_regs(pa);
        wgmma_fence();
        issue_pv<MT, D, BN, decltype(n)::value>(o, pa, sm.v_tile(prev.stage));
        wgmma_commit();
        fetch_ahead();   // (ws_q_ahead) under the last P V: qa is free since the last S GEMM
        wgmma_wait<0>();
      };
      ws_with_groups<C>(last_nb, last);
    } else {
      fetch_ahead();
    }
    // The last P V is done: its V stage is free; the item's rows out (no tiles: nothing visible,
    // zero rows).
    fence_regs(o);
    __syncwarp();
    if (blk.n_tiles > 0 && signals) mbar_arrive(sm.empty_v(prev.stage));
    write_out_rows<T, D>(a, out_rows(blk, soft, r_a), o, t4);
  }
  // Warpgroup 1's last "your turn" arrival on barrier 1 has no issue left to admit: take it, so
  // that no named barrier is left half-arrived at exit.
  if (wg == 0) named_sync(kWsTurnBar, 256);
}

template <typename T, typename C, int D>
__device__ __forceinline__ void prefill_ws(const PrefillArgs& a, unsigned char* smem_raw) {
  const WsSmem<T, C, D> sm(smem_raw);
  const int num_pairs = a.num_items * a.num_kv_heads;
  if (threadIdx.x == 0) {
    for (int st = 0; st < WsSmem<T, C, D>::S; ++st) {
      mbar_init(sm.full_k(st), 128);
      mbar_init(sm.full_v(st), 128);
      mbar_init(sm.empty_k(st), 8);
      mbar_init(sm.empty_v(st), 8);
    }
    for (int qb = 0; qb < kWsQBufs; ++qb) {
      mbar_init(sm.q_full(qb), 129);   // the copies' 128 arrivals and thread 0's for the record
      mbar_init(sm.q_empty(qb), 256);   // every consumer thread (the record's readers)
    }
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    regs_down<kWsProducerRegs>();
    ws_produce<T, C, D>(a, smem_raw, num_pairs);
  } else {
    regs_up<kWsConsumerRegs>();
    ws_consume<T, C, D>(a, smem_raw);
  }
}
#endif
}  // namespace prefill_detail

// grid: min(pairs, SMs) blocks, persistent over the (work item, KV head) pairs (item-major);
// block: kWsThreads threads; dynamic smem: prefill_ws_smem_bytes<T, C, D>(). T: query/output type
// (fp16/bf16); C: cache type (T, or fp8 e4m3, dequantized by the producer).
// Built for sm_90a only: elsewhere the body is empty and the launcher never picks it.
template <typename T, typename C, int D>
__global__ void __launch_bounds__(kWsThreads, 1) paged_prefill_ws_kernel(const PrefillArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
#if KVPAGER_PREFILL_WGMMA
  prefill_detail::prefill_ws<T, C, D>(a, smem_raw);
#endif
}

}  // namespace kvpager
