// Runs one "kernel" on the CPU: every block a team of OS threads (cpu_context.h). As on a GPU,
// only some blocks may be live at once: with a residency limit S (resident > 0) at most S blocks
// run, started strictly in block-index order as slots free (a block's slot frees once all its
// threads have returned), as a GPU's block scheduler does when fewer blocks fit than the grid has
// (comet/block_roles.h: why no kernel of comet's needs more). Unlimited (0): every block live at
// once. The first failure sets an abort flag that makes every other thread's waits and barriers
// throw Aborted (and starts no further block); it is rethrown here once all threads have stopped.
// A wait that can never be satisfied under S ends in the wait's timeout error, never a hang.
// A kernel launched with its device's slots (slot_pool.h) also waits for a free slot of the
// device before each block starts, and a grid that waits on itself takes all its slots at once
// (a cooperative launch): kernels of several streams of one rank then share the device.
#pragma once

#include <algorithm>
#include <climits>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comet/block_roles.h"
#include "cpu_context.h"
#include "slot_pool.h"

namespace comet::cpu {

// Threads per block when the buffer does not say: $COMET_CPU_BLOCK_THREADS, else 1.
inline int32_t default_block_threads() {
  const char* s = std::getenv("COMET_CPU_BLOCK_THREADS");
  if (!s || !*s) return 1;
  const long v = std::strtol(s, nullptr, 10);
  if (v < 1 || v > 1024)
    throw std::invalid_argument(std::string("COMET_CPU_BLOCK_THREADS must be in [1, 1024], got ") + s);
  return int32_t(v);
}

// Residency limit when the buffer does not say: $COMET_CPU_RESIDENT_BLOCKS, else 0 (unlimited).
inline int32_t default_resident_blocks() {
  const char* s = std::getenv("COMET_CPU_RESIDENT_BLOCKS");
  if (!s || !*s) return 0;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (*end != '\0' || v < 0 || v > (1 << 20))
    throw std::invalid_argument(
        std::string("COMET_CPU_RESIDENT_BLOCKS must be an integer in [0, 1048576] (0: no limit), got ") + s);
  return int32_t(v);
}

// The residency limit of a heap's calls: its own setting (Buffer(resident_blocks=)), else the
// environment's.
inline int32_t resident_blocks(const SymmHeap& heap) {
  return heap.resident_blocks() >= 0 ? heap.resident_blocks() : default_resident_blocks();
}

// Blocks of a grid that are all live at once under residency limit `resident` (0: no limit): the
// size of every grid whose blocks all wait on each other (grid barriers).
inline int32_t co_resident(int32_t blocks, int32_t resident) {
  return resident > 0 ? std::min(blocks, resident) : blocks;
}

// body(Team&, block, thread) runs on blocks x threads OS threads, at most `resident` blocks at a
// time (0: all), each holding a slot of `device`'s pool while it runs when one is given; `gang`:
// every block's slot is taken at once before any block starts (a grid that waits on itself).
template <class Body>
void run_teams(int32_t blocks, int32_t threads, int32_t resident, Body&& body,
               DeviceSlots device = {}, bool gang = false) {
  if (blocks < 1 || threads < 1 || resident < 0)
    throw std::invalid_argument("run_teams: need at least one block of one thread and a residency "
                                ">= 0, got " + std::to_string(blocks) + " x " +
                                std::to_string(threads) + ", resident " + std::to_string(resident));
  const int32_t slots = co_resident(blocks, resident);
  SlotPool own;  // no device pool: this kernel's own bookkeeping only
  SlotPool& pool = device.pool ? *device.pool : own;
  const int32_t capacity = device.pool ? device.capacity : INT32_MAX;
  if (gang && slots > capacity)
    throw std::invalid_argument("run_teams: a grid of " + std::to_string(slots) +
                                " blocks that waits on itself cannot fit a device of " +
                                std::to_string(capacity) + " resident blocks");
  std::atomic<bool> abort{false};
  std::exception_ptr first;
  std::mutex& mutex = pool.mutex;    // guards first, live, pool.used
  std::condition_variable& slot_free = pool.freed;
  int32_t live = 0;                  // blocks started whose threads have not all returned
  std::vector<std::unique_ptr<Team>> teams(static_cast<size_t>(blocks));
  std::vector<std::unique_ptr<std::atomic<int32_t>>> running(static_cast<size_t>(blocks));
  std::vector<std::thread> pool_threads;
  pool_threads.reserve(size_t(blocks) * size_t(threads));
  if (gang) {  // all at once, before any block starts (nothing can abort yet)
    std::unique_lock<std::mutex> lock(mutex);
    slot_free.wait(lock, [&] { return pool.used + slots <= capacity; });
    pool.used += slots;
    live = slots;
  }
  int32_t started = 0;
  for (int32_t b = 0; b < blocks; ++b) {
    {
      std::unique_lock<std::mutex> lock(mutex);
      if (!gang) {
        slot_free.wait(lock, [&] {
          return (live < slots && pool.used < capacity) || abort.load();
        });
      }
      if (abort.load()) break;  // the run failed: the blocks not yet started would only abort
      if (!gang) {
        ++live;
        ++pool.used;
      }
    }
    ++started;
    Team* team = (teams[size_t(b)] = std::make_unique<Team>(threads, abort)).get();
    std::atomic<int32_t>* left =
        (running[size_t(b)] = std::make_unique<std::atomic<int32_t>>(threads)).get();
    for (int32_t t = 0; t < threads; ++t)
      pool_threads.emplace_back([&, team, left, b, t] {
        try {
          body(*team, b, t);
        } catch (const Aborted&) {
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!first) first = std::current_exception();
          abort.store(true);
          slot_free.notify_all();
        }
        if (left->fetch_sub(1, std::memory_order_acq_rel) == 1) {
          std::lock_guard<std::mutex> lock(mutex);
          --live;
          --pool.used;
          slot_free.notify_all();
        }
      });
  }
  if (gang && started < slots) {  // slots taken for blocks that never started
    std::lock_guard<std::mutex> lock(mutex);
    live -= slots - started;
    pool.used -= slots - started;
    slot_free.notify_all();
  }
  for (auto& th : pool_threads) th.join();
  if (first) std::rethrow_exception(first);
}

