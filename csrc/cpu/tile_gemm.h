// The CPU stand-in for the CUTLASS mainloop: one output tile C[rows, n0:n0+cols] = A[rows] @ B^T
// (+ bias), B an expert's weight [N, K] read through strides (row-major [N, K], or [K, N] for the
// transposed weight layouts, without a copy), inputs of any ScalarKind, accumulation in Acc (fp32;
// fp64 for float64 inputs) in a fixed order (8 interleaved partial sums combined as a fixed tree),
// the bias added last, so results never depend on which block computes a tile or when.
#pragma once

#include <vector>

#include "comet/numeric.h"

namespace comet::cpu {

template <class Acc>
inline Acc dot_fixed_order(const Acc* a, const Acc* b, int64_t k) {
  Acc lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += a[i + l] * b[i + l];
  for (int l = 0; i < k; ++i, ++l) lane[l] += a[i] * b[i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

template <class Acc>
inline void widen(const void* src, ScalarKind kind, int64_t offset, int64_t n, Acc* dst,
                  int64_t stride = 1) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_as<Acc>(src, offset + i * stride, kind);
}

struct TileGemmArgs {
  const void* a;     // [M, K]
  ScalarKind a_kind;
  const void* b;     // this expert's [N, K] (b_transposed false) or [K, N] (true)
  ScalarKind b_kind;
  void* c;           // [M, N]
  ScalarKind c_kind;
  int64_t k, n;      // K, N (row strides of a and c)
  bool b_transposed = false;
  const void* bias = nullptr;  // [N] of this expert (b_kind), or none
};

// `scratch` is per-thread storage reused across tiles.
template <class Acc>
inline void tile_gemm(const TileGemmArgs& g, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                      std::vector<Acc>& scratch) {
  scratch.resize(size_t((cols + 1) * g.k));
  Acc* bt = scratch.data();
  Acc* arow = bt + cols * g.k;
  for (int64_t c = 0; c < cols; ++c) {
    if (g.b_transposed)
      widen(g.b, g.b_kind, col0 + c, g.k, bt + c * g.k, g.n);
    else
      widen(g.b, g.b_kind, (col0 + c) * g.k, g.k, bt + c * g.k);
  }
  for (int64_t r = row0; r < row0 + rows; ++r) {
    widen(g.a, g.a_kind, r * g.k, g.k, arow);
    for (int64_t c = 0; c < cols; ++c) {
      Acc v = dot_fixed_order(arow, bt + c * g.k, g.k);
      if (g.bias) v += load_as<Acc>(g.bias, col0 + c, g.b_kind);
      store_as<Acc>(g.c, r * g.n + col0 + c, g.c_kind, v);
    }
  }
}

}  // namespace comet::cpu
