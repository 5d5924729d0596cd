"""Autograd of torch.ops.comet.moe_layer0/1 (comet/layers/autograd.py).

* the virtual-token trick the backward relies on (rows of a [T*k, 1] call come out in the real
  dispatch order, with the same send positions and counts);
* torch.autograd.gradcheck in float64 over 1-4 simulated ranks (the whole world is one function:
  forward and backward run each rank on its own thread);
* gradients equal the pure-torch reference's autograd gradients in fp32 and bf16 on the awkward
  cases (simulated ranks, and 2-3 real processes over gloo); dropped slots get exactly zero;
* torch.compile(fullgraph=True, backend="aot_eager") forward+backward, opcheck with grads;
* deferred weight gradients (defer_weight_grads / compute_deferred_weight_grads), the overlap
  switch giving identical bits.
"""
import pytest
import torch

import comet
import comet.layers.autograd as cag
from comet import reference as ref
from tests.cases import E6_ON_3, TOL, Case, cases_for, make_inputs
from tests.dist_utils import run_ranks
from tests.sim_world import run_threads

LAUNCH = (1, 1, 4, 8)


def _f64_supported() -> bool:
    buf = comet.Buffer.simulated_world(1)[0]
    try:
        torch.ops.comet.moe_layer0(torch.ones(1, 2, dtype=torch.float64),
                                   torch.ones(1, 3, 2, dtype=torch.float64),
                                   torch.zeros(1, 1, dtype=torch.int64), 1, buf.handle, *LAUNCH)
        return True
    except TypeError:
        return False
    finally:
        buf.close()


needs_f64 = pytest.mark.skipif(not _f64_supported(),
                               reason="the CPU kernels do not accept float64 yet (ScalarKind F64)")


def activation(y0, n1):
    """Differentiable stand-in activation [M, N0] -> [M, N1] (same on both sides)."""
    acc = torch.float64 if y0.dtype == torch.float64 else torch.float32
    return torch.tanh(y0.to(acc)[:, :n1]).to(y0.dtype).contiguous()


# --------------------------------------------------------------------------------------------------
# The virtual-token ordering claim
# --------------------------------------------------------------------------------------------------


def _check_virtual_tokens(case):
    xs, w0s, _w1s, ids, _wts = make_inputs(case)
    el = case.experts // case.world

    def body(r, buf):
        _y0, lay = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts,
                                    buffer=buf, n_comm=2, tile=(3, 5))
        T, k = ids[r].shape
        vals = (torch.arange(T * k, dtype=torch.float32) + 1000 * r).reshape(T * k, 1)
        yv, lv = comet.moe_layer0(vals, torch.ones(el, 1, 1), ids[r].reshape(T * k, 1),
                                  num_experts=case.experts, buffer=buf)
        expect = (lay.row_source * 1000 + lay.row_token * k + lay.row_slot).float()
        assert torch.equal(yv[:, 0], expect), case
        assert torch.equal(lv.send_pos, lay.send_pos.reshape(T * k, 1)), case
        assert torch.equal(lv.recv_counts, lay.recv_counts), case
        # and back home: each row's scalar lands on its (t, j); dropped slots get 0
        back = cag._rows_to_slots(expect, ids[r], lay.send_pos, lay.recv_counts, case.experts,
                                  buf.handle, LAUNCH)
        tk = (torch.arange(T * k).reshape(T, k) + 1000 * r).float()
        assert torch.equal(back, torch.where(ids[r] >= 0, tk, 0.0)), case

    run_threads(case.world, body)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_virtual_tokens_come_out_in_dispatch_order(world):
    for case in cases_for(world) + ([E6_ON_3] if world == 3 else []):
        _check_virtual_tokens(case)


# --------------------------------------------------------------------------------------------------
# A simulated world as one differentiable function (for gradcheck)
# --------------------------------------------------------------------------------------------------


class _World(torch.autograd.Function):
    """flat per-rank inputs -> per-rank outputs. body(r, buf, *inputs_r) -> tensor runs on rank
    r's thread in forward; backward runs every rank's torch.autograd.grad on its own thread too
    (the backward collectives need all ranks at once)."""

    @staticmethod
    def forward(ctx, spec, *flat):
        body, bufs, counts = spec
        per_rank, i = [], 0
        for n in counts:
            per_rank.append(flat[i:i + n])
            i += n

        def fwd(r, buf):
            with torch.enable_grad():
                ins = [t.detach().requires_grad_(t.dtype.is_floating_point) for t in per_rank[r]]
                return ins, body(r, buf, *ins)

        ctx.spec, ctx.res = spec, run_threads(len(counts), fwd, buffers=bufs)
        return tuple(out.detach() for _ins, out in ctx.res)

    @staticmethod
    def backward(ctx, *gouts):
        _body, bufs, counts = ctx.spec

        def bwd(r, buf):
            ins, out = ctx.res[r]
            diff = [t for t in ins if t.requires_grad]
            g = torch.autograd.grad(out, diff, gouts[r], allow_unused=True, retain_graph=True)
            it = iter(g)
            return [next(it) if t.requires_grad else None for t in ins]

        grads = run_threads(len(counts), bwd, buffers=bufs)
        return (None, *[g for rank in grads for g in rank])


