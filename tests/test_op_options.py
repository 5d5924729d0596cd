"""The ops' optional arguments: expert biases (b0, b1), transposed weight layouts (w0_transposed,
w1_transposed) and an upper bound on the dispatched rows (max_rows).

* forward against the reference (biases in the reference, transposed weights transposed back for
  it) on the awkward cases, simulated ranks, fp32 and bf16;
* gradients (x, w0, w1, topk_weights, b0, b1) against the reference's autograd, float64 exactly
  (1e-10) and fp32/bf16 at their tolerances, with max_rows padding in the middle;
* max_rows: padded outputs (zeros, -1 origins), a bound that is too small raising on every rank
  with the buffer usable afterwards, static shapes under torch.compile;
* bad values (bias shape/dtype, max_rows < -1, h not padded to max_rows) raising before any
  kernel runs; opcheck with every option; the same across gloo processes.
"""
import pytest
import torch

import comet
from comet import reference as ref
from tests.cases import E6_ON_3, TOL, cases_for, make_biases, make_inputs
from tests.dist_utils import run_ranks
from tests.sim_world import run_threads
from tests.test_autograd import activation, cotangents

GRAD_TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-4),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=1e-2, rtol=1e-2)}
CASES = [c for w in (1, 2, 3) for c in cases_for(w)] + [E6_ON_3]
NAMES = ("dx", "dw0", "dw1", "dtopk_weights", "db0", "db1")


def bound_for(case):
    """A max_rows above every rank's row count (rows <= sum of all tokens * k)."""
    return sum(case.tokens) * case.topk + 3


def reference(case, dtype, inputs, biases, vs):
    """Reference outputs and gradients (x, w0, w1, topk_weights, b0, b1) per rank."""
    leaves = [[t.detach().clone().requires_grad_(t.dtype.is_floating_point) for t in group]
              for group in (*inputs, *biases)]
    xs, w0s, w1s, ids, wts, b0s, b1s = leaves
    y0s = ref.layer0_sim(xs, w0s, ids, case.experts, b0s)
    hs = [activation(y, case.n1) for y in y0s]
    outs = ref.layer1_sim(hs, w1s, wts, ids, case.experts, b1s)
    sum((o.to(torch.float64) * v.to(torch.float64)).sum() for o, v in zip(outs, vs)).backward()
    grad = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731
    return [(outs[r].detach(), [grad(t) for t in (xs[r], w0s[r], w1s[r], wts[r], b0s[r], b1s[r])])
            for r in range(case.world)]


def comet_rank(case, r, buf, inputs, biases, vs, *, transposed, max_rows, **launch):
    """One rank's forward and backward through the wrappers with the options; gradients come
    back in the caller's layouts (dw of a transposed weight transposed back)."""
    xs, w0s, w1s, ids, wts = inputs
    b0s, b1s = biases
    x, w0, w1, wt, b0, b1 = (t.detach().clone() for t in
                             (xs[r], w0s[r], w1s[r], wts[r], b0s[r], b1s[r]))
    if transposed:
        w0, w1 = w0.transpose(1, 2).contiguous(), w1.transpose(1, 2).contiguous()
    for t in (x, w0, w1, wt, b0, b1):
        t.requires_grad_()
    y0, lay = comet.moe_layer0(x, w0, ids[r], num_experts=case.experts, b0=b0,
                               w0_transposed=transposed, max_rows=max_rows, buffer=buf, **launch)
    m = int(lay.recv_counts.sum())
    if max_rows is not None:
        assert y0.shape[0] == max_rows and lay.num_rows == max_rows
        assert torch.all(y0[m:] == 0) and torch.all(lay.row_source[m:] == -1)
    out = comet.moe_layer1(activation(y0, case.n1), w1, wt, lay, b1=b1, w1_transposed=transposed,
                           buffer=buf, **launch)
    out.backward(vs[r])
    dw0, dw1 = w0.grad, w1.grad
    if transposed:
        dw0, dw1 = dw0.transpose(1, 2), dw1.transpose(1, 2)
    return out.detach(), [x.grad, dw0, dw1, wt.grad, b0.grad, b1.grad]


