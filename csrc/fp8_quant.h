// comet.fp8's quantisers (torch.ops.comet.fp8_quantize_rows / fp8_quantize_blocks), written with
// ATen for the Python API on any device; and the ops' own quantisation on the sending side
// (moe_layer0's dispatch_fp8), which writes the packed rows in one pass with the portable
// arithmetic of comet/fp8_rows.h (the CPU loop below; csrc/cuda/fp8_pack.cu on the GPU). The two
// give the same bits (tests/test_fp8.py checks the arithmetic against torch's conversion).
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
// A CPU x [T, H] (16/32/64-bit float) quantised straight into its packed rows (dispatch_fp8's
// sending side on the CPU backend): the bits of fp8_pack_rows(fp8_quantize_rows(x)).
at::Tensor fp8_quantize_pack_rows(const at::Tensor& x);

}  // namespace comet