def world_fn(world, body, counts, bufs=None):
    bufs = bufs or comet.Buffer.simulated_world(world, timeout=20)
    return lambda *flat: _World.apply((body, bufs, counts), *flat)


def tiny_case(world, routing, seed):
    tokens = tuple(0 if (routing == "dropped" and r == world - 1 and world > 1) else 2 + (r % 2)
                   for r in range(world))
    return Case(f"tiny-{routing}-w{world}", world, 2 * world if routing != "duplicates" else world,
                2, tokens, hidden=3, n0=4, n1=2, routing=routing, seed=seed)


def _gradcheck_case(case, fast):
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.float64)
    wts = [w.double() for w in wts]
    world, E = case.world, case.experts

    def moe(r, buf, x, w0, w1, wt, tid):
        y0, lay = comet.moe_layer0(x, w0, tid, num_experts=E, buffer=buf, n_comm=1, tile=(2, 3))
        return comet.moe_layer1(activation(y0, case.n1), w1, wt, lay, buffer=buf, n_comm=2,
                                tile=(2, 2))

    flat = [t for r in range(world) for t in (xs[r], w0s[r], w1s[r], wts[r], ids[r])]
    for t in flat:
        t.requires_grad_(t.dtype.is_floating_point)
    assert torch.autograd.gradcheck(world_fn(world, moe, [5] * world), flat, fast_mode=fast,
                                    atol=1e-7, rtol=1e-6), case

    def l0(r, buf, x, w0, tid):  # y0 and a (the dispatched rows) both differentiable
        y0, a = torch.ops.comet.moe_layer0(x, w0, tid, E, buf.handle, 2, 1, 2, 2)[:2]
        return torch.cat([y0, a * 0.5], dim=1)

    flat0 = [t for r in range(world) for t in (xs[r], w0s[r], ids[r])]
    assert torch.autograd.gradcheck(world_fn(world, l0, [3] * world), flat0, fast_mode=fast,
                                    atol=1e-7, rtol=1e-6), case


@needs_f64
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gradcheck_float64(world):
    """d/d(x, w0, w1, topk_weights) of layer0 -> tanh -> layer1, and of layer0's (y0, a) alone,
    across all ranks (cross-rank Jacobian blocks included), with dropped slots, duplicate experts
    and (dropped case) a rank without tokens. Full Jacobians on 1-2 ranks, fast mode (random
    projections) on 3-4."""
    routings = ["dropped", "duplicates"] if world <= 2 else ["dropped"]
    for i, routing in enumerate(routings):
        _gradcheck_case(tiny_case(world, routing, seed=40 + i), fast=world >= 3)


# --------------------------------------------------------------------------------------------------
# Against the reference's autograd (simulated ranks)
# --------------------------------------------------------------------------------------------------


def cotangents(case, dtype):
    g = torch.Generator().manual_seed(77 + case.seed)
    return [torch.randn(T, case.hidden, generator=g).to(dtype) for T in case.tokens]


def reference_grads(case, dtype, inputs, vs):
    xs, w0s, w1s, ids, wts = [[t.detach().clone().requires_grad_(t.dtype.is_floating_point)
                               for t in group] for group in inputs]
    y0s = ref.layer0_sim(xs, w0s, ids, case.experts)
    hs = [activation(y, case.n1) for y in y0s]
    outs = ref.layer1_sim(hs, w1s, wts, ids, case.experts)
    loss = sum((o.float() * v.float()).sum() for o, v in zip(outs, vs))
    loss.backward()
    grad = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)
    return outs, [[grad(t) for t in (xs[r], w0s[r], w1s[r], wts[r])] for r in range(case.world)]


def comet_grads(case, inputs, vs, buffers=None, **launch):
    xs, w0s, w1s, ids, wts = inputs

    def rank(r, buf):
        x, w0, w1, wt = (t.detach().clone().requires_grad_() for t in
                         (xs[r], w0s[r], w1s[r], wts[r]))
        y0, lay = comet.moe_layer0(x, w0, ids[r], num_experts=case.experts, buffer=buf, **launch)
        out = comet.moe_layer1(activation(y0, case.n1), w1, wt, lay, buffer=buf, **launch)
        out.backward(vs[r])
        return out.detach(), [x.grad, w0.grad, w1.grad, wt.grad]

    return run_threads(case.world, rank, buffers=buffers)


