// The generation-checked copy into the data segment (segment_copy.h says when it is used): a
// grid-stride copy, 16 bytes at a time when every address, pitch and the width allow it.
#include <cstdint>

#include "comet/capture_rule.h"
#include "segment_copy.h"

namespace comet::gpu {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    segment_copy_kernel(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width,
                        size_t height, const DeviceState* state, uint64_t generation) {
  if (stale_launch(generation, state->generation)) return;  // a replay after a grow
  const bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | dpitch |
                     spitch | width) & 15) == 0;
  const size_t unit = vec ? 16 : 1, per_row = width / unit, n = per_row * height;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const size_t r = i / per_row, c = (i % per_row) * unit;
    if (vec)
      *reinterpret_cast<uint4*>(dst + r * dpitch + c) =
          *reinterpret_cast<const uint4*>(src + r * spitch + c);
    else
      dst[r * dpitch + c] = src[r * spitch + c];
  }
}

}  // namespace

void launch_segment_copy(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                         size_t height, const DeviceState* state, uint64_t generation,
                         cudaStream_t stream) {
  if (width == 0 || height == 0) return;
  const size_t units = width * height / 16 + 1;  // about one 16-byte unit per thread, at most
  const size_t blocks = units / kThreads + 1;     // 1024 blocks (then grid-stride)
  segment_copy_kernel<<<unsigned(blocks < 1024 ? blocks : 1024), kThreads, 0, stream>>>(
      static_cast<char*>(dst), dpitch, static_cast<const char*>(src), spitch, width, height,
      state, generation);
}

cudaError_t preload_segment_copy_kernel() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&segment_copy_kernel));
}

}  // namespace comet::gpu
