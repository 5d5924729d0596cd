// Dispatch layout, row origins and tile visit orders on random worlds, fed by the prologue
// programs (send plan, tile plan) on a small CPU grid.
#include <algorithm>
#include <random>
#include <vector>

#include "check.h"
#include "comet/layout.h"
#include "comet/prologue.h"
#include "comet/tile_order.h"
#include "cpu/block_runner.h"
#include "cpu/grid_scratch.h"

using namespace comet;

int main() {
  std::mt19937 rng(1);
  for (int iter = 0; iter < 200; ++iter) {
    const int32_t W = 1 + rng() % 8, el = 1 + rng() % 3, E = W * el, k = 1 + rng() % 4;
    std::vector<std::vector<int32_t>> ids(W), bucket(W), slot(W), pos(W);
    std::vector<int64_t> tokens(W);
    for (int32_t s = 0; s < W; ++s) {
      tokens[s] = rng() % 10;
      ids[s].resize(size_t(tokens[s] * k));
      for (auto& v : ids[s]) v = int32_t(rng() % (E + 1)) - 1;
      bucket[s].resize(size_t(E) + 1);
      slot[s].resize(ids[s].size());
      pos[s].resize(ids[s].size());
      cpu::GridScratch sc(2, 2, E, 0, 0);
      const PrologueScratch ps = sc.view();
      int64_t rows = -1;
      cpu::run_grid(nullptr, 2, 2, 0, [&](cpu::CpuContext& ctx) {
        const int64_t r = send_plan_program(ctx, ps, ids[s].data(), tokens[s], k, E,
                                            bucket[s].data(), slot[s].data(), pos[s].data());
        if (grid_rank(ctx) == 0) rows = r;
      });
      CHECK(rows == std::count_if(ids[s].begin(), ids[s].end(), [](int32_t v) { return v >= 0; }));
    }
    for (int32_t d = 0; d < W; ++d) {
      std::vector<int32_t> rc(size_t(W) * el);
      for (int32_t s = 0; s < W; ++s)
        for (int32_t e = 0; e < el; ++e) rc[s * el + e] = bucket[s][d * el + e + 1] - bucket[s][d * el + e];
      std::vector<int64_t> eo(size_t(el) + 1), so(size_t(el) * (W + 1));
      const int64_t M = build_dispatch_layout(rc.data(), d, W, el, eo.data(), so.data());
      // every row exactly once, and rows of one (expert, source) contiguous in ring order
      std::vector<int> seen(static_cast<size_t>(M), 0);
      for (int32_t s = 0; s < W; ++s)
        for (size_t i = 0; i < ids[s].size(); ++i) {
          const int32_t e = ids[s][i];
          if (e < 0 || e / el != d) continue;
          const int64_t row = dispatch_row(so.data(), W, d, s, e % el, pos[s][i]);
          CHECK(row >= eo[e % el] && row < eo[e % el + 1]);
          CHECK(row_origin(so.data(), W, e % el, row).ring_pos == ring_position(d, s, W));
          ++seen[size_t(row)];
        }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; }));
      // tile orders
      const int32_t tm = 1 + rng() % 5, nt = 1 + rng() % 3;
      const int64_t cap = ceil_div(M, tm) + el;
      std::vector<MTile> tiles(static_cast<size_t>(cap));
      std::vector<int64_t> order(static_cast<size_t>(cap));
      std::vector<int32_t> order_bucket(size_t(W) + 1);
      cpu::GridScratch sc(2, 2, W, 0, std::max(el, W));
      const PrologueScratch ps = sc.view();
      const TilePlanArgs ta{eo.data(), so.data(), W, el, tm, cap, tiles.data(), order.data(),
                            order_bucket.data()};
      int64_t mt = -1;
      cpu::run_grid(nullptr, 2, 2, 0, [&](cpu::CpuContext& ctx) {
        const int64_t n = tile_plan_program(ctx, ps, ta);
        if (grid_rank(ctx) == 0) mt = n;
      });
      CHECK(mt >= 0 && mt <= cap);
      if (mt < 0) continue;
      int32_t last = 0;
      std::vector<int> visits(size_t(mt * nt), 0);
      for (int64_t i = 0; i < mt * nt; ++i) {
        TileCoord tc = layer0_tile(i, order.data(), mt, nt, 1);  // raster group 1
        const int32_t dist = mtile_ring_distance(tiles[size_t(tc.mtile)], so.data(), W);
        CHECK(dist >= last);  // local-only tiles first, then ring distance 1, 2, ...
        last = dist;
        ++visits[size_t(tc.mtile * nt + tc.ntile)];
        TileCoord c1 = layer1_tile(i, mt, nt, layer1_band(1, nt), 1);
        CHECK(c1.ntile == i / mt && c1.mtile == i % mt);  // band 1: column-major
      }
      CHECK(std::all_of(visits.begin(), visits.end(), [](int v) { return v == 1; }));
      // layer1 in bands of b n-tiles (0 = all): bands in order, m-major inside a band, each
      // tile once
      for (int32_t band_n = 0; band_n <= nt + 1; ++band_n) {
        const int32_t b = layer1_band(band_n, nt);
        CHECK(b == (band_n == 0 || band_n > nt ? nt : band_n));
        std::vector<int> seen1(size_t(mt * nt), 0);
        int64_t i = 0;
        for (int32_t first = 0; first < nt; first += b) {
          const int32_t width = std::min(b, nt - first);
          CHECK(layer1_band_of(first + width - 1, b, nt).first == first);
          CHECK(layer1_band_of(first, b, nt).width == width);
          for (int64_t m = 0; m < mt; ++m)
            for (int32_t n = first; n < first + width; ++n, ++i) {
              const TileCoord c = layer1_tile(i, mt, nt, b, 1);
              CHECK(c.mtile == m && c.ntile == n);
              if (c.mtile >= 0 && c.mtile < mt && c.ntile >= 0 && c.ntile < nt)
                ++seen1[size_t(c.mtile * nt + c.ntile)];
            }
        }
        CHECK(i == mt * nt);
        CHECK(std::all_of(seen1.begin(), seen1.end(), [](int v) { return v == 1; }));
      }
    }
  }
  TEST_MAIN_END
}
