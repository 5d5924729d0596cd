// The CPU backend's fused layers (fused_cpu.h): prologue programs, then the fused "kernel" of comm
// and GEMM blocks, all on thread teams.
#include "fused_cpu.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>

#include "block_runner.h"
#include "comet/comm_layer0.h"
#include "comet/comm_layer1.h"
#include "comet/gemm_schedule.h"
#include "comet/node_push.h"
#include "comet/prologue.h"
#include "grid_scratch.h"
#include "tile_gemm.h"

namespace comet::cpu {
namespace {

// Blocks of the grids that wait on themselves (the prologue programs' grid barriers, the combine
// step: comet/block_roles.h): the call's blocks, as many as are co-resident.
int32_t barrier_grid(const CpuLaunch& l) { return co_resident(l.n_comm + l.n_gemm, l.resident); }

// The prologue programs (comet/prologue.h) run on a grid of the call's blocks, each a team, as the
// CUDA prologue kernels run them on many blocks.
template <class Body>
void run_prologue(const SymmHeap& heap, const CpuLaunch& l, GridScratch& scratch, Body&& body) {
  const PrologueScratch ps = scratch.view();
  run_grid(&heap, barrier_grid(l), l.threads, l.stress_seed,
           [&](CpuContext& ctx) { body(ctx, ps); }, nullptr, l.resident, l.device);
}

// A fused layer's launches (comet/block_roles.h: one, or a staged layer's two steps).
template <class Comm, class Gemm>
void run_fused(const SymmHeap& heap, int32_t layer, const CpuLaunch& l, Comm&& comm, Gemm&& gemm) {
  const int32_t blocks = l.n_comm + l.n_gemm;
  for (int32_t s = 0; s < fused_steps(l.n_comm); ++s) {
    const FusedStep step = fused_step(layer, s, blocks, l.n_comm);
    run_blocks(heap, layer, step.n_comm, step.n_gemm, l.threads, l.resident, l.stress_seed, comm,
               gemm, l.device);
  }
}

// The call's regions, with room for the mirrors of remote sources when the group spans nodes.
DataRegions regions_of(const SymmHeap& heap, OpKind op, int64_t tmax, int64_t hidden, int32_t k,
                       int32_t experts, int64_t elem, int32_t acc_bytes = 4, int32_t tp = 1) {
  return call_regions(heap.topology(), op, tmax, int32_t(hidden), k, experts, int32_t(elem),
                      acc_bytes, tp);
}

// Where each source's published region is read (its segment, or its mirror on this node).
std::vector<const char*> source_bases(const SymmHeap& heap, const DataRegions& reg) {
  std::vector<const char*> d(static_cast<size_t>(heap.world()));
  for (int32_t s = 0; s < heap.world(); ++s) d[size_t(s)] = heap.source_base(s, reg);
  return d;
}


// The dispatch layout (and layer0's recv_counts) on the call's grid, as the CUDA begin kernel
// builds it (dispatch_layout_program). Returns M.
int64_t dispatch_layout(const SymmHeap& heap, const CpuLaunch& l, const DispatchLayoutArgs& a) {
  GridScratch scratch(barrier_grid(l), l.threads, 1, 0, 0);
  int64_t rows = 0;
  run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
    const int64_t r = dispatch_layout_program(ctx, ps, a);
    if (grid_rank(ctx) == 0) rows = r;
  });
  return rows;
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
  GridScratch scratch(barrier_grid(l), l.threads, W, 0, std::max(El, W));
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

// Publishes this rank's source data (written by the caller, and pushed to the other nodes'
// mirrors by `push`) and waits for every source's: on this node its data flag, across nodes its
// mirror's on this node's relay. The waits run on the call's grid, as the GPU's prologue kernels
// wait for them, so they hold the call's resident-block slots of the rank's device while they
// wait (slot_pool.h: what another kernel of the rank then cannot get).
template <class Push>
void exchange_sources(SymmHeap& heap, const CpuLaunch& l, uint64_t epoch, Push&& push) {
  flag_release(heap.header(heap.rank())->data_epoch, epoch);
  GridScratch scratch(barrier_grid(l), l.threads, 0, 0, 0);
  if (heap.topology().nodes() > 1) run_prologue(heap, l, scratch, push);
  run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
    for (int32_t s = ctx.block(); s < heap.world(); s += ctx.blocks())  // block-wide waits
      ctx.wait(heap.source_ready(s), epoch, WaitSite::PeerData, s);
    grid_sync(ctx, ps.bar);
  });
}

