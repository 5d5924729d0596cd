// Runs one fused "kernel" on the CPU: n_comm comm blocks and n_gemm GEMM blocks, each an OS thread,
// all live at once (as the persistent GPU kernel needs every block co-resident). The first failure
// sets an abort flag that makes every other block's waits return, then it is rethrown.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_context.h"

namespace comet::cpu {

// comm(CpuContext&) and gemm(CpuContext&, int32_t gemm_block) are called on their own threads.
template <class Comm, class Gemm>
void run_blocks(const SymmHeap& heap, int32_t n_comm, int32_t n_gemm, uint64_t stress_seed,
                Comm&& comm, Gemm&& gemm) {
  std::atomic<bool> abort{false};
  std::exception_ptr first;
  std::mutex mutex;
  auto guarded = [&](auto&& body) {
    try {
      body();
    } catch (const Aborted&) {
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!first) first = std::current_exception();
      abort.store(true);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(size_t(n_comm + n_gemm));
  for (int32_t b = 0; b < n_comm; ++b)
    threads.emplace_back([&, b] {
      guarded([&] {
        CpuContext ctx(heap, b, n_comm, abort, stress_seed);
        comm(ctx);
      });
    });
  for (int32_t g = 0; g < n_gemm; ++g)
    threads.emplace_back([&, g] {
      guarded([&] {
        CpuContext ctx(heap, g, n_gemm, abort, stress_seed ? stress_seed + 17 : 0);
        gemm(ctx, g);
      });
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace comet::cpu
