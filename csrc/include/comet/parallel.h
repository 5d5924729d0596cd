// Grid-wide building blocks of the multi-block prologue programs (prologue.h): a grid barrier made
// of the engine's own arrival counter and an epoch-style generation flag, an exclusive prefix sum
// and a stable counting sort, all written against the execution context (exec_context.h), so the
// CPU backend runs them with thread teams and the CUDA prologue kernels with many blocks.
//
// Work split: grid thread g of P (P = blocks x threads) owns a contiguous share of the items (sizes
// differ by at most one), so every step handles about n/P items per thread. What a thread is
// assigned is reported through ctx.work() (counted on the CPU, a no-op on the GPU) for the span
// benchmark: each distinct element (routing slot, entry, m-tile, counter) once per program where
// it is assigned, plus the scan's log2(threads) steps and block-sum reads; a program passes over
// its elements at most three times (e.g. the sort's count and scatter passes).
//
// Grid barriers need every block of the grid to be resident at once: the CPU runs every block as a
// live thread team; the CUDA launcher sizes the prologue grid to at most one block per SM.
#pragma once

#include "comet/config.h"
#include "comet/exec_context.h"
#include "comet/flags.h"

namespace comet {

template <class Ctx>
COMET_HD int64_t grid_rank(const Ctx& ctx) {
  return int64_t(ctx.block()) * ctx.threads() + ctx.thread();
}
template <class Ctx>
COMET_HD int64_t grid_size(const Ctx& ctx) {
  return int64_t(ctx.blocks()) * ctx.threads();
}

// Part `part` of a balanced contiguous split of [0, n) into `parts` parts.
struct Share {
  int64_t begin, end;
  COMET_HD int64_t size() const { return end - begin; }
};
COMET_HD Share share_of(int64_t n, int64_t part, int64_t parts) {
  const int64_t q = n / parts, r = n % parts;
  const int64_t b = part * q + (part < r ? part : r);
  return Share{b, b + q + (part < r ? 1 : 0)};
}

// Persistent barrier state (zero-initialised once; self-resetting, so never reset between uses).
struct GridBarrier {
  uint32_t* arrived;     // blocks arrived at the current barrier
  uint64_t* generation;  // number of barriers completed
};

// Every thread of every block calls it. Thread 0 of a block reads the generation BEFORE arriving
// (it cannot advance until this block arrives), arrives, and waits for generation + 1; the last
// arriver resets the counter and releases the new generation (arrive_and_publish).
//
// A grid of one block (every prologue kernel at decode sizes: up to 4096 routing slots, m-tiles or
// rows per block) has nobody to meet: the block barrier alone orders its threads' writes before
// their later reads, so it skips the fence, the arrival and the spin on the generation flag (an
// L2 round trip each, paid ~11-15 times per call otherwise). The generation is not advanced; the
// next multi-block barrier targets its own current value + 1, so the skip changes nothing there.
template <class Ctx>
COMET_HD void grid_sync(Ctx& ctx, const GridBarrier& b) {
  ctx.sync();
  if (ctx.blocks() == 1) return;
  uint64_t target = 0;
  if (ctx.thread() == 0) {
    ctx.fence_peers();  // the block's writes (ordered by sync()) before the arrival
    target = flag_relaxed(b.generation) + 1;
    arrive_and_publish(b.arrived, uint32_t(ctx.blocks()), b.generation, target);
  }
  ctx.wait(b.generation, target, WaitSite::GridBarrier, 0);  // block-wide: ends with sync()
}

// Scratch of grid_exclusive_scan: one value per block plus the total.
struct ScanScratch {
  int64_t* block_sum;  // [blocks]
  int64_t* total;      // [1]
};

// In-place exclusive prefix sum of v[0, n) over the whole grid; returns the total (every thread).
// Steps: each thread sums its share; the block scans its threads' sums in block_shared() memory
// (Hillis-Steele, log2(threads) steps, so needs 16 * threads <= kBlockSharedBytes); each thread adds
// the sums of the blocks before its own (at most `blocks` reads); each thread rewrites its share.
// Ends with a grid barrier, so v and the total are visible to every thread on return.
template <class Ctx, class T>
COMET_HD int64_t grid_exclusive_scan(Ctx& ctx, const GridBarrier& bar, T* v, int64_t n,
                                     const ScanScratch& s) {
  const int64_t g = grid_rank(ctx), P = grid_size(ctx);
  const Share sh = share_of(n, g, P);
  int64_t sum = 0;
  for (int64_t i = sh.begin; i < sh.end; ++i) sum += int64_t(v[i]);  // counted by the caller

  int64_t* buf = static_cast<int64_t*>(ctx.block_shared());  // [2][threads], double-buffered
  const int32_t t = ctx.thread(), nt = ctx.threads();
  buf[t] = sum;
  ctx.sync();
  int32_t in = 0;
  for (int32_t off = 1; off < nt; off <<= 1) {
    int64_t x = buf[in * nt + t];
    if (t >= off) x += buf[in * nt + t - off];
    buf[(1 - in) * nt + t] = x;
    in = 1 - in;
    ctx.sync();
    ctx.work(1);
  }
  const int64_t inclusive = buf[in * nt + t];
  if (t == nt - 1) s.block_sum[ctx.block()] = inclusive;
  grid_sync(ctx, bar);

  int64_t base = 0;
  for (int32_t b = 0; b < ctx.block(); ++b) base += s.block_sum[b];
  ctx.work(ctx.block());
  if (g == P - 1) *s.total = base + inclusive;
  int64_t run = base + inclusive - sum;
  for (int64_t i = sh.begin; i < sh.end; ++i) {
    const int64_t x = int64_t(v[i]);
    v[i] = T(run);
    run += x;
  }
  grid_sync(ctx, bar);
  return *s.total;
}

// Scratch of grid_counting_sort.
struct SortScratch {
  int32_t* counts;  // [keys * grid threads], key-major: counts[key * P + g]
  ScanScratch scan;
};

// Stable counting sort of items [0, n) by key(i) in [0, keys); key(i) < 0 drops the item. key must
// be a pure function of i (it is evaluated twice). Writes bucket_off[keys + 1], out[p] = i for the
// p-th kept item in (key, i) order, and pos_in_bucket[i] = p - bucket_off[key(i)] (-1 for dropped
// items) when pos_in_bucket is not null. That is exactly the sequential counting sort's order:
// thread shares are contiguous and increasing, and the counts are scanned key-major, thread-minor.
// Per thread: `keys` counters + its share of items (counted and scattered) + a share of the scan.
// Returns the number of kept items; ends with a grid barrier.
template <class Ctx, class Key, class Out>
COMET_HD int64_t grid_counting_sort(Ctx& ctx, const GridBarrier& bar, int64_t n, int32_t keys,
                                    const Key& key, int32_t* bucket_off, Out* out,
                                    int32_t* pos_in_bucket, const SortScratch& s) {
  const int64_t g = grid_rank(ctx), P = grid_size(ctx);
  const Share sh = share_of(n, g, P);
  for (int32_t k = 0; k < keys; ++k) s.counts[k * P + g] = 0;
  for (int64_t i = sh.begin; i < sh.end; ++i) {
    const int32_t k = key(i);
    if (k >= 0) ++s.counts[k * P + g];
  }
  ctx.work(keys + sh.size());
  grid_sync(ctx, bar);

  const int64_t kept = grid_exclusive_scan(ctx, bar, s.counts, int64_t(keys) * P, s.scan);
  for (int64_t k = g; k <= keys; k += P)
    bucket_off[k] = int32_t(k < keys ? s.counts[k * P] : kept);
  ctx.work(ceil_div(keys + 1, P));
  grid_sync(ctx, bar);

  for (int64_t i = sh.begin; i < sh.end; ++i) {
    const int32_t k = key(i);
    if (k < 0) {
      if (pos_in_bucket) pos_in_bucket[i] = -1;
      continue;
    }
    const int32_t p = s.counts[k * P + g]++;
    out[p] = Out(i);
    if (pos_in_bucket) pos_in_bucket[i] = p - bucket_off[k];
  }
  grid_sync(ctx, bar);
  return kept;
}

// The b in [0, n) with bound[b] <= x < bound[b + 1], for ascending bound[0..n] with
// bound[0] <= x < bound[n]: the part of a concatenation that item x falls in (log2(n) reads).
template <class T>
COMET_HD int32_t part_of(const T* bound, int32_t n, int64_t x) {
  int32_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (int64_t(bound[mid]) <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace comet
