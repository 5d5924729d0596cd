// The GPU side of comet.buffers.symm: one CudaBuffer per expert-parallel group owns the rank's symmetric
// header and data segment, the peer pointer tables the kernels use, the per-buffer device state
// (call counter, self-resetting counters) and the pinned host memory the ops read (the call
// summary of eager calls, the error record kernels write). Where the symmetric memory comes from
// and how the group meets on the host is its SymmBackend's (symm_backend.h): the NVSHMEM heap and
// nvshmem_ptr (a GPU per rank), or one cudaMalloc per symmetric object for W ranks of one process
// on one GPU (the simulated world).
//
// Peers whose memory nvshmem_ptr cannot reach are allowed when they form whole nodes (comet/
// topology.h: ranks_per_node consecutive ranks per node, each rank reaching exactly its node's);
// their table entries are null and the kernels reach them only through the buffer's put ring,
// drained by the proxy kernel (put_ring.cuh, proxy.cu) for the duration of each call.
//
// NVSHMEM's host API stays inside symm_nvshmem.cpp and its device API inside proxy.cu (the one
// -rdc translation unit); this header has no NVSHMEM types, so the op code and the fused kernels
// never see them.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "call_params.h"
#include "put_ring.h"
#include "symm_backend.h"

namespace comet::gpu {

// Thrown by CudaBuffer::grow when the need does not fit NVSHMEM's heap: the old capacity is
// allocated again, so the call ends cleanly on every rank and the buffer serves what fits.
struct SegmentRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What an eager call reads back after its begin kernel (the op's one host synchronisation).
struct CallSummary {
  DeviceState state;
  std::vector<CallMeta> metas;
};

class CudaBuffer {
 public:
  // pes[r]: the NVSHMEM PE of group rank r (the group may be a subgroup of the NVSHMEM world;
  // the inter-node proxy's table). Collective as symm's allocations are (NVSHMEM: over its whole
  // world, so every process of the world constructs its buffer, of whichever group, together;
  // the simulated world: its W ranks' threads), with the same capacity.
  CudaBuffer(int32_t rank, int32_t world, std::vector<int32_t> pes,
             std::shared_ptr<SymmBackend> symm, int device, int64_t group_hash, double timeout_s,
             size_t capacity_bytes);
  ~CudaBuffer();
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  int32_t rank() const { return rank_; }
  int32_t world() const { return world_; }
  // The group is a strict subgroup of the NVSHMEM world: growing needs every process of the world
  // (nvshmem_malloc is world-collective), so it only happens in reserve(), never inside a call.
  bool subgroup() const { return subgroup_; }
  const std::vector<int32_t>& pes() const { return pes_; }
  SymmBackend& symm() const { return *symm_; }
  int device() const { return device_; }
  // Ranks of the group on this rank's GPU (SymmBackend::device_ranks: 1, or W when simulated).
  int32_t device_ranks() const { return symm_->device_ranks(); }
  // The SMs this rank's kernels may use out of the GPU's `device_sms`: all of them with a GPU per
  // rank; floor(SMs / W) when W ranks share the GPU, so that every rank's grids (each at most one
  // block per SM of its share, sm_margin and the proxy's SM taken from it) are co-resident, and
  // none waits for an SM another rank's spinning blocks hold (docs/gpu.md, "Several ranks on one
  // GPU").
  int32_t sm_share(int32_t device_sms) const { return device_sms / std::max(device_ranks(), 1); }
  int64_t group_hash() const { return group_hash_; }
  // The placement fingerprint the next calls announce (as SymmHeap::call_tag on the CPU).
  int32_t call_tag() const { return call_tag_; }
  void set_call_tag(int32_t t) { call_tag_ = t; }
  // SMs a call's kernels leave free for other kernels peers may wait on (Buffer(sm_margin=); a
  // call's own sm_margin overrides it; docs/gpu.md, "SM margin").
  int32_t sm_margin() const { return sm_margin_; }
  void set_sm_margin(int32_t n) { sm_margin_ = n; }
  double timeout() const { return timeout_s_; }
  void set_timeout(double s) { timeout_s_ = s; }
  // Non-empty when some peer's memory is not reachable by pointer (another node, no P2P): which.
  const std::string& unreachable() const { return unreachable_; }
  // reach()[r]: rank r's header and data are reachable by pointer from this rank.
  const std::vector<uint8_t>& reach() const { return reach_; }
  // Nodes (comet/topology.h). Set once after construction from every rank's reach() (comet/
  // symm_cuda.py gathers them: comet/buffers/node_shape.py); checked against this rank's own reach().
  // With more than one node it allocates the put ring and the PE table the proxy uses.
  void set_ranks_per_node(int32_t n);
  int32_t ranks_per_node() const { return ranks_per_node_; }
  NodeTopology topology() const { return NodeTopology{world_, ranks_per_node_, node_reduce_}; }
  // layer1's partials summed per sending node (comet/topology.h); set once before the first call,
  // the same on every rank (comet/buffers/symm_cuda.py checks).
  void set_node_reduce(bool on) { node_reduce_ = on ? 1 : 0; }
  bool multi_node() const { return ranks_per_node_ < world_; }
  // Mirror slots a relay holds (DataRegions.mirror): one per other node.
  int32_t mirrors() const { return world_ / ranks_per_node_ - 1; }
  // Device view of the put ring and this rank's segments (slots null on one node). Changes when
  // the data segment grows: read it again after grow().
  PutRing put_ring() const;
  const int32_t* pes_device() const { return pes_dev_; }
  size_t header_size() const { return header_bytes_; }
  RankHeader* own_header() const { return static_cast<RankHeader*>(header_); }

  // Calls without host synchronisation: outputs hold max_rows rows (-1: off, rows read back).
  int64_t max_rows() const { return max_rows_; }
  void set_max_rows(int64_t r) { max_rows_ = r; }
  // Bytes of a row each op's comm blocks moved in its last call (Buffer.traffic: rows x bytes).
  int64_t traffic_row_bytes[2] = {0, 0};
  int32_t bench_mode() const { return bench_mode_; }
  void set_bench_mode(int32_t m) { bench_mode_ = m; }

  RankHeader* const* headers_table() const;  // device array [W]
  char* const* datas_table() const;          // device array [W]
  char* own_data() const { return static_cast<char*>(data_); }
  size_t capacity() const { return capacity_; }
  // Largest token count whose regions fit the data segment for this shape (equal on every rank
  // that agrees on the shape, so it is the agreed stride of the regions).
  int64_t token_capacity(OpKind op, int64_t hidden, int32_t topk, int32_t num_experts,
                         int32_t elem_bytes, int32_t tp = 1) const;
  // Collective: every rank grows together (they decide from the same call summary); for a
  // subgroup buffer, every process of the NVSHMEM world (reserve()). Frees the old segment
  // before allocating the new one (the heap never holds both), then tries the sizes of
  // comet/grow_rule.h. Throws SegmentRefused, with the old capacity allocated again, when even
  // the need does not fit NVSHMEM's heap (on every rank alike).
  void grow(size_t bytes, cudaStream_t stream);
  // The largest data segment a call or reserve asked for so far.
  size_t requested() const { return requested_; }
  // The data segment's generation (comet/capture_rule.h): advanced by every reallocation in
  // grow(), and mirrored in DeviceState, so a replayed call launched with an older one is caught.
  uint64_t generation() const { return generation_; }

  // The stream the buffer's calls run on (comet/stream_rule.h): called by every op before its
  // first kernel with the caller's stream; binds it, hands the buffer over to it (the new stream
  // waits for the old one's queued work), or throws when that cannot be done.
  void claim_stream(cudaStream_t s);
  bool has_stream() const { return has_stream_; }
  cudaStream_t stream() const { return stream_; }
  // The buffer's own stream for the inter-node proxy kernel (created with the put ring; null on
  // one node): never the caller's, never one of torch's pooled streams other code also gets.
  cudaStream_t proxy_stream() const { return proxy_stream_; }

  DeviceState* state() const { return state_; }
  ErrorRecord* error_device() const { return error_dev_; }
  const ErrorRecord& error_host() const { return *error_host_; }
  void clear_error();

  // Copies the state and every rank's metadata to pinned memory and waits for the stream.
  CallSummary read_summary(const CallMeta* metas_device, cudaStream_t stream);

  // Recovery (docs/reliability.md). A failed call (a timed-out wait, which records and returns
  // instead of trapping) leaves peers in an unknown state: the buffer refuses calls until every
  // rank re-arms it with recover() (collective): each publishes its last call number into its
  // peers' headers (PeerFlag::Rearm, host NVSHMEM puts), all continue from the largest, and the
  // device's counters restart. A CUDA error (the context is gone), a failed grow or a peer that
  // does not join the re-arm within the timeout ends the buffer for good (mark_dead).
  void mark_broken(const std::string& why);
  const std::string& broken() const { return broken_; }
  void mark_dead(const std::string& why);
  const std::string& dead() const { return dead_; }
  bool needs_rearm() const { return !broken_.empty() || fails_call(error_host_->code); }
  uint64_t rearm_round() const { return round_; }
  void recover();

  // Collective: frees the symmetric memory (every rank must call it).
  void release();

  // Symmetric bytes one buffer of `world` ranks takes with a data segment of `data_bytes` (the
  // header and the data, rounded as the buffer rounds them).
  static int64_t heap_bytes(int32_t world, size_t data_bytes);

 private:
  void refresh_tables(cudaStream_t stream);
  void publish_generation(cudaStream_t stream);
  static size_t ring_bytes() {
    return sizeof(RingControl) + size_t(kPutRingSlots) * sizeof(PutRequest);
  }

  int32_t rank_, world_;
  std::vector<int32_t> pes_;
  std::shared_ptr<SymmBackend> symm_;
  bool subgroup_ = false;
  int device_;
  int64_t group_hash_;
  int32_t call_tag_ = 0;
  int32_t sm_margin_ = 0;
  double timeout_s_;
  void* header_ = nullptr;
  void* data_ = nullptr;
  size_t header_bytes_ = 0;
  size_t capacity_ = 0;
  at::Tensor tables_;  // int64 [2, W] on the device: header pointers, data pointers
  DeviceState* state_ = nullptr;
  ErrorRecord* error_host_ = nullptr;
  ErrorRecord* error_dev_ = nullptr;
  void* summary_host_ = nullptr;
  int64_t max_rows_ = -1;
  int32_t bench_mode_ = 0;
  std::string unreachable_;
  std::vector<uint8_t> reach_;
  int32_t ranks_per_node_;
  int32_t node_reduce_ = 0;
  void* ring_mem_ = nullptr;     // device: RingControl, then kPutRingSlots PutRequests
  int32_t* pes_dev_ = nullptr;   // device: pes_
  cudaStream_t proxy_stream_ = nullptr;
  bool has_stream_ = false;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t handover_ = nullptr;
  size_t requested_ = 0;
  uint64_t generation_ = 0;
  uint64_t generation_host_[2] = {0, 0};  // staging of publish_generation (synchronised copy)
  std::string broken_;
  std::string dead_;
  uint64_t round_ = 0;  // completed re-arms, equal on every rank after each
};

// Throws "comet.buffers.symm (CUDA): <what>: <CUDA's error>" unless e is cudaSuccess.
void cuda_check(cudaError_t e, const char* what);

// Text of what the device recorded in an ErrorRecord (empty when nothing); ops_cuda.cpp.
std::string describe_error(const ErrorRecord& e);

// Loads every comet kernel the device can run (ops_cuda.cpp), so that no lazy module load (which
// may synchronise the device) happens during a call, while the inter-node proxy spins on work the
// host has not launched yet. Called when a buffer is created.
void preload_kernels(int device);

// Registry: ops receive an integer handle. CUDA handles live above 2^40, apart from the CPU
// heaps' (small integers), so a handle of the other backend is reported, not misused.
constexpr int64_t kCudaHandleBase = int64_t(1) << 40;
int64_t register_cuda_buffer(std::shared_ptr<CudaBuffer> b);
std::shared_ptr<CudaBuffer> find_cuda_buffer(int64_t handle);  // throws std::invalid_argument
void release_cuda_buffer(int64_t handle);

}  // namespace comet::gpu
