// The operator schemas: the one place torch.ops.comet.* is defined. Kernels live per backend
// (cpu/ops_cpu.cpp, cuda/), fake kernels and autograd are registered from Python (comet/layers/ops.py).
//
// moe_layer0 also returns `a`, the dispatched token rows [M, H] (the shared tensor its GEMM
// reads): backward needs them for the weight gradient and they exist anyway.
//
// `buffer` is the handle of the comet.Buffer (symmetric memory + group) the call communicates
// through. n_gemm = 0 means "every block not used for communication" (all SMs on a GPU).
//
// Optional, last so that older callers keep working:
//   b0 [E_local, N0] / b1 [E_local, H]: expert biases added to the GEMM result in fp32 before it
//     is rounded (layer0) or weighted by the slot's top-k weight (layer1);
//   w0_transposed / w1_transposed: the weights come as [E_local, H, N0] / [E_local, N1, H]
//     (GPT-OSS's layout, or another op's weight read without a copy, as backward does);
//   max_rows >= 0: an upper bound on this call's dispatched rows M on every rank of the group.
//     The row-indexed outputs of layer0 (y0, a, row_*) then have max_rows rows (rows >= M: zero on
//     the CPU backend, unspecified on CUDA) and layer1 takes h with max_rows rows, so shapes are
//     static (CUDA-graph capture, torch.compile without data-dependent sizes). -1: no bound.
//   tp_size >= 1: expert tensor parallelism (comet/layout.h, docs/api.md): the group is
//     TP-innermost, EP = W / tp_size ranks hold E / EP experts each, every rank a shard of them
//     (w0 [E_local, N0/tp, H], w1 [E_local, H, N1/tp]); layer0 gives the tp ranks of an EP rank
//     the same rows, layer1 sums the tp partial rows at the token's home (b1 added once).
//   band_n >= 0 (layer1): n-tiles per column band of its GEMM (comet/tile_order.h): h is read
//     from HBM once per band, a band is handed to the reduce-and-send as a unit; 0 = all n-tiles
//     in one band. The result does not depend on it (the reduction order is fixed).
//   FP8 (comet/fp8_rows.h, docs/api.md): x / h / w0 / w1 may be float8_e4m3fn with their float32
//     block scales x_scale [T, ceil(H/128)], h_scale [rows of h, ceil(N1/128)], w0_scale
//     [E_local, ceil(N0/128), ceil(H/128)], w1_scale [E_local, ceil(H/128), ceil(N1/128)];
//     out_dtype: of y0 / out (default bfloat16 when an input is FP8); dispatch_fp8: a 16/32-bit x
//     is quantised on the sending side and travels as FP8 rows with their scales. With FP8 rows on
//     the wire, layer0's `a` is the packed rows, uint8 [rows, fp8_row_bytes(H)].
//   sm_margin >= 0: SMs (CPU: resident-block slots) the call's fused kernel and the kernels
//     whose blocks wait on each other (prologue, combine) leave free for other kernels of the
//     device that peers may wait on (a collective, another buffer's call); -1: the buffer's
//     setting (Buffer(sm_margin=)). The result does not depend on it.
//
//   activation (layer0): "swiglu" / "geglu" / "silu" / "gelu" fused into the GEMM's epilogue
//     (comet/activation.h): y0 is then h, [M, N0/2] for the gated forms (w0 = [gate; up]) or
//     [M, N0], computed from the fp32 accumulators (bias added) and rounded once. CUDA: the
//     16-bit kernels of both paths and the sm_89 FP8 kernel; FP8 on sm_90 is refused (the
//     comet.moe_layer0 wrapper applies it after the op there).
//   h_fp8 (layer0, with an activation): h is emitted quantised, as FP8 packed rows uint8
//     [rows, fp8_row_bytes(cols)] (values and 1 x 128 scales, comet/fp8_rows.h: quantize_rows'
//     bits of the fp32 h); rows past M (max_rows) hold zeros with scale 1 on the CPU backend,
//     unspecified on CUDA. CUDA: the sm_80 path and sm_89; refused on sm_90.
//
// fp8_quantize_rows / fp8_quantize_blocks: comet.fp8's quantisers (csrc/fp8_quant.cpp).
#include <torch/library.h>

TORCH_LIBRARY(comet, m) {
  m.def(
      "moe_layer0(Tensor x, Tensor w0, Tensor topk_ids, int num_experts, int buffer, int n_comm, "
      "int n_gemm, int tile_m, int tile_n, Tensor? b0=None, bool w0_transposed=False, "
      "int max_rows=-1, int tp_size=1, Tensor? x_scale=None, Tensor? w0_scale=None, "
      "ScalarType? out_dtype=None, bool dispatch_fp8=False, str? activation=None, bool h_fp8=False, int sm_margin=-1) -> (Tensor y0, Tensor a, Tensor recv_counts, "
      "Tensor send_pos, Tensor row_source, Tensor row_token, Tensor row_slot)");
  m.def(
      "moe_layer1(Tensor h, Tensor w1, Tensor topk_weights, Tensor topk_ids, Tensor send_pos, "
      "Tensor recv_counts, int num_experts, int buffer, int n_comm, int n_gemm, int tile_m, "
      "int tile_n, Tensor? b1=None, bool w1_transposed=False, int max_rows=-1, int band_n=1, "
      "int tp_size=1, Tensor? h_scale=None, Tensor? w1_scale=None, ScalarType? out_dtype=None, "
      "int sm_margin=-1) -> Tensor");
  m.def("fp8_quantize_rows(Tensor x) -> (Tensor q, Tensor scale)");
  m.def("fp8_quantize_blocks(Tensor w) -> (Tensor q, Tensor scale)");
}
