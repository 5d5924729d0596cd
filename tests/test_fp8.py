"""FP8 layers (comet.fp8, docs/api.md "FP8") on the CPU backend, ranks simulated as threads.

* the quantisers: shapes, scale = amax / 448 per block (1 for a zero block), round trip, the
  same bits as the formula written out here;
* forward against comet.reference on the dequantised values (fp32-tight, out_dtype=float32) for
  FP8 x / h and weights, the mixed forms and dispatch_fp8, on sampled awkward cases (H and N not
  multiples of 128, empty ranks, dropped slots, skew, 1-4 ranks, every rank on its own node), and
  against the bf16 layer at FP8 tolerance;
* bitwise the same for any comm/GEMM split and tile;
* layer0's link bytes with FP8 rows: (H + 4 H/128) / (2 H) of bf16's;
* every e4m3 code decoded as torch decodes it; opcheck of FP8 calls; the tuner's FP8 profiling;
* three real processes (gloo) against the reference's torch.distributed form;
* the master-weight wrappers (comet.fp8.moe_layer0/1) run the ops' preamble: a tensor on another
  device raises on every rank, and so does a placement (FP8 runs on the contiguous map).
Gradients: tests/test_fp8_grad.py; bad input: tests/test_fp8_checks.py.
"""
import dataclasses
import pathlib
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comet
from comet import fp8
from comet import reference as ref
from tests.cases import Case, make_inputs
from tests.sim_world import run_threads

ROOT = pathlib.Path(__file__).resolve().parent.parent
F8 = torch.float8_e4m3fn
FP32_TIGHT = dict(atol=1e-4, rtol=1e-5)


def _oracle_rows(x):
    """quantize_rows written from its definition (not comet's code): per row and 128 columns,
    scale = amax / 448 (1 where the block is zero), q = x / scale rounded to e4m3fn."""
    T, H = x.shape
    q = torch.empty(T, H, dtype=F8)
    s = torch.empty(T, -(-H // 128))
    for b in range(s.shape[1]):
        blk = x[:, b * 128:(b + 1) * 128].float()
        sc = blk.abs().amax(1) / 448.0
        sc = torch.where(sc > 0, sc, torch.ones_like(sc))
        s[:, b] = sc
        q[:, b * 128:(b + 1) * 128] = (blk / sc[:, None]).to(F8)
    return q, s


# -- quantisers --------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 5), H=st.integers(1, 300), zero_block=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_quantize_rows_shapes_scales_round_trip(T, H, zero_block, dtype, seed):
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    if zero_block and T:
        x[0, :128] = 0
    q, s = fp8.quantize_rows(x)
    assert q.dtype == F8 and q.shape == (T, H)
    assert s.dtype == torch.float32 and s.shape == (T, -(-H // 128))
    oq, os_ = _oracle_rows(x)
    assert torch.equal(q.view(torch.uint8), oq.view(torch.uint8)) and torch.equal(s, os_)
    if zero_block and T:
        assert s[0, 0] == 1 and not q[0, :128].float().any()
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 (normals), absolute <= 2^-10 * scale below
    back = fp8.dequantize_rows(q, s)
    scale = s.repeat_interleave(128, 1)[:, :H]
    err = (back - x.float()).abs()
    assert (err <= torch.maximum(x.float().abs() * 2 ** -4, scale * 2 ** -9)).all()
    # each non-zero block's largest value lands on e4m3's largest, 448
    if T and H:
        amax = q.float().abs().view(T, -1)
        nonzero = x.float().abs().amax(1) > 0
        assert (amax.amax(1)[nonzero] == 448).all()


@settings(max_examples=15, deadline=None)
@given(E=st.integers(1, 2), N=st.integers(1, 270), K=st.integers(1, 270), seed=st.integers(0, 99))
def test_quantize_blocks_shapes_and_round_trip(E, N, K, seed):
    w = torch.randn(E, N, K, generator=torch.Generator().manual_seed(seed))
    q, s = fp8.quantize_blocks(w)
    assert q.dtype == F8 and q.shape == (E, N, K)
    assert s.shape == (E, -(-N // 128), -(-K // 128)) and s.dtype == torch.float32
    for bn in range(s.shape[1]):
        for bk in range(s.shape[2]):
            blk = w[:, bn * 128:(bn + 1) * 128, bk * 128:(bk + 1) * 128]
            torch.testing.assert_close(s[:, bn, bk], blk.abs().amax((1, 2)) / 448, rtol=0, atol=0)
    back = fp8.dequantize_blocks(q, s)
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, back.new_tensor(2.0 ** -9) *
                                              s.amax())).all()


def test_quantizers_refuse_bad_shapes():
    with pytest.raises(ValueError, match=r"quantize_rows: x must be 2-D"):
        fp8.quantize_rows(torch.zeros(3))
    with pytest.raises(ValueError, match=r"quantize_blocks: w must be 3-D"):
        fp8.quantize_blocks(torch.zeros(3, 3))
    with pytest.raises(TypeError, match=r"quantize_rows: x must be float32"):
        fp8.quantize_rows(torch.zeros(2, 2, dtype=torch.int32))


def test_rounding_to_e4m3_is_torchs_for_every_bf16_value_and_more():
    """The sending-side quantiser's float -> float8_e4m3fn rounding (comet/fp8_rows.h, run by the
    CPU backend and the CUDA kernel alike) gives torch's bits for every bfloat16 value below 464
    in magnitude (all 65536 patterns: subnormals, ties, signed zeros, NaN), and for float32 values
    around every e4m3 code's rounding boundaries; 464 and above saturate to 448 (torch: NaN above
    464), which the quantiser's values (at most 448 after their scale) never reach."""
    from comet._native import _C

    bf = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8.DTYPE).float()
    codes = codes[codes.isfinite()]
    mids = (codes.sort().values[1:] + codes.sort().values[:-1]) / 2  # the ties (exact in fp32)
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(1e9)),
                      torch.nextafter(mids, torch.tensor(-1e9))])
    g = torch.Generator().manual_seed(5)
    rnd = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-3, 0.05, 1.0, 100.0)])
    for v in (bf, near, rnd):
        v = v[(v.abs() < 464) | v.isnan()]
        ours = _C.engine.fp8_from_float(v)
        theirs = v.to(fp8.DTYPE).view(torch.uint8)
        nan = v.isnan()
        assert torch.equal(ours[~nan], theirs[~nan])
        assert torch.equal(ours[nan] & 0x7F, torch.full_like(ours[nan], 0x7F))
    big = torch.tensor([464.0, 500.0, -1e30, float("inf")])
    assert _C.engine.fp8_from_float(big).tolist() == [0x7E, 0x7E, 0xFE, 0x7E]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("H", [1, 127, 300, 512])
