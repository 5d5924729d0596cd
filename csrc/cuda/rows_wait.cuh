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

#include <cstdint>
#include <type_traits>

#include "epilogue.cuh"

namespace comet::gpu {

// No wait handed over: the caller acquired the rows before the tile (layer1, whose A is local),
// and the mainloop keeps its plain prologue.
struct NoRowsWait {
  __device__ __forceinline__ void operator()() const {}
};

template <class Wait>
inline constexpr bool kDefersRows = !std::is_same_v<std::decay_t<Wait>, NoRowsWait>;

// A plain (no activation) tile of either mma.sync tile GEMM (sm80::TileGemm, sm89::Fp8TileGemm):
// the mainloop, then its in-range part stored into dst (row-major, leading dimension ld), bias[c]
// added to column c first when bias is not null (epilogue.cuh, store_tile). Every thread of the
// block calls it; `wait` as above.
template <class Tile, class Out, class Bias, class Wait = NoRowsWait>
__device__ inline void run_plain_tile(char* smem, const typename Tile::Operand& a,
                                      const typename Tile::Operand& b, int64_t K, bool vec,
                                      Out* dst, int64_t ld, const Bias* bias,
                                      Wait&& wait = Wait{}) {
  Tile::template run_with<false>(
      smem, a, b, K, vec,
      [&](auto const& acc, auto const& coord) {
        store_tile(acc, coord, a.rows, b.rows, dst, ld, bias);
      },
      wait);
}

}  // namespace comet::gpu
