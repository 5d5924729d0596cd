// comet.fp8's quantisers (torch.ops.comet.fp8_quantize_rows / fp8_quantize_blocks), written once
// with ATen so that the Python API and the ops' own quantisation on the sending side (moe_layer0's
// dispatch_fp8) produce the same bits on any device.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace comet {

// x [T, H] -> (q [T, H] float8_e4m3fn, scale [T, ceil(H/128)] float32).
std::tuple<at::Tensor, at::Tensor> fp8_quantize_rows(const at::Tensor& x);
// w [E, N, K] -> (q [E, N, K] float8_e4m3fn, scale [E, ceil(N/128), ceil(K/128)] float32).
std::tuple<at::Tensor, at::Tensor> fp8_quantize_blocks(const at::Tensor& w);
// q and scale as the packed rows of comet/fp8_rows.h: uint8 [T, fp8_row_bytes(H)].
at::Tensor fp8_pack_rows(const at::Tensor& q, const at::Tensor& scale);

}  // namespace comet
