// The inter-node transport's proxy kernel and its end kernel (proxy.h says when they run).
//
// THE ONLY TRANSLATION UNIT THAT CALLS NVSHMEM ON THE DEVICE: compiled with -rdc=true and
// device-linked with libnvshmem_device.a on its own (comet_build.py), so the fused GEMM kernels'
// translation units stay non-rdc (ptxas serialises wgmma under -rdc: docs/toolchain.md). The kernels
// that want a put only store a request into the buffer's ring (put_ring.cuh); this kernel issues
// them, in ring order, one thread:
//   data, no signal   nvshmem_putmem_nbi
//   data + signal     nvshmem_putmem_signal_nbi(.., NVSHMEM_SIGNAL_SET)
//   signal only       nvshmemx_signal_op(.., NVSHMEM_SIGNAL_SET)
// and before any request with a signal, nvshmem_fence when something was issued since the last
// fence: put-with-signal orders the signal after its OWN data only, while put_signal promises it
// after every earlier put of this rank to that rank (FIFO per target). On stop: drain, then
// nvshmem_quiet (all of the call's puts delivered, their sources reusable), then exit.
#include <cstdio>

#pragma nv_diag_suppress 177  // NVSHMEM headers: variables declared but never referenced
#include <nvshmem.h>
#include <nvshmemx.h>

#include "proxy.h"
#include "put_ring.cuh"

