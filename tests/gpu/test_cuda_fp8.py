"""The CUDA FP8 kernels (sm_90a: CUTLASS's blockwise-scaled FP8 wgmma mainloop; sm_89: FP8
mma.sync), one process per GPU (see conftest.py for the command). WRITTEN, NEVER RUN: no machine of
this project has a GPU, and the kernels themselves are compiled and checked statically only; the
file skips without a GPU (conftest.py), and its FP8 tests skip on a GPU without FP8 tensor cores.

* FP8 on both operands (FP8 x with x_scale, FP8 w0 / w1, h quantised per row by
  comet.fp8.quantize_rows) against comet.reference on the dequantised values in fp32 (bf16 results:
  the GPU sums each 128-wide K block in its own order, so 2e-2), with awkward-but-allowed sizes
  (H, N1 multiples of 16 and not of 128), an empty rank, skewed and dropped routing, biases;
  bitwise run to run;
* dispatch_fp8=True equals the pre-quantised x bitwise (the sender's one-pass kernel, fp8_pack.cu,
  gives quantize_rows' bits), and layer0's
  `a` (the packed rows) unpacks to the source rows;
* backward (bf16 on the dequantised values) through comet.fp8.moe_layer0 / moe_layer1 (on CUDA
  both operands must be FP8, so training goes through these master-weight wrappers, which call the
  ops and their autograd) against the reference's autograd; comet.nn.MoE(fp8=True) near the bf16
  module;
* refusals, each on every rank before anything runs, the buffer then serving a bf16 call: mixed
  operands and out_dtype=float32 (TypeError, any GPU), H or N1 not a multiple of 16 on sm_90 and
  any FP8 call on a GPU without FP8 tensor cores (ValueError)."""
import dataclasses
import os

import pytest
import torch

import comet
import comet.nn
from comet import fp8
from comet import reference as ref
from tests.cases import Case, cases_for, h_from_y0, make_biases, make_inputs
from tests.gpu.conftest import all_gather_cpu, require_fp8
from tests.gpu.test_cuda_ops import check_against_reference, run_layers
from tests.test_fp8 import _fp8_inputs
from tests.test_fp8_grad import _close_bf16

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
BF16 = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _buffer():
    from comet.buffers import symm_cuda

    return symm_cuda.buffer_for(None, _device())


def _require(*capabilities):
    cap = torch.cuda.get_device_capability()
    if cap not in capabilities:
        pytest.skip(f"needs sm_{' or sm_'.join(f'{a}{b}' for a, b in capabilities)}; this GPU is "
                    f"sm_{cap[0]}{cap[1]}")


def _empty_last(tokens):
    """The last rank sends nothing (when there is more than one rank)."""
    return tuple(0 if WORLD > 1 and r == WORLD - 1 else t for r, t in enumerate(tokens))


W = WORLD
# (case, with biases). H and N1 are layer0's and layer1's K: multiples of 16 (sm_90's TMA rows).
CASES = [
    (Case("aligned", W, 4 * W, 2, tuple(300 + 17 * r for r in range(W)), hidden=256, n0=384,
          n1=256, seed=21), False),
    (Case("x16-skewed-empty", W, 3 * W, 2, _empty_last([97 + 5 * r for r in range(W)]),
          hidden=272, n0=160, n1=144, routing="skewed", seed=22), False),
    (Case("x16-dropped-bias", W, 2 * W, 3, tuple(40 + 9 * r for r in range(W)), hidden=144,
          n0=48, n1=32, routing="dropped", seed=23), True),
]
# sm_89's mma.sync kernel takes any size (sm_90 refuses these: test_sm90_needs_multiples_of_16).
RAGGED = Case("ragged-sm89", W, 2 * W, 2, tuple(33 + 4 * r for r in range(W)), hidden=200, n0=72,
              n1=36, seed=24)


def _to(t):
    return t.to(_device())


