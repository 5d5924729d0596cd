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
// the whole stage's transaction bytes, A's and B's). The barrier completes only when both loads
// landed, so the consumers see the stage exactly as before; B merely arrives earlier. wait() is
// the producer's readiness acquire followed by fence.proxy.async (ProducerContext): A's TMA loads
// still follow the acquire of the rows the comm blocks wrote with generic stores. Acquiring stages
// before the wait depends only on the consumers finishing the previous tile, whose loads were all
// issued, so no new wait cycle arises. The partition of the tiles follows CUTLASS's
// MainloopSm90TmaGmmaWarpSpecialized(FP8Blockwise)::load for a 1x1 cluster (no multicast).
#pragma once

#include <cute/tensor.hpp>

namespace comet::gpu::sm90 {

// gA: (BLK_M, BLK_K, k) and gB: (BLK_N, BLK_K, k), the tile's views of the TMA tensors (as
// CUTLASS's load slices them); called by the whole producer warp; `state` is not advanced (the
// caller advances it by k_tiles, as after collective.load).
template <class Mainloop, class Pipeline, class PipelineState, class Params, class Storage,
          class TensorA, class TensorB, class Wait>
__device__ void load_weights_first(const Params& mp, Pipeline& pipeline, PipelineState state,
                                   Storage& st, const TensorA& gA, const TensorB& gB, int k_tiles,
                                   Wait&& wait) {
  using namespace cute;
  using Barrier = typename Pipeline::ProducerBarrierType;
  constexpr int kStages = size<2>(typename Mainloop::SmemLayoutA{});
  const bool lane = cute::elect_one_sync();
  Tensor sA = make_tensor(make_smem_ptr(st.smem_A.data()), typename Mainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(st.smem_B.data()), typename Mainloop::SmemLayoutB{});
  auto tma_a = mp.tma_load_a.get_slice(0);
  auto tma_b = mp.tma_load_b.get_slice(0);
  Tensor tAgA = tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
  Tensor tAsA = tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
  Tensor tBgB = tma_b.partition_S(gB);
  Tensor tBsB = tma_b.partition_D(sB);
  const int early = k_tiles < kStages ? k_tiles : kStages;

  PipelineState s = state;
  for (int k = 0; k < early; ++k, ++s) {  // B of the first stages: no rows needed
    pipeline.producer_acquire(s);
    Barrier* bar = pipeline.producer_get_barrier(s);
    if (lane) copy(mp.tma_load_b.with(*bar, 0), tBgB(_, _, _, k), tBsB(_, _, _, s.index()));
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
      copy(mp.tma_load_b.with(*bar, 0), tBgB(_, _, _, k), tBsB(_, _, _, s.index()));
    }
  }
}

}  // namespace comet::gpu::sm90
