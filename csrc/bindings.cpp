// comet._C's Python surface besides the ops: creating, connecting and releasing symmetric heaps.
// comet/buffers/symm.py drives these steps with group barriers in between.
#include <torch/extension.h>

#include <cstring>

#include "cpu/block_runner.h"
#include "cpu/device_collective.h"
#include "cpu/symm_heap.h"

namespace {

using comet::cpu::find_heap;

// A rank whose call fails before reaching an op kernel (e.g. a tensor on the wrong device) still
// takes part in the metadata exchange, so every peer raises too instead of waiting.
std::string fail_call(int64_t handle, int32_t op, const std::string& message) {
  auto heap = find_heap(handle);
  comet::CallMeta me{};
  me.op = op;
  me.world = heap->world();
  me.group_hash = heap->group_hash();
  me.placement = heap->call_tag();
  me.max_rows = -1;
  me.error = 1;
  std::strncpy(me.message, message.c_str(), sizeof(me.message) - 1);
  const uint64_t e = heap->begin_call(me);
  std::string v = heap->verdict(op == 0 ? "comet.moe_layer0" : "comet.moe_layer1");
  heap->end_call(e);
  return v;
}

}  // namespace

void bind_engine(pybind11::module_& m);  // engine_bindings.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "comet native core: symmetric heaps (the ops are under torch.ops.comet)";
  m.def(
      "heap_create",
      [](int32_t rank, int32_t world, const std::string& job, int64_t group_hash, double timeout,
         int32_t ranks_per_node, double link_latency_us, double link_gbps) {
        try {
          return comet::cpu::register_heap(std::make_shared<comet::cpu::SymmHeap>(
              rank, world, job, group_hash, timeout, ranks_per_node,
              comet::cpu::LinkSettings{link_latency_us, link_gbps}));
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("rank"), py::arg("world"), py::arg("job"), py::arg("group_hash"), py::arg("timeout"),
      py::arg("ranks_per_node") = 0, py::arg("link_latency_us") = 0.0,
      py::arg("link_gbps") = 0.0);
  m.def("heap_link_stats", [](int64_t h) {
    comet::cpu::LinkProxy* p = find_heap(h)->proxy();
    return p ? std::make_pair(p->issued(), p->bytes_sent()) : std::make_pair(uint64_t(0), uint64_t(0));
  });
  m.def("heap_traffic", [](int64_t h) {
    const comet::cpu::SymmHeap::Traffic& t = find_heap(h)->traffic();
    return py::make_tuple(t.layer0_rows, t.layer0_bytes, t.layer1_rows, t.layer1_bytes);
  });
  m.def("heap_ranks_per_node",
        [](int64_t h) { return find_heap(h)->topology().ranks_per_node; });
  m.def("heap_set_node_reduce", [](int64_t h, bool on) { find_heap(h)->set_node_reduce(on); });
  m.def("heap_node_reduce", [](int64_t h) { return find_heap(h)->topology().node_reduce != 0; });
  m.def("heap_connect", [](int64_t h) { find_heap(h)->connect(); });
  m.def("heap_unlink_own", [](int64_t h) { find_heap(h)->unlink_own(); });
  m.def("heap_release", &comet::cpu::release_heap);
  m.def("heap_set_timeout", [](int64_t h, double s) { find_heap(h)->set_timeout(s); });
  m.def("heap_set_block_threads", [](int64_t h, int32_t n) {
    if (n < 0 || n > 1024)
      throw py::value_error("comet: threads_per_block must be in [1, 1024], got " +
                            std::to_string(n));
    find_heap(h)->set_block_threads(n);
  });
  m.def("heap_set_resident_blocks", [](int64_t h, int32_t n) {
    if (n < 0)
      throw py::value_error("comet: resident_blocks must be >= 0 (0: no limit), got " +
                            std::to_string(n));
    find_heap(h)->set_resident_blocks(n);
  });
  // What the calls run under: the buffer's setting, else $COMET_CPU_RESIDENT_BLOCKS (ValueError,
  // pybind11's std::invalid_argument, if that is malformed).
  m.def("heap_resident_blocks",
        [](int64_t h) { return comet::cpu::resident_blocks(*find_heap(h)); });
  m.def("heap_set_call_tag", [](int64_t h, int32_t t) { find_heap(h)->set_call_tag(t); });
  m.def("heap_fail_call", &fail_call, py::call_guard<py::gil_scoped_release>());
  // Collective (every rank of the group, between calls): grow the data segment to >= bytes.
  m.def("heap_reserve",
        [](int64_t h, int64_t bytes) {
          auto heap = find_heap(h);
          heap->recover_if_needed();
          heap->reserve(size_t(bytes));
        },
        py::call_guard<py::gil_scoped_release>());
  // Collective: re-arms the heap after a failed call (symm_heap.h); raises if a peer is gone.
  m.def("heap_recover", [](int64_t h) { find_heap(h)->recover(); },
        py::call_guard<py::gil_scoped_release>());
  m.def("heap_needs_rearm", [](int64_t h) { return find_heap(h)->needs_rearm(); });
  m.def("heap_rearm_round", [](int64_t h) { return int64_t(find_heap(h)->rearm_round()); });
  m.def("heap_set_sm_margin", [](int64_t h, int32_t n) {
    if (n < 0) throw py::value_error("comet: sm_margin must be >= 0, got " + std::to_string(n));
    find_heap(h)->set_sm_margin(n);
  });
  m.def("heap_sm_margin", [](int64_t h) { return find_heap(h)->sm_margin(); });
  // The device whose resident-block slots this heap's kernels share (csrc/cpu/slot_pool.h).
  m.def("heap_set_device", [](int64_t h, int64_t key) { find_heap(h)->set_device(key); });
  // Tests of the SM margin: a collective-like kernel on the heap's device (device_collective.h).
  m.def("heap_device_collective",
        [](int64_t h, int32_t blocks, int64_t tag, double timeout_s) {
          comet::cpu::device_collective(*find_heap(h), blocks, tag, timeout_s);
        },
        py::call_guard<py::gil_scoped_release>());
  // Resident-block slots of the heap's device held now by any kernel (tests of the SM margin).
  m.def("heap_slots_in_use", [](int64_t h) {
    comet::cpu::SlotPool* pool = find_heap(h)->slot_pool();
    std::lock_guard<std::mutex> lock(pool->mutex);
    return pool->used;
  });
  m.def("heap_set_data_limit", [](int64_t h, int64_t bytes) {
    if (bytes < 0)
      throw py::value_error("comet: heap_bytes must be >= 0 (0: no cap), got " +
                            std::to_string(bytes));
    find_heap(h)->set_data_limit(size_t(bytes));
  });
  m.def("heap_data_limit", [](int64_t h) { return int64_t(find_heap(h)->data_limit()); });
  m.def("heap_capacity", [](int64_t h) { return int64_t(find_heap(h)->capacity()); });
  m.def("heap_requested", [](int64_t h) { return int64_t(find_heap(h)->requested()); });
  bind_engine(m);
#ifdef COMET_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
