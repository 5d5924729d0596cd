// The per-call prologue of both fused ops as multi-block programs over the execution context, the
// one implementation both backends run (CPU: csrc/cpu/fused_cpu.cpp on thread teams; CUDA:
// csrc/cuda/prologue.cu with many blocks). Built from parallel.h's grid barrier, scan and stable
// counting sort, so every thread handles about T*k/P routing slots (or reduce-plan entries) plus
// O(E*W) counters and scan cells, P being the grid's thread count.
//
//   source side (every rank, before publishing):
//     send_plan_program   layer0: the send plan of layout.h (bucket_off, send_slot, send_pos)
//     pair_list_program   layer1: for each destination rank, this rank's tokens that have a slot
//                         there (ascending), so a destination builds its reduce plan from the
//                         pairs it owns instead of scanning every source's whole routing
//   destination side (after the peers published):
//     dispatch_layout_program  recv_counts from every source's bucket offsets (or given: layer1)
//                         and the dispatch layout of layout.h as one scan over the E_local x (W+1)
//                         segment cells, parallel: no thread reads W x E_local counts
//     tile_plan_program   m-tiles and, for layer0, their visit order (tile_order.h)
//     reduce_plan_program layer1's reduce plan (reduce_plan.h), parallel over entries
//
// Grid-wide steps synchronise with grid_sync (the engine's arrival counter and a generation flag
// inside one launch): separate kernel launches per step would add a launch gap per step on the
// GPU and could not be captured as one node, and the prologue grids are small (one block per SM at
// most), so every block is resident and a spin barrier is safe.
#pragma once

#include "comet/layout.h"
#include "comet/parallel.h"
#include "comet/reduce_plan.h"
#include "comet/symm_layout.h"
#include "comet/tile_order.h"

