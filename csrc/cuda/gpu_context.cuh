// GPU execution contexts for the engine's portable programs (the interface is documented in
// csrc/include/comet/exec_context.h), and the bounded spin-wait they share.
//
//   CommContext      a comm block of a fused kernel: block()/blocks() over the comm blocks, all
//                    threads of the block cooperate; copies are 16-byte vectors through peer
//                    pointers; data(r) of a source rank first acquires that rank's "data
//                    published" flag (once per block and call), so local rows flow before remote
//                    sources have even published theirs. Peers on other nodes (reachable() false)
//                    are only written, by put_signal: a request into the buffer's put ring, which
//                    the proxy kernel (proxy.cu) turns into NVSHMEM put-with-signal.
//   BlockGemmContext a GEMM block whose threads all run the tile (sm_80 path).
//   ProducerContext  the TMA producer warp of an sm_90a GEMM block: its wait acquires a tile's
//                    readiness and then issues the generic->async proxy fence the TMA loads need.
//   ConsumerContext  the two MMA warpgroups of an sm_90a GEMM block: no wait of their own (the
//                    producer waited before loading), sync() is a named barrier over them.
//
// A wait that does not complete within the buffer's timeout records what it waited for in the
// ErrorRecord (mapped host memory), prints it and returns, instead of hanging the GPU. Nothing
// traps, so the CUDA context survives and Buffer.recover() can re-arm the buffer: once a failure
// is recorded (a timeout, a workspace overflow, a transport failure: fails_call) every later
// wait of the call returns at once and nothing more is published to the peers (call_failed in
// error_record.cuh: the prologue's flags, put_signal, layer1's arrival flags), so the call's
// kernels drain quickly and no peer takes this call's data for a call of its own.
#pragma once

#include <cuda_runtime.h>

#include "call_params.h"
#include "comet/exec_context.h"
#include "comet/flags.h"
#include "comet/symm_layout.h"
#include "comet/topology.h"
#include "put_ring.cuh"

// Kernels with wgmma must contain no function call at all (ptxas then serialises every wgmma,
// C7510): their translation units define COMET_DEVICE_PRINTF 0 and rely on the ErrorRecord, which
// the host turns into the same message.
#ifndef COMET_DEVICE_PRINTF
#define COMET_DEVICE_PRINTF 1
#endif

namespace comet::gpu {

static __device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Orders this thread's earlier generic-proxy observations (the acquire of a readiness flag) before
// its later async-proxy (TMA) accesses of global memory.
static __device__ __forceinline__ void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;" ::: "memory");
#endif
}

// Where a timeout is reported, and how long a wait may take.
struct WaitConfig {
  ErrorRecord* error;
  uint64_t timeout_ns;
  int32_t rank;
};

