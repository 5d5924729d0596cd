// layer0's FP8 h (moe_layer0(activation=..., h_fp8=True)) in the mma.sync kernels' epilogue: h
// leaves the kernel as packed FP8 rows (comet/fp8_rows.h: [F e4m3 values][pad to 4][ceil(F/128)
// fp32 scales][pad to 16]), each 1 x 128 block of a row quantised from its fp32 activation values
// with the shared quantiser's arithmetic (fp8_amax, fp8_block_scale, float_to_fp8e4m3: the bits of
// comet.fp8.quantize_rows of that fp32 h), ready for moe_layer1's h / h_scale.
//
// The schedule walks n-tiles of 128 h columns, one scale block each (comet/activation.h:
// activation_tile_cols). A gated form's GEMM tile of 128 columns gives 64 h columns (the B-row
// remap), so a block is two GEMM sub-tiles, h columns [j0, j0 + 64) then [j0 + 64, j0 + 128), run
// one after the other through the same mainloop: the first one's epilogue keeps its fp32 values in
// shared memory (the stash, in fragment order: element i of thread t at stash[i * kThreads + t],
// so a warp's accesses are consecutive words), the second one's puts its own beside them (in the
// operand stages, free after its mainloop), takes each row's amax over both (the block's missing
// columns past F count as zeros, as quantize_rows pads), and writes both halves' values and the
// row's scale. A last block of at most 64 columns (F % 128 in
// (0, 64]) is one sub-tile, quantised at once; a plain form's tile is 128 h columns itself.
//
// Cross-thread amax: the threads of a row are a quad of a warp (the mma.sync accumulator layout:
// h_fp8_rows_in_quads checks it on the host for each kernel's TiledMma) in each of the warps that
// share the row: a quad reduces with two shuffles, then one lane per quad folds its rows into
// shared memory with atomicMax on the float's bits. For |v| (sign bit clear) the unsigned order of
// the bits is the float order with every NaN above +inf, so the result is fp8_amax's max of the
// row, or a NaN when fp8_amax gives one (only its payload may differ, and fp8_block_scale(NaN) is 1
// either way): the same scale in any order.
//
// Rows past the tile's real rows and columns past F are never written; the tile holding a row's
// last block also zeroes the row's padding bytes (rows past M under max_rows: unspecified).
#pragma once

#include <cute/tensor.hpp>

#include "call_params.h"
#include "comet/activation.h"
#include "comet/fp8_rows.h"
#include "comet/tile_order.h"
#include "epilogue.cuh"

