// CPU kernels of torch.ops.comet.moe_layer0 / moe_layer1: the per-call protocol on the host, then
// the fused "kernel" run by block_runner with the engine's comm programs and tile schedules
// (csrc/include/comet/), the GEMM tiles computed by tile_gemm.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "block_runner.h"
#include "comet/comm_layer0.h"
#include "comet/comm_layer1.h"
#include "comet/gemm_schedule.h"
#include "comet/prologue.h"
#include "comet/reduce_plan.h"
#include "grid_scratch.h"
#include "op_checks.h"
#include "symm_heap.h"
#include "tile_gemm.h"

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

CallMeta make_meta(OpKind op, const SymmHeap& heap, int64_t num_experts, int64_t topk,
                   int64_t hidden, int64_t cols, const at::Tensor& act, int64_t tokens,
                   const CheckResult& check) {
  return make_call_meta(op, heap.world(), heap.group_hash(), num_experts, topk, hidden, cols,
                        check.ok() ? int32_t(scalar_kind(act.scalar_type())) : -1, tokens, check);
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

int64_t max_tokens(const SymmHeap& heap) {
  int64_t t = 0;
  for (const CallMeta& m : heap.metas()) t = std::max<int64_t>(t, m.tokens);
  return t;
}

// Runs the body of a call; a failure inside leaves peers in an unknown state: mark the heap broken.
template <class Body>
auto guarded_call(SymmHeap& heap, uint64_t epoch, Body&& body) {
  try {
    auto result = body();
    heap.end_call(epoch);
    return result;
  } catch (const std::exception& e) {
    heap.mark_broken(e.what());
    throw;
  }
}

// The prologue programs (comet/prologue.h) run on a grid of the call's blocks, as the CUDA
// prologue kernels run them on many blocks.
template <class Body>
void run_prologue(const SymmHeap& heap, int32_t blocks, GridScratch& scratch, Body&& body) {
  const PrologueScratch ps = scratch.view();
  run_grid(&heap, blocks, 1, 0, [&](CpuContext& ctx) { body(ctx, ps); });
}

std::vector<const char*> peer_datas(const SymmHeap& heap) {
  std::vector<const char*> d(static_cast<size_t>(heap.world()));
  for (int32_t s = 0; s < heap.world(); ++s) d[size_t(s)] = heap.data(s);
  return d;
}

// m-tiles (and layer0's visit order when `order` is given) of a dispatch layout of M rows.
std::vector<MTile> plan_tiles(const SymmHeap& heap, int32_t blocks, const std::vector<int64_t>& expert_off,
                              const std::vector<int64_t>& seg_off, int32_t El, int64_t M,
                              int64_t tile_m, std::vector<int64_t>* order) {
  const int32_t W = heap.world();
  const int64_t cap = ceil_div(M, tile_m) + El;
  std::vector<MTile> mtiles(static_cast<size_t>(cap));
  if (order) order->resize(static_cast<size_t>(cap));
  std::vector<int32_t> bucket(size_t(W) + 1);
  GridScratch scratch(blocks, 1, W, 0, std::max(El, W));
  const TilePlanArgs a{expert_off.data(), seg_off.data(), W, El, int32_t(tile_m), cap,
                       mtiles.data(), order ? order->data() : nullptr, bucket.data()};
  int64_t n = 0;
  run_prologue(heap, blocks, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
    const int64_t r = tile_plan_program(ctx, ps, a);
    if (grid_rank(ctx) == 0) n = r;
  });
  mtiles.resize(static_cast<size_t>(n));
  if (order) order->resize(static_cast<size_t>(n));
  return mtiles;
}

