// Paged prefill attention on Hopper, warp-specialized and persistent (sm_90a only; the wgmma
// building blocks are prefill_tensor_ops.cuh's, the loads from the pages and the softmax
// paged_prefill.cuh's).
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
// in the output). K tiles: copied as they are and multiplied in e4m3, each query row split into two
// e4m3 terms (ws_raw_k, WsQuerySplit: bf16 queries since the twelfth session, fp16 since the
// eighteenth); with KVPAGER_PREFILL_WS_FP16_SPLIT=0 fp16 queries' K converted like V, S in fp16.
//
// The parts: prefill_ws_shared.cuh (knobs, shared memory layout, barriers, the item record),
// prefill_ws_producer.cuh (the producer warpgroup), prefill_ws_query.cuh (the consumers' query
// fragments), and here the consumers' GEMMs and softmax per tile, and the kernel.
//
// Barrier counts: full barriers get one asynchronous arrival per producer thread (128), q_full
// one more (thread 0's, releasing the record); empty K/V barriers one arrival per consumer warp
// (8), q_empty one per consumer thread (256: each thread read the record and its Q fragments).
#pragma once

#include <type_traits>

#include "paged_prefill.cuh"
#include "prefill_ws_producer.cuh"
#include "prefill_ws_query.cuh"
#include "prefill_ws_shared.cuh"

namespace kvpager {
namespace prefill_detail {
#if KVPAGER_PREFILL_WGMMA

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
// the two GEMMs take the time of one fp16 GEMM over the converted tile. Over the first NB column
// groups: 16 (the whole tile), or 8 (ws_fp8_narrow's last tiles). split
// (KVPAGER_PREFILL_WS_Q_AHEAD=0): the item's first tile, whose query is still unsplit
// (WsQuerySplit::load): each k-step is split just before its GEMMs are issued, under the previous
// k-step's.
template <typename T, int D, int BN, int NB>
__device__ __forceinline__ void issue_s_e4m3(float (&s)[BN / 8][4], uint32_t (&qa)[D / 16][4], uint32_t k_tile,
                                             bool split, float2 up) {
  static_assert(BN == 128 && (NB == 8 || NB == 16), "the e4m3 S GEMM is written for 64 or 128 of 128 positions");
  const uint64_t k_desc = gmma_desc(k_tile, 16, 1024);
  auto& sn = reinterpret_cast<float (&)[NB][4]>(s);
#pragma unroll
  for (int kk = 0; kk < D / 32; ++kk) {
    if (split) WsQuerySplit<T, D>::split_step(qa, kk, up);
    fence_regs(qa);
    wgmma_fence();
    wgmma_rs_e4m3(sn, qa[kk], k_desc + ((kk * 32) >> 4), kk == 0 ? 0 : 1);
    wgmma_rs_e4m3(sn, qa[D / 32 + kk], k_desc + ((kk * 32) >> 4));
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
// on whole prompts its S GEMM, P V and softmax there do 5/8 of the work on average. Over fp8 caches
// with the query split (ws_fp8_narrow: split ahead, K as e4m3) rounded up to 64 positions; every
// narrower arrangement tried there left ptxas short of registers (the wgmmas serialized, C7511).
// fp16 queries over fp8 with K converted (KVPAGER_PREFILL_WS_FP16_SPLIT=0) keep whole last tiles.
template <typename T, typename C>
__device__ __forceinline__ int ws_last_groups(int last_visible, int last_kv0) {
  if (KVPAGER_PREFILL_WS_NARROW == 0 || (sizeof(C) == 1 && !ws_fp8_narrow<T, C>)) return kWsBN / 8;
  const int cols = ws_raw_k<T, C> ? (last_visible + 1 - last_kv0 + 63) & ~63 : (last_visible + 1 - last_kv0 + 31) & ~31;
  return min(max(cols, 32), kWsBN) / 8;
}

// f(std::integral_constant<int, NB>) for the NB column groups a tile's GEMMs and softmax cover:
// the whole tile, or 4, 8 or 12 groups (ws_last_groups). Warp-uniform. Over fp8 caches only the
// whole tile is compiled, or (ws_fp8_narrow) 8 or 16 groups.
template <typename T, typename C, typename F>
__device__ __forceinline__ void ws_with_groups(int nb, F&& f) {
  static_assert(kWsBN == 128, "narrowed tiles are written for tiles of 128 positions");
  if constexpr (sizeof(C) == 1 && !ws_fp8_narrow<T, C>) {
    f(std::integral_constant<int, kWsBN / 8>{});
  } else if constexpr (ws_fp8_narrow<T, C>) {
    if (nb <= 8) f(std::integral_constant<int, 8>{});
    else f(std::integral_constant<int, 16>{});
  } else {
    switch (nb) {
      case 4: f(std::integral_constant<int, 4>{}); break;
      case 8: f(std::integral_constant<int, 8>{}); break;
      case 12: f(std::integral_constant<int, 12>{}); break;
      default: f(std::integral_constant<int, 16>{}); break;
    }
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
  // buffer filled by then: it loads an item's Q once it has issued the item before's last tile. A
  // query split before the kernel (a.query_down) is only loaded, with its rows' factors.
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
        if (a.query_down != nullptr) {   // split before the kernel (split_query.cuh)
          const float2 down = WsQuerySplit<T, D>::split_down(sm.down(qb), warp, lane);
          WsQuerySplit<T, D>::load_split(qa, sm.q(qb), warp, lane);
          mbar_arrive(sm.q_empty(qb));
          sl2 = make_float2(a.scale_log2 * down.x, a.scale_log2 * down.y);
        } else {
          q_up = WsQuerySplit<T, D>::load_scaled(qa, sm.q(qb), warp, lane, a.scale_log2, sl2);
          mbar_arrive(sm.q_empty(qb));
#pragma unroll
          for (int kk = 0; kk < D / 32; ++kk) WsQuerySplit<T, D>::split_step(qa, kk, q_up);
        }
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
    // (its row 63) sees (over fp8 caches with the query split in steps of 64 positions, ws_last_groups).
    const int last_visible = blk.offset + min((blk.row0 + wg * 64 + 63) / blk.G, blk.q_len - 1);
    const int last_nb = ws_last_groups<T, C>(last_visible, (blk.n_tiles - 1) * BN);
    // This warp's 16 rows of Q, as the S GEMMs' A fragments (registers): once every consumer thread
    // has its fragments (and has read the record), the buffer is free (q_empty), and the producer
    // loads the next item's Q while this one runs. Each thread arrives itself, after its own reads
    // (racecheck flags an order that runs through __syncwarp and one lane's arrival). (ws_q_ahead:
    // done by fetch_ahead, under the previous item's last P V.)
    if constexpr (!kAhead) {
      sl2 = make_float2(a.scale_log2, a.scale_log2);
      if constexpr (ws_raw_k<T, C>) {
        q_up = WsQuerySplit<T, D>::load_scaled(qa, sm.q(qb), warp, lane, a.scale_log2, sl2);
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
        issue_s_e4m3<T, D, BN, NB>(s, qa, sm.k_tile(cur.stage), !kAhead && j == 0, q_up);
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
      ws_with_groups<T, C>(last_nb, last);
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
