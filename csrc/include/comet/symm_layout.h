// What each rank keeps in symmetric memory, identical on every rank so a peer's address is
// (peer base + the same offset). Two pieces per rank:
//   - a fixed header (flags and the metadata of the current call), created once per buffer;
//   - a data segment, grown on demand, whose regions are laid out per call from values every rank
//     agrees on after the metadata exchange (largest token count, hidden size, topk, experts).
#pragma once

#include <cstring>

#include "comet/config.h"
#include "comet/topology.h"

namespace comet {

enum class OpKind : int32_t { Layer0 = 0, Layer1 = 1 };

// What a rank announces about its call; every rank checks that all ranks announced compatible
// calls before any data moves (so a mismatch is an error on every rank, not a hang).
struct CallMeta {
  uint64_t epoch;
  int32_t op;           // OpKind
  int32_t world;
  int64_t group_hash;   // identity of the group's member list
  int32_t num_experts;
  int32_t topk;
  int32_t hidden;       // H: x's columns (layer0) / the output's columns (layer1)
  int32_t cols;         // N0 (layer0) / N1, h's columns (layer1)
  int32_t dtype;        // ScalarKind of x / h
  int32_t error;        // nonzero: this rank's input was rejected; text in message
  int32_t tp;           // tp_size: expert tensor parallelism (comet/layout.h), 1 = none
  int32_t placement;    // fingerprint of the call's expert placement (comet/layers/placed.py);
                        // 0: the contiguous map. Must agree: a placement is a group's choice
  int64_t tokens;       // T on this rank
  int64_t data_bytes;   // data segment bytes this rank's call needs
  int64_t max_rows;     // the call's bound on dispatched rows (-1: none); shapes every rank's
                        // outputs and whether all raise on overflow, so it must agree
  // layer1: the rows this rank's routing sends (its slots with an expert id) and the rows its
  // layout (recv_counts) dispatches to it; -1: not counted (layer0, a rejected input). The
  // group's totals must match (routing_matches_layouts).
  int64_t routed_rows;
  int64_t layout_rows;
  char message[240];
};

// Whether the layer1 layouts of a call can match its routing, from every rank's metadata: every
// routed row lands on each of the tp ranks of its expert's EP rank, so the layouts dispatch tp
// times the routed rows in all. A cheap, necessary test before any data moves (a layout moved
// between ranks keeps the totals: the reduce plans catch that, comet/prologue.h); true when a
// rank did not count.
COMET_HD bool routing_matches_layouts(const CallMeta* m, int32_t world) {
  int64_t routed = 0, rows = 0;
  for (int32_t s = 0; s < world; ++s) {
    if (m[s].routed_rows < 0 || m[s].layout_rows < 0) return true;
    routed += m[s].routed_rows;
    rows += m[s].layout_rows;
  }
  return rows == int64_t(m[0].tp) * routed;
}

constexpr int kFlagStride = 8;  // uint64 words: one 64-byte line per flag, no false sharing

// Header of one rank. Flags are written by their owner unless noted.
struct RankHeader {
  uint64_t meta_epoch[kFlagStride];  // meta of call `epoch` is readable
  uint64_t data_epoch[kFlagStride];  // this rank's source data of call `epoch` is readable
  uint64_t done_epoch[kFlagStride];  // this rank finished reading peers' memory for call `epoch`
  uint64_t gen_ready[kFlagStride];   // data segment generation `gen` exists and may be mapped
  uint64_t pid[kFlagStride];
  CallMeta meta;
  // Followed by kPeerFlagKinds arrays of `world` flags, flag [kind][s] written by rank s (by a
  // store when s is on this node, by put-with-signal otherwise), each kFlagStride words apart,
  // then `world` CallMeta mailboxes (written by rank s before its PeerFlag::Meta flag).
};

// Per-source flags in a rank's header, written by the source (comet/topology.h for the mirrors).
enum class PeerFlag : int32_t {
  Arrive = 0,      // layer1: s's partials for this rank are complete for epoch
  Mapped = 1,      // s mapped this rank's data generation
  MirrorMeta = 2,  // this rank relays s (another node): s's send plan / routing mirror is complete
  MirrorRows = 3,  // ... and the rows of s's tokens this node needs
  Done = 4,        // s finished reading this rank's memory for call `epoch` (mailbox protocol)
  Meta = 5,        // s's CallMeta of call `epoch` is in this rank's mailbox
  Gen = 6,         // s's data generation `gen` exists
  Data = 7,        // s's source data of call `epoch` is readable (s on this node)
  // Recovery after a failed call (docs/reliability.md). Both carry a re-arm round, not an epoch:
  Fault = 8,       // s failed a call of round value-1 and asks for re-arm `value`; word 1 of
                   // the flag's line: 1 + the rank whose exit s noticed (0: none)
  Rearm = 9,       // s entered re-arm `value`; words 1.. of the flag's line hold its RearmState
};
constexpr int32_t kPeerFlagKinds = 10;

// What a rank brings to a re-arm, in words 1..3 of its Rearm flag's line (written before the
// flag, by stores on its node, in the same put as the signal across nodes). Every rank takes the
// largest epoch and generation, so no flag written before the re-arm can satisfy a later wait.
struct RearmState {
  uint64_t epoch;     // the last call number this rank used
  uint64_t gen;       // its data segment generation
  uint64_t capacity;  // its data segment bytes (0: none)
};
static_assert(sizeof(RearmState) <= (kFlagStride - 1) * sizeof(uint64_t),
              "RearmState must fit in a flag's line after the flag word");

// A peer's re-arm line as a host reads it through a copy engine (the CUDA buffer's recover):
// `read(line)` copies the whole line (flag word, then the RearmState) into `line`, polled until
// the flag reaches `target` or `expired()` says to stop (false then). The peer puts its state
// before its flag (ordered by a fence), so a copy issued after the flag was seen returns that
// state; the copy that saw the flag moved the line in one transfer whose order over the words is
// unspecified, so its state words may predate the put: the state is read once more.
template <class Read, class Expired>
bool poll_rearm_line(Read&& read, uint64_t target, Expired&& expired, RearmState* state) {
  uint64_t line[kFlagStride];
  for (;;) {
    read(line);
    if (line[0] >= target) break;
    if (expired()) return false;
  }
  read(line);
  memcpy(state, line + 1, sizeof(RearmState));
  return true;
}

COMET_HD size_t header_bytes(int32_t world) {
  return sizeof(RankHeader) + size_t(kPeerFlagKinds) * world * kFlagStride * sizeof(uint64_t) +
         size_t(world) * sizeof(CallMeta);
}
COMET_HD uint64_t* header_flag(RankHeader* h, int32_t world, PeerFlag kind, int32_t source) {
  return reinterpret_cast<uint64_t*>(h + 1) +
         (size_t(kind) * size_t(world) + size_t(source)) * kFlagStride;
}
COMET_HD uint64_t* header_arrive(RankHeader* h, int32_t source) {
  // Arrive is kind 0: its address does not depend on the world size.
  return reinterpret_cast<uint64_t*>(h + 1) + size_t(source) * kFlagStride;
}
COMET_HD uint64_t* header_mapped(RankHeader* h, int32_t world, int32_t source) {
  return header_flag(h, world, PeerFlag::Mapped, source);
}
COMET_HD CallMeta* header_meta_box(RankHeader* h, int32_t world, int32_t source) {
  return reinterpret_cast<CallMeta*>(reinterpret_cast<uint64_t*>(h + 1) +
                                     size_t(kPeerFlagKinds) * world * kFlagStride) +
         source;
}

COMET_HD size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Regions of the data segment for one call. Unused regions of an op have size 0.
struct DataRegions {
  // layer0, written by the source rank: its send plan and its tokens
  size_t bucket_off;  // int32 [E+1]
  // layer0 across nodes, written by the ranks of other nodes (mirrors > 0): each one's bucket
  // offsets, [W][E+1], at an offset that does not depend on the token capacity (like
  // bucket_off), so the GPU's begin kernel can size the dispatch layout before the data
  // segment is settled
  size_t bucket_box;
  size_t send_slot;   // int32 [tmax*k]
  size_t x;           // elem  [tmax, H]
  // layer1 (and layer0, where a destination finds a token's other slot rows from its primary
  // one: comm_layer0.h), written by the source rank: its routing and weights
  size_t ids;         // int32 [tmax*k]
  size_t send_pos;    // int32 [tmax*k]
  size_t weights;     // acc   [tmax*k]
  size_t pair_off;    // int32 [W+1]     its (token, destination) pairs by destination
  size_t pair_slot;   // int32 [tmax*k]  (prologue.h: pair_list_program)
  // layer1, written by peers: partial sums of this rank's tokens, one slice per partial slot,
  // in the activation dtype (comm_layer1.h says why)
  size_t recv;        // elem  [partials, tmax, H]
  // layer1 across nodes: this rank's partial rows for homes on other nodes, staged as the source
  // of their puts (symmetric memory: a put's source over IB must be registered), one row per
  // reduce-plan entry of such a home (one per (source, token): at most the other nodes' ranks'
  // tokens; comm_layer1.h: stage_row)
  size_t stage;       // elem  [(W - P) * tmax, H] when mirrors > 0 and partials go per rank
  // layer1 node-reduced (comet/topology.h): written by this node's ranks, the partial rows of the
  // tokens of the homes this rank relays (one per remote node), before this rank sums and sends
  // them: [mirrors][min(k, ranks_per_node)][tmax, H], slot = the sender's ordinal in its node
  size_t node_stage;  // elem
  // Node-first routing (comet/topology.h): the regions above up to source_bytes are what a source
  // publishes; a relay holds `mirrors` (nodes - 1) copies of that part for remote sources, from
  // `mirror` on, source_bytes apart.
  size_t source_bytes;
  size_t mirror;
  size_t total;
};

// partials = min(k, W / tp) * tp: a token's slots reach at most min(k, EP) distinct EP ranks, and
// each of their tp ranks sends its partial row (comet/layout.h: partial_slot). acc_bytes is the
// accumulator size of the weights (4: fp32; 8: fp64 on the CPU backend). node_stage_rows:
// NodeTopology::node_stage_rows(k) when layer1's partials are node-reduced, else 0.
COMET_HD DataRegions data_regions(OpKind op, int64_t tmax, int32_t hidden, int32_t topk,
                                  int32_t num_experts, int32_t world, int32_t elem_bytes,
                                  int32_t acc_bytes = 4, int32_t mirrors = 0,
                                  int32_t node_stage_rows = 0, int32_t tp = 1) {
  const size_t A = 256;  // every region starts on a 256-byte boundary (16-byte vector copies)
  DataRegions r{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    size_t at = off;
    off = align_up(off + bytes, A);
    return at;
  };
  size_t slots = size_t(tmax) * topk;
  if (op == OpKind::Layer0) {
    r.bucket_off = take(size_t(num_experts + 1) * 4);
    r.bucket_box = take(mirrors > 0 ? size_t(world) * size_t(num_experts + 1) * 4 : 0);
    r.send_slot = take(slots * 4);
    r.ids = take(slots * 4);
    r.send_pos = take(slots * 4);
    r.x = take(size_t(tmax) * hidden * elem_bytes);
    r.source_bytes = off;
  } else {
    const int32_t ep = world / tp;
    const int32_t partials = (topk < ep ? topk : ep) * tp;
    r.ids = take(slots * 4);
    r.send_pos = take(slots * 4);
    r.weights = take(slots * acc_bytes);
    r.pair_off = take(size_t(world + 1) * 4);
    r.pair_slot = take(slots * 4);
    r.source_bytes = off;
    r.recv = take(size_t(partials) * tmax * hidden * elem_bytes);
    // node_stage_rows > 0: node-reduced partials (no per-rank staging for puts). The ranks of
    // the other nodes: W - P with P = W / (mirrors + 1) ranks per node.
    const size_t remote_ranks = size_t(world) - size_t(world) / size_t(mirrors + 1);
    r.stage = take(mirrors > 0 && node_stage_rows == 0 ? remote_ranks * tmax * hidden * elem_bytes
                                                       : 0);
    r.node_stage = take(size_t(mirrors) * size_t(node_stage_rows) * tmax * hidden * elem_bytes);
  }
  r.mirror = take(size_t(mirrors) * r.source_bytes);
  r.total = off;
  return r;
}

// The regions of a call on a group of topology t: room for the mirrors of the other nodes'
// sources and, with node-reduced partials, for the relay's node_stage. tp: the call's tp_size.
COMET_HD DataRegions call_regions(const NodeTopology& t, OpKind op, int64_t tmax, int32_t hidden,
                                  int32_t topk, int32_t num_experts, int32_t elem_bytes,
                                  int32_t acc_bytes = 4, int32_t tp = 1) {
  return data_regions(op, tmax, hidden, topk, num_experts, t.world, elem_bytes, acc_bytes,
                      t.nodes() - 1, t.reduces_nodes() ? t.node_stage_rows(topk) : 0, tp);
}

}  // namespace comet
