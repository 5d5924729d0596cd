// Fused persistent FP8 kernels of the sm_89 (Ada) path, one per layer: the comm blocks
// (comet/block_roles.h) run the comm program, the rest walk the engine's tile schedule
// (comet/gemm_schedule.h: layer0_gemm / layer1_gemm, the same walk and bench modes as the sm80
// kernel, fused_sm80.cuh) and compute each tile with sm89::Fp8TileGemm (FP8 mma.sync with the
// operands' block scales), whose epilogue adds the tile's expert bias (bf16, when given) in fp32.
//
// Operands (CallParams' FP8 fields; both K-major, e4m3):
//   layer0: A = the dispatched packed rows p.a (comet/fp8_rows.h: the values at the row start,
//           row stride p.a_ld bytes; the scales at p.a_scale, row stride p.a_scale_ld floats);
//           B = w0 [El, N0, H] with w_scale
//           [El, ceil(N0/128), ceil(H/128)]; out y0 bf16 [rows_cap, N0], bias b0 bf16 [El, N0].
//   layer1: A = h [h_rows, N1] (row stride p.a_ld), scales p.a_scale (row stride p.a_scale_ld);
//           B = w1 [El, H, N1] with w_scale [El, ceil(H/128), ceil(N1/128)]; out C fp32
//           [h_rows, H], bias b1 bf16 [El, H].
// vec (16-byte operand copies) is decided on the host from p (fp8_vec below).
//
// layer0 with a fused activation (p.activation; kAct, its own instantiation): as the sm80 kernel
// (fused_sm80.cuh), a gated n-tile covers h's columns [j0, j0 + kBN / 2) through the B-row remap,
// the gate half's weight scales from w0's block row j0 / 128, the up half's from (F + j0) / 128
// (the host asks F % 64 == 0 of a gated form, so each half lies in one block); h in bf16.
//
// With h_fp8 (p.h_fp8, kHFp8: one more instantiation): as the sm80 kernel's (fused_sm80.cuh), h's
// n-tiles of 128 columns written as packed FP8 rows (h_fp8_epilogue.cuh). Its shared memory grows
// by kHFp8SmemBytes; at 128 rows that fits sm_89's 99 KiB only beside a 2-stage pipeline (64 KiB of
// operands instead of 96), so that instantiation runs 2 stages (HFp8Tile).
//
// Compiled for sm_89 only: the kernel body is inside `#if __CUDA_ARCH__ == 890` (FP8 mma.sync needs
// sm_89; other targets get an empty kernel, never launched there).
#pragma once

#include "comet/fp8_rows.h"
#include "comet/gemm_schedule.h"
#include "comm_blocks.cuh"
#include "h_fp8_epilogue.cuh"
#include "launch.h"
#include "sm89_fp8_tile_gemm.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 890
#define COMET_SM89_FP8_DEVICE 1
#else
#define COMET_SM89_FP8_DEVICE 0
#endif

