// Fused persistent kernels of the sm_90a path, one per layer and dtype. The comm blocks
// (comet/block_roles.h) run the comm program; every other block is a warp-specialised GEMM block built from CUTLASS 3.x's TMA +
// wgmma collective mainloop (MainloopSm90TmaGmmaWarpSpecialized, cooperative: one producer
// warpgroup, two MMA warpgroups on a 128x128 tile), unchanged. For few rows per expert (tile_m =
// 64, the tuner's small-batch tile) the same mainloop runs a 64x128 tile on one MMA warpgroup
// (the builder's warp-specialised, non-cooperative schedule: its TiledMma is one warpgroup's 64-row
// wgmma), so a tile of 1-64 rows pads at most 63 rows rather than 127, and with more stages in
// flight (8 x 24 KiB) a block keeps more weight bytes on the way. The kernel body around it is
// ours, because the tile scheduler is the engine's:
//
//  - GEMM block g of n_gemm (comet/block_roles.h) walks the engine's tile order
//    (comet/gemm_schedule.h) in every warp role: the producer warp with a ProducerContext, whose
//    wait acquires the m-tile's readiness (layer0) and then issues fence.proxy.async before the TMA
//    loads of A (layer0 issues the weights' loads of the tile's first stages before that wait:
//    weights_first.cuh); the MMA warpgroups with a ConsumerContext (no wait of their own; in layer1 they publish
//    each finished column after a named barrier over both warpgroups, i.e. once every epilogue
//    store of the tile has been issued, with release semantics).
//  - Experts share one TMA descriptor per operand: A is the whole dispatched row range
//    [rows_cap, K]; a tile's TMA coordinates start at its m-tile's first row and at its expert's
//    weights (cute::domain_offset), so tiles need not be aligned to 128 rows and no descriptor is
//    modified on the device. Rows of the tile past the m-tile (the next expert's, or beyond
//    rows_cap: zero-filled by TMA) only feed accumulators the epilogue never stores. B comes in
//    one of two layouts, a compile-time choice (the BMajor tag of GemmConfig / fused_kernel):
//      KMajorB  (the weights' usual layout, K contiguous: w0 [El, N0, H], w1 [El, H, N1]): B is
//               viewed as one [E_local * N, K] matrix, the tile starting at its expert's first
//               weight row; columns past N read the next expert's rows, which only feed
//               accumulators the epilogue never stores; K past the end is zero-filled.
//      MnMajorB (the ops' transposed weights, read in place, N contiguous: w0 [El, H, N0],
//               w1 [El, N1, H]): a rank-3 descriptor (N, K, L = E_local) with strides
//               (1, N, K * N), the tile sliced at its expert through the L mode, so TMA zero-fills
//               both K and N past the expert's own extent (never the next expert's rows, which a
//               2-D [E_local * K, N] view would read in the last k-tile when K % 64 != 0).
//               wgmma reads B MN-major from shared memory (16-bit types only, which is all the
//               path runs); the builder picks the MN-major swizzled smem layout.
//  - The epilogue (epilogue.cuh) stores straight from the accumulators with per-element
//    predication: bf16/fp16 y0 for layer0, fp32 C for layer1 (what comm_layer1.h reads), after
//    adding the tile's expert bias (b0 / b1, optional) in fp32. Not a TMA store: tiles start at
//    arbitrary rows and layer1 publishes each column right after its stores, which plain stores +
//    a named barrier + a release make simple.
//
// FP8 (Fp8GemmConfig; comet/fp8_rows.h): A and B float8_e4m3fn (K-major: FP8 wgmma reads both
// operands K-major from shared memory) with CUTLASS's blockwise-scaled mainloop
// (MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8, 128x128x128 tiles: one A scale per row and one
// B scale per tile for each 128-wide K tile, each k-tile's wgmma results scaled before they are
// added to the fp32 accumulators, in k order). The operand loads are the same TMA producer warp;
// the scales come from a second producer warp (load_scales: cp.async, 32 threads, arriving on the
// same stage barriers), because our tiles start at any row and layer0's scales sit inside the
// packed rows (row stride a_ld), which the mainloop's own tile-aligned scale loader cannot address.
// A is layer0's packed rows in place (values at the row start, row stride fp8_row_bytes(H), a
// multiple of 16) or layer1's h; y0 comes out in bf16 (and b0 / b1 are bf16).
//
// Everything is inside `#if __CUDA_ARCH_FEAT_SM90_ALL`: built for sm_80 this translation unit
// holds empty kernels, never launched there.
#pragma once

#define COMET_DEVICE_PRINTF 0  // no function calls in a wgmma kernel (see gpu_context.cuh)

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "comet/fp8_rows.h"
#include "comet/gemm_schedule.h"
#include "comm_blocks.cuh"
#include "launch.h"
#include "epilogue.cuh"
#include "weights_first.cuh"

