// The text every rank raises when a call is rejected, from all ranks' call metadata: the same
// words on the CPU heap and the CUDA buffer (host code; the CUDA prologue decides on the device
// *whether* to reject, this says *why*).
#pragma once

#include <sstream>
#include <string>

#include "comet/symm_layout.h"

namespace comet {

// bad: the rank whose input was rejected (-1: none). Empty result: the calls agree.
inline std::string call_verdict(const CallMeta* metas, int32_t world, int32_t rank, int32_t bad,
                                const char* op_name) {
  std::ostringstream msg;
  if (bad == rank) return metas[rank].message;
  if (bad >= 0) {
    msg << op_name << ": rank " << bad << " rejected its input: " << metas[bad].message;
    return msg.str();
  }
  const CallMeta& m0 = metas[0];
  static const char* kOps[] = {"moe_layer0", "moe_layer1"};
  static const char* kDtypes[] = {"float32", "bfloat16", "float16", "float64"};
  for (int32_t s = 1; s < world; ++s) {
    const CallMeta& m = metas[s];
    auto differ = [&](const char* what, auto a, auto b) {
      msg << op_name << ": ranks disagree on " << what << ": rank 0 has " << a << ", rank " << s
          << " has " << b;
    };
    if (m.op != m0.op) differ("the op called", kOps[m0.op & 1], kOps[m.op & 1]);
    else if (m.world != m0.world || m.group_hash != m0.group_hash)
      differ("the process group (size)", m0.world, m.world);
    else if (m.tp != m0.tp) differ("tp_size (expert tensor parallelism)", m0.tp, m.tp);
    else if (m.placement != m0.placement)
      differ("the expert placement (fingerprint; 0: none)", m0.placement, m.placement);
    else if (m.num_experts != m0.num_experts) differ("num_experts", m0.num_experts, m.num_experts);
    else if (m.topk != m0.topk) differ("topk (columns of topk_ids)", m0.topk, m.topk);
    else if (m.hidden != m0.hidden) differ("the hidden size H", m0.hidden, m.hidden);
    else if (m.cols != m0.cols)
      differ(m0.op == 0 ? "N0 (rows of w0)" : "N1 (columns of h and w1)", m0.cols, m.cols);
    else if (m.dtype != m0.dtype) differ("the dtype", kDtypes[m0.dtype & 3], kDtypes[m.dtype & 3]);
    else if (m.max_rows != m0.max_rows)
      differ("max_rows (-1: none; layer1 takes it from layer0's layout)", m0.max_rows, m.max_rows);
    else continue;
    return msg.str();
  }
  if (!routing_matches_layouts(metas, world)) {
    int64_t routed = 0, rows = 0;
    for (int32_t s = 0; s < world; ++s) {
      routed += metas[s].routed_rows;
      rows += metas[s].layout_rows;
    }
    msg << op_name << ": the layouts do not match the routing: the group's routing sends "
        << routed << " rows";
    if (m0.tp > 1) msg << " (to each of tp_size = " << m0.tp << " ranks: " << routed * m0.tp << ")";
    msg << " but its layouts (recv_counts) dispatch " << rows << " (";
    for (int32_t s = 0; s < world && s < 8; ++s)
      msg << (s ? ", " : "") << "rank " << s << ": " << metas[s].layout_rows;
    if (world > 8) msg << ", ...";
    msg << "): pass every rank the layout moe_layer0 returned for this call";
    return msg.str();
  }
  return {};
}

// Which rank's rejected input to report: this rank's own, else the lowest failing rank (-1: none).
inline int32_t rejected_rank(const CallMeta* metas, int32_t world, int32_t rank) {
  if (metas[rank].error) return rank;
  for (int32_t s = 0; s < world; ++s)
    if (metas[s].error) return s;
  return -1;
}

}  // namespace comet
