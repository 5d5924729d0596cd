// The sm_89 (Ada) FP8 GEMM tile of the fused kernels: one 128x128 output tile
// C[rows, cols] = A[rows, K] @ B[cols, K]^T with float8_e4m3fn A and B, both K-major ("TN"), each
// carrying block scales (A one fp32 scale per row and 128-wide K block, B one per 128 x 128 block),
// accumulated in fp32 with FP8 mma.sync (CuTe's SM89 16x8x32 e4m3 atom, 8 warps). Structure as
// sm80_tile_gemm.cuh: a multistage cp.async mainloop through swizzled shared memory read with
// ldmatrix, and the predicated epilogue of epilogue.cuh (bias added in fp32 before the store).
//
// Block scaling (the CPU backend's definition, csrc/cpu/tile_gemm.h): each 128-wide K block's
// products are summed on their own, multiplied by (its A scale for the row * its B scale) and added
// to the fp32 accumulator in block order. A k-tile here is exactly one scale block (kBK = 128
// bytes), so the MMAs of a k-tile accumulate into `part` (cleared per k-tile) and, right after,
// acc += part * (a_scale[row][kt] * b_scale[kt]) for every accumulator element.
//
// The k-tile's scales travel with its stage: 128 row scales of A and the tile's one B scale, 4-byte
// cp.async into a small per-stage array (zero for rows >= rows), issued with the operand copies. So
// their latency hides behind the pipeline like the operands', no register holds a scale across the
// mainloop (the MMA warps are close to the register limit with two 64-float accumulators), and the
// epilogue of a k-tile reads its thread's 8 distinct rows with ld.shared. Cost: 516 bytes of shared
// memory per stage. (Loading them from global with __ldg at the end of each k-tile would expose a
// global-load latency per k-tile, or cost 8 more live registers to prefetch one k-tile ahead.)
//
// Residues as in the sm80 tile: rows >= `rows`, columns >= `cols` and k >= K load as zeros. vec
// (K % 16 == 0, A's row stride % 16 == 0, 16-byte aligned A and B: the launcher's decision): 16-byte
// cp.async operand copies; otherwise a scalar path (any K, any alignment) fills the same shared
// memory synchronously.
//
// Fused activation (layer0's activation=): run_with<true> loads B through comet/activation.h's
// B-row remap as the sm80 tile does (the first kBN / 2 rows from w0's gate half, the rest from its
// up half; a gate accumulator and its up accumulator in one thread, epilogue.cuh's
// store_tile_act). The two halves are two weight blocks, each within one 128-row scale block when
// F % 64 == 0 (the host's condition for a gated form): each stage carries both B scales, and the
// fragment's up half (acc(i), i >= size / 2) is scaled by the second.
//
// Only tile-local work lives here: which tile to compute and when is the engine's schedule
// (csrc/include/comet/gemm_schedule.h), run by the fused kernel (fused_sm89_fp8.cuh).
#pragma once

#include <cute/tensor.hpp>

#include "comet/exec_context.h"  // kBlockSharedBytes
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/mma_sm89.hpp>
#include <cute/atom/mma_traits_sm89.hpp>
#include <cutlass/numeric_types.h>

#include "comet/activation.h"
#include "epilogue.cuh"
#include "rows_wait.cuh"

namespace comet::gpu::sm89 {

using namespace cute;

// kM: the tile's rows, 128 or 64 (few rows per expert: the same warps, half the M repeats, one
// stage of A half as large). kPipe: the pipeline's stages, 3 (below); layer0's FP8-h kernel with
// 128-row tiles runs 2, leaving room for its epilogue's 32.5 KiB (fused_sm89_fp8.cuh).
template <int kM = 128, int kPipe = 3>
struct Fp8TileGemm {
  static_assert(kM == 64 || kM == 128, "the 2 (M) x 4 (N) warps of 32 x 64 cover 64 or 128 rows");
  using T = cutlass::float_e4m3_t;
  // kBK = 128 bytes: one k-tile per scale block. 3 stages of (128 + 128) x 128 bytes = 96 KB, the
  // most that fits sm_89's 99 KB of shared memory per block (4 stages would need 128 KB).
  static constexpr int kBM = kM, kBN = 128, kBK = 128, kStages = kPipe, kThreads = 256;
  static constexpr int kChunk = 16;  // elements (bytes) per 16-byte vector
  static constexpr int kScaleBlock = 128;
  static_assert(kBK == kScaleBlock, "the mainloop applies the scales once per k-tile");

