// Instantiations of the sm_80-path fused kernel of layer0 (bf16 and fp16, B K-major or MN-major,
// 128- or 64-row tiles, plain, with the fused activation, or with it and FP8 h); see fused_sm80.cuh.
#include "fused_sm80.cuh"

namespace comet::gpu {

FusedKernelInfo fused_sm80_layer0_info(ScalarKind kind, bool b_mn_major, int tile_m, bool act,
                                       bool h_fp8) {
  return kind == ScalarKind::BF16
             ? sm80::info<cutlass::bfloat16_t, 0>(b_mn_major, tile_m, act, h_fp8)
             : sm80::info<cutlass::half_t, 0>(b_mn_major, tile_m, act, h_fp8);
}

void launch_fused_sm80_layer0(ScalarKind kind, const CallParams& p, bool b_mn_major, bool vec,
                              int grid, cudaStream_t stream) {
  if (kind == ScalarKind::BF16)
    sm80::launch<cutlass::bfloat16_t, 0>(p, b_mn_major, vec, grid, stream);
  else
    sm80::launch<cutlass::half_t, 0>(p, b_mn_major, vec, grid, stream);
}

}  // namespace comet::gpu
