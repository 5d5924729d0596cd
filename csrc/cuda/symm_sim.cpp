// The simulated world on one GPU: W ranks of a group as threads of one process, every rank's
// CudaBuffer on the same device, with the same kernels and call protocol as W GPUs
// (comet.buffers.symm_cuda.simulated_world). SimBackend is CudaBuffer's SymmBackend here
// (symm_backend.h):
//  - a symmetric object is ONE cudaMalloc of W strides for the group, made by the last rank to
//    reach the collective allocation; rank r's copy starts r strides from its base, so a peer
//    pointer is the same offset in another stride (no NVSHMEM, no peer access to enable);
//  - the collectives (construction, grow, release, the Python side's barriers) are a rendezvous
//    of the W threads (csrc/rendezvous.h) with the group's timeout, which names the ranks that did
//    not arrive;
//  - recover()'s host puts into peers' headers are cudaMemcpy on the legacy default stream, in
//    order (the state before the flag), completed by synchronising that stream. The ranks' calls
//    run on their own streams (torch.cuda.Stream per thread), never the legacy one, which would
//    serialise a rank's copies behind another rank's spinning kernel (CudaBuffer refuses it).
// There are no other nodes (no put ring, no proxy): every rank reaches every other by pointer.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_buffer.h"
#include "handle_registry.h"
#include "rendezvous.h"

namespace comet::gpu {
namespace {

constexpr const char* kWho = "comet.buffers.symm_cuda (simulated world)";

// The W ranks' meeting point and the group's symmetric objects.
class SimGroup {
 public:
  SimGroup(int32_t world, int device, double timeout_s)
      : meeting_(world, timeout_s, kWho), device_(device) {}

  int32_t world() const { return meeting_.world(); }
  int device() const { return device_; }

  // The group's collectives (csrc/rendezvous.h): the last rank to arrive runs `last`.
  void* meet(int32_t rank, const char* what, const std::function<void*()>& last) {
    return meeting_.meet(rank, what, last);
  }

  // The group's collective allocation of `stride` bytes per rank (run by the last to arrive).
  void* allocate(size_t stride) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    void* base = nullptr;
    if (cudaMalloc(&base, stride * size_t(world())) != cudaSuccess) {
      (void)cudaGetLastError();  // an allocation that does not fit is an answer, not an error
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    objects_[static_cast<char*>(base)] = stride;
    return base;
  }

  void release(char* base) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    {
      std::lock_guard<std::mutex> lock(mu_);
      objects_.erase(base);
    }
    (void)cudaFree(base);
  }

  // The object holding `addr` (an address in one rank's stride): its base and stride.
  std::pair<char*, size_t> object_of(const void* addr) {
    std::lock_guard<std::mutex> lock(mu_);
    char* a = static_cast<char*>(const_cast<void*>(addr));
    auto it = objects_.upper_bound(a);
    if (it != objects_.begin()) {
      --it;
      if (a < it->first + it->second * size_t(world())) return {it->first, it->second};
    }
    throw std::runtime_error(std::string(kWho) + ": an address outside the group's symmetric memory");
  }

 private:
  Rendezvous meeting_;
  const int device_;
  std::mutex mu_;                    // objects_
  std::map<char*, size_t> objects_;  // base -> stride (bytes per rank)
};

class SimBackend final : public SymmBackend {
 public:
  SimBackend(std::shared_ptr<SimGroup> group, int32_t rank) : group_(std::move(group)), rank_(rank) {}

  SimGroup& group() const { return *group_; }
  int32_t rank() const { return rank_; }

