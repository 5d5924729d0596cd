"""FP8 in the cost model (``MoEShape.dtype_bytes = 1``): layer0's rows carry H bytes plus
4 ceil(H / 128) scale bytes; layer1's partials stay bf16 (the output dtype); the GEMM runs at
``GpuSpec.fp8_tflops`` (the datasheets' dense FP8 figure, 2x bf16 on sm_90) on FP8 operands with
their scales and a bf16 output, plus the blockwise scaling's promotion on the CUDA cores:

* What the kernels do.  Both FP8 kernels run each 128-wide k-tile (exactly one scale block,
  ``FP8_SCALE_BLOCK``) into a partial accumulator on the tensor cores and then promote it into
  the fp32 accumulator with one FP32 FMA per accumulator element, ``acc += partial * scale``.
  sm_90a (csrc/cuda/fused_sm90.cuh, ``Fp8GemmConfig``: CUTLASS's blockwise FP8 mainloop, tiles
  128 x 128 x 128): ``mma()`` of sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp
  issues the k-tile's wgmmas into the partial (``ScaleOut::Zero`` first: a fresh partial per
  k-tile, since ``ScalePromotionInterval = 128 / 32 = 4`` MMAs is one k-tile), then
  ``warpgroup_wait<0>()``, then ``GmmaFP8Accumulation::scale_core`` (fp8_accumulation.hpp):
  ``accum(i) += accum_temp(i) * scale(i)`` for every element, the row's A scale already
  multiplied by the tile's B scale (``ScaleMsPerTile = 128``, ``ScaleNsPerTile = 1``: a few
  multiplies per thread, not per element).  sm_89 (csrc/cuda/sm89_fp8_tile_gemm.cuh):
  ``acc(i) = fmaf(part(i), row_scale * b_scale, acc(i))`` per element after each k-tile's
  mma.sync (the scale product is per row, shared by a thread's elements of that row).
* Why it is not overlapped with the tensor cores.  The sm_90a kernel uses the cooperative
  schedule (``KernelTmaWarpSpecializedCooperativeFP8Blockwise``): both MMA warpgroups compute
  halves of the same tile from the same pipeline stage, so they reach the promotion together,
  and each must wait for its wgmmas (the FMAs read the partial they write) and must finish the
  FMAs before issuing the next k-tile's wgmmas (which overwrite that partial).  So while an SM
  promotes, none of its wgmmas is in flight (only the ping-pong schedule, which staggers two
  warpgroups on different tiles, would hide it).  On sm_89 a warp's FMAs likewise wait for its
  mma.sync results and precede its next k-tile's; other warps may overlap, so there the charge
  is an upper bound (3% of the k-tile, below).
* The charge.  An FP8 GEMM ``[M, N, K]`` costs
  ``2 M N K / (fp8_rate * gemm_eff) + FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK * M N ceil(K / 128)
  / fma_rate`` with ``fma_rate = GpuSpec.fma_rate`` (``fp32_tflops / 2``: the datasheets count an
  FMA as 2 FLOPs), i.e. a tile costs ``t_tile + tile_m tile_n ceil(K / 128) / (fma_rate /
  sm_count)`` on its SM (``gemm_eff`` stays on the tensor-core part).  Per 128 x 128 x 128
  k-tile at peak rates the promotion takes ``(128 * 128 / (67e12 / 2)) / (2 * 128^3 / 1979e12)
  = 0.49 ns / 2.12 ns = 0.23`` of the tensor-core time on H100 / H800 / H200 (0.17 of the
  modelled k-tile at gemm_eff 0.75), H20 ``(128^2 / 22e12) / (2 * 128^3 / 296e12) = 0.05``, L20
  ``(128^2 / 29.9e12) / (2 * 128^3 / 239e12) = 0.03`` (FP8 tensor-core FLOP/s are 30x the FP32
  FLOP/s on H100, 4x on L20).
* Not charged: GPUs without FP8 tensor cores (``fp8_tflops`` None: no FP8 kernel; the bf16 rate
  stands for a loader that dequantises) and the CPU backend's pseudo-spec
  (``fp8_promotion=False``: its tile, csrc/cpu/tile_gemm.h, does the block scaling with the same
  fp32 units as every other multiply-add, one more per 128 of the dot product, inside its
  figure).

Bytes on the links and in HBM (the functions below).  The ops' format (docs/api.md, "FP8"): x / h
in float8 (e4m3 or e5m2, 1 byte) with one float32 scale per 1 x 128 values of a row; weights in
float8 with one float32 scale per 128 x 128 block; the GEMM accumulates in fp32 and writes its
output in bf16 (the default out_dtype).  So:
* a layer0 row on the links (and its local copy) is H bytes + 4 ceil(H / 128) scale bytes:
  (H + 4 H / 128) / (2 H) = 0.516 of bf16's bytes for H a multiple of 128;
* layer1 sends its partial rows in the output dtype, bf16 (2 H bytes: what it sends today), so
  FP8 leaves layer1's link bytes unchanged; only its GEMM's operands (h, w1) shrink;
* the GEMM runs at GpuSpec.fp8_tflops (sm_90: 2x bf16, datasheet; sm_80: no FP8 tensor cores,
  the bf16 rate) with the same gemm_eff, plus the promotion of its fp32 accumulators after
  every 128 K values: FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK FP32 FMA per output element on
  the CUDA cores, not overlapped with the tensor cores (derived above);
* its HBM operand bytes: A (K + 4 ceil(K / 128) per row), the weights (1 byte + 4 per 128 x 128
  block), the output in bf16;
* the backward runs in bf16 (the saved FP8 inputs are dequantised), so
  :func:`predict_backward` models it at bf16.
"""