// The GEMM of one layer for expert 0 (of_expert moves it to another): A [M, k] of a_kind (FP8:
// with a_scale [M, ceil(k/128)], or as layer0's packed rows, comet/fp8_rows.h, when a_scale is
// null), the weights [E_local] x [n, k] (or [k, n] transposed) of w_kind with w_scale's 128 x 128
// block scales when FP8, C [M, n] of c_kind, the bias [E_local, n] of bias_kind.
TileGemmArgs expert_gemm_args(const void* a, ScalarKind a_kind, const float* a_scale, int64_t k,
                              const void* w, ScalarKind w_kind, const float* w_scale, void* c,
                              ScalarKind c_kind, int64_t n, bool w_transposed, const void* bias,
                              ScalarKind bias_kind) {
  TileGemmArgs t{a, a_kind, w, w_kind, c, c_kind, k, n, w_transposed, bias};
  t.bias_kind = bias_kind;
  if (a_scale) {
    t.a_scale = a_scale;
    t.a_scale_stride = scale_blocks(k);
  } else if (a_kind == ScalarKind::F8E4M3 && k > 0) {  // layer0's packed rows
    const int64_t row = fp8_row_bytes(k);
    t.a_stride = row;
    t.a_scale = reinterpret_cast<const float*>(static_cast<const char*>(a) + fp8_row_scales_at(k));
    t.a_scale_stride = row / 4;
  }
  if (w_kind == ScalarKind::F8E4M3) t.b_scale = w_scale;
  return t;
}

TileGemmArgs of_expert(TileGemmArgs t, int32_t e) {
  const int64_t w_elem = scalar_bytes(t.b_kind);
  t.b = static_cast<const char*>(t.b) + int64_t(e) * t.n * t.k * w_elem;
  if (t.bias) t.bias = static_cast<const char*>(t.bias) + int64_t(e) * t.n * scalar_bytes(t.bias_kind);
  if (t.b_scale) t.b_scale += int64_t(e) * scale_blocks(t.n) * scale_blocks(t.k);
  return t;
}

// A GEMM tile computed by all threads of a block: each its contiguous share of the tile's rows.
// Every output element is one fixed-order dot product, so the split never changes a bit.
template <class Acc>
void block_tile_gemm(const CpuContext& ctx, const TileGemmArgs& t, const MTile& mt, int64_t col0,
                     int64_t cols, std::vector<Acc>& scratch,
                     Activation act = Activation::None) {
  const Share rows = share_of(mt.rows, ctx.thread(), ctx.threads());
  if (rows.size() > 0)
    tile_gemm(t, mt.row_begin + rows.begin, rows.size(), col0, cols, scratch, act);
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
  const int32_t W = heap.world(), d = heap.rank(), E = p.experts, El = E / (W / p.tp), k = p.topk;
  const int64_t T = p.tokens, row = p.row_bytes();
  const DataRegions reg = regions_of(heap, OpKind::Layer0, max_tokens(heap), row, k, E, 1);
  heap.reserve(reg.total);

  // Publish this rank's send plan and tokens.
  char* mine = heap.data(d);
  {
    GridScratch scratch(barrier_grid(l), l.threads, E, 0, 0);
    run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
      send_plan_program(ctx, ps, p.ids, T, k, E, reinterpret_cast<int32_t*>(mine + reg.bucket_off),
                        reinterpret_cast<int32_t*>(mine + reg.send_slot), send_pos);
    });
  }
  if (T > 0) {
    std::memcpy(mine + reg.x, p.x, size_t(T * row));
    // The routing and bucket positions, for the destinations' dedup (comm_layer0.h).
    std::memcpy(mine + reg.ids, p.ids, size_t(T * k) * 4);
    std::memcpy(mine + reg.send_pos, send_pos, size_t(T * k) * 4);
  }
  // Ranks of other nodes get our bucket offsets in their bucket box for us (symm_layout.h), as
  // the GPU's begin kernel sends them, and size their dispatch layout from it.
  const size_t box_row = size_t(E + 1) * 4;
  for (int32_t r = 0; r < W; ++r)
    if (!heap.reachable(r))
      heap.proxy()->put_signal(r, mine + reg.bucket_box + size_t(d) * box_row,
                               mine + reg.bucket_off, box_row,
                               header_flag(heap.header(d), W, PeerFlag::Data, d), epoch);
  const NodePushArgs push{heap.topology(), d, E, El, k, T, row, 0, epoch, reg, p.ids};
  exchange_sources(heap, l, epoch, [&](CpuContext& ctx, const PrologueScratch& ps) {
    layer0_push_program(ctx, ps.bar, push);
  });

  // Dispatch layout from every source's bucket sizes, then the m-tiles and their order.
  sources_ = source_bases(heap, reg);
  rows_ready_.resize(size_t(W));
  for (int32_t s = 0; s < W; ++s) rows_ready_[size_t(s)] = heap.rows_ready(s);
  std::vector<const char*> counts_from(sources_);  // bases whose bucket_off region is s's offsets
  for (int32_t s = 0; s < W; ++s)
    if (!heap.reachable(s)) {
      heap.wait(header_flag(heap.header(d), W, PeerFlag::Data, s), epoch, WaitSite::PeerData, s);
      counts_from[size_t(s)] = mine + reg.bucket_box + size_t(s) * box_row - reg.bucket_off;
    }
  expert_off_.resize(size_t(El) + 1);
  seg_off_.resize(size_t(El) * (W + 1));
  rows_ = dispatch_layout(heap, l, DispatchLayoutArgs{counts_from.data(), reg.bucket_off, d, W, El,
                                                      recv_counts, expert_off_.data(),
                                                      seg_off_.data(), false, p.tp});
  mtiles_ = plan_tiles(heap, l, expert_off_, seg_off_, El, rows_, &order_);
}

