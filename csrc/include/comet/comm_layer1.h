// layer1's comm programs, in two steps:
//  1. reduce-and-send (comm blocks of the fused kernel): for each n-tile in column order (the order
//     the GEMM blocks finish them), wait for its completion flag, reduce every local token's slots
//     (weighted, fp32, ascending slot) over the tile's columns and store the partial slice, in the
//     activation dtype, straight into the token's home rank's receive buffer. The last comm block
//     to finish tells every rank its partials are there.
//  2. combine (a follow-on step on every block: all SMs, not just the comm blocks): once every
//     rank's partials for this rank have arrived, sum each local token's at most min(k, W)
//     partials in fp32 in ascending partial slot (= ascending sending rank) and store the result
//     in the output dtype. Across nodes with node-reduced partials (comet/topology.h), each rank
//     first sums and sends, as its home's relay, the rows its node's ranks staged for one home on
//     every other node (layer1_node_relay), so a home adds one partial per other node.
// Acc is the accumulator: float (fp32) everywhere, double only for float64 on the CPU backend.
// Every step has a fixed order, so results are bitwise reproducible whatever the block counts,
// thread counts and timing.
//
// Work layout: a thread reduces one (entry, group of kColGroup = 8 columns) pair; pairs are
// numbered entry-major, so a warp covers 32 x 8 = 256 contiguous columns of one token (one partial
// row). In the vector path (fp32 Acc, H and tile_n multiples of 8, aligned buffers) a pair reads
// two 16-byte vectors of C per slot and writes one 16-byte vector of bf16/fp16 partials (two for
// fp32), so the loads and stores are 128-bit; otherwise one column per pair, scalar.
//
// Partials travel in the activation dtype (bf16/fp16 on the GPU): half the bytes of fp32 on the
// links and in the home rank's buffer. The cost is one extra rounding of each partial before the
// fp32 combine (relative 2^-9 for bf16, the same as the final rounding of the output);
// tests/test_partials_precision.py measures it against the fp32-partial result and the reference.
#pragma once

#include "comet/copy.h"
#include "comet/exec_context.h"
#include "comet/flags.h"
#include "comet/layout.h"
#include "comet/numeric.h"
#include "comet/reduce_plan.h"
#include "comet/symm_layout.h"
#include "comet/topology.h"

