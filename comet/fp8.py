"""FP8 tensors in the format comet's ops take (docs/api.md, "FP8"), and training with bf16 master
weights.

The format -- quantisers, their inverse, the packed rows FP8 tokens travel as -- is
comet.formats.fp8, below the ops (they size and dequantise with it); its names are this module's:

* activations, one scale per row and 128 columns: :func:`quantize_rows` ``x [T, H]`` ->
  ``(q [T, H], scale [T, ceil(H/128)])``;
* weights, one scale per 128 x 128 block: :func:`quantize_blocks` ``w [E, N, K]`` ->
  ``(q [E, N, K], scale [E, ceil(N/128), ceil(K/128)])``;
* :func:`dequantize_rows` / :func:`dequantize_blocks` give the values back (``q.float() * scale``);
  :func:`row_bytes` / :func:`unpack_rows`: the packed rows of moe_layer0's ``a`` with FP8 rows.

Training: :func:`moe_layer0` / :func:`moe_layer1` take bf16 master weights, quantise them per
call and return bf16 gradients for them (see below). They sit above the ops (comet.layers.ops and
its autograd), which do not import this module.
"""
from __future__ import annotations

import torch

from comet.formats.fp8 import (BLOCK, DTYPE, FP8_MAX, dequantize_blocks,  # noqa: F401
                               dequantize_rows, quantize_blocks, quantize_rows, row_bytes,
                               unpack_rows)
from comet.layers import autograd, ops

__all__ = ["BLOCK", "FP8_MAX", "dequantize_blocks", "dequantize_rows", "moe_layer0", "moe_layer1",
           "quantize_blocks", "quantize_rows", "row_bytes", "unpack_rows"]


# -- Training with bf16 master weights -------------------------------------------------------------
#
# torch casts a gradient to its input's dtype, so an FP8 tensor's gradient is FP8. Training keeps
# the weights in bf16 (the master) and quantises them per call: these wrappers quantise w0 / w1
# (and, as asked, the activations), call the op on the FP8 tensors and hand the op's own backward
# (comet.layers.autograd: bf16 backward on the dequantised values) the gradients' destinations, the bf16
# tensors the caller passed. Weight gradients are computed in the call's backward (not deferred by
# comet.layers.autograd.defer_weight_grads: the FP8 copy they would be recorded against is not a leaf).


