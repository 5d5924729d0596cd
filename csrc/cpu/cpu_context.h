// The CPU execution context: one OS thread per block (thread count 1), so block barriers are
// no-ops and copies are memcpy. Waits go through the heap (timeouts, dead peers, abort on a
// sibling's failure). With stress on, every delay() sleeps a random 0-300 us, which shuffles the
// interleaving of comm and GEMM blocks across runs.
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "comet/exec_context.h"
#include "symm_heap.h"

namespace comet::cpu {

class CpuContext {
 public:
  CpuContext(const SymmHeap& heap, int32_t block, int32_t blocks, const std::atomic<bool>& abort,
             uint64_t stress_seed)
      : heap_(heap), block_(block), blocks_(blocks), abort_(abort), stress_(stress_seed != 0),
        rng_(stress_seed * 1000003u + uint64_t(block) * 7919u + uint64_t(heap.rank())) {}

  int32_t block() const { return block_; }
  int32_t blocks() const { return blocks_; }
  int32_t thread() const { return 0; }
  int32_t threads() const { return 1; }
  void sync() {}
  void copy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  char* data(int32_t rank) const { return heap_.data(rank); }
  RankHeader* header(int32_t rank) const { return heap_.header(rank); }
  void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index) {
    delay();
    heap_.wait(flag, epoch, site, index, &abort_);
  }
  void fence_peers() { std::atomic_thread_fence(std::memory_order_seq_cst); }
  void delay() {
    if (!stress_) return;
    std::uniform_int_distribution<int> us(0, 300);
    std::this_thread::sleep_for(std::chrono::microseconds(us(rng_)));
  }

 private:
  const SymmHeap& heap_;
  int32_t block_, blocks_;
  const std::atomic<bool>& abort_;
  bool stress_;
  std::mt19937_64 rng_;
};

}  // namespace comet::cpu
