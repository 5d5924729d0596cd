// The fused kernels' epilogue: accumulators (fp32) stored straight from registers into the row-major
// output tile dst[rows, cols] (leading dimension ld), with per-element predication for the tile's
// valid rows and columns. Both MMA families (mma.sync and wgmma) hold column pairs (c, c+1) of one
// row in consecutive accumulator registers, so in-range aligned pairs go out as one 4-byte (16-bit
// outputs) or 8-byte (fp32) store.
//
// Bias (optional): the expert's bias element of the column, added to the fp32 accumulator before
// the conversion (layer0: y0 = round(acc + b0); layer1: C = acc + b1 in fp32).
//
// Rounding: cvt.rn (round to nearest even), the same results as comet/numeric.h's float_to_bf16 /
// float_to_f16 on the CPU backend for every non-NaN value (a NaN stays a NaN; its payload may
// differ).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "comet/activation.h"

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

// Bias elements (bf16 / fp16) as fp32, read through the non-coherent path (the bias is read-only
// for the kernel). One element (any 2-byte alignment), or the pair (p[0], p[1]) with one 4-byte
// load when p is 4-byte aligned.
template <class B>
__device__ __forceinline__ float bias_one(const B* p) {
  static_assert(sizeof(B) == 2, "biases are bf16 / fp16");
  return static_cast<float>(B::bitcast(__ldg(reinterpret_cast<const unsigned short*>(p))));
}
template <class B>
__device__ __forceinline__ void bias_two(const B* p, bool aligned4, float& b0, float& b1) {
  if (aligned4) {
    const unsigned int u = __ldg(reinterpret_cast<const unsigned int*>(p));
    b0 = static_cast<float>(B::bitcast(uint16_t(u & 0xffffu)));
    b1 = static_cast<float>(B::bitcast(uint16_t(u >> 16)));
  } else {
    b0 = bias_one(p);
    b1 = bias_one(p + 1);
  }
}

// acc: the thread's accumulator fragment; coord: the same partition of an identity tensor over the
// tile (tile-local (row, col) of every accumulator). bias: null, or the tile's slice of its
// expert's bias row (bias[c] belongs to tile column c, valid for c < cols): added to the fp32
// accumulator before the conversion / store, so y0 = round(x @ W^T + b) and C = h @ W^T + b.
template <class T, class B, class Acc, class Coord>
__device__ __forceinline__ void store_tile(const Acc& acc, const Coord& coord, int rows, int cols,
                                           T* dst, int64_t ld, const B* bias) {
  static_assert(decltype(cute::size(acc))::value % 2 == 0, "fragments come in column pairs");
  // The bias is addressed from the thread's first column c0: c - c0 is a compile-time constant of
  // the fragment layout, so every load is base + immediate (no per-column address registers,
  // which the GEMM kernels, at their register limit, cannot afford). Its loads stay next to
  // their stores (a pair's two elements in one 4-byte load when aligned). Measured with ptxas on
  // sm_90a, where the MMA warpgroups are at their register limit: loading the bias ahead, once
  // for the rows r and r + 8 sharing it, or a separate epilogue instance for calls with a bias,
  // all keep more registers live and spill.
  const int c0 = cute::get<1>(coord(0));
  const B* bias0 = bias != nullptr ? bias + c0 : nullptr;
  // The same for the output: element (r, c) at base + ((r - r0) * ld + (c - c0)), with r - r0 and
  // c - c0 compile-time constants: a handful of row offsets, no 64-bit address per element kept
  // live across the mainloop (the FP8 mainloop's second accumulator leaves no room for them).
  const int r0 = cute::get<0>(coord(0));
  T* const base = dst + int64_t(r0) * ld + c0;
  const bool bias_aligned4 = (reinterpret_cast<uintptr_t>(bias0) & 3) == 0;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    const int r = cute::get<0>(coord(i));
    const int c = cute::get<1>(coord(i));
    const bool adjacent = cute::get<0>(coord(i + 1)) == r && cute::get<1>(coord(i + 1)) == c + 1;
    if (r >= rows) continue;
    const int dc = c - c0;
    T* p = base + (int64_t(r - r0) * ld + dc);
    if (adjacent && c + 1 < cols &&
        (reinterpret_cast<uintptr_t>(p) & (2 * sizeof(T) - 1)) == 0) {
      float v0 = acc(i), v1 = acc(i + 1);
      if (bias0 != nullptr) {
        float b0, b1;
        bias_two(bias0 + dc, bias_aligned4 && dc % 2 == 0, b0, b1);
        v0 += b0;
        v1 += b1;
      }
      store_two(p, v0, v1);
    } else {
      const int r1 = cute::get<0>(coord(i + 1));
      const int c1 = cute::get<1>(coord(i + 1));
      if (c < cols) store_one(p, bias0 != nullptr ? acc(i) + bias_one(bias0 + dc) : acc(i));
      if (r1 < rows && c1 < cols)
        store_one(base + (int64_t(r1 - r0) * ld + (c1 - c0)),
                  bias0 != nullptr ? acc(i + 1) + bias_one(bias0 + (c1 - c0)) : acc(i + 1));
    }
  }
}

