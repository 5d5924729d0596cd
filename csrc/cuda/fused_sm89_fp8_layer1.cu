// The sm_89 FP8 fused kernel of layer1; see fused_sm89_fp8.cuh.
#include "fused_sm89_fp8.cuh"

namespace comet::gpu {

FusedKernelInfo fused_sm89_fp8_layer1_info(int tile_m) { return sm89::info<1>(tile_m); }

void launch_fused_sm89_fp8_layer1(const CallParams& p, int grid, cudaStream_t stream) {
  sm89::launch<1>(p, grid, stream);
}

}  // namespace comet::gpu