namespace comet::gpu {
namespace {

using ull = unsigned long long;

__device__ __forceinline__ ull acquire_ull(ull* p) {
  return cuda::atomic_ref<ull, cuda::thread_scope_system>(*p).load(cuda::std::memory_order_acquire);
}

__device__ __forceinline__ char* segment(const PutRing& r, uint32_t seg) {
  return seg == uint32_t(Seg::Header) ? r.header : seg == uint32_t(Seg::Data) ? r.data : nullptr;
}

__device__ __forceinline__ uint64_t segment_bytes(const PutRing& r, uint32_t seg) {
  return seg == uint32_t(Seg::Header) ? r.header_bytes
                                      : seg == uint32_t(Seg::Data) ? r.data_bytes : 0;
}

// Whether [off, off + bytes) lies in segment `seg` (the producer checked against the bases of its
// launch; this re-checks against the proxy's, in case a bug mixed up two calls' segments).
__device__ __forceinline__ bool inside(const PutRing& r, uint32_t seg, uint64_t off,
                                       uint64_t bytes) {
  const uint64_t n = segment_bytes(r, seg);
  return segment(r, seg) != nullptr && off <= n && bytes <= n - off;
}

// Records a failure of the proxy (the first failure wins) and says so; the call has then failed
// (fails_call), so the proxy issues nothing more and its producers stop.
__device__ void report(const ProxyParams& p, int32_t code, int32_t target, uint64_t seen,
                       uint64_t wanted, uint64_t waited_ns) {
  printf("comet: rank %d: the inter-node proxy %s (target rank %d, ring position %llu of %llu)\n",
         p.rank,
         code == kErrProxyIdle ? "got neither a request nor its stop in time"
                               : "was given a put outside this rank's symmetric memory",
         target, (ull)seen, (ull)wanted);
  transport_failed(p.error, code, p.rank, target, seen, wanted, waited_ns);
}

__global__ void __launch_bounds__(kProxyThreads, 1) proxy_kernel(const __grid_constant__ ProxyParams p) {
  if (threadIdx.x != 0) return;
  const PutRing& r = p.ring;
  RingControl* c = r.control;
  ull tail = c->tail;  // only this thread writes it
  bool unfenced = false;
  // The call failed (error_record.cuh; read from host memory only while idle): issue nothing
  // more, and stop at the call's end even with tickets left (a producer that gave up abandons
  // its ticket; recover() empties the ring).
  bool failed = call_failed(p.error);
  uint64_t idle_since = ring_globaltimer();
  uint32_t backoff = 32;
  for (uint32_t spin = 1;; ++spin) {
    PutRequest* s = &r.slots[tail & (kPutRingSlots - 1)];
    if (!failed && acquire_ull(&s->seq) == tail + 1) {
      const PutRequest q = *s;
      const uint32_t ds = q.segs & 15u, ss = q.segs >> 4 & 15u, gs = q.segs >> 8 & 15u;
      const bool data = q.bytes != 0, sig = gs != uint32_t(Seg::None);
      if (q.rank < 0 || q.rank >= p.world ||
          (data && (!inside(r, ds, q.dst_off, q.bytes) || !inside(r, ss, q.src_off, q.bytes))) ||
          (sig && !inside(r, gs, q.sig_off, sizeof(uint64_t)))) {
        report(p, kErrBadPut, q.rank, tail, c->head, 0);
        failed = true;
        continue;
      }
      const int pe = p.pes[q.rank];
      void* dst = data ? segment(r, ds) + q.dst_off : nullptr;
      const void* src = data ? segment(r, ss) + q.src_off : nullptr;
      uint64_t* flag = sig ? reinterpret_cast<uint64_t*>(segment(r, gs) + q.sig_off) : nullptr;
      if (sig && unfenced) nvshmem_fence();
      if (data && sig)
        nvshmem_putmem_signal_nbi(dst, src, q.bytes, flag, q.value, NVSHMEM_SIGNAL_SET, pe);
      else if (data)
        nvshmem_putmem_nbi(dst, src, q.bytes, pe);
      else if (sig)
        nvshmemx_signal_op(flag, q.value, NVSHMEM_SIGNAL_SET, pe);
      unfenced = true;  // a later signal must follow this request too
      ++tail;
      cuda::atomic_ref<ull, cuda::thread_scope_device>(c->tail).store(
          tail, cuda::std::memory_order_release);
      idle_since = ring_globaltimer();
      backoff = 32;
      continue;
    }
    // Stop: set by the end kernel after every enqueuing kernel of the call finished, so once it
    // is seen, head is final and every ticket below it is (or is about to be) published, unless
    // the call failed.
    if (cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(c->stop).load(
            cuda::std::memory_order_acquire) != 0 &&
        (failed || acquire_ull(&c->head) == tail))
      break;
    __nanosleep(backoff);
    if (backoff < 1024) backoff <<= 1;
    if (!failed && spin % 64 == 0) failed = call_failed(p.error);
    const uint64_t now = ring_globaltimer();
    if (now - idle_since > p.idle_timeout_ns) {
      if (failed) break;  // a second idle timeout after the failure: the stop is not coming
      report(p, kErrProxyIdle, -1, tail, acquire_ull(&c->head), now - idle_since);
      failed = true;
      idle_since = now;
    }
  }
  nvshmem_quiet();
  // The next call's proxy starts after this kernel ended (the main stream joined it before its
  // next end kernel), so resetting here cannot race with a new stop.
  c->stop = 0;
  __threadfence();
}

__global__ void __launch_bounds__(kProxyThreads, 1) end_kernel(const __grid_constant__ ProxyEnd e) {
  if (threadIdx.x != 0) return;
  if (e.send_done) {
    const uint64_t epoch = e.state->epoch;
    const int32_t W = e.topo.world;
    uint64_t* done = header_flag(e.own_header, W, PeerFlag::Done, e.rank);
    // Ordered after every earlier put of this call to that rank (FIFO per target): a peer that
    // sees "done" may reuse what this rank wrote into its memory.
    for (int32_t r = 0; r < W; ++r)
      if (!e.topo.same_node(e.rank, r))
        ring_push(e.ring, e.error, e.rank, e.timeout_ns, r, nullptr, nullptr, 0, done, epoch);
  }
  cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(e.ring.control->stop)
      .store(1u, cuda::std::memory_order_release);
}

}  // namespace

void launch_proxy(const ProxyParams& p, cudaStream_t side) {
  proxy_kernel<<<1, kProxyThreads, 0, side>>>(p);
}

void launch_proxy_end(const ProxyEnd& e, cudaStream_t main) {
  end_kernel<<<1, kProxyThreads, 0, main>>>(e);
}

cudaError_t preload_proxy_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&proxy_kernel));
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&end_kernel));
  return e;
}

}  // namespace comet::gpu