namespace comet {

template <class Acc>
struct Layer1CommArgs {
  int32_t rank, world, experts_local, topk;
  int32_t hidden;       // H: columns of the GEMM output and of out
  int32_t tile_n;
  int32_t num_ntiles;
  int64_t tmax;         // agreed token capacity: stride of the receive buffer slices
  uint64_t epoch;
  DataRegions regions;
  const Acc* c;         // [M, H] local GEMM output
  uint64_t* ntile_ready;// [num_ntiles] local flags, value = epoch when every tile of the column is done
  ReducePlan<Acc> plan;
  int64_t entries_per_item;  // work granularity of phase 1
  uint32_t* blocks_done;     // local counter, self-resetting
  // phase 2
  int64_t tokens;       // local T
  const int32_t* ids;   // local routing [T*k]
  void* out;            // [T, H]
  ScalarKind out_kind;  // also the partials' dtype
  // Several nodes (comet/topology.h; ranks_per_node 0 or W: one node): partial rows for homes on
  // other nodes are reduced into `stage` ([entries, H] in the partials' dtype, local) and sent
  // whole, one put per (entry), by the block that finishes the last n-tile of their chunk
  // (chunk_done: n-tiles reduced per chunk, local, self-resetting).
  int32_t ranks_per_node = 0;
  char* stage = nullptr;
  uint32_t* chunk_done = nullptr;
  // Node-reduced partials (NodeTopology::node_reduce, comet/topology.h): rows for a home on
  // another node go by pointer into the node_stage of the home's relay on this node instead, and
  // the relays sum and send them in the combine step (layer1_node_relay).
  int32_t node_reduce = 0;
  const CallMeta* metas = nullptr;  // [W] every rank's call: the relayed homes' token counts
  // Expert tensor parallelism (comet/layout.h; flat partials only): each of the t ranks of an EP
  // rank sends its partial row of a token, the home adds EPs x t partials (partial_slot).
  int32_t tp = 1;
  // += partial rows this rank sends to other ranks (Buffer.traffic), or null: one per reduce-plan
  // entry whose row goes to another rank (its home, or the home's relay here when node-reduced),
  // and, node-reduced, one per node-summed row this rank forwards as relay (layer1_node_relay)
  uint64_t* rows_sent = nullptr;
};

template <class Acc>
COMET_HD bool several_nodes(const Layer1CommArgs<Acc>& a) {
  return a.ranks_per_node > 0 && a.ranks_per_node < a.world;
}
// Whether rank s is on another node than this rank (then its memory is only reachable by put).
template <class Acc>
COMET_HD bool other_node(const Layer1CommArgs<Acc>& a, int32_t s) {
  return several_nodes(a) && s / a.ranks_per_node != a.rank / a.ranks_per_node;
}

template <class Acc>
COMET_HD bool node_reduced(const Layer1CommArgs<Acc>& a) {
  return several_nodes(a) && a.node_reduce != 0;
}
template <class Acc>
COMET_HD NodeTopology topology_of(const Layer1CommArgs<Acc>& a) {  // several nodes only
  return NodeTopology{a.world, a.ranks_per_node, a.node_reduce};
}
// The home's partial order for a token homed at `home` sent by `sender` (layout.h: slot_groups).
template <class Acc>
COMET_HD SlotGroups groups_of(const Layer1CommArgs<Acc>& a, int32_t home, int32_t sender) {
  return slot_groups(node_reduced(a) ? a.ranks_per_node : 0, home, sender);
}

// The reduce-plan entries whose home is on this rank's node, [lo, hi): entries are in ascending
// source order (prologue.h: reduce_plan_program) and a node's ranks are consecutive, so they are
// one range. They need no staging row; the others take the stage's rows in entry order
// (stage_row), so the stage holds at most the other nodes' ranks' tokens: (W - P) * tmax rows
// (symm_layout.h), not one per entry.
struct EntryRange {
  int64_t lo, hi;
};

template <class Acc>
COMET_HD EntryRange own_node_entries(const Layer1CommArgs<Acc>& a) {
  const int32_t first = a.rank / a.ranks_per_node * a.ranks_per_node;
  auto lower = [&](int32_t src) {  // the first entry whose source is >= src
    int64_t lo = 0, hi = a.plan.entries;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (a.plan.entry_source[mid] < src)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo;
  };
  return EntryRange{lower(first), lower(first + a.ranks_per_node)};
}

// The staging row of entry e, whose home is on another node.
COMET_HD int64_t stage_row(const EntryRange& own, int64_t e) {
  return e < own.lo ? e : e - (own.hi - own.lo);
}

// Rows [first, last) of an ordered list, each sent by a put when sends(i): a maximal run of rows
// in which each follows(i) its predecessor (same target, the next row both where it is read and
// where it lands) goes as one put, put(i, n), as layer0's dispatch sends runs of tokens
// (node_push.h). Each thread takes the runs that start in its share of the rows.
template <class Ctx, class Sends, class Follows, class Put>
COMET_HD void put_runs(Ctx& ctx, int64_t first, int64_t last, Sends&& sends, Follows&& follows,
                       Put&& put) {
  for (int64_t i = first + ctx.thread(); i < last; i += ctx.threads()) {
    if (!sends(i) || (i > first && sends(i - 1) && follows(i))) continue;  // not a run's start
    int64_t n = 1;
    while (i + n < last && sends(i + n) && follows(i + n)) ++n;
    put(i, n);
  }
}

constexpr int32_t kColGroup = 8;

// Whether both steps may use 16-byte vectors: fp32 accumulation, 8-column groups that never
// straddle a tile, and 16-byte aligned bases (row offsets are then multiples of 8 elements).
template <class Ctx, class Acc>
COMET_HD bool layer1_vectorised(Ctx& ctx, const Layer1CommArgs<Acc>& a) {
  const uintptr_t bases = reinterpret_cast<uintptr_t>(a.c) | reinterpret_cast<uintptr_t>(a.out) |
                          reinterpret_cast<uintptr_t>(ctx.data(a.rank) + a.regions.recv) |
                          reinterpret_cast<uintptr_t>(a.stage);
  return sizeof(Acc) == 4 && a.hidden % kColGroup == 0 && a.tile_n % kColGroup == 0 &&
         bases % 16 == 0;
}

// kColGroup fp32 values from 16-byte aligned memory.
COMET_HD void load_group(const float* p, float (&v)[kColGroup]) {
#pragma unroll
  for (int i = 0; i < kColGroup / 4; ++i) {
    const Vec16 q = reinterpret_cast<const Vec16*>(p)[i];
    memcpy(&v[4 * i], &q, 16);
  }
}

// kColGroup values stored as `kind` (fp32, bf16 or fp16) into 16-byte aligned memory.
COMET_HD void store_group(void* p, ScalarKind kind, const float (&v)[kColGroup]) {
  if (kind == ScalarKind::F32) {
#pragma unroll
    for (int i = 0; i < kColGroup / 4; ++i) {
      Vec16 q;
      memcpy(&q, &v[4 * i], 16);
      reinterpret_cast<Vec16*>(p)[i] = q;
    }
    return;
  }
  uint16_t h[kColGroup];
#pragma unroll
  for (int i = 0; i < kColGroup; ++i)
    h[i] = kind == ScalarKind::BF16 ? float_to_bf16(v[i]) : float_to_f16(v[i]);
  Vec16 q;
  memcpy(&q, h, 16);
  *reinterpret_cast<Vec16*>(p) = q;
}

// kColGroup values of `kind` from 16-byte aligned memory, widened to fp32.
COMET_HD void load_group_as(const void* p, ScalarKind kind, float (&v)[kColGroup]) {
  if (kind == ScalarKind::F32) {
    load_group(static_cast<const float*>(p), v);
    return;
  }
  const Vec16 q = *reinterpret_cast<const Vec16*>(p);
  uint16_t h[kColGroup];
  memcpy(h, &q, 16);
#pragma unroll
  for (int i = 0; i < kColGroup; ++i)
    v[i] = kind == ScalarKind::BF16 ? bf16_to_float(h[i]) : f16_to_float(h[i]);
}

// After one (chunk, n-tile) item: the block that completes the chunk's last n-tile sends the
// chunk's staged rows whose home is on another node (whole partial rows of H columns), one put
// per run of entries of one home with consecutive tokens in one partial slot (put_runs), the
// threads of the block each taking runs. The count is published with release after
// the block's stores (fence, barrier), and the last arriver acquires every other block's.
template <class Ctx, class Acc>
COMET_HD void send_staged_rows(Ctx& ctx, const Layer1CommArgs<Acc>& a, const EntryRange& own,
                               int64_t chunk, int64_t first, int64_t last, int64_t pstride) {
  int32_t* complete = static_cast<int32_t*>(ctx.block_shared());
  ctx.fence_peers();
  ctx.sync();
  if (ctx.thread() == 0) {
    const uint32_t before = count_ref(a.chunk_done[chunk]).fetch_add(1u, mo::memory_order_acq_rel);
    *complete = before + 1u == uint32_t(a.num_ntiles);
    if (*complete) count_ref(a.chunk_done[chunk]).store(0u, mo::memory_order_relaxed);
  }
  ctx.sync();
  if (*complete) {
    const int64_t eb = scalar_bytes(a.out_kind);
    const size_t row = size_t(a.hidden) * size_t(eb);
    const ReducePlan<Acc>& pl = a.plan;
    put_runs(
        ctx, first, last, [&](int64_t e) { return other_node(a, pl.entry_source[e]); },
        [&](int64_t e) {  // both of one remote home: adjacent stage rows (stage_row)
          return pl.entry_source[e] == pl.entry_source[e - 1] &&
                 pl.entry_partial[e] == pl.entry_partial[e - 1] &&
                 pl.entry_token[e] == pl.entry_token[e - 1] + 1;
        },
        [&](int64_t e, int64_t n) {
          const int64_t at = int64_t(pl.entry_partial[e]) * pstride +
                             int64_t(pl.entry_token[e]) * a.hidden;
          ctx.put_signal(pl.entry_source[e], ctx.data(a.rank) + a.regions.recv + at * eb,
                         a.stage + stage_row(own, e) * int64_t(row), size_t(n) * row, nullptr, 0);
        });
  }
  ctx.sync();  // `complete` is rewritten by the next item
}

template <class Ctx, class Acc>
COMET_HD void layer1_reduce_send(Ctx& ctx, const Layer1CommArgs<Acc>& a) {
  const bool vec = layer1_vectorised(ctx, a);
  const int64_t chunks = ceil_div(a.plan.entries, a.entries_per_item);
  const int64_t items = chunks * a.num_ntiles;
  const int64_t pstride = a.tmax * a.hidden;  // elements per partial slot
  uint64_t sent = 0;  // this thread's share of the rows sent to other ranks
  const bool staged = several_nodes(a) && !node_reduced(a);
  const EntryRange own = staged ? own_node_entries(a) : EntryRange{0, 0};
  for (int64_t i = ctx.block(); i < items; i += ctx.blocks()) {
    const int32_t n = int32_t(i / chunks);
    const int64_t first = (i % chunks) * a.entries_per_item;
    const int64_t last = first + a.entries_per_item < a.plan.entries ? first + a.entries_per_item
                                                                     : a.plan.entries;
    if (n == 0 && a.rows_sent != nullptr)  // each chunk's rows counted once, at its first n-tile
      for (int64_t e = first + ctx.thread(); e < last; e += ctx.threads()) {
        const int32_t home = a.plan.entry_source[e];
        const int32_t to = other_node(a, home) && node_reduced(a)
                               ? topology_of(a).relay(home, topology_of(a).node(a.rank))
                               : home;
        sent += to != a.rank;
      }
    ctx.wait(&a.ntile_ready[n], a.epoch, WaitSite::ColumnTile, n);
    const int32_t col0 = n * a.tile_n;
    const int32_t cols = a.hidden - col0 < a.tile_n ? a.hidden - col0 : a.tile_n;
    const uint32_t groups = uint32_t(vec ? cols / kColGroup : cols);
    const uint32_t pairs = uint32_t(last - first) * groups;
    for (uint32_t q = uint32_t(ctx.thread()); q < pairs; q += uint32_t(ctx.threads())) {
      const int64_t e = first + q / groups;
      const int32_t col = col0 + int32_t(q % groups) * (vec ? kColGroup : 1);
      const int64_t s0 = a.plan.entry_begin[e], s1 = a.plan.entry_begin[e + 1];
      const int32_t home = a.plan.entry_source[e];
      // The home's receive slot; for a home on another node this entry's staging row, or
      // (node-reduced) its row in the node_stage of the home's relay on this node.
      char* part = ctx.data(home) + a.regions.recv;
      int64_t at = int64_t(a.plan.entry_partial[e]) * pstride +
                   int64_t(a.plan.entry_token[e]) * a.hidden + col;
      if (other_node(a, home) && node_reduced(a)) {
        const NodeTopology t = topology_of(a);
        const int32_t mine = t.node(a.rank);
        part = ctx.data(t.relay(home, mine)) + a.regions.node_stage;
        at = ((int64_t(t.mirror_slot(home, mine)) * t.node_stage_rows(a.topk) +
               a.plan.entry_partial[e]) * a.tmax + a.plan.entry_token[e]) * a.hidden + col;
      } else if (other_node(a, home)) {
        part = a.stage;
        at = stage_row(own, e) * a.hidden + col;
      }
      if (vec) {
        float acc[kColGroup] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t s = s0; s < s1; ++s) {
          const float w = float(a.plan.slot_weight[s]);
          float v[kColGroup];
          load_group(reinterpret_cast<const float*>(a.c) + a.plan.slot_row[s] * a.hidden + col, v);
#pragma unroll
          for (int j = 0; j < kColGroup; ++j) acc[j] += w * v[j];
        }
        store_group(part + at * scalar_bytes(a.out_kind), a.out_kind, acc);
      } else {
        Acc acc = 0;
        for (int64_t s = s0; s < s1; ++s) acc += a.plan.slot_weight[s] * a.c[a.plan.slot_row[s] * a.hidden + col];
        store_as<Acc>(part, at, a.out_kind, acc);
      }
    }
    if (staged) send_staged_rows(ctx, a, own, i % chunks, first, last, pstride);
    ctx.delay();
  }
  if (sent > 0) counter_add(a.rows_sent, sent);
  // Publish "all my partials for you are written" to every rank (also those that got none, so a
  // home rank simply waits for all W).
  ctx.fence_peers();
  ctx.sync();
  if (ctx.thread() == 0) {
    uint32_t before = count_ref(*a.blocks_done).fetch_add(1u, mo::memory_order_acq_rel);
    if (before + 1u == uint32_t(ctx.blocks())) {
      count_ref(*a.blocks_done).store(0u, mo::memory_order_relaxed);
      // Node-reduced: the relays tell the homes on other nodes (layer1_node_relay); the flag to a
      // same-node rank also says "my rows in your node_stage are written".
      // A call that failed here (a GPU wait timed out and returned) tells no home its partials
      // are complete: they may be garbage (the CPU throws instead, so failed() is false there).
      for (int32_t s = 0; s < a.world && !ctx.failed(); ++s) {
        if (!other_node(a, s))
          flag_release(header_arrive(ctx.header(s), a.rank), a.epoch);
        else if (!node_reduced(a))  // after this rank's partial puts to s: FIFO per target
          ctx.put_signal(s, nullptr, nullptr, 0, header_arrive(ctx.header(a.rank), a.rank),
                         a.epoch);
      }
    }
  }
}

