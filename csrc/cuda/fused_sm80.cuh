// Fused persistent kernels of the sm_80 path (cp.async + mma.sync), one per layer and dtype:
// the comm blocks (comet/block_roles.h) run the comm program, the rest walk the engine's tile schedule
// (comet/gemm_schedule.h: layer0_gemm_deferred, whose wait for a tile's rows the tile's mainloop
// makes after its first weight loads (rows_wait.cuh), and layer1_gemm with the per-column
// publication) and compute each tile with sm80::TileGemm, whose epilogue adds the tile's expert
// bias (p.b0 / p.b1, when given) to the fp32 accumulators.
//
// Compiled for sm_80 (Ampere/Ada) and also for sm_90a, where it serves the shapes the TMA path
// cannot take (K not a multiple of 8, unaligned operands).
//
// B (the weights) is read in place in either layout, one instantiation each (kMnB):
//   K-major  (the weights' usual layout, K contiguous: w0 [El, N0, H], w1 [El, H, N1]);
//   MN-major (the ops' transposed weights, N contiguous: w0 [El, H, N0], w1 [El, N1, H]): TileGemm's
//            MN-major B (shared-memory layout for N-contiguous rows, ldmatrix.trans).
// vec (16-byte operand copies) is the host's decision: K % 8 == 0, 16-byte aligned A and B, and
// for MN-major B also N % 8 == 0 (its k-row stride; gated activation: F % 8 == 0 too).
//
// layer0 with a fused activation (p.activation, kAct: its own instantiation, so the plain kernel
// is unchanged): a gated form's n-tile nt covers h's columns [j0, j0 + kBN / 2), j0 = nt * kBN / 2,
// its GEMM the gate rows [j0, ..) and up rows [F + j0, ..) of w0 (comet/activation.h's remap in
// TileGemm's B loader); the epilogue pairs them in registers (store_tile_act). Plain forms: y0's
// tiles, the function applied in the epilogue.
//
// With h_fp8 (p.h_fp8, kHFp8: one more instantiation, the others unchanged): n-tiles of 128 h
// columns, one 1 x 128 scale block each, a gated one computed as two GEMM tiles of 64 h columns
// through the same mainloop, h written as packed FP8 rows (h_fp8_epilogue.cuh); the kernel's
// shared memory grows by the first GEMM tile's fp32 values (kHFp8SmemBytes).
#pragma once

#include "comet/gemm_schedule.h"
#include "comm_blocks.cuh"
#include "h_fp8_epilogue.cuh"
#include "launch.h"
#include "sm80_tile_gemm.cuh"

namespace comet::gpu::sm80 {

// The weight tile of columns [col0, col0 + kBN) of `expert` of a GEMM with K inputs and N outputs
// per expert: B [El, N, K] (K-major) or [El, K, N] (kMnB).
template <class Tile, bool kMnB, class T>
__device__ __forceinline__ typename Tile::Operand weight_tile(const T* B, int32_t expert,
                                                              int64_t col0, int64_t K, int64_t N) {
  if constexpr (kMnB)
    return typename Tile::Operand{B + int64_t(expert) * K * N + col0,
                                  int(N - col0 < Tile::kBN ? N - col0 : Tile::kBN), N};
  else
    return typename Tile::Operand{B + (int64_t(expert) * N + col0) * K,
                                  int(N - col0 < Tile::kBN ? N - col0 : Tile::kBN)};
}

// layer0's tile with the fused activation: h's tile of n-tile nt (see above).
template <class Tile, bool kMnB, class T, class Wait>
__device__ __forceinline__ void activation_tile(char* smem, const CallParams& p, const MTile& mt,
                                                int32_t nt, bool vec, Wait&& wait) {
  const Activation act = Activation(p.activation);
  const int64_t K = p.hidden, N0 = p.cols, F = activation_cols(act, N0);
  const T* A = reinterpret_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.w0);
  const T* bias = static_cast<const T*>(p.b0);  // [El, N0] or null
  const typename Tile::Operand a{A + mt.row_begin * K, mt.rows};
  const bool gated = activation_gated(act);
  const int half = gated ? Tile::kBN / 2 : Tile::kBN;
  const int64_t j0 = int64_t(nt) * half;
  // B's origin at the tile's gate row j0; the up rows F further (the remap, relative to it).
  typename Tile::Operand b = weight_tile<Tile, kMnB>(B, mt.expert, j0, K, N0);
  b.rows = int(F - j0 < half ? F - j0 : half);
  b.half = half;
  b.up = F;
  const T* bias_gate = bias != nullptr ? bias + int64_t(mt.expert) * N0 + j0 : nullptr;
  T* out = static_cast<T*>(p.y0) + mt.row_begin * F + j0;
  // One mainloop (plain forms: half = kBN, the remap the identity), two epilogues.
  Tile::template run_with<true>(
      smem, a, b, K, vec,
      [&](auto const& acc, auto const& coord) {
        store_activation_tile(acc, coord, a.rows, b.rows, out, F, bias_gate, act);
      },
      wait);
}

