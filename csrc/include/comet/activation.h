// The activation fused into layer0's epilogue (moe_layer0's `activation=`): the one definition of
// the functions and of which accumulator columns feed an output column, for every backend.
//
// w0 is [gate; up] as the caller stores it: N0 = 2F output columns of the GEMM, the gate in
// columns [0, F), the up projection in [F, 2F) (under expert tensor parallelism: each rank's shard
// is its own [gate shard; up shard], so the rule is the same on the shard). A gated form writes
// h[m, j] = act(gate_acc[m, j]) * up_acc[m, j] (F columns); a plain form writes h = act(y_acc)
// (N0 columns). Both take the fp32 (fp64) accumulators with the bias already added and round once,
// to the output dtype, when storing: h is never computed from a rounded y0.
//
// A tile of h's columns [j0, j0 + n) reads w0's rows [j0, j0 + n) and [F + j0, F + j0 + n): the
// gate and up column of an output sit in the same tile, each from its own half of w0
// (activation_b_row below).
#pragma once

#include <cstdint>

#include "comet/config.h"
#include "comet/fp8_rows.h"  // kScaleBlock

#if !COMET_DEVICE_CODE
#include <cmath>
#endif

namespace comet {

// The numbers never change meaning (the Python wrapper and the op agree through the name only,
// but tests and the C++ bindings use the values).
enum class Activation : int32_t { None = 0, SwiGLU = 1, GeGLU = 2, SiLU = 3, GeLU = 4 };

COMET_HD bool activation_gated(Activation a) {
  return a == Activation::SwiGLU || a == Activation::GeGLU;
}

// Columns of layer0's output for N0 GEMM columns: F = N0 / 2 for a gated form (N0 even, checked
// before any kernel), N0 otherwise.
COMET_HD int64_t activation_cols(Activation a, int64_t n0) {
  return activation_gated(a) ? n0 / 2 : n0;
}

// The GEMM column (w0 row) of output column j's gate (or its only input) and of its up half.
COMET_HD int64_t activation_gate_col(int64_t j) { return j; }
COMET_HD int64_t activation_up_col(int64_t j, int64_t f) { return f + j; }

// h's columns per layer0 n-tile: the backend's tile of h (`tile_h`: the CPU tile's n; the CUDA
// mma.sync kernels' GEMM tile_n / 2 for a gated form, tile_n for a plain one), rounded up to whole
// 1 x 128 scale blocks with h_fp8, so that each tile quantises its own blocks and the bits never
// depend on the tile. The schedule's n-tile count is ceil(F / activation_tile_cols(...)) on every
// backend. (A CUDA tile of 128 h columns of a gated form computes them as two GEMM tiles of 64 h
// columns, one after the other: csrc/cuda/h_fp8_epilogue.cuh.)
COMET_HD int64_t activation_tile_cols(int64_t tile_h, bool h_fp8) {
  return h_fp8 ? ceil_div(tile_h, kScaleBlock) * kScaleBlock : tile_h;
}

// The B-row remap of a tile of h's columns [j0, j0 + half): the tile's GEMM computes 2 * half
// columns (gated forms; plain forms and no activation: `half` columns), whose B row i (a w0 row,
// or a column of the transposed [H, N0] layout: the same index) is
//   i <  half: the gate row j0 + i,
//   i >= half: the up row F + j0 + (i - half),
// so in the accumulator a gate column and its up column sit `half` columns apart. `f` is the
// tile's h width F (N0 / 2; plain forms: N0, and then every i < half). Under expert tensor
// parallelism F is the shard's: each rank's w0 shard is its own [gate shard; up shard]. Every
// backend's loader asks this function which row its B row i reads: the CPU tile with half = the
// tile's h columns, the CUDA loaders with half = tile_n / 2 (gated) or tile_n.
COMET_HD int64_t activation_b_row(int64_t i, int64_t half, int64_t f, int64_t j0) {
  return i < half ? activation_gate_col(j0 + i) : activation_up_col(j0 + (i - half), f);
}

// Whether B row i of that tile is in range (its h column j0 + i mod half < F); out-of-range rows
// load as zeros and their columns are never stored.
COMET_HD bool activation_b_row_valid(int64_t i, int64_t half, int64_t f, int64_t j0) {
  return j0 + (i < half ? i : i - half) < f;
}

template <class T>
COMET_HD T act_exp(T v) {
#if COMET_DEVICE_CODE
  return sizeof(T) == 8 ? T(::exp(double(v))) : T(::expf(float(v)));
#else
  return std::exp(v);
#endif
}

template <class T>
COMET_HD T act_erf(T v) {
#if COMET_DEVICE_CODE
  return sizeof(T) == 8 ? T(::erf(double(v))) : T(::erff(float(v)));
#else
  return std::erf(v);
#endif
}

// silu(v) = v * sigmoid(v) = v / (1 + e^-v); gelu(v) = v/2 (1 + erf(v / sqrt 2)), the exact form.
template <class T>
COMET_HD T silu(T v) {
  return v / (T(1) + act_exp(-v));
}

template <class T>
COMET_HD T gelu(T v) {
  return T(0.5) * v * (T(1) + act_erf(v * T(0.70710678118654752440)));
}

// The output element from its accumulators (`up` is not read by the plain forms).
template <class T>
COMET_HD T activate(Activation a, T gate, T up) {
  switch (a) {
    case Activation::SwiGLU: return silu(gate) * up;
    case Activation::GeGLU: return gelu(gate) * up;
    case Activation::SiLU: return silu(gate);
    case Activation::GeLU: return gelu(gate);
    default: return gate;
  }
}

// The names `activation=` takes; -1 when the name is not one of them (host only).
#if !COMET_DEVICE_CODE
inline int32_t activation_from_name(const char* s, size_t n) {
  const char* names[] = {"swiglu", "geglu", "silu", "gelu"};
  for (int32_t i = 0; i < 4; ++i) {
    size_t len = 0;
    while (names[i][len]) ++len;
    if (len == n) {
      bool same = true;
      for (size_t c = 0; c < n; ++c) same = same && names[i][c] == s[c];
      if (same) return i + 1;
    }
  }
  return -1;
}
#endif

}  // namespace comet
