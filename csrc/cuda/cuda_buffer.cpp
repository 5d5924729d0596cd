// CudaBuffer (cuda_buffer.h): the rank's symmetric header and data segment, the peer pointer
// tables the kernels use, the call state and the recovery, written against SymmBackend
// (symm_backend.h) for how the symmetric memory is obtained and how the group meets on the host
// (NVSHMEM: symm_nvshmem.cpp; W ranks of one process on one GPU: symm_sim.cpp). Also the registry
// of the buffers the ops find by handle.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "comet/capture_rule.h"
#include "comet/grow_rule.h"
#include "comet/stream_rule.h"
#include "comet/symm_layout.h"
#include "cuda_buffer.h"
#include "handle_registry.h"

namespace comet::gpu {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("comet.buffers.symm (CUDA): ") + what + ": " +
                             cudaGetErrorString(e));
}

namespace {

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

constexpr size_t kMinData = size_t(1) << 20;  // room for the bucket offsets of ~250k experts

void* symmetric_alloc(SymmBackend& symm, size_t bytes, const char* what) {
  void* p = symm.alloc(bytes);
  if (p == nullptr) throw std::runtime_error(symm.heap_full(bytes, what));
  return p;
}

uint64_t stream_id(cudaStream_t s) { return uint64_t(reinterpret_cast<uintptr_t>(s)); }

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. the legacy stream queried during another's global capture
    return false;
  }
  return st == cudaStreamCaptureStatusActive;
}

}  // namespace

CudaBuffer::CudaBuffer(int32_t rank, int32_t world, std::vector<int32_t> pes,
                       std::shared_ptr<SymmBackend> symm, int device, int64_t group_hash,
                       double timeout_s, size_t capacity_bytes)
    : rank_(rank), world_(world), pes_(std::move(pes)), symm_(std::move(symm)), device_(device),
      group_hash_(group_hash), timeout_s_(timeout_s), ranks_per_node_(world) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  subgroup_ = symm_->subgroup();
  // Before the collective allocations: a failure here is the same on every rank (same binary,
  // same GPU model), so every rank raises instead of some waiting in the collective allocation.
  preload_kernels(device);
  cuda_check(cudaEventCreateWithFlags(&handover_, cudaEventDisableTiming), "cudaEventCreate");
  header_bytes_ = round_up(header_bytes(world), 256);
  header_ = symmetric_alloc(*symm_, header_bytes_, "buffer header");
  capacity_ = round_up(capacity_bytes > kMinData ? capacity_bytes : kMinData, size_t(1) << 20);
  data_ = symmetric_alloc(*symm_, capacity_, "data segment");
  cuda_check(cudaMemset(header_, 0, header_bytes_), "clearing the header");

  cuda_check(cudaMalloc(reinterpret_cast<void**>(&state_), sizeof(DeviceState)), "cudaMalloc");
  cuda_check(cudaMemset(state_, 0, sizeof(DeviceState)), "clearing the device state");
  publish_generation(at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
  cuda_check(cudaHostAlloc(reinterpret_cast<void**>(&error_host_), sizeof(ErrorRecord),
                           cudaHostAllocMapped),
             "cudaHostAlloc");
  std::memset(error_host_, 0, sizeof(ErrorRecord));
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_host_, 0),
             "cudaHostGetDevicePointer");
  cuda_check(cudaHostAlloc(&summary_host_, sizeof(DeviceState) + world * sizeof(CallMeta),
                           cudaHostAllocDefault),
             "cudaHostAlloc");
  tables_ = at::zeros({2, world}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA, device));
  refresh_tables(at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
  cuda_check(cudaDeviceSynchronize(), "initialising the buffer");
}

CudaBuffer::~CudaBuffer() {
  // The symmetric memory is only freed by release() (collective); the local resources always.
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  if (summary_host_ != nullptr) cudaFreeHost(summary_host_);
  if (state_ != nullptr) cudaFree(state_);
  if (ring_mem_ != nullptr) cudaFree(ring_mem_);
  if (pes_dev_ != nullptr) cudaFree(pes_dev_);
  if (proxy_stream_ != nullptr) cudaStreamDestroy(proxy_stream_);
  if (handover_ != nullptr) cudaEventDestroy(handover_);
}