def run_fp8(case, rank, inputs, biases=None):
    """All-FP8 layer0 -> h_from_y0 quantised per row -> all-FP8 layer1 on this rank; returns
    (y0, layout, h_q, h_scale, out)."""
    xq, w0q, w1q, ids, wts = inputs
    b0, b1 = (None, None) if biases is None else (_to(biases[0][rank]), _to(biases[1][rank]))
    y0, layout = comet.moe_layer0(_to(xq[rank][0]), _to(w0q[rank][0]), _to(ids[rank]),
                                  num_experts=case.experts, x_scale=_to(xq[rank][1]),
                                  w0_scale=_to(w0q[rank][1]), b0=b0)
    hq, hs = fp8.quantize_rows(h_from_y0(y0, case.n1))
    out = comet.moe_layer1(hq, _to(w1q[rank][0]), _to(wts[rank]), layout, h_scale=hs,
                           w1_scale=_to(w1q[rank][1]), b1=b1)
    torch.cuda.synchronize()
    return y0, layout, hq, hs, out


def check_fp8(case, rank, world, inputs, biases, y0, layout, hq, hs, out):
    """Against the reference on the dequantised values (fp32); layer1 on the h every rank
    actually produced."""
    xq, w0q, w1q, ids, wts = inputs
    b0s, b1s = (None, None) if biases is None else [[b.float() for b in bs] for bs in biases]
    rows = ref.dispatch_rows(ids, case.experts, rank)
    assert layout.row_source.cpu().tolist() == [r.source for r in rows]
    assert layout.row_token.cpu().tolist() == [r.token for r in rows]
    assert y0.dtype == BF16 and tuple(y0.shape) == (len(rows), case.n0)
    assert out.dtype == BF16 and tuple(out.shape) == (case.tokens[rank], case.hidden)
    y0_ref = ref.layer0_sim([fp8.dequantize_rows(*q) for q in xq],
                            [fp8.dequantize_blocks(*q) for q in w0q], ids, case.experts, b0s)
    torch.testing.assert_close(y0.cpu().float(), y0_ref[rank], **TOL)
    hs_all = all_gather_cpu(fp8.dequantize_rows(hq.cpu(), hs.cpu()), world)
    out_ref = ref.layer1_sim(hs_all, [fp8.dequantize_blocks(*q) for q in w1q], wts, ids,
                             case.experts, b1s)
    torch.testing.assert_close(out.cpu().float(), out_ref[rank], **TOL)


def _forward_matches_reference_bitwise(case, rank, w, with_biases):
    inputs = _fp8_inputs(case)
    biases = make_biases(case, BF16) if with_biases else None
    first = run_fp8(case, rank, inputs, biases)
    check_fp8(case, rank, w, inputs, biases, *first)
    again = run_fp8(case, rank, inputs, biases)
    assert torch.equal(first[0], again[0]) and torch.equal(first[4], again[4])  # run to run


@pytest.mark.parametrize("case,with_biases", CASES, ids=[str(c) for c, _ in CASES])
def test_fp8_layers_match_reference_on_dequantised_values(world, case, with_biases):
    rank, w = world
    require_fp8()
    _forward_matches_reference_bitwise(case, rank, w, with_biases)


def test_sm89_takes_any_size(world):
    rank, w = world
    _require((8, 9))
    _forward_matches_reference_bitwise(RAGGED, rank, w, False)


def _layer0_raw(x, w0, w0_scale, ids, num_experts, x_scale=None, dispatch_fp8=False):
    """torch.ops.comet.moe_layer0 as comet.moe_layer0 calls it, for its `a` output (the dispatched
    rows, packed FP8 rows here). Returns (y0, a, row_source, row_token)."""
    from comet.layers import ops

    buf = _buffer()
    scales = dict(w0_scale=w0_scale, **({} if x_scale is None else dict(x_scale=x_scale)))
    c = ops.layer0_call(buf, x, w0, ids, num_experts=num_experts, fp8=True, **scales)
    out = torch.ops.comet.moe_layer0(x, w0, ids, int(num_experts), buf.handle, *c.cfg, None, False,
                                     c.rows, c.tp, dispatch_fp8=dispatch_fp8, **scales)
    torch.cuda.synchronize()
    return out[0], out[1], out[4], out[5]