namespace comet::gpu::sm90 {

using namespace cute;

// B's layout in global memory (CUTLASS's B is [N, K] in GEMM terms: ColumnMajor = K contiguous,
// RowMajor = N contiguous).
struct KMajorB {  // B stored [N, K] per expert: the weights' usual layout
  using Layout = cutlass::layout::ColumnMajor;
  static constexpr bool kMn = false;
};
struct MnMajorB {  // B stored [K, N] per expert: the transposed weights, read in place
  using Layout = cutlass::layout::RowMajor;
  static constexpr bool kMn = true;
};

// The kernel schedule of a tile of kM rows: two MMA warpgroups on 128 rows, one on 64 (its
// TiledMma is a single warpgroup's 64 x N wgmma; we run no ping-pong, only its mainloop).
template <int kM, class Cooperative, class OneGroup>
using ScheduleFor = cute::conditional_t<kM == 128, Cooperative, OneGroup>;
template <int kM>
inline constexpr int kMmaGroups = kM / 64;

template <class T, class BMajor = KMajorB, int kM = 128>
struct GemmConfig {
  static_assert(kM == 64 || kM == 128, "the tile's rows: 128 (two MMA warpgroups) or 64 (one)");
  using Element = T;
  using Out0 = T;  // y0's element (and the biases')
  static constexpr bool kBlockScaled = false;
  using TileShape = Shape<Int<kM>, _128, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  // 5 x 32 KiB of operands (128 rows), 8 x 24 KiB (64 rows: more weight k-tiles in flight)
  static constexpr int kStages = kM == 128 ? 5 : 8;
  static constexpr int kAlign = 8;   // elements per 16 bytes: TMA needs 16-byte row strides
  static constexpr bool kBMn = BMajor::kMn;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, kAlign,
      T, typename BMajor::Layout, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCount<kStages>,
      ScheduleFor<kM, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                  cutlass::gemm::KernelTmaWarpSpecializedPingpong>>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using Pipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using Params = typename Mainloop::Params;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };

  static constexpr int kMmaThreads = 128 * kMmaGroups<kM>;
  static constexpr int kThreads = 128 + kMmaThreads;  // producer warpgroup + the MMA warpgroups
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes >= int(kBlockSharedBytes),
                "the comm blocks use the fused kernel's dynamic shared memory as their scratch");
  static_assert(kSmemBytes <= 227 * 1024, "an sm_90 block has at most 227 KiB of shared memory");
  static constexpr int kTileM = kM, kTileN = 128, kTileK = 64;
  static constexpr uint32_t kLoadRegisters = 40;
  static constexpr uint32_t kMmaRegisters = 232;
  // The fused activation's instantiation (PairedB): its TMA warp also keeps the two boxes' rows,
  // and its epilogue the activation's math. Measured with ptxas (sm_90a): 40 / 232 spills (128
  // rows: a row in the producer), and in the 64-row kernel 56 / 232 and 56 / 240 still do (a
  // kernel-long pointer kept in local memory through the producer's code); 128 rows 48 / 224
  // (128 x 48 + 256 x 224 = 63488 of the 65536 registers) and 64 rows 72 / 240 (one MMA
  // warpgroup: 128 x 72 + 128 x 240) do not.
  static constexpr uint32_t kActLoadRegisters = kM == 128 ? 48 : 72;
  static constexpr uint32_t kActMmaRegisters = kM == 128 ? 224 : 240;
  static_assert(128 * kActLoadRegisters + kMmaThreads * kActMmaRegisters <= 65536);
  static constexpr int kConsumerBarrier = 1;  // named barrier of the MMA warpgroups

  // TMA descriptors, built on the host: A [a_rows, K] (K contiguous) and B, the `experts`
  // experts' weights of n output columns each:
  //  - KMajorB: one [experts * n, K] matrix (K contiguous);
  //  - MnMajorB: (n, K, experts) with strides (1, n, K * n). The mainloop builds both descriptors
  //    from one problem shape (M, N, K, L), A's as (M, K, L) and B's as (N, K, L); A needs L = 1
  //    and B L = experts, so the descriptors come from two calls with the same arguments and B's
  //    is taken from the second (the same smem layout, box and TMA type: only the extents
  //    differ; the second call's A descriptor is discarded).
  static typename Mainloop::StrideB b_stride(int64_t n, int64_t k, int64_t experts) {
    if constexpr (!kBMn)
      return make_stride(int64_t(k), Int<1>{}, int64_t(experts * n * k));
    else
      return make_stride(Int<1>{}, int64_t(n), int64_t(k * n));
  }
  // B's (N, K, L) extents as the B descriptor sees them (the L of the second call for MnMajorB).
  static auto b_shape(int64_t n, int64_t k, int64_t experts) {
    return kBMn ? make_shape(int(n), int(k), int(experts)) : make_shape(int(experts * n), int(k), 1);
  }
  static Params make_params(const void* a, int64_t a_rows, int64_t a_ld, const void* b, int64_t n,
                            int64_t k, int64_t experts) {
    using StrideA = typename Mainloop::StrideA;
    using StrideB = typename Mainloop::StrideB;
    const StrideA da = make_stride(int64_t(a_ld), Int<1>{}, int64_t(a_rows * a_ld));
    const StrideB db = b_stride(n, k, experts);
    if constexpr (!kBMn) {
      const int64_t b_rows = experts * n;
      const typename Mainloop::Arguments args{static_cast<const T*>(a), da,
                                              static_cast<const T*>(b), db};
      return Mainloop::to_underlying_arguments(make_shape(int(a_rows), int(b_rows), int(k), 1),
                                               args, nullptr);
    } else {
      const typename Mainloop::Arguments args{static_cast<const T*>(a), da,
                                              static_cast<const T*>(b), db};
      Params mp = Mainloop::to_underlying_arguments(
          make_shape(int(a_rows), int(n), int(k), 1), args, nullptr);
      mp.tma_load_b = Mainloop::to_underlying_arguments(
                          make_shape(int(a_rows), int(n), int(k), int(experts)), args, nullptr)
                          .tma_load_b;
      return mp;
    }
  }
};

