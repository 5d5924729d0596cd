// The CPU execution context (interface: comet/exec_context.h). A block is a team of OS threads,
// like a GPU thread block: each thread has its own context (thread() in [0, threads())), the team
// shares a barrier (sync()) and a shared scratch (block_shared()), and cooperative copies split
// the bytes by thread rank exactly as the GPU's cooperative_copy does. So the GPU's cooperative
// semantics (work split by thread rank, thread-0 sections, barriers, races between threads of a
// block) run for real here; with one thread per block everything degenerates to plain memcpy.
//
// Waits are block-wide as on the GPU: thread 0 waits through the heap (timeouts, dead peers,
// abort on a sibling's failure), then the team meets at the barrier. The barrier itself gives up
// (throws Aborted) once any thread of the run failed, so a failure never leaves a team waiting.
// With stress on, every delay() sleeps a random 0-300 us, which shuffles the interleaving of
// blocks and of the threads inside a block across runs.
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

// Spins on `done()`, yielding, then sleeping briefly (teams may outnumber the cores many times
// over); throws Aborted once `abort` is set.
template <class Done>
void spin_until(Done&& done, const std::atomic<bool>& abort) {
  for (uint64_t spin = 0; !done(); ++spin) {
    if (abort.load(std::memory_order_relaxed)) throw Aborted{};
    if (spin < 64) continue;
    if (spin < 1024)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// State shared by the threads of one block.
class Team {
 public:
  Team(int32_t threads, const std::atomic<bool>& abort) : threads_(threads), abort_(abort) {}
  int32_t threads() const { return threads_; }
  const std::atomic<bool>& abort() const { return abort_; }

  // Reusable barrier. A thread reads the generation before arriving (it cannot advance before
  // this thread arrives); the last arriver resets the count, then releases the next generation,
  // so everything written before the barrier by any thread is visible after it to all.
  void arrive_and_wait() {
    if (threads_ == 1) return;
    const uint32_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      return;
    }
    spin_until([&] { return generation_.load(std::memory_order_acquire) != gen; }, abort_);
  }

  void* shared() { return shared_; }

 private:
  const int32_t threads_;
  const std::atomic<bool>& abort_;
  std::atomic<int32_t> arrived_{0};
  std::atomic<uint32_t> generation_{0};
  alignas(64) char shared_[kBlockSharedBytes];
};

class CpuContext {
 public:
  // heap may be null (a grid running prologue programs on local memory): then data()/header()
  // must not be called and waits spin locally.
  CpuContext(const SymmHeap* heap, Team& team, int32_t block, int32_t blocks, int32_t thread,
             uint64_t stress_seed)
      : heap_(heap), team_(team), block_(block), blocks_(blocks), thread_(thread),
        stress_(stress_seed != 0),
        rng_(stress_seed * 1000003u + uint64_t(block) * 7919u + uint64_t(thread) * 104729u +
             uint64_t(heap ? heap->rank() : 0)) {}

  int32_t block() const { return block_; }
  int32_t blocks() const { return blocks_; }
  int32_t thread() const { return thread_; }
  int32_t threads() const { return team_.threads(); }
  void sync() { team_.arrive_and_wait(); }

  // The GPU's splits (copy.h): element i of the bytes / of a batch's vectors to thread i % T.
  void copy(void* dst, const void* src, size_t bytes) {
    cooperative_copy(dst, src, bytes, thread_, threads());
  }
  void copy_rows(const RowCopy* rows, int32_t n, size_t bytes, bool vectorisable) {
    comet::copy_rows(rows, n, bytes, vectorisable, thread_, threads());
  }
  // The host published and waited for every source's data before the kernel.
  void acquire(int32_t) {}

  // Null for ranks on other nodes (comet/topology.h): only put_signal reaches them.
  char* data(int32_t rank) const { return heap_->data(rank); }
  RankHeader* header(int32_t rank) const { return heap_->header(rank); }
  bool reachable(int32_t rank) const { return heap_->reachable(rank); }
  // Through the heap's link proxy (link_proxy.h), as the GPU's NVSHMEM put-with-signal.
  void put_signal(int32_t rank, void* dst, const void* src, size_t bytes, uint64_t* sig,
                  uint64_t value) {
    heap_->proxy()->put_signal(rank, dst, src, bytes, sig, value);
  }

  // Block-wide: thread 0 waits, the others meet it at the barrier.
  void wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index) {
    delay();
    if (thread_ == 0) {
      if (heap_)
        heap_->wait(flag, epoch, site, index, &team_.abort());
      else
        wait_local(flag, epoch, site, index);
    }
    sync();
  }
  void fence_peers() { std::atomic_thread_fence(std::memory_order_seq_cst); }
  bool failed() const { return false; }  // a failed wait throws here (exec_context.h)
  // Span accounting of the prologue programs (parallel.h): elements this thread was assigned.
  void work(int64_t n) {
    if (work_) *work_ += n;
  }
  void count_work(int64_t* counter) { work_ = counter; }
  void* block_shared() { return team_.shared(); }
  void delay() {
    if (!stress_) return;
    std::uniform_int_distribution<int> us(0, 300);
    std::this_thread::sleep_for(std::chrono::microseconds(us(rng_)));
  }

 private:
  void wait_local(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index) {
    const auto start = std::chrono::steady_clock::now();
    spin_until(
        [&] {
          if (flag_acquire(flag) >= epoch) return true;
          if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60))
            throw std::runtime_error(std::string("comet: gave up after 60 s waiting for ") +
                                     wait_site_name(site) + " (index " + std::to_string(index) +
                                     ")");
          return false;
        },
        team_.abort());
  }

  const SymmHeap* heap_;
  Team& team_;
  int32_t block_, blocks_, thread_;
  bool stress_;
  std::mt19937_64 rng_;
  int64_t* work_ = nullptr;
};

}  // namespace comet::cpu
