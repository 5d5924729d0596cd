// CPU kernels of torch.ops.comet.moe_layer0 / moe_layer1: input checks and the per-call protocol
// on the host, then the torch-free fused layers of fused_cpu.h on the tensors' memory.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "block_runner.h"
#include "fp8_quant.h"
#include "fused_cpu.h"
#include "op_checks.h"
#include "symm_heap.h"

namespace comet::cpu {
namespace {

// COMET_STRESS=<nonzero seed> injects random delays into every block (see cpu_context.h).
uint64_t stress_seed(uint64_t epoch, int32_t rank) {
  const char* s = std::getenv("COMET_STRESS");
  if (!s || !*s) return 0;
  uint64_t seed = std::strtoull(s, nullptr, 10);
  if (seed == 0) return 0;
  return seed * 0x9E3779B97F4A7C15ull + epoch * 131 + uint64_t(rank) + 1;
}

std::shared_ptr<SymmHeap> heap_or_throw(int64_t handle) {
  try {
    return find_heap(handle);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// `wire`: the kind of what crosses ranks (layer0's token rows, layer1's partials), which the
// ranks of a group must agree on.
CallMeta make_meta(OpKind op, const SymmHeap& heap, int64_t num_experts, int64_t topk,
                   int64_t hidden, int64_t cols, ScalarKind wire, int64_t tokens,
                   int64_t max_rows, const CheckResult& check, int64_t tp) {
  return make_call_meta(op, heap.world(), heap.group_hash(), num_experts, topk, hidden, cols,
                        check.ok() ? int32_t(wire) : -1, tokens, max_rows, check, tp,
                        heap.call_tag());
}

// Expert tensor parallelism runs on one node (the node-first routing and node-reduced partials
// of comet/topology.h are per rank, not per EP rank).
void check_tp_topology(Checker& c, const SymmHeap& heap, int64_t tp) {
  c.value(tp == 1 || heap.topology().nodes() == 1,
          "tp_size=" + std::to_string(tp) + " > 1 needs a group on one node (this group spans " +
              std::to_string(heap.topology().nodes()) + " nodes)");
}

// Exchanges metadata; raises (on every rank alike) if any rank's input was bad or ranks disagree.
uint64_t begin_checked_call(SymmHeap& heap, const CallMeta& me, const CheckResult& local,
                            const char* op) {
  const uint64_t e = heap.begin_call(me);
  std::string v = heap.verdict(op);
  if (v.empty()) return e;
  heap.end_call(e);
  if (!local.ok()) v = local.message;  // untruncated text for the rank that failed
  if (local.code == 2) TORCH_CHECK_TYPE(false, v);
  TORCH_CHECK_VALUE(false, v);
}

// Runs the body of a call; a failure inside leaves peers in an unknown state: the heap tells them
// and refuses calls until re-armed (symm_heap.h: mark_broken).
template <class Body>
auto guarded_call(SymmHeap& heap, uint64_t epoch, Body&& body) {
  try {
    auto result = body();
    heap.end_call(epoch);
    return result;
  } catch (const SegmentRefused&) {
    heap.end_call(epoch);  // refused alike on every rank before any data moved: nothing to re-arm
    throw;
  } catch (const std::exception& e) {
    heap.mark_broken(e.what());
    throw;
  }
}

// Threads per block of this heap's calls (Buffer(threads_per_block=), else the environment).
int32_t block_threads(const SymmHeap& heap) {
  return heap.block_threads() > 0 ? heap.block_threads() : default_block_threads();
}


// sm_margin: the call's (check_margin accepted it). Under a residency limit S (the rank's device
// of S resident-block slots, shared by every kernel of the rank: slot_pool.h) the call's kernels
// run on at most S - sm_margin of them; without one nothing is shared and the margin is moot.
CpuLaunch cpu_launch(const SymmHeap& heap, uint64_t epoch, int64_t n_comm, int64_t n_gemm,
                     int64_t tile_m, int64_t tile_n, int64_t band_n, int64_t sm_margin) {
  const int32_t S = resident_blocks(heap);
  CpuLaunch l{int32_t(n_comm),       int32_t(n_gemm),
              int32_t(tile_m),       int32_t(tile_n),
              block_threads(heap),   stress_seed(epoch, heap.rank()),
              int32_t(band_n),       S > 0 ? S - int32_t(sm_margin) : 0,
              int32_t(std::max<int64_t>(raster_group_setting(), 0))};
  if (S > 0) l.device = DeviceSlots{heap.slot_pool(), S};
  return l;
}

// The call's margin (-1: the buffer's), and that it leaves the call a slot of the device.
int64_t call_margin(const SymmHeap& heap, int64_t sm_margin) {
  return sm_margin == -1 ? heap.sm_margin() : sm_margin;
}
void check_margin(Checker& c, const SymmHeap& heap, int64_t margin) {
  const int32_t S = resident_blocks(heap);
  c.value(S == 0 || margin < S,
          "sm_margin=" + std::to_string(margin) + " leaves none of this rank's " +
              std::to_string(S) + " resident blocks (resident_blocks) to the call's kernels");
}

// A bad $COMET_CPU_BLOCK_THREADS or $COMET_CPU_RESIDENT_BLOCKS fails here, before the call starts.
void check_launch_settings(const SymmHeap& heap) {
  block_threads(heap);
  resident_blocks(heap);
}

using Layer0Result =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

const void* bias_ptr(const std::optional<at::Tensor>& b) {
  return b.has_value() && b->defined() ? b->data_ptr() : nullptr;
}

Layer0Result moe_layer0_cpu(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& topk_ids,
                            int64_t num_experts, int64_t buffer, int64_t n_comm, int64_t n_gemm,
                            int64_t tile_m, int64_t tile_n, const std::optional<at::Tensor>& b0,
                            bool w0_transposed, int64_t max_rows, int64_t tp_size,
                            const std::optional<at::Tensor>& x_scale,
                            const std::optional<at::Tensor>& w0_scale,
                            std::optional<at::ScalarType> out_dtype, bool dispatch_fp8,
                            std::optional<c10::string_view> activation, bool h_fp8,
                            int64_t sm_margin) {
  auto heap = heap_or_throw(buffer);
  check_launch_settings(*heap);
  const int64_t margin = call_margin(*heap, sm_margin);
  const LaunchShape launch{n_comm, n_gemm, tile_m, tile_n, 1, margin};
  Checker checker("comet.moe_layer0", at::kCPU, /*read_values=*/true);
  check_layer0(checker, {x, w0, topk_ids, num_experts, b0, w0_transposed, max_rows, tp_size,
                         x_scale, w0_scale, out_dtype, dispatch_fp8, activation_arg(activation),
                         h_fp8},
               heap->world(), launch);
  check_tp_topology(checker, *heap, tp_size);
  check_margin(checker, *heap, margin);
  const CheckResult& check = checker.result();
  const bool ok = check.ok();
  // FP8 rows on the wire: x's own, or a 16/32-bit x quantised here, on the sending side.
  const bool fp8_rows = ok && (is_fp8(x) || dispatch_fp8);
  const CallMeta me = make_meta(OpKind::Layer0, *heap, num_experts, ok ? topk_ids.size(1) : 0,
                                ok ? x.size(1) : 0, ok ? w0_out(w0, w0_transposed) : 0,
                                fp8_rows ? ScalarKind::F8E4M3 : scalar_kind(x.scalar_type()),
                                ok ? x.size(0) : 0, max_rows, check, tp_size);
  const uint64_t epoch = begin_checked_call(*heap, me, check, "comet.moe_layer0");
  if (n_gemm == 0) n_gemm = 1;
  int64_t too_many = -1;  // the group's largest M when it exceeds max_rows
  Layer0Result result = guarded_call(*heap, epoch, [&]() -> Layer0Result {
    const int64_t T = x.size(0), H = x.size(1), N0 = w0_out(w0, w0_transposed),
                  k = topk_ids.size(1);
    const int32_t W = heap->world(), El = int32_t(num_experts) / (W / int32_t(tp_size));
    at::Tensor ids = topk_ids.to(at::kInt).contiguous();
    at::Tensor send_pos = at::empty({T, k}, ids.options());
    at::Tensor recv_counts = at::empty({W, El}, ids.options());
    at::Tensor rows = x;  // what this rank publishes: x, or its packed FP8 rows
    if (fp8_rows) {
      // x's own values and scales, or x quantised here in one pass with the arithmetic the CUDA
      // kernel runs (comet/fp8_rows.h)
      rows = is_fp8(x) ? fp8_pack_rows(x, *x_scale) : fp8_quantize_pack_rows(x);
    }
    const at::ScalarType out_type = result_dtype(x, w0, dispatch_fp8, out_dtype);
    Layer0Problem p{rows.data_ptr(), w0.data_ptr(), ids.data_ptr<int32_t>(),
                    fp8_rows ? ScalarKind::F8E4M3 : scalar_kind(x.scalar_type()), T, H, N0,
                    int32_t(num_experts), int32_t(k)};
    p.w0_transposed = w0_transposed;
    p.b0 = bias_ptr(b0);
    p.tp = int32_t(tp_size);
    p.dedup = layer0_dedup_setting();
    p.w_kind = scalar_kind(w0.scalar_type());
    p.out_kind = scalar_kind(out_type);
    p.w0_scale = is_fp8(w0) ? w0_scale->data_ptr<float>() : nullptr;
    p.activation = layer0_activation(activation);
    p.h_fp8 = h_fp8;
    Layer0Call call(*heap, epoch, p, cpu_launch(*heap, epoch, n_comm, n_gemm, tile_m, tile_n, 1, margin),
                    send_pos.data_ptr<int32_t>(), recv_counts.data_ptr<int32_t>());
    const int64_t M = call.rows();
    if (max_rows >= 0) {
      // Every rank sees the same group maximum, so all skip the kernel and raise together.
      const int64_t most = call.max_rows_of_group();
      if (most > max_rows) {
        too_many = most;
        return {};
      }
    }
    // With max_rows the row-indexed outputs are padded to it: zeros, and -1 as a row's origin.
    const int64_t R = max_rows >= 0 ? max_rows : M;
    auto padded = [&](at::Tensor t, double fill) { return R > M ? t.fill_(fill) : t; };
    at::Tensor a = padded(fp8_rows ? at::empty({R, p.row_bytes()}, x.options().dtype(at::kByte))
                                 : at::empty({R, H}, x.options()),
                        0);
    // (packed rows zeroed whole: their padding bytes are part of the output)
    at::Tensor y0 = padded(h_fp8 ? at::zeros({R, fp8_row_bytes(p.out_cols())},
                                             x.options().dtype(at::kByte))
                                 : at::empty({R, p.out_cols()}, x.options().dtype(out_type)),
                           0);
    if (h_fp8 && R > M)  // padded rows: zeros of scale 1, as quantize_rows gives a zero row
      y0.narrow(0, M, R - M)
          .narrow(1, fp8_row_scales_at(p.out_cols()), 4 * scale_blocks(p.out_cols()))
          .view(at::kFloat)
          .fill_(1.0);
    at::Tensor row_source = padded(at::empty({R}, ids.options()), -1);
    at::Tensor row_token = padded(at::empty({R}, ids.options()), -1);
    at::Tensor row_slot = padded(at::empty({R}, ids.options()), -1);
    call.run(a.data_ptr(), y0.data_ptr(), row_source.data_ptr<int32_t>(),
             row_token.data_ptr<int32_t>(), row_slot.data_ptr<int32_t>());
    return {y0, a, recv_counts, send_pos, row_source, row_token, row_slot};
  });
  TORCH_CHECK_VALUE(too_many < 0, "comet.moe_layer0: a rank of the group receives ", too_many,
                    " rows but max_rows is ", max_rows, " (raise max_rows; no data was computed)");
  return result;
}

// layer1 after the metadata exchange; Acc = float, or double for float64 inputs.
template <class Acc>
at::Tensor layer1_body(SymmHeap& heap, uint64_t epoch, const at::Tensor& h, const at::Tensor& w1,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       const at::Tensor& send_pos, const at::Tensor& recv_counts,
                       int64_t num_experts, const CpuLaunch& launch,
                       const std::optional<at::Tensor>& b1, bool w1_transposed, int64_t tp,
                       const std::optional<at::Tensor>& h_scale,
                       const std::optional<at::Tensor>& w1_scale, at::ScalarType out_type) {
  const at::ScalarType acc_type = sizeof(Acc) == 8 ? at::kDouble : at::kFloat;
  at::Tensor ids = topk_ids.to(at::kInt).contiguous();
  at::Tensor weights = topk_weights.to(acc_type).contiguous();
  at::Tensor pos = send_pos.contiguous(), rc = recv_counts.contiguous();
  // M from the layout: h may be padded to max_rows rows (the rows past M are not read).
  const int64_t T = topk_ids.size(0), M = rc.sum().item<int64_t>(),
                H = w1_out(w1, w1_transposed);
  Layer1Problem<Acc> p{h.data_ptr(), w1.data_ptr(), weights.data_ptr<Acc>(),
                       ids.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),
                       rc.data_ptr<int32_t>(), scalar_kind(h.scalar_type()), T, M,
                       h.size(1), H, int32_t(num_experts), int32_t(topk_ids.size(1))};
  p.w1_transposed = w1_transposed;
  p.b1 = bias_ptr(b1);
  p.tp = int32_t(tp);
  p.w_kind = scalar_kind(w1.scalar_type());
  p.out_kind = scalar_kind(out_type);
  p.h_scale = is_fp8(h) ? h_scale->data_ptr<float>() : nullptr;
  p.w1_scale = is_fp8(w1) ? w1_scale->data_ptr<float>() : nullptr;
  at::Tensor c = at::empty({M, H}, h.options().dtype(acc_type));
  at::Tensor out = at::empty({T, H}, h.options().dtype(out_type));
  try {
    layer1_call<Acc>(heap, epoch, p, launch, c.data_ptr<Acc>(), out.data_ptr());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return out;
}

at::Tensor moe_layer1_cpu(const at::Tensor& h, const at::Tensor& w1, const at::Tensor& topk_weights,
                          const at::Tensor& topk_ids, const at::Tensor& send_pos,
                          const at::Tensor& recv_counts, int64_t num_experts, int64_t buffer,
                          int64_t n_comm, int64_t n_gemm, int64_t tile_m, int64_t tile_n,
                          const std::optional<at::Tensor>& b1, bool w1_transposed,
                          int64_t max_rows, int64_t band_n, int64_t tp_size,
                          const std::optional<at::Tensor>& h_scale,
                          const std::optional<at::Tensor>& w1_scale,
                          std::optional<at::ScalarType> out_dtype, int64_t sm_margin) {
  auto heap = heap_or_throw(buffer);
  check_launch_settings(*heap);
  const int64_t margin = call_margin(*heap, sm_margin);
  const LaunchShape launch{n_comm, n_gemm, tile_m, tile_n, band_n, margin};
  Checker checker("comet.moe_layer1", at::kCPU, /*read_values=*/true);
  check_layer1(checker, {h, w1, topk_weights, topk_ids, send_pos, recv_counts, num_experts, b1,
                         w1_transposed, max_rows, tp_size, h_scale, w1_scale, out_dtype},
               heap->world(), launch);
  check_tp_topology(checker, *heap, tp_size);
  check_margin(checker, *heap, margin);
  const CheckResult& check = checker.result();
  const bool ok = check.ok();
  const at::ScalarType out_type = ok ? result_dtype(h, w1, false, out_dtype) : at::kFloat;
  CallMeta me = make_meta(OpKind::Layer1, *heap, num_experts, ok ? topk_ids.size(1) : 0,
                          ok ? w1_out(w1, w1_transposed) : 0, ok ? h.size(1) : 0,
                          scalar_kind(out_type), ok ? topk_ids.size(0) : 0, max_rows, check,
                          tp_size);
  if (ok) {  // the group's verdict checks the layouts against the routing (call_verdict.h)
    me.routed_rows = topk_ids.ge(0).sum().item<int64_t>();
    me.layout_rows = recv_counts.sum().item<int64_t>();
  }
  const uint64_t epoch = begin_checked_call(*heap, me, check, "comet.moe_layer1");
  if (n_gemm == 0) n_gemm = 1;
  return guarded_call(*heap, epoch, [&]() -> at::Tensor {
    const CpuLaunch launch = cpu_launch(*heap, epoch, n_comm, n_gemm, tile_m, tile_n, band_n, margin);
    if (h.scalar_type() == at::kDouble || out_type == at::kDouble)
      return layer1_body<double>(*heap, epoch, h, w1, topk_weights, topk_ids, send_pos,
                                 recv_counts, num_experts, launch, b1, w1_transposed, tp_size,
                                 h_scale, w1_scale, out_type);
    return layer1_body<float>(*heap, epoch, h, w1, topk_weights, topk_ids, send_pos, recv_counts,
                              num_experts, launch, b1, w1_transposed, tp_size, h_scale, w1_scale,
                              out_type);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(comet, CPU, m) {
  m.impl("moe_layer0", &moe_layer0_cpu);
  m.impl("moe_layer1", &moe_layer1_cpu);
}

}  // namespace comet::cpu
