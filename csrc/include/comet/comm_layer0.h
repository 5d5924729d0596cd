// layer0's comm block program: pull token rows from the source ranks' symmetric buffers into the
// local shared tensor A (dispatch layout), one m-tile at a time in layer0's tile order, and publish
// each finished m-tile with release so GEMM blocks waiting on it may load its rows. The release by
// thread 0 follows a block barrier, so every thread's stores of the tile happen before it.
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
};

// Rows of an m-tile are handled in batches of up to kRowBatch rows, their descriptors in the
// block's shared memory: first every thread resolves one row's origin (its two index loads from
// the source's published send plan), so a batch pays those dependent remote loads once instead
// of once per row; then the block copies the whole batch with several 16-byte loads in flight per
// thread (copy.h).
constexpr int32_t kRowBatch = int32_t(kBlockSharedBytes / sizeof(RowCopy));

template <class Ctx>
COMET_HD void layer0_comm(Ctx& ctx, const Layer0CommArgs& a) {
  RowCopy* batch = static_cast<RowCopy*>(ctx.block_shared());
  // Every row is 16-byte aligned at both ends when the row size and both bases are: A's, and the
  // x region's (at the same offset in every rank's segment, whose bases are page-aligned).
  const bool vec = a.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(a.a) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(ctx.data(a.rank) + a.regions.x) % 16 == 0;
  const int32_t anchor = ring_anchor(a.rank, a.tp), q = ep_rank_of(a.rank, a.tp);
  for (int64_t i = ctx.block(); i < a.num_mtiles; i += ctx.blocks()) {
    const int64_t id = a.mtile_order[i];
    const MTile mt = a.mtiles[id];
    // The sources this tile reads: a contiguous range of ring positions (rows are ring-ordered
    // within an expert). Acquiring them is block-wide, so it happens here, uniformly.
    const int32_t p_first = row_origin(a.seg_off, a.world, mt.expert, mt.row_begin).ring_pos;
    const int32_t p_last = mtile_ring_distance(mt, a.seg_off, a.world);
    for (int32_t p = p_first; p <= p_last; ++p) {
      const int32_t src = ring_source(anchor, p, a.world);
      ctx.acquire(src);
      if (a.rows_ready && a.rows_ready[src])
        ctx.wait(a.rows_ready[src], a.epoch, WaitSite::MirrorRows, src);
    }
    for (int64_t b0 = mt.row_begin; b0 < mt.row_begin + mt.rows; b0 += kRowBatch) {
      const int64_t left = mt.row_begin + mt.rows - b0;
      const int32_t n = int32_t(left < kRowBatch ? left : kRowBatch);
      for (int32_t r = ctx.thread(); r < n; r += ctx.threads()) {
        const int64_t row = b0 + r;
        const RowOrigin o = row_origin(a.seg_off, a.world, mt.expert, row);
        const int32_t src = ring_source(anchor, o.ring_pos, a.world);
        const char* sd = a.sources ? a.sources[src] : ctx.data(src);
        const int32_t* bucket_off = reinterpret_cast<const int32_t*>(sd + a.regions.bucket_off);
        const int32_t* send_slot = reinterpret_cast<const int32_t*>(sd + a.regions.send_slot);
        const int32_t slot = send_slot[bucket_off[q * a.experts_local + mt.expert] + o.index];
        const int32_t token = slot / a.topk;
        batch[r] = RowCopy{a.a + row * a.row_bytes, sd + a.regions.x + int64_t(token) * a.row_bytes};
        a.row_source[row] = src;
        a.row_token[row] = token;
        a.row_slot[row] = slot % a.topk;
      }
      ctx.sync();
      ctx.copy_rows(batch, n, size_t(a.row_bytes), vec);
      ctx.sync();  // the batch's slots are rewritten next
    }
    ctx.delay();
    if (ctx.thread() == 0) local_flag_release(&a.mtile_ready[id], a.epoch);  // read on this GPU only
  }
}

}  // namespace comet
