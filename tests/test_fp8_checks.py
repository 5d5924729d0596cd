"""Every FP8 input check of the ops (csrc/op_checks.cpp) raised on every rank of a group of 2:
rank 1 passes the bad input, rank 0 a good call and names rank 1 (as tests/test_input_checks.py
does for the other checks; tools/check_coverage.py counts these too)."""
import re

import pytest
import torch

import comet
from comet import fp8
from tests.sim_world import run_threads


W, E, K, H, N0, N1, T = 2, 4, 2, 8, 6, 5, 5


def _bad(layer, bad):
    """Rank 1 passes a bad FP8 input, rank 0 a good call; returns both errors."""
    from tests.test_input_checks import _layer0_args, _layer1_args

    def rank(r, buf):
        args = _layer0_args(r) if layer == 0 else _layer1_args(r, buf)
        if r == 1:
            args = bad(args)
        try:
            if layer == 0:
                comet.moe_layer0(args.pop("x"), args.pop("w0"), args.pop("topk_ids"), buffer=buf,
                                 **args)
            else:
                comet.moe_layer1(args.pop("h"), args.pop("w1"), args.pop("topk_weights"),
                                 args.pop("layout"), buffer=buf, **args)
        except (ValueError, TypeError) as e:
            return e
        return None

    return run_threads(W, rank)


def _q0(a, **over):
    xq, xs = fp8.quantize_rows(a["x"])
    wq, ws = fp8.quantize_blocks(a["w0"])
    return {**a, "x": xq, "x_scale": xs, "w0": wq, "w0_scale": ws, **over}


def _q1(a, **over):
    hq, hs = fp8.quantize_rows(a["h"])
    wq, ws = fp8.quantize_blocks(a["w1"])
    return {**a, "h": hq, "h_scale": hs, "w1": wq, "w1_scale": ws, **over}


def _scale_with(name, v):
    def f(a):
        a = _q0(a) if name in ("x_scale", "w0_scale") else _q1(a)
        s = a[name].clone()
        s.view(-1)[0] = v
        return {**a, name: s}
    return f


BAD = [
    ("x without scale", 0, lambda a: _q0(a, x_scale=None),
     r"x is float8_e4m3fn but x_scale is missing: pass its float32 scales \[T, ceil\(H/128\)\] "
     r"\(comet\.fp8 makes both\)"),
    ("w0 without scale", 0, lambda a: _q0(a, w0_scale=None),
     r"w0 is float8_e4m3fn but w0_scale is missing: pass its float32 scales "
     r"\[E_local, ceil\(N0/128\), ceil\(H/128\)\]"),
    ("x_scale shape", 0, lambda a: _q0(a, x_scale=torch.ones(T, 2)),
     r"x_scale must be \[T, ceil\(H/128\)\] = \[5, 1\], got shape \[5, 2\]"),
    ("x_scale dtype", 0, lambda a: _q0(a, x_scale=torch.ones(T, 1, dtype=torch.float64)),
     r"x_scale has dtype float64; scales are float32"),
    ("x_scale for bf16 x", 0, lambda a: {**a, "x_scale": torch.ones(T, 1)},
     r"x_scale is given but x has dtype float32: scales go with float8_e4m3fn only"),
    ("x_scale zero", 0, _scale_with("x_scale", 0.0),
     r"x_scale holds 0(\.0)? at flat index 0: every scale must be finite and > 0"),
    ("w0_scale nan", 0, _scale_with("w0_scale", float("nan")),
     r"w0_scale holds nan at flat index 0: every scale must be finite and > 0"),
    ("e5m2", 0, lambda a: {**a, "x": a["x"].to(torch.float8_e5m2)},
     r"x has dtype float8_e5m2; comet's FP8 format is float8_e4m3fn with float32 block scales "
     r"\(comet\.fp8\.quantize_rows / quantize_blocks\)"),
    ("fp8 w0 transposed", 0,
     lambda a: {**_q0(a), "w0": fp8.quantize_blocks(a["w0"].transpose(1, 2).contiguous())[0],
                "w0_transposed": True},
     r"w0 is float8_e4m3fn: FP8 weights are taken in their own layout only \(no w0_transposed\)"),
    ("out_dtype without fp8", 0, lambda a: {**a, "out_dtype": torch.bfloat16},
     r"out_dtype=bfloat16 is for FP8 calls; this call's result has x's dtype float32"),
    ("out_dtype int", 0, lambda a: _q0(a, out_dtype=torch.int32),
     r"out_dtype=int32 is not a result dtype: supported float32, bfloat16, float16, float64"),
    ("b0 dtype with fp8", 0, lambda a: _q0(a, b0=torch.zeros(E // W, N0)),
     r"b0 has dtype float32 but y0 \(out_dtype\) has bfloat16; they must match"),
    ("h without scale", 1, lambda a: _q1(a, h_scale=None),
     r"h is float8_e4m3fn but h_scale is missing: pass its float32 scales "
     r"\[rows of h, ceil\(N1/128\)\]"),
    ("w1_scale shape", 1, lambda a: _q1(a, w1_scale=torch.ones(E // W, 1, 2)),
     r"w1_scale must be \[E_local, ceil\(H/128\), ceil\(N1/128\)\] = \[2, 1, 1\], got shape "
     r"\[2, 1, 2\]"),
    ("w1_scale inf", 1, _scale_with("w1_scale", float("inf")),
     r"w1_scale holds inf at flat index 0"),
    ("b1 dtype with fp8", 1, lambda a: _q1(a, b1=torch.zeros(E // W, H)),
     r"b1 has dtype float32 but out \(out_dtype\) has bfloat16; they must match"),
    ("topk_weights dtype with fp8", 1,
     lambda a: _q1(a, topk_weights=a["topk_weights"].to(torch.float16)),
     r"topk_weights has dtype float16; expected float32 or the result's dtype bfloat16"),
]


@pytest.mark.parametrize("name,layer,bad,message", BAD, ids=[b[0].replace(" ", "_") for b in BAD])
def test_bad_fp8_input_raises_on_every_rank(name, layer, bad, message):
    err0, err1 = _bad(layer, bad)
    assert err1 is not None and re.search(message, str(err1)), f"{name}: {err1}"
    assert err0 is not None and "rank 1" in str(err0), f"{name}: {err0}"


def test_cuda_rules_refuse_fp8(monkeypatch):
    """The CUDA kernels have no FP8 path yet: with COMET_CPU_CUDA_RULES=1 the CPU backend refuses
    FP8 as they do (the same check for both ops, csrc/op_checks.cpp: Checker::precision)."""
    monkeypatch.setenv("COMET_CPU_CUDA_RULES", "1")
    err0, err1 = _bad(0, _q0)
    assert re.search(r"FP8 inputs \(float8_e4m3fn, dispatch_fp8\) run on the CPU backend only in "
                     r"this build: the CUDA kernels take bfloat16/float16 \(dequantise with "
                     r"comet\.fp8\.dequantize_rows / dequantize_blocks\) "
                     r"\[COMET_CPU_CUDA_RULES is set\]", str(err1)), err1