int64_t Layer0Call::max_rows_of_group() const {
  const int32_t W = heap_.world(), El = p_.experts / (W / p_.tp);
  const DataRegions reg = regions_of(heap_, OpKind::Layer0, max_tokens(heap_), p_.row_bytes(),
                                     p_.topk, p_.experts, 1);
  const std::vector<const char*> datas = source_bases(heap_, reg);
  std::vector<int32_t> counts(size_t(W) * size_t(El));
  int64_t most = 0;
  for (int32_t dest = 0; dest < W; ++dest) {
    gather_recv_counts(datas.data(), reg.bucket_off, dest, W, El, counts.data(), p_.tp);
    int64_t m = 0;
    for (int32_t c : counts) m += c;
    most = std::max(most, m);
  }
  return most;
}

void Layer0Call::run(void* a, void* y0, int32_t* row_source, int32_t* row_token,
                     int32_t* row_slot) {
  const int32_t W = heap_.world(), d = heap_.rank(), El = p_.experts / (W / p_.tp);
  const int64_t H = p_.hidden, N0 = p_.n0, row = p_.row_bytes();
  const int64_t MT = int64_t(mtiles_.size());
  const DataRegions reg =
      regions_of(heap_, OpKind::Layer0, max_tokens(heap_), row, p_.topk, p_.experts, 1);
  auto& flags = heap_.tile_flags();
  if (int64_t(flags.size()) < MT) flags.resize(size_t(MT), 0);

  Layer0CommArgs ca{d, W, El, p_.topk, row, epoch_, reg, seg_off_.data(),
                    mtiles_.data(), order_.data(), MT, static_cast<char*>(a), flags.data(),
                    row_source, row_token, row_slot};
  ca.sources = sources_.data();
  ca.rows_ready = rows_ready_.data();
  ca.tp = p_.tp;
  std::vector<uint32_t> mtile_rows(size_t(MT), 0);
  ca.mtile_rows = mtile_rows.data();
  ca.dedup = p_.dedup;
  uint64_t received = 0;
  ca.rows_received = &received;
  // n-tiles over the output's columns: with a gated activation each covers F's columns, its gate
  // and up halves read from both halves of w0 (comet/activation.h).
  const int64_t out_n = p_.out_cols();
  // FP8 h: n-tiles of whole 128-column scale blocks (comet/activation.h, the rule the CUDA
  // kernels share), so a tile quantises its blocks on its own
  const int64_t tile_n = activation_tile_cols(l_.tile_n, p_.h_fp8);
  const int32_t NT = int32_t(ceil_div(out_n, tile_n));
  GemmScheduleArgs ga{epoch_, mtiles_.data(), MT, NT, order_.data(), flags.data(), nullptr,
                      nullptr};
  ga.group = l_.raster_group;
  const TileGemmArgs base = expert_gemm_args(
      a, p_.kind, nullptr, H, p_.w0, p_.weight_kind(), p_.w0_scale, y0,
      p_.h_fp8 ? ScalarKind::F8E4M3 : p_.output_kind(), N0, p_.w0_transposed, p_.b0,
      p_.output_kind());
  run_fused(
      heap_, 0, l_,
      [&](CpuContext& ctx) { layer0_comm(ctx, ca); },
      [&](CpuContext& ctx, int32_t g) {
        std::vector<float> tmp32;
        std::vector<double> tmp64;
        layer0_gemm(ctx, g, ctx.blocks(), ga, [&](const MTile& mt, int32_t nt) {
          const TileGemmArgs t = of_expert(base, mt.expert);
          const int64_t col0 = int64_t(nt) * tile_n, cols = std::min<int64_t>(tile_n, out_n - col0);
          if (p_.kind == ScalarKind::F64)
            block_tile_gemm(ctx, t, mt, col0, cols, tmp64, p_.activation);
          else
            block_tile_gemm(ctx, t, mt, col0, cols, tmp32, p_.activation);
        });
      });
  SymmHeap::Traffic& tr = heap_.traffic();
  tr.layer0_rows = int64_t(received);
  tr.layer0_bytes = int64_t(received) * row;
}

