// layer1's reduce plan on a destination rank: one entry per (source rank, token) that has at least
// one slot on this rank, listing that token's local rows (ascending slot) with their weights, and
// the partial-sum slot it owns in the home rank's receive buffer. Built from what the sources
// published (routing, bucket positions, weights), so layer1 needs no state from layer0 beyond the
// per-source row counts.
#pragma once

#include "comet/layout.h"

namespace comet {

template <class Acc>
struct ReducePlan {
  int64_t entries;
  int32_t* entry_source;  // [entries]
  int32_t* entry_token;   // [entries]
  int32_t* entry_partial; // [entries] partial slot in the home rank's receive buffer
  int64_t* entry_begin;   // [entries+1] into slot_row / slot_weight
  int64_t* slot_row;      // [slots] row in the dispatch layout
  Acc* slot_weight;       // [slots]
};

// What one source published for layer1.
template <class Acc>
struct SourceRouting {
  const int32_t* ids;       // [tokens*k]
  const int32_t* send_pos;  // [tokens*k]
  const Acc* weights;       // [tokens*k]
  int64_t tokens;
};

COMET_HD bool token_has_local_slot(const int32_t* ids, int32_t k, int32_t experts_local,
                                   int32_t rank) {
  for (int32_t j = 0; j < k; ++j)
    if (ids[j] >= 0 && ids[j] / experts_local == rank) return true;
  return false;
}

// Sizes of the plan: returns entries, writes the slot count.
template <class Acc>
COMET_HD int64_t reduce_plan_size(const SourceRouting<Acc>* src, int32_t world, int32_t k,
                                  int32_t experts_local, int32_t rank, int64_t* slots) {
  int64_t entries = 0;
  *slots = 0;
  for (int32_t s = 0; s < world; ++s)
    for (int64_t t = 0; t < src[s].tokens; ++t) {
      const int32_t* ids = src[s].ids + t * k;
      if (!token_has_local_slot(ids, k, experts_local, rank)) continue;
      ++entries;
      for (int32_t j = 0; j < k; ++j)
        if (ids[j] >= 0 && ids[j] / experts_local == rank) ++*slots;
    }
  return entries;
}

// Fills a plan sized by reduce_plan_size. Entries go source-ascending, token-ascending.
template <class Acc>
COMET_HD void build_reduce_plan(const SourceRouting<Acc>* src, int32_t world, int32_t k,
                                int32_t experts_local, int32_t rank, const int64_t* seg_off,
                                ReducePlan<Acc>& plan) {
  int64_t e = 0, sl = 0;
  for (int32_t s = 0; s < world; ++s)
    for (int64_t t = 0; t < src[s].tokens; ++t) {
      const int32_t* ids = src[s].ids + t * k;
      if (!token_has_local_slot(ids, k, experts_local, rank)) continue;
      plan.entry_source[e] = s;
      plan.entry_token[e] = int32_t(t);
      plan.entry_partial[e] = partial_slot(ids, k, experts_local, rank).ordinal;
      plan.entry_begin[e] = sl;
      for (int32_t j = 0; j < k; ++j) {
        if (ids[j] < 0 || ids[j] / experts_local != rank) continue;
        plan.slot_row[sl] = dispatch_row(seg_off, world, rank, s, ids[j] % experts_local,
                                         src[s].send_pos[t * k + j]);
        plan.slot_weight[sl] = src[s].weights[t * k + j];
        ++sl;
      }
      ++e;
    }
  plan.entry_begin[e] = sl;
  plan.entries = e;
}

}  // namespace comet