// FP8 e4m3 A and B (K-major) with block scales: A 1 x 128 (one per row and k-tile), B 128 x 128
// (one per tile and k-tile). The scale layouts given to the builder only fix the granularity and
// that the scales are K-major (so the mainloop loads none by TMA): load_scales fills the stages.
// kM: the tile's rows, 128 (two MMA warpgroups) or 64 (one, as GemmConfig's).
template <int kM = 128>
struct Fp8GemmConfig {
  static_assert(kM == 64 || kM == 128, "the tile's rows: 128 (two MMA warpgroups) or 64 (one)");
  using T = cutlass::float_e4m3_t;
  using Element = T;
  using Out0 = cutlass::bfloat16_t;
  static constexpr bool kBlockScaled = true;
  using TileShape = Shape<Int<kM>, _128, _128>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlign = 16;  // elements per 16 bytes
  static constexpr bool kBMn = false;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T,
      cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, kAlign, T,
      cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, kAlign, float, TileShape, ClusterShape,
      // as many stages of (32 KiB of operands + 516 B of scales) as shared memory holds (the
      // builder's blockwise path takes no fixed count); the epilogue uses no shared memory
      cutlass::gemm::collective::StageCountAutoCarveout<0>,
      ScheduleFor<kM, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
                  cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise>>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using Pipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using Params = typename Mainloop::Params;
  static_assert(!Mainloop::IsTmaLoadSFA && !Mainloop::IsTmaLoadSFB &&
                    Mainloop::NumProducerThreadEvents == 33,
                "scales come from load_scales' 32 threads, operands from one TMA thread");
  static_assert(Mainloop::ScaleMsPerTile == kM && Mainloop::ScaleNsPerTile == 1);
  static constexpr int kStages = Mainloop::DispatchPolicy::Stages;
  static_assert(kStages >= 4, "enough k-tiles in flight to hide TMA latency");

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };

  static constexpr int kMmaThreads = 128 * kMmaGroups<kM>;
  static constexpr int kThreads = 128 + kMmaThreads;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes >= int(kBlockSharedBytes),
                "the comm blocks use the fused kernel's dynamic shared memory as their scratch");
  static_assert(kSmemBytes <= 227 * 1024, "an sm_90 block has at most 227 KiB of shared memory");
  static constexpr int kTileM = kM, kTileN = 128, kTileK = 128;
  // Measured with ptxas (sm_90a): the scale warp (its tile walk, waits and cp.async addresses)
  // spills at 40 and 48 registers, and layer1 still spills with 48 / 232; 56 / 224 spills in
  // neither layer (128 x 56 + 256 x 224 = 64512 of the 65536 registers).
  static constexpr uint32_t kLoadRegisters = 56;
  static constexpr uint32_t kMmaRegisters = 224;
  static constexpr int kConsumerBarrier = 1;

  // A [a_rows, K] with row stride a_ld bytes; B one [experts * n, K] matrix (K contiguous).
  static typename Mainloop::StrideB b_stride(int64_t n, int64_t k, int64_t experts) {
    return make_stride(int64_t(k), Int<1>{}, int64_t(experts * n * k));
  }
  static auto b_shape(int64_t n, int64_t k, int64_t experts) {
    return make_shape(int(experts * n), int(k), 1);
  }
  static Params make_params(const void* a, int64_t a_rows, int64_t a_ld, const void* b, int64_t n,
                            int64_t k, int64_t experts) {
    const int64_t b_rows = experts * n;
    const typename Mainloop::StrideA da = make_stride(int64_t(a_ld), Int<1>{}, int64_t(a_rows * a_ld));
    const typename Mainloop::StrideB db = b_stride(n, k, experts);
    const typename Mainloop::Arguments args{static_cast<const T*>(a), da,
                                            static_cast<const T*>(b), db,
                                            nullptr, LayoutSFA{}, nullptr, LayoutSFB{}};
    return Mainloop::to_underlying_arguments(make_shape(int(a_rows), int(b_rows), int(k), 1), args,
                                             nullptr);
  }
};

// The fused activation's B loads (layer0's activation=, comet/activation.h): a gated tile of h's
// columns [j0, j0 + 64) runs a 128-column GEMM tile whose B rows 0..63 are w0's gate rows
// [j0, j0 + 64) and rows 64..127 its up rows [F + j0, F + j0 + 64) (activation_b_row; plain forms:
// rows j0 + i, the remap the identity). The mainloop's descriptor boxes the whole 128-row tile, so
// the fused kernels carry a second descriptor over the same weights whose box is half of it, built
// with the first half of a stage's own (swizzled) smem layout; each stage then takes two boxes,
// one per half, on the stage's barrier, armed as before with the whole stage's bytes (A's and both
// halves of B's). The mainloop itself is unchanged: it reads the stage as it always does.
template <class C>
struct PairedB {
  using Mainloop = typename C::Mainloop;
  static constexpr int kHalf = C::kTileN / 2;
  using HalfShape = Shape<Int<kHalf>, Int<C::kTileK>>;
  using StageLayout = decltype(typename Mainloop::SmemLayoutB{}(_, _, Int<0>{}));
  using HalfLayout = decltype(composition(StageLayout{}, HalfShape{}));
  // Each half must be one box's destination: a dense block (the TMA box writes one), 1 KiB
  // aligned (the 128-byte swizzle repeats every 1 KiB, so the second half, one box further, sees
  // the same pattern as the first). The builder tiles the swizzle atoms N-first for K-major B and
  // K-first for MN-major B, so both halves are dense in either layout.
  static_assert(cute::cosize(HalfLayout{}.layout_b()) == kHalf * C::kTileK,
                "a half of a stage's B tile is one dense block of shared memory");
  static_assert(StageLayout{}.layout_b()(kHalf, 0) == kHalf * C::kTileK &&
                    (kHalf * C::kTileK * int(sizeof(typename C::Element))) % 1024 == 0,
                "the second half follows the first, at a multiple of the swizzle's 1 KiB");
  using TmaElement = cute::uint_bit_t<cute::sizeof_bits_v<typename C::Element>>;
  using GTensor = decltype(make_tensor(static_cast<const TmaElement*>(nullptr),
                                       repeat_like(typename Mainloop::StrideB{}, int32_t(0)),
                                       typename Mainloop::StrideB{}));
  using Tiler = Shape<Int<C::kTileM>, Int<kHalf>, Int<C::kTileK>>;
  using Tma = decltype(make_tma_copy_B_sm90(typename Mainloop::GmemTiledCopyB{},
                                            std::declval<GTensor>(), HalfLayout{}, Tiler{},
                                            typename C::ClusterShape{}));
  static Tma make(const GTensor& g) {
    return make_tma_copy_B_sm90(typename Mainloop::GmemTiledCopyB{}, g, HalfLayout{}, Tiler{},
                                typename C::ClusterShape{});
  }
};