  using TiledMma = decltype(make_tiled_mma(MMA_Atom<SM89_16x8x32_F32E4M3E4M3F32_TN>{},
                                           Layout<Shape<_2, _4, _1>>{},  // 8 warps: 2 (M) x 4 (N)
                                           Tile<_32, _64, _32>{}));
  // 128-byte k-rows: the 16-byte chunk index (bits 4-6) XOR the row (bits 7-9), so ldmatrix's 8
  // row addresses of one chunk column land in 8 distinct bank groups (and cp.async's 8 chunks of
  // one row too).
  using SmemAtom = decltype(composition(Swizzle<3, 4, 3>{},
                                        Layout<Shape<_8, Int<kBK>>, Stride<Int<kBK>, _1>>{}));
  using SmemLayoutA = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBM>, Int<kBK>, Int<kStages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBN>, Int<kBK>, Int<kStages>>{}));
  // ldmatrix moves 32-bit words: four e4m3 values of one row, as the m16n8k32 fragments hold them.
  using S2RAtom = Copy_Atom<SM75_U32x4_LDSM_N, T>;

  static constexpr int kOperandBytes = int(cosize_v<SmemLayoutA> + cosize_v<SmemLayoutB>);
  // After the operands: A's row scales [kStages][kBM], then B's [2][kStages] (the second row: a
  // paired tile's up half), padded to 32 bytes.
  static constexpr int kSmemBytes = kOperandBytes + kStages * kBM * 4 + 32;
  static_assert(kStages <= 4, "B's per-stage scales fit the 32-byte pad");
  static_assert(kSmemBytes >= int(kBlockSharedBytes),
                "the comm blocks use the fused kernel's dynamic shared memory as their scratch");
  static_assert(kSmemBytes <= 99 * 1024, "sm_89's shared memory per block");

  struct Operand {
    const uint8_t* ptr;  // first row of the tile (its values)
    int rows;            // valid rows (others read as zero)
    int64_t ld;          // bytes between rows (A: a_ld, may exceed K; B: K)
    // A: row r's scale of K block kb at scale[r * scale_ld + kb]. B: the tile's column block's
    // scales, kb at scale[kb] (scale_ld unused: the tile's columns are one weight block).
    const float* scale;
    int64_t scale_ld = 0;
    // Paired B only (the remap, activation_b_row relative to the tile's origin; `rows` then
    // counts valid h columns): B rows per half, the gate-to-up distance F, the up half's scales.
    int half = 0;
    int64_t up = 0;
    const float* scale_up = nullptr;
  };

  static __device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool ok) {
    const uint32_t s = uint32_t(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src),
                 "r"(ok ? 4 : 0));
  }

  // Fills stage `stage` of a [R, kBK] operand tile from k-tile `kt` (kPaired: B rows remapped).
  template <int R, bool kPaired = false, class SLayout>
  static __device__ __forceinline__ void load_stage(uint8_t* smem, SLayout const& layout,
                                                    const Operand& op, int64_t K, int kt,
                                                    int stage, bool vec) {
    constexpr int kChunksPerRow = kBK / kChunk;
    const int64_t k0 = int64_t(kt) * kBK;
    for (int idx = int(threadIdx.x); idx < R * kChunksPerRow; idx += kThreads) {
      const int r = idx / kChunksPerRow;
      const int c = (idx % kChunksPerRow) * kChunk;
      uint8_t* dst = smem + layout(r, c, stage);
      const int64_t gk = k0 + c;
      bool row_ok = r < op.rows;
      int64_t row = r;
      if constexpr (kPaired) {
        row_ok = activation_b_row_valid(r, op.half, op.rows, 0);
        row = activation_b_row(r, op.half, op.up, 0);
      }
      if (vec) {
        const bool ok = row_ok && gk < K;
        const uint8_t* src = ok ? op.ptr + row * op.ld + gk : op.ptr;
        const uint32_t s = uint32_t(__cvta_generic_to_shared(dst));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
                     "r"(ok ? 16 : 0));
      } else {
        // Scalar path: any K, any alignment. One in-range count and no out-of-range address (the
        // form sm80's MN-major scalar path found cheapest in registers).
        const int64_t left = row_ok ? K - gk : 0;
        const int n_ok = left < kChunk ? int(left) : kChunk;  // may be <= 0
        const uint8_t* src = op.ptr + (row_ok ? row * op.ld + gk : 0);
        uint32_t w[kChunk / 4];
#pragma unroll
        for (int e = 0; e < kChunk; e += 4) {
          uint32_t v = 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) v |= (e + j < n_ok ? uint32_t(src[e + j]) : 0u) << (8 * j);
          w[e / 4] = v;
        }
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  // The scales of k-tile `kt` (= K block kt) into stage `stage`: A's kBM row scales (0 for rows
  // past a.rows; threads below kBM), B's one (kPaired: and its up half's, at sbs[kStages +
  // stage]; threads kBM and kBM + 1). Apart, so that B's can go before the rows' wait.
  static __device__ __forceinline__ void load_scales_a(float* sas, const Operand& a, int kt,
                                                       int stage) {
    const int t = int(threadIdx.x);
    if (t < kBM) {
      const bool ok = t < a.rows;
      cp_async_4(sas + stage * kBM + t, ok ? a.scale + int64_t(t) * a.scale_ld + kt : a.scale, ok);
    }
  }
  template <bool kPaired>
  static __device__ __forceinline__ void load_scales_b(float* sbs, const Operand& b, int kt,
                                                       int stage) {
    const int t = int(threadIdx.x);
    if (t == kBM) {
      cp_async_4(sbs + stage, b.scale + kt, true);
    } else if (kPaired && t == kBM + 1) {
      cp_async_4(sbs + kStages + stage, b.scale_up + kt, true);
    }
  }

  // k-tile kt of A (rows and row scales) and of B (weights and block scales) into `stage`.
  static __device__ __forceinline__ void load_a_tile(uint8_t* sa, float* sas, const Operand& a,
                                                     int64_t K, int kt, int stage, bool vec) {
    load_stage<kBM>(sa, SmemLayoutA{}, a, K, kt, stage, vec);
    load_scales_a(sas, a, kt, stage);
  }
  template <bool kPaired>
  static __device__ __forceinline__ void load_b_tile(uint8_t* sb, float* sbs, const Operand& b,
                                                     int64_t K, int kt, int stage, bool vec) {
    load_stage<kBN, kPaired>(sb, SmemLayoutB{}, b, K, kt, stage, vec);
    load_scales_b<kPaired>(sbs, b, kt, stage);
  }
  template <bool kPaired>
  static __device__ __forceinline__ void load_k_tile(uint8_t* sa, uint8_t* sb, float* sas,
                                                     float* sbs, const Operand& a,
                                                     const Operand& b, int64_t K, int kt,
                                                     int stage, bool vec) {
    load_a_tile(sa, sas, a, K, kt, stage, vec);
    load_b_tile<kPaired>(sb, sbs, b, K, kt, stage, vec);
  }

  // The mainloop (kPaired: B through the remap, its halves scaled apart), then
  // epilogue(acc, coord): the accumulator fragment and the tile-local (row, col) of each element.
  // `smem` holds kSmemBytes; `wait`: the wait for the tile's rows, when the caller hands it over
  // (rows_wait.cuh, which also has the plain tile: run_plain_tile).
  template <bool kPaired, class Epilogue, class Wait = NoRowsWait>
  static __device__ __forceinline__ void run_with(char* smem, const Operand& a, const Operand& b,
                                                  int64_t K, bool vec, Epilogue&& epilogue,
                                                  Wait&& wait = Wait{}) {
    uint8_t* sa = reinterpret_cast<uint8_t*>(smem);
    uint8_t* sb = sa + cosize_v<SmemLayoutA>;
    float* sas = reinterpret_cast<float*>(smem + kOperandBytes);  // [kStages][kBM]
    float* sbs = sas + kStages * kBM;                              // [kStages]
    Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<T*>(sa)), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<T*>(sb)), SmemLayoutB{});

    TiledMma mma;
    auto thr_mma = mma.get_slice(threadIdx.x);
    Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, 0));  // (MMA, MMA_M, MMA_K)
    Tensor tCrB = thr_mma.partition_fragment_B(sB(_, _, 0));  // (MMA, MMA_N, MMA_K)
    Tensor acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
    Tensor part = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});  // this K block's sum
    clear(acc);
    // Tile-local (row, col) of every accumulator element: the row picks its A scale.
    Tensor tCcC = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));

    auto s2r_a = make_tiled_copy_A(S2RAtom{}, mma);
    auto thr_s2r_a = s2r_a.get_slice(threadIdx.x);
    Tensor tXsA = thr_s2r_a.partition_S(sA);  // (CPY, CPY_M, CPY_K, PIPE)
    Tensor tXrA = thr_s2r_a.retile_D(tCrA);
    auto s2r_b = make_tiled_copy_B(S2RAtom{}, mma);
    auto thr_s2r_b = s2r_b.get_slice(threadIdx.x);
    Tensor tXsB = thr_s2r_b.partition_S(sB);
    Tensor tXrB = thr_s2r_b.retile_D(tCrB);

    const int k_tiles = int((K + kBK - 1) / kBK);
    constexpr int kBlocks = size<2>(tCrA);

    // Prologue: the first kStages-1 k-tiles in flight; with a wait handed over, B's first
    // (weights and block scales, one group), the wait, then A's (a group each: rows_wait.cuh).
    if constexpr (kDefersRows<Wait>) {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s)
        if (s < k_tiles) load_b_tile<kPaired>(sb, sbs, b, K, s, s, vec);
      cp_async_fence();
      wait();
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < k_tiles) load_a_tile(sa, sas, a, K, s, s, vec);
        cp_async_fence();
      }
    } else {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < k_tiles) load_k_tile<kPaired>(sa, sb, sas, sbs, a, b, K, s, s, vec);
        cp_async_fence();
      }
    }

    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // stage kt visible to all; stage kt-1 free (everyone finished it)
      const int next = kt + kStages - 1;
      if (next < k_tiles)
        load_k_tile<kPaired>(sa, sb, sas, sbs, a, b, K, next, next % kStages, vec);
      cp_async_fence();
      const int stage = kt % kStages;
      clear(part);
#pragma unroll
      for (int kb = 0; kb < kBlocks; ++kb) {
        copy(s2r_a, tXsA(_, _, kb, stage), tXrA(_, _, kb));
        copy(s2r_b, tXsB(_, _, kb, stage), tXrB(_, _, kb));
        gemm(mma, tCrA(_, _, kb), tCrB(_, _, kb), part);
      }
      // This K block, scaled, into the accumulator (block order: the CPU backend's sum).
      const float* row_scale = sas + stage * kBM;
      const float b_scale = sbs[stage];
      const float b_scale_up = kPaired ? sbs[kStages + stage] : b_scale;
      constexpr int kHalf = decltype(size(acc))::value / 2;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i)
        acc(i) = fmaf(part(i), row_scale[get<0>(tCcC(i))] * (i < kHalf ? b_scale : b_scale_up),
                      acc(i));
    }
    cp_async_wait<0>();
    __syncthreads();  // shared memory free for the next tile

    epilogue(acc, tCcC);
  }
};

}  // namespace comet::gpu::sm89