void CudaBuffer::claim_stream(cudaStream_t s) {
  // Several ranks on this GPU (the simulated world): a rank's calls on the legacy default stream
  // would wait for, and be waited on by, every other rank's blocking work, and the host copies
  // of recover() (symm_sim.cpp) would queue behind its spinning kernels.
  if (device_ranks() > 1 && (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread))
    throw std::invalid_argument(
        "comet: rank " + std::to_string(rank_) + " of a simulated world of " +
        std::to_string(world_) + " ranks on one GPU called on the default CUDA stream: give each "
        "rank's thread a stream of its own (with torch.cuda.stream(torch.cuda.Stream()): ...)");
  const bool old_capturing = has_stream_ && capturing(stream_);
  switch (stream_step(has_stream_, stream_id(stream_), old_capturing, stream_id(s),
                      capturing(s))) {
    case StreamStep::Bind:
      has_stream_ = true;
      stream_ = s;
      break;
    case StreamStep::Same:
    case StreamStep::Capture:
      break;
    case StreamStep::HandOver:
      // Recorded now, the event follows every call the host queued on the old stream.
      cuda_check(cudaEventRecord(handover_, stream_), "handing the buffer to another stream");
      cuda_check(cudaStreamWaitEvent(s, handover_, 0), "handing the buffer to another stream");
      stream_ = s;
      break;
    case StreamStep::Refuse: {
      char msg[512];
      std::snprintf(msg, sizeof(msg),
                    "comet: a call on CUDA stream 0x%" PRIx64 " while this buffer's stream 0x%"
                    PRIx64 " is capturing a CUDA graph with calls of the same buffer: the two "
                    "could run concurrently and read each other's call number. End the capture "
                    "first, or give the captured calls a buffer of their own",
                    stream_id(s), stream_id(stream_));
      throw std::runtime_error(msg);
    }
  }
}

void CudaBuffer::set_ranks_per_node(int32_t n) {
  std::ostringstream bad;
  if (n < 1 || world_ % n != 0) {
    bad << "ranks_per_node " << n << " does not divide the group of " << world_;
  } else {
    const int32_t first = rank_ / n * n;
    for (int32_t r = 0; r < world_; ++r) {
      const bool same = r >= first && r < first + n;
      if (bool(reach_[size_t(r)]) != same)
        bad << (bad.tellp() > 0 ? ", " : "") << "rank " << r << " is "
            << (same ? "on its node but not reachable" : "on another node but reachable");
    }
    if (bad.tellp() > 0) {
      std::ostringstream head;
      head << "with " << n << " ranks per node, rank " << rank_ << " would be on node "
           << rank_ / n << " (ranks " << first << ".." << first + n - 1 << "), but ";
      bad.str(head.str() + bad.str());
    }
  }
  if (bad.tellp() > 0)
    throw std::runtime_error("comet.buffers.symm (CUDA): " + bad.str());
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  ranks_per_node_ = n;
  if (n < world_ && ring_mem_ == nullptr) {
    const size_t bytes = ring_bytes();
    cuda_check(cudaMalloc(&ring_mem_, bytes), "cudaMalloc (put ring)");
    cuda_check(cudaMemset(ring_mem_, 0, bytes), "clearing the put ring");
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&pes_dev_), sizeof(int32_t) * world_),
               "cudaMalloc (PE table)");
    cuda_check(cudaMemcpy(pes_dev_, pes_.data(), sizeof(int32_t) * world_, cudaMemcpyHostToDevice),
               "copying the PE table");
    // The proxy's own stream, at the highest priority: its one block should be scheduled ahead
    // of queued work, and no other code (torch's stream pool hands its streams to anyone) queues
    // work behind a proxy that spins until the call's end kernel.
    int lowest = 0, highest = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&lowest, &highest), "stream priorities");
    cuda_check(cudaStreamCreateWithPriority(&proxy_stream_, cudaStreamNonBlocking, highest),
               "creating the proxy stream");
  }
}

PutRing CudaBuffer::put_ring() const {
  PutRing r{};
  if (ring_mem_ != nullptr && multi_node()) {
    r.control = static_cast<RingControl*>(ring_mem_);
    r.slots = reinterpret_cast<PutRequest*>(static_cast<char*>(ring_mem_) + sizeof(RingControl));
  }
  r.header = static_cast<char*>(header_);
  r.header_bytes = header_bytes_;
  r.data = static_cast<char*>(data_);
  r.data_bytes = capacity_;
  return r;
}