namespace comet::gpu {

// The extra shared memory of an h_fp8 kernel, after its GEMM tile's: the stash (64 fp32 values per
// row of a kBM-row tile) and the per-row amax (kBM words). The last sub-tile's values (up to 128
// per row: a plain form's) take kHFp8CurrentBytes of the GEMM's operand stages.
template <int kBM>
constexpr int kHFp8SmemBytes = kBM * 64 * 4 + kBM * 4;
template <int kBM>
constexpr int kHFp8CurrentBytes = kBM * 128 * 4;
constexpr int kHFp8Threads = 256;  // the mma.sync kernels' block

// Where one h_fp8 tile writes: its rows' packed FP8 rows and its scale block.
struct HFp8Out {
  uint8_t* rows;      // the tile's first packed row (p.y0 + row_begin * row_bytes)
  int64_t row_bytes;  // fp8_row_bytes(F)
  int64_t f;          // h's columns F
  int64_t j0;         // the block's first h column (a multiple of 128)
  int32_t rows_valid;  // the tile's real rows
  float* stash;       // [kOut][kThreads] fp32: the first sub-tile's values
  uint32_t* amax;     // [kBM]: each row's amax bits
  float* current;     // [kOut][kThreads] fp32: the last sub-tile's values (in the operand stages)
};

// Slot of accumulator element i among a thread's rows: the mma.sync C fragment is ((2, 2), MMA_M,
// MMA_N) column-major, element (v, m, n) at row (v / 2, m) of the thread's rows.
template <int kMmaM>
__device__ __forceinline__ constexpr int h_fp8_row_slot(int i) {
  return (i / 2) % 2 + 2 * ((i / 4) % kMmaM);
}

// The host check of the layout facts the epilogue relies on, for each of the TiledMma's threads
// over a kBM x kBN tile: element i's row is that of the first element of its slot
// (h_fp8_row_slot), and the 4 lanes of a quad hold the same rows.
template <class TiledMma, int kBM, int kBN>
__host__ bool h_fp8_rows_in_quads() {
  TiledMma mma;
  auto part = [&](int t) {
    return mma.get_slice(t).partition_C(
        cute::make_identity_tensor(cute::Shape<cute::Int<kBM>, cute::Int<kBN>>{}));
  };
  for (int t = 0; t < int(cute::size(mma)); ++t) {
    auto c = part(t);
    auto lead = part(t - t % 4);
    const int mm = int(cute::size<1>(c));
    for (int i = 0; i < int(cute::size(c)); ++i) {
      const int first = (i / 2) % 2 * 2 + 4 * ((i / 4) % mm);
      if (cute::get<0>(c(i)) != cute::get<0>(c(first)) ||
          cute::get<0>(c(i)) != cute::get<0>(lead(i)))
        return false;
    }
  }
  return true;
}

// One h element of a sub-tile (columns c >= cols: 0, a missing column of the block): act of the
// accumulators with their biases added, in fp32 (store_tile_act's value, unrounded).
template <bool kGated, class B, class Acc>
__device__ __forceinline__ float h_fp8_value(const Acc& acc, int i, int c, int cols,
                                             const B* bias_gate, const B* bias_up,
                                             Activation act) {
  constexpr int kOut = kGated ? decltype(cute::size(acc))::value / 2
                              : decltype(cute::size(acc))::value;
  if (c >= cols) return 0.0f;
  return act_value<kGated, kOut>(acc, i, bias_gate, bias_up, c, act);  // epilogue.cuh's element
}

// One or two values of a packed row at h column j (j + 1 when `two`; columns >= f are padding,
// never written here), quantised with the row's scale s: float_to_fp8e4m3(v / s), quantize_rows'
// expression.
__device__ __forceinline__ void h_fp8_put(uint8_t* row, int64_t j, float a, float b, bool two,
                                          float s, int64_t f) {
  const uint8_t qa = float_to_fp8e4m3(a / s);
  if (two && j + 1 < f && (j & 1) == 0) {
    *reinterpret_cast<uint16_t*>(row + j) =
        uint16_t(qa) | uint16_t(uint16_t(float_to_fp8e4m3(b / s)) << 8);
  } else {
    if (j < f) row[j] = qa;
    if (two && j + 1 < f) row[j + 1] = float_to_fp8e4m3(b / s);
  }
}

// The epilogue of one GEMM sub-tile of an h_fp8 block. cols: its valid h columns (from its
// origin); off: its origin's column in the block (0 or 64); last: it completes the block (else its
// values go to the stash); a last sub-tile at off 64 reads the first one's values back. Every
// thread of the block calls it (it synchronises the block when `last`).
//
// Registers: the values go to shared memory as soon as they are computed (a last sub-tile's into
// the GEMM's operand stages, free after its mainloop), so nothing of the fragment stays live
// across the amax exchange: the FP8 kernel's 128-row tile, 64 accumulators per thread, spilled
// when they did.
template <bool kGated, class B, class Acc, class Coord>
__device__ __forceinline__ void store_h_fp8_tile(const Acc& acc, const Coord& coord, int cols,
                                                 int off, bool last, const HFp8Out& o,
                                                 const B* bias_gate, const B* bias_up,
                                                 Activation act) {
  constexpr int kAll = decltype(cute::size(acc))::value;
  constexpr int kOut = kGated ? kAll / 2 : kAll;
  constexpr int kMmaM = decltype(cute::size<1>(acc))::value;
  constexpr int kSlots = 2 * kMmaM;
  static_assert(kOut % 4 == 0, "fragments come in (2 columns) x (2 rows)");
  const int tid = int(threadIdx.x);
  constexpr int threads = kHFp8Threads;  // a compile-time stride: base + immediate addresses
  float* const mine = (last ? o.current : o.stash) + tid;  // element i at mine[i * threads]
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kOut; ++i)
    mine[i * threads] =
        h_fp8_value<kGated>(acc, i, cute::get<1>(coord(i)), cols, bias_gate, bias_up, act);
  if (!last) return;
  // The first sub-tile's values (same fragment positions, block columns c), when there is one.
  const bool prev = off != 0;
  const float* const first = o.stash + tid;

