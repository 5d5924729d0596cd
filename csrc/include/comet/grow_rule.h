// How a buffer's data segment grows (host logic of both backends: the CPU heap and the CUDA
// buffer's NVSHMEM segment, kept free of backend types so one rule serves both).
//
// A call that needs `need` bytes of a segment holding `capacity` grows it to twice the old size
// (a run of slowly growing calls then costs few grows, each a collective with a barrier), but a
// heap of fixed size (NVSHMEM_SYMMETRIC_SIZE, or the CPU heap's cap) may hold the need and not
// the doubling: the doubling must never be what kills a call that fits. So the sizes to try are,
// in order, max(need, 2 * capacity), then the need itself; both rounded up to `align`.
// A heap whose limit is known (the CPU cap) picks the first that fits before it frees anything;
// NVSHMEM, which has no query for its free bytes, tries them in turn after freeing the old
// segment, and allocates the old size again when neither fits (it fitted a moment ago).
#pragma once

#include <cstddef>

namespace comet {

struct GrowSteps {
  size_t first;   // max(need, 2 * capacity), rounded up
  size_t second;  // the need rounded up, or 0 when it equals `first`
};

inline size_t grow_round_up(size_t x, size_t align) {
  return align > 1 ? (x + align - 1) / align * align : x;
}

// Only meaningful when need > capacity (the caller grows only then).
inline GrowSteps grow_steps(size_t need, size_t capacity, size_t align) {
  const size_t doubled = capacity > (~size_t(0)) / 2 ? ~size_t(0) : 2 * capacity;
  const size_t first = grow_round_up(need > doubled ? need : doubled, align);
  const size_t second = grow_round_up(need, align);
  return GrowSteps{first, second == first ? 0 : second};
}

// The size to grow to on a heap that holds at most `limit` bytes (0: no limit): the first of
// grow_steps that fits, or 0 when even the need does not (then nothing may change).
inline size_t grow_size_within(size_t need, size_t capacity, size_t align, size_t limit) {
  const GrowSteps s = grow_steps(need, capacity, align);
  if (limit == 0 || s.first <= limit) return s.first;
  if (s.second != 0 && s.second <= limit) return s.second;
  return 0;
}

}  // namespace comet
