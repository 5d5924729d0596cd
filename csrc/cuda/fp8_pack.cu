// dispatch_fp8's sending side on the GPU: a 16/32-bit x [T, H] quantised and packed (comet/fp8_rows.h)
// straight into this rank's symmetric x region, in one pass: x is read once, the packed rows are
// written once (no staging tensors, no chain of elementwise kernels).
//
// One warp per 128-value block of a row (4 warps per block of the grid): lane l holds values
// [4l, 4l + 4) of the block, the block's amax is a warp max (NaN-propagating), then the scale and
// each value's rounding are comet/fp8_rows.h's (fp8_block_scale, float_to_fp8e4m3): the same
// arithmetic as the CPU backend's quantize_pack_block, so both give the same bits. A lane's 4
// values go out as one 4-byte store (rows are 16-byte aligned, a block starts at a multiple of
// 128), except in a ragged last block.
#include "comet/capture_rule.h"
#include "comet/fp8_rows.h"
#include "comet/numeric.h"
#include "launch.h"

namespace comet::gpu {
namespace {

constexpr int kWarpsPerBlock = 4;

__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    fp8_quantize_pack_kernel(const void* x, int32_t kind, int64_t H, char* dst,
                             int64_t row_bytes, int64_t groups_per_row, const DeviceState* state,
                             uint64_t generation) {
  if (state != nullptr && stale_launch(generation, state->generation)) return;  // launch.h
  const int64_t row = int64_t(blockIdx.x) / groups_per_row;
  const int64_t kb = (int64_t(blockIdx.x) % groups_per_row) * kWarpsPerBlock + threadIdx.x / 32;
  if (kb >= scale_blocks(H)) return;  // whole warps leave: the shuffles below stay full-warp
  const int lane = int(threadIdx.x % 32);
  const int64_t c0 = kb * kScaleBlock + 4 * lane;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[j] = c0 + j < H ? load_as<float>(x, row * H + c0 + j, ScalarKind(kind)) : 0.0f;
    amax = fp8_amax(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fp8_amax(amax, __shfl_xor_sync(~0u, amax, off));
  const float s = fp8_block_scale(amax);
  uint8_t* out = reinterpret_cast<uint8_t*>(dst) + row * row_bytes;
  if (c0 + 3 < H) {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) w |= uint32_t(float_to_fp8e4m3(v[j] / s)) << (8 * j);
    *reinterpret_cast<uint32_t*>(out + c0) = w;
  } else {
    for (int j = 0; j < 4 && c0 + j < H; ++j) out[c0 + j] = float_to_fp8e4m3(v[j] / s);
  }
  if (lane == 0) *reinterpret_cast<float*>(out + fp8_row_scales_at(H) + 4 * kb) = s;
}

}  // namespace

void launch_fp8_quantize_pack(const void* x, ScalarKind kind, int64_t tokens, int64_t hidden,
                              char* dst, int64_t row_bytes, cudaStream_t stream,
                              const DeviceState* state, uint64_t generation) {
  if (tokens == 0 || hidden == 0) return;
  const int64_t groups = ceil_div(scale_blocks(hidden), kWarpsPerBlock);
  fp8_quantize_pack_kernel<<<unsigned(tokens * groups), 32 * kWarpsPerBlock, 0, stream>>>(
      x, int32_t(kind), hidden, dst, row_bytes, groups, state, generation);
}

cudaError_t preload_fp8_pack_kernel() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&fp8_quantize_pack_kernel));
}

}  // namespace comet::gpu
