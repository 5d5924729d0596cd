// Fused persistent kernels of the sm_80 path (cp.async + mma.sync), one per layer and dtype:
// blocks [0, n_comm) run the comm program, the rest walk the engine's tile schedule
// (comet/gemm_schedule.h: layer0_gemm / layer1_gemm, with the readiness wait and the per-column
// publication) and compute each tile with sm80::TileGemm, whose epilogue adds the tile's expert
// bias (p.b0 / p.b1, when given) to the fp32 accumulators.
//
// Compiled for sm_80 (Ampere/Ada) and also for sm_90a, where it serves the shapes the TMA path
// cannot take (K not a multiple of 8, unaligned operands).
//
// B (the weights) is read K-major only (w0 [El, N0, H], w1 [El, H, N1]): the ops' transposed
// weights are copied into that layout per call for this path (ops_cuda.cpp: kernel_weights),
// while the sm_90a path reads them in place (MN-major B, fused_sm90.cuh). Reading them in place
// here would need another shared-memory layout for B and ldmatrix.trans in TileGemm.
#pragma once

#include "comet/gemm_schedule.h"
#include "comm_blocks.cuh"
#include "launch.h"
#include "sm80_tile_gemm.cuh"

namespace comet::gpu::sm80 {

template <class T, int kLayer>
__global__ void __launch_bounds__(TileGemm<T>::kThreads, 1)
    fused_kernel(const __grid_constant__ CallParams p, bool vec) {
  using Tile = TileGemm<T>;
  extern __shared__ __align__(128) char smem[];
  const uint64_t epoch = p.state->epoch;  // set by this call's begin kernel
  const KernelClock clock(p.state);
  if (ran_comm_block<kLayer>(p, epoch, smem)) return;
  if (p.state->status != int32_t(CallStatus::Ok)) return;
  const bool compute = p.mode != int32_t(BenchMode::CommOnly);
  if (kLayer == 0 && !compute) return;  // comm-only timing: layer0's comm needs no GEMM block
  const int32_t g = int32_t(blockIdx.x) - p.n_comm;
  const int32_t ng = int32_t(gridDim.x) - p.n_comm;
  BlockGemmContext ctx(wait_config(p));

  if constexpr (kLayer == 0) {
    const GemmScheduleArgs ga{epoch, p.mtiles, p.state->num_mtiles, p.num_ntiles,
                              p.mtile_order, p.mtile_ready, nullptr, nullptr};
    const int64_t K = p.hidden, N = p.cols;
    const T* A = reinterpret_cast<const T*>(p.a);
    const T* B = static_cast<const T*>(p.w0);
    const T* bias = static_cast<const T*>(p.b0);  // [El, N] or null
    T* Y = static_cast<T*>(p.y0);
    layer0_gemm(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt) {
      const int64_t col0 = int64_t(nt) * Tile::kBN;
      const typename Tile::Operand a{A + mt.row_begin * K, mt.rows};
      const typename Tile::Operand b{B + (int64_t(mt.expert) * N + col0) * K,
                                     int(N - col0 < Tile::kBN ? N - col0 : Tile::kBN)};
      T* out = Y + mt.row_begin * N + col0;
      Tile::run(smem, a, b, K, vec, out, N,
                bias != nullptr ? bias + int64_t(mt.expert) * N + col0 : nullptr);
    });
  } else {
    const GemmScheduleArgs ga{epoch,   p.mtiles, p.state->num_mtiles, p.num_ntiles,
                              nullptr, nullptr,  p.ntile_count,       p.ntile_ready};
    const int64_t K = p.cols, H = p.hidden;
    const T* A = static_cast<const T*>(p.h);
    const T* B = static_cast<const T*>(p.w1);
    const T* bias = static_cast<const T*>(p.b1);  // [El, H] or null: into C, before weighting
    float* C = p.c;
    layer1_gemm(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt) {
      if (!compute) return;  // comm-only timing: columns are published without computing them
      const int64_t col0 = int64_t(nt) * Tile::kBN;
      const typename Tile::Operand a{A + mt.row_begin * K, mt.rows};
      const typename Tile::Operand b{B + (int64_t(mt.expert) * H + col0) * K,
                                     int(H - col0 < Tile::kBN ? H - col0 : Tile::kBN)};
      float* out = C + mt.row_begin * H + col0;
      Tile::run(smem, a, b, K, vec, out, H,
                bias != nullptr ? bias + int64_t(mt.expert) * H + col0 : nullptr);
    });
  }
}

// Sets the dynamic shared memory limit (needed before the occupancy query and the launch).
template <class T, int kLayer>
FusedKernelInfo info() {
  auto* k = &fused_kernel<T, kLayer>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, TileGemm<T>::kSmemBytes);
  return FusedKernelInfo{reinterpret_cast<const void*>(k), TileGemm<T>::kThreads,
                         TileGemm<T>::kSmemBytes};
}

template <class T, int kLayer>
void launch(const CallParams& p, bool vec, int grid, cudaStream_t stream) {
  info<T, kLayer>();
  fused_kernel<T, kLayer><<<grid, TileGemm<T>::kThreads, TileGemm<T>::kSmemBytes, stream>>>(p, vec);
}

}  // namespace comet::gpu::sm80