GRAD_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
            torch.float16: dict(atol=1e-2, rtol=1e-2), torch.float64: dict(atol=1e-10, rtol=1e-10)}
NAMES = ("dx", "dw0", "dw1", "dtopk_weights")


def check_rank(case, dtype, got, expect_out, expect, ids):
    """One rank's output and gradients against the reference's (bf16/fp16: relative to the largest
    reference entry, the gradients being sums of many rounded terms)."""
    out, grads = got
    torch.testing.assert_close(out, expect_out.detach(), **TOL[dtype])
    for name, g, e in zip(NAMES, grads, expect):
        assert g is not None and g.dtype == e.dtype and g.shape == e.shape, (case, name)
        scale = 1.0
        if dtype in (torch.bfloat16, torch.float16) and e.numel():
            scale = max(1.0, float(e.float().abs().max()))
        torch.testing.assert_close(g.float() / scale, e.float() / scale, **GRAD_TOL[dtype],
                                   msg=lambda m, name=name: f"{case} {name}: {m}")
    assert torch.all(grads[3][ids < 0] == 0), "dropped slots must get zero weight gradient"


def check_grads(case, dtype, got, expect_outs, expect):
    ids = make_inputs(case)[3]
    for r in range(case.world):
        check_rank(case, dtype, got[r], expect_outs[r], expect[r], ids[r])


SIM_CASES = [c for w in (1, 2, 3, 4) for c in cases_for(w)] + [E6_ON_3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SIM_CASES, ids=str)
def test_gradients_match_reference(case, dtype):
    inputs = make_inputs(case, dtype)
    vs = cotangents(case, dtype)
    expect_outs, expect = reference_grads(case, dtype, inputs, vs)
    got = comet_grads(case, inputs, vs, n_comm=2, tile=(4, 8))
    check_grads(case, dtype, got, expect_outs, expect)


def test_dropped_slots_zero_gradient_even_with_nan_weights():
    case = cases_for(3)[3]  # dropped routing, a token with every slot dropped
    xs, w0s, w1s, ids, wts = make_inputs(case)
    wts = [torch.where(i < 0, torch.nan, w) for i, w in zip(ids, wts)]
    vs = cotangents(case, torch.float32)
    got = comet_grads(case, (xs, w0s, w1s, ids, wts), vs)
    clean = [torch.where(i < 0, 0.0, w) for i, w in zip(ids, wts)]
    expect_outs, expect = reference_grads(case, torch.float32, (xs, w0s, w1s, ids, clean), vs)
    check_grads(case, torch.float32, got, expect_outs, expect)
    for r, (out, grads) in enumerate(got):
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.all(grads[0][0] == 0)


def test_overlap_and_block_splits_give_identical_bits():
    case = cases_for(3)[5]
    inputs = make_inputs(case, torch.bfloat16)
    vs = cotangents(case, torch.bfloat16)
    bufs = comet.Buffer.simulated_world(3, timeout=20)
    base = comet_grads(case, inputs, vs, bufs, n_comm=1, tile=(8, 8))
    cag.set_weight_grad_overlap(False)
    try:
        other = comet_grads(case, inputs, vs, bufs, n_comm=3, tile=(5, 7))
    finally:
        cag.set_weight_grad_overlap(True)
    for (o1, g1), (o2, g2) in zip(base, other):
        assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


# --------------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------------


def _dist_grads(rank, world, cases, dtypes=(torch.float32, torch.bfloat16)):
    worst = {}
    for case in cases:
        for dtype in dtypes:
            inputs = make_inputs(case, dtype)
            vs = cotangents(case, dtype)
            expect_outs, expect = reference_grads(case, dtype, inputs, vs)
            xs, w0s, w1s, ids, wts = inputs
            x, w0, w1, wt = (t.detach().clone().requires_grad_() for t in
                             (xs[rank], w0s[rank], w1s[rank], wts[rank]))
            y0, lay = comet.moe_layer0(x, w0, ids[rank], num_experts=case.experts)
            out = comet.moe_layer1(activation(y0, case.n1), w1, wt, lay)
            out.backward(vs[rank])
            check_rank(case, dtype, (out.detach(), [x.grad, w0.grad, w1.grad, wt.grad]),
                       expect_outs[rank], expect[rank], ids[rank])
            diff = (out.detach().float() - expect_outs[rank].detach().float()).abs()
            worst[(case.name, str(dtype))] = float(diff.max()) if diff.numel() else 0.0
    return worst


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_across_processes(world):
    cases = cases_for(world) + ([E6_ON_3] if world == 3 else [])
    results = run_ranks(_dist_grads, world, cases, timeout=180)
    assert all(len(r) == 2 * len(cases) for r in results)


# --------------------------------------------------------------------------------------------------
# torch.compile, opcheck
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def buf1():
    return comet.Buffer.simulated_world(1)[0]


