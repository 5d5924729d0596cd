"""The activations moe_layer0 can fuse (`activation=`), in torch: their derivatives for backward,
and the forward where the op does not fuse them (the CUDA kernels so far). The fused forward is
csrc/include/comet/activation.h; both follow its pairing rule: w0 = [gate; up], so a gated form's
output column j takes GEMM columns j (gate) and F + j (up), F = N0 / 2."""
from __future__ import annotations

import math

import torch

NAMES = ("swiglu", "geglu", "silu", "gelu")
GATED = ("swiglu", "geglu")


def problem(name, n0: int) -> str | None:
    """Why `name` cannot be fused onto a GEMM of n0 columns (None: it can); the op's own check
    (csrc/op_checks.cpp) says the same for calls that reach it."""
    if name is None:
        return None
    if name not in NAMES:
        return f"activation must be None, 'swiglu', 'geglu', 'silu' or 'gelu', got {name!r}"
    if name in GATED and n0 % 2:
        return (f"activation='{name}' pairs w0's gate and up halves ([gate; up]), so its N0 must "
                f"be even, got N0 = {n0}")
    return None


def out_cols(name, n0: int) -> int:
    """Columns of layer0's output for n0 GEMM columns."""
    return n0 // 2 if name in GATED else n0


def _base(name):
    return "silu" if name in ("swiglu", "silu") else "gelu"


def _f(base, v):
    if base == "silu":
        return v * torch.sigmoid(v)
    return 0.5 * v * (1.0 + torch.erf(v * (1.0 / math.sqrt(2.0))))


def _df(base, v):
    if base == "silu":
        s = torch.sigmoid(v)
        return s * (1.0 + v * (1.0 - s))
    cdf = 0.5 * (1.0 + torch.erf(v * (1.0 / math.sqrt(2.0))))
    return cdf + v * torch.exp(-0.5 * v * v) * (1.0 / math.sqrt(2.0 * math.pi))


def _halves(name, pre):
    if name in GATED:
        f = pre.shape[-1] // 2
        return pre[..., :f], pre[..., f:]
    return pre, None


def apply(name, y: torch.Tensor) -> torch.Tensor:
    """act(y) for the pre-activation y [rows, N0] (computed in fp32, fp64 for float64, and
    rounded once to y's dtype): the fallback where the op does not fuse it. Differentiable."""
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    gate, up = _halves(name, y.to(acc))
    h = _f(_base(name), gate)
    return (h if up is None else h * up).to(y.dtype)


def backward(name, pre: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """d loss / d pre [rows, N0] from dh [rows, out_cols] at the pre-activation pre (fp32/fp64)."""
    base = _base(name)
    gate, up = _halves(name, pre)
    dh = dh.to(pre.dtype)
    if up is None:
        return dh * _df(base, gate)
    return torch.cat([dh * up * _df(base, gate), dh * _f(base, gate)], dim=1)
