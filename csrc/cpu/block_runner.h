// Runs one fused "kernel" on the CPU: n_comm comm blocks and n_gemm GEMM blocks, each an OS thread,
// all live at once (as the persistent GPU kernel needs every block co-resident). The first failure
// sets an abort flag that makes every other block's waits return, then it is rethrown.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu_context.h"

namespace comet::cpu {

// Runs blocks of any roles: block b runs body(ctx, b) on its own thread, all live at once; the first
// failure aborts the others (their waits throw Aborted) and is rethrown here.
template <class Body>
void run_threads(int32_t blocks, Body&& body) {
  std::atomic<bool> abort{false};
  std::exception_ptr first;
  std::mutex mutex;
  std::vector<std::thread> threads;
  threads.reserve(size_t(blocks));
  for (int32_t b = 0; b < blocks; ++b)
    threads.emplace_back([&, b] {
      try {
        body(abort, b);
      } catch (const Aborted&) {
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first) first = std::current_exception();
        abort.store(true);
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// comm(CpuContext&) and gemm(CpuContext&, int32_t gemm_block) are called on their own threads.
template <class Comm, class Gemm>
void run_blocks(const SymmHeap& heap, int32_t n_comm, int32_t n_gemm, uint64_t stress_seed,
                Comm&& comm, Gemm&& gemm) {
  run_threads(n_comm + n_gemm, [&](const std::atomic<bool>& abort, int32_t b) {
    if (b < n_comm) {
      CpuContext ctx(&heap, b, n_comm, abort, stress_seed);
      comm(ctx);
    } else {
      CpuContext ctx(&heap, b - n_comm, n_gemm, abort, stress_seed ? stress_seed + 17 : 0);
      gemm(ctx, b - n_comm);
    }
  });
}

// A grid of `blocks` blocks for the multi-block prologue programs (comet/prologue.h); heap may be
// null. work_per_thread, when given, receives each thread's ctx.work() count. (One thread per
// block in this version, so `threads` must be 1.)
template <class Body>
void run_grid(const SymmHeap* heap, int32_t blocks, int32_t threads, uint64_t stress_seed,
              Body&& body, std::vector<int64_t>* work_per_thread = nullptr) {
  if (threads != 1) throw std::invalid_argument("run_grid: one thread per block in this build");
  std::vector<int64_t> work(size_t(blocks), 0);
  run_threads(blocks, [&](const std::atomic<bool>& abort, int32_t b) {
    CpuContext ctx(heap, b, blocks, abort, stress_seed);
    ctx.count_work(&work[size_t(b)]);
    body(ctx);
  });
  if (work_per_thread) *work_per_thread = std::move(work);
}

}  // namespace comet::cpu
