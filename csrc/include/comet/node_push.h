// Node-first routing, source side (comet/topology.h): what a source rank sends to every other node,
// once per node, into the mirror on its relay there. Multi-block programs over the execution
// context (ctx.put_signal: comet/exec_context.h), run after the source published its data in its
// own segment, so every put reads from this rank's symmetric segment at the same offsets it lands
// at in the mirror.
//
//   layer0_push_program  1. (grid thread 0) per remote node: the bucket offsets, the routing and
//                           bucket positions (ids, send_pos) and the node's range of the send
//                           plan, then signal MirrorMeta: the destinations' prologue (dispatch
//                           layout) needs only this;
//                        2. (every block, a contiguous range of the tokens) per remote node: each
//                           maximal run of consecutive tokens of the range with at least one slot
//                           on that node as ONE put of their rows (push_node_rows): a token
//                           crosses to a node once, however many of its slots land there;
//                        3. (grid thread 0, after a grid barrier) per remote node: signal
//                           MirrorRows (ordered after every row put: the link is FIFO per target).
//   layer1_push_program  (grid thread 0) per remote node: the routing block (ids, bucket
//                        positions, weights, pair lists) in five puts, then signal MirrorMeta.
//
// Work: step 2 is T*k/P slot reads per thread for each remote node plus its runs' puts (and at most
// `threads` shared reads to end a run that crosses threads); steps 1, 3 and layer1's are O(nodes)
// puts on one thread (no loop over tokens).
#pragma once

#include "comet/exec_context.h"
#include "comet/parallel.h"
#include "comet/symm_layout.h"
#include "comet/topology.h"

