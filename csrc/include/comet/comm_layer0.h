// layer0's comm block program: pull token rows from the source ranks' symmetric buffers into the
// local shared tensor A (dispatch layout), one m-tile at a time in layer0's tile order, and publish
// each finished m-tile with release so GEMM blocks waiting on it may load its rows.
#pragma once

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
};

template <class Ctx>
COMET_HD void layer0_comm(Ctx& ctx, const Layer0CommArgs& a) {
  for (int64_t i = ctx.block(); i < a.num_mtiles; i += ctx.blocks()) {
    const int64_t id = a.mtile_order[i];
    const MTile mt = a.mtiles[id];
    for (int64_t row = mt.row_begin; row < mt.row_begin + mt.rows; ++row) {
      const RowOrigin o = row_origin(a.seg_off, a.world, mt.expert, row);
      const int32_t src = ring_source(a.rank, o.ring_pos, a.world);
      const char* sd = ctx.data(src);
      const int32_t* bucket_off = reinterpret_cast<const int32_t*>(sd + a.regions.bucket_off);
      const int32_t* send_slot = reinterpret_cast<const int32_t*>(sd + a.regions.send_slot);
      const int32_t slot = send_slot[bucket_off[a.rank * a.experts_local + mt.expert] + o.index];
      const int32_t token = slot / a.topk;
      ctx.copy(a.a + row * a.row_bytes, sd + a.regions.x + int64_t(token) * a.row_bytes,
               size_t(a.row_bytes));
      if (ctx.thread() == 0) {
        a.row_source[row] = src;
        a.row_token[row] = token;
        a.row_slot[row] = slot % a.topk;
      }
    }
    ctx.delay();
    ctx.sync();
    if (ctx.thread() == 0) flag_release(&a.mtile_ready[id], a.epoch);
  }
}

}  // namespace comet