def test_dispatched_rows_unpack_to_the_source_rows(world):
    """layer0's `a` with FP8 x: uint8 [M, row_bytes(H)], each row the source token's FP8 values and
    scales (values first), bit for bit."""
    rank, _ = world
    require_fp8()
    case = CASES[1][0]
    xq, w0q, _w1q, ids, _wts = _fp8_inputs(case)
    _y0, a, source, token = _layer0_raw(_to(xq[rank][0]), _to(w0q[rank][0]), _to(w0q[rank][1]),
                                        _to(ids[rank]), case.experts, x_scale=_to(xq[rank][1]))
    assert a.dtype == torch.uint8 and tuple(a.shape) == (source.numel(), fp8.row_bytes(case.hidden))
    q, s = fp8.unpack_rows(a.cpu(), case.hidden)
    rows = ref.dispatch_rows(ids, case.experts, rank)
    assert source.cpu().tolist() == [r.source for r in rows]
    assert token.cpu().tolist() == [r.token for r in rows]
    for i, row in enumerate(rows):
        assert torch.equal(q[i].view(torch.uint8), xq[row.source][0][row.token].view(torch.uint8))
        assert torch.equal(s[i], xq[row.source][1][row.token])


def test_dispatch_fp8_equals_prequantised_x(world):
    """dispatch_fp8=True quantises the bf16 x on the sending rank with quantize_rows: y0 and the
    packed rows equal those of the call given quantize_rows(x) and its scales, bit for bit."""
    rank, _ = world
    require_fp8()
    case = CASES[0][0]
    xs, _w0s, _w1s, ids, _wts = make_inputs(case, BF16)
    _xq, w0q, _w1q, _ids, _wts = _fp8_inputs(case)
    x, w0, ws, tid = _to(xs[rank]), _to(w0q[rank][0]), _to(w0q[rank][1]), _to(ids[rank])
    y0_d, a_d, _, _ = _layer0_raw(x, w0, ws, tid, case.experts, dispatch_fp8=True)
    xq, x_scale = fp8.quantize_rows(x)
    y0_q, a_q, _, _ = _layer0_raw(xq, w0, ws, tid, case.experts, x_scale=x_scale)
    assert torch.equal(a_d, a_q) and torch.equal(y0_d, y0_q)


# -- backward ---------------------------------------------------------------------------------------

GRAD = Case("grad", W, 2 * W, 2, _empty_last([33 + 7 * r for r in range(W)]), hidden=144, n0=96,
            n1=48, routing="dropped", seed=25)


