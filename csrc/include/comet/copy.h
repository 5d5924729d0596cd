// Cooperative copies by the threads of a block, shared by both execution contexts: which thread
// moves which bytes, and how many independent loads each thread keeps in flight. Only the 16-byte
// vector type is the target's: uint4 on the GPU (LDG.E.128 / STG.E.128), a 16-byte struct on the
// CPU. Plain (weak) loads and stores: callers acquire the data's readiness before and release what
// they wrote after.
//
// Why several loads in flight: a comm block's copy rate is bytes in flight / latency (Little's
// law). With one 16-byte load per thread outstanding and ~1-2 us NVLink round trips, 256 threads
// move 4 KiB per round trip, ~2-4 GB/s per block; kCopyUnroll independent loads per thread
// multiply that (the perfmodel derives the per-block rate from these constants).
#pragma once

#include "comet/config.h"

namespace comet {

#if COMET_DEVICE_CODE
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  uint64_t lo, hi;
};
#endif

// Independent 16-byte loads each thread issues before its stores in copy_rows.
constexpr int kCopyUnroll = 4;

// One row of a batched copy (the batch lives in the block's shared memory).
struct RowCopy {
  char* dst;
  const char* src;
};

// Copies `bytes` by the threads [tid, nthreads): 16-byte vectors when both sides allow, else the
// widest common alignment, with a scalar tail; element i goes to thread i % nthreads.
COMET_HD void cooperative_copy(void* dst, const void* src, size_t bytes, int tid, int nthreads) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const uintptr_t mis = reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s);
  size_t done = 0;
  if ((mis & 15) == 0) {
    const size_t n = bytes / 16;
    for (size_t i = tid; i < n; i += nthreads)
      reinterpret_cast<Vec16*>(d)[i] = reinterpret_cast<const Vec16*>(s)[i];
    done = n * 16;
  } else if ((mis & 3) == 0) {
    const size_t n = bytes / 4;
    for (size_t i = tid; i < n; i += nthreads)
      reinterpret_cast<uint32_t*>(d)[i] = reinterpret_cast<const uint32_t*>(s)[i];
    done = n * 4;
  } else if ((mis & 1) == 0) {
    const size_t n = bytes / 2;
    for (size_t i = tid; i < n; i += nthreads)
      reinterpret_cast<uint16_t*>(d)[i] = reinterpret_cast<const uint16_t*>(s)[i];
    done = n * 2;
  }
  for (size_t i = done + tid; i < bytes; i += nthreads) d[i] = s[i];
}

// Copies n rows of `bytes` each. Vector path: the rows' 16-byte vectors are numbered row-major and
// thread t moves vectors t, t + T, t + 2T, ... (T = nthreads), issuing kCopyUnroll loads (from up
// to kCopyUnroll different rows) before their stores, so every thread has kCopyUnroll loads in
// flight; the (row, vector) position advances by adding (not dividing) after the first. Rows that
// are not all 16-byte aligned (vectorisable false: the caller knows it once per call, from the
// row size and the buffers' bases) go one by one through cooperative_copy.
// Unroll is kCopyUnroll in both backends; other values exist for the CPU micro-benchmark that
// measures what the unroll buys (bench/comm_copy.py).
template <int Unroll = kCopyUnroll>
COMET_HD void copy_rows(const RowCopy* rows, int32_t n, size_t bytes, bool vectorisable, int tid,
                        int nthreads) {
  if (!vectorisable) {
    for (int32_t r = 0; r < n; ++r) cooperative_copy(rows[r].dst, rows[r].src, bytes, tid, nthreads);
    return;
  }
  const uint32_t per_row = uint32_t(bytes / 16);
  if (per_row == 0 || n == 0) return;
  const uint32_t total = uint32_t(n) * per_row;
  const uint32_t step = uint32_t(nthreads) * Unroll;  // advance of each slot per iteration
  const uint32_t step_rows = step / per_row, step_cols = step % per_row;
  uint32_t row[Unroll], col[Unroll];
#pragma unroll
  for (int u = 0; u < Unroll; ++u) {
    const uint32_t i = uint32_t(tid) + uint32_t(u) * uint32_t(nthreads);
    row[u] = i / per_row;
    col[u] = i % per_row;
  }
  for (uint32_t base = uint32_t(tid); base < total; base += step) {
    Vec16 v[Unroll];
#pragma unroll
    for (int u = 0; u < Unroll; ++u)
      if (row[u] < uint32_t(n)) v[u] = reinterpret_cast<const Vec16*>(rows[row[u]].src)[col[u]];
#pragma unroll
    for (int u = 0; u < Unroll; ++u) {
      if (row[u] < uint32_t(n)) reinterpret_cast<Vec16*>(rows[row[u]].dst)[col[u]] = v[u];
      row[u] += step_rows;
      col[u] += step_cols;
      if (col[u] >= per_row) {
        col[u] -= per_row;
        ++row[u];
      }
    }
  }
}

}  // namespace comet
