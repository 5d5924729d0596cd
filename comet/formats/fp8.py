"""The FP8 format comet's ops take (docs/api.md, "FP8"); comet.fp8 is its public face.

A value is ``q.float() * scale`` of its block: ``q`` float8_e4m3fn, ``scale`` float32 =
amax / 448 of the block (448: e4m3fn's largest finite value; an all-zero block gets scale 1).

* activations, one scale per row and 128 columns: :func:`quantize_rows` ``x [T, H]`` ->
  ``(q [T, H], scale [T, ceil(H/128)])``;
* weights, one scale per 128 x 128 block: :func:`quantize_blocks` ``w [E, N, K]`` ->
  ``(q [E, N, K], scale [E, ceil(N/128), ceil(K/128)])``.

The quantisers are the ops ``torch.ops.comet.fp8_quantize_rows / fp8_quantize_blocks`` (ATen, any
device). moe_layer0's sending side for ``dispatch_fp8=True`` quantises and packs each row in one
pass (the CPU backend's loop, one CUDA kernel on the GPU) with the arithmetic of
csrc/include/comet/fp8_rows.h, which gives the same bits (tests/test_fp8.py holds its rounding to
torch's conversion for every bfloat16 value and the one-pass rows to quantize_rows').

Packed rows: with FP8 token rows on the wire, moe_layer0's ``a`` output (the dispatched rows) holds
each row's values and scales together, uint8 ``[rows, row_bytes(H)]`` (csrc/include/comet/
fp8_rows.h); :func:`unpack_rows` splits them.

This module sits below the ops (comet.layers.ops sizes the packed rows with it, the autograd
dequantises the saved FP8 tensors with it) and imports nothing of comet but the compiled core.
"""
from __future__ import annotations

import torch

from comet._native import _C  # registers the ops; _C.engine: the packed rows' geometry

__all__ = ["BLOCK", "FP8_MAX", "DTYPE", "dequantize_blocks", "dequantize_rows", "quantize_blocks",
           "quantize_rows", "row_bytes", "unpack_rows"]

BLOCK = 128
FP8_MAX = 448.0
DTYPE = torch.float8_e4m3fn


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (float32/bfloat16/float16/float64) -> (q [T, H] float8_e4m3fn, scale [T, ceil(H/128)]
    float32), one scale per row and 128 columns (the last block may be narrower)."""
    return torch.ops.comet.fp8_quantize_rows(x)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (q [E, N, K] float8_e4m3fn, scale [E, ceil(N/128), ceil(K/128)] float32), one
    scale per 128 x 128 block (edge blocks may be smaller)."""
    return torch.ops.comet.fp8_quantize_blocks(w)


def _expand(scale: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, n)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of quantize_rows' output: q [T, H] * its 1 x 128 scales, in `dtype` (computed in
    fp32, rounded once)."""
    return (q.float() * _expand(scale, 1, q.shape[1])).to(dtype)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of quantize_blocks' output: q [E, N, K] * its 128 x 128 scales, in `dtype`."""
    s = _expand(_expand(scale, 1, q.shape[1]), 2, q.shape[2])
    return (q.float() * s).to(dtype)


def row_bytes(hidden: int) -> int:
    """Bytes of one packed FP8 row of `hidden` values (comet/fp8_rows.h, the one definition): the
    values, padded to 4 bytes, then their ceil(H/128) fp32 scales, padded to a multiple of 16
    bytes."""
    return int(_C.engine.fp8_row_bytes(hidden))


def unpack_rows(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows uint8 [R, row_bytes(H)] (moe_layer0's `a` with FP8 rows) -> (q [R, H]
    float8_e4m3fn, scale [R, ceil(H/128)] float32), copies."""
    nb, at = -(-hidden // BLOCK), int(_C.engine.fp8_row_scales_at(hidden))
    scale = rows[:, at:at + 4 * nb].contiguous().view(torch.float32)
    q = rows[:, :hidden].contiguous().view(DTYPE)
    return q, scale
