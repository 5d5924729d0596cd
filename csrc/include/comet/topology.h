// Nodes of an expert-parallel group and the node-first (hierarchical) routes between them.
//
// Ranks are grouped into nodes of `ranks_per_node` consecutive ranks (rank r on node
// r / ranks_per_node). Peers on the same node are reachable by pointer (NVLink / shared memory);
// peers on other nodes only through the transport's put-with-signal (NVSHMEM over IB/RoCE on the
// GPU, a proxy thread on the CPU analog): the comm programs never dereference them.
//
// Node-first dispatch (Tutel's 2DH, DeepEP's internode idea): what a source rank s publishes for
// node B (its send plan, the rows of the tokens that have at least one slot on node B, layer1's
// routing) crosses the inter-node link ONCE, into a mirror on s's relay on node B: the rank of
// node B with s's local index (rail-aligned, so every link of a node is used). Every rank of node B
// then reads s's data from that mirror by pointer, as it reads a same-node source: the fan-out
// happens inside the node. A mirror has the layout of the source's own published region (the
// same DataRegions offsets), so a destination reads a source through one base pointer, mirror or
// not, and the comm programs are unchanged; only the parts node B reads are ever written.
//
// layer1's partial sums for a token homed on another node, two policies (NodeTopology::node_reduce):
//  - per rank (default): one row per (token, sending rank) crosses the link with put-with-signal,
//    into the home's receive buffer; the home adds them in ascending rank as on one node, so the
//    results are bitwise equal to one node's;
//  - node-reduced (combine mirrors dispatch): the ranks of the sending node write their rows by
//    pointer into the node_stage of the home's relay on that node (the rank with the home's local
//    index, which also holds the home's mirrored routing); the relay adds them in ascending rank
//    and sends ONE row per (token, node). Fewer bytes on the link (a token with slots on several
//    ranks of a node crosses once), one more rounding of the node's sum to the activation dtype:
//    the results match the reference at the dtype's tolerance, not one node's bits.
#pragma once

#include "comet/config.h"

namespace comet {

struct NodeTopology {
  int32_t world = 1;
  int32_t ranks_per_node = 1;  // divides world; == world: one node
  int32_t node_reduce = 0;     // layer1: partials summed per sending node (see above); 0: per rank

  COMET_HD int32_t nodes() const { return world / ranks_per_node; }
  COMET_HD int32_t node(int32_t r) const { return r / ranks_per_node; }
  COMET_HD bool same_node(int32_t a, int32_t b) const { return node(a) == node(b); }
  // The rank of `node_b` that mirrors source s's published data for node_b's ranks.
  COMET_HD int32_t relay(int32_t s, int32_t node_b) const {
    return node_b * ranks_per_node + s % ranks_per_node;
  }
  // Index of a remote source's mirror among the (nodes - 1) mirror slots of a relay on node_b:
  // the source's node, with node_b itself skipped.
  COMET_HD int32_t mirror_slot(int32_t s, int32_t node_b) const {
    const int32_t n = node(s);
    return n < node_b ? n : n - 1;
  }
  // Whether layer1 sums a node's partials on the home's relay there (several nodes only).
  COMET_HD bool reduces_nodes() const { return node_reduce != 0 && nodes() > 1; }
  // What the partial-slot order takes (layout.h: slot_groups): ranks per node when node-reduced,
  // else 0 (flat).
  COMET_HD int32_t reduce_rpn() const { return reduces_nodes() ? ranks_per_node : 0; }
  // Rows a relay stages per (remote home, token): at most min(k, ranks_per_node) node-mates send.
  COMET_HD int32_t node_stage_rows(int32_t topk) const {
    return topk < ranks_per_node ? topk : ranks_per_node;
  }
  // Experts [first, last) hosted by node_b (experts are laid out rank-major).
  COMET_HD int32_t first_expert(int32_t node_b, int32_t experts_local) const {
    return node_b * ranks_per_node * experts_local;
  }
};

// Where destination `me` reads source s's published region (base of the same DataRegions
// offsets): s's own segment when s is on me's node, else the mirror on s's relay on me's node.
// datas[r]: rank r's data segment as me sees it (null for ranks on other nodes).
COMET_HD const char* source_base(const NodeTopology& t, const char* const* datas, int32_t me,
                                 int32_t s, size_t mirror_region, size_t source_bytes) {
  if (t.same_node(me, s)) return datas[s];
  const int32_t nb = t.node(me);
  return datas[t.relay(s, nb)] + mirror_region + size_t(t.mirror_slot(s, nb)) * source_bytes;
}

}  // namespace comet
