// The CPU backend's fused layers (fused_cpu.h): prologue programs, then the fused "kernel" of comm
// and GEMM blocks, all on thread teams.
#include "fused_cpu.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "block_runner.h"
#include "comet/comm_layer0.h"
#include "comet/comm_layer1.h"
#include "comet/gemm_schedule.h"
#include "comet/prologue.h"
#include "grid_scratch.h"
#include "tile_gemm.h"

namespace comet::cpu {
namespace {

// The prologue programs (comet/prologue.h) run on a grid of the call's blocks, each a team, as the
// CUDA prologue kernels run them on many blocks.
template <class Body>
void run_prologue(const SymmHeap& heap, const CpuLaunch& l, GridScratch& scratch, Body&& body) {
  const PrologueScratch ps = scratch.view();
  run_grid(&heap, l.n_comm + l.n_gemm, l.threads, l.stress_seed,
           [&](CpuContext& ctx) { body(ctx, ps); });
}

std::vector<const char*> peer_datas(const SymmHeap& heap) {
  std::vector<const char*> d(static_cast<size_t>(heap.world()));
  for (int32_t s = 0; s < heap.world(); ++s) d[size_t(s)] = heap.data(s);
  return d;
}

// m-tiles (and layer0's visit order when `order` is given) of a dispatch layout of M rows.
std::vector<MTile> plan_tiles(const SymmHeap& heap, const CpuLaunch& l,
                              const std::vector<int64_t>& expert_off,
                              const std::vector<int64_t>& seg_off, int32_t El, int64_t M,
                              std::vector<int64_t>* order) {
  const int32_t W = heap.world();
  const int64_t cap = ceil_div(M, l.tile_m) + El;
  std::vector<MTile> mtiles(static_cast<size_t>(cap));
  if (order) order->resize(static_cast<size_t>(cap));
  std::vector<int32_t> bucket(size_t(W) + 1);
  GridScratch scratch(l.n_comm + l.n_gemm, l.threads, W, 0, std::max(El, W));
  const TilePlanArgs a{expert_off.data(), seg_off.data(), W, El, l.tile_m, cap,
                       mtiles.data(), order ? order->data() : nullptr, bucket.data()};
  int64_t n = 0;
  run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
    const int64_t r = tile_plan_program(ctx, ps, a);
    if (grid_rank(ctx) == 0) n = r;
  });
  mtiles.resize(static_cast<size_t>(n));
  if (order) order->resize(static_cast<size_t>(n));
  return mtiles;
}

// Publishes this rank's source data (written by the caller) and waits for every source's.
void exchange_sources(SymmHeap& heap, uint64_t epoch) {
  flag_release(heap.header(heap.rank())->data_epoch, epoch);
  for (int32_t s = 0; s < heap.world(); ++s)
    heap.wait(heap.header(s)->data_epoch, epoch, WaitSite::PeerData, s);
}

// A GEMM tile computed by all threads of a block: each its contiguous share of the tile's rows.
// Every output element is one fixed-order dot product, so the split never changes a bit.
template <class Acc>
void block_tile_gemm(const CpuContext& ctx, const TileGemmArgs& t, const MTile& mt, int64_t col0,
                     int64_t cols, std::vector<Acc>& scratch) {
  const Share rows = share_of(mt.rows, ctx.thread(), ctx.threads());
  if (rows.size() > 0) tile_gemm(t, mt.row_begin + rows.begin, rows.size(), col0, cols, scratch);
}

}  // namespace

int64_t max_tokens(const SymmHeap& heap) {
  int64_t t = 0;
  for (const CallMeta& m : heap.metas()) t = std::max<int64_t>(t, m.tokens);
  return t;
}

Layer0Call::Layer0Call(SymmHeap& heap, uint64_t epoch, const Layer0Problem& p, const CpuLaunch& l,
                       int32_t* send_pos, int32_t* recv_counts)
    : heap_(heap), epoch_(epoch), p_(p), l_(l) {
  const int32_t W = heap.world(), d = heap.rank(), E = p.experts, El = E / W, k = p.topk;
  const int64_t T = p.tokens, elem = scalar_bytes(p.kind);
  const DataRegions reg = data_regions(OpKind::Layer0, max_tokens(heap), int32_t(p.hidden), k, E,
                                       W, int32_t(elem));
  heap.reserve(reg.total);

  // Publish this rank's send plan and tokens.
  char* mine = heap.data(d);
  {
    GridScratch scratch(l.n_comm + l.n_gemm, l.threads, E, 0, 0);
    run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
      send_plan_program(ctx, ps, p.ids, T, k, E, reinterpret_cast<int32_t*>(mine + reg.bucket_off),
                        reinterpret_cast<int32_t*>(mine + reg.send_slot), send_pos);
    });
  }
  if (T > 0) std::memcpy(mine + reg.x, p.x, size_t(T * p.hidden * elem));
  exchange_sources(heap, epoch);

  // Dispatch layout from every source's bucket sizes, then the m-tiles and their order.
  gather_recv_counts(peer_datas(heap).data(), reg.bucket_off, d, W, El, recv_counts);
  expert_off_.resize(size_t(El) + 1);
  seg_off_.resize(size_t(El) * (W + 1));
  rows_ = build_dispatch_layout(recv_counts, d, W, El, expert_off_.data(), seg_off_.data());
  mtiles_ = plan_tiles(heap, l, expert_off_, seg_off_, El, rows_, &order_);
}

