// How a CudaBuffer obtains its symmetric memory and how its group meets on the host: the one part
// of comet.buffers.symm's GPU side that differs between
//  - NVSHMEM (symm_nvshmem.cpp): one rank per process and GPU, the NVSHMEM heap, nvshmem_ptr peer
//    pointers, host puts into peers' memory; and
//  - the simulated world (symm_sim.cpp): W ranks as threads of one process on one GPU, every
//    symmetric object one cudaMalloc for the group (rank r's copy at r strides from its base),
//    the collectives a host rendezvous of the W threads, host puts a cudaMemcpy.
// Everything else (the kernels, the call protocol, flags, counters, error records) is CudaBuffer's
// own code and the same for both.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace comet::gpu {

class SymmBackend {
 public:
  virtual ~SymmBackend() = default;
  // Ranks of the group that share this rank's GPU: 1 with NVSHMEM (a GPU per rank), W in the
  // simulated world. Every kernel of a call that waits on peers uses at most its share of the SMs
  // (CudaBuffer::sm_share), so that the W ranks' grids are co-resident.
  virtual int32_t device_ranks() const = 0;
  // The group is a strict subgroup of the allocation's world (NVSHMEM: of its PEs): allocations
  // need every process of that world, so the buffer only grows in reserve().
  virtual bool subgroup() const = 0;
  // Collective: a symmetric object of `bytes` on every rank; null on every rank alike when it
  // does not fit (then heap_full says why).
  virtual void* alloc(size_t bytes) = 0;
  // Collective: frees a symmetric object (no rank uses any copy of it afterwards).
  virtual void free(void* mine) = 0;
  // Rank r's copy of the symmetric address `mine` (this rank's), or null when rank r's memory is
  // not reachable by pointer (another node).
  virtual void* peer(void* mine, int32_t r) = 0;
  // Host writes into rank r's copy of the symmetric address `mine` (recover()); fence() orders
  // them per destination rank, quiet() completes them.
  virtual void put(void* mine, const void* src, size_t bytes, int32_t r) = 0;
  virtual void put_u64(uint64_t* mine, uint64_t value, int32_t r) = 0;
  virtual void fence() = 0;
  virtual void quiet() = 0;
  // Why an alloc of `bytes` for `what` returned null, and what to do about it.
  virtual std::string heap_full(size_t bytes, const char* what) const = 0;
  // Waits for this rank's device work before recover() re-arms the buffer (`own`: the buffer's
  // bound stream, or null). NVSHMEM: the whole device (the proxy kernel too); the simulated
  // world: the rank's stream only, since the device also runs the other ranks' kernels, which
  // may wait (until their timeouts) on this rank.
  virtual cudaError_t settle(cudaStream_t own) = 0;
};

}  // namespace comet::gpu
