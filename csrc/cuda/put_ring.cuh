// The device request ring between the kernels that want to put-with-signal to another node
// (producers: GpuContext::put_signal in any kernel of a call) and the proxy kernel that issues the
// NVSHMEM calls (csrc/cuda/proxy.cu, the only -rdc translation unit). Why a ring: NVSHMEM device
// calls need -rdc and a device link, and -rdc in the fused kernels' TUs makes ptxas serialise
// wgmma (docs/toolchain.md); the producers only store a 64-byte request into global memory.
//
// A request names memory by (segment, offset) against this rank's own header / data segment,
// which is how NVSHMEM's symmetric addresses work: the proxy re-forms `base + offset` with the
// bases it was launched with, checks the offsets against the segments' sizes, and NVSHMEM maps
// the address to the target PE's copy. The source must lie in a symmetric segment too: a remote
// transport (IB) can only read registered memory, and the heap is.
//
// Protocol (multi-producer, one consumer, all on this GPU):
//   producer: ticket = atomicAdd(head, 1); wait until ticket - tail < capacity (the slot's old
//             request was consumed; bounded by the buffer's timeout, which reports the ring);
//             fill the slot; store seq = ticket + 1 with release (system scope: the NIC reads the
//             request's source data, written before, once the proxy issues it).
//   proxy:    wait until slots[tail].seq == tail + 1 (acquire), issue, store tail + 1 (release:
//             the slot may be reused).
// The ring's requests are issued in ticket order, which is what makes put_signal FIFO per target
// (the proxy adds the fences NVSHMEM needs for that).
//
// Failures record and return (error_record.cuh), they never trap: a producer whose request names
// memory outside the segments, or that finds its slot still taken after the timeout, records it
// (kErrBadPut / kErrRingFull), drops the put and writes nothing into the ring. The call has then
// failed (fails_call): later producers of the call return at once, the proxy stops at the call's
// end without waiting for the dropped tickets, and CudaBuffer::recover() empties the ring.
#pragma once

#include <cuda/atomic>

#include "call_params.h"
#include "error_record.cuh"
#include "put_ring.h"

namespace comet::gpu {

// Segment and offset of [p, p + bytes) in this rank's symmetric memory; Seg::None if outside.
static __device__ __forceinline__ Seg locate(const PutRing& r, const void* p, uint64_t bytes,
                                             uint64_t* off) {
  const char* c = static_cast<const char*>(p);
  if (c >= r.header && c + bytes <= r.header + r.header_bytes) {
    *off = uint64_t(c - r.header);
    return Seg::Header;
  }
  if (c >= r.data && c + bytes <= r.data + r.data_bytes) {
    *off = uint64_t(c - r.data);
    return Seg::Data;
  }
  *off = 0;
  return Seg::None;
}

// Records a transport failure (the first failure wins). Inline, no printf: producers sit in the
// fused kernels, which must contain no function call (gpu_context.cuh).
static __device__ __forceinline__ void transport_failed(ErrorRecord* e, int32_t code, int32_t rank,
                                                        int32_t target, uint64_t seen,
                                                        uint64_t wanted, uint64_t waited_ns) {
  if (claim_error(e, code)) {
    e->rank = rank;
    e->block = int32_t(blockIdx.x);
    e->index = target;
    e->limit = int64_t(wanted);
    e->seen = seen;
    e->seconds = double(waited_ns) * 1e-9;
    __threadfence_system();
  }
}

static __device__ __forceinline__ uint64_t ring_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Producer side: one thread enqueues one request. dst / src / sig are addresses in this rank's
// own segments (null sig: no signal; bytes 0: signal only).
static __device__ __forceinline__ void ring_push(const PutRing& r, ErrorRecord* err, int32_t me,
                                                 uint64_t timeout_ns, int32_t target, void* dst,
                                                 const void* src, uint64_t bytes, uint64_t* sig,
                                                 uint64_t value) {
  // This call failed (error_record.cuh): its data must not reach a peer.
  if (call_failed(err)) return;
  PutRequest q;
  const Seg ds = bytes ? locate(r, dst, bytes, &q.dst_off) : Seg::None;
  const Seg ss = bytes ? locate(r, src, bytes, &q.src_off) : Seg::None;
  const Seg gs = sig ? locate(r, sig, sizeof(uint64_t), &q.sig_off) : Seg::None;
  if (r.slots == nullptr || (bytes && (ds == Seg::None || ss == Seg::None)) ||
      (sig && gs != Seg::Header)) {
    transport_failed(err, kErrBadPut, me, target, bytes, uint64_t(r.slots != nullptr), 0);
    return;  // no ticket taken
  }
  using ull = unsigned long long;
  const ull t = atomicAdd(&r.control->head, 1ull);
  cuda::atomic_ref<ull, cuda::thread_scope_device> tail(r.control->tail);
  if (t - tail.load(cuda::std::memory_order_acquire) >= kPutRingSlots) {
    const uint64_t start = ring_globaltimer();
    uint32_t backoff = 64;
    while (t - tail.load(cuda::std::memory_order_acquire) >= kPutRingSlots) {
      __nanosleep(backoff);
      if (backoff < 2048) backoff <<= 1;
      // (No early exit when the call failed elsewhere: that check made the combine kernel
      // spill. Such a producer waits out its timeout, bounded; its ticket is abandoned either
      // way, and the proxy stops at the call's end without it.)
      const uint64_t now = ring_globaltimer();
      if (now - start > timeout_ns) {
        transport_failed(err, kErrRingFull, me, target,
                         tail.load(cuda::std::memory_order_relaxed), t, now - start);
        return;
      }
    }
  }
  PutRequest* s = &r.slots[t & (kPutRingSlots - 1)];
  s->rank = target;
  s->segs = uint32_t(ds) | uint32_t(ss) << 4 | uint32_t(gs) << 8;
  s->dst_off = q.dst_off;
  s->src_off = q.src_off;
  s->bytes = bytes;
  s->sig_off = q.sig_off;
  s->value = value;
  cuda::atomic_ref<ull, cuda::thread_scope_system>(s->seq).store(t + 1,
                                                                 cuda::std::memory_order_release);
}

}  // namespace comet::gpu
