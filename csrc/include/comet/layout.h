// The dispatch layout of docs/design.md, in one place for the CPU backend, the CUDA kernels and the tests.
//
// Source side (rank s): every (token t, slot j) with a valid expert id becomes one row. The send
// plan buckets them by global expert (counting sort, stable in (t, j) order), so the rows that
// destination d wants for its local expert el are bucket d*E_local+el, contiguous and already in
// the required (token, slot) order.
//
// Destination side (rank d): rows are grouped by local expert, then by source rank in ring order
// starting at d, then follow the source's bucket order. expert_off[el] is where expert el starts;
// seg_off[el*(W+1) + p] is where ring position p (source (d+p) mod W) starts, as an absolute row.
//
// Expert tensor parallelism (docs/design.md, "Expert tensor parallelism"): a group of W ranks with
// tp_size t is TP-innermost, rank r = ep_rank * t + tp_rank, and the E experts are split over the
// EP = W / t expert-parallel ranks (E_local = E / EP each), every tp rank of an EP rank holding a
// shard of the same experts. Source side nothing changes (buckets are per global expert); the
// destination side is the EP rank's: every tp rank of it reads the buckets of its EP rank's
// experts (from every one of the W sources) and starts its ring at the EP rank's first rank (the
// ring anchor), so the t ranks of one EP rank build the same layout, row for row. t = 1 is the
// expert-parallel layout above, bit for bit (ep_rank = anchor = rank).
#pragma once

#include "comet/config.h"

namespace comet {

COMET_HD int32_t ep_rank_of(int32_t rank, int32_t tp) { return rank / tp; }
COMET_HD int32_t tp_rank_of(int32_t rank, int32_t tp) { return rank % tp; }
// The rank whose ring every tp rank of `rank`'s EP rank uses (its EP rank's tp rank 0).
COMET_HD int32_t ring_anchor(int32_t rank, int32_t tp) { return rank - rank % tp; }
// Whether `rank` adds layer1's bias b1: once per token and expert, so on tp rank 0 only (the
// home sums the t ranks' partial rows).
COMET_HD bool adds_layer1_bias(int32_t rank, int32_t tp) { return rank % tp == 0; }

COMET_HD int32_t ring_source(int32_t dest, int32_t ring_pos, int32_t world) {
  return (dest + ring_pos) % world;
}
COMET_HD int32_t ring_position(int32_t dest, int32_t source, int32_t world) {
  return (source - dest + world) % world;
}

// Source side: the send plan (bucket_off, send_slot, send_pos) is built by send_plan_program
// (comet/prologue.h), a stable counting sort of the routing slots by expert.

// Destination side. recv_counts[s*E_local + el]: rows source s sends to local expert el of `dest`
// (with tp > 1: pass the ring anchor as `dest`). Outputs expert_off[E_local+1] and seg_off[E_local*(W+1)] (absolute rows). Returns M (total rows).
COMET_HD int64_t build_dispatch_layout(const int32_t* recv_counts, int32_t dest, int32_t world,
                                       int32_t experts_local, int64_t* expert_off,
                                       int64_t* seg_off) {
  int64_t row = 0;
  for (int32_t el = 0; el < experts_local; ++el) {
    expert_off[el] = row;
    for (int32_t p = 0; p < world; ++p) {
      seg_off[el * (world + 1) + p] = row;
      row += recv_counts[ring_source(dest, p, world) * experts_local + el];
    }
    seg_off[el * (world + 1) + world] = row;
  }
  expert_off[experts_local] = row;
  return row;
}

// Row of slot (source s, position pos inside s's bucket for local expert el) on the destination
// (dest: the destination's ring anchor when tp > 1).
COMET_HD int64_t dispatch_row(const int64_t* seg_off, int32_t world, int32_t dest, int32_t source,
                              int32_t el, int32_t pos) {
  return seg_off[el * (world + 1) + ring_position(dest, source, world)] + pos;
}

// The destination rank of slot j of a token if j is the token's first slot on that rank, else -1:
// a token contributes one reduce-plan entry (and one partial) per distinct destination, and
// crosses the link to a destination once, as the row of this slot (layer0's primary row,
// comm_layer0.h: the token's other slot rows there are local copies of it).
// Compares with the token's earlier slots (at most k-1, in registers / L1): the work counted is
// the k slots of each token.
COMET_HD int32_t first_slot_destination(const int32_t* token_ids, int32_t j, int32_t num_experts,
                                        int32_t experts_local) {
  const int32_t e = token_ids[j];
  if (e < 0 || e >= num_experts) return -1;
  const int32_t d = e / experts_local;
  for (int32_t i = 0; i < j; ++i)
    if (token_ids[i] >= 0 && token_ids[i] < num_experts && token_ids[i] / experts_local == d)
      return -1;
  return d;
}

// Inverse lookup for a row of local expert el: its ring position (a linear scan over W entries,
// cheap next to copying a row) and index within the segment.
struct RowOrigin {
  int32_t ring_pos;
  int32_t index;
};

COMET_HD RowOrigin row_origin(const int64_t* seg_off, int32_t world, int32_t el, int64_t row) {
  const int64_t* seg = seg_off + el * (world + 1);
  int32_t p = 0;
  while (p + 1 < world && seg[p + 1] <= row) ++p;
  return RowOrigin{p, int32_t(row - seg[p])};
}

// A token's partial sums and the order the home rank adds them in.
// Flat: the contributors are the distinct ranks among the token's valid slots, in ascending rank
// order; a sender's ordinal is the token's partial-sum slot in the home rank's receive buffer,
// which fixes the order of the final reduction.
// Node-reduced (SlotGroups::ranks_per_node > 0, layer1's combine across nodes, comm_layer1.h): the
// ranks of each node other than the home's count as ONE contributor (their partials are summed on
// that node first), keyed by the node's first rank, so the order stays ascending in rank.
// Within a node (SlotGroups::only_node >= 0): only that node's ranks count, each on its own (the
// order in which a relay adds its node's partials).
// Expert tensor parallelism (tp > 1, flat only): the contributors are the t ranks of each distinct
// EP rank among the token's slots, ascending in rank (EP rank, then tp rank): count = EPs x t, and
// the home adds the t partial rows of the first EP rank, then the next EP rank's, and so on.
struct PartialSlot {
  int32_t count;    // distinct contributors of the token
  int32_t ordinal;  // index of `rank`'s contributor among them (valid when it is one of them)
};

struct SlotGroups {
  int32_t ranks_per_node = 0;  // 0: flat (every rank on its own)
  int32_t home = 0;            // the token's home rank (node-reduced)
  int32_t only_node = -1;      // >= 0: count only this node's ranks, each on its own

