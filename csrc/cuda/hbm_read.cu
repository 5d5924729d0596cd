// How fast do `blocks` blocks, one per SM, read HBM when each thread keeps `loads` 16-byte loads in
// flight? The cost model assumes a streaming block reads its SM's share of HBM (hbm / sm_count)
// unless its bytes in flight over an assumed HBM latency are less (comet/tune/model/small_tile.py,
// block_stream_rate); at decode sizes that share is what the GEMM blocks lose to the comm blocks.
// tools/hbm_stream.py times this kernel over block counts and loads in flight on a GPU to measure
// both. Not used by the ops.
#include <cuda_runtime.h>

#include <cstdint>

#include "hbm_read.h"

namespace comet::gpu {
namespace {

// Block b reads the b-th contiguous share of src (as a GEMM block streams its weight slab), its
// threads striding by blockDim x kLoads vectors, each step's kLoads streaming loads
// (ld.global.cs: each byte is read once per launch) issued before any is used. ptxas interleaves
// the uses with the loads when it saves registers; minBlocks = 1 lets it keep all kLoads in
// flight, and tools/sass_check.py checks that the SASS does.
template <int kLoads>
__global__ void __launch_bounds__(256, 1) hbm_read_kernel(const uint4* __restrict__ src, int64_t n,
                                                        uint32_t* sink) {
  const int64_t per = (n + gridDim.x - 1) / gridDim.x;
  const int64_t begin = int64_t(blockIdx.x) * per;
  const int64_t end = begin + per < n ? begin + per : n;
  const int64_t step = int64_t(blockDim.x) * kLoads;
  uint32_t acc = 0;
  int64_t i = begin + threadIdx.x;
  // Whole steps: kLoads unpredicated loads (predicated ones made ptxas interleave them too).
  for (; i + int64_t(kLoads - 1) * blockDim.x < end; i += step) {
    uint4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) v[u] = __ldcs(src + i + int64_t(u) * blockDim.x);
#pragma unroll
    for (int u = 0; u < kLoads; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < end; i += blockDim.x) {  // the share's last partial step
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  // A store that depends on every load keeps them (the value is one no input makes in practice).
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;
}

template <int kLoads>
cudaError_t launch(const void* src, int64_t n, uint32_t* sink, int blocks, int threads,
                   size_t smem, cudaStream_t stream) {
  auto* k = &hbm_read_kernel<kLoads>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  k<<<blocks, threads, smem, stream>>>(static_cast<const uint4*>(src), n, sink);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_hbm_read(const void* src, int64_t bytes, uint32_t* sink, int blocks,
                            int threads, int loads, size_t smem, cudaStream_t stream) {
  const int64_t n = bytes / 16;
  switch (loads) {
    case 1: return launch<1>(src, n, sink, blocks, threads, smem, stream);
    case 2: return launch<2>(src, n, sink, blocks, threads, smem, stream);
    case 4: return launch<4>(src, n, sink, blocks, threads, smem, stream);
    case 8: return launch<8>(src, n, sink, blocks, threads, smem, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace comet::gpu
