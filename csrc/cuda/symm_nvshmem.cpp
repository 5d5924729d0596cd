// comet.buffers.symm's GPU backend on NVSHMEM, host side (nvshmemx_init_attr, nvshmem_malloc, nvshmem_ptr,
// nvshmem_free): the kernels load and store same-node peers' memory through the peer pointers this
// file puts in the tables; peers on other nodes get null entries and are written only through
// the buffer's put ring, which the proxy kernel (proxy.cu, the only device code calling NVSHMEM)
// drains. Initialisation goes through nvshmemx_init_attr, whose part in libnvshmem_device.a
// also sets up the device state of this module's NVSHMEM device code (the proxy's).
//
// Bootstrap: once per process from a unique id that rank 0 creates and comet/buffers/symm_cuda.py
// broadcasts over torch.distributed; the NVSHMEM world is the default group (PE = global rank).
// A buffer's group may be any subgroup: group rank r lives on PE pes[r], peer pointers come from
// nvshmem_ptr(.., pes[r]), and since nvshmem_malloc / nvshmem_free are collective over the whole
// NVSHMEM world, buffers are created, grown (reserve) and released by every process of the world
// together (each for its own group, e.g. every expert-parallel group at once).
//
// Also here: torch.ops.comet_cuda.*, the management ops comet/buffers/symm_cuda.py drives (create, grow,
// release, settings, error checks). They take and return plain values.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-variable"  // NVSHMEM's device-state declaration
#include <nvshmem.h>
#include <nvshmemx.h>
#pragma GCC diagnostic pop
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "comet/capture_rule.h"
#include "comet/grow_rule.h"
#include "comet/stream_rule.h"
#include "comet/symm_layout.h"
#include "cuda_buffer.h"

namespace comet::gpu {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("comet.buffers.symm (CUDA): ") + what + ": " +
                             cudaGetErrorString(e));
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

constexpr size_t kMinData = size_t(1) << 20;  // room for the bucket offsets of ~250k experts

// Why an nvshmem_malloc of `bytes` for `what` failed, and what to do about it.
std::string heap_full_message(size_t bytes, const char* what) {
  const char* set = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  std::ostringstream m;
  m << "comet.buffers.symm (CUDA): nvshmem_malloc of " << bytes << " bytes for the " << what
    << " failed: the NVSHMEM symmetric heap (NVSHMEM_SYMMETRIC_SIZE="
    << (set != nullptr ? set : "unset: NVSHMEM's default, 1G") << ") is too small. Set "
    << "NVSHMEM_SYMMETRIC_SIZE to at least the header plus " << bytes
    << " bytes (plus NVSHMEM's own use) before the first comet call, or pass the largest "
       "shape to comet.buffers.symm_cuda.init_nvshmem(reserve=dict(tokens=..., hidden=..., topk=..., "
       "num_experts=...)) so comet sets it (comet.buffers.symm.required_bytes gives the data bytes)";
  return m.str();
}

void* symmetric_alloc(size_t bytes, const char* what) {
  void* p = nvshmem_malloc(bytes);
  if (p == nullptr) throw std::runtime_error(heap_full_message(bytes, what));
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

CudaBuffer::CudaBuffer(int32_t rank, int32_t world, std::vector<int32_t> pes, int device,
                       int64_t group_hash, double timeout_s, size_t capacity_bytes)
    : rank_(rank), world_(world), pes_(std::move(pes)), device_(device), group_hash_(group_hash),
      timeout_s_(timeout_s), ranks_per_node_(world) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    throw std::runtime_error("comet.buffers.symm (CUDA): NVSHMEM is not initialised (create buffers "
                             "through comet.buffers.symm_cuda, which bootstraps it)");
  std::ostringstream bad;
  if (int32_t(pes_.size()) != world || rank < 0 || rank >= world)
    bad << "the group has " << world << " ranks but " << pes_.size() << " PEs were given";
  else if (pes_[size_t(rank)] != nvshmem_my_pe())
    bad << "this process is PE " << nvshmem_my_pe() << " but group rank " << rank << " maps to PE "
        << pes_[size_t(rank)];
  for (size_t r = 0; bad.tellp() == 0 && r < pes_.size(); ++r)
    if (pes_[r] < 0 || pes_[r] >= nvshmem_n_pes())
      bad << "group rank " << r << " maps to PE " << pes_[r] << ", outside the NVSHMEM world of "
          << nvshmem_n_pes();
  if (bad.tellp() > 0)
    throw std::runtime_error("comet.buffers.symm (CUDA): " + bad.str());
  subgroup_ = world != nvshmem_n_pes();
  // Before the collective allocations: a failure here is the same on every rank (same binary,
  // same GPU model), so every rank raises instead of some waiting in nvshmem_malloc.
  preload_kernels(device);
  cuda_check(cudaEventCreateWithFlags(&handover_, cudaEventDisableTiming), "cudaEventCreate");
  header_bytes_ = round_up(header_bytes(world), 256);
  header_ = symmetric_alloc(header_bytes_, "buffer header");
  capacity_ = round_up(capacity_bytes > kMinData ? capacity_bytes : kMinData, size_t(1) << 20);
  data_ = symmetric_alloc(capacity_, "data segment");
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
  // The NVSHMEM memory is only freed by release() (collective); the local resources always.
  if (error_host_ != nullptr) cudaFreeHost(error_host_);
  if (summary_host_ != nullptr) cudaFreeHost(summary_host_);
  if (state_ != nullptr) cudaFree(state_);
  if (ring_mem_ != nullptr) cudaFree(ring_mem_);
  if (pes_dev_ != nullptr) cudaFree(pes_dev_);
  if (proxy_stream_ != nullptr) cudaStreamDestroy(proxy_stream_);
  if (handover_ != nullptr) cudaEventDestroy(handover_);
}

