// How the prologue builds layer1's reduce plan with one thread per source while still using only
// the engine's own functions (comet/reduce_plan.h): the plan is source-major, so source s's
// entries are exactly what reduce_plan_size / build_reduce_plan produce for a view of the sources
// in which every other source has no tokens. Each part is built at its offsets (prefix sums of
// the parts' sizes); its entry_begin values count from 0 and its closing write lands on the next
// part's first entry, so a final pass rebases them (fix_entry_begin).
//
// Host and device code (COMET_HD), so the partition can be checked against the one-thread build.
#pragma once

#include "comet/reduce_plan.h"

namespace comet::gpu {

// view[o] = all[o] with tokens = 0 for o != s.
template <class Acc>
COMET_HD void source_view(const SourceRouting<Acc>* all, int32_t world, int32_t s,
                          SourceRouting<Acc>* view) {
  for (int32_t o = 0; o < world; ++o) {
    view[o] = all[o];
    if (o != s) view[o].tokens = 0;
  }
}

// The plan's arrays shifted to a part's first entry / slot.
template <class Acc>
COMET_HD ReducePlan<Acc> plan_part(const ReducePlan<Acc>& plan, int64_t entry_off,
                                   int64_t slot_off) {
  ReducePlan<Acc> part = plan;
  part.entry_source += entry_off;
  part.entry_token += entry_off;
  part.entry_partial += entry_off;
  part.entry_begin += entry_off;
  part.slot_row += slot_off;
  part.slot_weight += slot_off;
  return part;
}

// Rebases entry i of the part [e0, e1) whose slots start at slot_off (call for every i of every
// part, in any order, after every part was built; then set entry_begin[entries] = slots).
template <class Acc>
COMET_HD void fix_entry_begin(ReducePlan<Acc>& plan, int64_t i, int64_t e0, int64_t slot_off) {
  plan.entry_begin[i] = i == e0 ? slot_off : plan.entry_begin[i] + slot_off;
}

}  // namespace comet::gpu
