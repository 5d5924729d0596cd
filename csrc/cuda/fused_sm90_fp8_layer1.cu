// Instantiation of the sm_90a-path fused kernel of layer1 with FP8 operands (Fp8GemmConfig: e4m3 A and
// B with block scales, CUTLASS's blockwise-scaled mainloop); see fused_sm90.cuh.
// Keep NVSHMEM device calls (and anything needing -rdc) out of this file: ptxas serialises wgmma
// and ignores setmaxnreg under -rdc (docs/toolchain.md).
#include "fused_sm90.cuh"

namespace comet::gpu {

FusedKernelInfo fused_sm90_fp8_layer1_info(int tile_m) { return sm90::fp8_info<1>(tile_m); }

void launch_fused_sm90_fp8_layer1(const CallParams& p, int grid, cudaStream_t stream) {
  sm90::fp8_launch<1>(p, grid, stream);
}

}  // namespace comet::gpu
