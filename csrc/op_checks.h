// Input checks shared by the CPU and CUDA kernels of both ops. They never throw: the verdict goes
// into the call metadata so every rank of the group raises (a local throw would leave the peers
// waiting). `code` is 0 (fine), 1 (ValueError) or 2 (TypeError).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "comet/config.h"

namespace comet {

struct CheckResult {
  int32_t code = 0;
  std::string message;
  bool ok() const { return code == 0; }
};

struct Layer0Inputs {
  const at::Tensor& x;
  const at::Tensor& w0;
  const at::Tensor& topk_ids;
  int64_t num_experts;
};

struct Layer1Inputs {
  const at::Tensor& h;
  const at::Tensor& w1;
  const at::Tensor& topk_weights;
  const at::Tensor& topk_ids;
  const at::Tensor& send_pos;
  const at::Tensor& recv_counts;
  int64_t num_experts;
};

struct LaunchShape {
  int64_t n_comm, n_gemm, tile_m, tile_n;
};

// device: the device every tensor must be on (the backend's).
CheckResult check_layer0(const Layer0Inputs& in, int64_t world, const LaunchShape& launch,
                         at::DeviceType device);
CheckResult check_layer1(const Layer1Inputs& in, int64_t world, const LaunchShape& launch,
                         at::DeviceType device);

ScalarKind scalar_kind(at::ScalarType t);  // for a dtype that passed the checks

}  // namespace comet
