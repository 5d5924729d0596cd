// The CPU backend of comet.buffers.symm: per rank a fixed header segment and a growable data segment, both
// mapped by every rank of the same node (one-sided reads and writes, NVSHMEM's model on one node),
// plus the per-call protocol every op runs before its kernel:
//
//   begin_call: wait until every peer finished reading our memory in the previous call (so this
//               call may overwrite it), publish this call's metadata, collect every peer's, and
//               return the common verdict (an input error anywhere fails the call everywhere);
//   reserve:    grow every rank's data segment together when the call needs more room;
//   end_call:   announce "finished reading peers' memory for this call".
//
// Nodes (the CPU analog of several machines, comet/topology.h): with ranks_per_node < world,
// ranks of other nodes are not mapped (header()/data() are null for them); everything sent to
// them goes through the LinkProxy (put-with-signal, served by its own thread with the link's
// latency). The protocol is written for that: every flag a rank announces to the group it writes
// into each peer's header mailbox (header_flag(.., PeerFlag::.., me)), by a store on its node and by
// put-with-signal across nodes, so every wait reads local memory only.
//
// Flags carry the call number (epoch), so nothing is reset between calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comet/exec_context.h"
#include "comet/symm_layout.h"
#include "comet/topology.h"
#include "link_proxy.h"
#include "shm_segment.h"
#include "slot_pool.h"

namespace comet::cpu {

// Thrown by every wait once any block of the same call failed, so the others stop quickly.
struct Aborted {};

// Thrown by reserve() when the data segment would have to outgrow the heap's cap, before anything
// changed: every rank decides it alike (same cap, same need), so the call ends cleanly on every
// rank and the buffer goes on at its old capacity (no re-arm).
struct SegmentRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class SymmHeap {
 public:
  // ranks_per_node must divide world (world: one node, no proxy).
  SymmHeap(int32_t rank, int32_t world, std::string job, int64_t group_hash, double timeout_s,
           int32_t ranks_per_node = 0, LinkSettings link = {});
  ~SymmHeap();

  // Set-up steps, each separated by a group barrier (done by the Python side).
  void connect();     // map every peer's header
  void unlink_own();  // every peer has mapped our header: drop its name

  int32_t rank() const { return rank_; }
  int32_t world() const { return world_; }
  int64_t group_hash() const { return group_hash_; }
  // The placement fingerprint the next calls announce (CallMeta::placement; 0: none), set by the
  // Python wrapper before each call (comet/layers/placed.py).
  int32_t call_tag() const { return call_tag_; }
  void set_call_tag(int32_t t) { call_tag_ = t; }
  double timeout() const { return timeout_s_; }
  void set_timeout(double s) { timeout_s_ = s; }
  // OS threads per CPU block for this heap's calls; 0 = $COMET_CPU_BLOCK_THREADS (default 1).
  int32_t block_threads() const { return block_threads_; }
  void set_block_threads(int32_t n) { block_threads_ = n; }
  // Blocks of a CPU kernel live at once, as on a GPU (block_runner.h); 0 = no limit, -1 = not set:
  // $COMET_CPU_RESIDENT_BLOCKS (default no limit).
  int32_t resident_blocks() const { return resident_blocks_; }
  void set_resident_blocks(int32_t n) { resident_blocks_ = n; }
  // The device this rank's kernels run on (slot_pool.h): every heap of a device shares its pool of
  // resident-block slots. Key 0 (a rank per process) unless set; a simulated world sets its ranks'.
  void set_device(int64_t key) { pool_ = device_slot_pool(key); }
  SlotPool* slot_pool() const { return pool_.get(); }
  // Resident-block slots the fused kernels and the grids that wait on themselves leave free for
  // other kernels of the device (Buffer(sm_margin=)); a call's own sm_margin overrides it.
  int32_t sm_margin() const { return sm_margin_; }
  void set_sm_margin(int32_t n) { sm_margin_ = n; }

  // Null for ranks on other nodes.
  RankHeader* header(int32_t r) const { return reinterpret_cast<RankHeader*>(headers_[r]); }
  char* data(int32_t r) const { return data_[r]; }
  const NodeTopology& topology() const { return topo_; }
  // layer1's partials summed per sending node (comet/topology.h); set before the first call, the
  // same on every rank (comet/buffers/symm.py checks).
  void set_node_reduce(bool on) { topo_.node_reduce = on ? 1 : 0; }
  bool reachable(int32_t r) const { return topo_.same_node(rank_, r); }
  // The link to other nodes; null on one node.
  LinkProxy* proxy() const { return proxy_.get(); }
  // This rank's flag `kind` in rank r's header mailbox := value (store, or put-with-signal).
  void send_flag(int32_t r, PeerFlag kind, uint64_t value);
  // Base of source s's published region as this rank reads it (its segment, or its mirror on
  // this node's relay: comet/topology.h), for a call with these regions.
  const char* source_base(int32_t s, const DataRegions& reg) const {
    return comet::source_base(topo_, data_.data(), rank_, s, reg.mirror, reg.source_bytes);
  }
  // The flag that says source s's published data of this call is readable here: s's own
  // data_epoch on this node, the relay's MirrorMeta flag for s across nodes.
  uint64_t* source_ready(int32_t s) const;
  uint64_t* rows_ready(int32_t s) const;  // null on this node (then source_ready covers the rows)

