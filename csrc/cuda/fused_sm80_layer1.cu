// Instantiations of the sm_80-path fused kernel of layer1 (bf16 and fp16, B K-major or MN-major);
// see fused_sm80.cuh.
#include "fused_sm80.cuh"

namespace comet::gpu {

FusedKernelInfo fused_sm80_layer1_info(ScalarKind kind, bool b_mn_major, int tile_m) {
  return kind == ScalarKind::BF16 ? sm80::info<cutlass::bfloat16_t, 1>(b_mn_major, tile_m)
                                  : sm80::info<cutlass::half_t, 1>(b_mn_major, tile_m);
}

void launch_fused_sm80_layer1(ScalarKind kind, const CallParams& p, bool b_mn_major, bool vec,
                              int grid, cudaStream_t stream) {
  if (kind == ScalarKind::BF16)
    sm80::launch<cutlass::bfloat16_t, 1>(p, b_mn_major, vec, grid, stream);
  else
    sm80::launch<cutlass::half_t, 1>(p, b_mn_major, vec, grid, stream);
}

}  // namespace comet::gpu