// A fused kernel of `layer`: n_comm comm blocks and n_gemm GEMM blocks of `threads` threads each,
// laid out by comet/block_roles.h, at most `resident` live at once (0: all);
// comm(CpuContext&) and gemm(CpuContext&, int32_t gemm_block) run on every thread of their block.
template <class Comm, class Gemm>
void run_blocks(const SymmHeap& heap, int32_t layer, int32_t n_comm, int32_t n_gemm,
                int32_t threads, int32_t resident, uint64_t stress_seed, Comm&& comm, Gemm&& gemm,
                DeviceSlots device = {}) {
  run_teams(n_comm + n_gemm, threads, resident, [&](Team& team, int32_t b, int32_t t) {
    const BlockRole role = fused_block_role(layer, b, n_comm + n_gemm, n_comm);
    if (role.comm) {
      CpuContext ctx(&heap, team, role.index, role.count, t, stress_seed);
      comm(ctx);
    } else {
      CpuContext ctx(&heap, team, role.index, role.count, t, stress_seed ? stress_seed + 17 : 0);
      gemm(ctx, role.index);
    }
  }, device);
}

// A grid of blocks x threads whose blocks may all wait on each other (the multi-block prologue
// programs of comet/prologue.h with their grid barriers, layer1's combine step), so every block
// must be live at once: callers size it with co_resident(blocks, resident) for the residency
// limit `resident` it runs under (0: none). heap may be null. work_per_thread, when given,
// receives each grid thread's ctx.work() count (index block * threads + thread).
template <class Body>
void run_grid(const SymmHeap* heap, int32_t blocks, int32_t threads, uint64_t stress_seed,
              Body&& body, std::vector<int64_t>* work_per_thread = nullptr, int32_t resident = 0,
              DeviceSlots device = {}) {
  if (co_resident(blocks, resident) != blocks)
    throw std::invalid_argument("run_grid: the " + std::to_string(blocks) +
                                " blocks of a grid that waits on itself must all be co-resident, "
                                "but only " + std::to_string(resident) + " are (size it with "
                                "co_resident)");
  std::vector<int64_t> work(size_t(blocks) * size_t(threads), 0);
  run_teams(blocks, threads, resident, [&](Team& team, int32_t b, int32_t t) {
    CpuContext ctx(heap, team, b, blocks, t, stress_seed);
    ctx.count_work(&work[size_t(b) * size_t(threads) + size_t(t)]);
    body(ctx);
  }, device, /*gang=*/true);
  if (work_per_thread) *work_per_thread = std::move(work);
}

}  // namespace comet::cpu
