// The CPU stand-in for the CUTLASS mainloop: one output tile C[rows, n0:n0+cols] = A[rows] @ B^T
// (+ bias), B an expert's weight [N, K] read through strides (row-major [N, K], or [K, N] for the
// transposed weight layouts, without a copy), inputs of any ScalarKind, accumulation in Acc (fp32;
// fp64 for float64 inputs) in a fixed order (8 interleaved partial sums combined as a fixed tree),
// the bias added last, so results never depend on which block computes a tile or when.
//
// A fused activation (comet/activation.h) pairs each output column's gate and up columns in the
// tile and writes the activated value instead of C.
//
// FP8 (comet/fp8_rows.h): when an operand carries block scales, K is summed in 128-wide blocks in
// block order into an fp32 accumulator, each block's fixed-order dot product of the raw values
// multiplied by (its A scale * its B scale) before it is added (an operand without scales counts
// as scale 1). The one definition of the blockwise-scaled tile, used by both layers.
#pragma once

#include <vector>

#include "comet/activation.h"
#include "comet/fp8_rows.h"
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
  const void* bias = nullptr;  // [N] of this expert (bias_kind), or none
  // FP8 operands (both optional): a's row r, K block kb has scale a_scale[r * a_scale_stride + kb]
  // and a's rows are a_stride elements apart (0: k; packed rows are longer); b_scale is this
  // expert's [ceil(N/128), ceil(K/128)].
  const float* a_scale = nullptr;
  int64_t a_scale_stride = 0, a_stride = 0;
  const float* b_scale = nullptr;
  ScalarKind bias_kind = ScalarKind::F32;  // of bias
  bool blockwise() const { return a_scale || b_scale; }
};

// One output element of the blockwise-scaled GEMM: a [k] row and b [k] column, both widened.
template <class Acc>
inline Acc dot_blockwise(const TileGemmArgs& g, const Acc* a, const Acc* b, int64_t row,
                         int64_t col) {
  const int64_t kb_n = scale_blocks(g.k);
  const float* bs = g.b_scale ? g.b_scale + (col / kScaleBlock) * kb_n : nullptr;
  const float* as = g.a_scale ? g.a_scale + row * g.a_scale_stride : nullptr;
  Acc acc = 0;
  for (int64_t kb = 0; kb < kb_n; ++kb) {
    const int64_t k0 = kb * kScaleBlock, len = g.k - k0 < kScaleBlock ? g.k - k0 : kScaleBlock;
    const Acc part = dot_fixed_order(a + k0, b + k0, len);
    const Acc scale = Acc(as ? as[kb] : 1.0f) * Acc(bs ? bs[kb] : 1.0f);
    acc += part * scale;
  }
  return acc;
}

// B's column `col` (an expert's weight row) widened into dst [k].
template <class Acc>
inline void widen_b_col(const TileGemmArgs& g, int64_t col, Acc* dst) {
  if (g.b_transposed)
    widen(g.b, g.b_kind, col, g.k, dst, g.n);
  else
    widen(g.b, g.b_kind, col * g.k, g.k, dst);
}

// The accumulator of C[r, col] from the widened row and column, the bias added last.
template <class Acc>
inline Acc tile_element(const TileGemmArgs& g, const Acc* arow, const Acc* bcol, int64_t r,
                        int64_t col) {
  Acc v = g.blockwise() ? dot_blockwise(g, arow, bcol, r, col) : dot_fixed_order(arow, bcol, g.k);
  if (g.bias) v += load_as<Acc>(g.bias, col, g.bias_kind);
  return v;
}

// One output tile of rows [row0, row0 + rows) and output columns [col0, col0 + cols): C's
// columns (act None), or h's under a fused activation (comet/activation.h): each output column
// from its gate (and up) accumulators, activated in Acc and rounded once into c [M, out_n].
// `scratch` is per-thread storage reused across tiles.
template <class Acc>
inline void tile_gemm(const TileGemmArgs& g, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                      std::vector<Acc>& scratch, Activation act = Activation::None) {
  const bool gated = activation_gated(act);
  const int64_t srcs = gated ? 2 * cols : cols, out_n = activation_cols(act, g.n);
  scratch.resize(size_t((srcs + 1) * g.k));
  Acc* bt = scratch.data();
  Acc* arow = bt + srcs * g.k;
  // B columns: the tile's gate (or only) columns, then its up columns (the remap every backend's
  // B loader uses, with half = the tile's h columns).
  auto src_col = [&](int64_t c) { return activation_b_row(c, cols, out_n, col0); };
  for (int64_t c = 0; c < srcs; ++c) widen_b_col(g, src_col(c), bt + c * g.k);
  const int64_t a_stride = g.a_stride ? g.a_stride : g.k;
  // FP8 output (c_kind F8E4M3): packed rows of out_n values and their 1 x 128 scales
  // (comet/fp8_rows.h), each 128-column block of the tile quantised from its fp32 values; the
  // tile then starts at a block and covers whole blocks (the caller's n-tiles are multiples of
  // 128 columns).
  const bool fp8_out = g.c_kind == ScalarKind::F8E4M3;
  std::vector<float> vals(fp8_out ? size_t(cols) : 0);
  for (int64_t r = row0; r < row0 + rows; ++r) {
    widen(g.a, g.a_kind, r * a_stride, g.k, arow);
    for (int64_t c = 0; c < cols; ++c) {
      Acc v = tile_element(g, arow, bt + c * g.k, r, src_col(c));
      if (act != Activation::None) {
        const Acc up = gated ? tile_element(g, arow, bt + (cols + c) * g.k, r, src_col(cols + c))
                             : Acc(0);
        v = activate(act, v, up);
      }
      if (fp8_out)
        vals[size_t(c)] = float(v);
      else
        store_as<Acc>(g.c, r * out_n + col0 + c, g.c_kind, v);
    }
    if (fp8_out) {
      uint8_t* row = static_cast<uint8_t*>(g.c) + r * fp8_row_bytes(out_n);
      for (int64_t kb = col0 / kScaleBlock; kb < scale_blocks(col0 + cols); ++kb)
        quantize_pack_block([&](int64_t i) { return vals[size_t(i - col0)]; }, out_n, kb, row);
    }
  }
}

}  // namespace comet::cpu
