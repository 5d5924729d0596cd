"""Every FP8 input check of the ops (csrc/op_checks.cpp) raised on every rank of a group of 2:
rank 1 passes the bad input, rank 0 a good call and names rank 1 (as tests/test_input_checks.py
does for the other checks; tools/check_coverage.py counts these too).

The CUDA kernels' FP8 rules (Checker::precision) on the CPU backend under COMET_CPU_CUDA_RULES=1:
FP8 on both operands (an FP8 x with x_scale or dispatch_fp8, FP8 w0; FP8 h, FP8 w1) runs, bitwise
as without the rules; a mixed call or an out_dtype other than bfloat16 raises on every rank."""
import re

import pytest
import torch

import comet
from comet import fp8
from tests.sim_world import run_threads


W, E, K, H, N0, N1, T = 2, 4, 2, 8, 6, 5, 5


def _call(layer, args, buf):
    """comet.moe_layer0 / moe_layer1 with `args` (the dicts of _layer0_args / _layer1_args); returns
    y0 or out."""
    args = dict(args)
    if layer == 0:
        return comet.moe_layer0(args.pop("x"), args.pop("w0"), args.pop("topk_ids"), buffer=buf,
                                **args)[0]
    return comet.moe_layer1(args.pop("h"), args.pop("w1"), args.pop("topk_weights"),
                            args.pop("layout"), buffer=buf, **args)


def _bad(layer, bad, good=lambda a: a, args=None):
    """Rank 1 passes bad(args), rank 0 good(args); returns both errors. args(r, buf): a rank's
    arguments (default: tests/test_input_checks.py's float32 call)."""
    from tests.test_input_checks import _layer0_args, _layer1_args

    def rank(r, buf):
        a = args(r, buf) if args else _layer0_args(r) if layer == 0 else _layer1_args(r, buf)
        try:
            _call(layer, bad(a) if r == 1 else good(a), buf)
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


# -- the CUDA kernels' FP8 rules on the CPU backend (COMET_CPU_CUDA_RULES=1) -----------------------

BF16 = torch.bfloat16
RULES = r" \[COMET_CPU_CUDA_RULES is set\]"


def _fp8_layer1_args(r, buf):
    """A valid all-FP8 layer0 call (allowed under the rules) on every rank, then layer1's
    arguments: h its bf16 y0's first N1 columns, w1 float32 (the forms below quantise them)."""
    from tests.test_input_checks import EL, _layer0_args

    a0 = _q0(_layer0_args(r))
    y0, layout = comet.moe_layer0(a0.pop("x"), a0.pop("w0"), a0.pop("topk_ids"), buffer=buf, **a0)
    g = torch.Generator().manual_seed(10 + r)
    return dict(h=y0[:, :N1].contiguous(), w1=torch.randn(EL, H, N1, generator=g),
                topk_weights=torch.rand(T, K, generator=g), layout=layout)


def _dispatch0(a, **over):
    """bf16 x quantised on dispatch, FP8 w0."""
    return _q0(a, x=a["x"].to(BF16), x_scale=None, dispatch_fp8=True, **over)


ALL_FP8 = {"fp8-x": (0, _q0), "dispatch": (0, _dispatch0), "fp8-h": (1, _q1)}


@pytest.mark.parametrize("form", list(ALL_FP8))
def test_cuda_rules_run_all_fp8_calls_bitwise(monkeypatch, form):
    """FP8 on both operands is what the CUDA kernels take: the rules let it run, with the same bits
    as without them (bf16 results)."""
    from tests.test_input_checks import _layer0_args

    layer, make = ALL_FP8[form]

    def results():
        def rank(r, buf):
            a = _layer0_args(r) if layer == 0 else _fp8_layer1_args(r, buf)
            return _call(layer, make(a), buf)

        return run_threads(W, rank)

    free = results()
    monkeypatch.setenv("COMET_CPU_CUDA_RULES", "1")
    ruled = results()
    for a, b in zip(free, ruled):
        assert a.dtype == BF16 and a.numel() > 0 and torch.equal(a, b)


MIXED = [
    ("bf16 x, fp8 w0", 0, lambda a: _q0(a, x=a["x"].to(BF16), x_scale=None), _q0,
     r"the CUDA FP8 kernels take FP8 on both operands: w0 is float8_e4m3fn but x is bfloat16 "
     r"\(pass dispatch_fp8=True or an FP8 x with x_scale; mixed precision runs on the CPU "
     r"backend\)" + RULES),
    ("fp8 x, bf16 w0", 0, lambda a: _q0(a, w0=a["w0"].to(BF16), w0_scale=None), _q0,
     r"the CUDA FP8 kernels take FP8 on both operands: x is FP8 but w0 is bfloat16 \(quantise "
     r"it with comet\.fp8\.quantize_blocks; mixed precision runs on the CPU backend\)" + RULES),
    ("bf16 h, fp8 w1", 1, lambda a: _q1(a, h=a["h"], h_scale=None), _q1,
     r"the CUDA FP8 kernels take FP8 on both operands: w1 is float8_e4m3fn but h is bfloat16 "
     r"\(quantise it with comet\.fp8\.quantize_rows; mixed precision runs on the CPU "
     r"backend\)" + RULES),
    ("out_dtype float32", 0, lambda a: _q0(a, out_dtype=torch.float32), _q0,
     r"the CUDA FP8 kernels write bfloat16, got out_dtype=float32 \(other result dtypes run on "
     r"the CPU backend\)" + RULES),
    ("out_dtype float32 layer1", 1, lambda a: _q1(a, out_dtype=torch.float32), _q1,
     r"the CUDA FP8 kernels write bfloat16, got out_dtype=float32 .*" + RULES),
]


@pytest.mark.parametrize("name,layer,bad,good,message", MIXED,
                         ids=[m[0].replace(" ", "_").replace(",", "") for m in MIXED])
def test_cuda_rules_refuse_mixed_fp8_on_every_rank(monkeypatch, name, layer, bad, good, message):
    """COMET_CPU_CUDA_RULES=1: rank 1 makes a call the CUDA FP8 kernels refuse (one operand not
    FP8, or a result dtype other than bfloat16), rank 0 an all-FP8 one; rank 1 raises TypeError
    with the rule, rank 0 names rank 1."""
    monkeypatch.setenv("COMET_CPU_CUDA_RULES", "1")
    err0, err1 = _bad(layer, bad, good, None if layer == 0 else _fp8_layer1_args)
    assert isinstance(err1, TypeError) and re.search(message, str(err1)), f"{name}: {err1!r}"
    assert err0 is not None and "rank 1" in str(err0), f"{name}: {err0!r}"
