#include "fp8_quant.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "comet/fp8_rows.h"

namespace comet {
namespace {

constexpr double kFp8Max = 448.0;  // float8_e4m3fn's largest finite value

// amax / 448 of each block (reduced over `dims` of the blocked view), 1 where a block is all zero.
at::Tensor block_scales(const at::Tensor& blocks, at::IntArrayRef dims) {
  const at::Tensor scale = blocks.abs().amax(dims) / kFp8Max;
  return at::where(scale > 0, scale, at::ones_like(scale));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fp8_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2, "comet.fp8.quantize_rows: x must be 2-D [T, H], got shape ",
                    x.sizes());
  TORCH_CHECK_TYPE(x.is_floating_point() && x.element_size() >= 2,
                   "comet.fp8.quantize_rows: x must be float32/bfloat16/float16/float64, got ",
                   x.scalar_type());
  const int64_t T = x.size(0), H = x.size(1), nb = scale_blocks(H);
  const at::Tensor blocks =
      at::constant_pad_nd(x.to(at::kFloat), {0, nb * kScaleBlock - H}).view({T, nb, kScaleBlock});
  const at::Tensor scale = block_scales(blocks, {2});
  const at::Tensor q = (blocks / scale.unsqueeze(2)).to(at::kFloat8_e4m3fn);
  return {q.view({T, nb * kScaleBlock}).narrow(1, 0, H).contiguous(), scale};
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_blocks(const at::Tensor& w) {
  TORCH_CHECK_VALUE(w.dim() == 3,
                    "comet.fp8.quantize_blocks: w must be 3-D [E, N, K], got shape ", w.sizes());
  TORCH_CHECK_TYPE(w.is_floating_point() && w.element_size() >= 2,
                   "comet.fp8.quantize_blocks: w must be float32/bfloat16/float16/float64, got ",
                   w.scalar_type());
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  const int64_t nn = scale_blocks(N), nk = scale_blocks(K);
  const at::Tensor blocks =
      at::constant_pad_nd(w.to(at::kFloat), {0, nk * kScaleBlock - K, 0, nn * kScaleBlock - N})
          .view({E, nn, kScaleBlock, nk, kScaleBlock});
  const at::Tensor scale = block_scales(blocks, {2, 4});
  const at::Tensor q = (blocks / scale.view({E, nn, 1, nk, 1})).to(at::kFloat8_e4m3fn);
  return {q.view({E, nn * kScaleBlock, nk * kScaleBlock}).narrow(1, 0, N).narrow(2, 0, K)
              .contiguous(),
          scale};
}

at::Tensor fp8_pack_rows(const at::Tensor& q, const at::Tensor& scale) {
  const int64_t T = q.size(0), H = q.size(1), at_scales = fp8_row_scales_at(H);
  const int64_t scale_bytes = 4 * scale_blocks(H);
  at::Tensor rows = at::zeros({T, fp8_row_bytes(H)}, q.options().dtype(at::kByte));
  rows.narrow(1, 0, H).copy_(q.view(at::kByte));
  rows.narrow(1, at_scales, scale_bytes)
      .copy_(scale.contiguous().view(at::kByte).view({T, scale_bytes}));
  return rows;
}

at::Tensor fp8_quantize_pack_rows(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), nb = scale_blocks(H);
  at::Tensor rows = at::zeros({T, fp8_row_bytes(H)}, x.options().dtype(at::kByte));
  const int64_t rb = rows.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fp8_quantize_pack_rows",
                                  [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    uint8_t* rp = rows.data_ptr<uint8_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = xp + t * H;
        for (int64_t kb = 0; kb < nb; ++kb)
          quantize_pack_block([&](int64_t i) { return static_cast<float>(row[i]); }, H, kb,
                              rp + t * rb);
      }
    });
  });
  return rows;
}

TORCH_LIBRARY_IMPL(comet, CompositeImplicitAutograd, m) {
  m.impl("fp8_quantize_rows", &fp8_quantize_rows);
  m.impl("fp8_quantize_blocks", &fp8_quantize_blocks);
}

}  // namespace comet