// The fused kernels' parameters: the mainloop's, and the half-tile B descriptor.
template <class C>
struct ActParams {
  typename C::Params main;
  typename PairedB<C>::Tma b_half;
};
template <class C, bool kAct>
using KernelParams = cute::conditional_t<kAct, ActParams<C>, typename C::Params>;

// The register split of the producer and MMA warpgroups (setmaxnreg): the fused instantiation's
// own (GemmConfig's kAct*Registers; the FP8 configs have no fused instantiation).
template <class C, bool kAct>
struct Registers {
  static constexpr uint32_t kLoad = C::kLoadRegisters, kMma = C::kMmaRegisters;
};
template <class C>
struct Registers<C, true> {
  static constexpr uint32_t kLoad = C::kActLoadRegisters, kMma = C::kActMmaRegisters;
};

template <class P>
__host__ __device__ __forceinline__ const P& main_params(const P& mp) {
  return mp;
}
template <class C>
__host__ __device__ __forceinline__ const typename C::Params& main_params(const ActParams<C>& ap) {
  return ap.main;
}

// B as make_params gave it to the mainloop ((N, K, L) extents and strides), under the half box.
template <class C>
ActParams<C> make_act_params(const typename C::Params& mp, const void* b, int64_t n, int64_t k,
                             int64_t experts) {
  using PB = PairedB<C>;
  const auto g = make_tensor(static_cast<const typename PB::TmaElement*>(b),
                             make_layout(C::b_shape(n, k, experts), C::b_stride(n, k, experts)));
  return ActParams<C>{mp, PB::make(g)};
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Both halves' boxes of a stage, gate half first (weights_first.cuh's BoxLoads each).
template <class Half>
struct PairLoads {
  Half gate, up;
  template <class Barrier>
  __device__ __forceinline__ void operator()(Barrier* bar, int k, int stage) const {
    gate(bar, k, stage);
    up(bar, k, stage);
  }
};

// B's loads of a fused-activation tile: two boxes per stage, B rows [0, 64) of the tile from w0
// row `gate_row` on and rows [64, 128) from `up_row` on (rows of the [El * N0, K] view's expert, or
// columns of MnMajorB's, as whole_b_loads' tile origin). mB: the half descriptor's TMA tensor.
template <class C, class Tma, class Storage, class TensorB>
__device__ __forceinline__ auto paired_b_loads(const Tma& tma, Storage& st, const TensorB& mB,
                                               int64_t gate_row, int64_t up_row, int32_t expert,
                                               int64_t n) {
  using Half = typename PairedB<C>::HalfShape;
  Tensor sB = make_tensor(make_smem_ptr(st.smem_B.data()), typename C::Mainloop::SmemLayoutB{});
  Tensor sH = flat_divide(sB, Half{});  // (HALF, BLK_K, 2, 1, PIPE)
  auto thr = tma.get_slice(0);
  auto box = [&](int64_t row) {
    const auto origin = C::kBMn ? make_coord(int(row), 0, int(expert))
                                : make_coord(int(int64_t(expert) * n + row), 0, 0);
    // (HALF, BLK_K, k): the half tile's k-tiles
    return thr.partition_S(local_tile(domain_offset(origin, mB), Half{}, make_coord(0, _))(
        _, _, _, 0));
  };
  // (TMA, TMA_N, TMA_K, PIPE): the stage's two halves
  return PairLoads<decltype(box_loads(tma, box(gate_row), thr.partition_D(sH(_, _, 0, 0, _))))>{
      box_loads(tma, box(gate_row), thr.partition_D(sH(_, _, 0, 0, _))),
      box_loads(tma, box(up_row), thr.partition_D(sH(_, _, 1, 0, _)))};
}

