// Copies of a call's source data into this rank's data segment that a CUDA graph may replay
// (segment_copy.cu). A captured copy keeps the segment address it was captured with; after a grow
// that segment is freed (comet/capture_rule.h). So the calls without host synchronisation (the
// capturable ones) copy with this kernel, which first compares the generation it was launched
// with and the device state's, and writes nothing when they differ. Eager calls, whose
// generation is always current, keep the copy engine (cudaMemcpyAsync).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "call_params.h"

namespace comet::gpu {

// height rows of width bytes, from src (row pitch spitch) to dst (row pitch dpitch); skipped when
// `generation` is not state->generation.
void launch_segment_copy(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                         size_t height, const DeviceState* state, uint64_t generation,
                         cudaStream_t stream);
cudaError_t preload_segment_copy_kernel();  // loads it now (as preload_prologue_kernels)

}  // namespace comet::gpu
