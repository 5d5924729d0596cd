// A stand-in for a collective kernel (NCCL's) on the CPU backend's device model, for tests of
// the SM margin: a kernel of `blocks` blocks on the rank's device (its pool of resident-block
// slots, slot_pool.h), in which block b of every rank of the world waits for block b of every
// other rank, as a collective's channel blocks pair up across ranks. The ranks rendezvous through
// this process's memory, so the world is a simulated one (ranks as threads of one process).
// It takes no margin itself: a collective library does not know comet's.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "block_runner.h"

namespace comet::cpu {

// Block b of this rank arrives for rendezvous `tag` and waits for the world's; throws after
// timeout_s naming the block.
inline void collective_block(int64_t tag, int32_t block, int32_t world, double timeout_s) {
  static std::mutex mutex;
  static std::condition_variable arrived;
  static std::map<std::pair<int64_t, int32_t>, int32_t> count;
  std::unique_lock<std::mutex> lock(mutex);
  const auto key = std::make_pair(tag, block);
  ++count[key];
  arrived.notify_all();
  if (!arrived.wait_for(lock, std::chrono::duration<double>(timeout_s),
                        [&] { return count[key] >= world; }))
    throw std::runtime_error("device collective " + std::to_string(tag) + ": block " +
                             std::to_string(block) + " gave up after " +
                             std::to_string(timeout_s) + " s waiting for its peers' block " +
                             std::to_string(block));
}

// The collective on `heap`'s device, with the heap's residency limit as the device's slots.
inline void device_collective(const SymmHeap& heap, int32_t blocks, int64_t tag,
                              double timeout_s) {
  const int32_t S = resident_blocks(heap);
  const DeviceSlots device = S > 0 ? DeviceSlots{heap.slot_pool(), S} : DeviceSlots{};
  run_teams(blocks, 1, S, [&](Team&, int32_t b, int32_t) {
    collective_block(tag, b, heap.world(), timeout_s);
  }, device);
}

}  // namespace comet::cpu