// Node-reduced partials, the relay's part (first in the combine step, on every block): this
// rank relays, for each other node B, the home h = B's rank with this rank's local index (whose
// routing it mirrors). Once this node's ranks have written their rows for h's tokens into
// node_stage (their Arrive flags), each token with c >= 1 rows is summed in fp32 in ascending
// slot (= ascending sending rank) into its first row, rounded to the partials' dtype, and that
// row is put into h's receive buffer at the node's slot in h's order: one row per (token, node)
// crosses the link. Tokens split over blocks, (token, column group) pairs over threads, then the
// block's threads put its tokens' rows, one put per run of consecutive tokens in one slot; the
// last block to finish signals every h (after its puts: the link is FIFO per target).
template <class Ctx, class Acc>
COMET_HD void layer1_node_relay(Ctx& ctx, const Layer1CommArgs<Acc>& a) {
  const NodeTopology t = topology_of(a);
  const int32_t mine = t.node(a.rank), rpn = t.ranks_per_node;
  for (int32_t r = mine * rpn; r < (mine + 1) * rpn; ++r)
    ctx.wait(header_arrive(ctx.header(a.rank), r), a.epoch, WaitSite::Partials, r);
  const bool vec = layer1_vectorised(ctx, a);
  const int64_t eb = scalar_bytes(a.out_kind), rows = t.node_stage_rows(a.topk);
  const int64_t pstride = a.tmax * a.hidden;
  char* stage = ctx.data(a.rank) + a.regions.node_stage;
  const uint32_t groups = uint32_t(vec ? a.hidden / kColGroup : a.hidden);
  const SlotGroups within{rpn, 0, mine};
  for (int32_t b = 0; b < t.nodes(); ++b) {
    if (b == mine) continue;
    const int32_t h = t.relay(a.rank, b);  // node b's rank with this rank's local index
    const int32_t ms = t.mirror_slot(h, mine);
    const int32_t* ids = reinterpret_cast<const int32_t*>(
        ctx.data(a.rank) + a.regions.mirror + size_t(ms) * a.regions.source_bytes + a.regions.ids);
    const int64_t tokens = a.metas[h].tokens;
    const int64_t per_block = ceil_div(tokens, ctx.blocks());
    const int64_t t0 = per_block * ctx.block();
    const int64_t t1 = t0 + per_block < tokens ? t0 + per_block : tokens;
    const int64_t base = int64_t(ms) * rows * a.tmax;  // first node_stage row of h's slot 0
    const uint32_t pairs = t1 > t0 ? uint32_t(t1 - t0) * groups : 0u;
    for (uint32_t q = uint32_t(ctx.thread()); q < pairs; q += uint32_t(ctx.threads())) {
      const int64_t tok = t0 + q / groups;
      const int64_t col = int64_t(q % groups) * (vec ? kColGroup : 1);
      const int32_t c = partial_slot(ids + tok * a.topk, a.topk, a.experts_local, a.rank, within).count;
      if (c < 2) continue;  // 0: nothing to send; 1: the row is the sum already
      if (vec) {
        float acc[kColGroup] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int32_t j = 0; j < c; ++j) {
          float v[kColGroup];
          load_group_as(stage + ((base + j * a.tmax + tok) * a.hidden + col) * eb, a.out_kind, v);
#pragma unroll
          for (int i = 0; i < kColGroup; ++i) acc[i] += v[i];
        }
        store_group(stage + ((base + tok) * a.hidden + col) * eb, a.out_kind, acc);
      } else {
        Acc acc = 0;
        for (int32_t j = 0; j < c; ++j)
          acc += load_as<Acc>(stage, (base + j * a.tmax + tok) * a.hidden + col, a.out_kind);
        store_as<Acc>(stage, (base + tok) * a.hidden + col, a.out_kind, acc);
      }
    }
    ctx.fence_peers();  // the sums are in memory before the transport reads them
    ctx.sync();
    const size_t row = size_t(a.hidden) * size_t(eb);
    // The node's slot in h's order for a token, -1 when this node sends it nothing; a run is
    // the consecutive tokens of one slot (their rows adjacent in node_stage and at h).
    auto slot_of = [&](int64_t tok) -> int32_t {
      const int32_t* tid = ids + tok * a.topk;
      if (partial_slot(tid, a.topk, a.experts_local, a.rank, within).count == 0) return -1;
      return partial_slot(tid, a.topk, a.experts_local, a.rank, SlotGroups{rpn, h, -1}).ordinal;
    };
    for (int64_t tok = t0 + ctx.thread(); tok < t1; tok += ctx.threads()) {
      const int32_t slot = slot_of(tok);
      if (slot < 0 || (tok > t0 && slot_of(tok - 1) == slot)) continue;  // not a run's start
      int64_t n = 1;
      while (tok + n < t1 && slot_of(tok + n) == slot) ++n;
      ctx.put_signal(h, ctx.data(a.rank) + a.regions.recv + (slot * pstride + tok * a.hidden) * eb,
                     stage + (base + tok) * int64_t(row), size_t(n) * row, nullptr, 0);
      // Sent rows (Buffer.traffic), counted where they are put: one add per run, not a running
      // total (which made the combine kernel spill).
      if (a.rows_sent != nullptr) counter_add(a.rows_sent, uint64_t(n));
    }
    ctx.sync();
  }
  ctx.fence_peers();
  ctx.sync();
  if (ctx.thread() == 0) {
    const uint32_t before = count_ref(*a.blocks_done).fetch_add(1u, mo::memory_order_acq_rel);
    if (before + 1u == uint32_t(ctx.blocks())) {
      count_ref(*a.blocks_done).store(0u, mo::memory_order_relaxed);
      for (int32_t b = 0; b < t.nodes(); ++b)
        if (b != mine)
          ctx.put_signal(t.relay(a.rank, b), nullptr, nullptr, 0,
                         header_arrive(ctx.header(a.rank), a.rank), a.epoch);
    }
  }
}

