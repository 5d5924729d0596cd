"""FP8 tensors in the format comet's ops take (docs/api.md, "FP8").

A value is ``q.float() * scale`` of its block: ``q`` float8_e4m3fn, ``scale`` float32 =
amax / 448 of the block (448: e4m3fn's largest finite value; an all-zero block gets scale 1).

* activations, one scale per row and 128 columns: :func:`quantize_rows` ``x [T, H]`` ->
  ``(q [T, H], scale [T, ceil(H/128)])``;
* weights, one scale per 128 x 128 block: :func:`quantize_blocks` ``w [E, N, K]`` ->
  ``(q [E, N, K], scale [E, ceil(N/128), ceil(K/128)])``.

The quantisers are the ops ``torch.ops.comet.fp8_quantize_rows / fp8_quantize_blocks``, the same
code moe_layer0 runs on the sending side for ``dispatch_fp8=True`` (so both give the same bits).

Packed rows: with FP8 token rows on the wire, moe_layer0's ``a`` output (the dispatched rows) holds
each row's values and scales together, uint8 ``[rows, row_bytes(H)]`` (csrc/include/comet/
fp8_rows.h); :func:`unpack_rows` splits them.

Training: :func:`moe_layer0` / :func:`moe_layer1` take bf16 master weights, quantise them per
call and return bf16 gradients for them (see below).
"""
from __future__ import annotations

import torch

from comet._native import _C  # noqa: F401  (registers the ops)

