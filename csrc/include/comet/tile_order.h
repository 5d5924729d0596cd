// GEMM tile orders of the two fused kernels, parameterised by the tile shape (no fixed constants).
//
// A GEMM tile is (m-tile, n-tile); m-tiles never straddle experts: expert el's rows
// [expert_off[el], expert_off[el+1]) are cut into ceil(rows / tile_m) m-tiles, numbered globally
// expert-major. Tiles of both layers are numbered 0..num_mtiles*num_ntiles-1 in visit order, and
// GEMM block g of n_gemm takes tiles g, g + n_gemm, ... (a static, deterministic assignment).
//
// layer0: m-tiles are visited by the ring distance of the farthest source among their rows
// (0 = local only, then rows from the next rank, ...), ties in expert/row order; all n-tiles of an
// m-tile follow each other. The comm blocks fill m-tiles in this same order, so the local tiles
// can start at once while remote rows are still arriving.
// layer1: in column bands of b consecutive n-tiles (the last band may be narrower), bands in
// n-tile order; inside a band m-major across all experts: the band's n-tiles of m-tile 0, then of
// m-tile 1, ... So h is swept from HBM once per band (ceil(num_ntiles / b) times; each m-tile's
// rows are reused from L2 by the band's b tiles while the band's W1 columns stay in L2), and a
// band's column slice of the output is finished as a unit and its reduce-and-send can start.
// b = 1 is plain column-major order; b = num_ntiles sweeps h once but publishes only at the end.
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

// i-th tile visited by layer0, given tile_plan_program's m-tile order.
COMET_HD TileCoord layer0_tile(int64_t i, const int64_t* mtile_order, int32_t num_ntiles) {
  return TileCoord{mtile_order[i / num_ntiles], int32_t(i % num_ntiles)};
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

// i-th tile visited by layer1 (column bands of `band` n-tiles, from layer1_band; m-major inside).
COMET_HD TileCoord layer1_tile(int64_t i, int64_t num_mtiles, int32_t num_ntiles, int32_t band) {
  const int64_t per_band = num_mtiles * band;  // tiles of a full band
  const int32_t first = int32_t(i / per_band) * band;
  const int32_t width = num_ntiles - first < band ? num_ntiles - first : band;
  const int64_t j = i - int64_t(first) * num_mtiles;  // index inside the band
  return TileCoord{j / width, first + int32_t(j % width)};
}

}  // namespace comet