// layer0's tile with the fused activation and FP8 h: h's n-tile nt of 128 columns (one scale
// block), a gated form's as two GEMM tiles of 64 h columns (h_fp8_epilogue.cuh). The shared memory
// after the GEMM tile's holds the first one's values and the rows' amax.
template <class Tile, bool kMnB, class T>
__device__ __forceinline__ void activation_fp8_tile(char* smem, const CallParams& p,
                                                    const MTile& mt, int32_t nt, bool vec) {
  static_assert(Tile::kBN == kHFp8TileN && Tile::kThreads == kHFp8Threads &&
                    kHFp8CurrentBytes<Tile::kBM> <= Tile::kSmemBytes,
                "h_fp8_epilogue.cuh's tile, its last values in the operand stages");
  using Epilogue = HFp8Epilogue<T, Tile::kBM, Tile::kSmemBytes>;
  const Activation act = Activation(p.activation);
  const int64_t F = activation_cols(act, p.cols), j0 = h_fp8_block(nt, act);
  const int half = h_fp8_half(act);
#pragma unroll 1  // one mainloop in the code, run once or twice
  for (int off = 0; off < int(kScaleBlock) && j0 + off < F; off += half) {
    const int64_t js = j0 + off;  // this GEMM tile's first h column
    const typename Tile::Operand a{reinterpret_cast<const T*>(p.a) + mt.row_begin * p.hidden,
                                   mt.rows};
    typename Tile::Operand b =
        weight_tile<Tile, kMnB>(static_cast<const T*>(p.w0), mt.expert, js, p.hidden, p.cols);
    b.rows = int(F - js < half ? F - js : half);
    b.half = half;
    b.up = F;
    Tile::template run_with<true>(smem, a, b, p.hidden, vec, Epilogue{p, mt, nt, off, smem});
  }
}

template <class T, int kLayer, bool kMnB, int kM, bool kAct = false, bool kHFp8 = false>
__global__ void __launch_bounds__(TileGemm<T, kMnB, kM>::kThreads, 1)
    fused_kernel(const __grid_constant__ CallParams p, bool vec) {
  using Tile = TileGemm<T, kMnB, kM>;
  extern __shared__ __align__(128) char smem[];
  const uint64_t epoch = p.state->epoch;  // set by this call's begin kernel
  const KernelClock clock(p.state);
  if (ran_comm_block<kLayer>(p, epoch, smem)) return;
  const MmaGemmBlock gb = mma_gemm_block<kLayer>(p);
  if (!gb.active) return;
  const int32_t g = gb.g, ng = gb.ng;
  const bool compute = gb.compute;
  BlockGemmContext ctx(wait_config(p));

  if constexpr (kLayer == 0) {
    const GemmScheduleArgs ga = layer0_schedule_args(p, epoch);
    const int64_t K = p.hidden, N = p.cols;
    const T* A = reinterpret_cast<const T*>(p.a);
    const T* B = static_cast<const T*>(p.w0);
    const T* bias = static_cast<const T*>(p.b0);  // [El, N] or null
    T* Y = static_cast<T*>(p.y0);
    // Weights before rows: the tile's mainloop takes the wait for its rows (rows_wait.cuh); an
    // h_fp8 tile (two GEMM tiles through one mainloop in the code) waits before its first loads.
    layer0_gemm_deferred(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt, auto&& wait) {
      if constexpr (kHFp8) {
        wait();
        activation_fp8_tile<Tile, kMnB, T>(smem, p, mt, nt, vec);
      } else if constexpr (kAct) {
        activation_tile<Tile, kMnB, T>(smem, p, mt, nt, vec, wait);
      } else {
        const int64_t col0 = int64_t(nt) * Tile::kBN;
        const typename Tile::Operand a{A + mt.row_begin * K, mt.rows};
        const typename Tile::Operand b = weight_tile<Tile, kMnB>(B, mt.expert, col0, K, N);
        T* out = Y + mt.row_begin * N + col0;
        run_plain_tile<Tile>(smem, a, b, K, vec, out, N,
                             bias != nullptr ? bias + int64_t(mt.expert) * N + col0 : nullptr,
                             wait);
      }
    });
  } else {
    const GemmScheduleArgs ga = layer1_schedule_args(p, epoch);
    const int64_t K = p.cols, H = p.hidden;
    const T* A = static_cast<const T*>(p.h);
    const T* B = static_cast<const T*>(p.w1);
    const T* bias = static_cast<const T*>(p.b1);  // [El, H] or null: into C, before weighting
    float* C = p.c;
    layer1_gemm(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt) {
      if (!compute) return;  // comm-only timing: columns are published without computing them
      const int64_t col0 = int64_t(nt) * Tile::kBN;
      const typename Tile::Operand a{A + mt.row_begin * K, mt.rows};
      const typename Tile::Operand b = weight_tile<Tile, kMnB>(B, mt.expert, col0, K, H);
      float* out = C + mt.row_begin * H + col0;
      run_plain_tile<Tile>(smem, a, b, K, vec, out, H,
                           bias != nullptr ? bias + int64_t(mt.expert) * H + col0 : nullptr);
    });
  }
}