from __future__ import annotations

import math

FP8_SCALE_BLOCK = 128  # values per scale along a row (1 x 128) and per weight block side (128 x 128)
FP8_SCALE_BYTES = 4  # a float32 scale
FP8_OUT_BYTES = 2  # the GEMM output / layer1 partials: bfloat16 (out_dtype's default)
# FP32 FMAs per output element per FP8_SCALE_BLOCK of K that the FP8 kernels run on the CUDA cores
# to promote a k-tile's tensor-core partial (acc += partial * scale; see the module docstring)
FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK = 1


def fp8_promotion_charged(shape: "MoEShape", spec: "GpuSpec") -> bool:
    """Whether ``shape``'s GEMM on ``spec`` pays the promotion: FP8 operands on FP8 tensor cores
    (not the bf16 rate of a GPU without them, nor the CPU backend's tile)."""
    return shape.is_fp8 and spec.fp8_tflops is not None and spec.fp8_promotion


def fp8_promotion_seconds(m: float, n: float, k: int, fma_rate: float) -> float:
    """Seconds of the promotion of an ``[m, n, k]`` FP8 GEMM's accumulators at ``fma_rate``
    FMA/s: one FMA per output element and 128-wide K block."""
    return FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK * m * n * math.ceil(k / FP8_SCALE_BLOCK) / fma_rate


def fp8_scale_bytes(n: int) -> int:
    """Scale bytes that travel with an FP8 row of ``n`` values: one float32 per 128."""
    return FP8_SCALE_BYTES * math.ceil(n / FP8_SCALE_BLOCK)


def _out_row_bytes(shape: "MoEShape") -> int:
    """Bytes of one GEMM output row of H elements (layer1's partial before it is sent; the
    combine's output row): bf16 for FP8 operands, else the activation dtype."""
    return shape.H * FP8_OUT_BYTES if shape.is_fp8 else shape.row_bytes


def _fp8_gemm_bytes(shape: "MoEShape", m: float, experts: int, n_out: int, k_red: int,
                    sweeps: float) -> float:
    """HBM bytes of an FP8 grouped GEMM (module doc): A with its row scales, the weights with
    their block scales, the bf16 output."""
    a = m * (k_red + fp8_scale_bytes(k_red))
    w = experts * (n_out * k_red + FP8_SCALE_BYTES * math.ceil(n_out / FP8_SCALE_BLOCK)
                   * math.ceil(k_red / FP8_SCALE_BLOCK))
    return sweeps * a + w + FP8_OUT_BYTES * m * n_out
