// Plain data of the put ring (csrc/cuda/put_ring.cuh has the protocol and the producer side):
// shared by the host (CudaBuffer allocates a ring, CallParams carries its device view) and the
// kernels, so no device code here.
#pragma once

#include <cstdint>

namespace comet::gpu {

// Which of this rank's symmetric allocations an address lies in.
enum class Seg : uint32_t { None = 0, Header = 1, Data = 2 };

// One slot: exactly 64 bytes, so a slot is one cache line and rings are easy to size.
struct PutRequest {
  unsigned long long seq;  // ticket + 1 once the request is complete (release)
  int32_t rank;            // target group rank (the proxy maps it to its PE)
  uint32_t segs;           // Seg of dst | src << 4 | sig << 8
  uint64_t dst_off, src_off, bytes, sig_off, value;
  uint64_t pad;
};
static_assert(sizeof(PutRequest) == 64, "a request is one 64-byte slot");

// Control words of a ring, each on its own 128-byte line (producers hammer head, the proxy
// writes tail).
struct RingControl {
  unsigned long long head;  // tickets handed out
  unsigned long long pad0[15];
  unsigned long long tail;  // requests consumed by the proxy
  unsigned long long pad1[15];
  uint32_t stop;            // 1: the call's last enqueuing kernel is done; the proxy drains, exits
  uint32_t pad2[31];
};

constexpr uint32_t kPutRingSlots = 4096;  // 256 KiB per buffer; a power of two

// Device view of a buffer's ring and of this rank's symmetric segments (to translate addresses).
struct PutRing {
  PutRequest* slots;     // [kPutRingSlots], null: this buffer has no remote peers
  RingControl* control;
  char* header;          // this rank's header and data segment (the symmetric addresses)
  uint64_t header_bytes;
  char* data;
  uint64_t data_bytes;
};

// ErrorRecord codes of the transport (describe_error in ops_cuda.cpp words them).
constexpr int32_t kErrRingFull = 5;    // a producer waited too long for a ring slot
constexpr int32_t kErrProxyIdle = 6;   // the proxy got neither a request nor its stop in time
constexpr int32_t kErrBadPut = 7;      // a request outside this rank's symmetric segments

}  // namespace comet::gpu