void CudaBuffer::claim_stream(cudaStream_t s) {
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
    void* h = nvshmem_ptr(header_, pes_[size_t(r)]);
    void* d = nvshmem_ptr(data_, pes_[size_t(r)]);
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
  // NVSHMEM heap that holds the need never fails the call for the doubling's sake.
  const GrowSteps steps = grow_steps(bytes, capacity_, size_t(1) << 20);
  const size_t old = capacity_;
  // The old segment goes first, so the heap never holds both (the peak is the new size, not
  // old + new). Every rank is here between calls: in a call after reading its summary (the
  // begin kernel waited until every peer was done with the previous call, and nothing of this
  // call has been written to the data segment yet; the proxy is paused), in reserve() with
  // the buffer's stream synchronised; nvshmem_free is collective (a barrier), so no rank
  // allocates before every rank let go of its old segment. nvshmem_malloc is collective too and
  // every rank's heap holds the same allocations, so every rank gets the same answer to each try.
  nvshmem_free(data_);
  data_ = nullptr;
  capacity_ = 0;
  for (const size_t cap : {steps.first, steps.second}) {
    if (cap == 0) continue;
    data_ = nvshmem_malloc(cap);
    if (data_ != nullptr) {
      capacity_ = cap;
      generation_ = next_generation(generation_);
      publish_generation(stream);
      refresh_tables(stream);
      return;
    }
  }
  // Neither fits: the old size did a moment ago, so the buffer goes on at it and the call raises.
  const std::string why = heap_full_message(steps.second != 0 ? steps.second : steps.first,
                                            "grown data segment");
  data_ = nvshmem_malloc(old);
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
  cudaError_t ce = cudaDeviceSynchronize();
  if (ce != cudaSuccess) {
    mark_dead(std::string("the CUDA context failed (") + cudaGetErrorString(ce) +
              "): restart the process");
    throw std::runtime_error("comet: this buffer cannot be used again: " + dead_);
  }
  nvshmem_quiet();
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
  // The state, then the flag (nvshmem_fence orders the two puts to each PE).
  for (int32_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    nvshmem_putmem(own_line + 1, own_line + 1, sizeof(RearmState), pes_[size_t(r)]);
    nvshmem_fence();
    nvshmem_uint64_p(own_line, target, pes_[size_t(r)]);
  }
  nvshmem_quiet();
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
      nvshmem_uint64_p(done_box, epoch, pes_[size_t(r)]);
  nvshmem_quiet();
  clear_error();
  broken_.clear();
  round_ = target;
}

void CudaBuffer::release() {
  if (header_ == nullptr) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  cudaDeviceSynchronize();
  nvshmem_free(data_);
  nvshmem_free(header_);
  data_ = header_ = nullptr;
}

namespace {
std::mutex g_mutex;
std::map<int64_t, std::shared_ptr<CudaBuffer>> g_buffers;
int64_t g_next = kCudaHandleBase;
}  // namespace

int64_t register_cuda_buffer(std::shared_ptr<CudaBuffer> b) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_buffers[g_next] = std::move(b);
  return g_next++;
}

