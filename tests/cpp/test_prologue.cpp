// The multi-block prologue programs (comet/prologue.h) on CPU grids of several shapes, against a
// sequential oracle written here from docs/design.md's definitions: identical send plans, dispatch
// layouts (gathered or given recv_counts; negative counts refused), m-tiles, layer0 orders and
// reduce plans (bitwise, element by element) for random worlds including empty ranks, dropped
// slots and duplicate experts.
#include <atomic>
#include <algorithm>
#include <random>
#include <vector>

#include "check.h"
#include "cpu/block_runner.h"
#include "cpu/grid_scratch.h"
#include "comet/prologue.h"

using namespace comet;

namespace {

// Sequential oracle of the send plan: stable counting sort of slots by expert.
void oracle_send_plan(const std::vector<int32_t>& ids, int32_t E, std::vector<int32_t>& bucket,
                      std::vector<int32_t>& slot, std::vector<int32_t>& pos) {
  bucket.assign(size_t(E) + 1, 0);
  for (int32_t v : ids)
    if (v >= 0) ++bucket[size_t(v) + 1];
  for (int32_t e = 0; e < E; ++e) bucket[e + 1] += bucket[e];
  std::vector<int32_t> fill(bucket.begin(), bucket.end() - 1);
  slot.assign(size_t(bucket[E]), -1);
  pos.assign(ids.size(), -1);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) continue;
    const int32_t p = fill[ids[i]]++;
    slot[p] = int32_t(i);
    pos[i] = p - bucket[ids[i]];
  }
}

bool token_has_local_slot(const int32_t* ids, int32_t k, int32_t experts_local, int32_t rank) {
  for (int32_t j = 0; j < k; ++j)
    if (ids[j] >= 0 && ids[j] / experts_local == rank) return true;
  return false;
}

struct Grid {
  int32_t blocks, threads;
};

}  // namespace

