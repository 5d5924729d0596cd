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
  uint32_t* ntile_count;       // layer1: arrivals per n-tile (self-resetting)
  uint64_t* ntile_ready;       // layer1: flags to the comm blocks
};

// layer0: acquire an m-tile's readiness before touching its rows.
template <class Ctx, class Compute>
COMET_HD void layer0_gemm(Ctx& ctx, int32_t gemm_block, int32_t gemm_blocks,
                          const GemmScheduleArgs& a, Compute&& compute) {
  const int64_t tiles = a.num_mtiles * a.num_ntiles;
  for (int64_t i = gemm_block; i < tiles; i += gemm_blocks) {
    const TileCoord tc = layer0_tile(i, a.mtile_order, a.num_ntiles);
    ctx.wait(&a.mtile_ready[tc.mtile], a.epoch, WaitSite::RowTile, tc.mtile);
    compute(a.mtiles[tc.mtile], tc.ntile);
    ctx.delay();
  }
}

// layer1: column-major; the last tile of a column publishes the column to the comm blocks.
template <class Ctx, class Compute>
COMET_HD void layer1_gemm(Ctx& ctx, int32_t gemm_block, int32_t gemm_blocks,
                          const GemmScheduleArgs& a, Compute&& compute) {
  const int64_t tiles = a.num_mtiles * a.num_ntiles;
  for (int64_t i = gemm_block; i < tiles; i += gemm_blocks) {
    const TileCoord tc = layer1_tile(i, a.num_mtiles);
    compute(a.mtiles[tc.mtile], tc.ntile);
    ctx.delay();
    ctx.sync();
    if (ctx.thread() == 0)
      arrive_and_publish(&a.ntile_count[tc.ntile], uint32_t(a.num_mtiles), &a.ntile_ready[tc.ntile],
                         a.epoch);
  }
}

}  // namespace comet
