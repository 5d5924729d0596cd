// The sm_89 FP8 fused kernel of layer0; see fused_sm89_fp8.cuh.
#include "fused_sm89_fp8.cuh"

namespace comet::gpu {

FusedKernelInfo fused_sm89_fp8_layer0_info(int tile_m, bool act, bool h_fp8) {
  if (act && h_fp8) return sm89::info<0, true, true>(tile_m);
  return act ? sm89::info<0, true>(tile_m) : sm89::info<0>(tile_m);
}

void launch_fused_sm89_fp8_layer0(const CallParams& p, int grid, cudaStream_t stream) {
  if (p.activation != int32_t(Activation::None) && p.h_fp8)
    sm89::launch<0, true, true>(p, grid, stream);
  else if (p.activation != int32_t(Activation::None))
    sm89::launch<0, true>(p, grid, stream);
  else
    sm89::launch<0>(p, grid, stream);
}

}  // namespace comet::gpu