using Layer0Result =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Layer0Result moe_layer0_cpu(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& topk_ids,
                            int64_t num_experts, int64_t buffer, int64_t n_comm, int64_t n_gemm,
                            int64_t tile_m, int64_t tile_n) {
  auto heap = heap_or_throw(buffer);
  const LaunchShape launch{n_comm, n_gemm, tile_m, tile_n};
  Checker checker("comet.moe_layer0", at::kCPU, /*read_values=*/true);
  check_layer0(checker, {x, w0, topk_ids, num_experts}, heap->world(), launch);
  const CheckResult& check = checker.result();
  const bool ok = check.ok();
  const CallMeta me = make_meta(OpKind::Layer0, *heap, num_experts, ok ? topk_ids.size(1) : 0,
                                ok ? x.size(1) : 0, ok ? w0.size(1) : 0, x, ok ? x.size(0) : 0,
                                check);
  const uint64_t epoch = begin_checked_call(*heap, me, check, "comet.moe_layer0");
  if (n_gemm == 0) n_gemm = 1;
  return guarded_call(*heap, epoch, [&]() -> Layer0Result {
    const int32_t W = heap->world(), d = heap->rank();
    const int32_t E = int32_t(num_experts), El = E / W, k = int32_t(topk_ids.size(1));
    const int64_t T = x.size(0), H = x.size(1), N0 = w0.size(1);
    const int64_t elem = x.element_size();
    const ScalarKind kind = scalar_kind(x.scalar_type());
    const DataRegions reg = data_regions(OpKind::Layer0, max_tokens(*heap), int32_t(H), k, E, W,
                                         int32_t(elem));
    heap->reserve(reg.total);

    // Publish this rank's send plan and tokens.
    char* mine = heap->data(d);
    at::Tensor ids = topk_ids.to(at::kInt).contiguous();
    at::Tensor send_pos = at::empty({T, k}, ids.options());
    const int32_t grid = int32_t(n_comm + n_gemm);
    {
      GridScratch scratch(grid, 1, E, 0, 0);
      const int32_t* idp = ids.data_ptr<int32_t>();
      int32_t* pos = send_pos.data_ptr<int32_t>();
      run_prologue(*heap, grid, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
        send_plan_program(ctx, ps, idp, T, k, E, reinterpret_cast<int32_t*>(mine + reg.bucket_off),
                          reinterpret_cast<int32_t*>(mine + reg.send_slot), pos);
      });
    }
    if (T > 0) std::memcpy(mine + reg.x, x.data_ptr(), size_t(T * H * elem));
    flag_release(heap->header(d)->data_epoch, epoch);
    for (int32_t s = 0; s < W; ++s) heap->wait(heap->header(s)->data_epoch, epoch, WaitSite::PeerData, s);

    // Dispatch layout from every source's bucket sizes.
    at::Tensor recv_counts = at::empty({W, El}, ids.options());
    int32_t* rc = recv_counts.data_ptr<int32_t>();
    gather_recv_counts(peer_datas(*heap).data(), reg.bucket_off, d, W, El, rc);
    std::vector<int64_t> expert_off(size_t(El) + 1), seg_off(size_t(El) * (W + 1));
    const int64_t M = build_dispatch_layout(rc, d, W, El, expert_off.data(), seg_off.data());
    std::vector<int64_t> order;
    std::vector<MTile> mtiles = plan_tiles(*heap, grid, expert_off, seg_off, El, M, tile_m, &order);
    const int64_t MT = int64_t(mtiles.size());

    at::Tensor a = at::empty({M, H}, x.options());
    at::Tensor y0 = at::empty({M, N0}, x.options());
    at::Tensor row_source = at::empty({M}, ids.options());
    at::Tensor row_token = at::empty({M}, ids.options());
    at::Tensor row_slot = at::empty({M}, ids.options());
    auto& flags = heap->tile_flags();
    if (int64_t(flags.size()) < MT) flags.resize(size_t(MT), 0);

    Layer0CommArgs ca{d, W, El, k, H * elem, epoch, reg, seg_off.data(), mtiles.data(),
                      order.data(), MT, static_cast<char*>(a.data_ptr()), flags.data(),
                      row_source.data_ptr<int32_t>(), row_token.data_ptr<int32_t>(),
                      row_slot.data_ptr<int32_t>()};
    const int32_t NT = int32_t(ceil_div(N0, tile_n));
    GemmScheduleArgs ga{epoch, mtiles.data(), MT, NT, order.data(), flags.data(), nullptr, nullptr};
    const char* w0p = static_cast<const char*>(w0.data_ptr());
    run_blocks(
        *heap, int32_t(n_comm), int32_t(n_gemm), stress_seed(epoch, d),
        [&](CpuContext& ctx) { layer0_comm(ctx, ca); },
        [&](CpuContext& ctx, int32_t g) {
          std::vector<float> tmp32;
          std::vector<double> tmp64;
          layer0_gemm(ctx, g, int32_t(n_gemm), ga, [&](const MTile& mt, int32_t nt) {
            TileGemmArgs t{a.data_ptr(), kind, w0p + int64_t(mt.expert) * N0 * H * elem, kind,
                           y0.data_ptr(), kind, H, N0};
            const int64_t col0 = int64_t(nt) * tile_n, cols = std::min<int64_t>(tile_n, N0 - col0);
            if (kind == ScalarKind::F64)
              tile_gemm(t, mt.row_begin, mt.rows, col0, cols, tmp64);
            else
              tile_gemm(t, mt.row_begin, mt.rows, col0, cols, tmp32);
          });
        });
    return {y0, a, recv_counts, send_pos, row_source, row_token, row_slot};
  });
}

