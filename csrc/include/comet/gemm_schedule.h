// How GEMM blocks walk their tiles and synchronise with the comm blocks. The tile computation
// itself is the backend's (CUTLASS mainloop on the GPU, an fp32 tile GEMM on the CPU) and is passed
// in as `compute(const MTile&, int32_t ntile)`.
#pragma once

#include "comet/exec_context.h"
#include "comet/flags.h"
#include "comet/tile_order.h"

namespace comet {

struct GemmScheduleArgs {
  uint64_t epoch;
  const MTile* mtiles;
  int64_t num_mtiles;
  int32_t num_ntiles;
  const int64_t* mtile_order;  // layer0 only
  uint64_t* mtile_ready;       // layer0: flags from the comm blocks
  uint32_t* ntile_count;       // layer1: arrivals per band, at its first n-tile (self-resetting)
  uint64_t* ntile_ready;       // layer1: flags to the comm blocks, one per n-tile
  int32_t band_n = 1;          // layer1: n-tiles per band (tile_order.h: layer1_band; 0 = all)
  int32_t group = 0;           // m-tiles per raster group (tile_order.h); 0 = raster_group(n_gemm)
};

// The raster group a schedule of gemm_blocks GEMM blocks runs with.
COMET_HD int32_t schedule_group(const GemmScheduleArgs& a, int32_t gemm_blocks) {
  return a.group > 0 ? a.group : raster_group(gemm_blocks);
}

// i-th tile of layer `layer`'s schedule for gemm_blocks GEMM blocks: the one tile order every
// warp role and backend walks (the sm_90a producer warps too).
COMET_HD TileCoord schedule_tile(int32_t layer, int64_t i, const GemmScheduleArgs& a,
                                 int32_t gemm_blocks) {
  const int32_t group = schedule_group(a, gemm_blocks);
  return layer == 0 ? layer0_tile(i, a.mtile_order, a.num_mtiles, a.num_ntiles, group)
                    : layer1_tile(i, a.num_mtiles, a.num_ntiles,
                                  layer1_band(a.band_n, a.num_ntiles), group);
}

// layer0 with the readiness wait handed to the tile's work: compute(mtile, ntile, wait) must call
// wait() (the acquire of the m-tile's readiness) before it touches the tile's rows, and may do
// work that needs no rows first: the sm_90a producer issues the weights' loads of its first
// pipeline stages before it (weights depend on no communication).
template <class Ctx, class Compute>
COMET_HD void layer0_gemm_deferred(Ctx& ctx, int32_t gemm_block, int32_t gemm_blocks,
                                   const GemmScheduleArgs& a, Compute&& compute) {
  const int64_t tiles = a.num_mtiles * a.num_ntiles;
  for (int64_t i = gemm_block; i < tiles; i += gemm_blocks) {
    const TileCoord tc = schedule_tile(0, i, a, gemm_blocks);
    compute(a.mtiles[tc.mtile], tc.ntile, [&]() COMET_LAMBDA_INLINE {
      ctx.wait(&a.mtile_ready[tc.mtile], a.epoch, WaitSite::RowTile, tc.mtile);
    });
    ctx.delay();
  }
}

// layer0: acquire an m-tile's readiness before touching its rows.
template <class Ctx, class Compute>
COMET_HD void layer0_gemm(Ctx& ctx, int32_t gemm_block, int32_t gemm_blocks,
                          const GemmScheduleArgs& a, Compute&& compute) {
  layer0_gemm_deferred(ctx, gemm_block, gemm_blocks, a,
                       [&](const MTile& mt, int32_t nt, auto&& wait) COMET_LAMBDA_INLINE {
                         wait();
                         compute(mt, nt);
                       });
}

// layer1, after a tile's stores (thread 0, after the block's barrier): arrive on the tile's band;
// the band's last tile publishes it as a unit: the flag of the band's first n-tile by
// arrive_and_publish (release after every arrival, acquired through the counter's acq_rel chain),
// then the flags of its other n-tiles, so the comm blocks wait per n-tile as before.
COMET_HD void layer1_arrive(const GemmScheduleArgs& a, int32_t ntile, int32_t band) {
  const Band b = layer1_band_of(ntile, band, a.num_ntiles);
  if (!arrive_and_publish(&a.ntile_count[b.first], uint32_t(a.num_mtiles * b.width),
                          &a.ntile_ready[b.first], a.epoch))
    return;
  for (int32_t n = b.first + 1; n < b.first + b.width; ++n) flag_release(&a.ntile_ready[n], a.epoch);
}

// layer1: column bands (tile_order.h); the last tile of a band publishes it to the comm blocks.
template <class Ctx, class Compute>
COMET_HD void layer1_gemm(Ctx& ctx, int32_t gemm_block, int32_t gemm_blocks,
                          const GemmScheduleArgs& a, Compute&& compute) {
  const int64_t tiles = a.num_mtiles * a.num_ntiles;
  const int32_t band = layer1_band(a.band_n, a.num_ntiles);
  for (int64_t i = gemm_block; i < tiles; i += gemm_blocks) {
    const TileCoord tc = schedule_tile(1, i, a, gemm_blocks);
    compute(a.mtiles[tc.mtile], tc.ntile);
    ctx.delay();
    ctx.sync();
    if (ctx.thread() == 0) layer1_arrive(a, tc.ntile, band);
  }
}

}  // namespace comet