// The FP8 mainloop's scale producer (warp 1 of the producer warpgroup): for each k-tile of the
// tile, the A scales of its 128 rows (rows past the m-tile read as 0: they feed accumulators the
// epilogue never stores) and the tile's B scale, copied with cp.async into the stage the TMA warp
// fills, arriving on that stage's barrier when they land (32 arrivals of the 33 it expects).
// a_scale: the m-tile's first row's scales (row r, k-tile kt at a_scale[r * a_ld + kt]);
// b_scale: the tile's column block's scales (k-tile kt at b_scale[kt]).
template <class C>
__device__ __forceinline__ void load_scales(typename C::Pipeline& pipeline,
                                            typename C::PipelineState& state,
                                            typename C::SharedStorage& ss, const float* a_scale,
                                            int64_t a_ld, int32_t rows, const float* b_scale,
                                            int k_tiles) {
  using Mainloop = typename C::Mainloop;
  const auto sfa = typename Mainloop::SmemLayoutSFA{};
  const auto sfb = typename Mainloop::SmemLayoutSFB{};
  float* smem_sfa = ss.tensors.smem_SFA.data();
  float* smem_sfb = ss.tensors.smem_SFB.data();
  const int lane = int(threadIdx.x % 32);
  for (int kt = 0; kt < k_tiles; ++kt) {
    pipeline.producer_acquire(state);
    const int stage = int(state.index());
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Mainloop::ScaleMsPerTile / 32; ++i) {
      const int r = lane + 32 * i;
      const bool in = r < rows;
      const float* src = in ? a_scale + int64_t(r) * a_ld + kt : a_scale;
      const float* dst = smem_sfa + sfa(make_coord(make_coord(0, r), make_coord(0, 0), stage));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                       uint32_t(__cvta_generic_to_shared(dst))),
                   "l"(src), "r"(in ? 4 : 0));
    }
    if (lane == 0) {
      const float* dst = smem_sfb + sfb(make_coord(make_coord(0, 0), make_coord(0, 0), stage));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                       uint32_t(__cvta_generic_to_shared(dst))),
                   "l"(b_scale + kt));
    }
    pipeline.producer_commit(state, cutlass::arch::cpasync_barrier_arrive_noinc);
    ++state;
  }
}

// The tile walk of a producer warp (the TMA loads; with FP8 also the scales): layer0 after each
// m-tile's readiness, layer1 in the MMA warpgroups' order (layer1_gemm: the same bands, the same
// tiles; the producers publish nothing).
template <int kLayer, class Fn>
__device__ __forceinline__ void producer_walk(const CallParams& p, const WaitConfig& wc, int32_t g,
                                              int32_t ng, const GemmScheduleArgs& ga, Fn&& fn) {
  if constexpr (kLayer == 0) {
    ProducerContext ctx(wc);
    layer0_gemm(ctx, g, ng, ga, fn);
  } else {
    const int64_t tiles = ga.num_mtiles * ga.num_ntiles;
    for (int64_t i = g; i < tiles; i += ng) {
      const TileCoord tc = schedule_tile(1, i, ga, ng);
      fn(p.mtiles[tc.mtile], tc.ntile);
    }
  }
}