int64_t Layer0Call::max_rows_of_group() const {
  const int32_t W = heap_.world(), El = p_.experts / W;
  const DataRegions reg = data_regions(OpKind::Layer0, max_tokens(heap_), int32_t(p_.hidden),
                                       p_.topk, p_.experts, W, int32_t(scalar_bytes(p_.kind)));
  const std::vector<const char*> datas = peer_datas(heap_);
  std::vector<int32_t> counts(size_t(W) * size_t(El));
  int64_t most = 0;
  for (int32_t dest = 0; dest < W; ++dest) {
    gather_recv_counts(datas.data(), reg.bucket_off, dest, W, El, counts.data());
    int64_t m = 0;
    for (int32_t c : counts) m += c;
    most = std::max(most, m);
  }
  return most;
}

void Layer0Call::run(void* a, void* y0, int32_t* row_source, int32_t* row_token,
                     int32_t* row_slot) {
  const int32_t W = heap_.world(), d = heap_.rank(), El = p_.experts / W;
  const int64_t H = p_.hidden, N0 = p_.n0, elem = scalar_bytes(p_.kind);
  const int64_t MT = int64_t(mtiles_.size());
  const DataRegions reg = data_regions(OpKind::Layer0, max_tokens(heap_), int32_t(H), p_.topk,
                                       p_.experts, W, int32_t(elem));
  auto& flags = heap_.tile_flags();
  if (int64_t(flags.size()) < MT) flags.resize(size_t(MT), 0);

  const Layer0CommArgs ca{d, W, El, p_.topk, H * elem, epoch_, reg, seg_off_.data(),
                          mtiles_.data(), order_.data(), MT, static_cast<char*>(a), flags.data(),
                          row_source, row_token, row_slot};
  const int32_t NT = int32_t(ceil_div(N0, l_.tile_n));
  const GemmScheduleArgs ga{epoch_, mtiles_.data(), MT, NT, order_.data(), flags.data(),
                            nullptr, nullptr};
  const char* w0 = static_cast<const char*>(p_.w0);
  const char* b0 = static_cast<const char*>(p_.b0);
  const ScalarKind kind = p_.kind;
  const int64_t tile_n = l_.tile_n;
  run_blocks(
      heap_, l_.n_comm, l_.n_gemm, l_.threads, l_.stress_seed,
      [&](CpuContext& ctx) { layer0_comm(ctx, ca); },
      [&](CpuContext& ctx, int32_t g) {
        std::vector<float> tmp32;
        std::vector<double> tmp64;
        layer0_gemm(ctx, g, l_.n_gemm, ga, [&](const MTile& mt, int32_t nt) {
          const TileGemmArgs t{a, kind, w0 + int64_t(mt.expert) * N0 * H * elem, kind, y0, kind,
                               H, N0, p_.w0_transposed,
                               p_.b0 ? b0 + int64_t(mt.expert) * N0 * elem : nullptr};
          const int64_t col0 = int64_t(nt) * tile_n, cols = std::min<int64_t>(tile_n, N0 - col0);
          if (kind == ScalarKind::F64)
            block_tile_gemm(ctx, t, mt, col0, cols, tmp64);
          else
            block_tile_gemm(ctx, t, mt, col0, cols, tmp32);
        });
      });
}