// layer1 after the metadata exchange; Acc = float, or double for float64 inputs.
template <class Acc>
at::Tensor layer1_body(SymmHeap& heap, uint64_t epoch, const at::Tensor& h, const at::Tensor& w1,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       const at::Tensor& send_pos, const at::Tensor& recv_counts,
                       int64_t num_experts, int64_t n_comm, int64_t n_gemm, int64_t tile_m,
                       int64_t tile_n) {
  const int32_t W = heap.world(), d = heap.rank();
  const int32_t E = int32_t(num_experts), El = E / W, k = int32_t(topk_ids.size(1));
  const int64_t T = topk_ids.size(0), M = h.size(0), N1 = h.size(1), H = w1.size(1);
  const ScalarKind kind = scalar_kind(h.scalar_type());
  const at::ScalarType acc_type = sizeof(Acc) == 8 ? at::kDouble : at::kFloat;
  const int64_t tmax = max_tokens(heap);
  const DataRegions reg = data_regions(OpKind::Layer1, tmax, int32_t(H), k, E, W,
                                       int32_t(h.element_size()), int32_t(sizeof(Acc)));
  heap.reserve(std::max<size_t>(reg.total, 1));

  // Publish this rank's routing, bucket positions and weights for the destinations.
  char* mine = heap.data(d);
  at::Tensor ids = topk_ids.to(at::kInt).contiguous();
  at::Tensor weights = topk_weights.to(acc_type).contiguous();
  if (T > 0) {
    std::memcpy(mine + reg.ids, ids.data_ptr(), size_t(T * k) * 4);
    std::memcpy(mine + reg.send_pos, send_pos.data_ptr(), size_t(T * k) * 4);
    std::memcpy(mine + reg.weights, weights.data_ptr(), size_t(T * k) * sizeof(Acc));
  }
  const int32_t grid = int32_t(n_comm + n_gemm);
  {
    GridScratch scratch(grid, 1, W, T * k, 0);
    const int32_t* idp = ids.data_ptr<int32_t>();
    run_prologue(heap, grid, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
      pair_list_program(ctx, ps, idp, T, k, E, W, reinterpret_cast<int32_t*>(mine + reg.pair_off),
                        reinterpret_cast<int32_t*>(mine + reg.pair_slot));
    });
  }
  flag_release(heap.header(d)->data_epoch, epoch);
  for (int32_t s = 0; s < W; ++s) heap.wait(heap.header(s)->data_epoch, epoch, WaitSite::PeerData, s);

  std::vector<int64_t> expert_off(size_t(El) + 1), seg_off(size_t(El) * (W + 1));
  build_dispatch_layout(recv_counts.data_ptr<int32_t>(), d, W, El, expert_off.data(),
                        seg_off.data());
  std::vector<MTile> mtiles = plan_tiles(heap, grid, expert_off, seg_off, El, M, tile_m, nullptr);
  const int64_t MT = int64_t(mtiles.size());

  // The reduce plan from the peers' published routing and pair lists.
  std::vector<PlanSource<Acc>> src(static_cast<size_t>(W));
  for (int32_t s = 0; s < W; ++s) src[size_t(s)] = plan_source<Acc>(heap.data(s), reg);
  const int64_t cap = std::max<int64_t>(M, 1);
  std::vector<int32_t> e_src(static_cast<size_t>(cap)), e_tok(static_cast<size_t>(cap)),
      e_part(static_cast<size_t>(cap));
  std::vector<int64_t> e_begin(static_cast<size_t>(cap) + 1), s_row(static_cast<size_t>(cap));
  std::vector<Acc> s_w(static_cast<size_t>(cap));
  ReducePlan<Acc> plan{0, e_src.data(), e_tok.data(), e_part.data(), e_begin.data(), s_row.data(),
                       s_w.data()};
  int64_t slots = 0, entries = 0;
  {
    GridScratch scratch(grid, 1, W, 0, std::max(El, W));
    const ReducePlanArgs<Acc> ra{src.data(), d, W, k, El, seg_off.data(), cap, plan, &slots};
    run_prologue(heap, grid, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
      const int64_t n = reduce_plan_program(ctx, ps, ra);
      if (grid_rank(ctx) == 0) entries = n;
    });
  }
  TORCH_CHECK_VALUE(entries >= 0 && slots == M,
                    "comet.moe_layer1: the peers' routing sends this rank more rows than the layout "
                    "(recv_counts) says (", M, "): pass the layout moe_layer0 returned for this call");
  plan.entries = entries;

  const int32_t NT = int32_t(ceil_div(H, tile_n));
  auto& flags = heap.tile_flags();
  auto& counts = heap.tile_counts();
  if (int64_t(flags.size()) < NT) flags.resize(size_t(NT), 0);
  if (int64_t(counts.size()) < NT) counts.resize(size_t(NT), 0);

  at::Tensor c = at::empty({M, H}, h.options().dtype(acc_type));
  at::Tensor out = at::empty({T, H}, h.options());
  Layer1CommArgs<Acc> la{d, W, El, k, int32_t(H), int32_t(tile_n), NT, tmax, epoch, reg,
                         c.data_ptr<Acc>(), flags.data(), plan,
                         std::max<int64_t>(1, ceil_div(entries, 4 * n_comm)), heap.blocks_done(),
                         T, ids.data_ptr<int32_t>(), out.data_ptr(), kind};
  GemmScheduleArgs ga{epoch, mtiles.data(), MT, NT, nullptr, nullptr, counts.data(), flags.data()};
  const char* w1p = static_cast<const char*>(w1.data_ptr());
  const int64_t elem = h.element_size();
  const ScalarKind c_kind = sizeof(Acc) == 8 ? ScalarKind::F64 : ScalarKind::F32;
  run_blocks(
      heap, int32_t(n_comm), int32_t(n_gemm), stress_seed(epoch, d),
      [&](CpuContext& ctx) { layer1_comm(ctx, la); },
      [&](CpuContext& ctx, int32_t g) {
        std::vector<Acc> tmp;
        layer1_gemm(ctx, g, int32_t(n_gemm), ga, [&](const MTile& mt, int32_t nt) {
          TileGemmArgs t{h.data_ptr(), kind, w1p + int64_t(mt.expert) * H * N1 * elem, kind,
                         c.data_ptr(), c_kind, N1, H};
          const int64_t col0 = int64_t(nt) * tile_n;
          tile_gemm(t, mt.row_begin, mt.rows, col0, std::min<int64_t>(tile_n, H - col0), tmp);
        });
      });
  return out;
}