def _seed(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _ste(t, quantize, dequantize):
    """t's quantised-and-dequantised value forward, the identity backward (the layers' rule)."""
    return t + (dequantize(*quantize(t.detach())) - t).detach()


def test_backward_matches_reference_autograd(world):
    """FP8 forward, bf16 backward on the dequantised values: layer0 (x, w0, b0) with its y0
    gradient seeded, layer1 (h, w1, b1, topk_weights) on a leaf h (this rank's activation of its
    y0), each against the reference's autograd on the same values in fp32."""
    rank, w = world
    require_fp8()
    case = GRAD
    xs, w0s, w1s, ids, wts = make_inputs(case, BF16)
    b0s, b1s = make_biases(case, BF16)
    x, w0, b0, w1, b1, tw = (_to(t).requires_grad_() for t in
                             (xs[rank], w0s[rank], b0s[rank], w1s[rank], b1s[rank], wts[rank]))
    y0, layout = fp8.moe_layer0(x, w0, _to(ids[rank]), num_experts=case.experts, b0=b0)
    (y0.float() * _to(_seed(y0.shape, 70 + rank))).sum().backward()
    h = h_from_y0(y0.detach(), case.n1).requires_grad_()
    out = fp8.moe_layer1(h, w1, tw, layout, b1=b1)
    (out.float() * _to(_seed(out.shape, 90 + rank))).sum().backward()
    for t in (x, w0, b0, w1, b1, h):
        assert t.grad.dtype == BF16
    assert tw.grad.dtype == torch.float32

    rx, rw0, rb0, rw1, rb1, rtw = ([t.detach().float().clone().requires_grad_() for t in ts]
                                   for ts in (xs, w0s, b0s, w1s, b1s, wts))
    y0r = ref.layer0_sim([_ste(t, fp8.quantize_rows, fp8.dequantize_rows) for t in rx],
                         [_ste(t, fp8.quantize_blocks, fp8.dequantize_blocks) for t in rw0], ids,
                         case.experts, rb0)
    sum((y * _seed(y.shape, 70 + r)).sum() for r, y in enumerate(y0r)).backward()
    rh = [t.float().requires_grad_() for t in all_gather_cpu(h.detach().cpu(), w)]
    outr = ref.layer1_sim([_ste(t, fp8.quantize_rows, fp8.dequantize_rows) for t in rh],
                          [_ste(t, fp8.quantize_blocks, fp8.dequantize_blocks) for t in rw1], rtw,
                          ids, case.experts, rb1)
    sum((o * _seed(o.shape, 90 + r)).sum() for r, o in enumerate(outr)).backward()
    torch.testing.assert_close(y0.detach().cpu().float(), y0r[rank].detach(), **TOL)
    torch.testing.assert_close(out.detach().cpu().float(), outr[rank].detach(), **TOL)
    for got, want in ((x, rx), (w0, rw0), (b0, rb0), (h, rh), (w1, rw1), (b1, rb1), (tw, rtw)):
        if want[rank].grad is None:  # nothing reached it (an empty rank's x)
            assert not got.grad.any()
        else:
            _close_bf16(got.grad.cpu(), want[rank].grad)


def test_nn_moe_fp8_tracks_the_bf16_module(world):
    """comet.nn.MoE(fp8=True) (master weights quantised per step, tokens on dispatch, the SwiGLU
    output per row): output and every gradient within FP8's error (0.1 relative) of the bf16
    module with the same seed."""
    rank, w = world
    require_fp8()
    hidden, ffn, experts, topk = 256, 144, 2 * w, 2
    x_all = [_seed((40 + 9 * r, hidden), 3 + r).to(BF16) for r in range(w)]

    def run(use_fp8):
        moe = comet.nn.MoE(hidden, ffn, experts, topk, init_std=0.1, seed=5, dtype=BF16,
                           device=_device(), fp8=use_fp8)
        x = _to(x_all[rank]).requires_grad_()
        out = moe(x)
        out.float().sum().backward()
        return [t.detach().cpu() for t in (out, x.grad, moe.w0.grad, moe.w1.grad,
                                           moe.router.weight.grad)]

    for q, b in zip(run(True), run(False)):
        assert q.dtype == b.dtype
        rel = (q.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)
        assert rel < 0.1, rel


# -- refusals ---------------------------------------------------------------------------------------

SMALL = dataclasses.replace(cases_for(W)[0], name="small", hidden=256, n0=128, n1=128, seed=30)


def _serves_bf16(rank, w):
    y0, layout, h, out, inputs = run_layers(SMALL, BF16, rank)
    check_against_reference(SMALL, BF16, rank, w, y0, layout, h, out, inputs)


def _small_fp8(rank):
    """SMALL's FP8 operands on this rank: (x_q, x_scale, w0_q, w0_scale, ids, w1_q, w1_scale,
    topk_weights), on the GPU."""
    xq, w0q, w1q, ids, wts = _fp8_inputs(SMALL)
    return tuple(_to(t) for t in (*xq[rank], *w0q[rank], ids[rank], *w1q[rank], wts[rank]))


def _mixed_call(form, rank):
    xq, xs, w0q, w0s, ids, w1q, w1s, tw = _small_fp8(rank)
    E = SMALL.experts
    if form == "bf16-x":
        return comet.moe_layer0(fp8.dequantize_rows(xq, xs, BF16), w0q, ids, num_experts=E,
                                w0_scale=w0s)
    if form == "bf16-w0":
        return comet.moe_layer0(xq, fp8.dequantize_blocks(w0q, w0s, BF16), ids, num_experts=E,
                                x_scale=xs)
    if form == "out-float32":
        return comet.moe_layer0(xq, w0q, ids, num_experts=E, x_scale=xs, w0_scale=w0s,
                                out_dtype=torch.float32)
    # bf16 h with FP8 w1, on the layout of a bf16 layer0 call (any GPU)
    y0, layout = comet.moe_layer0(fp8.dequantize_rows(xq, xs, BF16),
                                  fp8.dequantize_blocks(w0q, w0s, BF16), ids, num_experts=E)
    return comet.moe_layer1(h_from_y0(y0, SMALL.n1), w1q, tw, layout, w1_scale=w1s)


MIXED = {
    "bf16-x": r"the CUDA FP8 kernels take FP8 on both operands: w0 is float8_e4m3fn but x is "
              r"bfloat16 \(pass dispatch_fp8=True or an FP8 x with x_scale; mixed precision runs "
              r"on the CPU backend\)",
    "bf16-w0": r"the CUDA FP8 kernels take FP8 on both operands: x is FP8 but w0 is bfloat16 "
               r"\(quantise it with comet\.fp8\.quantize_blocks; mixed precision runs on the CPU "
               r"backend\)",
    "bf16-h": r"the CUDA FP8 kernels take FP8 on both operands: w1 is float8_e4m3fn but h is "
              r"bfloat16 \(quantise it with comet\.fp8\.quantize_rows; mixed precision runs on "
              r"the CPU backend\)",
    "out-float32": r"the CUDA FP8 kernels write bfloat16, got out_dtype=float32 \(other result "
                   r"dtypes run on the CPU backend\)",
}


@pytest.mark.parametrize("form", list(MIXED))
def test_mixed_fp8_and_other_result_dtypes_are_refused(world, form):
    """The shared checks (csrc/op_checks.cpp, Checker::precision) refuse these before the GPU's
    kind is looked at, so on any GPU."""
    rank, w = world
    with pytest.raises(TypeError, match=MIXED[form]):
        _mixed_call(form, rank)
    _serves_bf16(rank, w)


def test_sm90_needs_multiples_of_16(world):
    """sm_90's FP8 kernel loads rows with TMA (16-byte rows): layer0 with H = 200, layer1 with
    N1 = 72 refused with a ValueError."""
    rank, w = world
    _require((9, 0))
    odd = dataclasses.replace(SMALL, name="h200", hidden=200)
    xq, w0q, _w1q, ids, _wts = _fp8_inputs(odd)
    with pytest.raises(ValueError, match=r"200.*multiple of 16"):
        comet.moe_layer0(_to(xq[rank][0]), _to(w0q[rank][0]), _to(ids[rank]),
                         num_experts=odd.experts, x_scale=_to(xq[rank][1]),
                         w0_scale=_to(w0q[rank][1]))
    _serves_bf16(rank, w)
    xq, xs, w0q, w0s, ids, _w1q, _w1s, tw = _small_fp8(rank)
    y0, layout = comet.moe_layer0(xq, w0q, ids, num_experts=SMALL.experts, x_scale=xs,
                                  w0_scale=w0s)
    hq, hs = fp8.quantize_rows(h_from_y0(y0, 72))
    w1q, w1s = fp8.quantize_blocks(_to(_seed((SMALL.experts // w, SMALL.hidden, 72), 31)))
    with pytest.raises(ValueError, match=r"72.*multiple of 16"):
        comet.moe_layer1(hq, w1q, tw, layout, h_scale=hs, w1_scale=w1s)
    _serves_bf16(rank, w)


def test_fp8_refused_without_fp8_tensor_cores(world):
    """Ampere (sm_80, sm_86) has no FP8 tensor cores: an all-FP8 call raises a ValueError naming
    the GPU's sm (no dequantising fallback: the caller dequantises, or runs FP8 on the CPU)."""
    rank, w = world
    major, minor = torch.cuda.get_device_capability()
    if major != 8 or (major, minor) == (8, 9):
        pytest.skip(f"for a GPU without FP8 tensor cores; this one is sm_{major}{minor}")
    xq, xs, w0q, w0s, ids, *_ = _small_fp8(rank)
    with pytest.raises(ValueError, match=rf"FP8 tensor cores.*sm_{major}{minor}"):
        comet.moe_layer0(xq, w0q, ids, num_experts=SMALL.experts, x_scale=xs, w0_scale=w0s)
    _serves_bf16(rank, w)