template <class Acc>
void layer1_call(SymmHeap& heap, uint64_t epoch, const Layer1Problem<Acc>& p, const CpuLaunch& l,
                 Acc* c, void* out) {
  const int32_t W = heap.world(), d = heap.rank();
  const int32_t E = p.experts, El = E / W, k = p.topk;
  const int64_t T = p.tokens, M = p.rows, N1 = p.n1, H = p.hidden;
  const int64_t elem = scalar_bytes(p.kind);
  const int64_t tmax = max_tokens(heap);
  const DataRegions reg = data_regions(OpKind::Layer1, tmax, int32_t(H), k, E, W, int32_t(elem),
                                       int32_t(sizeof(Acc)));
  heap.reserve(std::max<size_t>(reg.total, 1));

  // Publish this rank's routing, bucket positions, weights and pair lists for the destinations.
  char* mine = heap.data(d);
  if (T > 0) {
    std::memcpy(mine + reg.ids, p.ids, size_t(T * k) * 4);
    std::memcpy(mine + reg.send_pos, p.send_pos, size_t(T * k) * 4);
    std::memcpy(mine + reg.weights, p.weights, size_t(T * k) * sizeof(Acc));
  }
  {
    GridScratch scratch(l.n_comm + l.n_gemm, l.threads, W, T * k, 0);
    run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
      pair_list_program(ctx, ps, p.ids, T, k, E, W, reinterpret_cast<int32_t*>(mine + reg.pair_off),
                        reinterpret_cast<int32_t*>(mine + reg.pair_slot));
    });
  }
  exchange_sources(heap, epoch);

  std::vector<int64_t> expert_off(size_t(El) + 1), seg_off(size_t(El) * (W + 1));
  build_dispatch_layout(p.recv_counts, d, W, El, expert_off.data(), seg_off.data());
  std::vector<MTile> mtiles = plan_tiles(heap, l, expert_off, seg_off, El, M, nullptr);
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
    GridScratch scratch(l.n_comm + l.n_gemm, l.threads, W, 0, std::max(El, W));
    const ReducePlanArgs<Acc> ra{src.data(), d, W, k, El, seg_off.data(), cap, plan, &slots};
    run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
      const int64_t n = reduce_plan_program(ctx, ps, ra);
      if (grid_rank(ctx) == 0) entries = n;
    });
  }
  if (entries < 0 || slots != M)
    throw std::invalid_argument(
        "comet.moe_layer1: the peers' routing sends this rank more rows than the layout "
        "(recv_counts) says (" + std::to_string(M) +
        "): pass the layout moe_layer0 returned for this call");
  plan.entries = entries;

  const int32_t NT = int32_t(ceil_div(H, l.tile_n));
  auto& flags = heap.tile_flags();
  auto& counts = heap.tile_counts();
  if (int64_t(flags.size()) < NT) flags.resize(size_t(NT), 0);
  if (int64_t(counts.size()) < NT) counts.resize(size_t(NT), 0);

  const Layer1CommArgs<Acc> la{d, W, El, k, int32_t(H), l.tile_n, NT, tmax, epoch, reg, c,
                               flags.data(), plan,
                               std::max<int64_t>(1, ceil_div(entries, 4 * int64_t(l.n_comm))),
                               heap.blocks_done(), T, p.ids, out, p.kind};
  const GemmScheduleArgs ga{epoch, mtiles.data(), MT, NT, nullptr, nullptr, counts.data(),
                            flags.data()};
  const char* w1 = static_cast<const char*>(p.w1);
  const char* b1 = static_cast<const char*>(p.b1);
  const ScalarKind c_kind = sizeof(Acc) == 8 ? ScalarKind::F64 : ScalarKind::F32;
  run_blocks(
      heap, l.n_comm, l.n_gemm, l.threads, l.stress_seed,
      [&](CpuContext& ctx) { layer1_reduce_send(ctx, la); },
      [&](CpuContext& ctx, int32_t g) {
        std::vector<Acc> tmp;
        layer1_gemm(ctx, g, l.n_gemm, ga, [&](const MTile& mt, int32_t nt) {
          const TileGemmArgs t{p.h, p.kind, w1 + int64_t(mt.expert) * H * N1 * elem, p.kind, c,
                               c_kind, N1, H, p.w1_transposed,
                               p.b1 ? b1 + int64_t(mt.expert) * H * elem : nullptr};
          const int64_t col0 = int64_t(nt) * l.tile_n;
          block_tile_gemm(ctx, t, mt, col0, std::min<int64_t>(l.tile_n, H - col0), tmp);
        });
      });
  // The combine as a follow-on step on every block (the GPU's combine kernel over all SMs).
  run_grid(&heap, l.n_comm + l.n_gemm, l.threads, l.stress_seed,
           [&](CpuContext& ctx) { layer1_combine(ctx, la); });
}

template void layer1_call<float>(SymmHeap&, uint64_t, const Layer1Problem<float>&,
                                 const CpuLaunch&, float*, void*);
template void layer1_call<double>(SymmHeap&, uint64_t, const Layer1Problem<double>&,
                                  const CpuLaunch&, double*, void*);

}  // namespace comet::cpu
