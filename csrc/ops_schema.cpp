// The operator schemas: the one place torch.ops.comet.* is defined. Kernels live per backend
// (cpu/ops_cpu.cpp, cuda/), fake kernels and autograd are registered from Python (comet/ops.py).
//
// moe_layer0 also returns `a`, the dispatched token rows [M, H] (the shared tensor its GEMM
// reads): backward needs them for the weight gradient and they exist anyway.
//
// `buffer` is the handle of the comet.Buffer (symmetric memory + group) the call communicates
// through. n_gemm = 0 means "every block not used for communication" (all SMs on a GPU).
#include <torch/library.h>

TORCH_LIBRARY(comet, m) {
  m.def(
      "moe_layer0(Tensor x, Tensor w0, Tensor topk_ids, int num_experts, int buffer, int n_comm, "
      "int n_gemm, int tile_m, int tile_n) -> (Tensor y0, Tensor a, Tensor recv_counts, "
      "Tensor send_pos, Tensor row_source, Tensor row_token, Tensor row_slot)");
  m.def(
      "moe_layer1(Tensor h, Tensor w1, Tensor topk_weights, Tensor topk_ids, Tensor send_pos, "
      "Tensor recv_counts, int num_experts, int buffer, int n_comm, int n_gemm, int tile_m, "
      "int tile_n) -> Tensor");
}
