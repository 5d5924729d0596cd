// The readiness protocol's memory operations: 64-bit flags written with release and read with
// acquire, and a self-resetting arrival counter. One header for both targets: cuda::atomic_ref
// (system scope, so peers writing through NVSHMEM peer pointers and the host observe it) on the
// device, std::atomic_ref on the host (also valid on memory shared between processes, because
// 64-bit atomics are lock-free there).
//
// Flags never get reset: each op call has a sequence number (epoch) and a flag means "ready for
// every epoch <= its value". That is what makes back-to-back calls safe without a reset pass.
#pragma once

#include "comet/config.h"

#if COMET_DEVICE_CODE
#include <cuda/atomic>
#else
#include <atomic>
#endif

namespace comet {

#if COMET_DEVICE_CODE
using flag_ref = cuda::atomic_ref<uint64_t, cuda::thread_scope_system>;
using count_ref = cuda::atomic_ref<uint32_t, cuda::thread_scope_device>;
namespace mo = cuda::std;
#else
using flag_ref = std::atomic_ref<uint64_t>;
using count_ref = std::atomic_ref<uint32_t>;
namespace mo = std;
#endif

// Flags that only this GPU writes and reads (tile readiness, grid barriers): device scope is
// enough, and cheaper than system scope (no ordering with the host or peer GPUs to maintain).
// Morally strong with the system-scope operations on the same flag: both scopes include every
// thread of this GPU.
#if COMET_DEVICE_CODE
using local_flag_ref = cuda::atomic_ref<uint64_t, cuda::thread_scope_device>;
#else
using local_flag_ref = std::atomic_ref<uint64_t>;
#endif

COMET_HD void flag_release(uint64_t* flag, uint64_t value) {
  flag_ref(*flag).store(value, mo::memory_order_release);
}

COMET_HD uint64_t flag_acquire(uint64_t* flag) {
  return flag_ref(*flag).load(mo::memory_order_acquire);
}

COMET_HD void local_flag_release(uint64_t* flag, uint64_t value) {
  local_flag_ref(*flag).store(value, mo::memory_order_release);
}

COMET_HD uint64_t local_flag_acquire(uint64_t* flag) {
  return local_flag_ref(*flag).load(mo::memory_order_acquire);
}

COMET_HD uint64_t flag_relaxed(uint64_t* flag) {
  return flag_ref(*flag).load(mo::memory_order_relaxed);
}

// Arrive on a counter shared by `expected` arrivals (`n` at once: layer0 counts an m-tile's rows
// as they are written, by whichever comm block writes them). The last arriver resets the counter
// (so the next call starts from zero without a host pass) and publishes `epoch` on `flag` with
// release; acq_rel on the counter chains every earlier producer's writes into that release.
COMET_HD bool arrive_and_publish(uint32_t* counter, uint32_t expected, uint64_t* flag,
                                 uint64_t epoch, uint32_t n = 1) {
  uint32_t before = count_ref(*counter).fetch_add(n, mo::memory_order_acq_rel);
  if (before + n != expected) return false;
  count_ref(*counter).store(0u, mo::memory_order_relaxed);
  flag_release(flag, epoch);
  return true;
}

// Adds n to a statistics counter (relaxed: read after the kernel, e.g. layer0's received rows).
COMET_HD void counter_add(uint64_t* counter, uint64_t n) {
  flag_ref(*counter).fetch_add(n, mo::memory_order_relaxed);
}

}  // namespace comet
