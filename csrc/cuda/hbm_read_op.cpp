// torch.ops.comet_cuda.hbm_read_bench: times hbm_read.cu's kernel with CUDA events on the current
// stream, one launch per iteration; returns each launch's milliseconds (tools/hbm_stream.py).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "hbm_read.h"

namespace comet::gpu {
namespace {

std::vector<double> hbm_read_bench(const at::Tensor& src, int64_t blocks, int64_t threads,
                                   int64_t loads, int64_t iters) {
  TORCH_CHECK(src.is_cuda() && src.is_contiguous(),
              "hbm_read_bench: src must be a contiguous CUDA tensor, got ", src.device(),
              src.is_contiguous() ? "" : " (not contiguous)");
  const int64_t bytes = src.numel() * src.element_size() / 16 * 16;
  TORCH_CHECK(bytes >= 16, "hbm_read_bench: src holds ", src.nbytes(), " bytes, fewer than 16");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0,
              "hbm_read_bench: src must be 16-byte aligned");
  TORCH_CHECK(blocks >= 1 && blocks <= 65535, "hbm_read_bench: blocks = ", blocks,
              ", expected 1 to 65535");
  TORCH_CHECK(threads >= 32 && threads <= 256 && threads % 32 == 0,
              "hbm_read_bench: threads = ", threads, ", expected a multiple of 32 up to 256");
  TORCH_CHECK(loads == 1 || loads == 2 || loads == 4 || loads == 8, "hbm_read_bench: loads = ",
              loads, ", expected 1, 2, 4 or 8");
  TORCH_CHECK(iters >= 1, "hbm_read_bench: iters = ", iters, ", expected at least 1");
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaDeviceProp& prop = *at::cuda::getDeviceProperties(src.get_device());
  // More than half an SM's shared memory per block: at most one block per SM, as the fused
  // kernels' GEMM blocks.
  const size_t smem = prop.sharedMemPerMultiprocessor / 2 + 1024;
  TORCH_CHECK(smem <= prop.sharedMemPerBlockOptin, "hbm_read_bench: ", smem,
              " bytes of shared memory per block exceed this GPU's ", prop.sharedMemPerBlockOptin);
  const at::Tensor sink = at::empty({blocks}, src.options().dtype(at::kInt));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(src.get_device());
  std::vector<cudaEvent_t> ev(size_t(2 * iters));
  for (auto& e : ev) C10_CUDA_CHECK(cudaEventCreate(&e));
  cudaError_t err = cudaSuccess;
  for (int64_t i = 0; i < iters && err == cudaSuccess; ++i) {
    C10_CUDA_CHECK(cudaEventRecord(ev[size_t(2 * i)], stream));
    err = launch_hbm_read(src.data_ptr(), bytes, reinterpret_cast<uint32_t*>(sink.data_ptr()),
                          int(blocks), int(threads), int(loads), smem, stream);
    C10_CUDA_CHECK(cudaEventRecord(ev[size_t(2 * i + 1)], stream));
  }
  std::vector<double> ms;
  if (err == cudaSuccess) err = cudaEventSynchronize(ev.back());
  for (int64_t i = 0; i < iters && err == cudaSuccess; ++i) {
    float t = 0.f;
    err = cudaEventElapsedTime(&t, ev[size_t(2 * i)], ev[size_t(2 * i + 1)]);
    ms.push_back(double(t));
  }
  for (auto& e : ev) (void)cudaEventDestroy(e);
  TORCH_CHECK(err == cudaSuccess, "hbm_read_bench: ", cudaGetErrorString(err));
  return ms;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(comet_cuda, m) {
  m.def("hbm_read_bench(Tensor src, int blocks, int threads, int loads, int iters) -> float[]",
        &hbm_read_bench);
}

}  // namespace comet::gpu
