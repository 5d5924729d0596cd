"""FP8 backward (docs/api.md "FP8"): bf16 backward on the dequantised values, against the
reference's autograd on those values; comet.fp8's master-weight wrappers and
comet.nn.MoE(fp8=True) against the bf16 module."""
import torch

import comet
import comet.nn
from comet import fp8
from comet import reference as ref
from tests.cases import make_inputs
from tests.sim_world import run_threads
from tests.test_fp8 import CASES, _fp8_inputs


def _grad_case():
    return CASES[2]  # 3 ranks, dropped slots, H = 260


def test_gradients_match_the_reference_on_dequantised_values():
    """comet.fp8.moe_layer0/1 (bf16 master weights quantised per call, x quantised on dispatch,
    h quantised per row): gradients of x, w0, h, w1 and topk_weights are the bf16 backward of
    the dequantised forward, checked against the reference's autograd on those values (the
    quantisation as identity: a straight-through estimator)."""
    case = _grad_case()
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    dys = [torch.randn(T, case.hidden, generator=g) for T in case.tokens]

    def rank(r, buf):
        x = xs[r].clone().requires_grad_()
        w0 = w0s[r].clone().requires_grad_()
        w1 = w1s[r].clone().requires_grad_()
        tw = wts[r].clone().requires_grad_()
        y0, layout = fp8.moe_layer0(x, w0, ids[r], num_experts=case.experts, buffer=buf,
                                    n_comm=1, tile=(8, 8))
        h = y0[:, :case.n1].contiguous()
        out = fp8.moe_layer1(h, w1, tw, layout, buffer=buf, n_comm=1, tile=(8, 8))
        (out.float() * dys[r]).sum().backward()
        return x.grad, w0.grad, w1.grad, tw.grad, y0.detach(), out.detach()

    res = run_threads(case.world, rank)

    # the reference on the dequantised values, fp32, the quantisers as identity
    def ste(t, q, dq):
        v = dq(*q(t.detach()))
        return t.float() + (v - t.float()).detach()

    rx = [xs[r].float().requires_grad_() for r in range(case.world)]
    rw0 = [w0s[r].float().requires_grad_() for r in range(case.world)]
    rw1 = [w1s[r].float().requires_grad_() for r in range(case.world)]
    rtw = [wts[r].clone().requires_grad_() for r in range(case.world)]
    y0r = ref.layer0_sim([ste(x, fp8.quantize_rows, fp8.dequantize_rows) for x in rx],
                         [ste(w, fp8.quantize_blocks, fp8.dequantize_blocks) for w in rw0],
                         ids, case.experts)
    # the forward's h: y0 rounded to bf16 (its dtype), then quantised per row
    hr = [ste(y[:, :case.n1].to(torch.bfloat16).float(), fp8.quantize_rows, fp8.dequantize_rows)
          for y in y0r]
    outr = ref.layer1_sim(hr, [ste(w, fp8.quantize_blocks, fp8.dequantize_blocks) for w in rw1],
                          rtw, ids, case.experts)
    sum((o * d).sum() for o, d in zip(outr, dys)).backward()
    for r, (dx, dw0, dw1, dtw, y0, out) in enumerate(res):
        assert dx.dtype == torch.bfloat16 and dw0.dtype == torch.bfloat16
        assert dw1.dtype == torch.bfloat16 and dtw.dtype == torch.float32
        for got, want in ((out, outr[r].detach()), (dtw, rtw[r].grad), (dw1, rw1[r].grad),
                          (dw0, rw0[r].grad), (dx, rx[r].grad)):
            _close_bf16(got, want)


def _close_bf16(got, want):
    """A bf16 backward against fp32: within bf16's rounding of its operands and result, as a
    fraction of the tensor's size (single elements may cancel)."""
    err = (got.float() - want).norm() / want.norm().clamp_min(1e-6)
    assert err < 1e-2, err


def test_op_backward_with_fp8_weights_gives_bf16_activation_grads():
    """The ops' own autograd with FP8 weights (no master): bf16 x with dispatch_fp8 and bf16 h get
    their gradients in bf16, the bf16 backward on the dequantised weights."""
    case = _grad_case()
    xs, _w0s, _w1s, ids, wts = make_inputs(case, torch.bfloat16)
    _xq, w0q, w1q, _ids, _wts = _fp8_inputs(case)

    def rank(r, buf):
        x = xs[r].clone().requires_grad_()
        y0, layout = comet.moe_layer0(x, w0q[r][0], ids[r], num_experts=case.experts, buffer=buf,
                                      w0_scale=w0q[r][1], dispatch_fp8=True, n_comm=1, tile=(8, 8))
        h = y0[:, :case.n1].detach().contiguous().requires_grad_()
        out = comet.moe_layer1(h, w1q[r][0], wts[r], layout, buffer=buf, w1_scale=w1q[r][1],
                               n_comm=1, tile=(8, 8))
        out.float().sum().backward()
        y0.float().sum().backward()
        return x.grad, h.grad, h.detach(), layout

    res = run_threads(case.world, rank)
    w0d = [fp8.dequantize_blocks(*w, torch.bfloat16).float() for w in w0q]
    w1d = [fp8.dequantize_blocks(*w, torch.bfloat16).float() for w in w1q]
    # dx[t] = sum over slots of 1 @ W0[e]; dh[row] = w[t, j] * (1 @ W1[e])
    rx = [xs[r].float().requires_grad_() for r in range(case.world)]
    y0r = ref.layer0_sim(rx, w0d, ids, case.experts)
    sum(y.sum() for y in y0r).backward()
    rh = [res[r][2].float().requires_grad_() for r in range(case.world)]
    sum(o.sum() for o in ref.layer1_sim(rh, w1d, wts, ids, case.experts)).backward()
    for r, (dx, dh, _h, _layout) in enumerate(res):
        assert dx.dtype == torch.bfloat16 and dh.dtype == torch.bfloat16
        torch.testing.assert_close(dx.float(), rx[r].grad, atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(dh.float(), rh[r].grad, atol=3e-2, rtol=2e-2)


# -- comet.nn.MoE(fp8=True) --------------------------------------------------------------------


def test_nn_moe_fp8_tracks_the_bf16_module_and_trains_its_master_weights():
    """The same module (same seed) with fp8=True: output and every parameter's gradient (bf16,
    the master weights') within FP8's error of the bf16 module's."""
    Hm, Fm, Em, Km = 160, 136, 4, 2
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, Hm, generator=g).to(torch.bfloat16) for n in (9, 6)]

    def run(use_fp8):
        def rank(r, buf):
            moe = comet.nn.MoE(Hm, Fm, Em, Km, buffer=buf, init_std=0.1, seed=5, n_comm=1,
                               tile=(8, 32), dtype=torch.bfloat16, fp8=use_fp8)
            x = xs[r].clone().requires_grad_()
            out = moe(x)
            out.float().sum().backward()
            return out.detach(), x.grad, moe.w0.grad, moe.w1.grad, moe.router.weight.grad

        return run_threads(2, rank)

    for q, b in zip(run(True), run(False)):
        for a, c in zip(q, b):
            assert a.dtype == c.dtype
            rel = (a.float() - c.float()).norm() / c.float().norm().clamp_min(1e-6)
            assert rel < 0.1, rel