namespace comet {

// Grid-wide scratch of one prologue program run (the caller sizes counts with
// prologue_count_cells for the largest key count of the program and the grid's thread count).
struct PrologueScratch {
  GridBarrier bar;
  SortScratch sort;
  int32_t* item_keys;  // [T*k] pair_list_program: each slot's key
  int64_t* small;      // [max(E_local, W) + 1]: per-expert m-tile offsets / per-source entry bases
};

COMET_HD int64_t prologue_count_cells(int32_t max_keys, int64_t grid_threads) {
  return int64_t(max_keys) * grid_threads;
}

// ---- source side ----

// layer0's send plan (layout.h): slots bucketed by expert id, stable in slot order. Ids outside
// [0, E) count as dropped here; the op's validation rejects the call before anything moves.
template <class Ctx>
COMET_HD int64_t send_plan_program(Ctx& ctx, const PrologueScratch& s, const int32_t* ids,
                                   int64_t tokens, int32_t k, int32_t num_experts,
                                   int32_t* bucket_off, int32_t* send_slot, int32_t* send_pos) {
  auto key = [=](int64_t i) {
    const int32_t e = ids[i];
    return e >= 0 && e < num_experts ? e : -1;
  };
  return grid_counting_sort(ctx, s.bar, tokens * k, num_experts, key, bucket_off, send_slot,
                            send_pos, s.sort);
}

// layer1, source side: pair_off[W+1] and pair_slot[pairs] = t*k + j of token t's first slot on
// destination d, ordered by (d, t). One step over tokens (a thread walks its tokens' k slots and
// keys each by first_slot_destination), then the stable counting sort over the slots by key.
// With expert tensor parallelism the destinations are the EP ranks (ep_world = W / tp entries of
// pair_off used): every tp rank of EP rank q reads q's list.
template <class Ctx>
COMET_HD int64_t pair_list_program(Ctx& ctx, const PrologueScratch& s, const int32_t* ids,
                                   int64_t tokens, int32_t k, int32_t num_experts, int32_t ep_world,
                                   int32_t* pair_off, int32_t* pair_slot) {
  const int32_t world = ep_world;
  const int32_t el = num_experts / world;
  const Share sh = share_of(tokens, grid_rank(ctx), grid_size(ctx));
  for (int64_t t = sh.begin; t < sh.end; ++t)
    for (int32_t j = 0; j < k; ++j)
      s.item_keys[t * k + j] = first_slot_destination(ids + t * k, j, num_experts, el);
  // (the same slots are counted once, by the sort below)
  grid_sync(ctx, s.bar);
  const int32_t* keys = s.item_keys;
  auto key = [=](int64_t i) { return keys[i]; };
  return grid_counting_sort(ctx, s.bar, tokens * k, world, key, pair_off, pair_slot,
                            static_cast<int32_t*>(nullptr), s.sort);
}

// ---- destination side ----

// recv_counts[s*E_local + el]: rows source s sends to this rank's local expert el, read from every
// source's published bucket offsets (W*E_local reads on one thread: the sequential oracle of
// dispatch_layout_program, used where one thread is the point, e.g. max_rows_of_group on the CPU).
COMET_HD void gather_recv_counts(const char* const* datas, size_t bucket_off_region, int32_t rank,
                                 int32_t world, int32_t experts_local, int32_t* recv_counts,
                                 int32_t tp = 1) {
  const int32_t ep = ep_rank_of(rank, tp);
  for (int32_t s = 0; s < world; ++s) {
    const int32_t* bo = reinterpret_cast<const int32_t*>(datas[s] + bucket_off_region);
    for (int32_t el = 0; el < experts_local; ++el)
      recv_counts[s * experts_local + el] =
          bo[ep * experts_local + el + 1] - bo[ep * experts_local + el];
  }
}

struct DispatchLayoutArgs {
  // [W] bases whose `bucket_off_region` holds source s's published bucket offsets [E+1] (layer0:
  // recv_counts is written from them); null: recv_counts is given (layer1) and only read.
  const char* const* counts_from;
  size_t bucket_off_region;
  int32_t rank, world, experts_local;
  int32_t* recv_counts;  // [W*E_local]
  int64_t* expert_off;   // out [E_local+1]
  int64_t* seg_off;      // out [E_local*(W+1)]
  bool check_counts;     // count negative recv_counts (a malformed layer1 layout)
  int32_t tp = 1;        // tp_size (layout.h): buckets of the EP rank, ring from its anchor
};

// build_dispatch_layout (layout.h) as a grid program, bit for bit: cell el*(W+1) + p of seg_off
// holds the count of ring position p of local expert el (0 in the extra cell p = W), and one
// exclusive scan over the cells in that order turns them into the segments' first rows, the extra
// cell into the expert's end row (the next expert's start). Per thread: its share of the cells
// (one count each, gathered from a source's bucket offsets for layer0), the scan's share, and
// its share of expert_off. Returns M, or -1 (every thread, layout still written) when
// check_counts finds a negative count (a grid-wide count over the sort scratch's first P cells).
template <class Ctx>
COMET_HD int64_t dispatch_layout_program(Ctx& ctx, const PrologueScratch& s,
                                         const DispatchLayoutArgs& a) {
  const int32_t W = a.world, El = a.experts_local, d = ring_anchor(a.rank, a.tp);
  const int32_t q = ep_rank_of(a.rank, a.tp);  // whose experts' buckets are read
  const int64_t cells = int64_t(El) * (W + 1);
  const int64_t g = grid_rank(ctx), P = grid_size(ctx);
  const Share sh = share_of(cells, g, P);
  int32_t negative = 0;
  for (int64_t c = sh.begin; c < sh.end; ++c) {
    const int32_t el = int32_t(c / (W + 1)), pos = int32_t(c % (W + 1));
    if (pos == W) {
      a.seg_off[c] = 0;
      continue;
    }
    const int32_t src = ring_source(d, pos, W);
    int32_t* cnt = a.recv_counts + int64_t(src) * El + el;
    if (a.counts_from != nullptr) {
      const int32_t* bo =
          reinterpret_cast<const int32_t*>(a.counts_from[src] + a.bucket_off_region);
      *cnt = bo[q * El + el + 1] - bo[q * El + el];
    }
    negative += *cnt < 0;
    a.seg_off[c] = *cnt;
  }
  ctx.work(sh.size());
  grid_sync(ctx, s.bar);
  const int64_t rows = grid_exclusive_scan(ctx, s.bar, a.seg_off, cells, s.sort.scan);
  for (int64_t el = g; el <= El; el += P)
    a.expert_off[el] = el < El ? a.seg_off[el * (W + 1)] : rows;
  ctx.work(ceil_div(El + 1, P));
  if (!a.check_counts) {
    grid_sync(ctx, s.bar);
    return rows;
  }
  s.sort.counts[g] = negative;
  grid_sync(ctx, s.bar);
  const int64_t negatives = grid_exclusive_scan(ctx, s.bar, s.sort.counts, P, s.sort.scan);
  ctx.work(1);
  return negatives > 0 ? -1 : rows;
}

struct TilePlanArgs {
  const int64_t* expert_off;  // [E_local+1] from build_dispatch_layout
  const int64_t* seg_off;     // [E_local*(W+1)]
  int32_t world, experts_local, tile_m;
  int64_t mtiles_cap;         // room in mtiles / mtile_order
  MTile* mtiles;              // out [num_mtiles], global (expert-major) numbering
  int64_t* mtile_order;       // out [num_mtiles] layer0 visit order; null for layer1
  int32_t* order_bucket;      // [W+1] scratch of the order's counting sort (layer0)
};

// m-tiles (parallel over m-tiles: a thread finds its tile's expert by binary search over the
// per-expert tile offsets) and, for layer0, the visit order as a stable counting sort of the
// m-tiles by ring distance. Returns the number of m-tiles, or -1 (on every thread, nothing
// written) when it exceeds mtiles_cap.
template <class Ctx>
COMET_HD int64_t tile_plan_program(Ctx& ctx, const PrologueScratch& s, const TilePlanArgs& a) {
  int64_t* tile_off = s.small;  // [E_local+1]
  if (grid_rank(ctx) == 0) {
    tile_off[0] = 0;
    for (int32_t el = 0; el < a.experts_local; ++el)
      tile_off[el + 1] = tile_off[el] + ceil_div(a.expert_off[el + 1] - a.expert_off[el], a.tile_m);
    ctx.work(a.experts_local);
  }
  grid_sync(ctx, s.bar);
  const int64_t n = tile_off[a.experts_local];
  if (n > a.mtiles_cap) return -1;
  const Share sh = share_of(n, grid_rank(ctx), grid_size(ctx));
  for (int64_t id = sh.begin; id < sh.end; ++id) {
    const int32_t el = part_of(tile_off, a.experts_local, id);
    const int64_t r = a.expert_off[el] + (id - tile_off[el]) * a.tile_m;
    const int64_t left = a.expert_off[el + 1] - r;
    a.mtiles[id] = MTile{r, int32_t(left < a.tile_m ? left : a.tile_m), el};
  }
  ctx.work(sh.size());
  grid_sync(ctx, s.bar);
  if (a.mtile_order != nullptr) {
    const MTile* mt = a.mtiles;
    const int64_t* seg = a.seg_off;
    const int32_t world = a.world;
    auto key = [=](int64_t i) { return mtile_ring_distance(mt[i], seg, world); };
    grid_counting_sort(ctx, s.bar, n, world, key, a.order_bucket, a.mtile_order,
                       static_cast<int32_t*>(nullptr), s.sort);
  }
  return n;
}

// What a source published for layer1 (pointers into its symmetric data segment).
template <class Acc>
struct PlanSource {
  const int32_t* ids;        // [tokens*k]
  const int32_t* send_pos;   // [tokens*k]
  const Acc* weights;        // [tokens*k]
  const int32_t* pair_off;   // [W+1]
  const int32_t* pair_slot;  // [pairs]
};

template <class Acc>
COMET_HD PlanSource<Acc> plan_source(const char* data, const DataRegions& r) {
  return PlanSource<Acc>{reinterpret_cast<const int32_t*>(data + r.ids),
                         reinterpret_cast<const int32_t*>(data + r.send_pos),
                         reinterpret_cast<const Acc*>(data + r.weights),
                         reinterpret_cast<const int32_t*>(data + r.pair_off),
                         reinterpret_cast<const int32_t*>(data + r.pair_slot)};
}

template <class Acc>
struct ReducePlanArgs {
  const PlanSource<Acc>* src;  // [W]
  int32_t rank, world, topk, experts_local;
  const int64_t* seg_off;      // this rank's dispatch layout
  int64_t cap;                 // room for entries and for slots in plan
  ReducePlan<Acc> plan;        // out (plan.entries is set by the caller from the return value)
  int64_t* slots_out;          // out: number of slots, or on an overflow the count over cap
  int32_t reduce_rpn = 0;      // ranks per node when layer1's partials are node-reduced, else 0
  int32_t tp = 1;              // tp_size (layout.h); > 1 only with flat partials (reduce_rpn 0)
};

// layer1's reduce plan on this rank, parallel over entries: entry bases per source (one thread,
// W reads); each thread resolves its entries (source by binary search, token from the source's
// pair list, partial slot, slot count); a scan of the slot counts gives entry_begin; each thread
// fills its entries' slots. Entries go source-ascending, token-ascending; slots ascending j.
// Returns the number of entries, or (every thread) kPlanEntriesOverflow / kPlanSlotsOverflow when
// the entries / slots exceed cap, with that count in *slots_out: the peers' routing does not
// match this rank's layout. Both backends refuse the call then (nothing is written past cap).
constexpr int64_t kPlanEntriesOverflow = -1;
constexpr int64_t kPlanSlotsOverflow = -2;

template <class Ctx, class Acc>
COMET_HD int64_t reduce_plan_program(Ctx& ctx, const PrologueScratch& s,
                                     const ReducePlanArgs<Acc>& a) {
  int64_t* base = s.small;  // [W+1] first entry of each source
  const int32_t d = a.rank, k = a.topk, el = a.experts_local;
  const int32_t q = ep_rank_of(d, a.tp), anchor = ring_anchor(d, a.tp);  // (layout.h)
  if (grid_rank(ctx) == 0) {
    base[0] = 0;
    for (int32_t src = 0; src < a.world; ++src)
      base[src + 1] = base[src] + (a.src[src].pair_off[q + 1] - a.src[src].pair_off[q]);
    ctx.work(a.world);
  }
  grid_sync(ctx, s.bar);
  const int64_t entries = base[a.world];
  if (entries > a.cap) {
    if (grid_rank(ctx) == 0) *a.slots_out = entries;
    return kPlanEntriesOverflow;
  }
  const Share sh = share_of(entries, grid_rank(ctx), grid_size(ctx));
  for (int64_t e = sh.begin; e < sh.end; ++e) {
    const int32_t src = part_of(base, a.world, e);
    const PlanSource<Acc>& p = a.src[src];
    const int32_t t = p.pair_slot[p.pair_off[q] + (e - base[src])] / k;
    const int32_t* ids = p.ids + int64_t(t) * k;
    a.plan.entry_source[e] = src;
    a.plan.entry_token[e] = t;
    a.plan.entry_partial[e] =
        partial_slot(ids, k, el, d, slot_groups(a.reduce_rpn, src, d), a.tp).ordinal;
    int64_t n = 0;
    for (int32_t j = 0; j < k; ++j) n += ids[j] >= 0 && ids[j] / el == q;
    a.plan.entry_begin[e] = n;
  }
  ctx.work(sh.size());
  const int64_t slots = grid_exclusive_scan(ctx, s.bar, a.plan.entry_begin, entries,
                                            s.sort.scan);
  if (slots > a.cap) {
    if (grid_rank(ctx) == 0) *a.slots_out = slots;
    return kPlanSlotsOverflow;
  }
  if (grid_rank(ctx) == 0) {
    a.plan.entry_begin[entries] = slots;
    *a.slots_out = slots;
  }
  for (int64_t e = sh.begin; e < sh.end; ++e) {
    const int32_t src = a.plan.entry_source[e];
    const PlanSource<Acc>& p = a.src[src];
    const int64_t t = a.plan.entry_token[e];
    int64_t sl = a.plan.entry_begin[e];
    for (int32_t j = 0; j < k; ++j) {
      const int32_t id = p.ids[t * k + j];
      if (id < 0 || id / el != q) continue;
      a.plan.slot_row[sl] =
          dispatch_row(a.seg_off, a.world, anchor, src, id % el, p.send_pos[t * k + j]);
      a.plan.slot_weight[sl] = p.weights[t * k + j];
      ++sl;
    }
  }
  grid_sync(ctx, s.bar);
  return entries;
}

}  // namespace comet
