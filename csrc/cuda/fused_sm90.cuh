// Fused persistent kernels of the sm_90a path, one per layer and dtype. The comm blocks
// (comet/block_roles.h) run the comm program; every other block is a warp-specialised GEMM block built from CUTLASS 3.x's TMA +
// wgmma collective mainloop (MainloopSm90TmaGmmaWarpSpecialized, cooperative: one producer
// warpgroup, two MMA warpgroups on a 128x128 tile), unchanged. The kernel body around it is ours,
// because the tile scheduler is the engine's:
//
//  - GEMM block g of n_gemm (comet/block_roles.h) walks the engine's tile order
//    (comet/gemm_schedule.h) in every warp role: the producer warp with a ProducerContext, whose
//    wait acquires the m-tile's readiness (layer0) and then issues fence.proxy.async before the TMA
//    loads; the MMA warpgroups with a ConsumerContext (no wait of their own; in layer1 they publish
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

#include "comet/gemm_schedule.h"
#include "comm_blocks.cuh"
#include "launch.h"
#include "epilogue.cuh"

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

template <class T, class BMajor = KMajorB>
struct GemmConfig {
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kStages = 5;  // 5 x 32 KiB of operands
  static constexpr int kAlign = 8;   // elements per 16 bytes: TMA needs 16-byte row strides
  static constexpr bool kBMn = BMajor::kMn;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, kAlign,
      T, typename BMajor::Layout, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCount<kStages>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using Pipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using Params = typename Mainloop::Params;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };

  static constexpr int kThreads = 384;        // producer warpgroup + 2 MMA warpgroups
  static constexpr int kMmaThreads = 256;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes >= int(kBlockSharedBytes),
                "the comm blocks use the fused kernel's dynamic shared memory as their scratch");
  static constexpr int kTileM = 128, kTileN = 128, kTileK = 64;
  static constexpr uint32_t kLoadRegisters = 40;
  static constexpr uint32_t kMmaRegisters = 232;
  static constexpr int kConsumerBarrier = 1;  // named barrier of the MMA warpgroups

  // TMA descriptors, built on the host: A [a_rows, K] (K contiguous) and B, the `experts`
  // experts' weights of n output columns each:
  //  - KMajorB: one [experts * n, K] matrix (K contiguous);
  //  - MnMajorB: (n, K, experts) with strides (1, n, K * n). The mainloop builds both descriptors
  //    from one problem shape (M, N, K, L), A's as (M, K, L) and B's as (N, K, L); A needs L = 1
  //    and B L = experts, so the descriptors come from two calls with the same arguments and B's
  //    is taken from the second (the same smem layout, box and TMA type: only the extents
  //    differ; the second call's A descriptor is discarded).
  static Params make_params(const void* a, int64_t a_rows, const void* b, int64_t n, int64_t k,
                            int64_t experts) {
    using StrideA = typename Mainloop::StrideA;
    using StrideB = typename Mainloop::StrideB;
    const StrideA da = make_stride(int64_t(k), Int<1>{}, int64_t(a_rows * k));
    if constexpr (!kBMn) {
      const int64_t b_rows = experts * n;
      const StrideB db = make_stride(int64_t(k), Int<1>{}, int64_t(b_rows * k));
      const typename Mainloop::Arguments args{static_cast<const T*>(a), da,
                                              static_cast<const T*>(b), db};
      return Mainloop::to_underlying_arguments(make_shape(int(a_rows), int(b_rows), int(k), 1),
                                               args, nullptr);
    } else {
      const StrideB db = make_stride(Int<1>{}, int64_t(n), int64_t(k * n));
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

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <class T, int kLayer, class BMajor>
__device__ void gemm_block(const CallParams& p, const typename GemmConfig<T, BMajor>::Params& mp,
                           char* smem, uint64_t epoch) {
  using C = GemmConfig<T, BMajor>;
  using Mainloop = typename C::Mainloop;
  using Pipeline = typename C::Pipeline;
  using PipelineState = typename C::PipelineState;
  using X = Underscore;
  auto& ss = *reinterpret_cast<typename C::SharedStorage*>(smem);

  const int32_t g = gemm_block_index<kLayer>(p);
  const int32_t ng = int32_t(gridDim.x) - p.n_comm;
  const int64_t num_mtiles = p.state->num_mtiles;
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
      kLayer == 0 ? GemmScheduleArgs{epoch, p.mtiles, num_mtiles, p.num_ntiles, p.mtile_order,
                                     p.mtile_ready, nullptr, nullptr}
                  : layer1_schedule_args(p, epoch);

  typename Pipeline::Params pp;
  if (warp_group == 0)
    pp.role = warp_in_group == 0 ? Pipeline::ThreadCategory::Producer
                                 : Pipeline::ThreadCategory::NonParticipant;
  else
    pp.role = Pipeline::ThreadCategory::Consumer;
  pp.is_leader = int(threadIdx.x) % 128 == 0;
  pp.num_consumers = C::kMmaThreads;
  pp.transaction_bytes = mp.tma_transaction_bytes;
  Pipeline pipeline(ss.pipeline, pp, typename C::ClusterShape{});
  __syncthreads();  // barrier initialisation visible to every warp

  Mainloop collective;
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<C::kLoadRegisters>();
    if (warp_in_group != 0) return;
    // Producer warp: TMA loads in the engine's tile order.
    PipelineState state = cutlass::make_producer_start_state<Pipeline>();
    Tensor mA = mp.tma_load_a.get_tma_tensor(make_shape(int(a_rows), int(K), 1));
    // B's coordinates (n, k, l): KMajorB over [El*N, K] (l = 0, the expert in n), MnMajorB over
    // (N, K, El) (the expert in l: TMA's bounds are the expert's own N and K).
    Tensor mB = mp.tma_load_b.get_tma_tensor(
        C::kBMn ? make_shape(int(n_out), int(K), int(p.experts_local))
                : make_shape(int(b_rows), int(K), 1));
    auto load_tile = [&](const MTile& mt, int32_t nt) {
      const int n0 = int(int64_t(nt) * C::kTileN);
      const auto b_origin = C::kBMn ? make_coord(n0, 0, int(mt.expert))
                                    : make_coord(int(int64_t(mt.expert) * n_out + n0), 0, 0);
      Tensor gA = local_tile(domain_offset(make_coord(int(mt.row_begin), 0, 0), mA),
                             typename C::TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});
      Tensor gB = local_tile(domain_offset(b_origin, mB), typename C::TileShape{},
                             make_coord(_, _, _), Step<X, _1, _1>{});
      auto k_iter = make_coord_iterator(shape<3>(gA));
      collective.load(mp, pipeline, state, cute::make_tuple(gA, gB), make_coord(0, 0, _, 0),
                      k_iter, k_tiles, int(threadIdx.x) % 32, 0u, ss.tensors);
      state.advance(k_tiles);
    };
    ProducerContext ctx(wc);
    if constexpr (kLayer == 0) {
      layer0_gemm(ctx, g, ng, ga, load_tile);
    } else {
      // The MMA warpgroups' order (layer1_gemm): the same bands, the same tiles.
      const int64_t tiles = num_mtiles * p.num_ntiles;
      const int32_t band = layer1_band(ga.band_n, p.num_ntiles);
      for (int64_t i = g; i < tiles; i += ng) {
        const TileCoord tc = layer1_tile(i, num_mtiles, p.num_ntiles, band);
        load_tile(p.mtiles[tc.mtile], tc.ntile);
      }
    }
    collective.load_tail(pipeline, state);
    return;
  }

  // MMA warpgroups: mainloop, then a predicated epilogue straight from the accumulators.
  cutlass::arch::warpgroup_reg_alloc<C::kMmaRegisters>();
  const int mma_thread = int(threadIdx.x) - 128;
  PipelineState state;
  typename C::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_slice(mma_thread);
  Tensor tCcC = thr_mma.partition_C(make_identity_tensor(take<0, 2>(typename C::TileShape{})));
  ConsumerContext ctx(128, C::kMmaThreads, C::kConsumerBarrier);

  auto compute_tile = [&](const MTile& mt, int32_t nt, auto* out) {
    Tensor acc = partition_fragment_C(tiled_mma, take<0, 2>(typename C::TileShape{}));
    collective.mma(pipeline, state, acc, k_tiles, mma_thread, ss.tensors, mp);
    collective.mma_tail(pipeline, state, k_tiles);
    state.advance(k_tiles);
    // Expert bias [El, n_out] (or null): layer0's b0 into y0 before rounding, layer1's b1 into C
    // (fp32) before the comm blocks' top-k weighting.
    const T* bias = static_cast<const T*>(kLayer == 0 ? p.b0 : p.b1);
    const int64_t col0 = int64_t(nt) * C::kTileN;
    const int cols = int(n_out - col0 < C::kTileN ? n_out - col0 : C::kTileN);
    store_tile(acc, tCcC, mt.rows, cols, out + mt.row_begin * n_out + col0, n_out,
               bias != nullptr ? bias + int64_t(mt.expert) * n_out + col0 : nullptr);
  };
  if constexpr (kLayer == 0) {
    T* y0 = static_cast<T*>(p.y0);
    layer0_gemm(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt) { compute_tile(mt, nt, y0); });
  } else {
    float* c = p.c;
    layer1_gemm(ctx, g, ng, ga, [&](const MTile& mt, int32_t nt) { compute_tile(mt, nt, c); });
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <class T, int kLayer, class BMajor = KMajorB>
__global__ void __launch_bounds__(GemmConfig<T, BMajor>::kThreads, 1)
    fused_kernel(const __grid_constant__ CallParams p,
                 const __grid_constant__ typename GemmConfig<T, BMajor>::Params mp) {
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
  gemm_block<T, kLayer, BMajor>(p, mp, smem, epoch);
#endif
}

template <class T, int kLayer, class BMajor>
FusedKernelInfo info() {
  using C = GemmConfig<T, BMajor>;
  auto* k = &fused_kernel<T, kLayer, BMajor>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  return FusedKernelInfo{reinterpret_cast<const void*>(k), C::kThreads, C::kSmemBytes};
}

// B: p.w0 / p.w1 in BMajor's layout (MnMajorB: the ops' transposed weights as given; the caller
// checked N % 8 == 0 and 16-byte alignment, TMA's conditions on B's strides and base).
template <class T, int kLayer, class BMajor>
void launch(const CallParams& p, int grid, cudaStream_t stream) {
  using C = GemmConfig<T, BMajor>;
  const int64_t K = kLayer == 0 ? p.hidden : p.cols;
  const int64_t n_out = kLayer == 0 ? p.cols : p.hidden;
  const void* a = kLayer == 0 ? static_cast<const void*>(p.a) : p.h;
  const int64_t a_rows = kLayer == 0 ? p.rows_cap : p.h_rows;
  const void* b = kLayer == 0 ? p.w0 : p.w1;
  const typename C::Params mp = C::make_params(a, a_rows, b, n_out, K, p.experts_local);
  info<T, kLayer, BMajor>();
  fused_kernel<T, kLayer, BMajor><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, mp);
}

// What the fused_sm90_layer*.cu entry points instantiate: the kernel for B's layout.
template <class T, int kLayer>
FusedKernelInfo info(bool b_mn_major) {
  return b_mn_major ? info<T, kLayer, MnMajorB>() : info<T, kLayer, KMajorB>();
}

template <class T, int kLayer>
void launch(const CallParams& p, bool b_mn_major, int grid, cudaStream_t stream) {
  if (b_mn_major)
    launch<T, kLayer, MnMajorB>(p, grid, stream);
  else
    launch<T, kLayer, KMajorB>(p, grid, stream);
}

// One dynamic shared memory size whatever B's layout (the same stages of the same tiles); the
// host probe of tools/check_ptxas.py reads GemmConfig<T>'s.
static_assert(GemmConfig<cutlass::bfloat16_t, MnMajorB>::kSmemBytes ==
                  GemmConfig<cutlass::bfloat16_t, KMajorB>::kSmemBytes &&
              GemmConfig<cutlass::half_t, MnMajorB>::kSmemBytes ==
                  GemmConfig<cutlass::half_t, KMajorB>::kSmemBytes);

}  // namespace comet::gpu::sm90