def check(case, dtype, got, expect, ids):
    for r, ((out, grads), (e_out, e_grads)) in enumerate(zip(got, expect)):
        torch.testing.assert_close(out, e_out, **TOL[dtype])
        for name, g, e in zip(NAMES, grads, e_grads):
            assert g is not None and g.shape == e.shape and g.dtype == e.dtype, (case, r, name)
            scale = max(1.0, float(e.float().abs().max())) if e.numel() and dtype in (
                torch.bfloat16, torch.float16) else 1.0
            torch.testing.assert_close(g.double() / scale, e.double() / scale, **GRAD_TOL[dtype],
                                       msg=lambda m, n=name: f"{case} rank {r} {n}: {m}")
        assert torch.all(grads[3][ids[r] < 0] == 0)


def run_case(case, dtype, *, transposed, bounded, buffers=None, **launch):
    inputs = make_inputs(case, dtype)
    biases = make_biases(case, dtype)
    vs = [v.to(dtype) for v in cotangents(case, dtype)]
    expect = reference(case, dtype, inputs, biases, vs)
    max_rows = bound_for(case) if bounded else None
    got = run_threads(case.world, lambda r, buf: comet_rank(
        case, r, buf, inputs, biases, vs, transposed=transposed, max_rows=max_rows, **launch),
        buffers=buffers)
    check(case, dtype, got, expect, inputs[3])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_biases_transposed_bounded_match_reference(case, dtype):
    """Everything at once (biases, both weights transposed, padded rows), forward and backward."""
    run_case(case, dtype, transposed=True, bounded=True, n_comm=2, tile=(4, 8))


@pytest.mark.parametrize("transposed,bounded", [(False, False), (True, False), (False, True)])
def test_each_option_alone(transposed, bounded):
    for case in (cases_for(2)[5], E6_ON_3):
        run_case(case, torch.float32, transposed=transposed, bounded=bounded, n_comm=1,
                 tile=(5, 7))


def test_transposed_weights_are_read_without_a_copy():
    """Same bits as the untransposed call: the transposed layout is read through strides."""
    case = cases_for(2)[0]
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.bfloat16)

    def body(r, buf):
        outs = []
        for t in (False, True):
            w0 = w0s[r].transpose(1, 2).contiguous() if t else w0s[r]
            w1 = w1s[r].transpose(1, 2).contiguous() if t else w1s[r]
            y0, lay = comet.moe_layer0(xs[r], w0, ids[r], num_experts=case.experts,
                                       w0_transposed=t, buffer=buf)
            outs.append((y0, comet.moe_layer1(activation(y0, case.n1), w1, wts[r], lay,
                                              w1_transposed=t, buffer=buf)))
        (y_a, o_a), (y_b, o_b) = outs
        assert torch.equal(y_a, y_b) and torch.equal(o_a, o_b)

    run_threads(case.world, body)


def test_max_rows_too_small_raises_on_every_rank_and_buffer_stays_usable():
    case = cases_for(3)[0]
    xs, w0s, _w1s, ids, _wts = make_inputs(case)
    bufs = comet.Buffer.simulated_world(3, timeout=20)

    def body(r, buf):
        with pytest.raises(ValueError, match="max_rows is 2"):
            comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts, max_rows=2,
                             buffer=buf)
        y0, lay = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts, buffer=buf)
        return y0.shape[0]

    rows = run_threads(3, body, buffers=bufs)
    assert sum(rows) == sum(int((i >= 0).sum()) for i in ids)


