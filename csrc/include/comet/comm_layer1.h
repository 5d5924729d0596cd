// layer1's comm block program, in two phases:
//  1. reduce-and-send: for each n-tile in column order (the order the GEMM blocks finish them),
//     wait for its completion flag, reduce every local token's slots (weighted, fp32, ascending
//     slot) over the tile's columns and store the partial slice straight into the token's home
//     rank's receive buffer. The last comm block to finish tells every rank its partials are there.
//  2. combine: once every rank's partials for this rank have arrived, sum each local token's at
//     most min(k, W) partials in ascending partial slot (= ascending sending rank) and store the
//     result in the output dtype. Acc is the accumulator: float (fp32) everywhere, double only
//     for float64 on the CPU backend. Every step has a fixed order, so results are bitwise
//     reproducible whatever the block counts and timing.
#pragma once

#include "comet/exec_context.h"
#include "comet/flags.h"
#include "comet/layout.h"
#include "comet/numeric.h"
#include "comet/reduce_plan.h"
#include "comet/symm_layout.h"

namespace comet {

template <class Acc>
struct Layer1CommArgs {
  int32_t rank, world, experts_local, topk;
  int32_t hidden;       // H: columns of the GEMM output and of out
  int32_t tile_n;
  int32_t num_ntiles;
  int64_t tmax;         // agreed token capacity: stride of the receive buffer slices
  uint64_t epoch;
  DataRegions regions;
  const Acc* c;         // [M, H] local GEMM output
  uint64_t* ntile_ready;// [num_ntiles] local flags, value = epoch when every tile of the column is done
  ReducePlan<Acc> plan;
  int64_t entries_per_item;  // work granularity of phase 1
  uint32_t* blocks_done;     // local counter, self-resetting
  // phase 2
  int64_t tokens;       // local T
  const int32_t* ids;   // local routing [T*k]
  void* out;            // [T, H]
  ScalarKind out_kind;
};

template <class Ctx, class Acc>
COMET_HD void layer1_reduce_send(Ctx& ctx, const Layer1CommArgs<Acc>& a) {
  const int64_t chunks = ceil_div(a.plan.entries, a.entries_per_item);
  const int64_t items = chunks * a.num_ntiles;
  for (int64_t i = ctx.block(); i < items; i += ctx.blocks()) {
    const int32_t n = int32_t(i / chunks);
    const int64_t first = (i % chunks) * a.entries_per_item;
    const int64_t last = first + a.entries_per_item < a.plan.entries ? first + a.entries_per_item
                                                                     : a.plan.entries;
    ctx.wait(&a.ntile_ready[n], a.epoch, WaitSite::ColumnTile, n);
    const int32_t col0 = n * a.tile_n;
    const int32_t cols = a.hidden - col0 < a.tile_n ? a.hidden - col0 : a.tile_n;
    for (int64_t e = first; e < last; ++e) {
      Acc* dst = reinterpret_cast<Acc*>(ctx.data(a.plan.entry_source[e]) + a.regions.recv) +
                   (int64_t(a.plan.entry_partial[e]) * a.tmax + a.plan.entry_token[e]) * a.hidden +
                   col0;
      for (int32_t c = ctx.thread(); c < cols; c += ctx.threads()) {
        Acc acc = 0;
        for (int64_t s = a.plan.entry_begin[e]; s < a.plan.entry_begin[e + 1]; ++s)
          acc += a.plan.slot_weight[s] * a.c[a.plan.slot_row[s] * a.hidden + col0 + c];
        dst[c] = acc;
      }
    }
    ctx.delay();
  }
  // Publish "all my partials for you are written" to every rank (also those that got none, so a
  // home rank simply waits for all W).
  ctx.fence_peers();
  ctx.sync();
  if (ctx.thread() == 0) {
    uint32_t before = count_ref(*a.blocks_done).fetch_add(1u, mo::memory_order_acq_rel);
    if (before + 1u == uint32_t(ctx.blocks())) {
      count_ref(*a.blocks_done).store(0u, mo::memory_order_relaxed);
      for (int32_t s = 0; s < a.world; ++s)
        flag_release(header_arrive(ctx.header(s), a.rank), a.epoch);
    }
  }
}

template <class Ctx, class Acc>
COMET_HD void layer1_combine(Ctx& ctx, const Layer1CommArgs<Acc>& a) {
  for (int32_t s = 0; s < a.world; ++s)
    ctx.wait(header_arrive(ctx.header(a.rank), s), a.epoch, WaitSite::Partials, s);
  const Acc* recv = reinterpret_cast<const Acc*>(ctx.data(a.rank) + a.regions.recv);
  const int64_t per_block = ceil_div(a.tokens, ctx.blocks());
  const int64_t t0 = per_block * ctx.block();
  const int64_t t1 = t0 + per_block < a.tokens ? t0 + per_block : a.tokens;
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t parts = partial_slot(a.ids + t * a.topk, a.topk, a.experts_local, a.rank).count;
    for (int32_t c = ctx.thread(); c < a.hidden; c += ctx.threads()) {
      Acc acc = 0;
      for (int32_t p = 0; p < parts; ++p) acc += recv[(int64_t(p) * a.tmax + t) * a.hidden + c];
      store_as<Acc>(a.out, t * a.hidden + c, a.out_kind, acc);
    }
  }
}

template <class Ctx, class Acc>
COMET_HD void layer1_comm(Ctx& ctx, const Layer1CommArgs<Acc>& a) {
  layer1_reduce_send(ctx, a);
  layer1_combine(ctx, a);
}

}  // namespace comet
