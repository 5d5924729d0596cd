// comet._C.engine.prologue_bench: runs the engine's multi-block prologue programs (comet/prologue.h:
// send plan, pair lists, dispatch layout, tile plans, reduce plan)
// on a CPU grid of blocks x threads OS threads (the CPU backend's thread teams) for one simulated
// destination rank of a world of W ranks with random top-k routing, and reports per program the
// span (the largest number of elements one thread was assigned, from ctx.work()) and the time
// between two grid barriers around it. Used by bench/prologue.py and its test.
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <vector>

#include "comet/prologue.h"
#include "cpu/block_runner.h"
#include "cpu/grid_scratch.h"

namespace py = pybind11;

namespace {

using namespace comet;
using cpu::GridScratch;

struct Measured {
  int64_t span;
  double seconds;
};

// Runs body(ctx) on the grid between two grid barriers; span = max work over the grid's threads.
template <class Body>
Measured run_measured(int32_t blocks, int32_t threads, const PrologueScratch& s, Body&& body) {
  std::vector<int64_t> work;
  double seconds = 0;
  cpu::run_grid(nullptr, blocks, threads, 0, [&](cpu::CpuContext& ctx) {
    grid_sync(ctx, s.bar);
    const auto t0 = std::chrono::steady_clock::now();
    body(ctx);
    grid_sync(ctx, s.bar);
    if (grid_rank(ctx) == 0)
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }, &work);
  return Measured{*std::max_element(work.begin(), work.end()), seconds};
}

struct Source {
  std::vector<int32_t> ids, bucket, slot, pos, pair_off, pair_slot;
  std::vector<float> weights;
};

py::dict prologue_bench(int64_t tokens, int32_t k, int32_t experts, int32_t world, int32_t blocks,
                        int32_t threads, int32_t tile_m, uint64_t seed) {
  TORCH_CHECK_VALUE(world >= 1 && experts % world == 0 && k >= 1 && k <= experts,
                    "prologue_bench: need W | E and 1 <= k <= E, got W=", world, " E=", experts,
                    " k=", k);
  TORCH_CHECK_VALUE(blocks >= 1 && threads >= 1 && threads <= 1024, "prologue_bench: bad grid ",
                    blocks, "x", threads);
  const int32_t el = experts / world;
  const int64_t P = int64_t(blocks) * threads;
  std::mt19937_64 rng(seed);
  std::vector<Source> src(static_cast<size_t>(world));
  std::vector<int32_t> perm(static_cast<size_t>(experts));
  for (auto& s : src) {  // top-k routing: k distinct experts per token, uniform
    s.ids.resize(size_t(tokens * k));
    s.weights.resize(s.ids.size());
    for (int64_t t = 0; t < tokens; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      for (int32_t j = 0; j < k; ++j) {
        std::swap(perm[j], perm[j + rng() % (experts - j)]);
        s.ids[size_t(t * k + j)] = perm[j];
        s.weights[size_t(t * k + j)] = float(rng() % 1000) / 1000.0f;
      }
    }
    s.bucket.resize(size_t(experts) + 1);
    s.slot.resize(s.ids.size());
    s.pos.resize(s.ids.size());
    s.pair_off.resize(size_t(world) + 1);
    s.pair_slot.resize(s.ids.size());
  }
  py::dict out;
  auto record = [&](const char* name, const Measured& m) {
    py::dict d;
    d["span"] = m.span;
    d["seconds"] = m.seconds;
    out[name] = d;
  };
  // Source programs: rank 0 on the measured grid, the others (inputs of rank 0's destination side)
  // on a single thread.
  for (int32_t r = 0; r < world; ++r) {
    Source& s = src[size_t(r)];
    const int32_t b = r == 0 ? blocks : 1, th = r == 0 ? threads : 1;
    GridScratch g(b, th, std::max(experts, world), tokens * k, 0);
    const PrologueScratch ps = g.view();
    const Measured send = run_measured(b, th, ps, [&](cpu::CpuContext& ctx) {
      send_plan_program(ctx, ps, s.ids.data(), tokens, k, experts, s.bucket.data(), s.slot.data(),
                        s.pos.data());
    });
    const Measured pairs = run_measured(b, th, ps, [&](cpu::CpuContext& ctx) {
      pair_list_program(ctx, ps, s.ids.data(), tokens, k, experts, world, s.pair_off.data(),
                        s.pair_slot.data());
    });
    if (r == 0) {
      record("send_plan", send);
      record("pair_list", pairs);
    }
  }
  // Destination side of rank 0.
  const int32_t d = 0;
  std::vector<int32_t> rc(size_t(world) * el);
  for (int32_t s = 0; s < world; ++s)
    for (int32_t e = 0; e < el; ++e)
      rc[size_t(s * el + e)] = src[size_t(s)].bucket[size_t(d * el + e + 1)] -
                               src[size_t(s)].bucket[size_t(d * el + e)];
  std::vector<int64_t> eo(size_t(el) + 1), so(size_t(el) * (world + 1));
  const int64_t M = build_dispatch_layout(rc.data(), d, world, el, eo.data(), so.data());
  {
    // The begin kernel's layout step: recv_counts gathered from the sources' bucket offsets and
    // the layout as one scan (checked against the sequential build).
    std::vector<const char*> from(static_cast<size_t>(world));
    for (int32_t s = 0; s < world; ++s)
      from[size_t(s)] = reinterpret_cast<const char*>(src[size_t(s)].bucket.data());
    std::vector<int32_t> grc(rc.size());
    std::vector<int64_t> geo(eo.size()), gso(so.size());
    const DispatchLayoutArgs la{from.data(), 0, d, world, el, grc.data(), geo.data(), gso.data(),
                                false};
    GridScratch lg(blocks, threads, 1, 0, 0);
    const PrologueScratch lps = lg.view();
    record("dispatch_layout", run_measured(blocks, threads, lps, [&](cpu::CpuContext& ctx) {
             dispatch_layout_program(ctx, lps, la);
           }));
    TORCH_CHECK(grc == rc && geo == eo && gso == so, "prologue_bench: dispatch layout differs");
  }
  const int64_t cap_tiles = ceil_div(M, tile_m) + el;
  std::vector<MTile> tiles(static_cast<size_t>(cap_tiles));
  std::vector<int64_t> order(static_cast<size_t>(cap_tiles));
  std::vector<int32_t> order_bucket(size_t(world) + 1);
  GridScratch g(blocks, threads, world, 0, std::max(el, world));
  const PrologueScratch ps = g.view();
  int64_t num_tiles = 0;
  const TilePlanArgs ta0{eo.data(), so.data(), world, el, tile_m, cap_tiles, tiles.data(),
                         order.data(), order_bucket.data()};
  record("tile_plan_layer0", run_measured(blocks, threads, ps, [&](cpu::CpuContext& ctx) {
           const int64_t n = tile_plan_program(ctx, ps, ta0);
           if (grid_rank(ctx) == 0) num_tiles = n;
         }));
  TilePlanArgs ta1 = ta0;
  ta1.mtile_order = nullptr;
  record("tile_plan_layer1", run_measured(blocks, threads, ps, [&](cpu::CpuContext& ctx) {
           tile_plan_program(ctx, ps, ta1);
         }));
  std::vector<PlanSource<float>> ps_src(static_cast<size_t>(world));
  for (int32_t s = 0; s < world; ++s) {
    const Source& x = src[size_t(s)];
    ps_src[size_t(s)] = PlanSource<float>{x.ids.data(), x.pos.data(), x.weights.data(),
                                          x.pair_off.data(), x.pair_slot.data()};
  }
  const int64_t cap = std::max<int64_t>(M, 1);
  std::vector<int32_t> e_src(static_cast<size_t>(cap)), e_tok(static_cast<size_t>(cap)),
      e_part(static_cast<size_t>(cap));
  std::vector<int64_t> e_begin(static_cast<size_t>(cap) + 1), s_row(static_cast<size_t>(cap));
  std::vector<float> s_w(static_cast<size_t>(cap));
  int64_t slots = 0, entries = 0;
  const ReducePlanArgs<float> ra{ps_src.data(), d, world, k, el, so.data(), cap,
                                 ReducePlan<float>{0, e_src.data(), e_tok.data(), e_part.data(),
                                                   e_begin.data(), s_row.data(), s_w.data()},
                                 &slots};
  record("reduce_plan", run_measured(blocks, threads, ps, [&](cpu::CpuContext& ctx) {
           const int64_t n = reduce_plan_program(ctx, ps, ra);
           if (grid_rank(ctx) == 0) entries = n;
         }));
  TORCH_CHECK(entries >= 0 && slots == M, "prologue_bench: reduce plan refused (", entries, ", ",
              slots, " slots for ", M, " rows)");
  out["rows"] = M;
  out["mtiles"] = num_tiles;
  out["entries"] = entries;
  out["grid_threads"] = P;
  return out;
}

}  // namespace

void bind_prologue_bench(py::module_& engine) {
  engine.def("prologue_bench", &prologue_bench, py::arg("tokens"), py::arg("k"),
             py::arg("experts"), py::arg("world"), py::arg("blocks"), py::arg("threads"),
             py::arg("tile_m") = 128, py::arg("seed") = 0);
}
