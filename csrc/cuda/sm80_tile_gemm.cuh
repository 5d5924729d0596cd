// The sm_80 GEMM tile of the fused kernels: one kM x 128 output tile (kM = 128, or 64 for few rows
// per expert: the same 8 warps, 2 (M) x 4 (N), each with half the M repeats) C[rows, cols] = A[rows, K] @
// B[cols, K]^T (both operands K-contiguous, "TN"; or, kMnB, B stored [K, cols] with its columns
// contiguous: the ops' transposed weights read in place), bf16 or fp16 inputs, fp32 accumulation
// with mma.sync (CuTe SM80 16x8x16 atoms, 8 warps), a multistage cp.async mainloop through swizzled
// shared memory read with ldmatrix, and a predicated epilogue storing straight from registers
// (adding the expert's bias, when there is one, in fp32 before the store).
//
// Residues are handled in the tile: rows >= `rows`, columns >= `cols` and k >= K load as zeros.
// When K is a multiple of 8 and both operands are 16-byte aligned (and, kMnB, N % 8 == 0: the
// fused kernels' `vec`) the gmem->smem copies are 16-byte cp.async (zero-filling out-of-range
// vectors); otherwise a scalar path fills the same shared memory synchronously (the awkward
// shapes: H = 37 and friends), so one kernel serves every shape.
//
// B MN-major (kMnB): a stage of B holds kBK k-rows of kBN contiguous columns in CUTLASS's sm80
// layout for 16-bit MN-major operands (3-3-3 swizzle over 64-column, 128-byte rows), read with
// ldmatrix.trans (SM75_U16x8_LDSM_T), which yields the same mma.sync fragments as the K-major
// layout with ldmatrix. Its 16-byte cp.async vectors run along N (vec then also needs the row
// stride N % 8 == 0); its scalar path gathers the same vectors element by element.
//
// Fused activation (layer0's activation=, comet/activation.h): run_with<true> loads B through the
// B-row remap (activation_b_row: the tile's first kBN / 2 B rows from w0's gate half, the rest
// from its up half; in the MN-major layout the same index picks columns), so a gate column's
// accumulator and its up column's sit kBN / 2 columns apart, which this warp layout keeps in one
// thread (acc(i) and acc(i + size / 2): epilogue.cuh, store_tile_act); the epilogue is the caller's.
//
// Only tile-local work lives here: which tile to compute and when is the engine's schedule
// (csrc/include/comet/gemm_schedule.h), run by the fused kernel.
#pragma once

#include <cute/tensor.hpp>

#include "comet/exec_context.h"  // kBlockSharedBytes
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cutlass/numeric_types.h>

#include "comet/activation.h"
#include "epilogue.cuh"
#include "rows_wait.cuh"

namespace comet::gpu::sm80 {

using namespace cute;

template <class T>
struct MmaAtomFor;
template <>
struct MmaAtomFor<cutlass::bfloat16_t> {
  using type = SM80_16x8x16_F32BF16BF16F32_TN;
};
template <>
struct MmaAtomFor<cutlass::half_t> {
  using type = SM80_16x8x16_F32F16F16F32_TN;
};

template <class T, bool kMnB = false, int kM = 128>
struct TileGemm {
  static_assert(kM == 64 || kM == 128, "the 2 (M) x 4 (N) warps of 32 x 64 cover 64 or 128 rows");
  static constexpr int kBM = kM, kBN = 128, kBK = 32, kStages = 4, kThreads = 256;
  static constexpr int kChunk = 8;  // elements per 16-byte vector

