// The resident-block slots of one device, as the CPU backend models a GPU's SMs: every kernel of
// every stream of a rank takes its blocks' slots from its rank's pool (SymmHeap::slot_pool), so
// kernels in flight at once on a rank (two buffers' calls, a call beside another kernel that
// waits across ranks) compete for them as kernels on one GPU compete for its SMs. How many slots
// the device has is the launching buffer's residency limit (Buffer(resident_blocks=S)); a fused
// kernel takes at most S - sm_margin of them (docs/gpu.md, "SM margin").
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

namespace comet::cpu {

struct SlotPool {
  std::mutex mutex;
  std::condition_variable freed;
  int32_t used = 0;  // slots held by live blocks of any kernel of this device
};

// Where a kernel's blocks take their slots: its device's pool and that device's slot count
// (pool null: no device-wide limit, only the kernel's own).
struct DeviceSlots {
  SlotPool* pool = nullptr;
  int32_t capacity = 0;
};

// The pool of device `key` (created on first use, kept for the process's life): one per process
// for a rank per process, one per simulated rank in a simulated world.
std::shared_ptr<SlotPool> device_slot_pool(int64_t key);

}  // namespace comet::cpu
