// layer1's reduce plan on a destination rank: one entry per (source rank, token) that has at least
// one slot on this rank, listing that token's local rows (ascending slot) with their weights, and
// the partial-sum slot it owns in the home rank's receive buffer (node-reduced partials for a home
// on another node: its slot in the relay's node_stage, comet/topology.h). Built by reduce_plan_program
// (comet/prologue.h), in parallel over entries, from what the sources published (routing, bucket
// positions, weights, pair lists), so layer1 needs no state from layer0 beyond the per-source row
// counts.
#pragma once

#include <string>

#include "comet/layout.h"

namespace comet {

template <class Acc>
struct ReducePlan {
  int64_t entries;
  int32_t* entry_source;  // [entries]
  int32_t* entry_token;   // [entries]
  int32_t* entry_partial; // [entries] partial slot in the home's receive buffer (or node_stage)
  int64_t* entry_begin;   // [entries+1] into slot_row / slot_weight
  int64_t* slot_row;      // [slots] row in the dispatch layout
  Acc* slot_weight;       // [slots]
};

// The error of a layer1 call whose layout (recv_counts: `layout_rows` rows on this rank) does not
// match the peers' routing, which sends `sent` rows here (at least that many when only the
// (token, rank) pairs were counted). Both backends word it so.
inline std::string layout_mismatch_message(int32_t rank, int64_t sent, bool at_least,
                                           int64_t layout_rows) {
  return "comet.moe_layer1: the peers' routing sends rank " + std::to_string(rank) + " " +
         (at_least ? "at least " : "") + std::to_string(sent) +
         " rows but its layout (recv_counts) dispatches " + std::to_string(layout_rows) +
         ": pass the layout moe_layer0 returned for this call, unedited, on every rank";
}

}  // namespace comet
