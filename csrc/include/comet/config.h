// Compile-target macros shared by every portable header of the engine.
// The same headers are compiled by g++ (CPU backend, C++ unit tests) and by nvcc (CUDA kernels);
// COMET_HD marks code that must run on both.
#pragma once

#include <cstddef>
#include <cstdint>

// COMET_LAMBDA_INLINE: a lambda the callers' kernels must inline (after the parameter list). A
// CUDA kernel with wgmma must contain no real call (csrc/cuda/gpu_context.cuh), and whether a
// lambda's call is inlined is otherwise the compiler's choice, which a larger body (a fused
// epilogue) can tip.
#if defined(__CUDACC__)
#define COMET_HD __host__ __device__ __forceinline__
#define COMET_DEVICE_CODE 1
#define COMET_LAMBDA_INLINE __attribute__((always_inline))
#else
#define COMET_HD inline
#define COMET_DEVICE_CODE 0
#define COMET_LAMBDA_INLINE
#endif

namespace comet {

// Element kinds the ops accept. The numbers are part of the symmetric-memory metadata that ranks
// compare with each other, so they never change meaning. F64 exists for the CPU backend only (exact
// gradient checks); it accumulates in double. F8E4M3 (float8_e4m3fn) always comes with fp32 block
// scales (comet/fp8_rows.h).
enum class ScalarKind : int32_t { F32 = 0, BF16 = 1, F16 = 2, F64 = 3, F8E4M3 = 4 };

COMET_HD int32_t scalar_bytes(ScalarKind k) {
  return k == ScalarKind::F64 ? 8 : k == ScalarKind::F32 ? 4 : k == ScalarKind::F8E4M3 ? 1 : 2;
}

COMET_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace comet