namespace comet::gpu::sm89 {

// The GEMM tile of a kernel, and its dynamic shared memory (with h_fp8: the epilogue's after the
// tile's). The FP8-h kernel of 128-row tiles runs a 2-stage pipeline (see above).
template <int kM, bool kHFp8>
using HFp8Tile = Fp8TileGemm<kM, kHFp8 && kM == 128 ? 2 : 3>;
template <int kM, bool kHFp8>
constexpr int kKernelSmem = HFp8Tile<kM, kHFp8>::kSmemBytes + (kHFp8 ? kHFp8SmemBytes<kM> : 0);
static_assert(kKernelSmem<128, true> <= 99 * 1024 && kKernelSmem<64, true> <= 99 * 1024,
              "sm_89's shared memory per block");

// The GEMM's A values (first row), its depth K and output width N for layer kLayer.
template <int kLayer>
__host__ __device__ inline const uint8_t* a_values(const CallParams& p) {
  if constexpr (kLayer == 0)
    return reinterpret_cast<const uint8_t*>(p.a);
  else
    return static_cast<const uint8_t*>(p.h);
}
template <int kLayer>
__host__ __device__ inline int64_t gemm_k(const CallParams& p) {
  return kLayer == 0 ? p.hidden : p.cols;
}
template <int kLayer>
__host__ __device__ inline int64_t gemm_n(const CallParams& p) {
  return kLayer == 0 ? p.cols : p.hidden;
}
template <int kLayer>
__host__ __device__ inline const void* weights(const CallParams& p) {
  return kLayer == 0 ? p.w0 : p.w1;
}

// 16-byte cp.async needs every row of A and B to start 16-byte aligned: K (B's row stride) and
// a_ld multiples of 16, both bases aligned (an expert's weights start at a multiple of K * N).
template <int kLayer>
inline bool fp8_vec(const CallParams& p) {
  const auto aligned16 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; };
  return gemm_k<kLayer>(p) % 16 == 0 && p.a_ld % 16 == 0 && aligned16(a_values<kLayer>(p)) &&
         aligned16(weights<kLayer>(p));
}

#if COMET_SM89_FP8_DEVICE
// The tile (m-tile mt, n-tile nt) of layer kLayer: A rows and scales of the m-tile, the weight
// rows of columns [col0, col0 + kBN) of its expert with their block's scales, and the output.
// `wait`: layer0's wait for the tile's rows, made by the mainloop (rows_wait.cuh).
template <int kLayer, int kM, class Out, class Wait = NoRowsWait>
__device__ __forceinline__ void compute_tile(char* smem, const CallParams& p, bool vec,
                                             const MTile& mt, int32_t nt, Out* out_base,
                                             const void* bias_base, Wait&& wait = Wait{}) {
  using Tile = Fp8TileGemm<kM>;
  const int64_t K = gemm_k<kLayer>(p), N = gemm_n<kLayer>(p);
  const int64_t col0 = int64_t(nt) * Tile::kBN;
  const typename Tile::Operand a{a_values<kLayer>(p) + mt.row_begin * p.a_ld, mt.rows, p.a_ld,
                        p.a_scale + mt.row_begin * p.a_scale_ld, p.a_scale_ld};
  const typename Tile::Operand b{
      static_cast<const uint8_t*>(weights<kLayer>(p)) + (int64_t(mt.expert) * N + col0) * K,
      int(N - col0 < Tile::kBN ? N - col0 : Tile::kBN), K,
      p.w_scale + (int64_t(mt.expert) * scale_blocks(N) + col0 / Tile::kBN) * scale_blocks(K)};
  const auto* bias = static_cast<const cutlass::bfloat16_t*>(bias_base);  // [El, N] or null
  run_plain_tile<Tile>(smem, a, b, K, vec, out_base + mt.row_begin * N + col0, N,
                       bias != nullptr ? bias + int64_t(mt.expert) * N + col0 : nullptr, wait);
}

// The operands of layer0's GEMM tile with the fused activation whose first h column is j0 (both
// activation tiles): A the m-tile's packed rows (layer0_a), B through the B-row remap (paired_b:
// half rows per half, kBN / 2 gated, kBN plain; the gate half's weight scales from w0's block row
// j0 / 128, the up half's from (F + j0) / 128).
template <class Tile>
__device__ __forceinline__ typename Tile::Operand layer0_a(const CallParams& p, const MTile& mt) {
  return {a_values<0>(p) + mt.row_begin * p.a_ld, mt.rows, p.a_ld,
          p.a_scale + mt.row_begin * p.a_scale_ld, p.a_scale_ld};
}
template <class Tile>
__device__ __forceinline__ typename Tile::Operand paired_b(const CallParams& p, const MTile& mt,
                                                           int64_t j0) {
  const Activation act = Activation(p.activation);
  const int64_t K = p.hidden, N0 = p.cols, F = activation_cols(act, N0);
  const int half = activation_gated(act) ? Tile::kBN / 2 : Tile::kBN;
  const float* scales = p.w_scale + int64_t(mt.expert) * scale_blocks(N0) * scale_blocks(K);
  typename Tile::Operand b{static_cast<const uint8_t*>(p.w0) + (int64_t(mt.expert) * N0 + j0) * K,
                           int(F - j0 < half ? F - j0 : half), K,
                           scales + (j0 / Tile::kBN) * scale_blocks(K)};
  b.half = half;
  b.up = F;
  b.scale_up = activation_gated(act) ? scales + ((F + j0) / Tile::kBN) * scale_blocks(K) : b.scale;
  return b;
}