std::shared_ptr<CudaBuffer> find_cuda_buffer(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_buffers.find(handle);
  if (it == g_buffers.end()) {
    if (handle < kCudaHandleBase)
      throw std::invalid_argument(
          "comet: buffer " + std::to_string(handle) +
          " is a CPU buffer but the inputs are CUDA tensors; use a CUDA buffer "
          "(comet.buffers.symm_cuda.buffer_for(group, device)) for CUDA inputs");
    throw std::invalid_argument("comet: no live CUDA buffer with handle " +
                                std::to_string(handle) + " (closed, or never created)");
  }
  return it->second;
}

void release_cuda_buffer(int64_t handle) {
  std::shared_ptr<CudaBuffer> b;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_buffers.find(handle);
    if (it == g_buffers.end()) return;
    b = it->second;
    g_buffers.erase(it);
  }
  b->release();
}

namespace {

// ---- torch.ops.comet_cuda.* ------------------------------------------------------------------

at::Tensor nvshmem_unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0)
    throw std::runtime_error("comet.buffers.symm (CUDA): nvshmemx_get_uniqueid failed");
  at::Tensor t = at::empty({int64_t(sizeof(id))}, at::kByte);
  std::memcpy(t.data_ptr(), &id, sizeof(id));
  return t;
}

// NVSHMEM's initialisation through libnvshmem_device.a's nvshmemi_init_thread (what
// nvshmemx_init_attr calls, minus its exit() on failure): besides the host library it sets up the
// device state of this module, which the proxy kernel's NVSHMEM device calls read. The host-only
// nvshmemx_hostlib_init_attr would leave that state empty.
int init_with_device_state(unsigned flags, nvshmemx_init_attr_t* attr) {
  int provided = 0;
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  return nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, flags, attr, version);
}

// Returns false when NVSHMEM was already initialised (by an earlier call, torch's symmetric
// memory or nvshmem4py) with the same rank and world; this module's device state is set up then
// too (a repeated init only counts a reference and initialises the calling module's device code).
bool nvshmem_bootstrap(const at::Tensor& uid, int64_t rank, int64_t world, int64_t device) {
  static bool device_state_ready = false;
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    TORCH_CHECK(nvshmem_my_pe() == rank && nvshmem_n_pes() == world,
                "comet.buffers.symm (CUDA): NVSHMEM is already initialised as PE ", nvshmem_my_pe(),
                " of ", nvshmem_n_pes(), ", not as rank ", rank, " of ", world);
    if (!device_state_ready) {
      TORCH_CHECK(init_with_device_state(0, nullptr) == 0,
                  "comet.buffers.symm (CUDA): setting up NVSHMEM's device state for comet's proxy kernel "
                  "failed (NVSHMEM was initialised by another library)");
      device_state_ready = true;
    }
    return false;
  }
  TORCH_CHECK(uid.device().is_cpu() && uid.scalar_type() == at::kByte &&
                  uid.numel() == int64_t(sizeof(nvshmemx_uniqueid_t)),
              "comet.buffers.symm (CUDA): bad NVSHMEM unique id");
  cuda_check(cudaSetDevice(int(device)), "cudaSetDevice");
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.contiguous().data_ptr(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  TORCH_CHECK(nvshmemx_set_attr_uniqueid_args(int(rank), int(world), &id, &attr) == 0,
              "comet.buffers.symm (CUDA): nvshmemx_set_attr_uniqueid_args failed");
  TORCH_CHECK(init_with_device_state(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) == 0,
              "comet.buffers.symm (CUDA): NVSHMEM initialisation failed (rank ", rank, " of ", world, ")");
  device_state_ready = true;
  return true;
}

int64_t buffer_create(int64_t rank, int64_t world, at::IntArrayRef pes, int64_t device,
                      double timeout, int64_t group_hash, int64_t capacity) {
  std::vector<int32_t> p(pes.begin(), pes.end());
  return register_cuda_buffer(std::make_shared<CudaBuffer>(
      int32_t(rank), int32_t(world), std::move(p), int(device), group_hash, timeout,
      size_t(capacity)));
}
bool buffer_is_subgroup(int64_t h) { return find_cuda_buffer(h)->subgroup(); }

