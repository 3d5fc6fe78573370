// The warp-specialized prefill kernel's producer warpgroup (paged_prefill_ws.cuh): it picks the
// block's next (work item, KV head) pair (static stripes or the dynamic counter), writes the item's
// record, copies its Q tile and then its K/V tiles from the pages into the stages (cp.async; fp8
// V rows, and K rows where the query is not split (KVPAGER_PREFILL_WS_FP16_SPLIT=0, fp16), converted
// through its registers), and signals each on its full barrier.
#pragma once

#include "prefill_ws_shared.cuh"

namespace kvpager {
namespace prefill_detail {
#if KVPAGER_PREFILL_WGMMA

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
        // (fp8: the row's offset recomputed a page, not held across the item: with narrowed last
        // tiles ptxas spilled it, ws_fp8_narrow.)
        const C* src = base + static_cast<int64_t>(b >= 0 ? b : 0) * stride + (kFp8 ? opaque(my_row) : my_row) * D;
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
      if constexpr (ws_q_ahead<T, C>) {
        // A split query: row t's factor (PrefillArgs::query_down), zeros past the last row.
        if (a.query_down != nullptr) {
          const int row = blk.row0 + t;
          cp_async4(sm.down(qcur.stage) + 4 * t,
                    a.query_down + blk.kvh * a.query_down_stride + blk.q_start * blk.G + row, row < blk.rows);
        }
      }
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

#endif  // KVPAGER_PREFILL_WGMMA
}  // namespace prefill_detail
}  // namespace kvpager