void CudaBuffer::refresh_tables(cudaStream_t stream) {
  at::Tensor host = at::empty({2, world_}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* t = host.data_ptr<int64_t>();
  std::ostringstream bad;
  const bool first = reach_.empty();
  reach_.resize(size_t(world_));
  for (int32_t r = 0; r < world_; ++r) {
    void* h = symm_->peer(header_, r);
    void* d = symm_->peer(data_, r);
    const bool ok = h != nullptr && d != nullptr;
    if (!ok) bad << (bad.tellp() > 0 ? ", " : "") << r;
    if (!first && bool(reach_[size_t(r)]) != ok)
      throw std::runtime_error("comet.buffers.symm (CUDA): rank " + std::to_string(r) +
                               " changed reachability when the data segment grew");
    reach_[size_t(r)] = ok;
    // Null for another node: a stray pointer access faults instead of touching the wrong memory.
    t[r] = ok ? reinterpret_cast<int64_t>(h) : 0;
    t[world_ + r] = ok ? reinterpret_cast<int64_t>(d) : 0;
  }
  if (bad.tellp() > 0)
    unreachable_ = "comet.buffers.symm (CUDA): rank " + std::to_string(rank_) +
                   " cannot reach the symmetric memory of rank(s) " + bad.str() +
                   " by pointer (other nodes, reached through NVSHMEM put-with-signal; or GPUs "
                   "without peer-to-peer access)";
  cuda_check(cudaMemcpyAsync(tables_.data_ptr(), t, sizeof(int64_t) * 2 * world_,
                             cudaMemcpyHostToDevice, stream),
             "copying the peer tables");
  cuda_check(cudaStreamSynchronize(stream), "copying the peer tables");
}

RankHeader* const* CudaBuffer::headers_table() const {
  return reinterpret_cast<RankHeader* const*>(tables_.data_ptr<int64_t>());
}

char* const* CudaBuffer::datas_table() const {
  return reinterpret_cast<char* const*>(tables_.data_ptr<int64_t>() + world_);
}

int64_t CudaBuffer::token_capacity(OpKind op, int64_t hidden, int32_t topk, int32_t num_experts,
                                   int32_t elem_bytes, int32_t tp) const {
  auto fits = [&](int64_t t) {
    return call_regions(topology(), op, t, int32_t(hidden), topk, num_experts, elem_bytes, 4, tp)
               .total <= capacity_;
  };
  if (!fits(0)) return -1;
  int64_t lo = 0, hi = int64_t(capacity_);  // every region grows with t
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

void CudaBuffer::grow(size_t bytes, cudaStream_t stream) {
  if (bytes > requested_) requested_ = bytes;
  if (bytes <= capacity_) return;
  // The sizes to try (comet/grow_rule.h): the doubling, then the need alone, so a fixed-size
  // heap that holds the need never fails the call for the doubling's sake.
  const GrowSteps steps = grow_steps(bytes, capacity_, size_t(1) << 20);
  const size_t old = capacity_;
  // The old segment goes first, so the heap never holds both (the peak is the new size, not
  // old + new). Every rank is here between calls: in a call after reading its summary (the
  // begin kernel waited until every peer was done with the previous call, and nothing of this
  // call has been written to the data segment yet; the proxy is paused), in reserve() with
  // the buffer's stream synchronised; the free is collective (a barrier), so no rank
  // allocates before every rank let go of its old segment. The allocation is collective too and
  // every rank's heap holds the same allocations, so every rank gets the same answer to each try.
  symm_->free(data_);
  data_ = nullptr;
  capacity_ = 0;
  for (const size_t cap : {steps.first, steps.second}) {
    if (cap == 0) continue;
    data_ = symm_->alloc(cap);
    if (data_ != nullptr) {
      capacity_ = cap;
      generation_ = next_generation(generation_);
      publish_generation(stream);
      refresh_tables(stream);
      return;
    }
  }
  // Neither fits: the old size did a moment ago, so the buffer goes on at it and the call raises.
  const std::string why = symm_->heap_full(steps.second != 0 ? steps.second : steps.first,
                                            "grown data segment");
  data_ = symm_->alloc(old);
  if (data_ == nullptr) {
    mark_dead(why + " (and the old segment of " + std::to_string(old) +
              " bytes could not be allocated again)");
    throw std::runtime_error(dead_);
  }
  capacity_ = old;
  generation_ = next_generation(generation_);  // new memory all the same
  publish_generation(stream);
  refresh_tables(stream);
  throw SegmentRefused(why + "; the buffer keeps its " + std::to_string(old) +
                       " bytes and serves the calls that fit");
}

// The segment's generation and bytes into the device state, stream-ordered before the calls that
// follow (refresh_tables, called after it, synchronises the stream).
void CudaBuffer::publish_generation(cudaStream_t stream) {
  static_assert(offsetof(DeviceState, segment_bytes) ==
                    offsetof(DeviceState, generation) + sizeof(uint64_t),
                "DeviceState: segment_bytes follows generation");
  generation_host_[0] = generation_;
  generation_host_[1] = uint64_t(capacity_);
  cuda_check(cudaMemcpyAsync(&state_->generation, generation_host_, sizeof(generation_host_),
                             cudaMemcpyHostToDevice, stream),
             "copying the segment generation");
  cuda_check(cudaStreamSynchronize(stream), "copying the segment generation");
}

void CudaBuffer::clear_error() { std::memset(error_host_, 0, sizeof(ErrorRecord)); }

CallSummary CudaBuffer::read_summary(const CallMeta* metas_device, cudaStream_t stream) {
  char* host = static_cast<char*>(summary_host_);
  cudaError_t e = cudaMemcpyAsync(host, state_, sizeof(DeviceState), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(host + sizeof(DeviceState), metas_device, world_ * sizeof(CallMeta),
                        cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    std::string why = describe_error(*error_host_);
    if (why.empty()) why = "comet: the call's prologue failed on the GPU";
    why += std::string(" (CUDA: ") + cudaGetErrorString(e) + ")";
    mark_dead(why);
    throw std::runtime_error(why);
  }
  CallSummary s;
  std::memcpy(&s.state, host, sizeof(DeviceState));
  s.metas.resize(size_t(world_));
  std::memcpy(s.metas.data(), host + sizeof(DeviceState), world_ * sizeof(CallMeta));
  return s;
}

void CudaBuffer::mark_broken(const std::string& why) {
  if (broken_.empty()) broken_ = why;
}

void CudaBuffer::mark_dead(const std::string& why) {
  if (dead_.empty()) dead_ = why;
}

void CudaBuffer::recover() {
  if (!dead_.empty()) throw std::runtime_error("comet: this buffer cannot be used again: " + dead_);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  // The failed call's kernels have ended (its waits returned) and so has the proxy kernel: after
  // this, nothing of this rank writes to a peer any more.
  cudaError_t ce = symm_->settle(has_stream_ ? stream_ : nullptr);
  if (ce != cudaSuccess) {
    mark_dead(std::string("the CUDA context failed (") + cudaGetErrorString(ce) +
              "): restart the process");
    throw std::runtime_error("comet: this buffer cannot be used again: " + dead_);
  }
  symm_->quiet();
  // The put ring may hold tickets a failed call abandoned (put_ring.cuh): empty it, so the next
  // call's proxy starts from a consistent head and tail.
  if (ring_mem_ != nullptr)
    cuda_check(cudaMemset(ring_mem_, 0, ring_bytes()), "clearing the put ring");
  const uint64_t target = round_ + 1;
  DeviceState st;
  auto copy = [&](void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
    const cudaError_t e = cudaMemcpy(dst, src, n, kind);
    if (e != cudaSuccess) {
      mark_dead(std::string("the CUDA context failed during the re-arm (") +
                cudaGetErrorString(e) + ")");
      throw std::runtime_error("comet: this buffer cannot be used again: " + dead_);
    }
  };
  copy(&st, state_, sizeof(st), cudaMemcpyDeviceToHost);
  RankHeader* mine = static_cast<RankHeader*>(header_);
  uint64_t* own_line = header_flag(mine, world_, PeerFlag::Rearm, rank_);
  const RearmState me{st.epoch, 0, uint64_t(capacity_)};
  copy(own_line + 1, &me, sizeof(me), cudaMemcpyHostToDevice);
  // The state, then the flag (fence() orders the two puts to each rank).
  for (int32_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    symm_->put(own_line + 1, own_line + 1, sizeof(RearmState), r);
    symm_->fence();
    symm_->put_u64(own_line, target, r);
  }
  symm_->quiet();
  // Every peer's line in this rank's header, polled from the host within the timeout.
  uint64_t epoch = st.epoch;
  const auto start = std::chrono::steady_clock::now();
  for (int32_t s = 0; s < world_; ++s) {
    if (s == rank_) continue;
    const uint64_t* peer_line = header_flag(mine, world_, PeerFlag::Rearm, s);
    auto read = [&](uint64_t* line) {
      copy(line, peer_line, kFlagStride * sizeof(uint64_t), cudaMemcpyDeviceToHost);
    };
    auto expired = [&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
             timeout_s_;
    };
    RearmState peer;  // read after the peer's flag was seen (symm_layout.h: poll_rearm_line)
    if (!poll_rearm_line(read, target, expired, &peer)) {
      std::ostringstream why;
      why << "rank " << s << " did not join the re-arm within " << timeout_s_
          << " s (gone or stuck; every rank must call Buffer.recover())";
      mark_dead(why.str());
      throw std::runtime_error("comet: this buffer cannot be used again: " + dead_);
    }
    if (peer.capacity != capacity_) {
      mark_dead("the ranks hold data segments of different sizes after a failed grow");
      throw std::runtime_error("comet: this buffer cannot be used again: " + dead_);
    }
    epoch = std::max(epoch, peer.epoch);
  }
  // Continue from the group's newest call: no flag written before can satisfy a later wait.
  // The self-resetting counters may have stopped mid-count.
  st.epoch = epoch;
  st.comm_done = 0;
  st.blocks_done = 0;
  st.grid_arrived = 0;
  st.status = int32_t(CallStatus::Ok);
  copy(state_, &st, sizeof(st), cudaMemcpyHostToDevice);
  // Every rank is past its failed call: "done reading your memory" up to `epoch`, in this rank's
  // own header (same-node peers read it there) and in the mailboxes of the other nodes' ranks.
  copy(mine->done_epoch, &epoch, sizeof(epoch), cudaMemcpyHostToDevice);
  uint64_t* done_box = header_flag(mine, world_, PeerFlag::Done, rank_);
  for (int32_t r = 0; r < world_; ++r)
    if (r != rank_ && !topology().same_node(rank_, r))
      symm_->put_u64(done_box, epoch, r);
  symm_->quiet();
  clear_error();
  broken_.clear();
  round_ = target;
}

void CudaBuffer::release() {
  if (header_ == nullptr) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaDeviceSynchronize();
  symm_->free(data_);
  symm_->free(header_);
  data_ = header_ = nullptr;
}

namespace {
HandleRegistry<CudaBuffer> g_buffers(kCudaHandleBase);
}  // namespace

int64_t register_cuda_buffer(std::shared_ptr<CudaBuffer> b) { return g_buffers.add(std::move(b)); }

std::shared_ptr<CudaBuffer> find_cuda_buffer(int64_t handle) {
  std::shared_ptr<CudaBuffer> b = g_buffers.find(handle);
  if (b == nullptr) {
    if (handle < kCudaHandleBase)
      throw std::invalid_argument(
          "comet: buffer " + std::to_string(handle) +
          " is a CPU buffer but the inputs are CUDA tensors; use a CUDA buffer "
          "(comet.buffers.symm_cuda.buffer_for(group, device)) for CUDA inputs");
    throw std::invalid_argument("comet: no live CUDA buffer with handle " +
                                std::to_string(handle) + " (closed, or never created)");
  }
  return b;
}

void release_cuda_buffer(int64_t handle) {
  if (std::shared_ptr<CudaBuffer> b = g_buffers.take(handle)) b->release();
}

int64_t CudaBuffer::heap_bytes(int32_t world, size_t data_bytes) {
  return int64_t(round_up(header_bytes(world), 256) +
                 round_up(data_bytes > kMinData ? data_bytes : kMinData, size_t(1) << 20));
}

}  // namespace comet::gpu
