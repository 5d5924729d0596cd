// Host-side entry points of the CUDA kernels (defined in the .cu files of csrc/cuda/), called by
// the op implementations in ops_cuda.cpp. Plain C++: no CUDA device code, no CUTLASS, no torch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "call_params.h"

namespace comet::gpu {

// Prologue kernels (prologue.cu):
//  source:  (p.source_blocks blocks) validate the routing, build the send plan (layer0) or the
//           (token, destination) pair lists (layer1) in local scratch; skipped when p.ids is null.
//  begin:   (a grid sized for max(W, E_local*(W+1)) items, usually one block) advance the call
//           counter, wait until every peer finished the previous call, publish the send plan's
//           bucket offsets, exchange metadata (a peer per thread) and decide the verdict on the
//           device, compute the dispatch layout and M (dispatch_layout_program; layer1: from its
//           recv_counts, checked against h).
//  publish: (p.plan_blocks blocks) announce this rank's source data, build m-tiles and their
//           order (layer0), the reduce plan from the peers' pair lists (layer1).
//  finish:  mark the call done without running the fused kernel (a call rejected on the host).
// source, begin and publish run the engine's prologue programs (comet/prologue.h) with
// kPrologueThreads threads per block, launched cooperatively (their grid barriers need every block
// resident) with the grid clamped to the kernel's occupancy.
constexpr int kPrologueThreads = 256;
void launch_source(const CallParams& p, cudaStream_t stream);
void launch_begin(const CallParams& p, const CallMeta& me, cudaStream_t stream);
void launch_publish(const CallParams& p, cudaStream_t stream);
void launch_finish(const CallParams& p, cudaStream_t stream);
// Loads the four kernels above now (comet::gpu::preload_kernels, cuda_buffer.h says why).
cudaError_t preload_prologue_kernels();

// layer1's combine (combine.cu): after the fused kernel, on `grid` blocks (the fused kernel's
// grid size, i.e. every SM) of kCombineThreads threads; ends the call's "done" handshake.
constexpr int kCombineThreads = 256;
void launch_combine(const CallParams& p, int grid, cudaStream_t stream);
cudaError_t preload_combine_kernel();  // loads it now (as preload_prologue_kernels)

// dispatch_fp8's sending side (fp8_pack.cu): x [tokens, hidden] of `kind` (bf16 / fp16 / fp32),
// contiguous, quantised and packed into `tokens` rows of row_bytes at dst (comet/fp8_rows.h), one
// warp per 128-value block; the rows' padding bytes are not written (nothing reads them). dst is
// in the data segment: with `state`, nothing is written unless `generation` is the segment's
// (a CUDA graph replayed after a grow: comet/capture_rule.h).
void launch_fp8_quantize_pack(const void* x, ScalarKind kind, int64_t tokens, int64_t hidden,
                              char* dst, int64_t row_bytes, cudaStream_t stream,
                              const DeviceState* state = nullptr, uint64_t generation = 0);
cudaError_t preload_fp8_pack_kernel();  // loads it now (as preload_prologue_kernels)

// A call's device copies and flag clears, as one kernel launch (stream_copies.cu) in place of a
// cudaMemcpyAsync / cudaMemsetAsync each. A descriptor copies `rows` rows of `width` bytes from
// src (pitch src_pitch) to dst (pitch dst_pitch), or zeroes them when src is null; `unit` is the
// widest access (16, 8, 4, 2 or 1 bytes) that every address, the width and the pitches allow.
// The descriptors are independent regions: the kernel runs them in any order.
struct CopyDesc {
  void* dst;
  const void* src;
  int64_t width, rows, dst_pitch, src_pitch;
  int32_t unit;
};
struct CopyList {
  static constexpr int32_t kMax = 8;  // layer0's 4 copies, x's values and scales, 2 clears
  CopyDesc d[kMax];
  int32_t n = 0;
  // The data segment the copies write into, as the call was launched (or captured) with: with
  // `state`, the kernel writes nothing unless `generation` is still the segment's
  // (comet/capture_rule.h: a CUDA graph replayed after a grow).
  const DeviceState* state = nullptr;
  uint64_t generation = 0;
  // Adds a copy (src) or a clear (src null) of rows x width bytes; nothing when empty. False
  // when the list is full (a caller's bug: the op checks it).
  bool add(void* dst, const void* src, int64_t width, int64_t rows = 1, int64_t dst_pitch = 0,
           int64_t src_pitch = 0) {
    if (width <= 0 || rows <= 0) return true;
    if (n == kMax) return false;
    if (rows == 1) dst_pitch = src_pitch = width;
    uint64_t bits = reinterpret_cast<uintptr_t>(dst) | uint64_t(width) | uint64_t(dst_pitch) |
                    (src ? reinterpret_cast<uintptr_t>(src) | uint64_t(src_pitch) : 0);
    int32_t unit = 16;
    while (unit > 1 && (bits & uint64_t(unit - 1)) != 0) unit /= 2;
    d[n++] = {dst, src, width, rows, dst_pitch, src_pitch, unit};
    return true;
  }
};
void launch_copies(const CopyList& l, cudaStream_t stream);
cudaError_t preload_copies_kernel();  // loads it now (as preload_prologue_kernels)

// What the occupancy check needs about a fused kernel.
struct FusedKernelInfo {
  const void* func;   // the __global__ function, for cudaOccupancyMaxActiveBlocksPerMultiprocessor
  int threads;        // block size
  int smem_bytes;     // dynamic shared memory per block
};

// sm_80 path (cp.async + mma.sync): compiled for sm_80 and sm_90a; every shape.
// tile_m (every info function): the kernel of that tile's rows, 128 or 64 (kTileMs).
// layer: 0 or 1; kind: BF16 or F16. b_mn_major: the weights (p.w0 / p.w1) are the ops' transposed
// layout, read in place (w0 [El, H, N0], w1 [El, N1, H]; N contiguous), else the usual
// K-contiguous layout. vec: 16-byte operand copies allowed (K % 8 == 0, 16-byte aligned operands,
// and N % 8 == 0 when b_mn_major).
// One pair per translation unit (fused_sm80_layer0.cu / fused_sm80_layer1.cu). layer0 with a fused
// activation (p.activation, comet/activation.h) runs its own instantiation: act names it here;
// h_fp8 (with act, p.h_fp8): the one writing h as packed FP8 rows (h_fp8_epilogue.cuh).
FusedKernelInfo fused_sm80_layer0_info(ScalarKind kind, bool b_mn_major, int tile_m,
                                       bool act = false, bool h_fp8 = false);
FusedKernelInfo fused_sm80_layer1_info(ScalarKind kind, bool b_mn_major, int tile_m);
void launch_fused_sm80_layer0(ScalarKind kind, const CallParams& p, bool b_mn_major, bool vec,
                              int grid, cudaStream_t stream);
void launch_fused_sm80_layer1(ScalarKind kind, const CallParams& p, bool b_mn_major, bool vec,
                              int grid, cudaStream_t stream);

// sm_90a path (TMA + wgmma, CUTLASS collective mainloop): needs K % 8 == 0 and 16-byte aligned
// operands; only for devices of compute capability 9.0.
// b_mn_major: the weights (p.w0 / p.w1) are the ops' transposed layout, read in place
// (w0 [El, H, N0], w1 [El, N1, H]; N contiguous), which also needs N % 8 == 0; else the usual
// K-contiguous layout (w0 [El, N0, H], w1 [El, H, N1]).
// One pair per translation unit (fused_sm90_layer0.cu / fused_sm90_layer1.cu). layer0 with a fused
// activation (p.activation, comet/activation.h) runs its own instantiation: act names it here.
FusedKernelInfo fused_sm90_layer0_info(ScalarKind kind, bool b_mn_major, int tile_m,
                                       bool act = false);
FusedKernelInfo fused_sm90_layer1_info(ScalarKind kind, bool b_mn_major, int tile_m);
void launch_fused_sm90_layer0(ScalarKind kind, const CallParams& p, bool b_mn_major, int grid,
                              cudaStream_t stream);
void launch_fused_sm90_layer1(ScalarKind kind, const CallParams& p, bool b_mn_major, int grid,
                              cudaStream_t stream);

// FP8 paths (comet/fp8_rows.h; CallParams' FP8 fields): A and B float8_e4m3fn with their block
// scales (A 1 x 128 per row, the weights 128 x 128), fp32 accumulation with each 128-wide K block
// scaled before it is added; K-major weights only (FP8 tensor cores read both operands K-major);
// y0 (layer0) in bf16, C (layer1) in fp32 as the 16-bit kernels.
//  sm_90a (fused_sm90_fp8_layer*.cu): CUTLASS's blockwise-scaled FP8 wgmma mainloop; K % 16 == 0
//   and 16-byte aligned operands (TMA); devices of compute capability 9.0.
//  sm_89 (fused_sm89_fp8_layer*.cu, compiled for sm_89 only): FP8 mma.sync (Ada); every K. layer0
//   with a fused activation (p.activation) runs its own instantiation: act names it here; h_fp8
//   (with act, p.h_fp8): the one writing h as packed FP8 rows.
// sm_80 has no FP8 tensor cores: the ops refuse FP8 there.
FusedKernelInfo fused_sm90_fp8_layer0_info(int tile_m);
FusedKernelInfo fused_sm90_fp8_layer1_info(int tile_m);
void launch_fused_sm90_fp8_layer0(const CallParams& p, int grid, cudaStream_t stream);
void launch_fused_sm90_fp8_layer1(const CallParams& p, int grid, cudaStream_t stream);
FusedKernelInfo fused_sm89_fp8_layer0_info(int tile_m, bool act = false, bool h_fp8 = false);
FusedKernelInfo fused_sm89_fp8_layer1_info(int tile_m);
void launch_fused_sm89_fp8_layer0(const CallParams& p, int grid, cudaStream_t stream);
void launch_fused_sm89_fp8_layer1(const CallParams& p, int grid, cudaStream_t stream);

// Tile shapes the CUDA kernels are compiled for (every path): tile_n = 128, and tile_m = 128 or
// 64, the small-batch tile for few rows per expert (comet/tune/model/decode.py: a 1-64 row m-tile
// pads to 64 rows, not 128). The launch functions run the kernel of p.tile_m; the info functions
// take it (the occupancy of the two differs). Checker::launch admits no other tile.
constexpr int kTileMs[] = {128, 64};
constexpr int kTileN = 128;

}  // namespace comet::gpu
