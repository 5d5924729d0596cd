// GEMM tile orders of the two fused kernels, parameterised by the tile shape (no fixed constants).
//
// A GEMM tile is (m-tile, n-tile); m-tiles never straddle experts: expert el's rows
// [expert_off[el], expert_off[el+1]) are cut into ceil(rows / tile_m) m-tiles, numbered globally
// expert-major. Tiles of both layers are numbered 0..num_mtiles*num_ntiles-1 in visit order, and
// GEMM block g of n_gemm takes tiles g, g + n_gemm, ... (a static, deterministic assignment), so
// the n_gemm consecutive tiles of one "wave" run at the same time.
//
// Raster groups. Both orders cut their m-tile sequence into groups of `group` consecutive m-tiles
// and walk a group n-major: the group's m-tiles of its first n-tile, then of the next, ... A
// wave then touches about `group` m-tiles of A rows and n_gemm / group n-tiles of weights
// instead of 1 and n_gemm (group = 1, plain m-major order): with 128 x 128 tiles of K-deep
// operands the wave's distinct operand bytes are (group + n_gemm / group) * 128 * K * elem,
// least at group = sqrt(n_gemm) (raster_group): 23 tile-rows instead of 133 on 132 SMs. The
// weights of an expert are then read from HBM about ceil(m-tiles of the expert / group) times
// instead of once per m-tile (Mixtral's w0 at 4096 tokens: 8 times, ~15 GB per call). The rows
// of a group are reused from L2 across its n-tiles when the group's rows and a wave's weights fit
// there (comet/tune/model/gemm.py charges what does not).
//
// layer0: m-tiles are visited by the ring distance of the farthest source among their rows
// (0 = local only, then rows from the next rank, ...), ties in expert/row order; raster groups
// are runs of that order, so a group's tiles wait for at most `group` m-tiles beyond the order's
// prefix. The comm blocks fill m-tiles in this same order, so the local tiles can start at once
// while remote rows are still arriving.
// layer1: in column bands of b consecutive n-tiles (the last band may be narrower), bands in
// n-tile order; inside a band raster groups of m-tiles across all experts, each walked n-major
// over the band's n-tiles. So h is swept from HBM once per band (ceil(num_ntiles / b) times;
// each m-tile's rows are reused from L2 by the band's b tiles), and a band's column slice of the
// output is finished as a unit and its reduce-and-send can start. b = 1 is plain column-major
// order (groups change nothing then); b = num_ntiles sweeps h once but publishes only at the end.
#pragma once

#include "comet/config.h"
#include "comet/layout.h"

namespace comet {

struct MTile {
  int64_t row_begin;  // absolute first row
  int32_t rows;       // <= tile_m
  int32_t expert;     // local expert
};

// The m-tiles (expert-major cuts of tile_m rows) and layer0's visit order (a stable counting sort
// of m-tile ids by ring distance) are built by tile_plan_program (comet/prologue.h).

// Ring distance of the farthest source an m-tile needs (rows are ring-ordered inside an expert, so
// that is the ring position of its last row).
COMET_HD int32_t mtile_ring_distance(const MTile& mt, const int64_t* seg_off, int32_t world) {
  return row_origin(seg_off, world, mt.expert, mt.row_begin + mt.rows - 1).ring_pos;
}

struct TileCoord {
  int64_t mtile;  // global m-tile id
  int32_t ntile;
};

// m-tiles per raster group for n_gemm GEMM blocks: the largest g with g * g <= n_gemm (at least 1).
COMET_HD int32_t raster_group(int32_t n_gemm) {
  int32_t g = 1;
  while (int64_t(g + 1) * (g + 1) <= n_gemm) ++g;
  return g;
}

// The j-th tile of a run of `mtiles` m-tiles (from m0) walked in raster groups of `group` over
// `width` n-tiles (from n0): (index into the run's m-tiles, n-tile).
struct RunTile {
  int64_t m;
  int32_t n;
};
COMET_HD RunTile raster_tile(int64_t j, int64_t mtiles, int32_t width, int32_t group) {
  const int64_t g = group < 1 ? 1 : group;
  const int64_t first = j / (g * width) * g;  // the group's first m-tile
  const int64_t size = mtiles - first < g ? mtiles - first : g;
  const int64_t q = j - first * width;
  return RunTile{first + q % size, int32_t(q / size)};
}

// i-th tile visited by layer0, given tile_plan_program's m-tile order.
COMET_HD TileCoord layer0_tile(int64_t i, const int64_t* mtile_order, int64_t num_mtiles,
                               int32_t num_ntiles, int32_t group) {
  const RunTile t = raster_tile(i, num_mtiles, num_ntiles, group);
  return TileCoord{mtile_order[t.m], t.n};
}

// The band width layer1 runs with: band_n n-tiles per band, 0 (or more than there are) = all.
COMET_HD int32_t layer1_band(int32_t band_n, int32_t num_ntiles) {
  return band_n <= 0 || band_n > num_ntiles ? num_ntiles : band_n;
}

// The band of n-tile n: its first n-tile and width (the last band may be narrower).
struct Band {
  int32_t first, width;
};
COMET_HD Band layer1_band_of(int32_t ntile, int32_t band, int32_t num_ntiles) {
  const int32_t first = ntile / band * band;
  return Band{first, num_ntiles - first < band ? num_ntiles - first : band};
}

// i-th tile visited by layer1 (column bands of `band` n-tiles, from layer1_band; raster groups of
// `group` m-tiles inside).
COMET_HD TileCoord layer1_tile(int64_t i, int64_t num_mtiles, int32_t num_ntiles, int32_t band,
                               int32_t group) {
  const int64_t per_band = num_mtiles * band;  // tiles of a full band
  const int32_t first = int32_t(i / per_band) * band;
  const int32_t width = num_ntiles - first < band ? num_ntiles - first : band;
  const RunTile t = raster_tile(i - int64_t(first) * num_mtiles, num_mtiles, width, group);
  return TileCoord{t.m, first + t.n};
}

}  // namespace comet
