// Which blocks of a fused kernel are comm blocks and which GEMM blocks: the one layout both
// backends use (csrc/cpu/fused_cpu.cpp's run_blocks, csrc/cuda/comm_blocks.cuh: comm_block_index,
// gemm_block_index).
//
// Forward progress by construction. A GPU starts a kernel's blocks in index order and keeps only
// as many live as fit (fewer than the occupancy query promised when another kernel shares the SMs:
// a side stream, MPS, another process); a block that spins holds its slot. So no block may wait on
// a block of the same kernel with a higher index: then, whatever the residency S >= 1, the lowest
// unfinished block can always make progress, and by induction every block finishes. The roles are
// laid out so that every wait inside a kernel points downwards:
//
//   layer0  comm blocks [0, n_comm), GEMM blocks [n_comm, grid). GEMM blocks wait for m-tiles the
//           comm blocks dispatched (RowTile): lower indices. Comm blocks wait only on what other
//           kernels published: peers' source data (their prologue kernels), the mirrored rows of
//           sources on other nodes (MirrorRows: those sources' node push, through the link).
//   layer1  GEMM blocks [0, n_gemm), comm blocks [n_gemm, grid). Comm blocks wait for finished
//           columns (ColumnTile): GEMM blocks, lower indices. GEMM blocks wait on nothing.
//   counters, not waits: the per-column arrivals (layer1_gemm), the chunks' n-tile arrivals of
//           send_staged_rows (the last arriver sends, nobody waits for it), the comm blocks'
//           blocks_done and the "done" handshake (the last arriver publishes; the next call's
//           prologue, another kernel, waits for it).
//
// Grids where every block waits on every other need all blocks co-resident, whatever the index
// layout, and are sized to what is co-resident (the CPU backend clamps them to its residency
// limit, block_runner.h: co_resident):
//   - the prologue programs (comet/prologue.h, comet/node_push.h): grid barriers;
//   - layer1's combine step when partials are node-reduced (comm_layer1.h): each block, having
//     relayed its share, waits for the relays on the other nodes, which signal only once every
//     block of THEIR combine grid has relayed, whose blocks wait for ours: a grid barrier across
//     the nodes. Without node_reduce the combine waits only on the peers' fused kernels.
#pragma once

#include "comet/config.h"

namespace comet {

struct BlockRole {
  bool comm;      // a comm block (else a GEMM block)
  int32_t index;  // its index among the blocks of its role
  int32_t count;  // blocks of its role
};

// The roles are contiguous ranges of block indices: their first blocks.
COMET_HD int32_t first_comm_block(int32_t layer, int32_t blocks, int32_t n_comm) {
  return layer == 0 ? 0 : blocks - n_comm;
}
COMET_HD int32_t first_gemm_block(int32_t layer, int32_t n_comm) { return layer == 0 ? n_comm : 0; }

// Role of block `block` of a fused kernel of `blocks` blocks, n_comm of them comm blocks.
COMET_HD BlockRole fused_block_role(int32_t layer, int32_t block, int32_t blocks, int32_t n_comm) {
  const int32_t c = block - first_comm_block(layer, blocks, n_comm);
  if (c >= 0 && c < n_comm) return BlockRole{true, c, n_comm};
  return BlockRole{false, block - first_gemm_block(layer, n_comm), blocks - n_comm};
}

// n_comm = 0: no comm blocks beside the GEMM blocks ("staged"). Comm blocks pay off only while
// rows cross a link, whose transfers they overlap with the GEMM; where none does (a world of one)
// they would only copy or reduce rows in this GPU's memory while holding SMs the GEMM could use.
// A staged layer runs as two launches of the whole grid, in dependency order: layer0 all comm
// blocks (the rows into A), then all GEMM blocks; layer1 all GEMM blocks, then all comm blocks
// (reduce and send). Each launch is the fused kernel with one role only, so the comm programs and
// the GEMM schedule are the same code as in a fused launch; the second launch finds every flag it
// waits on already published by the first (the same stream), so nothing waits across the two.
// The result is bitwise that of any fused split (every sum keeps its order).
struct FusedStep {
  int32_t n_comm, n_gemm;  // the step's blocks of each role (their sum: the step's grid)
};
COMET_HD int32_t fused_steps(int32_t n_comm) { return n_comm == 0 ? 2 : 1; }
// Step `step` (0 .. fused_steps - 1) of a layer of `blocks` blocks, n_comm of them comm blocks.
COMET_HD FusedStep fused_step(int32_t layer, int32_t step, int32_t blocks, int32_t n_comm) {
  if (n_comm > 0) return FusedStep{n_comm, blocks - n_comm};
  const bool comm_step = (step == 0) == (layer == 0);
  return comm_step ? FusedStep{blocks, 0} : FusedStep{0, blocks};
}
// The comm blocks that run a layer's comm program (what its work is split for): n_comm, or the
// whole grid in a staged layer.
COMET_HD int32_t comm_program_blocks(int32_t blocks, int32_t n_comm) {
  return n_comm > 0 ? n_comm : blocks;
}

}  // namespace comet
