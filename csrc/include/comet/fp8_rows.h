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

#include "comet/config.h"

namespace comet {

constexpr int64_t kScaleBlock = 128;  // values per scale along a row / per side of a weight block

COMET_HD int64_t scale_blocks(int64_t n) { return ceil_div(n, kScaleBlock); }

// Byte offset of a packed row's scales (after its values).
COMET_HD int64_t fp8_row_scales_at(int64_t hidden) { return ceil_div(hidden, 4) * 4; }

COMET_HD int64_t fp8_row_bytes(int64_t hidden) {
  return ceil_div(fp8_row_scales_at(hidden) + 4 * scale_blocks(hidden), 16) * 16;
}

}  // namespace comet