def small_inputs(dtype=torch.float32, T=9, H=16, N0=12, N1=6, E=3, k=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[0, 1] = -1
    w0 = (torch.randn(E, N0, H, generator=g) / 4).to(dtype)
    w1 = (torch.randn(E, H, N1, generator=g) / 4).to(dtype)
    wts = torch.rand(T, k, generator=g)
    return x, w0, w1, ids, wts, E


def test_compile_fullgraph_forward_backward(buf1):
    x, w0, w1, ids, wts, E = small_inputs()

    def moe(x, w0, w1, wts):
        y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf1)
        h = ref.swiglu(y0)
        return comet.moe_layer1(h, w1, wts, layout, buffer=buf1)

    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (moe, compiled):
        leaves = [t.clone().requires_grad_() for t in (x, w0, w1, wts)]
        out = fn(*leaves)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        results.append((out.detach(), [t.grad for t in leaves]))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o2, o1, atol=0, rtol=0)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert all(g is not None and torch.isfinite(g).all() for g in g2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_with_grad(buf1, dtype):
    x, w0, w1, ids, wts, E = small_inputs(dtype)
    x.requires_grad_()
    w0.requires_grad_()
    torch.library.opcheck(torch.ops.comet.moe_layer0.default,
                          (x, w0, ids, E, buf1.handle, *LAUNCH))
    y0, a, rc, sp, *_ = torch.ops.comet.moe_layer0(x.detach(), w0.detach(), ids, E, buf1.handle,
                                                   *LAUNCH)
    h = y0[:, : w1.shape[2]].contiguous().requires_grad_()
    torch.library.opcheck(torch.ops.comet.moe_layer1.default,
                          (h, w1.requires_grad_(), wts.requires_grad_(), ids, sp, rc, E,
                           buf1.handle, *LAUNCH))
    torch.library.opcheck(cag.expert_weight_grad, (y0, a, rc, torch.float32))


# --------------------------------------------------------------------------------------------------
# Deferred weight gradients
# --------------------------------------------------------------------------------------------------


def _run_small(buf, leaves, ids, E, backward):
    x, w0, w1, wts = leaves
    y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf)
    out = comet.moe_layer1(ref.swiglu(y0), w1, wts, layout, buffer=buf)
    backward(out)
    return out


@pytest.mark.parametrize("background", [False, True])
def test_deferred_weight_grads(buf1, background):
    x, w0, w1, ids, wts, E = small_inputs()
    v = torch.randn(x.shape[0], x.shape[1])
    eager = [t.clone().requires_grad_() for t in (x, w0, w1, wts)]
    _run_small(buf1, eager, ids, E, lambda o: o.backward(v))

    late = [t.clone().requires_grad_() for t in (x, w0, w1, wts)]
    with cag.defer_weight_grads(background=background) as q:
        _run_small(buf1, late, ids, E, lambda o: o.backward(v))
    assert late[1].grad is None and late[2].grad is None  # dW deferred
    assert late[0].grad is not None and late[3].grad is not None  # dx, dweights not
    assert len(q) == 2 and cag.pending_weight_grads() == 2
    assert cag.compute_deferred_weight_grads() == 2 and cag.pending_weight_grads() == 0
    for a, b in zip(late, eager):
        assert torch.equal(a.grad, b.grad)
    # a second micro-batch accumulates, like .grad does
    with cag.defer_weight_grads() as q:
        _run_small(buf1, late, ids, E, lambda o: o.backward(v))
    q.compute()
    torch.testing.assert_close(late[1].grad, 2 * eager[1].grad)


def test_deferred_queue_captured_at_forward_and_nonleaf_weights(buf1):
    """A queue active during forward is used by that op's backward (a layer owning its queue);
    a weight built from parameters (stack) gets its gradient propagated to the parameters."""
    x, w0, w1, ids, wts, E = small_inputs()
    v = torch.randn(x.shape[0], x.shape[1])
    p0 = [w.clone().requires_grad_() for w in w0]
    p1 = [w.clone().requires_grad_() for w in w1]
    q = cag.DeferredWeightGrads()
    with cag.defer_weight_grads(q):
        y0, layout = comet.moe_layer0(x, torch.stack(p0), ids, num_experts=E, buffer=buf1)
        out = comet.moe_layer1(ref.swiglu(y0), torch.stack(p1), wts, layout, buffer=buf1)
    out.backward(v)
    assert all(p.grad is None for p in p0 + p1) and len(q) == 2
    q.compute()
    eager = [t.clone().requires_grad_() for t in (w0, w1)]
    _run_small(buf1, [x, eager[0], eager[1], wts], ids, E, lambda o: o.backward(v))
    assert torch.equal(torch.stack([p.grad for p in p0]), eager[0].grad)
    assert torch.equal(torch.stack([p.grad for p in p1]), eager[1].grad)
