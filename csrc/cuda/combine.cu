// layer1's combine as a follow-on kernel over all SMs (the fused kernel's grid size): once every
// rank's partial sums for this rank have arrived, the engine's combine program (comm_layer1.h)
// sums each token's partials in a fixed order and writes the output. Running it on every SM
// instead of on the comm blocks alone gives it the whole GPU's load/store bandwidth; stream order
// puts it after the fused kernel (the GEMM blocks are done). Its blocks then arrive on the call's
// "done" counter: the last tells every peer this rank finished touching their memory (the
// buffer-reuse handshake of the next call).
#include "comm_blocks.cuh"
#include "launch.h"

namespace comet::gpu {
namespace {

constexpr int kThreads = kCombineThreads;

__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ CallParams p) {
  const DeviceState* st = p.state;
  const uint64_t epoch = st->epoch;
  if (st->status == int32_t(CallStatus::Ok) && p.mode != int32_t(BenchMode::GemmOnly)) {
    CommContext ctx(p, int32_t(blockIdx.x), int32_t(gridDim.x), epoch, /*wait_source_data=*/false,
                    nullptr);
    layer1_combine(ctx, layer1_comm_args(p, epoch));
  }
  __syncthreads();
  if (threadIdx.x == 0)
    arrive_and_publish(&p.state->comm_done, gridDim.x, p.headers[p.rank]->done_epoch, epoch);
}

}  // namespace

void launch_combine(const CallParams& p, int grid, cudaStream_t stream) {
  if (!p.topo.reduces_nodes()) {  // no block waits on another block of this grid
    combine_kernel<<<grid, kThreads, 0, stream>>>(p);
    return;
  }
  // Node-reduced: every block relays its share, then waits for the other nodes' relays, which
  // wait for all of ours: in effect a barrier across the grid, so every block must be resident
  // at once. A cooperative launch guarantees that (a plain launch beside another kernel holding
  // SMs could leave blocks unscheduled behind spinning ones: a hang); the grid is clamped to what
  // fits, and the combine program splits its work by gridDim, so any size is correct.
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, combine_kernel, kThreads, 0);
  if (e != cudaSuccess) return;  // reported by the caller's cudaGetLastError
  const int fits = per_sm * (sms - p.sm_margin > 1 ? sms - p.sm_margin : 1);  // the call's margin
  CallParams args = p;
  void* argv[] = {&args};
  cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&combine_kernel),
                              dim3(grid < fits ? grid : fits), dim3(kThreads), argv, 0, stream);
}

cudaError_t preload_combine_kernel() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&combine_kernel));
}

}  // namespace comet::gpu
