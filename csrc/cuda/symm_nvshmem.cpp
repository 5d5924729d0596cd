// comet.buffers.symm's GPU backend on NVSHMEM, host side (nvshmemx_init_attr, nvshmem_malloc, nvshmem_ptr,
// nvshmem_free): NvshmemBackend, CudaBuffer's SymmBackend with a GPU per rank (symm_backend.h;
// symm_sim.cpp is the other one). The kernels load and store same-node peers' memory through the
// peer pointers it gives for the tables; peers on other nodes get null entries and are written only through
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

// A GPU per rank: the symmetric objects on the NVSHMEM heap, peers through nvshmem_ptr, host puts
// with NVSHMEM. Group rank r is PE pes[r]; the allocations are collective over NVSHMEM's whole
// world (every process, whichever group its buffer serves).
class NvshmemBackend final : public SymmBackend {
 public:
  NvshmemBackend(int32_t rank, int32_t world, std::vector<int32_t> pes) : pes_(std::move(pes)) {
    if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
      throw std::runtime_error("comet.buffers.symm (CUDA): NVSHMEM is not initialised (create "
                               "buffers through comet.buffers.symm_cuda, which bootstraps it)");
    std::ostringstream bad;
    if (int32_t(pes_.size()) != world || rank < 0 || rank >= world)
      bad << "the group has " << world << " ranks but " << pes_.size() << " PEs were given";
    else if (pes_[size_t(rank)] != nvshmem_my_pe())
      bad << "this process is PE " << nvshmem_my_pe() << " but group rank " << rank
          << " maps to PE " << pes_[size_t(rank)];
    for (size_t r = 0; bad.tellp() == 0 && r < pes_.size(); ++r)
      if (pes_[r] < 0 || pes_[r] >= nvshmem_n_pes())
        bad << "group rank " << r << " maps to PE " << pes_[r] << ", outside the NVSHMEM world of "
            << nvshmem_n_pes();
    if (bad.tellp() > 0) throw std::runtime_error("comet.buffers.symm (CUDA): " + bad.str());
    subgroup_ = world != nvshmem_n_pes();
  }
  int32_t device_ranks() const override { return 1; }
  bool subgroup() const override { return subgroup_; }
  void* alloc(size_t bytes) override { return nvshmem_malloc(bytes); }
  void free(void* mine) override { nvshmem_free(mine); }
  void* peer(void* mine, int32_t r) override { return nvshmem_ptr(mine, pe(r)); }
  void put(void* mine, const void* src, size_t bytes, int32_t r) override {
    nvshmem_putmem(mine, src, bytes, pe(r));
  }
  void put_u64(uint64_t* mine, uint64_t value, int32_t r) override {
    nvshmem_uint64_p(mine, value, pe(r));
  }
  void fence() override { nvshmem_fence(); }
  void quiet() override { nvshmem_quiet(); }
  // The device: the inter-node proxy kernel runs on the buffer's own stream.
  cudaError_t settle(cudaStream_t) override { return cudaDeviceSynchronize(); }
  std::string heap_full(size_t bytes, const char* what) const override {
    const char* set = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
    std::ostringstream m;
    m << "comet.buffers.symm (CUDA): nvshmem_malloc of " << bytes << " bytes for the " << what
      << " failed: the NVSHMEM symmetric heap (NVSHMEM_SYMMETRIC_SIZE="
      << (set != nullptr ? set : "unset: NVSHMEM's default, 1G") << ") is too small. Set "
      << "NVSHMEM_SYMMETRIC_SIZE to at least the header plus " << bytes
      << " bytes (plus NVSHMEM's own use) before the first comet call, or pass the largest "
         "shape to comet.buffers.symm_cuda.init_nvshmem(reserve=dict(tokens=..., hidden=..., "
         "topk=..., num_experts=...)) so comet sets it (comet.buffers.symm.required_bytes gives "
         "the data bytes)";
    return m.str();
  }

 private:
  int pe(int32_t r) const { return pes_[size_t(r)]; }
  std::vector<int32_t> pes_;
  bool subgroup_ = false;
};

}  // namespace

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
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  auto symm = std::make_shared<NvshmemBackend>(int32_t(rank), int32_t(world), p);
  return register_cuda_buffer(std::make_shared<CudaBuffer>(
      int32_t(rank), int32_t(world), std::move(p), std::move(symm), int(device), group_hash,
      timeout, size_t(capacity)));
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
  return CudaBuffer::heap_bytes(int32_t(world), size_t(std::max<int64_t>(data_bytes, 0)));
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