def test_bad_option_values_raise_with_the_value():
    case = cases_for(1)[0]
    xs, w0s, w1s, ids, wts = make_inputs(case)
    buf = comet.Buffer.simulated_world(1)[0]
    E, el = case.experts, case.experts
    kw = dict(num_experts=E, buffer=buf)
    with pytest.raises(ValueError, match=r"b0 must be \[E_local, 20\].*got shape \[2, 19\]"):
        comet.moe_layer0(xs[0], w0s[0], ids[0], b0=torch.zeros(el, 19), **kw)
    with pytest.raises(TypeError, match="b0 has dtype bfloat16 but x has float32"):
        comet.moe_layer0(xs[0], w0s[0], ids[0], b0=torch.zeros(el, 20, dtype=torch.bfloat16),
                         **kw)
    with pytest.raises(ValueError, match="max_rows must be >= 0.*got -5"):
        comet.moe_layer0(xs[0], w0s[0], ids[0], max_rows=-5, **kw)
    with pytest.raises(ValueError, match=r"w0 must be \[E_local, H, N0\] \(w0_transposed\)"):
        comet.moe_layer0(xs[0], w0s[0], ids[0], w0_transposed=True, **kw)
    y0, lay = comet.moe_layer0(xs[0], w0s[0], ids[0], max_rows=40, **kw)
    h = activation(y0, case.n1)
    with pytest.raises(ValueError, match="h has 39 rows but max_rows is 40"):
        comet.moe_layer1(h[:39].contiguous(), w1s[0], wts[0], lay, buffer=buf)
    with pytest.raises(ValueError, match=r"b1 must be \[E_local, 24\]"):
        comet.moe_layer1(h, w1s[0], wts[0], lay, b1=torch.zeros(el, 12), buffer=buf)
    out = comet.moe_layer1(h, w1s[0], wts[0], lay, buffer=buf)  # and the buffer still works
    assert out.shape == (xs[0].shape[0], case.hidden)


def test_opcheck_and_static_shapes_under_compile():
    g = torch.Generator().manual_seed(1)
    T, H, N0, N1, E = 9, 16, 12, 6, 3
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, 2), generator=g)
    w0t = torch.randn(E, H, N0, generator=g) / 4
    w1t = torch.randn(E, N1, H, generator=g) / 4
    b0, b1 = torch.randn(E, N0, generator=g), torch.randn(E, H, generator=g)
    wts = torch.rand(T, 2, generator=g)
    buf = comet.Buffer.simulated_world(1)[0]
    launch = (1, 1, 4, 8)
    torch.library.opcheck(torch.ops.comet.moe_layer0.default,
                          (x, w0t.requires_grad_(), ids, E, buf.handle, *launch,
                           b0.requires_grad_(), True, 32))
    y0, _a, rc, sp, *_ = torch.ops.comet.moe_layer0(x, w0t.detach(), ids, E, buf.handle, *launch,
                                                    b0.detach(), True, 32)
    h = y0[:, :N1].contiguous().requires_grad_()
    torch.library.opcheck(torch.ops.comet.moe_layer1.default,
                          (h, w1t.requires_grad_(), wts, ids, sp, rc, E, buf.handle, *launch,
                           b1.requires_grad_(), True, 32))

    def moe(x):
        y0, lay = comet.moe_layer0(x, w0t, ids, num_experts=E, b0=b0, w0_transposed=True,
                                   max_rows=32, buffer=buf)
        assert y0.shape[0] == 32  # a static size, also while tracing
        return comet.moe_layer1(ref.swiglu(y0), w1t, wts, lay, b1=b1, w1_transposed=True,
                                buffer=buf)

    eager = moe(x)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


def _dist_options(rank, world, cases):
    for case in cases:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = make_inputs(case, dtype)
            biases = make_biases(case, dtype)
            vs = [v.to(dtype) for v in cotangents(case, dtype)]
            expect = reference(case, dtype, inputs, biases, vs)
            got = comet_rank(case, rank, None, inputs, biases, vs, transposed=True,
                             max_rows=bound_for(case))
            ids = inputs[3]
            check(case, dtype, [got], [expect[rank]], [ids[rank]])
    return True


def test_options_across_processes():
    cases = cases_for(2)
    assert all(run_ranks(_dist_options, 2, cases, timeout=180))