int main() {
  std::mt19937 rng(7);
  const Grid grids[] = {{1, 1}, {1, 3}, {2, 4}, {3, 5}, {4, 8}};
  for (int iter = 0; iter < 120; ++iter) {
    const Grid g = grids[iter % 5];
    const int64_t P = int64_t(g.blocks) * g.threads;
    const int32_t W = 1 + rng() % 6, el = 1 + rng() % 3, E = W * el, k = 1 + rng() % 4;
    std::vector<std::vector<int32_t>> ids(W), bucket(W), slot(W), pos(W), pair_off(W), pair_slot(W);
    std::vector<std::vector<float>> weights(W);
    std::vector<int64_t> tokens(W);
    for (int32_t s = 0; s < W; ++s) {
      tokens[s] = (rng() % 5 == 0) ? 0 : rng() % 40;  // empty ranks now and then
      ids[s].resize(size_t(tokens[s] * k));
      for (auto& v : ids[s]) v = int32_t(rng() % (E + 1)) - 1;  // -1: dropped slot
      weights[s].resize(ids[s].size());
      for (auto& w : weights[s]) w = float(rng() % 1000) / 7.0f;
      std::vector<int32_t> ob, os, op;
      oracle_send_plan(ids[s], E, ob, os, op);

      cpu::GridScratch sc(g.blocks, g.threads, std::max(E, W), int64_t(ids[s].size()), 0);
      const PrologueScratch ps = sc.view();
      bucket[s].assign(size_t(E) + 1, -7);
      slot[s].assign(ids[s].size(), -7);
      pos[s].assign(ids[s].size(), -7);
      pair_off[s].assign(size_t(W) + 1, -7);
      pair_slot[s].assign(ids[s].size(), -7);
      std::vector<int64_t> work;
      cpu::run_grid(nullptr, g.blocks, g.threads, 0, [&](cpu::CpuContext& ctx) {
        send_plan_program(ctx, ps, ids[s].data(), tokens[s], k, E, bucket[s].data(),
                          slot[s].data(), pos[s].data());
        pair_list_program(ctx, ps, ids[s].data(), tokens[s], k, E, W, pair_off[s].data(),
                          pair_slot[s].data());
      }, &work);
      CHECK(bucket[s] == ob);
      CHECK(std::equal(os.begin(), os.end(), slot[s].begin()));
      CHECK(pos[s] == op);
      // Pairs: (d, t) for every distinct destination d of token t, ordered by (d, t), each the
      // token's first slot on d.
      std::vector<int32_t> want_off(size_t(W) + 1, 0), want;
      for (int32_t d = 0; d < W; ++d) {
        for (int64_t t = 0; t < tokens[s]; ++t)
          for (int32_t j = 0; j < k; ++j) {
            const int32_t e = ids[s][size_t(t * k + j)];
            if (e < 0 || e / el != d) continue;
            want.push_back(int32_t(t * k + j));
            break;
          }
        want_off[size_t(d) + 1] = int32_t(want.size());
      }
      CHECK(pair_off[s] == want_off);
      CHECK(std::equal(want.begin(), want.end(), pair_slot[s].begin()));
      // Span: every thread handled about T*k/P slots plus O(E) counters and scan cells.
      const int64_t bound = 2 * (ceil_div(tokens[s] * k, P) * 3 + 4 * std::max(E, W) + 64);
      CHECK(*std::max_element(work.begin(), work.end()) <= bound);
    }

    for (int32_t d = 0; d < W; ++d) {
      std::vector<int32_t> rc(size_t(W) * el);
      for (int32_t s = 0; s < W; ++s)
        for (int32_t e = 0; e < el; ++e)
          rc[s * el + e] = bucket[s][d * el + e + 1] - bucket[s][d * el + e];
      std::vector<int64_t> eo(size_t(el) + 1), so(size_t(el) * (W + 1));
      const int64_t M = build_dispatch_layout(rc.data(), d, W, el, eo.data(), so.data());
      {
        // dispatch_layout_program: recv_counts gathered from the sources' bucket offsets (layer0)
        // and the layout, bit for bit the sequential one; from given counts (layer1) the same,
        // and a negative count refused when checked. Span: a share of the E_local*(W+1) cells.
        std::vector<const char*> from(static_cast<size_t>(W));
        for (int32_t s = 0; s < W; ++s) from[s] = reinterpret_cast<const char*>(bucket[s].data());
        std::vector<int32_t> grc(rc.size(), -7);
        std::vector<int64_t> geo(eo.size(), -7), gso(so.size(), -7);
        DispatchLayoutArgs la{from.data(), 0, d, W, el, grc.data(), geo.data(), gso.data(), false};
        cpu::GridScratch lsc(g.blocks, g.threads, 1, 0, 0);
        const PrologueScratch lps = lsc.view();
        int64_t got[3] = {-7, -7, -7};
        std::vector<int64_t> work;
        cpu::run_grid(nullptr, g.blocks, g.threads, 0, [&](cpu::CpuContext& ctx) {
          const int64_t m0 = dispatch_layout_program(ctx, lps, la);
          DispatchLayoutArgs given = la;
          given.counts_from = nullptr;
          given.check_counts = true;
          const int64_t m1 = dispatch_layout_program(ctx, lps, given);
          if (grid_rank(ctx) == 0) {
            got[0] = m0;
            got[1] = m1;
          }
        }, &work);
        CHECK(got[0] == M && got[1] == M);
        CHECK(grc == rc && geo == eo && gso == so);
        const int64_t cells = int64_t(el) * (W + 1);
        CHECK(*std::max_element(work.begin(), work.end()) <=
              2 * (2 * ceil_div(cells, P) + 2 * P / g.threads + 2 * 16 + 8));
        if (!grc.empty()) {
          grc[rng() % grc.size()] = -1;
          DispatchLayoutArgs bad = la;
          bad.counts_from = nullptr;
          bad.check_counts = true;
          cpu::run_grid(nullptr, g.blocks, g.threads, 0, [&](cpu::CpuContext& ctx) {
            const int64_t m = dispatch_layout_program(ctx, lps, bad);
            if (grid_rank(ctx) == 0) got[2] = m;
          });
          CHECK(got[2] == -1);
        }
      }
      const int32_t tm = 1 + rng() % 5;
      // m-tiles: expert-major cuts of tile_m rows
      std::vector<MTile> want_tiles;
      for (int32_t e = 0; e < el; ++e)
        for (int64_t r = eo[e]; r < eo[e + 1]; r += tm)
          want_tiles.push_back(MTile{r, int32_t(std::min<int64_t>(tm, eo[e + 1] - r)), e});
      const int64_t mt = int64_t(want_tiles.size());
      std::vector<int64_t> want_order(static_cast<size_t>(mt));
      for (int64_t i = 0; i < mt; ++i) want_order[size_t(i)] = i;
      std::stable_sort(want_order.begin(), want_order.end(), [&](int64_t a, int64_t b) {
        return mtile_ring_distance(want_tiles[size_t(a)], so.data(), W) <
               mtile_ring_distance(want_tiles[size_t(b)], so.data(), W);
      });

      // reduce plan oracle: entries (s, t) with a slot on d, source- then token-ascending
      std::vector<int32_t> w_src, w_tok, w_part;
      std::vector<int64_t> w_begin, w_row;
      std::vector<float> w_w;
      for (int32_t s = 0; s < W; ++s)
        for (int64_t t = 0; t < tokens[s]; ++t) {
          const int32_t* tid = ids[s].data() + t * k;
          if (!token_has_local_slot(tid, k, el, d)) continue;
          w_src.push_back(s);
          w_tok.push_back(int32_t(t));
          w_part.push_back(partial_slot(tid, k, el, d).ordinal);
          w_begin.push_back(int64_t(w_row.size()));
          for (int32_t j = 0; j < k; ++j) {
            if (tid[j] < 0 || tid[j] / el != d) continue;
            w_row.push_back(dispatch_row(so.data(), W, d, s, tid[j] % el, pos[s][size_t(t * k + j)]));
            w_w.push_back(weights[s][size_t(t * k + j)]);
          }
        }
      w_begin.push_back(int64_t(w_row.size()));
      CHECK(int64_t(w_row.size()) == M);

      std::vector<PlanSource<float>> src(static_cast<size_t>(W));
      for (int32_t s = 0; s < W; ++s)
        src[s] = PlanSource<float>{ids[s].data(), pos[s].data(), weights[s].data(),
                                   pair_off[s].data(), pair_slot[s].data()};
      const int64_t cap = std::max<int64_t>(M, 1);
      std::vector<int32_t> e_src(static_cast<size_t>(cap)), e_tok(static_cast<size_t>(cap)),
          e_part(static_cast<size_t>(cap));
      std::vector<int64_t> e_begin(static_cast<size_t>(cap) + 1), s_row(static_cast<size_t>(cap));
      std::vector<float> s_w(static_cast<size_t>(cap));
      std::vector<MTile> tiles(size_t(mt) + 1);
      std::vector<int64_t> order(size_t(mt) + 1);
      std::vector<int32_t> order_bucket(size_t(W) + 1);
      int64_t slots = -1, got_tiles = -1, entries = -1;
      cpu::GridScratch sc(g.blocks, g.threads, W, 0, std::max(el, W));
      const PrologueScratch ps = sc.view();
      ReducePlanArgs<float> ra{src.data(), d, W, k, el, so.data(), cap,
                               ReducePlan<float>{0, e_src.data(), e_tok.data(), e_part.data(),
                                                 e_begin.data(), s_row.data(), s_w.data()},
                               &slots};
      TilePlanArgs ta{eo.data(), so.data(), W, el, tm, mt + 1, tiles.data(), order.data(),
                      order_bucket.data()};
      cpu::run_grid(nullptr, g.blocks, g.threads, 0, [&](cpu::CpuContext& ctx) {
        const int64_t n = tile_plan_program(ctx, ps, ta);
        const int64_t en = reduce_plan_program(ctx, ps, ra);
        if (grid_rank(ctx) == 0) {
          got_tiles = n;
          entries = en;
        }
      });
      CHECK(got_tiles == mt);
      for (int64_t i = 0; i < mt; ++i) {
        CHECK(tiles[size_t(i)].row_begin == want_tiles[size_t(i)].row_begin);
        CHECK(tiles[size_t(i)].rows == want_tiles[size_t(i)].rows);
        CHECK(tiles[size_t(i)].expert == want_tiles[size_t(i)].expert);
        CHECK(order[size_t(i)] == want_order[size_t(i)]);
      }
      CHECK(entries == int64_t(w_src.size()));
      CHECK(slots == M);
      if (entries == int64_t(w_src.size()) && slots == M) {
        CHECK(std::equal(w_src.begin(), w_src.end(), e_src.begin()));
        CHECK(std::equal(w_tok.begin(), w_tok.end(), e_tok.begin()));
        CHECK(std::equal(w_part.begin(), w_part.end(), e_part.begin()));
        CHECK(std::equal(w_begin.begin(), w_begin.end(), e_begin.begin()));
        CHECK(std::equal(w_row.begin(), w_row.end(), s_row.begin()));
        CHECK(std::equal(w_w.begin(), w_w.end(), s_w.begin()));
      }
      // Too small a capacity is refused on every thread, nothing overrun, and the count that
      // exceeded it is reported (the entries when they do, else the slots).
      if (M > 1) {
        ra.cap = M - 1;
        int64_t refused = 0;
        std::atomic<int64_t> disagree{0};
        slots = -1;
        cpu::run_grid(nullptr, g.blocks, g.threads, 0, [&](cpu::CpuContext& ctx) {
          const int64_t en = reduce_plan_program(ctx, ps, ra);
          if (grid_rank(ctx) == 0) refused = en;
          if (en != kPlanEntriesOverflow && en != kPlanSlotsOverflow) ++disagree;
        });
        CHECK(disagree == 0);
        const int64_t want_refusal = int64_t(w_src.size()) > ra.cap ? kPlanEntriesOverflow
                                                                    : kPlanSlotsOverflow;
        CHECK(refused == want_refusal);
        CHECK(slots == (want_refusal == kPlanEntriesOverflow ? int64_t(w_src.size()) : M));
      }
    }
  }
  TEST_MAIN_END
}