std::string buffer_unreachable(int64_t h) { return find_cuda_buffer(h)->unreachable(); }
// This rank's row of the reachability matrix (1: by pointer), and the nodes comet/buffers/symm_cuda.py
// infers from every rank's row (comet/buffers/node_shape.py).
std::vector<int64_t> buffer_reach(int64_t h) {
  const auto& r = find_cuda_buffer(h)->reach();
  return std::vector<int64_t>(r.begin(), r.end());
}
void buffer_set_ranks_per_node(int64_t h, int64_t n) {
  auto b = find_cuda_buffer(h);
  b->set_ranks_per_node(int32_t(n));
}
int64_t buffer_ranks_per_node(int64_t h) { return find_cuda_buffer(h)->ranks_per_node(); }
void buffer_set_node_reduce(int64_t h, bool on) { find_cuda_buffer(h)->set_node_reduce(on); }
void buffer_release(int64_t h) { release_cuda_buffer(h); }
void buffer_set_call_tag(int64_t h, int64_t t) { find_cuda_buffer(h)->set_call_tag(int32_t(t)); }
void buffer_set_max_rows(int64_t h, int64_t r) { find_cuda_buffer(h)->set_max_rows(r); }
void buffer_set_sm_margin(int64_t h, int64_t n) {
  TORCH_CHECK_VALUE(n >= 0 && n <= INT32_MAX, "comet: sm_margin must be >= 0, got ", n);
  find_cuda_buffer(h)->set_sm_margin(int32_t(n));
}
int64_t buffer_sm_margin(int64_t h) { return find_cuda_buffer(h)->sm_margin(); }
int64_t buffer_max_rows(int64_t h) { return find_cuda_buffer(h)->max_rows(); }
void buffer_set_bench_mode(int64_t h, int64_t m) {
  TORCH_CHECK_VALUE(m >= 0 && m <= 2, "bench mode must be 0 (fused), 1 (comm only) or 2 (GEMM only)");
  find_cuda_buffer(h)->set_bench_mode(int32_t(m));
}
void buffer_set_timeout(int64_t h, double s) { find_cuda_buffer(h)->set_timeout(s); }
int64_t buffer_capacity(int64_t h) { return int64_t(find_cuda_buffer(h)->capacity()); }

// Collective: grows every rank's data segment to at least `bytes`.
void buffer_reserve(int64_t h, int64_t bytes) {
  auto b = find_cuda_buffer(h);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(b->device()));
  auto stream = at::cuda::getCurrentCUDAStream();
  cuda_check(cudaStreamSynchronize(stream), "reserve");
  // The buffer's calls may be queued on another stream: they must be done with the old segment.
  if (b->has_stream()) cuda_check(cudaStreamSynchronize(b->stream()), "reserve");
  b->grow(size_t(bytes), stream);
}

// The buffer's device state after its queued calls (waits for the buffer's stream, else the
// current one); `what` names the read in an error.
DeviceState settled_state(int64_t h, const char* what) {
  auto b = find_cuda_buffer(h);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(b->device()));
  cudaStream_t stream = b->has_stream() ? b->stream() : at::cuda::getCurrentCUDAStream().stream();
  DeviceState st{};
  cuda_check(cudaMemcpyAsync(&st, b->state(), sizeof(st), cudaMemcpyDeviceToHost, stream), what);
  cuda_check(cudaStreamSynchronize(stream), what);
  return st;
}

// Duration of the last fused kernel on this buffer (seconds).
double buffer_kernel_time(int64_t h) {
  const DeviceState st = settled_state(h, "reading the kernel clock");
  if (st.kernel_end < st.kernel_start || st.kernel_start == ~0ull) return 0.0;
  return double(st.kernel_end - st.kernel_start) * 1e-9;
}

int64_t buffer_requested(int64_t h) { return int64_t(find_cuda_buffer(h)->requested()); }
// Buffer.traffic: (layer0 rows, bytes, layer1 rows, bytes) the comm blocks counted in the last
// call of each op.
std::vector<int64_t> buffer_traffic(int64_t h) {
  const DeviceState st = settled_state(h, "reading the traffic counts");
  const int64_t r0 = int64_t(st.layer0_rows_received), r1 = int64_t(st.layer1_rows_sent);
  const int64_t* row_bytes = find_cuda_buffer(h)->traffic_row_bytes;
  return {r0, r0 * row_bytes[0], r1, r1 * row_bytes[1]};
}
// The buffer's bound stream (-1: none yet) and its proxy stream (0 on one node), as integers.
int64_t buffer_stream(int64_t h) {
  auto b = find_cuda_buffer(h);
  return b->has_stream() ? int64_t(reinterpret_cast<intptr_t>(b->stream())) : -1;
}
int64_t buffer_proxy_stream(int64_t h) {
  return int64_t(reinterpret_cast<intptr_t>(find_cuda_buffer(h)->proxy_stream()));
}
// Symmetric heap bytes one buffer takes with a data segment of `data_bytes` (header and data,
// rounded as the buffer rounds them).
int64_t buffer_heap_bytes(int64_t world, int64_t data_bytes) {
  const size_t d = size_t(std::max<int64_t>(data_bytes, 0));
  return int64_t(round_up(header_bytes(int32_t(world)), 256) +
                 round_up(d > kMinData ? d : kMinData, size_t(1) << 20));
}

}  // namespace

