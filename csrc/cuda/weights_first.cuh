// Weights before rows: the TMA producer warp of an sm_90a layer0 GEMM block issues the weight (B)
// loads of a tile's first pipeline stages before it waits for the tile's rows, then A of those
// stages, then A and B of the rest in k order, as CUTLASS's collective load does.
//
// Why: weights depend on no communication. At decode sizes a layer is bound by reading the
// experts' weights and a tile's rows arrive last (one m-tile holds its expert's rows from every
// source rank), so the first min(k_tiles, Stages) k-tiles of B are in flight, or in shared memory,
// while the dispatch is still running.
//
// How it stays correct: each stage is acquired exactly as in CUTLASS's load (producer_acquire:
// wait until the MMA warpgroups released the stage, then the leader arms its full barrier with
// the whole stage's transaction bytes, A's and B's; B may come as two boxes, see load_b below).
// The barrier completes only when every load landed, so the consumers see the stage exactly as
// before; B merely arrives earlier. wait() is the producer's readiness acquire followed by
// fence.proxy.async (ProducerContext): A's TMA loads still follow the acquire of the rows the
// comm blocks wrote with generic stores. Acquiring stages before the wait depends only on the
// consumers finishing the previous tile, whose loads were all issued, so no new wait cycle
// arises. The partition of the tiles follows CUTLASS's
// MainloopSm90TmaGmmaWarpSpecialized(FP8Blockwise)::load for a 1x1 cluster (no multicast).
#pragma once

#include <cute/tensor.hpp>

namespace comet::gpu::sm90 {

// A tile's loads of one operand part through one TMA descriptor: k-tile k of src (TMA, TMA_N,
// TMA_K, k) into stage `stage` of dst (TMA, TMA_N, TMA_K, PIPE) on barrier `bar` (one thread).
// Structs with force-inlined calls rather than lambdas: a kernel with wgmma must contain no real
// function call (gpu_context.cuh), and a lambda's call is the compiler's to inline or not.
template <class Tma, class Src, class Dst>
struct BoxLoads {
  const Tma* tma;
  Src src;
  Dst dst;
  template <class Barrier>
  __device__ __forceinline__ void operator()(Barrier* bar, int k, int stage) const {
    using cute::_;
    cute::copy(tma->with(*bar, 0), src(_, _, _, k), dst(_, _, _, stage));
  }
};
template <class Tma, class Src, class Dst>
__device__ __forceinline__ BoxLoads<Tma, Src, Dst> box_loads(const Tma& tma, const Src& src,
                                                             const Dst& dst) {
  return BoxLoads<Tma, Src, Dst>{&tma, src, dst};
}

// B's loads of one tile as CUTLASS's load issues them: the mainloop's descriptor, the whole
// (BLK_N, BLK_K) tile per stage. gB: (BLK_N, BLK_K, k), the tile's view of the TMA tensor.
template <class Mainloop, class Params, class Storage, class TensorB>
__device__ __forceinline__ auto whole_b_loads(const Params& mp, Storage& st, const TensorB& gB) {
  using namespace cute;
  Tensor sB = make_tensor(make_smem_ptr(st.smem_B.data()), typename Mainloop::SmemLayoutB{});
  auto tma_b = mp.tma_load_b.get_slice(0);
  return box_loads(mp.tma_load_b, tma_b.partition_S(gB),   // (TMA, TMA_N, TMA_K, k)
                   tma_b.partition_D(sB));                 // (TMA, TMA_N, TMA_K, PIPE)
}

// gA: (BLK_M, BLK_K, k), the tile's view of A's TMA tensor (as CUTLASS's load slices it); load_b:
// B's loads of the tile (whole_b_loads, or the fused activation's two half-tile boxes:
// paired_b_loads in fused_sm90.cuh); called by the whole producer warp; `state` is not advanced
// (the caller advances it by k_tiles, as after collective.load).
template <class Mainloop, class Pipeline, class PipelineState, class Params, class Storage,
          class TensorA, class LoadB, class Wait>
__device__ void load_weights_first(const Params& mp, Pipeline& pipeline, PipelineState state,
                                   Storage& st, const TensorA& gA, const LoadB& load_b,
                                   int k_tiles, Wait&& wait) {
  using namespace cute;
  using Barrier = typename Pipeline::ProducerBarrierType;
  constexpr int kStages = size<2>(typename Mainloop::SmemLayoutA{});
  const bool lane = cute::elect_one_sync();
  Tensor sA = make_tensor(make_smem_ptr(st.smem_A.data()), typename Mainloop::SmemLayoutA{});
  auto tma_a = mp.tma_load_a.get_slice(0);
  Tensor tAgA = tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
  Tensor tAsA = tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
  const int early = k_tiles < kStages ? k_tiles : kStages;

  PipelineState s = state;
  for (int k = 0; k < early; ++k, ++s) {  // B of the first stages: no rows needed
    pipeline.producer_acquire(s);
    Barrier* bar = pipeline.producer_get_barrier(s);
    if (lane) load_b(bar, k, int(s.index()));
  }
  wait();  // the tile's rows: readiness acquire + proxy fence (the whole warp)
  s = state;
  for (int k = 0; k < early; ++k, ++s) {  // A of those stages, on the barriers already armed
    Barrier* bar = pipeline.producer_get_barrier(s);
    if (lane) copy(mp.tma_load_a.with(*bar, 0), tAgA(_, _, _, k), tAsA(_, _, _, s.index()));
  }
  for (int k = early; k < k_tiles; ++k, ++s) {  // the rest as CUTLASS's load
    pipeline.producer_acquire(s);
    Barrier* bar = pipeline.producer_get_barrier(s);
    if (lane) {
      copy(mp.tma_load_a.with(*bar, 0), tAgA(_, _, _, k), tAsA(_, _, _, s.index()));
      load_b(bar, k, int(s.index()));
    }
  }
}

}  // namespace comet::gpu::sm90
