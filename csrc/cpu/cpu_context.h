// The CPU execution context: one OS thread per block (thread count 1), so block barriers are
// no-ops and copies are memcpy. Waits go through the heap (timeouts, dead peers, abort on a
// sibling's failure). With stress on, every delay() sleeps a random 0-300 us, which shuffles the
// interleaving of comm and GEMM blocks across runs.
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include "comet/exec_context.h"
#include "comet/flags.h"
#include "symm_heap.h"

namespace comet::cpu {

class CpuContext {
 public:
  // heap may be null (a grid running prologue programs on local memory): then data()/header()
  // must not be called and waits spin locally.
  CpuContext(const SymmHeap* heap, int32_t block, int32_t blocks, const std::atomic<bool>& abort,
             uint64_t stress_seed)
      : heap_(heap), block_(block), blocks_(blocks), abort_(abort), stress_(stress_seed != 0),
        rng_(stress_seed * 1000003u + uint64_t(block) * 7919u + uint64_t(heap ? heap->rank() : 0)) {}

  int32_t block() const { return block_; }
  int32_t blocks() const { return blocks_; }
  int32_t thread() const { return 0; }
  int32_t threads() const { return 1; }
  void sync() {}
  void copy(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  char* data(int32_t rank) const { return heap_->data(rank); }
  RankHeader* header(int32_t rank) const { return heap_->header(rank); }
  void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index) {
    delay();
    if (heap_) {
      heap_->wait(flag, epoch, site, index, &abort_);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (uint64_t spin = 0; flag_acquire(flag) < epoch; ++spin) {
      if (abort_.load(std::memory_order_relaxed)) throw Aborted{};
      if (spin < 64) continue;
      std::this_thread::yield();
      if (spin % 1024 == 0 && std::chrono::steady_clock::now() - start > std::chrono::seconds(60))
        throw std::runtime_error(std::string("comet: gave up after 60 s waiting for ") +
                                 wait_site_name(site) + " (index " + std::to_string(index) + ")");
    }
  }
  void fence_peers() { std::atomic_thread_fence(std::memory_order_seq_cst); }
  // Span accounting of the prologue programs (parallel.h): elements this thread was assigned.
  void work(int64_t n) {
    if (work_) *work_ += n;
  }
  void count_work(int64_t* counter) { work_ = counter; }
  // The block's shared scratch (the GPU's shared memory): one thread per block, so its own.
  void* block_shared() { return shared_; }
  void delay() {
    if (!stress_) return;
    std::uniform_int_distribution<int> us(0, 300);
    std::this_thread::sleep_for(std::chrono::microseconds(us(rng_)));
  }

 private:
  const SymmHeap* heap_;
  int32_t block_, blocks_;
  const std::atomic<bool>& abort_;
  bool stress_;
  std::mt19937_64 rng_;
  int64_t* work_ = nullptr;
  alignas(64) char shared_[kBlockSharedBytes];
};

}  // namespace comet::cpu