  // Each row's amax: the thread's elements, its quad, then the warps sharing the row.
  for (int r = tid; r < o.rows_valid; r += threads) o.amax[r] = 0u;
  float m[kSlots];
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < kSlots; ++s) m[s] = 0.0f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kOut; ++i) {
    const int s = h_fp8_row_slot<kMmaM>(i);
    m[s] = fp8_amax(m[s], fabsf(mine[i * threads]));
    if (prev) m[s] = fp8_amax(m[s], fabsf(first[i * threads]));
  }
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < kSlots; ++s) {
    m[s] = fp8_amax(m[s], __shfl_xor_sync(0xffffffffu, m[s], 1));
    m[s] = fp8_amax(m[s], __shfl_xor_sync(0xffffffffu, m[s], 2));
  }
  __syncthreads();  // the amax words cleared
  if (tid % 4 == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kSlots; ++s) {
      const int r = cute::get<0>(coord((s % 2) * 2 + 4 * (s / 2)));
      if (r < o.rows_valid) atomicMax(&o.amax[r], __float_as_uint(m[s]));
    }
  }
  __syncthreads();  // every row's amax complete
  float scale[kSlots];
  CUTLASS_PRAGMA_UNROLL
  for (int s = 0; s < kSlots; ++s) {
    const int r = cute::get<0>(coord((s % 2) * 2 + 4 * (s / 2)));
    scale[s] = fp8_block_scale(r < o.rows_valid ? __uint_as_float(o.amax[r]) : 0.0f);
  }

  // The values, quantised: element i of both sub-tiles (block columns c and off + c).
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kOut; i += 2) {
    const int r = cute::get<0>(coord(i)), c = cute::get<1>(coord(i));
    const int r1 = cute::get<0>(coord(i + 1)), c1 = cute::get<1>(coord(i + 1));
    const bool two = r1 == r && c1 == c + 1;  // always, in the mma.sync layouts
    if (r < o.rows_valid) {
      const float s = scale[h_fp8_row_slot<kMmaM>(i)];
      uint8_t* row = o.rows + int64_t(r) * o.row_bytes;
      if (prev)
        h_fp8_put(row, o.j0 + c, first[i * threads], first[(i + 1) * threads], two, s, o.f);
      h_fp8_put(row, o.j0 + off + c, mine[i * threads], mine[(i + 1) * threads], two, s, o.f);
    }
    if (!two && r1 < o.rows_valid) {  // the odd element on its own
      const float s1 = scale[h_fp8_row_slot<kMmaM>(i + 1)];
      uint8_t* row1 = o.rows + int64_t(r1) * o.row_bytes;
      if (prev) h_fp8_put(row1, o.j0 + c1, first[(i + 1) * threads], 0.0f, false, s1, o.f);
      h_fp8_put(row1, o.j0 + off + c1, mine[(i + 1) * threads], 0.0f, false, s1, o.f);
    }
  }
  // The rows' scales of the block, by the thread holding its first column (one per row), and in
  // a row's last block its padding bytes (zeros).
  if (cute::get<1>(coord(0)) == 0) {
    const int64_t kb = o.j0 / kScaleBlock, blocks = scale_blocks(o.f);
    const int64_t scales_at = fp8_row_scales_at(o.f);
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kSlots; ++s) {
      const int r = cute::get<0>(coord((s % 2) * 2 + 4 * (s / 2)));
      if (r >= o.rows_valid) continue;
      uint8_t* row = o.rows + int64_t(r) * o.row_bytes;
      *reinterpret_cast<float*>(row + scales_at + 4 * kb) = scale[s];  // 4-byte aligned
      if (kb == blocks - 1) {
        for (int64_t j = o.f; j < scales_at; ++j) row[j] = 0;
        for (int64_t j = scales_at + 4 * blocks; j < o.row_bytes; ++j) row[j] = 0;
      }
    }
  }
  __syncthreads();  // `current` (the operand stages) is the next tile's mainloop's again
}

