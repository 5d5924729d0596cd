// The HBM read-rate kernel of tools/hbm_stream.py (hbm_read.cu) and its host op
// (hbm_read_op.cpp: torch.ops.comet_cuda.hbm_read_bench).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace comet::gpu {

// Reads `bytes` (a multiple of 16) of src on `blocks` blocks of `threads` threads (at most 256),
// each thread keeping `loads` (1, 2, 4 or 8) 16-byte loads in flight; `smem` bytes of dynamic
// shared memory per block (enough of it keeps one block per SM); sink: `blocks` words, written
// only when a block's loads XOR to one magic value. Returns the launch's error.
cudaError_t launch_hbm_read(const void* src, int64_t bytes, uint32_t* sink, int blocks,
                            int threads, int loads, size_t smem, cudaStream_t stream);

}  // namespace comet::gpu
