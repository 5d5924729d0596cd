// The FP8 format of the ops (comet.fp8): float8_e4m3fn values, each 128-wide block of a row (1 x 128,
// activations) or each 128 x 128 block of a weight with one fp32 scale; a value is q * scale.
//
// On the wire (layer0's symmetric x region and its dispatched rows `a`) an FP8 token row travels
// with its scales as one packed row, so the comm blocks move it as they move any row, unchanged:
//   [H fp8 values][zero padding to 4 bytes][ceil(H/128) fp32 scales][zero padding to 16 bytes]
// Values first: on the GPU the dispatched rows are the GEMM's A operand as they lie, one matrix of
// row stride fp8_row_bytes(H) (a multiple of 16, TMA's condition on strides) starting at the
// buffer's 16-byte-aligned base, whatever H is; the scales stay 4-byte aligned; 16 bytes is the
// comm's vector width. For H a multiple of 512 both paddings are empty and a row is H + 4 H/128
// bytes, against 2 H in bf16.
#pragma once

#include <cmath>

#include "comet/config.h"
#include "comet/numeric.h"

namespace comet {

constexpr int64_t kScaleBlock = 128;  // values per scale along a row / per side of a weight block

COMET_HD int64_t scale_blocks(int64_t n) { return ceil_div(n, kScaleBlock); }

// Byte offset of a packed row's scales (after its values).
COMET_HD int64_t fp8_row_scales_at(int64_t hidden) { return ceil_div(hidden, 4) * 4; }

COMET_HD int64_t fp8_row_bytes(int64_t hidden) {
  return ceil_div(fp8_row_scales_at(hidden) + 4 * scale_blocks(hidden), 16) * 16;
}

// The quantiser's arithmetic (comet.fp8.quantize_rows' format), shared by the CPU backend's and the
// CUDA kernels' sending-side quantisation (dispatch_fp8) so both give the same bits; tests check
// them against torch's own float8_e4m3fn conversion.
constexpr float kFp8Max = 448.0f;  // float8_e4m3fn's largest finite value

// amax over the block's values, NaN-propagating (as torch's amax): NaN if either is.
COMET_HD float fp8_amax(float a, float b) { return (a > b || a != a) ? a : b; }

// A block's scale from its amax (of the absolute values): amax / 448, 1 for a block of zeros
// (and for a NaN amax: NaN > 0 is false, as in torch.where(scale > 0, scale, 1)).
COMET_HD float fp8_block_scale(float amax) {
  const float s = amax / kFp8Max;
  return s > 0.0f ? s : 1.0f;
}

// float -> float8_e4m3fn bits, round to nearest even (exactly torch's conversion for |v| < 464 and
// NaN); |v| >= 464 saturates to +-448 (torch gives NaN above 464; the quantiser's values
// v / scale never exceed 448 by more than a rounding step, so it never gets there).
COMET_HD uint8_t float_to_fp8e4m3(float v) {
  const uint32_t b = float_bits(v) & 0x7fffffffu;
  const uint8_t sign = uint8_t((float_bits(v) >> 24) & 0x80u);
  if (b > 0x7f800000u) return uint8_t(sign | 0x7f);  // NaN
  if (b >= 0x43e80000u) return uint8_t(sign | 0x7e);  // >= 464: saturate to 448
  const int32_t e = int32_t(b >> 23) - 127;
  if (e < -6) {
    // Below the smallest normal (2^-6): multiples of 2^-9. |v| * 512 < 8 is exact; rounding it to
    // an integer (nearest even) gives the subnormal's mantissa, or 8 = the smallest normal's bits.
    return uint8_t(sign | uint8_t(rintf(bits_float(b) * 512.0f)));
  }
  // Normal: exponent e + 7 and the top 3 mantissa bits, rounded to nearest even on the other 20
  // (a carry out of the mantissa correctly steps the exponent).
  uint32_t q = (uint32_t(e + 7) << 3) | ((b >> 20) & 7u);
  const uint32_t rest = b & 0xfffffu, half = 0x80000u;
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return uint8_t(sign | q);
}

// Quantises 128-value block kb of a token row of H values (element i read as float by load(i))
// into its packed row `dst` (values at dst[i], the block's scale at its slot after the values):
// amax of |v| (NaN-propagating; the ragged last block's missing values count as zeros), the
// block's scale, each value divided by it and rounded. The CPU backend runs it block after block;
// the CUDA kernel (csrc/cuda/fp8_pack.cu) spreads a block's 128 values over a warp with the same
// three functions.
template <class Load>
COMET_HD void quantize_pack_block(Load&& load, int64_t hidden, int64_t kb, uint8_t* dst) {
  const int64_t c0 = kb * kScaleBlock;
  const int64_t c1 = c0 + kScaleBlock < hidden ? c0 + kScaleBlock : hidden;
  float amax = 0.0f;
  for (int64_t i = c0; i < c1; ++i) amax = fp8_amax(amax, fabsf(load(i)));
  const float s = fp8_block_scale(amax);
  for (int64_t i = c0; i < c1; ++i) dst[i] = float_to_fp8e4m3(load(i) / s);
  memcpy(dst + fp8_row_scales_at(hidden) + 4 * kb, &s, 4);
}

}  // namespace comet