def test_one_pass_quantiser_gives_quantize_rows_bits(dtype, H):
    """dispatch_fp8's one-pass quantise-and-pack (the CPU backend's, the same arithmetic as the
    CUDA kernel) equals quantize_rows + packing bit for bit, with all-zero, NaN, inf and tiny
    blocks among ordinary ones."""
    from comet._native import _C

    g = torch.Generator().manual_seed(H)
    x = torch.randn(9, H, generator=g) * torch.logspace(-6, 3, 9).unsqueeze(1)
    x[1] = 0.0
    x[2, H // 2] = float("nan")
    x[3, 0] = float("inf")
    x[4, -1] = -1e-7
    x = x.to(dtype)
    rows = _C.engine.fp8_quantize_pack_rows(x)
    assert rows.shape == (9, fp8.row_bytes(H))
    q, s = fp8.unpack_rows(rows, H)
    q_ref, s_ref = fp8.quantize_rows(x)
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_row_bytes_matches_the_packed_rows_of_layer0():
    for H in (1, 100, 128, 300, 512):
        assert fp8.row_bytes(H) % 16 == 0 and fp8.row_bytes(H) >= H + 4 * -(-H // 128)
    assert fp8.row_bytes(512) == 512 + 16 and fp8.row_bytes(7168) == 7168 + 4 * 56


# docs/api.md's packed FP8 row, as written there; the test below reads rows by this text's offsets,
# not by comet's (row_bytes, unpack_rows, fp8_row_scales_at).
DOC_ROW = "`[H fp8 values][pad to 4 bytes][ceil(H/128) float32 scales][pad to 16 bytes]`"


def _doc_row_layout(H):
    """(offset of the scales, number of scales, row bytes) of DOC_ROW for H values."""
    scales_at = -(-H // 4) * 4                    # H one-byte values, padded to 4 bytes
    n_scales = -(-H // 128)                       # one float32 per 128 values
    row = -(-(scales_at + 4 * n_scales) // 16) * 16  # padded to 16 bytes
    return scales_at, n_scales, row


def _check_doc_rows(rows, q, s, H):
    """rows: uint8 [R, .] read by the documented offsets hold q's bytes, s's floats, zero padding
    (the padding's content is comet/fp8_rows.h's: zeros)."""
    at, nb, row = _doc_row_layout(H)
    assert rows.dtype == torch.uint8 and rows.shape == (q.shape[0], row)
    assert torch.equal(rows[:, :H], q.view(torch.uint8))
    assert not rows[:, H:at].any()
    assert torch.equal(rows[:, at:at + 4 * nb].contiguous().view(torch.float32).view(torch.int32),
                       s.contiguous().view(torch.int32))
    assert not rows[:, at + 4 * nb:].any()


@pytest.mark.parametrize("H", [1, 2, 3, 5, 37, 127, 128, 129, 255, 300, 509, 512, 640, 1001])
def test_packed_rows_follow_the_documented_layout(H):
    """The sending side's packed rows (dispatch_fp8) against the format as docs/api.md writes it,
    values and scales from the quantiser written out in this file (_oracle_rows)."""
    from comet._native import _C

    assert DOC_ROW in (ROOT / "docs" / "api.md").read_text()
    g = torch.Generator().manual_seed(H)
    x = torch.randn(6, H, generator=g) * torch.logspace(-3, 2, 6).unsqueeze(1)
    x[1] = 0.0
    q, s = _oracle_rows(x)
    _check_doc_rows(_C.engine.fp8_quantize_pack_rows(x), q, s, H)
    assert fp8.row_bytes(H) == _doc_row_layout(H)[2]


@pytest.mark.parametrize("H", [37, 300])
def test_dispatched_rows_follow_the_documented_layout(H):
    """layer0's `a` with FP8 rows (an FP8 x with its scales, and dispatch_fp8 from bf16): each row
    read by docs/api.md's offsets is its source token's values and scales."""
    case = Case(f"layout-{H}", 2, 4, 2, (5, 4), hidden=H, n0=16, n1=8, seed=7)
    xs, w0s, _w1s, ids, _wts = make_inputs(case, torch.bfloat16)
    w0q = [fp8.quantize_blocks(w) for w in w0s]
    xq = [_oracle_rows(x) for x in xs]
    for dispatch in (False, True):
        def rank(r, buf):
            x, kw = (xs[r], dict(dispatch_fp8=True)) if dispatch else (xq[r][0],
                                                                      dict(x_scale=xq[r][1]))
            out = torch.ops.comet.moe_layer0(x, w0q[r][0], ids[r], case.experts, buf.handle,
                                             1, 1, 8, 8, w0_scale=w0q[r][1], **kw)
            return out[1]

        for r, a in enumerate(run_threads(case.world, rank)):
            rows = ref.dispatch_rows(ids, case.experts, r)
            q = torch.stack([xq[row.source][0][row.token] for row in rows])
            s = torch.stack([xq[row.source][1][row.token] for row in rows])
            _check_doc_rows(a, q, s, H)


# -- forward --------------------------------------------------------------------------------------

# Sampled awkward cases: several 128-blocks with ragged ends (H, N0, N1 not multiples of 128), and
# the routing kinds of tests/cases.py (empty rank, dropped slots, skew) on 1-4 ranks.
BIG = dict(hidden=260, n0=140, n1=132)
CASES = [
    Case("uniform-w1", 1, 2, 2, (9,), **BIG),
    Case("empty-rank-w2", 2, 4, 2, (9, 0), seed=1, **BIG),
    Case("dropped-w3", 3, 6, 3, (5, 6, 7), routing="dropped", seed=3, **BIG),
    Case("skewed-w4", 4, 12, 2, (13, 12, 11, 10), routing="skewed", seed=5, hidden=37, n0=30,
         n1=17),
]
# (name, layer0 x / w0 forms, layer1 h / w1 forms): "q" FP8 with scales, "b" bf16, "d" bf16 x
# quantised on dispatch.
FORMS = {"fp8": ("q", "q", "q", "q"), "bf16-act": ("b", "q", "b", "q"),
         "bf16-weights": ("q", "b", "q", "b"), "dispatch": ("d", "q", "q", "q")}


def _fp8_inputs(case):
    xs, w0s, w1s, ids, wts = make_inputs(case)
    return ([fp8.quantize_rows(x) for x in xs], [fp8.quantize_blocks(w) for w in w0s],
            [fp8.quantize_blocks(w) for w in w1s], ids, wts)


def _layer0_args(form, xq, wq):
    """(x, w0, kwargs) of one rank for the forms above; the values are always the dequantised ones
    (bf16 forms: the dequantised FP8 values are exact in bf16? not always, so they are rounded and
    the reference gets the rounded values too)."""
    fx, fw = form
    x = {"q": xq[0], "b": fp8.dequantize_rows(*xq, torch.bfloat16),
         "d": fp8.dequantize_rows(*xq, torch.bfloat16)}[fx]
    w = wq[0] if fw == "q" else fp8.dequantize_blocks(*wq, torch.bfloat16)
    kw = dict(x_scale=xq[1] if fx == "q" else None, w0_scale=wq[1] if fw == "q" else None,
              dispatch_fp8=fx == "d")
    return x, w, kw


def _values_rows(t, scale):
    return fp8.dequantize_rows(t, scale) if t.dtype == F8 else t.float()


def _values_w(t, scale):
    return fp8.dequantize_blocks(t, scale) if t.dtype == F8 else t.float()


def run_fp8(case, form, n_comm=1, tile=(8, 8), buffers=None, out_dtype=torch.float32):
    xq, w0q, w1q, ids, wts = _fp8_inputs(case)
    f0, f1 = FORMS[form][:2], FORMS[form][2:]

    def rank(r, buf):
        x, w0, kw = _layer0_args(f0, xq[r], w0q[r])
        y0, layout = comet.moe_layer0(x, w0, ids[r], num_experts=case.experts, buffer=buf,
                                      n_comm=n_comm, tile=tile, out_dtype=out_dtype, **kw)
        h = torch.tanh(y0.float()[:, :case.n1])
        if f1[0] == "q":
            h, h_scale = fp8.quantize_rows(h)
        else:
            h, h_scale = h.to(torch.bfloat16), None
        w1 = w1q[r][0] if f1[1] == "q" else fp8.dequantize_blocks(*w1q[r], torch.bfloat16)
        out = comet.moe_layer1(h, w1, wts[r], layout, buffer=buf, n_comm=n_comm, tile=tile,
                               h_scale=h_scale, w1_scale=w1q[r][1] if f1[1] == "q" else None,
                               out_dtype=out_dtype)
        return y0, h, h_scale, w1, x, w0, kw, out

    return run_threads(case.world, rank, buffers=buffers), (xq, w0q, w1q, ids, wts)


def check_reference(case, results, inputs):
    xq, w0q, w1q, ids, wts = inputs
    # the values the layer multiplies: dequantised FP8, or the bf16 tensors as given (with
    # dispatch_fp8 the bf16 x quantised again: its own quantize_rows)
    xs = []
    for r, (_y0, _h, _hs, _w1, x, _w0, kw, _out) in enumerate(results):
        if kw["dispatch_fp8"]:
            xs.append(fp8.dequantize_rows(*fp8.quantize_rows(x)))
        else:
            xs.append(_values_rows(x, kw["x_scale"]))
    w0s = [_values_w(res[5], res[6]["w0_scale"]) for res in results]
    y0_ref = ref.layer0_sim(xs, w0s, ids, case.experts)
    hs = [_values_rows(res[1], res[2]) for res in results]
    w1s = [_values_w(res[3], w1q[r][1] if res[3].dtype == F8 else None)
           for r, res in enumerate(results)]
    out_ref = ref.layer1_sim(hs, w1s, wts, ids, case.experts)
    for r, res in enumerate(results):
        torch.testing.assert_close(res[0], y0_ref[r], **FP32_TIGHT)
        torch.testing.assert_close(res[7], out_ref[r], **FP32_TIGHT)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_on_dequantised_values(case, form):
    results, inputs = run_fp8(case, form)
    check_reference(case, results, inputs)


def test_every_rank_on_its_own_node():
    case = CASES[2]
    bufs = comet.Buffer.simulated_world(case.world, timeout=20, ranks_per_node=1)
    results, inputs = run_fp8(case, "dispatch", buffers=bufs)
    check_reference(case, results, inputs)


def test_default_result_dtype_is_bf16_and_close_to_the_bf16_layer():
    """FP8 against the bf16 layer on the original values: within FP8's error (3 mantissa bits)."""
    case = CASES[1]
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.bfloat16)
    q_res, _ = run_fp8(case, "fp8", out_dtype=None)
    for y0, *_rest, out in q_res:
        assert y0.dtype == torch.bfloat16 and out.dtype == torch.bfloat16

    def rank(r, buf):
        y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts, buffer=buf)
        h = torch.tanh(y0.float()[:, :case.n1]).to(torch.bfloat16)
        return y0, comet.moe_layer1(h, w1s[r], wts[r], layout, buffer=buf)

    b_res = run_threads(case.world, rank)
    for (y0q, *_rest, outq), (y0b, outb) in zip(q_res, b_res):
        for a, b in ((y0q, y0b), (outq, outb)):
            rel = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)
            assert rel < 0.08, rel


def test_bitwise_for_any_split_and_tile():
    case = CASES[2]
    base, _ = run_fp8(case, "fp8")
    for n_comm, tile in ((2, (16, 32)), (3, (4, 128))):
        other, _ = run_fp8(case, "fp8", n_comm=n_comm, tile=tile)
        for a, b in zip(base, other):
            assert torch.equal(a[0], b[0]) and torch.equal(a[7], b[7])


def test_dispatched_rows_are_packed_fp8_rows():
    """moe_layer0's `a` with FP8 rows: uint8 [M, row_bytes(H)], each the source token's values
    and scales (unpack_rows gives them back)."""
    case = CASES[1]
    xq, w0q, _w1q, ids, _wts = _fp8_inputs(case)

    def rank(r, buf):
        out = torch.ops.comet.moe_layer0(xq[r][0], w0q[r][0], ids[r], case.experts, buf.handle,
                                         1, 1, 8, 8, x_scale=xq[r][1], w0_scale=w0q[r][1])
        return out[1], out[5]

    for r, (a, row_token) in enumerate(run_threads(case.world, rank)):
        assert a.dtype == torch.uint8 and a.shape[1] == fp8.row_bytes(case.hidden)
        q, s = fp8.unpack_rows(a, case.hidden)
        rows = ref.dispatch_rows(ids, case.experts, r)
        for i, row in enumerate(rows):
            assert torch.equal(q[i].view(torch.uint8), xq[row.source][0][row.token].view(torch.uint8))
            assert torch.equal(s[i], xq[row.source][1][row.token])


# -- bytes on the link ------------------------------------------------------------------------------


def _layer0_link_bytes(bufs, call):
    before = [b.link_stats()[1] for b in bufs]
    run_threads(len(bufs), call, buffers=bufs)
    return [b.link_stats()[1] - before[r] for r, b in enumerate(bufs)]


def test_fp8_rows_move_a_fraction_of_bf16_bytes():
    """Two nodes of one rank, every token routed to the other node: the row bytes layer0 moves
    (the call's bytes minus those of a call without tokens and the routing) are T rows of
    2 H bytes in bf16 and of H + 4 H/128 bytes in FP8 (H = 512: no padding)."""
    W, E, k, H, N0, T = 2, 4, 2, 512, 8, 6
    bufs = comet.Buffer.simulated_world(W, timeout=20, ranks_per_node=1, link_latency_us=0)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(W)]
    ids = [torch.stack([torch.randperm(2, generator=g) + 2 * (1 - r) for _ in range(T)])
           for r in range(W)]
    w0 = [torch.randn(E // W, N0, H, generator=g).to(torch.bfloat16) for _ in range(W)]

    def measure(tokens, dispatch_fp8):
        return _layer0_link_bytes(bufs, lambda r, b: comet.moe_layer0(
            xs[r][:tokens], w0[r], ids[r][:tokens], num_experts=E, buffer=b, n_comm=1,
            tile=(8, 8), dispatch_fp8=dispatch_fp8))

    rows_bf16 = [a - b for a, b in zip(measure(T, False), measure(0, False))]
    rows_fp8 = [a - b for a, b in zip(measure(T, True), measure(0, True))]
    routing = T * k * 12  # per slot: its send-plan entry, expert id and bucket position
    for r in range(W):
        assert rows_bf16[r] == T * 2 * H + routing
        assert rows_fp8[r] == T * (H + 4 * H // 128) + routing
        ratio = (rows_fp8[r] - routing) / (rows_bf16[r] - routing)
        assert ratio == (H + 4 * H / 128) / (2 * H)


def test_every_fp8_code_widens_as_torch_widens_it():
    """The kernels' e4m3 decoding (comet/numeric.h) against torch's on all 254 finite codes: x is
    every code (scale 1), w0 the identity (1.0 and 0 are exact), so y0 = x exactly."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    x = codes.view(F8).reshape(2, 127)
    x_scale = torch.ones(2, 1)
    w0 = torch.eye(127).to(F8).reshape(1, 127, 127)

    def rank(r, buf):
        return comet.moe_layer0(x, w0, torch.zeros(2, 1, dtype=torch.int64), num_experts=1,
                                buffer=buf, x_scale=x_scale, w0_scale=torch.ones(1, 1, 1),
                                out_dtype=torch.float32)[0]

    (y0,) = run_threads(1, rank)
    assert torch.equal(y0, x.float())


# -- the ops as PyTorch operators ------------------------------------------------------------------

LAUNCH = (1, 1, 8, 8)
# opcheck's test_schema compares tensors with arithmetic torch lacks for float8 (mul): left out.
UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("form,max_rows", [("fp8", -1), ("dispatch", 40), ("bf16-act", -1)])
def test_opcheck_fp8_calls(form, max_rows):
    """Schema, fake kernels (result dtypes, the packed rows' shape) and autograd registration agree
    with the CPU kernels for FP8 calls, with and without a row bound, on a world of one."""
    buf = comet.Buffer.simulated_world(1)[0]
    case = CASES[0]
    xq, w0q, w1q, ids, wts = _fp8_inputs(case)
    x, w0, kw = _layer0_args(FORMS[form][:2], xq[0], w0q[0])
    args0 = (x, w0, ids[0], case.experts, buf.handle, *LAUNCH, None, False, max_rows)
    torch.library.opcheck(torch.ops.comet.moe_layer0.default, args0, kw, test_utils=UTILS)
    y0, _a, rc, sp, *_ = torch.ops.comet.moe_layer0(*args0, **kw)
    h, hs = fp8.quantize_rows(y0[:, :case.n1].float())
    w1, w1s = w1q[0]
    torch.library.opcheck(torch.ops.comet.moe_layer1.default,
                          (h, w1, wts[0], ids[0], sp, rc, case.experts, buf.handle, *LAUNCH, None,
                           False, max_rows, 1), dict(h_scale=hs, w1_scale=w1s), test_utils=UTILS)


def test_tuner_profilers_run_fp8_calls():
    """comet.tune.profiling's hooks measure FP8 calls for an FP8 key (bf16 tokens quantised on dispatch,
    FP8 weights, FP8 h), as the autotuner's --profile asks for them."""
    import types

    from comet.tune import profiling
    from comet.tune import tuner as tn

    key = types.SimpleNamespace(arch="cpu", W=1, E=4, k=2, H=256, N=136, tokens=16, dtype="fp8",
                                sm_count=3, id=lambda: "fp8-key")
    for factory in (profiling.layer0_profiler, profiling.layer1_profiler):
        assert factory(key)(tn.Config(1, 16, 16)) > 0


def _master_call(r, buf, bad_layer):
    """Rank r's comet.fp8 (master-weight) layer0 + layer1 call on a group of 2 (the shapes of
    tests/test_input_checks.py); rank 1's topk_ids (bad_layer 0) or its layout's (1) on the meta
    device. Returns the call's error (or None) and whether a good pair of calls afterwards
    works."""
    from tests.test_input_checks import N1, _layer0_args

    a = _layer0_args(r)
    g = torch.Generator().manual_seed(10 + r)
    w1, tw = torch.randn(a["w0"].shape[0], a["x"].shape[1], N1, generator=g), torch.rand(5, 2)

    def pair(ids_of=lambda t: t, layout_of=lambda lay: lay):
        y0, layout = fp8.moe_layer0(a["x"], a["w0"], ids_of(a["topk_ids"]),
                                    num_experts=a["num_experts"], buffer=buf)
        return fp8.moe_layer1(y0[:, :N1].contiguous(), w1, tw, layout_of(layout), buffer=buf)

    try:
        if r == 1 and bad_layer == 0:
            pair(ids_of=lambda t: t.to("meta"))
        elif r == 1:
            pair(layout_of=lambda lay: dataclasses.replace(lay, topk_ids=lay.topk_ids.to("meta")))
        else:
            pair()
        err = None
    except ValueError as e:
        err = str(e)
    return err, pair().shape == (5, a["x"].shape[1])


@pytest.mark.parametrize("layer", [0, 1])
def test_master_weight_wrappers_check_devices_on_every_rank(layer):
    """comet.fp8.moe_layer0/1 run comet.moe_layer0/1's preamble (comet/layers/ops.py: layer0_call
    / layer1_call): rank 1's topk_ids (layer1: its layout's) on another device, the meta device
    standing in for a CPU tensor among CUDA ones, raise the ops' device error there and name
    rank 1 on rank 0, before any quantisation or kernel; the buffer serves the next calls."""
    (err0, ok0), (err1, ok1) = run_threads(2, lambda r, buf: _master_call(r, buf, layer))
    assert err1 and re.search(rf"comet\.moe_layer{layer}: topk_ids is on meta but "
                              rf"{'x' if layer == 0 else 'h'} is on cpu; all inputs must share "
                              "a device", err1), err1
    assert err0 and "rank 1" in err0, err0
    assert ok0 and ok1


def test_master_weight_wrappers_refuse_a_placement():
    """FP8 runs on the contiguous map: comet.fp8.moe_layer0 on a buffer with a placement, and
    moe_layer1 with a layout made under one, raise on every rank (they would otherwise run the
    contiguous map on the placement's slots)."""
    from comet.plan.placement import Placement
    from tests.test_input_checks import N1, _layer0_args

    bufs = comet.Buffer.simulated_world(2, timeout=20, placement=Placement.contiguous(4, 2))

    def rank(r, buf):
        a = _layer0_args(r)
        y0, layout = comet.moe_layer0(a["x"], a["w0"], a["topk_ids"], num_experts=4, buffer=buf)
        errs = []
        for call in (lambda: fp8.moe_layer0(a["x"], a["w0"], a["topk_ids"], num_experts=4,
                                            buffer=buf),
                     lambda: fp8.moe_layer1(y0[:, :N1].contiguous(), torch.randn(2, 8, N1),
                                            torch.rand(5, 2), layout, buffer=buf)):
            try:
                call()
                errs.append(None)
            except ValueError as e:
                errs.append(str(e))
        return errs

    for e0, e1 in run_threads(2, rank, buffers=bufs):
        assert e0 == ("comet.moe_layer0: FP8 (dispatch_fp8, w0_scale) with a placement is not "
                      "supported (FP8 runs on the contiguous map)"), e0
        assert e1 == ("comet.moe_layer1: FP8 (h_scale, w1_scale) with a placement is not "
                      "supported (FP8 runs on the contiguous map)"), e1


def _fp8_across_processes(rank, world):
    case = CASES[2] if world == 3 else CASES[1]
    xq, w0q, w1q, ids, wts = _fp8_inputs(case)
    y0, layout = comet.moe_layer0(xq[rank][0], w0q[rank][0], ids[rank], num_experts=case.experts,
                                  x_scale=xq[rank][1], w0_scale=w0q[rank][1],
                                  out_dtype=torch.float32)
    h, hs = fp8.quantize_rows(torch.tanh(y0[:, :case.n1]))
    out = comet.moe_layer1(h, w1q[rank][0], wts[rank], layout, h_scale=hs, w1_scale=w1q[rank][1],
                           out_dtype=torch.float32)
    y0_ref = ref.layer0_dist(fp8.dequantize_rows(*xq[rank]), fp8.dequantize_blocks(*w0q[rank]),
                             ids[rank], case.experts)
    out_ref = ref.layer1_dist(fp8.dequantize_rows(h, hs), fp8.dequantize_blocks(*w1q[rank]),
                              wts[rank], ids[rank], case.experts)
    torch.testing.assert_close(y0, y0_ref, **FP32_TIGHT)
    torch.testing.assert_close(out, out_ref, **FP32_TIGHT)
    return out.shape[0]


def test_fp8_across_processes():
    """Three processes (torch.distributed gloo, the shared-memory heap between processes): FP8 rows
    and their scales dispatched, both layers against the reference's torch.distributed form."""
    from tests.dist_utils import run_ranks

    assert run_ranks(_fp8_across_processes, 3, timeout=120) == list(CASES[2].tokens)