// store_tile_act's pairing, checked on the host (tools/check_ptxas.py's probe runs it for every
// kernel that calls store_tile_act): for each of the TiledMma's threads over a kBM x kBN tile,
// the first half of its accumulator fragment holds columns c < kBN / 2 and element i + size / 2
// is the same row's column c + kBN / 2.
template <class TiledMma, int kBM, int kBN>
__host__ bool fragment_halves_pair() {
  TiledMma mma;
  for (int t = 0; t < int(cute::size(mma)); ++t) {
    auto c = mma.get_slice(t).partition_C(
        cute::make_identity_tensor(cute::Shape<cute::Int<kBM>, cute::Int<kBN>>{}));
    const int n = int(cute::size(c));
    for (int i = 0; i < n / 2; ++i)
      if (!(cute::get<1>(c(i)) < kBN / 2 && cute::get<0>(c(i + n / 2)) == cute::get<0>(c(i)) &&
            cute::get<1>(c(i + n / 2)) == cute::get<1>(c(i)) + kBN / 2))
        return false;
  }
  return true;
}

// One output element of store_tile_act: its gate (or only) accumulator i and up accumulator
// i + kOut, each with its bias (gate0 / up0: the biases of the thread's first column c0, or null;
// dc: the element's column - c0). A function of its own, force-inlined: the wgmma kernels must
// contain no real call (gpu_context.cuh), and the activation's math makes this body large enough
// for the compiler to keep it out of line if it were a lambda called from every unrolled element.
template <bool kGated, int kOut, class B, class Acc>
__device__ __forceinline__ float act_value(const Acc& acc, int i, const B* gate0, const B* up0,
                                           int dc, Activation act) {
  float g = acc(i);
  if (gate0 != nullptr) g += bias_one(gate0 + dc);
  float u = 0.0f;
  if constexpr (kGated) {
    u = acc(i + kOut);
    if (up0 != nullptr) u += bias_one(up0 + dc);
  }
  return activate(act, g, u);
}

// layer0's fused activation (comet/activation.h) in place of store_tile: h[r, c] of the tile's
// in-range rows and h columns, act applied in fp32 to the accumulators with their bias added,
// rounded once. kGated: the tile's GEMM ran through the B-row remap, so the first half of the
// fragment holds gate columns c < half and acc(i + size / 2) is the up column c + half of the
// same row (the mma.sync and wgmma layouts of the kernels that call this: fragment_halves_pair),
// and h's tile is half as wide; bias_up is then the tile's slice of the up half's bias. Plain
// forms: every element is its own h column, bias_up unused.
template <bool kGated, class T, class B, class Acc, class Coord>
__device__ __forceinline__ void store_tile_act(const Acc& acc, const Coord& coord, int rows,
                                               int cols, T* dst, int64_t ld, const B* bias_gate,
                                               const B* bias_up, Activation act) {
  constexpr int kAll = decltype(cute::size(acc))::value;
  constexpr int kOut = kGated ? kAll / 2 : kAll;
  static_assert(kOut % 2 == 0, "fragments come in column pairs");
  const int c0 = cute::get<1>(coord(0));
  const int r0 = cute::get<0>(coord(0));
  T* const base = dst + int64_t(r0) * ld + c0;
  const B* const gate0 = bias_gate != nullptr ? bias_gate + c0 : nullptr;
  const B* const up0 = bias_up != nullptr ? bias_up + c0 : nullptr;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kOut; i += 2) {
    const int r = cute::get<0>(coord(i));
    const int c = cute::get<1>(coord(i));
    const int r1 = cute::get<0>(coord(i + 1));
    const int c1 = cute::get<1>(coord(i + 1));
    const bool adjacent = r1 == r && c1 == c + 1;
    if (r >= rows) continue;
    T* p = base + (int64_t(r - r0) * ld + (c - c0));
    if (adjacent && c + 1 < cols && (reinterpret_cast<uintptr_t>(p) & (2 * sizeof(T) - 1)) == 0) {
      store_two(p, act_value<kGated, kOut>(acc, i, gate0, up0, c - c0, act),
                act_value<kGated, kOut>(acc, i + 1, gate0, up0, c1 - c0, act));
    } else {
      if (c < cols) store_one(p, act_value<kGated, kOut>(acc, i, gate0, up0, c - c0, act));
      if (r1 < rows && c1 < cols)
        store_one(base + (int64_t(r1 - r0) * ld + (c1 - c0)),
                  act_value<kGated, kOut>(acc, i + 1, gate0, up0, c1 - c0, act));
    }
  }
}

// The fused activation's epilogue of one tile, either form: a gated form's up-half bias lies F
// columns after its gate-half bias (w0 = [gate; up], b0 likewise), a plain form's is unused.
template <class T, class B, class Acc, class Coord>
__device__ __forceinline__ void store_activation_tile(const Acc& acc, const Coord& coord, int rows,
                                                      int cols, T* dst, int64_t F,
                                                      const B* bias_gate, Activation act) {
  if (activation_gated(act))
    store_tile_act<true>(acc, coord, rows, cols, dst, F, bias_gate,
                         bias_gate != nullptr ? bias_gate + F : nullptr, act);
  else
    store_tile_act<false>(acc, coord, rows, cols, dst, F, bias_gate, bias_gate, act);
}

}  // namespace comet::gpu