__all__ = ["BLOCK", "FP8_MAX", "dequantize_blocks", "dequantize_rows", "moe_layer0", "moe_layer1",
           "quantize_blocks", "quantize_rows", "row_bytes", "unpack_rows"]

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
    """Bytes of one packed FP8 row of `hidden` values (comet/fp8_rows.h): the values, padded to
    4 bytes, then their ceil(H/128) fp32 scales, padded to a multiple of 16 bytes."""
    return -(-(_scales_at(hidden) + 4 * -(-hidden // BLOCK)) // 16) * 16


def _scales_at(hidden: int) -> int:
    return -(-hidden // 4) * 4


def unpack_rows(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows uint8 [R, row_bytes(H)] (moe_layer0's `a` with FP8 rows) -> (q [R, H]
    float8_e4m3fn, scale [R, ceil(H/128)] float32), copies."""
    nb, at = -(-hidden // BLOCK), _scales_at(hidden)
    scale = rows[:, at:at + 4 * nb].contiguous().view(torch.float32)
    q = rows[:, :hidden].contiguous().view(DTYPE)
    return q, scale


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
    from comet.layers import autograd

    active, autograd._tls.active = autograd._tls.active, []
    try:
        return fn()
    finally:
        autograd._tls.active = active


class _MasterLayer0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w0, b0, topk_ids, static):
        from comet.layers import autograd

        num_experts, handle, cfg, bound, out_dtype, dispatch, tp = static
        q, s = quantize_blocks(w0)
        args = _schema_args("moe_layer0", (x, q, topk_ids, num_experts, handle, *cfg, b0, False,
                                           bound), tp_size=tp, w0_scale=s, out_dtype=out_dtype,
                            dispatch_fp8=dispatch)
        out = torch.ops.comet.moe_layer0(*args)
        ctx.inner = _OpCtx(_needs(args, {0: x.requires_grad, 1: w0.requires_grad,
                                         9: b0 is not None and b0.requires_grad}))
        autograd._layer0_setup_context(ctx.inner, args, out)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, dy0, *_rest):
        from comet.layers import autograd

        g = _undeferred(lambda: autograd._layer0_backward(ctx.inner, dy0, None))
        return g[0], g[1], g[9], None, None


class _MasterLayer1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w1, topk_weights, b1, layout_tensors, static):
        from comet.layers import autograd

        num_experts, handle, cfg, bound, band, out_dtype, quantize_h, tp = static
        q, s = quantize_blocks(w1)
        hq, hs = quantize_rows(h) if quantize_h else (h, None)
        args = _schema_args("moe_layer1", (hq, q, topk_weights, *layout_tensors, num_experts,
                                           handle, *cfg, b1, False, bound, band),
                            tp_size=tp, h_scale=hs, w1_scale=s, out_dtype=out_dtype)
        out = torch.ops.comet.moe_layer1(*args)
        ctx.inner = _OpCtx(_needs(args, {0: h.requires_grad, 1: w1.requires_grad,
                                         2: topk_weights.requires_grad,
                                         12: b1 is not None and b1.requires_grad}))
        autograd._layer1_setup_context(ctx.inner, args, out)
        return out

    @staticmethod
    def backward(ctx, dout):
        from comet.layers import autograd

        g = _undeferred(lambda: autograd._layer1_backward(ctx.inner, dout))
        return g[0], g[1], g[2], g[12], None, None


def moe_layer0(x, w0, topk_ids, *, num_experts: int, b0=None, dispatch_fp8: bool = True,
               out_dtype: torch.dtype | None = None, max_rows: int | None = None, group=None,
               n_comm: int | None = None, tile=None, buffer=None, tp_size: int | None = None):
    """comet.moe_layer0 in FP8 from bf16 (master) weights: w0 [E_local, N0, H] is quantised per
    call (quantize_blocks), x travels as FP8 rows (dispatch_fp8, the default) or as it is.
    Differentiable: x gets its gradient in its dtype, w0 (and b0) in bf16 (x's dtype).
    Returns (y0, Layout) as comet.moe_layer0."""
    from comet.layers import ops

    buf = ops._buffer_for(buffer, group, x)
    ops._same_device(buf, 0, {"x": x, "w0": w0, "topk_ids": topk_ids, "b0": b0})
    tp = int(getattr(buf, "tp_size", 1) if tp_size is None else tp_size)
    cfg = ops.launch_config(x.device, n_comm, tile, layer=0, world=buf.world,
                            num_experts=num_experts, ranks_per_node=getattr(buf, "ranks_per_node",
                                                                            None),
                            x=x, w=w0, topk_ids=topk_ids, tp_size=tp, fp8=True)
    bound = -1 if max_rows is None else int(max_rows)
    y0, _a, recv_counts, send_pos, rs, rt, rsl = _MasterLayer0.apply(
        x, w0, b0, topk_ids, (int(num_experts), buf.handle, tuple(cfg), bound, out_dtype,
                              bool(dispatch_fp8), tp))
    return y0, ops.Layout(int(num_experts), buf.handle, topk_ids, recv_counts, send_pos, rs, rt,
                          rsl, bound, tp)


def moe_layer1(h, w1, topk_weights, layout, *, b1=None, quantize_h: bool = True,
               out_dtype: torch.dtype | None = None, group=None, n_comm: int | None = None,
               tile=None, buffer=None, band: int | None = None):
    """comet.moe_layer1 in FP8 from bf16 (master) weights: w1 [E_local, H, N1] quantised per call,
    h quantised per row (quantize_rows) unless quantize_h=False. Differentiable: h, w1 (and b1) get
    bf16 gradients (h's dtype), topk_weights its own dtype. Returns out [T, H]."""
    from comet.layers import ops

    buf = ops._buffer_for(buffer, group, h)
    if buf.handle != layout.buffer:
        buf.fail_call(1, "comet.moe_layer1: layout was produced on another buffer/group")
    ops._same_device(buf, 1, {"h": h, "w1": w1, "topk_weights": topk_weights, "b1": b1})
    cfg = ops.launch_config(h.device, n_comm, tile, layer=1, world=buf.world,
                            ranks_per_node=getattr(buf, "ranks_per_node", None),
                            node_reduce=getattr(buf, "node_reduce", False),
                            num_experts=layout.num_experts, x=h, w=w1, topk_ids=layout.topk_ids,
                            with_band=True, tp_size=int(layout.tp_size), fp8=True)
    band_n = cfg[4] if band is None else int(band)
    return _MasterLayer1.apply(
        h, w1, topk_weights, b1, (layout.topk_ids, layout.send_pos, layout.recv_counts),
        (layout.num_experts, buf.handle, tuple(cfg[:4]), int(layout.max_rows), band_n, out_dtype,
         bool(quantize_h), int(layout.tp_size)))
