// The fused kernels' epilogue: accumulators (fp32) stored straight from registers into the row-major
// output tile dst[rows, cols] (leading dimension ld), with per-element predication for the tile's
// valid rows and columns. Both MMA families (mma.sync and wgmma) hold column pairs (c, c+1) of one
// row in consecutive accumulator registers, so in-range aligned pairs go out as one 4-byte (16-bit
// outputs) or 8-byte (fp32) store.
//
// Rounding: cvt.rn (round to nearest even), the same results as comet/numeric.h's float_to_bf16 /
// float_to_f16 on the CPU backend for every non-NaN value (a NaN stays a NaN; its payload may
// differ).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace comet::gpu {

static __device__ __forceinline__ uint16_t cvt_out(float v, cutlass::bfloat16_t*) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}
static __device__ __forceinline__ uint16_t cvt_out(float v, cutlass::half_t*) {
  uint16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

template <class T>
__device__ __forceinline__ void store_one(T* p, float v) {
  if constexpr (std::is_same_v<T, float>)
    *p = v;
  else
    *reinterpret_cast<uint16_t*>(p) = cvt_out(v, p);
}

template <class T>
__device__ __forceinline__ void store_two(T* p, float v0, float v1) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  } else {
    const uint32_t w = uint32_t(cvt_out(v0, p)) | (uint32_t(cvt_out(v1, p)) << 16);
    *reinterpret_cast<uint32_t*>(p) = w;
  }
}

// acc: the thread's accumulator fragment; coord: the same partition of an identity tensor over the
// tile (tile-local (row, col) of every accumulator).
template <class T, class Acc, class Coord>
__device__ __forceinline__ void store_tile(const Acc& acc, const Coord& coord, int rows, int cols,
                                           T* dst, int64_t ld) {
  static_assert(decltype(cute::size(acc))::value % 2 == 0, "fragments come in column pairs");
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    const int r = cute::get<0>(coord(i));
    const int c = cute::get<1>(coord(i));
    const bool adjacent = cute::get<0>(coord(i + 1)) == r && cute::get<1>(coord(i + 1)) == c + 1;
    if (r >= rows) continue;
    T* p = dst + int64_t(r) * ld + c;
    if (adjacent && c + 1 < cols &&
        (reinterpret_cast<uintptr_t>(p) & (2 * sizeof(T) - 1)) == 0) {
      store_two(p, acc(i), acc(i + 1));
    } else {
      if (c < cols) store_one(p, acc(i));
      const int r1 = cute::get<0>(coord(i + 1));
      const int c1 = cute::get<1>(coord(i + 1));
      if (r1 < rows && c1 < cols) store_one(dst + int64_t(r1) * ld + c1, acc(i + 1));
    }
  }
}

}  // namespace comet::gpu
