// layer1's reduce plan on a destination rank: one entry per (source rank, token) that has at least
// one slot on this rank, listing that token's local rows (ascending slot) with their weights, and
// the partial-sum slot it owns in the home rank's receive buffer (node-reduced partials for a home
// on another node: its slot in the relay's node_stage, comet/topology.h). Built by reduce_plan_program
// (comet/prologue.h), in parallel over entries, from what the sources published (routing, bucket
// positions, weights, pair lists), so layer1 needs no state from layer0 beyond the per-source row
// counts.
#pragma once

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

}  // namespace comet