// Out of line and by value: the spin loop stays small and nothing of the caller needs to live in
// local memory.
#if COMET_DEVICE_PRINTF
static __device__ __noinline__ void wait_timed_out(ErrorRecord* e, int32_t rank, uint64_t* flag,
                                                   uint64_t epoch, WaitSite site, int64_t index,
                                                   uint64_t seen, uint64_t waited_ns) {
#else
static __device__ __forceinline__ void wait_timed_out(ErrorRecord* e, int32_t rank, uint64_t* flag,
                                                      uint64_t epoch, WaitSite site, int64_t index,
                                                      uint64_t seen, uint64_t waited_ns) {
#endif
  if (claim_error(e, kErrTimeout)) {
    e->site = int32_t(site);
    e->rank = rank;
    e->block = int32_t(blockIdx.x);
    e->index = index;
    e->epoch = epoch;
    e->seen = seen;
    e->seconds = double(waited_ns) * 1e-9;
    __threadfence_system();
  }
#if COMET_DEVICE_PRINTF
  printf("comet: rank %d block %d gave up after %.1f s waiting for %s (index %lld, call %llu, "
         "flag at %p holds %llu); a peer may have died, stalled or called a different op\n",
         rank, int(blockIdx.x), double(waited_ns) * 1e-9, wait_site_name(site),
         (long long)index, (unsigned long long)epoch, (void*)flag, (unsigned long long)seen);
#else
  (void)flag;
#endif
}

// Single-thread spin until *flag >= epoch (acquire: device scope for this GPU's own flags, system
// scope for peers'), bounded by the timeout.
static __device__ __forceinline__ uint64_t acquire_at(uint64_t* flag, bool local) {
  return local ? local_flag_acquire(flag) : flag_acquire(flag);
}

static __device__ __forceinline__ void spin_until(const WaitConfig& wc, uint64_t* flag, uint64_t epoch,
                                           WaitSite site, int64_t index) {
  const bool local = local_site(site);
  uint64_t v = acquire_at(flag, local);
  if (v >= epoch) return;
  const uint64_t start = globaltimer_ns();
  uint32_t backoff = 32;
  for (uint32_t spin = 1;; ++spin) {
    __nanosleep(backoff);
    if (backoff < 1024) backoff <<= 1;
    v = acquire_at(flag, local);
    if (v >= epoch) return;
    // Another wait of this call gave up: stop too (a read of host memory, so not every round).
    if (spin % 64 == 0 && call_failed(wc.error)) return;
    const uint64_t now = globaltimer_ns();
    if (now - start > wc.timeout_ns) {
      wait_timed_out(wc.error, wc.rank, flag, epoch, site, index, v, now - start);
      return;
    }
  }
}

// Brackets a fused kernel's run in DeviceState (kernel_start / kernel_end, %globaltimer), so the
// comm-only / GEMM-only / fused kernel times can be read without profilers. Every warp's exit
// counts (the roles of a block finish at different times).
struct KernelClock {
  DeviceState* st;
  __device__ explicit KernelClock(DeviceState* s) : st(s) {
    if (threadIdx.x == 0) atomicMin(&st->kernel_start, (unsigned long long)globaltimer_ns());
  }
  __device__ ~KernelClock() {
    if (threadIdx.x % 32 == 0) atomicMax(&st->kernel_end, (unsigned long long)globaltimer_ns());
  }
};

// put_signal of the execution-context interface for kernels with CallParams (the comm programs'
// contexts and the prologue kernels): ONE thread enqueues `bytes` from src (this rank's
// symmetric memory) to rank r's copy of dst, then r's copy of the flag sig := value, after the
// data and after every earlier put_signal of this rank to r. dst / sig are addresses in this
// rank's own header or data segment (NVSHMEM's convention); bytes 0: signal only; sig null: no
// signal. Non-blocking: src must stay unchanged until the call ends (the proxy's quiet).
static __device__ __forceinline__ void put_signal(const CallParams& p, int32_t r, void* dst,
                                                  const void* src, size_t bytes, uint64_t* sig,
                                                  uint64_t value) {
  ring_push(p.ring, p.error, p.rank, p.timeout_ns, r, dst, src, bytes, sig, value);
}

// Context of one comm block (all its threads).
class CommContext {
 public:
  // shared: the block's shared scratch for block_shared() (kBlockSharedBytes, 16-byte aligned;
  // the fused kernels pass their dynamic shared memory, which the comm blocks do not use
  // otherwise), or null for programs that need none.
  __device__ CommContext(const CallParams& p, int32_t block, int32_t blocks, uint64_t epoch,
                         bool wait_source_data, void* shared)
      : headers_(p.headers), datas_(p.datas), wc_{p.error, p.timeout_ns, p.rank}, epoch_(epoch),
        block_(block), blocks_(blocks), rank_(p.rank), lazy_(wait_source_data), shared_(shared),
        topo_(p.topo), ring_(&p.ring) {}

  __device__ int32_t block() const { return block_; }
  __device__ int32_t blocks() const { return blocks_; }
  __device__ int32_t thread() const { return int32_t(threadIdx.x); }
  __device__ int32_t threads() const { return int32_t(blockDim.x); }
  __device__ void sync() { __syncthreads(); }
  __device__ void copy(void* dst, const void* src, size_t bytes) {
    cooperative_copy(dst, src, bytes, int(threadIdx.x), int(blockDim.x));
  }
  __device__ void copy_rows(const RowCopy* rows, int32_t n, size_t bytes, bool vectorisable) {
    comet::copy_rows(rows, n, bytes, vectorisable, int(threadIdx.x), int(blockDim.x));
  }
  // Called uniformly by every thread of the block (the programs do), so the wait inside is
  // block-wide.
  __device__ void acquire(int32_t r) {
    if (lazy_ && r != rank_) acquire_source(r);
  }
  __device__ char* data(int32_t r) const { return datas_[r]; }
  __device__ RankHeader* header(int32_t r) const { return headers_[r]; }
  __device__ void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index) {
    if (threadIdx.x == 0) spin_until(wc_, flag, epoch, site, index);
    __syncthreads();
  }
  __device__ void fence_peers() { __threadfence_system(); }
  __device__ void delay() {}
  __device__ void* block_shared() const { return shared_; }
  // A wait of this call timed out (gpu_context.cuh's header): publish nothing more.
  __device__ bool failed() const { return call_failed(wc_.error); }
  // Whether rank r's header and data are reachable by pointer (r on this rank's node).
  __device__ bool reachable(int32_t r) const { return topo_.same_node(rank_, r); }
  // One thread; see put_signal(CallParams, ...) above.
  __device__ void put_signal(int32_t r, void* dst, const void* src, size_t bytes, uint64_t* sig,
                             uint64_t value) {
    ring_push(*ring_, wc_.error, rank_, wc_.timeout_ns, r, dst, src, bytes, sig, value);
  }

 private:
  // A source on this node: its own data flag; on another node: the MirrorMeta flag its push set
  // on this node's relay (its rows have their own flag, Layer0CommArgs.rows_ready).
  __device__ void acquire_source(int32_t r) {
    if (r < 64 && (ready_ >> r & 1u)) return;
    uint64_t* flag =
        topo_.same_node(rank_, r)
            ? headers_[r]->data_epoch
            : header_flag(headers_[topo_.relay(r, topo_.node(rank_))], topo_.world,
                          PeerFlag::MirrorMeta, r);
    wait(flag, epoch_, WaitSite::PeerData, r);
    if (r < 64) ready_ |= uint64_t(1) << r;
  }

  RankHeader* const* headers_;
  char* const* datas_;
  WaitConfig wc_;
  uint64_t epoch_;
  int32_t block_, blocks_, rank_;
  bool lazy_;
  void* shared_;
  NodeTopology topo_;
  const PutRing* ring_;  // in the kernel's __grid_constant__ parameters
  uint64_t ready_ = 0;
};