// kAct (layer0): the fused activation's instantiation (kp: ActParams<C>; see PairedB): B through
// the remap, the epilogue store_activation_tile. The plain kernel (kAct false) is unchanged.
// Force-inlined: the fused kernel calls it directly (its body too large for the compiler to
// inline it otherwise, and a kernel with wgmma must contain no real call: gpu_context.cuh); the
// plain kernel through gemm_block below, as it always did.
template <class C, int kLayer, bool kAct>
__device__ __forceinline__ void gemm_block_body(const CallParams& p,
                                                const KernelParams<C, kAct>& kp, char* smem,
                                                uint64_t epoch) {
  static_assert(!kAct || kLayer == 0, "the activation is fused into layer0 only");
  const typename C::Params& mp = main_params(kp);
  using T = typename C::Element;
  using Mainloop = typename C::Mainloop;
  using Pipeline = typename C::Pipeline;
  using PipelineState = typename C::PipelineState;
  using X = Underscore;
  auto& ss = *reinterpret_cast<typename C::SharedStorage*>(smem);

  const int32_t g = gemm_block_index<kLayer>(p);
  const int32_t ng = int32_t(gridDim.x) - p.n_comm;
  const int warp_group = int(threadIdx.x) / 128;
  const int warp_in_group = (int(threadIdx.x) / 32) % 4;
  const WaitConfig wc = wait_config(p);

  // Operand geometry: layer0 A = a [rows_cap, H], B = w0 [El*N0, H] (MN-major: [El, H, N0]),
  // out y0 [., N0]; layer1 A = h [h_rows, N1], B = w1 [El*H, N1] (MN-major: [El, N1, H]),
  // out C [., H] (fp32).
  const int64_t K = kLayer == 0 ? p.hidden : p.cols;
  const int64_t n_out = kLayer == 0 ? p.cols : p.hidden;
  const int64_t a_rows = kLayer == 0 ? p.rows_cap : p.h_rows;
  const int64_t b_rows = int64_t(p.experts_local) * n_out;
  const int k_tiles = int((K + C::kTileK - 1) / C::kTileK);

  const GemmScheduleArgs ga =
      kLayer == 0 ? layer0_schedule_args(p, epoch) : layer1_schedule_args(p, epoch);

  // Producers: the TMA warp (warp 0), and with block scales the scale warp (warp 1, load_scales).
  constexpr bool kScaled = C::kBlockScaled;
  typename Pipeline::Params pp;
  if (warp_group == 0)
    pp.role = warp_in_group == 0 || (kScaled && warp_in_group == 1)
                  ? Pipeline::ThreadCategory::Producer
                  : Pipeline::ThreadCategory::NonParticipant;
  else
    pp.role = Pipeline::ThreadCategory::Consumer;
  pp.is_leader = int(threadIdx.x) % 128 == 0;
  pp.num_consumers = C::kMmaThreads;
  if constexpr (kScaled) pp.num_producers = Mainloop::NumProducerThreadEvents;
  pp.transaction_bytes = mp.tma_transaction_bytes;
  Pipeline pipeline(ss.pipeline, pp, typename C::ClusterShape{});
  __syncthreads();  // barrier initialisation visible to every warp

  Mainloop collective;
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Registers<C, kAct>::kLoad>();
    if constexpr (kScaled) {
      if (warp_in_group == 1) {
        // The scales of the same tiles in the same order (and, layer0, after the same waits: the
        // scales of a dispatched row travel inside it).
        PipelineState state = cutlass::make_producer_start_state<Pipeline>();
        // The weights' 128 x 128 block scales: [El, scale_blocks(n_out), scale_blocks(K)]; a
        // k-tile is one K block and an n-tile one N block (Fp8GemmConfig's tile = kScaleBlock).
        static_assert(C::kTileK == kScaleBlock && C::kTileN == kScaleBlock);
        const int64_t k_blocks = scale_blocks(K), n_blocks = scale_blocks(n_out);
        producer_walk<kLayer>(p, wc, g, ng, ga, [&](const MTile& mt, int32_t nt) {
          load_scales<C>(pipeline, state, ss, p.a_scale + mt.row_begin * p.a_scale_ld,
                         p.a_scale_ld, mt.rows,
                         p.w_scale + (int64_t(mt.expert) * n_blocks + nt) * k_blocks, k_tiles);
        });
        return;
      }
    }
    if (warp_in_group != 0) return;
    // Producer warp: TMA loads in the engine's tile order.
    PipelineState state = cutlass::make_producer_start_state<Pipeline>();
    Tensor mA = mp.tma_load_a.get_tma_tensor(make_shape(int(a_rows), int(K), 1));
    // B's coordinates (n, k, l): KMajorB over [El*N, K] (l = 0, the expert in n), MnMajorB over
    // (N, K, El) (the expert in l: TMA's bounds are the expert's own N and K).
    Tensor mB = mp.tma_load_b.get_tma_tensor(
        C::kBMn ? make_shape(int(n_out), int(K), int(p.experts_local))
                : make_shape(int(b_rows), int(K), 1));
    // The tile's views of A and B: (BLK, BLK_K, m/n, k, l), as CUTLASS's load takes them.
    auto tile_views = [&](const MTile& mt, int32_t nt) {
      const int n0 = int(int64_t(nt) * C::kTileN);
      const auto b_origin = C::kBMn ? make_coord(n0, 0, int(mt.expert))
                                    : make_coord(int(int64_t(mt.expert) * n_out + n0), 0, 0);
      Tensor gA = local_tile(domain_offset(make_coord(int(mt.row_begin), 0, 0), mA),
                             typename C::TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});
      Tensor gB = local_tile(domain_offset(b_origin, mB), typename C::TileShape{},
                             make_coord(_, _, _), Step<X, _1, _1>{});
      return cute::make_tuple(gA, gB);
    };
    if constexpr (kLayer == 0) {
      // Weights before rows (weights_first.cuh): a tile's first stages of B are loaded before
      // the wait for its rows, which layer0_gemm_deferred hands to the load.
      ProducerContext ctx(wc);
      if constexpr (kAct) {
        // Force-inlined (the kernel must contain no real call: gpu_context.cuh); the plain
        // kernel's lambda below is left to the compiler, as it always was.
        layer0_gemm_deferred(
            ctx, g, ng, ga, [&](const MTile& mt, int32_t nt, auto&& wait) COMET_LAMBDA_INLINE {
              auto [gA, gB] = tile_views(mt, nt);
              // h's n-tile nt: columns [j0, j0 + half); its B rows from activation_b_row.
              const Activation act = Activation(p.activation);
              const int64_t F = activation_cols(act, n_out);
              const int64_t half = activation_gated(act) ? C::kTileN / 2 : C::kTileN;
              const int64_t j0 = int64_t(nt) * half;
              constexpr int kBox = PairedB<C>::kHalf;  // B rows per box
              Tensor mBh = kp.b_half.get_tma_tensor(
                  C::kBMn ? make_shape(int(n_out), int(K), int(p.experts_local))
                          : make_shape(int(b_rows), int(K), 1));
              load_weights_first<typename C::Mainloop>(
                  mp, pipeline, state, ss.tensors, gA(_, _, 0, _, 0),
                  paired_b_loads<C>(kp.b_half, ss.tensors, mBh, activation_b_row(0, half, F, j0),
                                    activation_b_row(kBox, half, F, j0), mt.expert, n_out),
                  k_tiles, wait);
              state.advance(k_tiles);
            });
      } else {
        layer0_gemm_deferred(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt, auto&& wait) {
          auto [gA, gB] = tile_views(mt, nt);
          load_weights_first<typename C::Mainloop>(
              mp, pipeline, state, ss.tensors, gA(_, _, 0, _, 0),
              whole_b_loads<typename C::Mainloop>(mp, ss.tensors, gB(_, _, 0, _, 0)), k_tiles,
              wait);
          state.advance(k_tiles);
        });
      }
    } else {
      auto load_tile = [&](const MTile& mt, int32_t nt) {
        auto [gA, gB] = tile_views(mt, nt);
        auto k_iter = make_coord_iterator(shape<3>(gA));
        if constexpr (kScaled) {
          // The scale tensors of the tuple are only read by a TMA scale load, which this
          // configuration has none of (load_scales fills them).
          const Tensor sf = make_tensor(make_gmem_ptr(static_cast<const float*>(nullptr)),
                                        typename C::LayoutSFA{});
          const Tensor sfb = make_tensor(make_gmem_ptr(static_cast<const float*>(nullptr)),
                                         typename C::LayoutSFB{});
          collective.load(mp, pipeline, state, cute::make_tuple(gA, gB, sf, sfb),
                          make_coord(0, 0, _, 0), k_iter, k_tiles, int(threadIdx.x) % 32, 0u,
                          ss.tensors);
        } else {
          collective.load(mp, pipeline, state, cute::make_tuple(gA, gB), make_coord(0, 0, _, 0),
                          k_iter, k_tiles, int(threadIdx.x) % 32, 0u, ss.tensors);
        }
        state.advance(k_tiles);
      };
      producer_walk<kLayer>(p, wc, g, ng, ga, load_tile);
    }
    collective.load_tail(pipeline, state);
    return;
  }

  // MMA warpgroups: mainloop, then a predicated epilogue straight from the accumulators.
  cutlass::arch::warpgroup_reg_alloc<Registers<C, kAct>::kMma>();
  const int mma_thread = int(threadIdx.x) - 128;
  PipelineState state;
  typename C::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(mma_thread);
  Tensor tCcC = thr_mma.partition_C(make_identity_tensor(take<0, 2>(typename C::TileShape{})));
  ConsumerContext ctx(128, C::kMmaThreads, C::kConsumerBarrier);

  auto compute_tile = [&](const MTile& mt, int32_t nt, auto* out) {
    Tensor acc = partition_fragment_C(tiled_mma, take<0, 2>(typename C::TileShape{}));
    // The blockwise mainloop adds each scaled k-tile into acc (acc += partial * scale) and never
    // zeroes it; the 16-bit mainloop's first wgmma overwrites it.
    if constexpr (kScaled) clear(acc);
    collective.mma(pipeline, state, acc, k_tiles, mma_thread, ss.tensors, mp);
    collective.mma_tail(pipeline, state, k_tiles);
    state.advance(k_tiles);
    // Expert bias [El, n_out] (or null): layer0's b0 into y0 before rounding, layer1's b1 into C
    // (fp32) before the comm blocks' top-k weighting.
    using Bias = typename C::Out0;  // the 16-bit kernels' T; bf16 with FP8 operands
    const Bias* bias = static_cast<const Bias*>(kLayer == 0 ? p.b0 : p.b1);
    const int64_t col0 = int64_t(nt) * C::kTileN;
    const int cols = int(n_out - col0 < C::kTileN ? n_out - col0 : C::kTileN);
    store_tile(acc, tCcC, mt.rows, cols, out + mt.row_begin * n_out + col0, n_out,
               bias != nullptr ? bias + int64_t(mt.expert) * n_out + col0 : nullptr);
  };
  // The fused activation's tile (kAct: h's n-tile nt, as the producer's): gate column c of the
  // accumulator pairs with up column c + 64 in the same thread (fragment_halves_pair:
  // tools/check_ptxas.py checks it for these TiledMmas); h [rows_cap, F] is y0's storage.
  // Force-inlined, as the walk's lambda below: a kernel with wgmma must contain no real call
  // (gpu_context.cuh), and the activation's epilogue makes the body large enough for the compiler
  // to keep it out of line otherwise.
  // Its mainloop is compute_tile's, written out again so that the plain kernel's code stays as it
  // was.
  auto act_tile = [&](const MTile& mt, int32_t nt, auto* out) COMET_LAMBDA_INLINE {
    Tensor acc = partition_fragment_C(tiled_mma, take<0, 2>(typename C::TileShape{}));
    if constexpr (kScaled) clear(acc);
    collective.mma(pipeline, state, acc, k_tiles, mma_thread, ss.tensors, mp);
    collective.mma_tail(pipeline, state, k_tiles);
    state.advance(k_tiles);
    using Bias = typename C::Out0;
    const Bias* bias = static_cast<const Bias*>(p.b0);
    const Activation act = Activation(p.activation);
    const int64_t F = activation_cols(act, n_out);
    const int64_t half = activation_gated(act) ? C::kTileN / 2 : C::kTileN;
    const int64_t j0 = int64_t(nt) * half;
    const int cols = int(F - j0 < half ? F - j0 : half);
    store_activation_tile(acc, tCcC, mt.rows, cols, out + mt.row_begin * F + j0, F,
                          bias != nullptr ? bias + int64_t(mt.expert) * n_out + j0 : nullptr,
                          act);
  };
  if constexpr (kLayer == 0) {
    auto* y0 = static_cast<typename C::Out0*>(p.y0);
    if constexpr (kAct)
      layer0_gemm(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt) COMET_LAMBDA_INLINE {
        act_tile(mt, nt, y0);
      });
    else
      layer0_gemm(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt) { compute_tile(mt, nt, y0); });
  } else {
    float* c = p.c;
    layer1_gemm(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt) { compute_tile(mt, nt, c); });
  }
}

