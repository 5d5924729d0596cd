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
  combine_kernel<<<grid, kThreads, 0, stream>>>(p);
}

cudaError_t preload_combine_kernel() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&combine_kernel));
}

}  // namespace comet::gpu
