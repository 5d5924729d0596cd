// Host-side entry points of the CUDA kernels (defined in the .cu files of csrc/cuda/), called by
// the op implementations in ops_cuda.cpp. Plain C++: no CUDA device code, no CUTLASS, no torch.
#pragma once

#include <cuda_runtime.h>

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
// (a CUDA graph replayed after a grow: comet/capture_rule.h, segment_copy.h).
void launch_fp8_quantize_pack(const void* x, ScalarKind kind, int64_t tokens, int64_t hidden,
                              char* dst, int64_t row_bytes, cudaStream_t stream,
                              const DeviceState* state = nullptr, uint64_t generation = 0);
cudaError_t preload_fp8_pack_kernel();  // loads it now (as preload_prologue_kernels)

// What the occupancy check needs about a fused kernel.
struct FusedKernelInfo {
  const void* func;   // the __global__ function, for cudaOccupancyMaxActiveBlocksPerMultiprocessor
  int threads;        // block size
  int smem_bytes;     // dynamic shared memory per block
};

// sm_80 path (cp.async + mma.sync): compiled for sm_80 and sm_90a; every shape.
// layer: 0 or 1; kind: BF16 or F16. b_mn_major: the weights (p.w0 / p.w1) are the ops' transposed
// layout, read in place (w0 [El, H, N0], w1 [El, N1, H]; N contiguous), else the usual
// K-contiguous layout. vec: 16-byte operand copies allowed (K % 8 == 0, 16-byte aligned operands,
// and N % 8 == 0 when b_mn_major).
// One pair per translation unit (fused_sm80_layer0.cu / fused_sm80_layer1.cu).
FusedKernelInfo fused_sm80_layer0_info(ScalarKind kind, bool b_mn_major);
FusedKernelInfo fused_sm80_layer1_info(ScalarKind kind, bool b_mn_major);
void launch_fused_sm80_layer0(ScalarKind kind, const CallParams& p, bool b_mn_major, bool vec,
                              int grid, cudaStream_t stream);
void launch_fused_sm80_layer1(ScalarKind kind, const CallParams& p, bool b_mn_major, bool vec,
                              int grid, cudaStream_t stream);

// sm_90a path (TMA + wgmma, CUTLASS collective mainloop): needs K % 8 == 0 and 16-byte aligned
// operands; only for devices of compute capability 9.0.
// b_mn_major: the weights (p.w0 / p.w1) are the ops' transposed layout, read in place
// (w0 [El, H, N0], w1 [El, N1, H]; N contiguous), which also needs N % 8 == 0; else the usual
// K-contiguous layout (w0 [El, N0, H], w1 [El, H, N1]).
// One pair per translation unit (fused_sm90_layer0.cu / fused_sm90_layer1.cu).
FusedKernelInfo fused_sm90_layer0_info(ScalarKind kind, bool b_mn_major);
FusedKernelInfo fused_sm90_layer1_info(ScalarKind kind, bool b_mn_major);
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
//  sm_89 (fused_sm89_fp8_layer*.cu, compiled for sm_89 only): FP8 mma.sync (Ada); every K.
// sm_80 has no FP8 tensor cores: the ops refuse FP8 there.
FusedKernelInfo fused_sm90_fp8_layer0_info();
FusedKernelInfo fused_sm90_fp8_layer1_info();
void launch_fused_sm90_fp8_layer0(const CallParams& p, int grid, cudaStream_t stream);
void launch_fused_sm90_fp8_layer1(const CallParams& p, int grid, cudaStream_t stream);
FusedKernelInfo fused_sm89_fp8_layer0_info();
FusedKernelInfo fused_sm89_fp8_layer1_info();
void launch_fused_sm89_fp8_layer0(const CallParams& p, int grid, cudaStream_t stream);
void launch_fused_sm89_fp8_layer1(const CallParams& p, int grid, cudaStream_t stream);

// Tile shape the CUDA kernels are compiled for (both paths).
constexpr int kTileM = 128;
constexpr int kTileN = 128;

}  // namespace comet::gpu
