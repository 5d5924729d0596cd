// A call's device copies and flag clears as one kernel launch (launch.h: CopyList): each op used to
// put 2 memsets and 5 device copies on the stream, 7 stream operations of a few microseconds each
// at decode sizes. Every descriptor is an independent region (a copy into this rank's symmetric
// buffer, or a local workspace range to zero), so all threads of the grid take one descriptor
// after the other in grid-stride loops: no ordering inside the kernel is needed, and the kernel
// sits in the stream where the copies were, so what ran before them and after them is unchanged.
// Every pointer is a kernel argument: a captured CUDA graph replays it with the call's own, and
// a replay after the data segment was reallocated (a grow) writes nothing (CopyList::state).
#include <algorithm>

#include "comet/capture_rule.h"
#include "launch.h"

namespace comet::gpu {
namespace {

constexpr int kCopyThreads = 256;
constexpr int64_t kMaxCopyBlocks = 1024;  // grid-stride beyond that

template <class U>
__device__ void copy_units(const CopyDesc& d, int64_t tid, int64_t stride) {
  const int64_t per_row = d.width / int64_t(sizeof(U));
  if (d.rows == 1) {  // every region but FP8 x's: no division per unit
    U* dst = static_cast<U*>(d.dst);
    const U* src = static_cast<const U*>(d.src);
    for (int64_t i = tid; i < per_row; i += stride) dst[i] = src ? src[i] : U{};
    return;
  }
  const int64_t total = per_row * d.rows;
  for (int64_t i = tid; i < total; i += stride) {
    const int64_t r = i / per_row, c = i - r * per_row;
    U* dst = reinterpret_cast<U*>(static_cast<char*>(d.dst) + r * d.dst_pitch) + c;
    *dst = d.src ? reinterpret_cast<const U*>(static_cast<const char*>(d.src) + r * d.src_pitch)[c]
                 : U{};
  }
}

// __grid_constant__: the descriptors are read from the parameter space where indexed, not
// copied to a local array.
__global__ void __launch_bounds__(kCopyThreads) stream_copies_kernel(const __grid_constant__ CopyList l) {
  if (l.state != nullptr && stale_launch(l.generation, l.state->generation)) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int32_t i = 0; i < l.n; ++i) {
    const CopyDesc& d = l.d[i];
    switch (d.unit) {
      case 16: copy_units<uint4>(d, tid, stride); break;
      case 8: copy_units<uint2>(d, tid, stride); break;
      case 4: copy_units<uint32_t>(d, tid, stride); break;
      case 2: copy_units<uint16_t>(d, tid, stride); break;
      default: copy_units<uint8_t>(d, tid, stride); break;
    }
  }
}

}  // namespace

void launch_copies(const CopyList& l, cudaStream_t stream) {
  if (l.n == 0) return;
  int64_t units = 1;
  for (int32_t i = 0; i < l.n; ++i)
    units = std::max(units, l.d[i].width / l.d[i].unit * l.d[i].rows);
  const int64_t blocks = std::clamp<int64_t>(ceil_div(units, kCopyThreads), 1, kMaxCopyBlocks);
  stream_copies_kernel<<<unsigned(blocks), kCopyThreads, 0, stream>>>(l);
}

cudaError_t preload_copies_kernel() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&stream_copies_kernel));
}

}  // namespace comet::gpu