// layer0's tile with the fused activation: h's tile of n-tile nt.
template <int kM, class Wait>
__device__ __forceinline__ void activation_tile(char* smem, const CallParams& p, bool vec,
                                                const MTile& mt, int32_t nt, Wait&& wait) {
  using Tile = Fp8TileGemm<kM>;
  const Activation act = Activation(p.activation);
  const int64_t K = p.hidden, N0 = p.cols, F = activation_cols(act, N0);
  const int half = activation_gated(act) ? Tile::kBN / 2 : Tile::kBN;
  const int64_t j0 = int64_t(nt) * half;
  const typename Tile::Operand a = layer0_a<Tile>(p, mt);
  const typename Tile::Operand b = paired_b<Tile>(p, mt, j0);
  const auto* bias = static_cast<const cutlass::bfloat16_t*>(p.b0);  // [El, N0] or null
  const cutlass::bfloat16_t* bias_gate =
      bias != nullptr ? bias + int64_t(mt.expert) * N0 + j0 : nullptr;
  auto* out = static_cast<cutlass::bfloat16_t*>(p.y0) + mt.row_begin * F + j0;
  // One mainloop (plain forms: half = kBN, the remap the identity, both B scales the tile's),
  // two epilogues.
  Tile::template run_with<true>(
      smem, a, b, K, vec,
      [&](auto const& acc, auto const& coord) {
        store_activation_tile(acc, coord, a.rows, b.rows, out, F, bias_gate, act);
      },
      wait);
}

// layer0's tile with the fused activation and FP8 h: h's n-tile nt of 128 columns (one scale
// block), a gated form's as two GEMM tiles of 64 h columns (h_fp8_epilogue.cuh), each half's
// weight scales as activation_tile's.
template <class Tile>
__device__ __forceinline__ void activation_fp8_tile(char* smem, const CallParams& p, bool vec,
                                                    const MTile& mt, int32_t nt) {
  static_assert(Tile::kBN == kHFp8TileN && Tile::kThreads == kHFp8Threads &&
                    kHFp8CurrentBytes<Tile::kBM> <= Tile::kOperandBytes,
                "h_fp8_epilogue.cuh's tile, its last values in the operand stages");
  using Epilogue = HFp8Epilogue<cutlass::bfloat16_t, Tile::kBM, Tile::kSmemBytes>;
  const Activation act = Activation(p.activation);
  const int64_t F = activation_cols(act, p.cols), j0 = h_fp8_block(nt, act);
  const int half = h_fp8_half(act);
#pragma unroll 1  // one mainloop in the code, run once or twice
  for (int off = 0; off < int(kScaleBlock) && j0 + off < F; off += half) {
    Tile::template run_with<true>(smem, layer0_a<Tile>(p, mt), paired_b<Tile>(p, mt, j0 + off),
                                  p.hidden, vec, Epilogue{p, mt, nt, off, smem});
  }
}
#endif

