// comet._C.engine: the portable engine's planning programs exposed for property tests
// (tests/test_engine_layout.py), run on a CPU grid of blocks x threads like the CPU backend runs
// them (the ops never go through these wrappers).
#include <torch/extension.h>

#include <mutex>
#include <string>
#include <vector>

#include "comet/activation.h"
#include "comet/fp8_rows.h"
#include "fp8_quant.h"
#include "op_checks.h"
#include "comet/gemm_schedule.h"
#include "comet/prologue.h"
#include "comet/grow_rule.h"
#include "comet/stream_rule.h"
#include "comet/capture_rule.h"
#include "comet/symm_layout.h"
#include "comet/topology.h"
#include "cpu/block_runner.h"
#include "cpu/grid_scratch.h"

namespace py = pybind11;

namespace {

using I32 = std::vector<int32_t>;
using I64 = std::vector<int64_t>;

// blocks x threads, at most `resident` blocks live at once (0: no limit): the programs' grid
// barriers need every block live, so the grid is the co-resident part of the blocks.
struct Grid {
  int32_t blocks, threads, resident = 0;
  int32_t size() const { return comet::cpu::co_resident(blocks, resident); }
};

// Runs body(ctx) on the grid.
template <class Body>
void on_grid(const Grid& g, Body&& body) {
  comet::cpu::run_grid(nullptr, g.size(), g.threads, 0, body, nullptr, g.resident);
}

py::tuple send_plan(const I32& ids, int64_t tokens, int32_t k, int32_t num_experts,
                    int32_t blocks, int32_t threads, int32_t resident) {
  I32 bucket_off(size_t(num_experts) + 1), send_slot(ids.size()), send_pos(ids.size());
  const Grid g{blocks, threads, resident};
  comet::cpu::GridScratch sc(g.size(), threads, num_experts, 0, 0);
  const comet::PrologueScratch ps = sc.view();
  int64_t rows = 0;
  on_grid(g, [&](comet::cpu::CpuContext& ctx) {
    const int64_t r = comet::send_plan_program(ctx, ps, ids.data(), tokens, k, num_experts,
                                               bucket_off.data(), send_slot.data(),
                                               send_pos.data());
    if (comet::grid_rank(ctx) == 0) rows = r;
  });
  send_slot.resize(size_t(rows));
  return py::make_tuple(bucket_off, send_slot, send_pos);
}

// dispatch_layout_program on a blocks x threads grid. counts_from (the sources' bucket offsets,
// one list per source) empty: from recv_counts as given (layer1), checked: a negative count
// raises. Returns (recv_counts, expert_off, seg_off).
py::tuple layout_on_grid(I32 recv_counts, const std::vector<I32>& counts_from, int32_t dest,
                         int32_t world, int32_t el, const Grid& g) {
  I64 expert_off(size_t(el) + 1), seg_off(size_t(el) * (world + 1));
  std::vector<const char*> from;
  for (const I32& bo : counts_from) from.push_back(reinterpret_cast<const char*>(bo.data()));
  recv_counts.resize(size_t(world) * el);
  comet::cpu::GridScratch sc(g.size(), g.threads, 1, 0, 0);
  const comet::PrologueScratch ps = sc.view();
  const comet::DispatchLayoutArgs a{from.empty() ? nullptr : from.data(), 0, dest, world, el,
                                    recv_counts.data(), expert_off.data(), seg_off.data(),
                                    from.empty()};
  int64_t rows = 0;
  on_grid(g, [&](comet::cpu::CpuContext& ctx) {
    const int64_t r = comet::dispatch_layout_program(ctx, ps, a);
    if (comet::grid_rank(ctx) == 0) rows = r;
  });
  TORCH_CHECK_VALUE(rows >= 0, "dispatch_layout: a negative recv_count");
  return py::make_tuple(recv_counts, expert_off, seg_off);
}

py::tuple dispatch_layout(const I32& recv_counts, int32_t dest, int32_t world, int32_t el,
                          int32_t blocks, int32_t threads) {
  py::tuple t = layout_on_grid(recv_counts, {}, dest, world, el, {blocks, threads});
  return py::make_tuple(t[1], t[2]);
}

py::tuple gather_dispatch_layout(const std::vector<I32>& bucket_offs, int32_t dest, int32_t el,
                                 int32_t blocks, int32_t threads) {
  TORCH_CHECK_VALUE(!bucket_offs.empty(), "gather_dispatch_layout: no sources");
  return layout_on_grid({}, bucket_offs, dest, int32_t(bucket_offs.size()), el,
                        {blocks, threads});
}

int64_t dispatch_row(const I64& seg_off, int32_t world, int32_t dest, int32_t source, int32_t el,
                     int32_t pos) {
  return comet::dispatch_row(seg_off.data(), world, dest, source, el, pos);
}

// m-tiles and (with seg_off) layer0's order from tile_plan_program on a blocks x threads grid.
std::vector<comet::MTile> mtiles_of(const I64& expert_off, const I64* seg_off, int32_t world,
                                    int32_t tile_m, I64* order, const Grid& g = {2, 1}) {
  const int32_t el = int32_t(expert_off.size()) - 1;
  int64_t cap = el;
  for (int32_t e = 0; e < el; ++e) cap += (expert_off[e + 1] - expert_off[e]) / tile_m;
  std::vector<comet::MTile> mt(size_t(std::max<int64_t>(cap, 1)));
  if (order) order->assign(mt.size(), -1);
  I32 bucket(size_t(world) + 1);
  I64 no_seg(size_t(el) * (world + 1), 0);
  comet::cpu::GridScratch sc(g.size(), g.threads, world, 0, std::max(el, world));
  const comet::PrologueScratch ps = sc.view();
  const comet::TilePlanArgs a{expert_off.data(), seg_off ? seg_off->data() : no_seg.data(), world,
                              el, tile_m, int64_t(mt.size()), mt.data(),
                              order ? order->data() : nullptr, bucket.data()};
  int64_t n = 0;
  on_grid(g, [&](comet::cpu::CpuContext& ctx) {
    const int64_t r = comet::tile_plan_program(ctx, ps, a);
    if (comet::grid_rank(ctx) == 0) n = r;
  });
  mt.resize(size_t(n));
  if (order) order->resize(size_t(n));
  return mt;
}

// [(row_begin, rows, expert)] in global m-tile numbering.
std::vector<std::tuple<int64_t, int32_t, int32_t>> mtiles(const I64& expert_off, int32_t tile_m,
                                                          int32_t blocks, int32_t threads,
                                                          int32_t resident) {
  std::vector<std::tuple<int64_t, int32_t, int32_t>> out;
  for (const auto& m :
       mtiles_of(expert_off, nullptr, 1, tile_m, nullptr, {blocks, threads, resident}))
    out.emplace_back(m.row_begin, m.rows, m.expert);
  return out;
}

// Visit order of GEMM tiles as [(mtile, ntile)] for gemm_blocks GEMM blocks (group 0: the raster
// group those blocks get, tile_order.h); layer 0 needs seg_off and world.
std::vector<std::pair<int64_t, int32_t>> tile_order(int32_t layer, const I64& expert_off,
                                                    const I64& seg_off, int32_t world,
                                                    int32_t tile_m, int32_t num_ntiles,
                                                    int32_t blocks, int32_t threads,
                                                    int32_t band_n, int32_t resident,
                                                    int32_t group, int32_t gemm_blocks) {
  I64 order;
  auto mt = mtiles_of(expert_off, &seg_off, world, tile_m, &order, {blocks, threads, resident});
  comet::GemmScheduleArgs a{0, mt.data(), int64_t(mt.size()), num_ntiles, order.data(), nullptr,
                            nullptr, nullptr};
  a.band_n = band_n;
  a.group = group;
  std::vector<std::pair<int64_t, int32_t>> out;
  for (int64_t i = 0; i < a.num_mtiles * num_ntiles; ++i) {
    const comet::TileCoord tc = comet::schedule_tile(layer, i, a, gemm_blocks);
    out.emplace_back(tc.mtile, tc.ntile);
  }
  return out;
}

// layer1's GEMM schedule (gemm_schedule.h) on a grid of gemm_blocks x threads with no-op tiles:
// for every tile computed, (m-tile, n-tile, how many of its band's flags were already published
// when it started), then the flags and the arrival counters after the call (epoch 1).
py::tuple layer1_schedule(int64_t num_mtiles, int32_t num_ntiles, int32_t band_n,
                          int32_t gemm_blocks, int32_t threads, int32_t group) {
  std::vector<comet::MTile> mt(size_t(num_mtiles), comet::MTile{0, 1, 0});
  std::vector<uint64_t> flags(size_t(num_ntiles), 0);
  std::vector<uint32_t> counts(size_t(num_ntiles), 0);
  comet::GemmScheduleArgs a{1, mt.data(), num_mtiles, num_ntiles, nullptr, nullptr, counts.data(),
                            flags.data()};
  a.band_n = band_n;
  a.group = group;
  const int32_t band = comet::layer1_band(band_n, num_ntiles);
  std::mutex mu;
  std::vector<std::tuple<int64_t, int32_t, int32_t>> seen;
  comet::cpu::run_grid(nullptr, gemm_blocks, threads, 0, [&](comet::cpu::CpuContext& ctx) {
    comet::layer1_gemm(ctx, ctx.block(), gemm_blocks, a, [&](const comet::MTile& m, int32_t n) {
      if (ctx.thread() != 0) return;
      const comet::Band b = comet::layer1_band_of(n, band, num_ntiles);
      int32_t published = 0;
      for (int32_t j = b.first; j < b.first + b.width; ++j)
        published += comet::flag_acquire(&flags[size_t(j)]) != 0;
      std::lock_guard<std::mutex> lock(mu);
      seen.emplace_back(int64_t(&m - mt.data()), n, published);
    });
  });
  return py::make_tuple(seen, flags, counts);
}

int32_t mtile_ring_distance(const I64& expert_off, const I64& seg_off, int32_t world,
                            int32_t tile_m, int64_t mtile) {
  auto mt = mtiles_of(expert_off, &seg_off, world, tile_m, nullptr);
  return comet::mtile_ring_distance(mt.at(size_t(mtile)), seg_off.data(), world);
}

// reduce_rpn > 0: node-reduced partials of a token homed at `home` (layout.h: slot_groups);
// tp > 1: expert tensor parallelism (flat only; el = E / (W / tp)).
py::tuple partial_slot(const I32& token_ids, int32_t el, int32_t rank, int32_t reduce_rpn,
                       int32_t home, int32_t tp) {
  if (tp < 1 || (tp > 1 && reduce_rpn > 0))
    throw py::value_error("comet: partial_slot needs tp >= 1, and reduce_rpn 0 when tp > 1");
  auto p = comet::partial_slot(token_ids.data(), int32_t(token_ids.size()), el, rank,
                               comet::slot_groups(reduce_rpn, home, rank), tp);
  return py::make_tuple(p.count, p.ordinal);
}

}  // namespace



