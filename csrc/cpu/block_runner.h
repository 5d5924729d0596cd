// Runs one "kernel" on the CPU: every block a team of OS threads (cpu_context.h), all blocks live
// at once (as the persistent GPU kernel and the grid barriers of the prologue programs need every
// block co-resident). The first failure sets an abort flag that makes every other thread's waits
// and barriers throw Aborted; it is rethrown here once all threads have stopped.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu_context.h"

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

// body(Team&, block, thread) runs on blocks x threads OS threads.
template <class Body>
void run_teams(int32_t blocks, int32_t threads, Body&& body) {
  if (blocks < 1 || threads < 1)
    throw std::invalid_argument("run_teams: need at least one block of one thread, got " +
                                std::to_string(blocks) + " x " + std::to_string(threads));
  std::atomic<bool> abort{false};
  std::exception_ptr first;
  std::mutex mutex;
  std::vector<std::unique_ptr<Team>> teams;
  for (int32_t b = 0; b < blocks; ++b) teams.emplace_back(std::make_unique<Team>(threads, abort));
  std::vector<std::thread> pool;
  pool.reserve(size_t(blocks) * size_t(threads));
  for (int32_t b = 0; b < blocks; ++b)
    for (int32_t t = 0; t < threads; ++t)
      pool.emplace_back([&, b, t] {
        try {
          body(*teams[size_t(b)], b, t);
        } catch (const Aborted&) {
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!first) first = std::current_exception();
          abort.store(true);
        }
      });
  for (auto& th : pool) th.join();
  if (first) std::rethrow_exception(first);
}

// A fused kernel: n_comm comm blocks and n_gemm GEMM blocks of `threads` threads each;
// comm(CpuContext&) and gemm(CpuContext&, int32_t gemm_block) run on every thread of their block.
template <class Comm, class Gemm>
void run_blocks(const SymmHeap& heap, int32_t n_comm, int32_t n_gemm, int32_t threads,
                uint64_t stress_seed, Comm&& comm, Gemm&& gemm) {
  run_teams(n_comm + n_gemm, threads, [&](Team& team, int32_t b, int32_t t) {
    if (b < n_comm) {
      CpuContext ctx(&heap, team, b, n_comm, t, stress_seed);
      comm(ctx);
    } else {
      CpuContext ctx(&heap, team, b - n_comm, n_gemm, t, stress_seed ? stress_seed + 17 : 0);
      gemm(ctx, b - n_comm);
    }
  });
}

// A grid of blocks x threads for the multi-block prologue programs (comet/prologue.h); heap may be
// null. work_per_thread, when given, receives each grid thread's ctx.work() count (index
// block * threads + thread).
template <class Body>
void run_grid(const SymmHeap* heap, int32_t blocks, int32_t threads, uint64_t stress_seed,
              Body&& body, std::vector<int64_t>* work_per_thread = nullptr) {
  std::vector<int64_t> work(size_t(blocks) * size_t(threads), 0);
  run_teams(blocks, threads, [&](Team& team, int32_t b, int32_t t) {
    CpuContext ctx(heap, team, b, blocks, t, stress_seed);
    ctx.count_work(&work[size_t(b) * size_t(threads) + size_t(t)]);
    body(ctx);
  });
  if (work_per_thread) *work_per_thread = std::move(work);
}

}  // namespace comet::cpu