template <class C, int kLayer>
__device__ void gemm_block(const CallParams& p, const typename C::Params& mp, char* smem,
                           uint64_t epoch) {
  gemm_block_body<C, kLayer, false>(p, mp, smem, epoch);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <class C, int kLayer, bool kAct = false>
__global__ void __launch_bounds__(C::kThreads, 1)
    fused_kernel(const __grid_constant__ CallParams p,
                 const __grid_constant__ KernelParams<C, kAct> mp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) char smem[];
  const uint64_t epoch = p.state->epoch;  // set by this call's begin kernel
  const KernelClock clock(p.state);
  if (ran_comm_block<kLayer>(p, epoch, smem)) return;
  if (p.state->status != int32_t(CallStatus::Ok)) return;
  if (p.mode == int32_t(BenchMode::CommOnly)) {
    // Comm-only timing: no MMA; layer1's columns are still published so the comm side runs.
    if constexpr (kLayer == 1) {
      BlockGemmContext ctx(wait_config(p));
      const GemmScheduleArgs ga = layer1_schedule_args(p, epoch);
      layer1_gemm(ctx, gemm_block_index<kLayer>(p), int32_t(gridDim.x) - p.n_comm, ga,
                  [](const MTile&, int32_t) {});
    }
    return;
  }
  if constexpr (kAct)
    gemm_block_body<C, kLayer, true>(p, mp, smem, epoch);
  else
    gemm_block<C, kLayer>(p, mp, smem, epoch);
#endif
}