  int32_t device_ranks() const override { return group_->world(); }
  bool subgroup() const override { return false; }
  void* alloc(size_t bytes) override {
    // Strides of whole 256-byte lines: every rank's copy starts as aligned as cudaMalloc's base.
    const size_t stride = (bytes + 255) / 256 * 256;
    void* base = group_->meet(rank_, "a symmetric allocation",
                              [&]() -> void* { return group_->allocate(stride); });
    return base == nullptr ? nullptr : static_cast<char*>(base) + size_t(rank_) * stride;
  }
  void free(void* mine) override {
    char* base = group_->object_of(mine).first;
    group_->meet(rank_, "a symmetric free", [&]() -> void* {
      group_->release(base);
      return nullptr;
    });
  }
  void* peer(void* mine, int32_t r) override {
    const auto [base, stride] = group_->object_of(mine);
    const size_t offset = size_t(static_cast<char*>(mine) - base) % stride;
    return base + size_t(r) * stride + offset;
  }
  void put(void* mine, const void* src, size_t bytes, int32_t r) override {
    cuda_check(cudaMemcpy(peer(mine, r), src, bytes, cudaMemcpyDefault), "a put into a peer");
  }
  void put_u64(uint64_t* mine, uint64_t value, int32_t r) override {
    cuda_check(cudaMemcpy(peer(mine, r), &value, sizeof(value), cudaMemcpyHostToDevice),
               "a put into a peer");
  }
  void fence() override {}  // the puts share the legacy stream, in order
  void quiet() override {
    cuda_check(cudaStreamSynchronize(cudaStreamLegacy), "completing the puts into peers");
  }
  cudaError_t settle(cudaStream_t own) override {
    return own != nullptr ? cudaStreamSynchronize(own) : cudaSuccess;
  }
  std::string heap_full(size_t bytes, const char* what) const override {
    std::ostringstream m;
    m << kWho << ": cudaMalloc of " << group_->world() << " x " << bytes << " bytes for the "
      << what << " failed: the GPU's memory does not hold it (the simulated world's "
      << group_->world() << " ranks share one GPU)";
    return m.str();
  }

 private:
  std::shared_ptr<SimGroup> group_;
  int32_t rank_;
};

// Groups being built: a handle until all W ranks have created their buffers.
struct GroupBeingBuilt {
  std::shared_ptr<SimGroup> group;
  std::atomic<int32_t> joined{0};
};
HandleRegistry<GroupBeingBuilt> g_groups(1);

int64_t sim_group_create(int64_t world, int64_t device, double timeout) {
  TORCH_CHECK_VALUE(world >= 1 && world <= 1024, kWho, ": world must be in [1, 1024], got ", world);
  TORCH_CHECK_VALUE(timeout > 0, kWho, ": timeout must be > 0 seconds, got ", timeout);
  int count = 0;
  cuda_check(cudaGetDeviceCount(&count), "counting the GPUs");
  TORCH_CHECK_VALUE(device >= 0 && device < count, kWho, ": no CUDA device ", device, " (",
                    count, " visible)");
  auto building = std::make_shared<GroupBeingBuilt>();
  building->group = std::make_shared<SimGroup>(int32_t(world), int(device), timeout);
  return g_groups.add(std::move(building));
}

// Rank `rank`'s buffer of the group (collective: every rank's thread calls it at once).
int64_t buffer_create_sim(int64_t group, int64_t rank, double timeout, int64_t group_hash,
                          int64_t capacity) {
  const std::shared_ptr<GroupBeingBuilt> building = g_groups.find(group);
  TORCH_CHECK_VALUE(building != nullptr, kWho, ": no simulated group ", group,
                    " being created (each rank joins once)");
  const std::shared_ptr<SimGroup> g = building->group;
  TORCH_CHECK_VALUE(rank >= 0 && rank < g->world(), kWho, ": rank ", rank,
                    " outside the group of ", g->world());
  if (++building->joined == g->world()) g_groups.take(group);  // every rank has joined
  std::vector<int32_t> pes(size_t(g->world()));
  for (int32_t r = 0; r < g->world(); ++r) pes[size_t(r)] = r;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g->device()));
  auto symm = std::make_shared<SimBackend>(g, int32_t(rank));
  return register_cuda_buffer(std::make_shared<CudaBuffer>(
      int32_t(rank), g->world(), std::move(pes), std::move(symm), g->device(), group_hash,
      timeout, size_t(capacity)));
}

// A host barrier of the simulated group of buffer `handle` (Buffer._barrier's).
void sim_barrier(int64_t handle) {
  auto b = find_cuda_buffer(handle);
  auto* sim = dynamic_cast<SimBackend*>(&b->symm());
  TORCH_CHECK_VALUE(sim != nullptr, "comet: buffer ", handle, " is not a simulated one");
  sim->group().meet(sim->rank(), "a barrier", nullptr);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(comet_cuda, m) {
  m.def("sim_group_create(int world, int device, float timeout) -> int", &sim_group_create);
  m.def("buffer_create_sim(int group, int rank, float timeout, int group_hash, int capacity) -> int",
        &buffer_create_sim);
  m.def("sim_barrier(int handle) -> ()", &sim_barrier);
}

}  // namespace comet::gpu
