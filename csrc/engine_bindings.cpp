// comet._C.engine: the portable engine's planning functions exposed for property tests
// (tests/test_engine_layout.py). The ops never go through these wrappers.
#include <torch/extension.h>

#include <vector>

#include "comet/layout.h"
#include "comet/tile_order.h"

namespace py = pybind11;

namespace {

using I32 = std::vector<int32_t>;
using I64 = std::vector<int64_t>;

py::tuple send_plan(const I32& ids, int64_t tokens, int32_t k, int32_t num_experts) {
  I32 bucket_off(size_t(num_experts) + 1), send_slot(ids.size()), send_pos(ids.size()),
      fill(static_cast<size_t>(num_experts));
  const int64_t rows = comet::build_send_plan(ids.data(), tokens, k, num_experts, bucket_off.data(),
                                              send_slot.data(), send_pos.data(), fill.data());
  send_slot.resize(size_t(rows));
  return py::make_tuple(bucket_off, send_slot, send_pos);
}

py::tuple dispatch_layout(const I32& recv_counts, int32_t dest, int32_t world, int32_t el) {
  I64 expert_off(size_t(el) + 1), seg_off(size_t(el) * (world + 1));
  comet::build_dispatch_layout(recv_counts.data(), dest, world, el, expert_off.data(),
                               seg_off.data());
  return py::make_tuple(expert_off, seg_off);
}

int64_t dispatch_row(const I64& seg_off, int32_t world, int32_t dest, int32_t source, int32_t el,
                     int32_t pos) {
  return comet::dispatch_row(seg_off.data(), world, dest, source, el, pos);
}

std::vector<comet::MTile> mtiles_of(const I64& expert_off, int32_t tile_m) {
  const int32_t el = int32_t(expert_off.size()) - 1;
  std::vector<comet::MTile> mt(size_t(comet::count_mtiles(expert_off.data(), el, tile_m)));
  comet::build_mtiles(expert_off.data(), el, tile_m, mt.data());
  return mt;
}

// [(row_begin, rows, expert)] in global m-tile numbering.
std::vector<std::tuple<int64_t, int32_t, int32_t>> mtiles(const I64& expert_off, int32_t tile_m) {
  std::vector<std::tuple<int64_t, int32_t, int32_t>> out;
  for (const auto& m : mtiles_of(expert_off, tile_m)) out.emplace_back(m.row_begin, m.rows, m.expert);
  return out;
}

// Visit order of GEMM tiles as [(mtile, ntile)]; layer 0 needs seg_off and world.
std::vector<std::pair<int64_t, int32_t>> tile_order(int32_t layer, const I64& expert_off,
                                                    const I64& seg_off, int32_t world,
                                                    int32_t tile_m, int32_t num_ntiles) {
  auto mt = mtiles_of(expert_off, tile_m);
  const int64_t n = int64_t(mt.size());
  I64 order(static_cast<size_t>(n)), scratch(size_t(world) + 1);
  if (layer == 0)
    comet::layer0_mtile_order(mt.data(), n, seg_off.data(), world, order.data(), scratch.data());
  std::vector<std::pair<int64_t, int32_t>> out;
  for (int64_t i = 0; i < n * num_ntiles; ++i) {
    auto tc = layer == 0 ? comet::layer0_tile(i, order.data(), num_ntiles) : comet::layer1_tile(i, n);
    out.emplace_back(tc.mtile, tc.ntile);
  }
  return out;
}

int32_t mtile_ring_distance(const I64& expert_off, const I64& seg_off, int32_t world,
                            int32_t tile_m, int64_t mtile) {
  auto mt = mtiles_of(expert_off, tile_m);
  return comet::mtile_ring_distance(mt.at(size_t(mtile)), seg_off.data(), world);
}

py::tuple partial_slot(const I32& token_ids, int32_t el, int32_t rank) {
  auto p = comet::partial_slot(token_ids.data(), int32_t(token_ids.size()), el, rank);
  return py::make_tuple(p.count, p.ordinal);
}

}  // namespace

void bind_engine(py::module_& m) {
  auto e = m.def_submodule("engine", "the portable engine's planning functions, for tests");
  e.def("send_plan", &send_plan);
  e.def("dispatch_layout", &dispatch_layout);
  e.def("dispatch_row", &dispatch_row);
  e.def("mtiles", &mtiles);
  e.def("tile_order", &tile_order);
  e.def("mtile_ring_distance", &mtile_ring_distance);
  e.def("partial_slot", &partial_slot);
}