namespace {

// Synchronises the current stream and the buffer's, and reports what the device recorded (empty:
// nothing).
std::string buffer_check(int64_t h) {
  auto b = find_cuda_buffer(h);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(b->device()));
  cudaError_t e = cudaStreamSynchronize(at::cuda::getCurrentCUDAStream());
  // The buffer's calls may have been queued on another stream (comet/stream_rule.h).
  if (e == cudaSuccess && b->has_stream()) e = cudaStreamSynchronize(b->stream());
  std::string msg = describe_error(b->error_host());
  if (e != cudaSuccess) {
    msg = (msg.empty() ? std::string() : msg + "; ") + "CUDA error: " + cudaGetErrorString(e);
    b->mark_dead(msg);
  } else if (!msg.empty() && !fails_call(b->error_host().code)) {
    b->clear_error();  // reported once; a failure (a timeout, ...) stays until recover()
  }
  return msg;
}

void buffer_recover(int64_t h) { find_cuda_buffer(h)->recover(); }
bool buffer_needs_rearm(int64_t h) { return find_cuda_buffer(h)->needs_rearm(); }
int64_t buffer_rearm_round(int64_t h) { return int64_t(find_cuda_buffer(h)->rearm_round()); }

}  // namespace

TORCH_LIBRARY(comet_cuda, m) {
  m.def("nvshmem_unique_id() -> Tensor", &nvshmem_unique_id);
  m.def("nvshmem_bootstrap(Tensor uid, int rank, int world, int device) -> bool",
        &nvshmem_bootstrap);
  m.def("buffer_create(int rank, int world, int[] pes, int device, float timeout, "
        "int group_hash, int capacity) -> int",
        &buffer_create);
  m.def("buffer_is_subgroup(int handle) -> bool", &buffer_is_subgroup);
  m.def("buffer_unreachable(int handle) -> str", &buffer_unreachable);
  m.def("buffer_reach(int handle) -> int[]", &buffer_reach);
  m.def("buffer_set_ranks_per_node(int handle, int ranks_per_node) -> ()",
        &buffer_set_ranks_per_node);
  m.def("buffer_ranks_per_node(int handle) -> int", &buffer_ranks_per_node);
  m.def("buffer_set_node_reduce(int handle, bool on) -> ()", &buffer_set_node_reduce);
  m.def("buffer_release(int handle) -> ()", &buffer_release);
  m.def("buffer_set_call_tag(int handle, int tag) -> ()", &buffer_set_call_tag);
  m.def("buffer_set_sm_margin(int handle, int margin) -> ()", &buffer_set_sm_margin);
  m.def("buffer_sm_margin(int handle) -> int", &buffer_sm_margin);
  m.def("buffer_set_max_rows(int handle, int max_rows) -> ()", &buffer_set_max_rows);
  m.def("buffer_max_rows(int handle) -> int", &buffer_max_rows);
  m.def("buffer_set_bench_mode(int handle, int mode) -> ()", &buffer_set_bench_mode);
  m.def("buffer_set_timeout(int handle, float seconds) -> ()", &buffer_set_timeout);
  m.def("buffer_capacity(int handle) -> int", &buffer_capacity);
  m.def("buffer_reserve(int handle, int bytes) -> ()", &buffer_reserve);
  m.def("buffer_check(int handle) -> str", &buffer_check);
  m.def("buffer_recover(int handle) -> ()", &buffer_recover);
  m.def("buffer_needs_rearm(int handle) -> bool", &buffer_needs_rearm);
  m.def("buffer_rearm_round(int handle) -> int", &buffer_rearm_round);
  m.def("buffer_kernel_time(int handle) -> float", &buffer_kernel_time);
  m.def("buffer_requested(int handle) -> int", &buffer_requested);
  m.def("buffer_traffic(int handle) -> int[]", &buffer_traffic);
  m.def("buffer_stream(int handle) -> int", &buffer_stream);
  m.def("buffer_proxy_stream(int handle) -> int", &buffer_proxy_stream);
  m.def("buffer_heap_bytes(int world, int data_bytes) -> int", &buffer_heap_bytes);
}

}  // namespace comet::gpu