template <class Acc>
void layer1_call(SymmHeap& heap, uint64_t epoch, const Layer1Problem<Acc>& p, const CpuLaunch& l,
                 Acc* c, void* out) {
  const int32_t W = heap.world(), d = heap.rank();
  const int32_t E = p.experts, El = E / (W / p.tp), k = p.topk;
  const int64_t T = p.tokens, M = p.rows, N1 = p.n1, H = p.hidden;
  const int64_t elem = scalar_bytes(p.output_kind());  // of the partials on the wire
  const int64_t tmax = max_tokens(heap);
  const DataRegions reg =
      regions_of(heap, OpKind::Layer1, tmax, H, k, E, elem, int32_t(sizeof(Acc)), p.tp);
  heap.reserve(std::max<size_t>(reg.total, 1));

  // Publish this rank's routing, bucket positions, weights and pair lists for the destinations.
  char* mine = heap.data(d);
  if (T > 0) {
    std::memcpy(mine + reg.ids, p.ids, size_t(T * k) * 4);
    std::memcpy(mine + reg.send_pos, p.send_pos, size_t(T * k) * 4);
    std::memcpy(mine + reg.weights, p.weights, size_t(T * k) * sizeof(Acc));
  }
  {
    GridScratch scratch(barrier_grid(l), l.threads, W, T * k, 0);
    run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
      pair_list_program(ctx, ps, p.ids, T, k, E, W / p.tp,
                        reinterpret_cast<int32_t*>(mine + reg.pair_off),
                        reinterpret_cast<int32_t*>(mine + reg.pair_slot));
    });
  }
  const NodePushArgs push{heap.topology(), d, E, El, k, T, 0, int64_t(sizeof(Acc)), epoch, reg,
                          p.ids};
  exchange_sources(heap, l, epoch, [&](CpuContext& ctx, const PrologueScratch&) {
    layer1_push_program(ctx, push);
  });

  std::vector<int64_t> expert_off(size_t(El) + 1), seg_off(size_t(El) * (W + 1));
  // (recv_counts is only read when no counts_from is given; checked on the host)
  int32_t* given = const_cast<int32_t*>(p.recv_counts);
  dispatch_layout(heap, l, DispatchLayoutArgs{nullptr, 0, d, W, El, given, expert_off.data(),
                                              seg_off.data(), false, p.tp});
  std::vector<MTile> mtiles = plan_tiles(heap, l, expert_off, seg_off, El, M, nullptr);
  const int64_t MT = int64_t(mtiles.size());

  // The reduce plan from the peers' published routing and pair lists.
  std::vector<PlanSource<Acc>> src(static_cast<size_t>(W));
  for (int32_t s = 0; s < W; ++s) src[size_t(s)] = plan_source<Acc>(heap.source_base(s, reg), reg);
  const int64_t cap = std::max<int64_t>(M, 1);
  std::vector<int32_t> e_src(static_cast<size_t>(cap)), e_tok(static_cast<size_t>(cap)),
      e_part(static_cast<size_t>(cap));
  std::vector<int64_t> e_begin(static_cast<size_t>(cap) + 1), s_row(static_cast<size_t>(cap));
  std::vector<Acc> s_w(static_cast<size_t>(cap));
  ReducePlan<Acc> plan{0, e_src.data(), e_tok.data(), e_part.data(), e_begin.data(), s_row.data(),
                       s_w.data()};
  int64_t slots = 0, entries = 0;
  {
    GridScratch scratch(barrier_grid(l), l.threads, W, 0, std::max(El, W));
    const ReducePlanArgs<Acc> ra{src.data(), d, W, k, El, seg_off.data(), cap, plan, &slots,
                                 heap.topology().reduce_rpn(), p.tp};
    run_prologue(heap, l, scratch, [&](CpuContext& ctx, const PrologueScratch& ps) {
      const int64_t n = reduce_plan_program(ctx, ps, ra);
      if (grid_rank(ctx) == 0) entries = n;
    });
  }
  // The rule of the GPU's publish kernel: the call fails on this rank (nothing written past the
  // plan's room); ops_cpu.cpp's guarded_call stops the peers and the buffer needs a re-arm.
  if (entries < 0 || slots != M)
    throw std::invalid_argument(
        layout_mismatch_message(d, slots, entries == kPlanEntriesOverflow, M));
  plan.entries = entries;

  const int32_t NT = int32_t(ceil_div(H, l.tile_n));
  auto& flags = heap.tile_flags();
  auto& counts = heap.tile_counts();
  if (int64_t(flags.size()) < NT) flags.resize(size_t(NT), 0);
  if (int64_t(counts.size()) < NT) counts.resize(size_t(NT), 0);

  const int64_t per_item = std::max<int64_t>(
      1, ceil_div(entries, 4 * int64_t(comm_program_blocks(l.n_comm + l.n_gemm, l.n_comm))));
  Layer1CommArgs<Acc> la{d, W, El, k, int32_t(H), l.tile_n, NT, tmax, epoch, reg, c,
                         flags.data(), plan, per_item, heap.blocks_done(), T, p.ids, out,
                         p.output_kind()};
  la.tp = p.tp;
  uint64_t sent = 0;
  la.rows_sent = &sent;
  // Across nodes: partial rows for remote homes are staged in the symmetric segment (reg.stage)
  // and put whole, or (node-reduced) written into their relay's node_stage.
  if (heap.topology().nodes() > 1) {
    la.node_reduce = heap.topology().node_reduce;
    la.metas = heap.metas().data();
    auto& chunk_counts = heap.chunk_counts();
    const size_t chunks = size_t(ceil_div(entries, per_item));
    if (chunk_counts.size() < chunks) chunk_counts.resize(chunks, 0);
    la.ranks_per_node = heap.topology().ranks_per_node;
    la.stage = heap.data(d) + reg.stage;
    la.chunk_done = chunk_counts.data();
  }
  GemmScheduleArgs ga{epoch, mtiles.data(), MT, NT, nullptr, nullptr, counts.data(), flags.data()};
  ga.band_n = l.band_n;
  ga.group = l.raster_group;
  const ScalarKind c_kind = sizeof(Acc) == 8 ? ScalarKind::F64 : ScalarKind::F32;
  // b1 once per (token, expert): on tp rank 0, the other tp ranks' partials carry none.
  const void* b1 = adds_layer1_bias(d, p.tp) ? p.b1 : nullptr;
  const TileGemmArgs base =
      expert_gemm_args(p.h, p.kind, p.h_scale, N1, p.w1, p.weight_kind(), p.w1_scale, c, c_kind,
                       H, p.w1_transposed, b1, p.output_kind());
  run_fused(
      heap, 1, l,
      [&](CpuContext& ctx) { layer1_reduce_send(ctx, la); },
      [&](CpuContext& ctx, int32_t g) {
        std::vector<Acc> tmp;
        layer1_gemm(ctx, g, ctx.blocks(), ga, [&](const MTile& mt, int32_t nt) {
          const TileGemmArgs t = of_expert(base, mt.expert);
          const int64_t col0 = int64_t(nt) * l.tile_n;
          block_tile_gemm(ctx, t, mt, col0, std::min<int64_t>(l.tile_n, H - col0), tmp);
        });
      });
  // The combine as a follow-on step on every co-resident block (the GPU's combine kernel over all
  // SMs): node-reduced, its blocks wait on each other across the nodes (comet/block_roles.h).
  run_grid(&heap, barrier_grid(l), l.threads, l.stress_seed,
           [&](CpuContext& ctx) { layer1_combine(ctx, la); }, nullptr, l.resident, l.device);
  SymmHeap::Traffic& tr = heap.traffic();
  tr.layer1_rows = int64_t(sent);
  tr.layer1_bytes = int64_t(sent) * H * scalar_bytes(p.output_kind());
}

template void layer1_call<float>(SymmHeap&, uint64_t, const Layer1Problem<float>&,
                                 const CpuLaunch&, float*, void*);
template void layer1_call<double>(SymmHeap&, uint64_t, const Layer1Problem<double>&,
                                  const CpuLaunch&, double*, void*);

}  // namespace comet::cpu
