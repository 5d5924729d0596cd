// layer0's comm block program: pull token rows from the source ranks' symmetric buffers into the
// local shared tensor A (dispatch layout), one m-tile at a time in layer0's tile order, and publish
// each m-tile once all its rows are in A, so GEMM blocks waiting on it may load them.
//
// Each (source token, destination rank) pair crosses the link once (dedup, the default): of a
// token's slot rows on this rank only its primary row (its first slot here, layout.h:
// first_slot_destination) is pulled; the block that pulls it then fills the token's other slot
// rows here (other local experts, replicas, the same expert twice) by local copies from it. Those
// rows may lie in other m-tiles, owned by other comm blocks, so an m-tile is published by an
// arrival counter of its rows (flags.h: arrive_and_publish), whichever block writes its last
// row: no comm block ever waits on another (docs/design.md, "Block roles and forward
// progress"). HBM cost on the destination: each extra slot row is written once and its primary
// row read once more (both local), instead of one more row read from the link. The releases
// follow a block barrier, so every thread's stores of the rows happen before them.
#pragma once

#include "comet/copy.h"
#include "comet/exec_context.h"
#include "comet/flags.h"
#include "comet/layout.h"
#include "comet/symm_layout.h"
#include "comet/tile_order.h"

namespace comet {

struct Layer0CommArgs {
  int32_t rank, world, experts_local, topk;
  int64_t row_bytes;  // H * element size
  uint64_t epoch;
  DataRegions regions;
  const int64_t* seg_off;      // [E_local*(W+1)] from build_dispatch_layout
  const MTile* mtiles;         // [num_mtiles]
  const int64_t* mtile_order;  // [num_mtiles] layer0 visit order
  int64_t num_mtiles;
  char* a;                     // [M, H] local, dispatch layout
  uint64_t* mtile_ready;       // [num_mtiles] local flags, value = epoch when rows are in A
  int32_t* row_source;         // [M] outputs: each row's origin
  int32_t* row_token;
  int32_t* row_slot;
  // Several nodes (comet/topology.h): where each source's published region is read (its own
  // segment, or its mirror on this node's relay) and, for sources on other nodes, the flag that
  // says their rows are in the mirror (null: the source is on this node). Null arrays: one node.
  const char* const* sources = nullptr;  // [W]
  uint64_t* const* rows_ready = nullptr; // [W]
  int32_t tp = 1;  // tp_size (layout.h): the EP rank's buckets, the ring from its anchor
  uint32_t* mtile_rows = nullptr;  // [num_mtiles] rows written so far (self-resetting counters)
  // false: every slot row is pulled over the link (no dedup; kept so tests can demand the same
  // bits from both ways)
  bool dedup = true;
  uint64_t* rows_received = nullptr;  // += rows pulled from other ranks (Buffer.traffic), or null
};

// Rows of an m-tile are handled in batches, their descriptors in the block's shared memory: first
// every thread resolves its rows' origins (two index loads from the source's published send plan,
// and with dedup the token's k ids and bucket positions), so a batch pays those dependent remote
// loads once instead of once per row; then the block copies the batch's primary rows with several
// 16-byte loads in flight per thread (copy.h), and then their local copies.
// Shared memory of a batch of n rows: n pulls, n * (k - 1) local copies, an int per row, 2 totals.
COMET_HD int32_t layer0_batch_rows(int32_t topk, bool dedup) {
  const int32_t extra = dedup && topk > 1 ? topk - 1 : 0;
  const int32_t n = int32_t((kBlockSharedBytes - 16) / (sizeof(RowCopy) * (1 + extra) + 4));
  return n > 0 ? n : 1;
}

// The m-tile holding `row` (m-tiles are numbered in row order, expert-major): binary search.
COMET_HD int64_t mtile_of_row(const MTile* mtiles, int64_t num_mtiles, int64_t row) {
  int64_t lo = 0, hi = num_mtiles - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (mtiles[mid].row_begin <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <class Ctx>
COMET_HD void layer0_comm(Ctx& ctx, const Layer0CommArgs& a) {
  const int32_t k = a.topk, extra = a.dedup && k > 1 ? k - 1 : 0;
  const int32_t cap = layer0_batch_rows(k, a.dedup);
  RowCopy* pull = static_cast<RowCopy*>(ctx.block_shared());   // [cap]
  RowCopy* fan = pull + cap;                                      // [cap * extra]
  int32_t* want = reinterpret_cast<int32_t*>(fan + int64_t(cap) * extra);  // [cap]: -1 / extras
  int32_t* totals = want + cap;                                   // [2]: packed pulls, copies
  // Every row is 16-byte aligned at both ends when the row size and both bases are: A's, and the
  // x region's (at the same offset in every rank's segment, whose bases are page-aligned).
  const bool vec = a.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a.a) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(ctx.data(a.rank) + a.regions.x) % 16 == 0;
  const int32_t anchor = ring_anchor(a.rank, a.tp), q = ep_rank_of(a.rank, a.tp);
  const int32_t num_experts = a.experts_local * (a.world / a.tp);
  uint64_t received = 0;  // this thread's primary rows from other ranks
  for (int64_t i = ctx.block(); i < a.num_mtiles; i += ctx.blocks()) {
    const int64_t id = a.mtile_order[i];
    const MTile mt = a.mtiles[id];
    // The sources this tile reads: a contiguous range of ring positions (rows are ring-ordered
    // within an expert). Acquiring them is block-wide, so it happens here, uniformly. A token's
    // other slot rows filled from this tile come from the same sources.
    const int32_t p_first = row_origin(a.seg_off, a.world, mt.expert, mt.row_begin).ring_pos;
    const int32_t p_last = mtile_ring_distance(mt, a.seg_off, a.world);
    for (int32_t p = p_first; p <= p_last; ++p) {
      const int32_t src = ring_source(anchor, p, a.world);
      ctx.acquire(src);
      if (a.rows_ready && a.rows_ready[src])
        ctx.wait(a.rows_ready[src], a.epoch, WaitSite::MirrorRows, src);
    }
    for (int64_t b0 = mt.row_begin; b0 < mt.row_begin + mt.rows; b0 += cap) {
      const int64_t left = mt.row_begin + mt.rows - b0;
      const int32_t n = int32_t(left < cap ? left : cap);
      // 1. Each row's origin; with dedup, whether it is its token's primary row here and, if so,
      //    the token's other slot rows here (want[r]: -1 for a row another row fills).
      for (int32_t r = ctx.thread(); r < n; r += ctx.threads()) {
        const int64_t row = b0 + r;
        const RowOrigin o = row_origin(a.seg_off, a.world, mt.expert, row);
        const int32_t src = ring_source(anchor, o.ring_pos, a.world);
        const char* sd = a.sources ? a.sources[src] : ctx.data(src);
        const int32_t* bucket_off = reinterpret_cast<const int32_t*>(sd + a.regions.bucket_off);
        const int32_t* send_slot = reinterpret_cast<const int32_t*>(sd + a.regions.send_slot);
        const int32_t slot = send_slot[bucket_off[q * a.experts_local + mt.expert] + o.index];
        const int32_t token = slot / k, j = slot % k;
        pull[r] = RowCopy{a.a + row * a.row_bytes, sd + a.regions.x + int64_t(token) * a.row_bytes};
        int32_t w = 0;
        if (extra > 0) {
          const int64_t at = int64_t(token) * k;
          const int32_t* ids = reinterpret_cast<const int32_t*>(sd + a.regions.ids) + at;
          const int32_t* pos = reinterpret_cast<const int32_t*>(sd + a.regions.send_pos) + at;
          if (first_slot_destination(ids, j, num_experts, a.experts_local) != q) {
            w = -1;
          } else {
            RowCopy* mine = fan + int64_t(r) * extra;  // unpacked; packed in step 2
            for (int32_t jj = j + 1; jj < k; ++jj) {
              const int32_t e = ids[jj];
              if (e < 0 || e >= num_experts || e / a.experts_local != q) continue;
              const int64_t to = dispatch_row(a.seg_off, a.world, anchor, src, e % a.experts_local,
                                              pos[jj]);
              mine[w++] = RowCopy{a.a + to * a.row_bytes, a.a + row * a.row_bytes};
              a.row_source[to] = src;
              a.row_token[to] = token;
              a.row_slot[to] = jj;
            }
          }
        }
        want[r] = w;
        if (w >= 0) {
          a.row_source[row] = src;
          a.row_token[row] = token;
          a.row_slot[row] = j;
          received += src != a.rank;
        }
      }
      ctx.sync();
      // 2. Pack the pulls and the local copies (one thread: n counts, no remote load). In
      //    place, ascending: an entry's packed index never exceeds its unpacked one, and every
      //    entry an earlier row's packing writes lies below the later rows' unpacked entries.
      if (extra > 0 && ctx.thread() == 0) {
        int32_t np = 0, nf = 0;
        for (int32_t r = 0; r < n; ++r) {
          if (want[r] < 0) continue;
          pull[np++] = pull[r];
          for (int32_t x = 0; x < want[r]; ++x) fan[nf++] = fan[int64_t(r) * extra + x];
        }
        totals[0] = np;
        totals[1] = nf;
      }
      if (extra > 0) ctx.sync();
      const int32_t pulls = extra > 0 ? totals[0] : n, fans = extra > 0 ? totals[1] : 0;
      // 3. The link: one row per token; then the local copies from the rows just written.
      ctx.copy_rows(pull, pulls, size_t(a.row_bytes), vec);
      ctx.sync();
      if (fans > 0) {
        ctx.copy_rows(fan, fans, size_t(a.row_bytes), vec);
        ctx.sync();
      }
      // 4. Arrivals (after the barrier: every thread's stores precede each release): this
      //    tile's pulled rows at once, each local copy on its own tile.
      ctx.delay();
      if (ctx.thread() == 0 && pulls > 0)
        arrive_and_publish(&a.mtile_rows[id], uint32_t(mt.rows), &a.mtile_ready[id], a.epoch,
                           uint32_t(pulls));
      for (int32_t f = ctx.thread(); f < fans; f += ctx.threads()) {
        const int64_t to = (fan[f].dst - a.a) / a.row_bytes;
        const int64_t t = mtile_of_row(a.mtiles, a.num_mtiles, to);
        arrive_and_publish(&a.mtile_rows[t], uint32_t(a.mtiles[t].rows), &a.mtile_ready[t],
                           a.epoch);
      }
      ctx.sync();  // the batch's entries are rewritten next
    }
  }
  if (a.rows_received != nullptr && received > 0) counter_add(a.rows_received, received);
}

}  // namespace comet