namespace comet {

struct NodePushArgs {
  NodeTopology topo;
  int32_t rank, num_experts, experts_local, topk;
  int64_t tokens;       // T on this rank
  int64_t row_bytes;    // layer0: H * element size
  int64_t acc_bytes;    // layer1: bytes of a weight (the accumulator type)
  uint64_t epoch;
  DataRegions regions;
  const int32_t* ids;   // [T*k] this rank's routing
};

// This rank's mirror on node b's relay, as an address in this rank's own segment (put_signal's
// convention): offset `at` of the published region lands at mirror(b) + at there.
COMET_HD char* mirror_in(char* mine, const NodePushArgs& a, int32_t b) {
  return mine + a.regions.mirror + size_t(a.topo.mirror_slot(a.rank, b)) * a.regions.source_bytes;
}

// Whether token t has a slot on an expert of [e0, e1).
COMET_HD bool token_on(const int32_t* ids, int64_t t, int32_t k, int32_t e0, int32_t e1) {
  for (int32_t j = 0; j < k; ++j) {
    const int32_t e = ids[t * k + j];
    if (e >= e0 && e < e1) return true;
  }
  return false;
}

// Step 2 for one remote node: the rows of this block's tokens with a slot on [e0, e1), one put per
// maximal run of such tokens inside the block's contiguous range of tokens, so a put carries as
// many consecutive rows as the routing allows (a whole block's range when every token goes there)
// and puts per call are at most blocks x runs, not one per token. The block's range is split over
// its threads; a run is put by the thread where it starts, which finds where it ends in its own
// share or, when it reaches the share's end, from the later threads' first token off the node
// (block_shared(), one value per thread): at most `threads` reads, never a walk over tokens.
template <class Ctx>
COMET_HD void push_node_rows(Ctx& ctx, const NodePushArgs& a, int32_t relay, char* mirror,
                             int32_t e0, int32_t e1) {
  char* mine = ctx.data(a.rank);
  const Share blk = share_of(a.tokens, ctx.block(), ctx.blocks());
  const int32_t nt = ctx.threads();
  auto share = [&](int32_t u) {
    const Share s = share_of(blk.size(), u, nt);
    return Share{blk.begin + s.begin, blk.begin + s.end};
  };
  const Share sh = share(ctx.thread());
  auto on = [&](int64_t tok) { return token_on(a.ids, tok, a.topk, e0, e1); };
  int64_t* first_off = static_cast<int64_t*>(ctx.block_shared());  // [threads]
  int64_t off = sh.end;
  for (int64_t tok = sh.begin; tok < sh.end; ++tok)
    if (!on(tok)) {
      off = tok;
      break;
    }
  first_off[ctx.thread()] = off;
  ctx.sync();
  int64_t walked = 0;
  // A run that enters this share from the previous thread's is that thread's to put.
  bool inherited = sh.size() > 0 && sh.begin > blk.begin && on(sh.begin - 1);
  int64_t run = -1;  // first token of the run this thread puts
  for (int64_t tok = sh.begin; tok <= sh.end; ++tok) {
    if (tok < sh.end && on(tok)) {
      if (run < 0 && !inherited) run = tok;
      continue;
    }
    inherited = false;
    if (run < 0) continue;
    int64_t end = tok;
    if (tok == sh.end)  // the run reaches the share's end: it goes on to the first token off
      for (int32_t u = ctx.thread() + 1; u < nt && end == share(u).begin; ++u, ++walked)
        end = first_off[u];
    const size_t at = a.regions.x + size_t(run) * size_t(a.row_bytes);
    ctx.put_signal(relay, mirror + at, mine + at, size_t(end - run) * size_t(a.row_bytes), nullptr,
                   0);
    run = -1;
  }
  ctx.work((2 * sh.size() + 1) * a.topk + walked);
  ctx.sync();  // first_off is reused by the next node
}

template <class Ctx>
COMET_HD void layer0_push_program(Ctx& ctx, const GridBarrier& bar, const NodePushArgs& a) {
  const NodeTopology& t = a.topo;
  const int32_t home = t.node(a.rank), nodes = t.nodes();
  char* mine = ctx.data(a.rank);
  RankHeader* hdr = ctx.header(a.rank);
  const int32_t* bucket_off = reinterpret_cast<const int32_t*>(mine + a.regions.bucket_off);
  const int32_t per_node = t.ranks_per_node * a.experts_local;
  if (grid_rank(ctx) == 0) {
    for (int32_t b = 0; b < nodes; ++b) {
      if (b == home) continue;
      const int32_t relay = t.relay(a.rank, b);
      const int32_t e0 = b * per_node;
      char* mirror = mirror_in(mine, a, b);
      ctx.put_signal(relay, mirror + a.regions.bucket_off, bucket_off,
                     size_t(a.num_experts + 1) * 4, nullptr, 0);
      const int64_t s0 = bucket_off[e0], s1 = bucket_off[e0 + per_node];
      // The routing and bucket positions, where the node gets rows: a destination there finds a
      // token's slot rows from its primary one (comm_layer0.h), so the token crosses once per
      // destination rank.
      const size_t slots = s1 > s0 ? size_t(a.tokens) * size_t(a.topk) * 4 : 0;
      // (one call site in a loop: two inlined puts made the GPU's publish kernel spill)
      for (int i = 0; i < 2; ++i) {
        const size_t at = i == 0 ? a.regions.ids : a.regions.send_pos;
        ctx.put_signal(relay, mirror + at, mine + at, slots, nullptr, 0);
      }
      const size_t at = a.regions.send_slot + size_t(s0) * 4;
      ctx.put_signal(relay, mirror + at, mine + at, size_t(s1 - s0) * 4,
                     header_flag(hdr, t.world, PeerFlag::MirrorMeta, a.rank), a.epoch);
    }
    ctx.work(nodes);
  }
  for (int32_t b = 0; b < nodes; ++b) {
    if (b == home) continue;
    const int32_t e0 = b * per_node;
    push_node_rows(ctx, a, t.relay(a.rank, b), mirror_in(mine, a, b), e0, e0 + per_node);
  }
  grid_sync(ctx, bar);
  if (grid_rank(ctx) == 0) {
    for (int32_t b = 0; b < nodes; ++b)
      if (b != home)
        ctx.put_signal(t.relay(a.rank, b), nullptr, nullptr, 0,
                       header_flag(hdr, t.world, PeerFlag::MirrorRows, a.rank), a.epoch);
  }
}

// Called by one thread (grid thread 0 of a prologue program, or the host).
template <class Ctx>
COMET_HD void layer1_push_program(Ctx& ctx, const NodePushArgs& a) {
  if (grid_rank(ctx) != 0) return;
  const NodeTopology& t = a.topo;
  char* mine = ctx.data(a.rank);
  RankHeader* hdr = ctx.header(a.rank);
  const DataRegions& r = a.regions;
  const size_t slots = size_t(a.tokens) * size_t(a.topk);
  const size_t at[5] = {r.ids, r.send_pos, r.weights, r.pair_off, r.pair_slot};
  const size_t bytes[5] = {slots * 4, slots * 4, slots * size_t(a.acc_bytes),
                           size_t(t.world + 1) * 4, slots * 4};
  for (int32_t b = 0; b < t.nodes(); ++b) {
    if (b == t.node(a.rank)) continue;
    const int32_t relay = t.relay(a.rank, b);
    char* mirror = mirror_in(mine, a, b);
    for (int i = 0; i < 5; ++i) {
      const bool last = i == 4;
      ctx.put_signal(relay, mirror + at[i], mine + at[i], bytes[i],
                     last ? header_flag(hdr, t.world, PeerFlag::MirrorMeta, a.rank) : nullptr,
                     a.epoch);
    }
  }
  ctx.work(t.nodes());
}

}  // namespace comet