class _OpCtx:
    """What comet.layers.autograd's setup_context / backward read from an autograd ctx."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = tuple(needs_input_grad)

    def set_materialize_grads(self, _value):
        pass

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _schema_args(op_name: str, first: tuple, **named) -> tuple:
    """Every argument of a call of torch.ops.comet.<op_name> in its schema's order (as
    setup_context receives them): `first` positionally, the rest by name or their defaults."""
    schema = getattr(torch.ops.comet, op_name).default._schema
    rest = schema.arguments[len(first):]
    return tuple(first) + tuple(named[a.name] if a.name in named else a.default_value
                                for a in rest)


def _needs(args: tuple, grads: dict):
    return tuple(bool(grads.get(i, False)) for i in range(len(args)))


def _undeferred(fn):
    active, autograd._tls.active = autograd._tls.active, []
    try:
        return fn()
    finally:
        autograd._tls.active = active


class _MasterLayer0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w0, b0, topk_ids, static):
        num_experts, handle, cfg, bound, out_dtype, dispatch, tp, margin = static
        q, s = quantize_blocks(w0)
        args = _schema_args("moe_layer0", (x, q, topk_ids, num_experts, handle, *cfg, b0, False,
                                           bound), tp_size=tp, w0_scale=s, out_dtype=out_dtype,
                            dispatch_fp8=dispatch, sm_margin=margin)
        out = torch.ops.comet.moe_layer0(*args)
        ctx.inner = _OpCtx(_needs(args, {0: x.requires_grad, 1: w0.requires_grad,
                                         9: b0 is not None and b0.requires_grad}))
        autograd._layer0_setup_context(ctx.inner, args, out)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, dy0, *_rest):
        g = _undeferred(lambda: autograd._layer0_backward(ctx.inner, dy0, None))
        return g[0], g[1], g[9], None, None


class _MasterLayer1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w1, topk_weights, b1, layout_tensors, static):
        num_experts, handle, cfg, bound, band, out_dtype, quantize_h, tp, margin = static
        q, s = quantize_blocks(w1)
        hq, hs = quantize_rows(h) if quantize_h else (h, None)
        args = _schema_args("moe_layer1", (hq, q, topk_weights, *layout_tensors, num_experts,
                                           handle, *cfg, b1, False, bound, band),
                            tp_size=tp, h_scale=hs, w1_scale=s, out_dtype=out_dtype,
                            sm_margin=margin)
        out = torch.ops.comet.moe_layer1(*args)
        ctx.inner = _OpCtx(_needs(args, {0: h.requires_grad, 1: w1.requires_grad,
                                         2: topk_weights.requires_grad,
                                         12: b1 is not None and b1.requires_grad}))
        autograd._layer1_setup_context(ctx.inner, args, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        g = _undeferred(lambda: autograd._layer1_backward(ctx.inner, dout))
        return g[0], g[1], g[2], g[12], None, None


def moe_layer0(x, w0, topk_ids, *, num_experts: int, b0=None, dispatch_fp8: bool = True,
               out_dtype: torch.dtype | None = None, max_rows: int | None = None, group=None,
               n_comm: int | None = None, tile=None, buffer=None, tp_size: int | None = None,
               sm_margin: int | None = None):
    """comet.moe_layer0 in FP8 from bf16 (master) weights: w0 [E_local, N0, H] is quantised per
    call (quantize_blocks), x travels as FP8 rows (dispatch_fp8, the default) or as it is.
    Differentiable: x gets its gradient in its dtype, w0 (and b0) in bf16 (x's dtype).
    Not on a buffer with a placement (FP8 runs on the contiguous map): that raises on every rank.
    Returns (y0, Layout) as comet.moe_layer0."""
    # comet.moe_layer0's preamble (device check on every rank, tp_size, bound, launch config).
    buf = ops.call_buffer(buffer, group, x)
    margin = ops.call_margin(buf, 0, sm_margin)
    if getattr(buf, "placement", None) is not None:  # FP8 runs on the contiguous map only
        ops._no_fp8_with_placement(buf, 0, w0_scale=True, dispatch_fp8=dispatch_fp8 or None)
    c = ops.layer0_call(buf, x, w0, topk_ids, num_experts=num_experts, b0=b0, max_rows=max_rows,
                        n_comm=n_comm, tile=tile, tp_size=tp_size, fp8=True)
    return c.layout(num_experts, topk_ids, _MasterLayer0.apply(
        x, w0, b0, topk_ids, (int(num_experts), c.buf.handle, c.cfg, c.rows, out_dtype,
                              bool(dispatch_fp8), c.tp, margin)))


def moe_layer1(h, w1, topk_weights, layout, *, b1=None, quantize_h: bool = True,
               out_dtype: torch.dtype | None = None, group=None, n_comm: int | None = None,
               tile=None, buffer=None, band: int | None = None, sm_margin: int | None = None):
    """comet.moe_layer1 in FP8 from bf16 (master) weights: w1 [E_local, H, N1] quantised per call,
    h quantised per row (quantize_rows) unless quantize_h=False. Differentiable: h, w1 (and b1) get
    bf16 gradients (h's dtype), topk_weights its own dtype. A layout made with a placement
    raises on every rank (FP8 runs on the contiguous map). Returns out [T, H]."""
    buf = ops.layer1_buffer(buffer, group, h, layout)
    margin = ops.call_margin(buf, 1, sm_margin)
    if layout.routes is not None:
        ops._no_fp8_with_placement(buf, 1, h_scale=quantize_h or None, w1_scale=True)
    c = ops.layer1_call(buf, h, w1, topk_weights, layout, b1=b1, n_comm=n_comm, tile=tile,
                        band=band, fp8=True)
    return _MasterLayer1.apply(
        h, w1, topk_weights, b1, (layout.topk_ids, layout.send_pos, layout.recv_counts),
        (layout.num_experts, c.buf.handle, c.cfg, c.rows, c.band_n, out_dtype, bool(quantize_h),
         c.tp, margin))
