"""The backward of the fused ops in the cost model (comet.tune.perfmodel): a training step's
second half.

comet.layers.autograd's backward of one op (module doc there) is collective calls of the same fused
ops plus the weight-gradient GEMM, overlapped as Lancet does:

* layer0's backward (``shape.N = N0``): dx = a moe_layer1-type call (GEMM [M, N0] x [N0, H],
  reduce, combine home), i.e. :func:`predict` with layer=1 on the same shape; dW0 [E_l, N0, H]
  = dy0_e^T a_e runs beside it.
* layer1's backward (``shape.N = N1``): dh = a moe_layer0-type call (dispatch dout, GEMM
  [M, H] x [H, N1]): :func:`predict` with layer=0; the top-k weights go to the rows in a
  virtual-token moe_layer0 call and their gradients come home in a virtual-token moe_layer1 call
  (T k tokens of one slot and 8 elements); dW1 [E_l, H, N1] = (w dout)_e^T h_e runs beside the
  second one (it needs the first's row weights).

The weight gradient (:func:`weight_grad_time`) is one grouped GEMM on the whole GPU in the
activation dtype (tensor-core rate, fp32 accumulation): 2 M N H FLOPs per layer, the forward
GEMM's count (so a third of a step's expert FLOPs), reduced over each expert's M_e rows.  Its
output tiles are E_l * ceil(P / tile_m) * ceil(Q / tile_n), a tile of expert e costs
2 tile_m tile_n M_e / (per-SM rate); roofline with the operands read once (A rows, grad rows)
and the output written once::

    wgrad = max(max(sum of tile seconds / sm_count, longest tile), unique_bytes / hbm)

Overlap: the side-stream GEMM fills the time the collective waits on its links, but the two
share the tensor cores, so the pair takes at least the collective's GEMM on the whole GPU plus
the weight gradient, and at least the collective alone (``overlapped``); without overlap they
add up (``sequential``)::

    layer0: overlapped = max(dx, dx_gemm_full + dW0)
    layer1: overlapped = dh + vt_rows + max(vt_home, vt_home_gemm_full + dW1)

``overlapped`` is optimistic about SM sharing (the persistent fused kernel holds every SM while
it runs; the side stream's blocks get SMs only as it frees them), ``sequential`` pessimistic.
Each collective call gets the n_comm :func:`choose_n_comm` picks for it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, Optional

from .gemm import DEFAULT_TILE, _sm_flops, _tile
from .hardware import GpuSpec
from .pipeline import choose_n_comm, predict
from .shape import MoEShape, _check_layer, expert_rows

def weight_grad_time(shape: MoEShape, spec: GpuSpec, layer: int, tile=DEFAULT_TILE,
                     out_bytes: Optional[int] = None) -> float:
    """Seconds of ``layer``'s weight-gradient grouped GEMM on the whole GPU (module doc): dW0
    [E_l, N, H] for layer 0, dW1 [E_l, H, N] for layer 1, operands in ``shape.dtype_bytes`` (the
    tensor-core rate for 16-bit), output in ``out_bytes`` (default: the operands' size)."""
    _check_layer(layer)
    tm, tn = _tile(tile)
    rows = [r for r in expert_rows(shape) if r > 0]
    if not rows:
        return 0.0
    out_rows, out_cols = (shape.N, shape.H) if layer == 0 else (shape.H, shape.N)
    tiles_per_expert = math.ceil(out_rows / tm) * math.ceil(out_cols / tn)
    per_sm = _sm_flops(shape, spec)
    tile_s = [2.0 * tm * tn * r / per_sm for r in rows]
    compute = max(sum(tile_s) * tiles_per_expert / spec.sm_count, max(tile_s))
    out = shape.dtype_bytes if out_bytes is None else int(out_bytes)
    m = sum(rows)
    unique = shape.dtype_bytes * m * (out_rows + out_cols) + out * len(rows) * out_rows * out_cols
    return max(compute, unique / spec.hbm_bw)


def _virtual_token_shape(shape: MoEShape) -> MoEShape:
    """The virtual-token calls' shape: T k tokens of one slot, rows of 8 bf16 (comet.layers.autograd)."""
    return replace(shape, k=1, T=shape.T * shape.k, H=8, N=8, dtype_bytes=2, remote_rows=None,
                   partial_bytes=None, tp_path=None)


def _call(shape: MoEShape, spec: GpuSpec, layer: int, tile, n_blocks) -> Dict[str, float]:
    n = choose_n_comm(shape, spec, layer, n_blocks, tile)
    return predict(shape, spec, n, layer, tile, n_blocks=n_blocks)


def predict_backward(shape: MoEShape, spec: GpuSpec, layer: int, tile=DEFAULT_TILE, *,
                     n_blocks: Optional[int] = None,
                     out_bytes: Optional[int] = None) -> Dict[str, float]:
    """Predicted seconds of the backward of ``layer``'s op (module doc; ``shape`` as for the
    forward call: ``N`` = N0 for layer 0, N1 for layer 1). Returns ``collective`` (the fused
    calls backward makes, each with its chosen n_comm, prologues included), ``weight_grad``,
    ``overlapped`` and ``sequential``."""
    _check_layer(layer)
    if shape.is_fp8:  # FP8 forward, bf16 backward (the saved FP8 inputs are dequantised)
        shape = replace(shape, dtype_bytes=2)
    shape = replace(shape, tp_path=None)  # the backward's calls choose their own TP paths
    dw = weight_grad_time(shape, spec, layer, tile, out_bytes)
    if layer == 0:
        dx = _call(shape, spec, 1, tile, n_blocks)  # moe_layer1 over the same rows
        collective = dx["fused"]
        overlapped = max(collective, dx["gemm_full"] + dw)
    else:
        vt = _virtual_token_shape(shape)
        dh = _call(shape, spec, 0, tile, n_blocks)  # moe_layer0: dispatch dout, GEMM with W1^T
        to_rows = _call(vt, spec, 0, tile, n_blocks)
        home = _call(vt, spec, 1, tile, n_blocks)
        collective = dh["fused"] + to_rows["fused"] + home["fused"]
        overlapped = dh["fused"] + to_rows["fused"] + max(home["fused"], home["gemm_full"] + dw)
    overlapped = min(overlapped, collective + dw)
    return {"collective": collective, "weight_grad": dw, "overlapped": overlapped,
            "sequential": collective + dw}
