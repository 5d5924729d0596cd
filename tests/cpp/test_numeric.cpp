// fp32 <-> bf16/fp16 conversions of the engine (csrc/include/comet/numeric.h), and the fused
// activations (csrc/include/comet/activation.h) at values known from their definitions.
#include <cmath>
#include <cstring>
#include <vector>

#include "check.h"
#include "comet/activation.h"
#include "comet/numeric.h"

using namespace comet;

int main() {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_f16(1.0f) == 0x3c00);
  CHECK(float_to_f16(65504.0f) == 0x7bff);
  CHECK(float_to_f16(70000.0f) == 0x7c00);   // overflow -> inf
  CHECK(float_to_f16(-2.0f) == 0xc000);
  CHECK(float_to_f16(5.9604645e-8f) == 0x0001);  // smallest subnormal
  CHECK(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  CHECK(std::isnan(f16_to_float(float_to_f16(NAN))));
  // Round to nearest even: 1 + 2^-8 is halfway between two bf16 values, ties to even (1.0).
  CHECK(float_to_bf16(1.0f + 1.0f / 256) == 0x3f80);
  CHECK(float_to_bf16(1.0f + 3.0f / 256) == 0x3f82);
  // Every fp16 value round-trips exactly through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t b = uint16_t(h);
    const float f = f16_to_float(b);
    if (std::isnan(f)) continue;
    CHECK(float_to_f16(f) == b);
  }
  // Every bf16 value too.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_float(uint16_t(h));
    if (std::isnan(f)) continue;
    CHECK(float_to_bf16(f) == uint16_t(h));
  }
  // float8_e4m3fn (the FP8 ops' values): exact widening, no infinity, S.1111.111 is NaN.
  CHECK(fp8e4m3_to_float(0x38) == 1.0f);
  CHECK(fp8e4m3_to_float(0x7e) == 448.0f);                 // the largest finite value
  CHECK(fp8e4m3_to_float(0x08) == std::ldexp(1.0f, -6));   // the smallest normal
  CHECK(fp8e4m3_to_float(0x01) == std::ldexp(1.0f, -9));   // the smallest subnormal
  CHECK(fp8e4m3_to_float(0xb8) == -1.0f);
  CHECK(std::isnan(fp8e4m3_to_float(0x7f)) && std::isnan(fp8e4m3_to_float(0xff)));
  for (uint32_t b = 1; b < 0x7f; ++b)  // positive codes in increasing order of value
    CHECK(fp8e4m3_to_float(uint8_t(b)) > fp8e4m3_to_float(uint8_t(b - 1)));
  // Activations in double against their closed forms: silu(1) = 1 / (1 + 1/e),
  // gelu(1) = (1 + erf(1 / sqrt 2)) / 2 = Phi(1) = 0.8413447460685429...
  const double e = 2.718281828459045;
  CHECK(std::fabs(silu(1.0) - 1.0 / (1.0 + 1.0 / e)) < 1e-15);
  CHECK(std::fabs(gelu(1.0) - 0.8413447460685429) < 1e-15);
  CHECK(silu(0.0) == 0.0 && gelu(0.0) == 0.0 && gelu(-40.0) == -0.0);
  CHECK(activate(Activation::SwiGLU, 2.0, 3.0) == silu(2.0) * 3.0);
  CHECK(activate(Activation::GeGLU, 2.0, 3.0) == gelu(2.0) * 3.0);
  CHECK(activate(Activation::SiLU, 2.0, 3.0) == silu(2.0));
  CHECK(activate(Activation::GeLU, 2.0, 3.0) == gelu(2.0));
  // The pairing rule: w0 = [gate; up], F = N0 / 2 columns of h for the gated forms.
  CHECK(activation_cols(Activation::SwiGLU, 10) == 5 && activation_cols(Activation::GeLU, 10) == 10);
  CHECK(activation_gate_col(3) == 3 && activation_up_col(3, 5) == 8);
  // The B-row remap, against the rule written out: for every F (odd ones included), tile width
  // (a CPU tile's h columns, or the CUDA tile's 64) and tile origin, B row i < half loads gate
  // row j0 + i, B row half + i the up row F + j0 + i, in range exactly when j0 + i < F; over
  // all tiles each w0 row is loaded in range exactly once.
  for (int64_t f = 1; f <= 70; f += 3)
    for (int64_t half : {1, 4, 7, 64}) {
      std::vector<int> loads(size_t(2 * f), 0);
      for (int64_t j0 = 0; j0 < f; j0 += half)
        for (int64_t i = 0; i < 2 * half; ++i) {
          const int64_t col = i % half, want = (i < half ? 0 : f) + j0 + col;
          CHECK(activation_b_row(i, half, f, j0) == want);
          CHECK(activation_b_row_valid(i, half, f, j0) == (j0 + col < f));
          if (j0 + col < f) ++loads[size_t(want)];
        }
      for (int n : loads) CHECK(n == 1);
    }
  // Plain forms: half = the tile's width, F = N0: row j0 + i, in range while j0 + i < N0.
  CHECK(activation_b_row(5, 8, 9, 16) == 21 && activation_b_row_valid(5, 8, 30, 16));
  CHECK(!activation_b_row_valid(5, 8, 21, 16));
  CHECK(activation_from_name("geglu", 5) == int32_t(Activation::GeGLU));
  CHECK(activation_from_name("relu", 4) == -1 && activation_from_name("silu2", 5) == -1);
  TEST_MAIN_END
}