  // The contributor key of rank d (ordered like the ranks), or -1 when d does not count.
  COMET_HD int32_t key(int32_t d) const {
    if (ranks_per_node <= 0) return d;
    const int32_t n = d / ranks_per_node;
    if (only_node >= 0) return n == only_node ? d : -1;
    return n == home / ranks_per_node ? d : n * ranks_per_node;
  }
};

// The groups a sender's ordinal is taken in for a token homed at `home`. reduce_rpn: ranks per
// node when partials are node-reduced, else 0 (flat). A sender on another node than the home
// takes its ordinal within its node (its row's slot in the relay's node_stage); one on the home's
// node, and the home adding its partials, use the node-reduced order.
COMET_HD SlotGroups slot_groups(int32_t reduce_rpn, int32_t home, int32_t sender) {
  if (reduce_rpn <= 0) return SlotGroups{};
  if (sender / reduce_rpn != home / reduce_rpn) return SlotGroups{reduce_rpn, 0, sender / reduce_rpn};
  return SlotGroups{reduce_rpn, home, -1};
}

COMET_HD PartialSlot partial_slot(const int32_t* token_ids, int32_t k, int32_t experts_local,
                                  int32_t rank, SlotGroups g = SlotGroups{}, int32_t tp = 1) {
  PartialSlot r{0, 0};
  const int32_t mine = g.key(ep_rank_of(rank, tp));
  for (int32_t j = 0; j < k; ++j) {
    if (token_ids[j] < 0) continue;
    const int32_t kj = g.key(token_ids[j] / experts_local);
    if (kj < 0) continue;
    bool seen = false;
    for (int32_t i = 0; i < j; ++i)
      if (token_ids[i] >= 0 && g.key(token_ids[i] / experts_local) == kj) seen = true;
    if (seen) continue;
    ++r.count;
    if (kj < mine) ++r.ordinal;
  }
  r.count *= tp;
  r.ordinal = r.ordinal * tp + tp_rank_of(rank, tp);
  return r;
}

}  // namespace comet