// The kernel's dynamic shared memory: its tile's, and with h_fp8 the epilogue's (kHFp8SmemBytes:
// 32.5 KiB more at 128 rows, 96.5 KiB in all, within sm_86 / sm_89's 99 KiB per block).
template <class T, bool kMnB, int kM, bool kHFp8>
constexpr int kKernelSmem = TileGemm<T, kMnB, kM>::kSmemBytes + (kHFp8 ? kHFp8SmemBytes<kM> : 0);
static_assert(kKernelSmem<cutlass::bfloat16_t, false, 128, true> <= 99 * 1024,
              "sm_86 / sm_89's shared memory per block");

// Sets the dynamic shared memory limit (needed before the occupancy query and the launch).
template <class T, int kLayer, bool kMnB, int kM, bool kAct = false, bool kHFp8 = false>
FusedKernelInfo info() {
  using Tile = TileGemm<T, kMnB, kM>;
  constexpr int smem = kKernelSmem<T, kMnB, kM, kHFp8>;
  auto* k = &fused_kernel<T, kLayer, kMnB, kM, kAct, kHFp8>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  return FusedKernelInfo{reinterpret_cast<const void*>(k), Tile::kThreads, smem};
}

template <class T, int kLayer, bool kMnB, int kM, bool kAct = false, bool kHFp8 = false>
void launch(const CallParams& p, bool vec, int grid, cudaStream_t stream) {
  using Tile = TileGemm<T, kMnB, kM>;
  constexpr int smem = kKernelSmem<T, kMnB, kM, kHFp8>;
  info<T, kLayer, kMnB, kM, kAct, kHFp8>();
  fused_kernel<T, kLayer, kMnB, kM, kAct, kHFp8><<<grid, Tile::kThreads, smem, stream>>>(p, vec);
}

// b_mn_major: the weights are the ops' transposed layout, read in place (MN-major B). tile_m:
// the tile's rows, 128 or 64 (few rows per expert; Checker::launch admits no other). act
// (layer0 only): the fused activation's instantiation; h_fp8 (with act): its FP8-h one.
template <class T, int kLayer, int kM>
FusedKernelInfo info_rows(bool b_mn_major, bool act, bool h_fp8) {
  if constexpr (kLayer == 0) {
    if (act && h_fp8)
      return b_mn_major ? info<T, 0, true, kM, true, true>() : info<T, 0, false, kM, true, true>();
    if (act) return b_mn_major ? info<T, 0, true, kM, true>() : info<T, 0, false, kM, true>();
  }
  return b_mn_major ? info<T, kLayer, true, kM>() : info<T, kLayer, false, kM>();
}
template <class T, int kLayer>
FusedKernelInfo info(bool b_mn_major, int tile_m, bool act = false, bool h_fp8 = false) {
  return tile_m == 64 ? info_rows<T, kLayer, 64>(b_mn_major, act, h_fp8)
                      : info_rows<T, kLayer, 128>(b_mn_major, act, h_fp8);
}

template <class T, int kLayer, int kM>
void launch_rows(const CallParams& p, bool b_mn_major, bool vec, int grid, cudaStream_t stream) {
  if constexpr (kLayer == 0) {
    if (p.activation != int32_t(Activation::None) && p.h_fp8) {
      if (b_mn_major)
        launch<T, 0, true, kM, true, true>(p, vec, grid, stream);
      else
        launch<T, 0, false, kM, true, true>(p, vec, grid, stream);
      return;
    }
    if (p.activation != int32_t(Activation::None)) {
      if (b_mn_major)
        launch<T, 0, true, kM, true>(p, vec, grid, stream);
      else
        launch<T, 0, false, kM, true>(p, vec, grid, stream);
      return;
    }
  }
  if (b_mn_major)
    launch<T, kLayer, true, kM>(p, vec, grid, stream);
  else
    launch<T, kLayer, false, kM>(p, vec, grid, stream);
}
template <class T, int kLayer>
void launch(const CallParams& p, bool b_mn_major, bool vec, int grid, cudaStream_t stream) {
  if (p.tile_m == 64)
    launch_rows<T, kLayer, 64>(p, b_mn_major, vec, grid, stream);
  else
    launch_rows<T, kLayer, 128>(p, b_mn_major, vec, grid, stream);
}

// The host sizes grids from one kernel's shared memory either way (for each tile_m).
static_assert(TileGemm<cutlass::bfloat16_t, true>::kSmemBytes ==
                  TileGemm<cutlass::bfloat16_t, false>::kSmemBytes &&
              TileGemm<cutlass::half_t, true>::kSmemBytes ==
                  TileGemm<cutlass::half_t, false>::kSmemBytes &&
              TileGemm<cutlass::bfloat16_t, true, 64>::kSmemBytes ==
                  TileGemm<cutlass::bfloat16_t, false, 64>::kSmemBytes);

}  // namespace comet::gpu::sm80
