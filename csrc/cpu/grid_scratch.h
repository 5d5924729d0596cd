// Host-side scratch of one run of a multi-block prologue program (comet/prologue.h) on a CPU grid:
// the grid barrier's state, the counting sort's counters, the scan's block sums and the small
// per-program arrays, sized for the grid and the program's largest key count. Used by the CPU
// backend (fused_cpu.cpp), the engine bindings and the C++ tests, so they all run the programs
// the same way.
#pragma once

#include <algorithm>
#include <vector>

#include "comet/prologue.h"

namespace comet::cpu {

class GridScratch {
 public:
  // blocks x threads grid; counting-sort keys up to max_keys; `items` slots of item keys (pair
  // lists); `small_n` + 1 values of per-expert / per-source scratch.
  GridScratch(int32_t blocks, int32_t threads, int32_t max_keys, int64_t items, int32_t small_n)
      : counts_(size_t(prologue_count_cells(max_keys, int64_t(blocks) * threads))),
        keys_(size_t(std::max<int64_t>(items, 1))),
        block_sum_(size_t(blocks)),
        small_(size_t(small_n) + 1) {}

  PrologueScratch view() {
    return PrologueScratch{GridBarrier{&arrived_, &generation_},
                           SortScratch{counts_.data(), ScanScratch{block_sum_.data(), &total_}},
                           keys_.data(), small_.data()};
  }

 private:
  uint32_t arrived_ = 0;
  uint64_t generation_ = 0;
  int64_t total_ = 0;
  std::vector<int32_t> counts_, keys_;
  std::vector<int64_t> block_sum_, small_;
};

}  // namespace comet::cpu