  using TiledMma = decltype(make_tiled_mma(MMA_Atom<typename MmaAtomFor<T>::type>{},
                                           Layout<Shape<_2, _4, _1>>{},  // 8 warps: 2 (M) x 4 (N)
                                           Tile<_32, _64, _16>{}));
  // 32 halves = 64 bytes per k-row of a stage: 2-3-3 swizzle keeps ldmatrix conflict-free.
  using SmemAtom = decltype(composition(Swizzle<2, 3, 3>{},
                                        Layout<Shape<_8, Int<kBK>>, Stride<Int<kBK>, _1>>{}));
  using SmemLayoutA = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBM>, Int<kBK>, Int<kStages>>{}));
  // MN-major B: 64 contiguous columns (128 bytes) per k-row of the atom, 8 k-rows.
  using SmemAtomMn = decltype(composition(Swizzle<3, 3, 3>{},
                                          Layout<Shape<_64, _8>, Stride<_1, _64>>{}));
  using SmemLayoutB = conditional_t<
      kMnB, decltype(tile_to_shape(SmemAtomMn{}, Shape<Int<kBN>, Int<kBK>, Int<kStages>>{})),
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBN>, Int<kBK>, Int<kStages>>{}))>;
  using S2RAtom = Copy_Atom<SM75_U32x4_LDSM_N, T>;
  using S2RAtomB = conditional_t<kMnB, Copy_Atom<SM75_U16x8_LDSM_T, T>, S2RAtom>;

  static constexpr int kSmemBytes =
      int(cosize_v<SmemLayoutA> + cosize_v<SmemLayoutB>) * int(sizeof(T));
  static_assert(kSmemBytes >= int(kBlockSharedBytes),
                "the comm blocks use the fused kernel's dynamic shared memory as their scratch");

  struct Operand {
    const T* ptr;    // first row of the tile (MN-major B: element (k = 0, first column))
    int rows;        // valid rows (others read as zero); MN-major B: valid columns; paired B:
                     //   valid h columns from the tile's origin (F - j0)
    int64_t ld = 0;  // MN-major B only: the stride between k-rows (N); else K
    // Paired B only (the remap, activation_b_row relative to the tile's origin): B rows per
    // half (kBN / 2 gated, kBN plain) and the gate-to-up distance F.
    int half = 0;
    int64_t up = 0;
  };

  // Which row (MN-major: column) of op tile row r reads, and whether it is in range.
  template <bool kPaired>
  static __device__ __forceinline__ int64_t src_row(const Operand& op, int r) {
    if constexpr (kPaired)
      return activation_b_row(r, op.half, op.up, 0);
    else
      return r;
  }
  template <bool kPaired>
  static __device__ __forceinline__ bool row_valid(const Operand& op, int r) {
    if constexpr (kPaired)
      return activation_b_row_valid(r, op.half, op.rows, 0);
    else
      return r < op.rows;
  }

  // Fills stage `stage` of a [R, kBK] operand tile from k-tile `kt` (kPaired: B rows remapped).
  template <int R, bool kPaired = false, class SLayout>
  static __device__ __forceinline__ void load_stage(T* smem, SLayout const& layout,
                                                    const Operand& op, int64_t K, int kt,
                                                    int stage, bool vec) {
    constexpr int kChunksPerRow = kBK / kChunk;
    const int64_t k0 = int64_t(kt) * kBK;
    for (int idx = int(threadIdx.x); idx < R * kChunksPerRow; idx += kThreads) {
      const int r = idx / kChunksPerRow;
      const int c = (idx % kChunksPerRow) * kChunk;
      T* dst = smem + layout(r, c, stage);
      const int64_t gk = k0 + c;
      const bool row_ok = row_valid<kPaired>(op, r);
      if (vec) {
        const bool ok = row_ok && gk < K;
        const T* src = ok ? op.ptr + src_row<kPaired>(op, r) * K + gk : op.ptr;
        const uint32_t s = uint32_t(__cvta_generic_to_shared(dst));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
                     "r"(ok ? 16 : 0));
      } else {
        // Scalar path: any K, any alignment. Each element read only when in range.
        const uint16_t* src =
            reinterpret_cast<const uint16_t*>(op.ptr) + src_row<kPaired>(op, r) * K + gk;
        uint32_t w[kChunk / 2];
#pragma unroll
        for (int e = 0; e < kChunk; e += 2) {
          const uint32_t lo = row_ok && gk + e < K ? src[e] : 0u;
          const uint32_t hi = row_ok && gk + e + 1 < K ? src[e + 1] : 0u;
          w[e / 2] = lo | (hi << 16);
        }
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  // Fills stage `stage` of MN-major B (kBN columns x kBK k) from k-tile `kt`: element (n, k) of
  // the tile at op.ptr[k * op.ld + n]. With vec, op.ld % 8 == 0 and op.ptr is 16-byte aligned, so
  // op.rows (N - col0, or kBN) is a multiple of 8 and each vector is wholly in or out of range.
  // kPaired: columns remapped (a vector of 8 never straddles the two halves, kBN / 2 % 8 == 0;
  // with vec the host also made F a multiple of 8).
  template <bool kPaired = false, class SLayout>
  static __device__ __forceinline__ void load_stage_mn(T* smem, SLayout const& layout,
                                                       const Operand& op, int64_t K, int kt,
                                                       int stage, bool vec) {
    constexpr int kChunksPerRow = kBN / kChunk;
    const int64_t k0 = int64_t(kt) * kBK;
    for (int idx = int(threadIdx.x); idx < kBK * kChunksPerRow; idx += kThreads) {
      const int r = idx / kChunksPerRow;              // k within the k-tile
      const int c = (idx % kChunksPerRow) * kChunk;   // first column of the vector
      T* dst = smem + layout(c, r, stage);
      const int64_t gk = k0 + r;
      const bool k_ok = gk < K;
      // the vector's first column in the tile's half and its source column
      const int cc = kPaired && c >= op.half ? c - op.half : c;
      const int64_t sc = src_row<kPaired>(op, c);
      if (vec) {
        const bool ok = k_ok && row_valid<kPaired>(op, c);
        const T* src = ok ? op.ptr + gk * op.ld + sc : op.ptr;
        const uint32_t s = uint32_t(__cvta_generic_to_shared(dst));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
                     "r"(ok ? 16 : 0));
      } else {
        // Scalar path: any N, any alignment. Each element read only when in range. (Written with
        // one in-range count and no out-of-range row address: the form with a predicate per
        // element (as load_stage) took layer1's kernel from ~150 to 254 registers.)
        const int n_ok = k_ok ? op.rows - cc : 0;  // elements of the vector in range (may be < 0)
        const uint16_t* src =
            reinterpret_cast<const uint16_t*>(op.ptr) + (k_ok ? gk * op.ld + sc : 0);
        uint32_t w[kChunk / 2];
#pragma unroll
        for (int e = 0; e < kChunk; e += 2) {
          const uint32_t lo = e < n_ok ? src[e] : 0u;
          const uint32_t hi = e + 1 < n_ok ? src[e + 1] : 0u;
          w[e / 2] = lo | (hi << 16);
        }
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  template <bool kPaired>
  static __device__ __forceinline__ void load_stage_b(T* smem, const Operand& op, int64_t K,
                                                      int kt, int stage, bool vec) {
    if constexpr (kMnB)
      load_stage_mn<kPaired>(smem, SmemLayoutB{}, op, K, kt, stage, vec);
    else
      load_stage<kBN, kPaired>(smem, SmemLayoutB{}, op, K, kt, stage, vec);
  }

  // The mainloop (kPaired: B through the remap), then epilogue(acc, coord): the accumulator
  // fragment and the tile-local (row, col) of each of its elements. `smem` holds kSmemBytes;
  // `wait`: the wait for the tile's rows, when the caller hands it over (rows_wait.cuh, which
  // also has the plain tile: run_plain_tile).
  template <bool kPaired, class Epilogue, class Wait = NoRowsWait>
  static __device__ __forceinline__ void run_with(char* smem, const Operand& a, const Operand& b,
                                                  int64_t K, bool vec, Epilogue&& epilogue,
                                                  Wait&& wait = Wait{}) {
    T* sa = reinterpret_cast<T*>(smem);
    T* sb = sa + cosize_v<SmemLayoutA>;
    Tensor sA = make_tensor(make_smem_ptr(sa), SmemLayoutA{});  // (BM, BK, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(sb), SmemLayoutB{});  // (BN, BK, PIPE)

    TiledMma mma;
    auto thr_mma = mma.get_slice(threadIdx.x);
    Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, 0));  // (MMA, MMA_M, MMA_K)
    Tensor tCrB = thr_mma.partition_fragment_B(sB(_, _, 0));  // (MMA, MMA_N, MMA_K)
    Tensor acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
    clear(acc);

    auto s2r_a = make_tiled_copy_A(S2RAtom{}, mma);
    auto thr_s2r_a = s2r_a.get_slice(threadIdx.x);
    Tensor tXsA = thr_s2r_a.partition_S(sA);  // (CPY, CPY_M, CPY_K, PIPE)
    Tensor tXrA = thr_s2r_a.retile_D(tCrA);
    auto s2r_b = make_tiled_copy_B(S2RAtomB{}, mma);
    auto thr_s2r_b = s2r_b.get_slice(threadIdx.x);
    Tensor tXsB = thr_s2r_b.partition_S(sB);
    Tensor tXrB = thr_s2r_b.retile_D(tCrB);

    const int k_tiles = int((K + kBK - 1) / kBK);
    constexpr int kBlocks = size<2>(tCrA);

    // Prologue: the first kStages-1 k-tiles in flight; with a wait handed over, B's first
    // (one group), the wait, then A's (a group each: rows_wait.cuh).
    if constexpr (kDefersRows<Wait>) {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s)
        if (s < k_tiles) load_stage_b<kPaired>(sb, b, K, s, s, vec);
      cp_async_fence();
      wait();
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < k_tiles) load_stage<kBM>(sa, SmemLayoutA{}, a, K, s, s, vec);
        cp_async_fence();
      }
    } else {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < k_tiles) {
          load_stage<kBM>(sa, SmemLayoutA{}, a, K, s, s, vec);
          load_stage_b<kPaired>(sb, b, K, s, s, vec);
        }
        cp_async_fence();
      }
    }

    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // stage kt visible to all; stage kt-1 free (everyone finished it)
      const int next = kt + kStages - 1;
      if (next < k_tiles) {
        load_stage<kBM>(sa, SmemLayoutA{}, a, K, next, next % kStages, vec);
        load_stage_b<kPaired>(sb, b, K, next, next % kStages, vec);
      }
      cp_async_fence();
      const int stage = kt % kStages;
#pragma unroll
      for (int kb = 0; kb < kBlocks; ++kb) {
        copy(s2r_a, tXsA(_, _, kb, stage), tXrA(_, _, kb));
        copy(s2r_b, tXsB(_, _, kb, stage), tXrB(_, _, kb));
        gemm(mma, tCrA(_, _, kb), tCrB(_, _, kb), acc);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // shared memory free for the next tile

    Tensor tCcC = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
    epilogue(acc, tCcC);
  }
};

}  // namespace comet::gpu::sm80