// h_fp8's GEMM tiles: h columns per GEMM tile of kBN columns (a gated form's kBN / 2 through the
// B-row remap, a plain form's kBN) and the h block of n-tile nt.
constexpr int kHFp8TileN = 128;  // the mma.sync kernels' GEMM tile_n
static_assert(kHFp8TileN == kScaleBlock, "a plain form's GEMM tile is one scale block");
__device__ __forceinline__ int h_fp8_half(Activation act) {
  return activation_gated(act) ? kHFp8TileN / 2 : kHFp8TileN;
}
__device__ __forceinline__ int64_t h_fp8_block(int32_t nt, Activation act) {
  return int64_t(nt) * activation_tile_cols(h_fp8_half(act), true);
}
// Whether the GEMM tile at block column off (0 or 64) is the block's last one.
__device__ __forceinline__ bool h_fp8_last(int64_t j0, int off, int half, int64_t f) {
  return off + half >= int(kScaleBlock) || j0 + off + half >= f;
}

// run_with's epilogue of the h_fp8 GEMM tile at block column `off` of n-tile nt of m-tile mt
// (kTileSmem: the GEMM tile's shared memory, the stash after it). Everything it needs beyond
// the fragment is derived here from the call's parameters, so nothing but (mt, nt, off) stays
// live across the mainloop (the FP8 kernel's is at its register limit), and it is a function
// object because its call must be inlined (a lambda this large is not, and the call would pass
// the fragment through local memory). A gated form's up-half bias lies F columns after its
// gate-half bias (w0 = [gate; up], b0 likewise); a plain form's is unused. B: b0's element type.
template <class B, int kBM, int kTileSmem>
struct HFp8Epilogue {
  const CallParams& p;
  const MTile& mt;
  int32_t nt;
  int off;
  char* smem;
  template <class Acc, class Coord>
  __device__ __forceinline__ void operator()(const Acc& acc, const Coord& coord) const {
    const Activation act = Activation(p.activation);
    const int64_t f = activation_cols(act, p.cols), row_bytes = fp8_row_bytes(f);
    const int half = h_fp8_half(act);
    float* stash = reinterpret_cast<float*>(smem + kTileSmem);
    const HFp8Out o{static_cast<uint8_t*>(p.y0) + mt.row_begin * row_bytes, row_bytes, f,
                    h_fp8_block(nt, act), mt.rows, stash,
                    reinterpret_cast<uint32_t*>(stash + kBM * 64), reinterpret_cast<float*>(smem)};
    const int64_t js = o.j0 + off;
    const int cols = int(f - js < half ? f - js : half);
    const bool last = h_fp8_last(o.j0, off, half, f);
    const B* b0 = static_cast<const B*>(p.b0);
    const B* gate = b0 != nullptr ? b0 + int64_t(mt.expert) * p.cols + js : nullptr;
    if (activation_gated(act))
      store_h_fp8_tile<true>(acc, coord, cols, off, last, o, gate,
                             gate != nullptr ? gate + f : nullptr, act);
    else
      store_h_fp8_tile<false>(acc, coord, cols, off, last, o, gate, gate, act);
  }
};

}  // namespace comet::gpu