void bind_prologue_bench(py::module_& engine);  // prologue_bench.cpp
void bind_copy_bench(py::module_& engine);      // copy_bench.cpp

void bind_engine(py::module_& m) {
  auto e = m.def_submodule("engine", "the portable engine's planning functions, for tests");
  bind_prologue_bench(e);
  bind_copy_bench(e);
  e.def("send_plan", &send_plan, py::arg("ids"), py::arg("tokens"), py::arg("k"),
        py::arg("num_experts"), py::arg("blocks") = 1, py::arg("threads") = 1,
        py::arg("resident_blocks") = 0);
  e.def("dispatch_layout", &dispatch_layout, py::arg("recv_counts"), py::arg("dest"),
        py::arg("world"), py::arg("el"), py::arg("blocks") = 1, py::arg("threads") = 1);
  e.def("gather_dispatch_layout", &gather_dispatch_layout, py::arg("bucket_offs"),
        py::arg("dest"), py::arg("el"), py::arg("blocks") = 1, py::arg("threads") = 1);
  e.def("dispatch_row", &dispatch_row);
  e.def("mtiles", &mtiles, py::arg("expert_off"), py::arg("tile_m"), py::arg("blocks") = 1,
        py::arg("threads") = 1, py::arg("resident_blocks") = 0);
  e.def("tile_order", &tile_order, py::arg("layer"), py::arg("expert_off"), py::arg("seg_off"),
        py::arg("world"), py::arg("tile_m"), py::arg("num_ntiles"), py::arg("blocks") = 1,
        py::arg("threads") = 1, py::arg("band_n") = 1, py::arg("resident_blocks") = 0,
        py::arg("group") = 1, py::arg("gemm_blocks") = 1);
  e.def("layer1_schedule", &layer1_schedule, py::arg("num_mtiles"), py::arg("num_ntiles"),
        py::arg("band_n"), py::arg("gemm_blocks") = 1, py::arg("threads") = 1,
        py::arg("group") = 1);
  e.def("raster_group", &comet::raster_group, py::arg("n_gemm"));
  e.def("mtile_ring_distance", &mtile_ring_distance);
  e.def("partial_slot", &partial_slot, py::arg("token_ids"), py::arg("el"), py::arg("rank"),
        py::arg("reduce_rpn") = 0, py::arg("home") = 0, py::arg("tp") = 1);
  // comet/topology.h: (relay rank, mirror slot) of source s's data for node b.
  e.def("node_route", [](int32_t world, int32_t ranks_per_node, int32_t s, int32_t b) {
    const comet::NodeTopology t{world, ranks_per_node};
    return std::make_pair(t.relay(s, b), t.mirror_slot(s, b));
  });
  // comet/symm_layout.h: the data segment bytes of one call (op 0: layer0, 1: layer1) on a group
  // of `world` ranks in nodes of `ranks_per_node` (0: one node); what both backends size their
  // segment by (comet.buffers.symm.required_bytes).
  e.def(
      "region_bytes",
      [](int32_t op, int64_t tokens, int32_t hidden, int32_t topk, int32_t experts, int32_t world,
         int32_t elem_bytes, int32_t acc_bytes, int32_t ranks_per_node, bool node_reduce,
         int32_t tp) {
        if (op < 0 || op > 1 || tokens < 0 || hidden < 0 || topk < 1 || experts < 1 ||
            world < 1 || elem_bytes < 1 || acc_bytes < 1 || tp < 1 || world % tp != 0)
          throw py::value_error("comet: region_bytes needs op 0/1, tokens/hidden >= 0, "
                                "topk/experts/world/elem/acc >= 1, tp dividing world");
        const int32_t rpn = ranks_per_node > 0 ? ranks_per_node : world;
        if (world % rpn != 0)
          throw py::value_error("comet: ranks_per_node=" + std::to_string(rpn) +
                                " does not divide the group size " + std::to_string(world));
        const comet::NodeTopology t{world, rpn, node_reduce ? 1 : 0};
        return int64_t(comet::call_regions(t, comet::OpKind(op), tokens, hidden, topk, experts,
                                           elem_bytes, acc_bytes, tp)
                           .total);
      },
      py::arg("op"), py::arg("tokens"), py::arg("hidden"), py::arg("topk"), py::arg("experts"),
      py::arg("world"), py::arg("elem_bytes"), py::arg("acc_bytes") = 4,
      py::arg("ranks_per_node") = 0, py::arg("node_reduce") = false, py::arg("tp") = 1);
  e.def("header_bytes", [](int32_t world) { return int64_t(comet::header_bytes(world)); });
  // comet/activation.h's B-row remap of a fused activation's tile of h's columns [j0, j0 + half):
  // the w0 row each of its 2 * half B rows loads, -1 where out of range.
  e.def("activation_b_rows", [](int64_t half, int64_t f, int64_t j0) {
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < 2 * half; ++i)
      rows.push_back(comet::activation_b_row_valid(i, half, f, j0)
                         ? comet::activation_b_row(i, half, f, j0)
                         : -1);
    return rows;
  });
  // comet/fp8_rows.h: bytes of one packed FP8 token row of `hidden` values and the offset of its
  // scales (comet.fp8.row_bytes / unpack_rows, required_bytes for FP8 rows).
  e.def("fp8_row_bytes", [](int64_t hidden) { return comet::fp8_row_bytes(hidden); });
  e.def("fp8_row_scales_at", [](int64_t hidden) { return comet::fp8_row_scales_at(hidden); });
  // comet/fp8_rows.h's float -> float8_e4m3fn rounding on a float32 CPU tensor (bits as uint8), for
  // the tests that hold it to torch's own conversion.
  e.def("fp8_from_float", [](const at::Tensor& t) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "fp8_from_float: float32 CPU");
    const at::Tensor f = t.contiguous();
    at::Tensor out = at::empty(f.sizes(), f.options().dtype(at::kByte));
    const float* src = f.data_ptr<float>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    for (int64_t i = 0; i < f.numel(); ++i) dst[i] = comet::float_to_fp8e4m3(src[i]);
    return out;
  });
  // dispatch_fp8's sending-side quantiser of the CPU backend (packed rows), for the same tests.
  e.def("fp8_quantize_pack_rows", [](const at::Tensor& x) { return comet::fp8_quantize_pack_rows(x); });
  // comet/grow_rule.h: the sizes a segment grows to (first, second; 0: none), and the one a
  // heap with a known limit picks (0: refused).
  e.def("grow_steps", [](uint64_t need, uint64_t capacity, uint64_t align) {
    const comet::GrowSteps s = comet::grow_steps(need, capacity, align);
    return std::make_pair(uint64_t(s.first), uint64_t(s.second));
  });
  e.def("grow_size_within", [](uint64_t need, uint64_t capacity, uint64_t align, uint64_t limit) {
    return uint64_t(comet::grow_size_within(need, capacity, align, limit));
  });
  // comet/stream_rule.h, for tests with made-up stream ids: the StreamStep as an int.
  e.def("stream_step", [](bool has_bound, uint64_t bound, bool bound_capturing, uint64_t current,
                          bool current_capturing) {
    return int32_t(comet::stream_step(has_bound, bound, bound_capturing, current,
                                      current_capturing));
  });
  // comet/capture_rule.h, for tests without a GPU: a launch's staleness after grows, the stale
  // replay's error and the refusal of a capture across nodes ("" when allowed).
  e.def("stale_launch", [](uint64_t launched, uint64_t current) {
    return comet::stale_launch(launched, current);
  });
  e.def("next_generation", [](uint64_t g) { return comet::next_generation(g); });
  e.def("stale_graph_message", [](uint64_t captured_bytes, uint64_t current_bytes) {
    return comet::stale_graph_message(captured_bytes, current_bytes);
  });
  e.def("capture_refusal", [](int32_t nodes, bool capturing) {
    return comet::capture_refusal(nodes, capturing);
  });
  // The ops' launch checks (csrc/op_checks.cpp) for a device type without a call: the message
  // Checker::launch gives (and Checker::grid's for a grid of at most grid_limit blocks, when >= 0),
  // "" when accepted. CUDA's rules (the one tile shape, the co-resident grid) on a CPU machine.
  e.def(
      "launch_check",
      [](const std::string& device, int64_t n_comm, int64_t n_gemm, int64_t tile_m, int64_t tile_n,
         int64_t band_n, int64_t grid_limit, const std::string& limit_why) {
        comet::Checker c("comet.moe_layer0", at::Device(device), /*read_values=*/false);
        if (c.launch({n_comm, n_gemm, tile_m, tile_n, band_n}) && grid_limit >= 0)
          c.grid(n_comm, n_gemm, grid_limit, limit_why);
        return c.result().message;
      },
      py::arg("device"), py::arg("n_comm"), py::arg("n_gemm"), py::arg("tile_m"),
      py::arg("tile_n"), py::arg("band_n") = 1, py::arg("grid_limit") = -1,
      py::arg("limit_why") = "");

}
