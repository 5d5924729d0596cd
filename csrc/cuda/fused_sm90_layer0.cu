// Instantiations of the sm_90a-path fused kernel of layer0 (bf16 and fp16, B K-major or MN-major,
// 128- or 64-row tiles, plain or with the fused activation);
// see fused_sm90.cuh.
// Keep NVSHMEM device calls (and anything needing -rdc) out of this file: ptxas serialises wgmma
// and ignores setmaxnreg under -rdc (docs/toolchain.md).
#include "fused_sm90.cuh"

namespace comet::gpu {

FusedKernelInfo fused_sm90_layer0_info(ScalarKind kind, bool b_mn_major, int tile_m, bool act) {
  return kind == ScalarKind::BF16 ? sm90::info<cutlass::bfloat16_t, 0>(b_mn_major, tile_m, act)
                                  : sm90::info<cutlass::half_t, 0>(b_mn_major, tile_m, act);
}

void launch_fused_sm90_layer0(ScalarKind kind, const CallParams& p, bool b_mn_major, int grid,
                              cudaStream_t stream) {
  if (kind == ScalarKind::BF16)
    sm90::launch<cutlass::bfloat16_t, 0>(p, b_mn_major, grid, stream);
  else
    sm90::launch<cutlass::half_t, 0>(p, b_mn_major, grid, stream);
}

}  // namespace comet::gpu
