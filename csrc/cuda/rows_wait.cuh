// Weights before rows on the mma.sync paths (sm80_tile_gemm.cuh, sm89_fp8_tile_gemm.cuh): layer0's
// GEMM blocks hand the wait for a tile's rows (comet/gemm_schedule.h, layer0_gemm_deferred) to
// the tile's mainloop, which issues the cp.async loads of the weight (B) operand's first pipeline
// stages (and, FP8, their block scales) before it and the rows' (A, and A's row scales) after.
//
// Why: weights depend on no communication. At decode sizes one m-tile holds its expert's rows from
// every source rank, so a GEMM block waits for the rows of a whole comm round; its first stages of
// weights are in flight, or in shared memory, meanwhile (the sm_90a producer does the same with
// TMA: weights_first.cuh).
//
// How it stays correct: B's first stages are one cp.async group, committed before the wait, and A's
// stages a group each after it. The mainloop's waits (cp.async.wait_group kStages - 2) count
// groups from the newest, so when stage kt is consumed the groups of A's k-tiles up to kt are
// complete and every older group with them (B's group is the oldest): one more group than the
// plain prologue's kStages - 1 only makes the first waits ask for one group more. The wait itself
// is the block-wide readiness acquire the schedule used to make before the tile (every thread
// calls it); the A loads follow it as before. Shared memory: the previous tile's mainloop ended
// with cp.async.wait_group 0 and a block barrier, as before any tile's first loads.
#pragma once

#include <type_traits>

namespace comet::gpu {

// No wait handed over: the caller acquired the rows before the tile (layer1, whose A is local),
// and the mainloop keeps its plain prologue.
struct NoRowsWait {
  __device__ __forceinline__ void operator()() const {}
};

template <class Wait>
inline constexpr bool kDefersRows = !std::is_same_v<std::decay_t<Wait>, NoRowsWait>;

}  // namespace comet::gpu