  // Per-call protocol (see above). begin_call returns the epoch; metas() then holds every rank's
  // metadata. verdict() is empty when all ranks' calls agree.
  uint64_t begin_call(CallMeta me);
  const std::vector<CallMeta>& metas() const { return metas_; }
  std::string verdict(const char* op_name) const;
  // Grows the data segment (collective) to at least `bytes` by comet/grow_rule.h: to max(bytes,
  // twice the current size), or to `bytes` when the doubling would pass the cap, freeing the old
  // segment first. Throws SegmentRefused, changing nothing, when `bytes` itself passes the cap.
  void reserve(size_t bytes);
  size_t capacity() const { return capacity_; }
  // The most bytes the data segment may take (0: no cap): the CPU analog of a fixed-size NVSHMEM
  // heap (NVSHMEM_SYMMETRIC_SIZE). Buffer(heap_bytes=), the same on every rank.
  size_t data_limit() const { return data_limit_; }
  void set_data_limit(size_t bytes) { data_limit_ = bytes; }
  // The largest data segment any call (or reserve) of this heap asked for so far.
  size_t requested() const { return requested_; }
  void end_call(uint64_t epoch);

  // Spin until *flag >= epoch (acquire). Throws Aborted when `abort` is set, and a runtime_error
  // naming the site after the timeout or when a peer process is gone.
  void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index,
            const std::atomic<bool>* abort = nullptr) const;

  // Recovery (docs/reliability.md). A failed call leaves peers in an unknown state: mark_broken
  // records why and tells every peer (PeerFlag::Fault; naming a peer whose process is gone, so
  // that every rank's error names the dead rank), whose waits then give up at once. The next
  // call (begin_call) or recover() re-arms the heap: a collective in which every rank drains its
  // link, publishes its last epoch and data generation (PeerFlag::Rearm), and continues from the
  // group's largest epoch, so no flag written before can satisfy a wait after. Segments are kept
  // when every rank still holds the same one (else dropped, and the next call grows them anew).
  // The heap is re-armable until a peer process is gone: then it is dead for good.
  void mark_broken(const std::string& why);
  // Throws if the heap is dead; re-arms it first if this rank or a peer failed a call.
  void recover_if_needed();
  // Re-arms now (collective: every rank calls it, or its next call re-arms, within the timeout).
  void recover();
  bool needs_rearm() const;
  uint64_t rearm_round() const { return round_; }
  void check_usable() const;  // throws if dead

  // Local scratch that persists across calls (flags are epoch-valued, counters self-reset).
  std::vector<uint64_t>& tile_flags() { return tile_flags_; }
  std::vector<uint32_t>& tile_counts() { return tile_counts_; }
  std::vector<uint32_t>& chunk_counts() { return chunk_counts_; }
  uint32_t* blocks_done() { return &blocks_done_; }
  // What the comm blocks of this rank's last layer0 / layer1 call counted (Buffer.traffic).
  struct Traffic {
    int64_t layer0_rows = 0, layer0_bytes = 0, layer1_rows = 0, layer1_bytes = 0;
  };
  Traffic& traffic() { return traffic_; }

 private:
  std::string segment_name(int32_t r, const char* kind, uint64_t gen) const;
  bool peer_alive(int32_t r) const;
  uint64_t peer_pid(int32_t r) const;

  int32_t rank_, world_;
  NodeTopology topo_;
  std::unique_ptr<LinkProxy> proxy_;
  std::vector<uint64_t> remote_pid_;
  std::string job_;
  int64_t group_hash_;
  int32_t call_tag_ = 0;
  double timeout_s_;
  int32_t block_threads_ = 0;
  int32_t resident_blocks_ = -1;
  int32_t sm_margin_ = 0;
  std::shared_ptr<SlotPool> pool_ = device_slot_pool(0);
  uint64_t epoch_ = 0;
  uint64_t gen_ = 0;      // data segment generation, equal on every rank
  size_t capacity_ = 0;   // data segment bytes, equal on every rank
  size_t requested_ = 0;
  size_t data_limit_ = 0;  // 0: no cap
  ShmSegment own_header_;
  std::vector<ShmSegment> peer_headers_;
  std::vector<char*> headers_;
  ShmSegment own_data_;
  std::vector<ShmSegment> peer_data_;
  std::vector<char*> data_;
  std::vector<CallMeta> metas_;
  std::string broken_;   // why the last call failed (re-armable); empty: none
  std::string dead_;     // why the heap cannot be re-armed (a peer is gone); empty: it can
  uint64_t round_ = 0;   // completed re-arms, equal on every rank after each
  int32_t faulted_peer() const;  // a peer that asked for re-arm round_+1, or -1
  // Asks every peer for re-arm `round` (PeerFlag::Fault), naming `dead` (-1: none), a peer whose
  // process is gone, in word 1 of the flag's line.
  void send_fault(uint64_t round, int32_t dead);
  int32_t dead_peer() const;           // a peer whose process is gone, or -1
  // The rank peer s's fault of this round names (word 1 of its Fault line), or -1.
  int32_t fault_named(int32_t s) const;
  // The rank whose exit explains a failure here: the one a wait of this rank reported, else one
  // a peer's fault names, else a dead peer seen from here; -1 if no peer is gone.
  int32_t exit_cause() const;
  void note_exit(int32_t r) const;     // a wait reports rank r's exit (the first one is kept)
  mutable std::atomic<int32_t> exit_seen_{-1};
  void rearm();
  void check_peers_alive();  // marks the heap dead and throws if a peer is gone
  void drop_data_segments();
  std::vector<uint64_t> tile_flags_;
  std::vector<uint32_t> tile_counts_;
  std::vector<uint32_t> chunk_counts_;
  uint32_t blocks_done_ = 0;
  Traffic traffic_;
};

// Registry of live heaps: ops receive an integer handle (keeps op schemas plain and traceable).
int64_t register_heap(std::shared_ptr<SymmHeap> heap);
std::shared_ptr<SymmHeap> find_heap(int64_t handle);  // throws ValueError-style runtime_error
void release_heap(int64_t handle);

}  // namespace comet::cpu