// The follow-on step, on every block of a grid: tokens split over blocks, (token, column group)
// pairs over the threads of a block. Node-reduced, this rank first relays (layer1_node_relay),
// then waits for its own node's ranks and for its relay on every other node.
template <class Ctx, class Acc>
COMET_HD void layer1_combine(Ctx& ctx, const Layer1CommArgs<Acc>& a) {
  const bool reduced = node_reduced(a);
  if (reduced) layer1_node_relay(ctx, a);
  for (int32_t s = 0; s < a.world; ++s)
    if (!reduced || !other_node(a, s) ||
        s == topology_of(a).relay(a.rank, topology_of(a).node(s)))
      ctx.wait(header_arrive(ctx.header(a.rank), s), a.epoch, WaitSite::Partials, s);
  const bool vec = layer1_vectorised(ctx, a);
  const char* recv = ctx.data(a.rank) + a.regions.recv;
  const int64_t pstride = a.tmax * a.hidden;
  const int64_t per_block = ceil_div(a.tokens, ctx.blocks());
  const int64_t t0 = per_block * ctx.block();
  const int64_t t1 = t0 + per_block < a.tokens ? t0 + per_block : a.tokens;
  if (t1 <= t0) return;
  const uint32_t groups = uint32_t(vec ? a.hidden / kColGroup : a.hidden);
  const uint32_t pairs = uint32_t(t1 - t0) * groups;
  const int64_t eb = scalar_bytes(a.out_kind);
  for (uint32_t q = uint32_t(ctx.thread()); q < pairs; q += uint32_t(ctx.threads())) {
    const int64_t t = t0 + q / groups;
    const int64_t col = int64_t(q % groups) * (vec ? kColGroup : 1);
    const int32_t parts =
        partial_slot(a.ids + t * a.topk, a.topk, a.experts_local, a.rank,
                     groups_of(a, a.rank, a.rank), a.tp)
            .count;
    if (vec) {
      float acc[kColGroup] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int32_t p = 0; p < parts; ++p) {
        float v[kColGroup];
        load_group_as(recv + (p * pstride + t * a.hidden + col) * eb, a.out_kind, v);
#pragma unroll
        for (int j = 0; j < kColGroup; ++j) acc[j] += v[j];
      }
      store_group(static_cast<char*>(a.out) + (t * a.hidden + col) * eb, a.out_kind, acc);
    } else {
      Acc acc = 0;
      for (int32_t p = 0; p < parts; ++p)
        acc += load_as<Acc>(recv, p * pstride + t * a.hidden + col, a.out_kind);
      store_as<Acc>(a.out, t * a.hidden + col, a.out_kind, acc);
    }
  }
}

}  // namespace comet