template <int kLayer, int kM, bool kAct = false, bool kHFp8 = false>
__global__ void __launch_bounds__(Fp8TileGemm<kM>::kThreads, 1)
    fused_kernel(const __grid_constant__ CallParams p, bool vec) {
#if COMET_SM89_FP8_DEVICE
  extern __shared__ __align__(128) char smem[];
  const uint64_t epoch = p.state->epoch;  // set by this call's begin kernel
  const KernelClock clock(p.state);
  if (ran_comm_block<kLayer>(p, epoch, smem)) return;
  const MmaGemmBlock gb = mma_gemm_block<kLayer>(p);
  if (!gb.active) return;
  BlockGemmContext ctx(wait_config(p));

  if constexpr (kLayer == 0) {
    const GemmScheduleArgs ga = layer0_schedule_args(p, epoch);
    auto* y0 = static_cast<cutlass::bfloat16_t*>(p.y0);
    // Weights before rows: the tile's mainloop takes the wait for its rows (rows_wait.cuh); an
    // h_fp8 tile (two GEMM tiles through one mainloop in the code) waits before its first loads.
    layer0_gemm_deferred(ctx, gb.g, gb.ng, ga, [&](const MTile& mt, int32_t nt, auto&& wait) {
      if constexpr (kHFp8) {
        wait();
        activation_fp8_tile<HFp8Tile<kM, true>>(smem, p, vec, mt, nt);
      } else if constexpr (kAct)
        activation_tile<kM>(smem, p, vec, mt, nt, wait);
      else
        compute_tile<0, kM>(smem, p, vec, mt, nt, y0, p.b0, wait);
    });
  } else {
    const GemmScheduleArgs ga = layer1_schedule_args(p, epoch);
    layer1_gemm(ctx, gb.g, gb.ng, ga, [&](const MTile& mt, int32_t nt) {
      if (!gb.compute) return;  // comm-only timing: columns are published without computing them
      compute_tile<1, kM>(smem, p, vec, mt, nt, p.c, p.b1);  // b1 into C, before the top-k weighting
    });
  }
#endif
}

// Sets the dynamic shared memory limit (needed before the occupancy query and the launch).
// kAct (layer0): the fused activation's instantiation; kHFp8 (with kAct): its FP8-h one.
template <int kLayer, int kM, bool kAct = false, bool kHFp8 = false>
FusedKernelInfo info() {
  constexpr int smem = kKernelSmem<kM, kHFp8>;
  auto* k = &fused_kernel<kLayer, kM, kAct, kHFp8>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  return FusedKernelInfo{reinterpret_cast<const void*>(k), Fp8TileGemm<kM>::kThreads, smem};
}

template <int kLayer, int kM, bool kAct = false, bool kHFp8 = false>
void launch_kernel(const CallParams& p, int grid, cudaStream_t stream) {
  constexpr int smem = kKernelSmem<kM, kHFp8>;
  info<kLayer, kM, kAct, kHFp8>();
  fused_kernel<kLayer, kM, kAct, kHFp8>
      <<<grid, Fp8TileGemm<kM>::kThreads, smem, stream>>>(p, fp8_vec<kLayer>(p));
}

// What the fused_sm89_fp8_layer*.cu entry points instantiate: the kernel of the call's tile rows
// (p.tile_m: 128, or 64 for few rows per expert; Checker::launch admits no other) and, for
// layer0, of its activation (plain or fused).
template <int kLayer, bool kAct = false, bool kHFp8 = false>
FusedKernelInfo info(int tile_m) {
  return tile_m == 64 ? info<kLayer, 64, kAct, kHFp8>() : info<kLayer, 128, kAct, kHFp8>();
}

template <int kLayer, bool kAct = false, bool kHFp8 = false>
void launch(const CallParams& p, int grid, cudaStream_t stream) {
  if (p.tile_m == 64)
    launch_kernel<kLayer, 64, kAct, kHFp8>(p, grid, stream);
  else
    launch_kernel<kLayer, 128, kAct, kHFp8>(p, grid, stream);
}

}  // namespace comet::gpu::sm89