at::Tensor moe_layer1_cpu(const at::Tensor& h, const at::Tensor& w1, const at::Tensor& topk_weights,
                          const at::Tensor& topk_ids, const at::Tensor& send_pos,
                          const at::Tensor& recv_counts, int64_t num_experts, int64_t buffer,
                          int64_t n_comm, int64_t n_gemm, int64_t tile_m, int64_t tile_n) {
  auto heap = heap_or_throw(buffer);
  const LaunchShape launch{n_comm, n_gemm, tile_m, tile_n};
  Checker checker("comet.moe_layer1", at::kCPU, /*read_values=*/true);
  check_layer1(checker, {h, w1, topk_weights, topk_ids, send_pos, recv_counts, num_experts},
               heap->world(), launch);
  const CheckResult& check = checker.result();
  const bool ok = check.ok();
  const CallMeta me = make_meta(OpKind::Layer1, *heap, num_experts, ok ? topk_ids.size(1) : 0,
                                ok ? w1.size(1) : 0, ok ? h.size(1) : 0, h,
                                ok ? topk_ids.size(0) : 0, check);
  const uint64_t epoch = begin_checked_call(*heap, me, check, "comet.moe_layer1");
  if (n_gemm == 0) n_gemm = 1;
  return guarded_call(*heap, epoch, [&]() -> at::Tensor {
    if (h.scalar_type() == at::kDouble)
      return layer1_body<double>(*heap, epoch, h, w1, topk_weights, topk_ids, send_pos,
                                 recv_counts, num_experts, n_comm, n_gemm, tile_m, tile_n);
    return layer1_body<float>(*heap, epoch, h, w1, topk_weights, topk_ids, send_pos, recv_counts,
                              num_experts, n_comm, n_gemm, tile_m, tile_n);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(comet, CPU, m) {
  m.impl("moe_layer0", &moe_layer0_cpu);
  m.impl("moe_layer1", &moe_layer1_cpu);
}

}  // namespace comet::cpu
