// The dispatch layout of DESIGN.md, in one place for the CPU backend, the CUDA kernels and the tests.
//
// Source side (rank s): every (token t, slot j) with a valid expert id becomes one row. The send
// plan buckets them by global expert (counting sort, stable in (t, j) order), so the rows that
// destination d wants for its local expert el are bucket d*E_local+el, contiguous and already in
// the required (token, slot) order.
//
// Destination side (rank d): rows are grouped by local expert, then by source rank in ring order
// starting at d, then follow the source's bucket order. expert_off[el] is where expert el starts;
// seg_off[el*(W+1) + p] is where ring position p (source (d+p) mod W) starts, as an absolute row.
#pragma once

#include "comet/config.h"

namespace comet {

COMET_HD int32_t ring_source(int32_t dest, int32_t ring_pos, int32_t world) {
  return (dest + ring_pos) % world;
}
COMET_HD int32_t ring_position(int32_t dest, int32_t source, int32_t world) {
  return (source - dest + world) % world;
}

// Source side: the send plan (bucket_off, send_slot, send_pos) is built by send_plan_program
// (comet/prologue.h), a stable counting sort of the routing slots by expert.

// Destination side. recv_counts[s*E_local + el]: rows source s sends to local expert el of `dest`.
// Outputs expert_off[E_local+1] and seg_off[E_local*(W+1)] (absolute rows). Returns M (total rows).
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

// Row of slot (source s, position pos inside s's bucket for local expert el) on the destination.
COMET_HD int64_t dispatch_row(const int64_t* seg_off, int32_t world, int32_t dest, int32_t source,
                              int32_t el, int32_t pos) {
  return seg_off[el * (world + 1) + ring_position(dest, source, world)] + pos;
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

// Number of distinct ranks among a token's valid slots that hold an expert, and the ordinal of
// `rank` among them in ascending rank order: that ordinal is the token's partial-sum slot in the
// home rank's receive buffer, which fixes the order of the final reduction.
struct PartialSlot {
  int32_t count;    // distinct destination ranks of the token
  int32_t ordinal;  // index of `rank` among them (valid when rank is one of them)
};

COMET_HD PartialSlot partial_slot(const int32_t* token_ids, int32_t k, int32_t experts_local,
                                  int32_t rank) {
  PartialSlot r{0, 0};
  for (int32_t j = 0; j < k; ++j) {
    if (token_ids[j] < 0) continue;
    int32_t dj = token_ids[j] / experts_local;
    bool seen = false;
    for (int32_t i = 0; i < j; ++i)
      if (token_ids[i] >= 0 && token_ids[i] / experts_local == dj) seen = true;
    if (seen) continue;
    ++r.count;
    if (dj < rank) ++r.ordinal;
  }
  return r;
}

}  // namespace comet