template <class C, int kLayer, bool kAct = false>
FusedKernelInfo info() {
  auto* k = &fused_kernel<C, kLayer, kAct>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  return FusedKernelInfo{reinterpret_cast<const void*>(k), C::kThreads, C::kSmemBytes};
}

// B: p.w0 / p.w1 in BMajor's layout (MnMajorB: the ops' transposed weights as given; the caller
// checked N % 8 == 0 and 16-byte alignment, TMA's conditions on B's strides and base).
// FP8 (Fp8GemmConfig): A's row stride is p.a_ld (layer0's packed rows are longer than H).
// kAct: layer0's fused activation (its own instantiation, with the half-tile B descriptor).
template <class C, int kLayer, bool kAct = false>
void launch(const CallParams& p, int grid, cudaStream_t stream) {
  const int64_t K = kLayer == 0 ? p.hidden : p.cols;
  const int64_t n_out = kLayer == 0 ? p.cols : p.hidden;
  const void* a = kLayer == 0 ? static_cast<const void*>(p.a) : p.h;
  // FP8: at least one row (a call without rows still runs this kernel; the host gives A a row).
  const int64_t a_rows = std::max<int64_t>(kLayer == 0 ? p.rows_cap : p.h_rows,
                                           C::kBlockScaled ? 1 : 0);
  const int64_t a_ld = C::kBlockScaled ? p.a_ld : K;
  const void* b = kLayer == 0 ? p.w0 : p.w1;
  const typename C::Params mp = C::make_params(a, a_rows, a_ld, b, n_out, K, p.experts_local);
  info<C, kLayer, kAct>();
  if constexpr (kAct)
    fused_kernel<C, kLayer, true><<<grid, C::kThreads, C::kSmemBytes, stream>>>(
        p, make_act_params<C>(mp, b, n_out, K, p.experts_local));
  else
    fused_kernel<C, kLayer><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, mp);
}

// What the fused_sm90_layer*.cu entry points instantiate: the kernel for B's layout and the
// call's tile rows (p.tile_m: 128, or 64 for few rows per expert; Checker::launch admits no
// other). act (layer0 only): the fused activation's instantiation (p.activation).
template <class T, int kLayer, int kM>
FusedKernelInfo info_rows(bool b_mn_major, bool act) {
  if constexpr (kLayer == 0)
    if (act)
      return b_mn_major ? info<GemmConfig<T, MnMajorB, kM>, 0, true>()
                        : info<GemmConfig<T, KMajorB, kM>, 0, true>();
  return b_mn_major ? info<GemmConfig<T, MnMajorB, kM>, kLayer>()
                    : info<GemmConfig<T, KMajorB, kM>, kLayer>();
}
template <class T, int kLayer>
FusedKernelInfo info(bool b_mn_major, int tile_m, bool act = false) {
  return tile_m == 64 ? info_rows<T, kLayer, 64>(b_mn_major, act)
                      : info_rows<T, kLayer, 128>(b_mn_major, act);
}

template <class T, int kLayer, int kM>
void launch_rows(const CallParams& p, bool b_mn_major, int grid, cudaStream_t stream) {
  if constexpr (kLayer == 0) {
    if (p.activation != int32_t(Activation::None)) {
      if (b_mn_major)
        launch<GemmConfig<T, MnMajorB, kM>, 0, true>(p, grid, stream);
      else
        launch<GemmConfig<T, KMajorB, kM>, 0, true>(p, grid, stream);
      return;
    }
  }
  if (b_mn_major)
    launch<GemmConfig<T, MnMajorB, kM>, kLayer>(p, grid, stream);
  else
    launch<GemmConfig<T, KMajorB, kM>, kLayer>(p, grid, stream);
}
template <class T, int kLayer>
void launch(const CallParams& p, bool b_mn_major, int grid, cudaStream_t stream) {
  if (p.tile_m == 64)
    launch_rows<T, kLayer, 64>(p, b_mn_major, grid, stream);
  else
    launch_rows<T, kLayer, 128>(p, b_mn_major, grid, stream);
}

// The FP8 entry points' (fused_sm90_fp8_layer*.cu) kernel for the call's tile rows.
template <int kLayer>
FusedKernelInfo fp8_info(int tile_m) {
  return tile_m == 64 ? info<Fp8GemmConfig<64>, kLayer>() : info<Fp8GemmConfig<128>, kLayer>();
}
template <int kLayer>
void fp8_launch(const CallParams& p, int grid, cudaStream_t stream) {
  if (p.tile_m == 64)
    launch<Fp8GemmConfig<64>, kLayer>(p, grid, stream);
  else
    launch<Fp8GemmConfig<128>, kLayer>(p, grid, stream);
}

// One dynamic shared memory size whatever B's layout (the same stages of the same tiles); the
// host probe of tools/check_ptxas.py reads GemmConfig<T>'s.
static_assert(GemmConfig<cutlass::bfloat16_t, MnMajorB>::kSmemBytes ==
                  GemmConfig<cutlass::bfloat16_t, KMajorB>::kSmemBytes &&
              GemmConfig<cutlass::half_t, MnMajorB>::kSmemBytes ==
                  GemmConfig<cutlass::half_t, KMajorB>::kSmemBytes &&
              GemmConfig<cutlass::bfloat16_t, MnMajorB, 64>::kSmemBytes ==
                  GemmConfig<cutlass::bfloat16_t, KMajorB, 64>::kSmemBytes);

}  // namespace comet::gpu::sm90