// Every thread of a GEMM block runs the same tile (sm_80 path).
class BlockGemmContext {
 public:
  __device__ explicit BlockGemmContext(const WaitConfig& wc) : wc_(wc) {}
  __device__ int32_t thread() const { return int32_t(threadIdx.x); }
  __device__ int32_t threads() const { return int32_t(blockDim.x); }
  __device__ void sync() { __syncthreads(); }
  __device__ void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index) {
    if (threadIdx.x == 0) spin_until(wc_, flag, epoch, site, index);
    __syncthreads();
  }
  __device__ void delay() {}

 private:
  WaitConfig wc_;
};

// The TMA producer warp of an sm_90a GEMM block.
class ProducerContext {
 public:
  __device__ explicit ProducerContext(const WaitConfig& wc) : wc_(wc) {}
  __device__ int32_t thread() const { return int32_t(threadIdx.x % 32); }
  __device__ int32_t threads() const { return 32; }
  __device__ void sync() { __syncwarp(); }
  __device__ void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index) {
    if (threadIdx.x % 32 == 0) spin_until(wc_, flag, epoch, site, index);
    __syncwarp();
    // The rows were written by comm blocks with generic stores; the loads that follow are TMA
    // (async proxy).
    fence_proxy_async_global();
  }
  __device__ void delay() {}

 private:
  WaitConfig wc_;
};

// The MMA warpgroups of an sm_90a GEMM block (threads [first, first + count) of the block).
class ConsumerContext {
 public:
  __device__ ConsumerContext(int32_t first, int32_t count, int32_t barrier_id)
      : first_(first), count_(count), barrier_(barrier_id) {}
  __device__ int32_t thread() const { return int32_t(threadIdx.x) - first_; }
  __device__ int32_t threads() const { return count_; }
  __device__ void sync() { asm volatile("bar.sync %0, %1;" ::"r"(barrier_), "r"(count_) : "memory"); }
  __device__ void wait(uint64_t*, uint64_t, WaitSite, int64_t) {}
  __device__ void delay() {}

 private:
  int32_t first_, count_, barrier_;
};

}  // namespace comet::gpu
