"""The activation between the two ops in the cost model (comet.tune.perfmodel): separate, or
fused into layer0's epilogue (``moe_layer0(activation=)``, docs/design.md "The fused activation").

Separate, it is a kernel of its own after layer0: a launch (``KERNEL_GAP_S``) plus reading
``y0 [M, N0]`` and writing ``h [M, F]`` at the achievable HBM bandwidth (an elementwise kernel is
bound by its bytes; ``F = N0 / 2`` for the gated forms, ``N0`` for the plain ones)::

    separate = KERNEL_GAP_S + b M (N0 + F) / hbm

Fused, layer0's GEMM computes the same FLOPs (both accumulators of every output column) and
writes ``h`` instead of ``y0``: ``b M (N0 - F)`` bytes fewer (:func:`gemm_time`'s output term,
:func:`_gemm_unique_bytes`), which shortens it only where it is bound by its bytes; the separate
kernel is gone.  So the fused layer0 is :func:`predict`'s layer0 with its GEMM's memory term
recomputed for an ``F``-column output, and nothing after it::

    fused = layer0(y0 -> h written)        unfused = layer0 + separate

M is the layer's expected rows per rank (``expert_rows``: measured, else uniform routing).
These are model figures, not measurements: the CUDA epilogue is built for the sm_80 path's and
the sm_89 FP8 kernels (compiled, never run on a GPU) and not for sm_90a (docs/design.md), so the
fused column is what the model predicts for it.
"""

from __future__ import annotations

import math

from .comm import KERNEL_GAP_S
from .fp8 import FP8_OUT_BYTES
from .gemm import (DEFAULT_TILE, _gemm_unique_bytes, _tile_seconds, a_sweeps, gemm_tiles,
                   weight_reads)
from .hardware import GpuSpec
from .pipeline import predict
from .shape import MoEShape, expert_rows


def activation_cols(n0: int, gated: bool = True) -> int:
    """Columns of h for layer0's ``n0`` GEMM columns."""
    return n0 // 2 if gated else n0


def activation_kernel_time(shape: MoEShape, spec: GpuSpec, gated: bool = True) -> float:
    """Seconds of the separate activation kernel after layer0 (``shape``: layer0's, ``N = N0``):
    a launch, ``y0`` read and ``h`` written."""
    m = sum(expert_rows(shape))
    n0 = shape.N
    return KERNEL_GAP_S + shape.dtype_bytes * m * (n0 + activation_cols(n0, gated)) / spec.hbm_bw


def predict_activation(shape: MoEShape, spec: GpuSpec, n_comm: int, gated: bool = True,
                       tile=DEFAULT_TILE) -> dict:
    """layer0 with the activation separate and fused (seconds): ``layer0`` (its fused kernel, as
    :func:`predict`), ``activation`` (the separate kernel), ``unfused`` (the two), ``fused``
    (layer0 writing h from its epilogue) and ``saved_bytes`` (HBM bytes the fusion removes:
    y0 written and read back)."""
    p = predict(shape, spec, n_comm, 0, tile=tile)
    act = activation_kernel_time(shape, spec, gated)
    m = sum(expert_rows(shape))
    n0 = shape.N
    out_b = FP8_OUT_BYTES if shape.is_fp8 else shape.dtype_bytes
    # layer0's GEMM with an F-column output: the same tiles of work (both accumulators of each
    # output column), out_b M (N0 - F) bytes fewer written (gemm_time's roofline otherwise)
    n_gemm, band = p["n_gemm"], 1
    per_col, cols = gemm_tiles(shape, 0, tile)
    compute = math.ceil(per_col * cols / n_gemm) * _tile_seconds(shape, spec, 0, tile)
    bytes_fused = _gemm_unique_bytes(shape, 0, a_sweeps(shape, spec, 0, tile, band),
                                     weight_reads(shape, spec, 0, n_gemm, tile, band)) \
        - out_b * m * (n0 - activation_cols(n0, gated))
    gemm_fused = max(compute, bytes_fused / (spec.hbm_bw * min(n_gemm, spec.sm_count)
                                             / spec.sm_count))
    # the GEMM's saving shortens the kernel at most by itself (the pipeline's other bound: comm)
    fused = p["fused"] - max(0.0, p["gemm"] - gemm_fused)
    fused = max(fused, p["prologue"] + p["comm"])
    return {"layer0": p["fused"], "activation": act, "unfused": p["fused"] + act,
            "fused": min(fused, p["fused"]), "saved_bytes": 2.0 * out_b * m * n0}
