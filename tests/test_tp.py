"""Expert tensor parallelism (tp_size > 1) on the CPU backend, ranks simulated as threads.

Against comet.reference's tp reference (the layer over the full experts, each rank given its
shard): the layout rows (tp_dispatch_rows, the same on the t ranks of an EP rank), y0, the output
(fp32 tight, bf16 ~2e-2), the gradients of x, w0, w1, b0, b1 and topk_weights against the
reference's autograd over the full weights, bitwise reproducibility run to run, and the input
errors raised on every rank before any kernel."""
import dataclasses
import os
import runpy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comet
from comet._native import _C
from comet import reference as ref
from tests.cases import TOL
from tests.dist_utils import run_ranks
from tests.sim_world import run_threads


@dataclasses.dataclass(frozen=True)
class TpCase:
    name: str
    world: int
    tp: int
    experts: int
    tokens: tuple
    topk: int = 2
    hidden: int = 16
    n0: int = 12   # full width N0 = N1 (an elementwise activation); each rank holds n0 / tp
    drop: float = 0.0
    skew: bool = False
    seed: int = 0

    @property
    def n1(self):
        return self.n0

    def __str__(self):
        return f"{self.name}-W{self.world}t{self.tp}E{self.experts}"


CASES = [
    TpCase("ep1tp2", 2, 2, 4, (5, 3)),
    TpCase("ep2tp2", 4, 2, 6, (4, 0, 7, 3), topk=3, drop=0.25),       # E/EP = 3, an empty rank
    TpCase("ep1tp4", 4, 4, 3, (3, 6, 1, 2), n0=16, skew=True),  # E = 3, all on one EP rank
    TpCase("ep2tp2-odd", 4, 2, 2, (1, 5, 0, 4), topk=2, hidden=13, n0=10, drop=0.4),
    TpCase("ep3tp2", 6, 2, 6, (2, 3, 0, 4, 1, 2), topk=2, n0=6),
    TpCase("ep2tp3", 6, 3, 4, (3, 1, 2, 0, 2, 3), topk=3, n0=9, drop=0.2),
]


def act(y):
    """An elementwise activation: the activation of each shard of y0 is the full one's shard."""
    return torch.tanh(y.to(torch.float64 if y.dtype == torch.float64 else torch.float32)).to(y.dtype)


def make_inputs(case: TpCase, dtype, bias=True):
    g = torch.Generator().manual_seed(1000 + case.seed)
    E, H = case.experts, case.hidden
    w0 = (torch.randn(E, case.n0, H, generator=g) / H ** 0.5).to(dtype)
    w1 = (torch.randn(E, H, case.n1, generator=g) / case.n1 ** 0.5).to(dtype)
    b0 = (0.1 * torch.randn(E, case.n0, generator=g)).to(dtype) if bias else None
    b1 = (0.1 * torch.randn(E, H, generator=g)).to(dtype) if bias else None
    xs, ids, wts = [], [], []
    for T in case.tokens:
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        if case.skew:  # most slots on expert 0
            logits = torch.randn(T, E, generator=g)
            logits[:, 0] += 4.0
        else:
            logits = torch.randn(T, E, generator=g)
        k = min(case.topk, E)
        topi = torch.topk(logits, k, dim=1).indices
        if case.drop:
            topi = torch.where(torch.rand(T, k, generator=g) < case.drop, -1, topi)
        ids.append(topi.to(torch.int32))
        wts.append(torch.rand(T, k, generator=g).to(torch.float32 if dtype != torch.float64
                                                        else torch.float64))
    return xs, w0, w1, b0, b1, ids, wts


def shards(case, rank, w0, w1, b0, b1, transposed=False):
    """Rank `rank`'s operands: w0 / b0 sharded along N0, w1 along N1, b1 whole (its EP rank's)."""
    W, t = case.world, case.tp
    w0r, w1r = ref.tp_shard(w0, W, t, rank, 1), ref.tp_shard(w1, W, t, rank, 2)
    if transposed:
        w0r, w1r = w0r.transpose(1, 2).contiguous(), w1r.transpose(1, 2).contiguous()
    b0r = None if b0 is None else ref.tp_shard(b0, W, t, rank, 1)
    el = case.experts // (W // t)
    q = rank // t
    b1r = None if b1 is None else b1[q * el:(q + 1) * el].contiguous()
    return w0r, w1r, b0r, b1r


def run(case, inputs, *, transposed=False, max_rows=None, n_comm=1, tile=(8, 8), grad=False,
        buffers=None):
    xs, w0, w1, b0, b1, ids, wts = inputs
    # one node whatever $COMET_CPU_RANKS_PER_NODE says (t > 1 is refused across nodes)
    bufs = buffers or comet.Buffer.simulated_world(case.world, timeout=20, tp_size=case.tp,
                                                   ranks_per_node=case.world)

    def rank(r, buf):
        w0r, w1r, b0r, b1r = shards(case, r, w0, w1, b0, b1, transposed)
        x, wt = xs[r].clone(), wts[r].clone()
        leaves = [x, w0r, w1r, wt] + [b for b in (b0r, b1r) if b is not None]
        if grad:
            for leaf in leaves:
                leaf.requires_grad_(True)
        y0, layout = comet.moe_layer0(x, w0r, ids[r], num_experts=case.experts, b0=b0r,
                                      w0_transposed=transposed, max_rows=max_rows, buffer=buf,
                                      n_comm=n_comm, tile=tile)
        out = comet.moe_layer1(act(y0), w1r, wt, layout, b1=b1r, w1_transposed=transposed,
                               buffer=buf, n_comm=n_comm, tile=tile)
        grads = None
        if grad:
            g = torch.Generator().manual_seed(7 + r)
            seed = torch.randn(out.shape, generator=g).to(out.dtype)
            (out * seed).sum().backward()
            grads = {"x": x.grad, "w0": w0r.grad, "w1": w1r.grad, "w": wt.grad,
                     "b0": None if b0r is None else b0r.grad,
                     "b1": None if b1r is None else b1r.grad}
        return y0.detach(), layout, out.detach(), grads

    return run_threads(case.world, rank, buffers=bufs)


def check_forward(case, inputs, results, dtype, max_rows=None):
    xs, w0, w1, b0, b1, ids, wts = inputs
    outs = ref.moe_tp_sim(xs, w0, w1, ids, wts, act, b0, b1)
    for r, (y0, layout, out, _) in enumerate(results):
        rows = ref.tp_dispatch_rows(ids, case.experts, r, case.tp)
        M = len(rows)
        assert layout.tp_size == case.tp
        assert layout.num_rows == (M if max_rows is None else max_rows)
        assert layout.row_source[:M].tolist() == [row.source for row in rows]
        assert layout.row_token[:M].tolist() == [row.token for row in rows]
        assert layout.row_slot[:M].tolist() == [row.slot for row in rows]
        assert y0.shape == (layout.num_rows, case.n0 // case.tp)
        # y0 = this rank's shard of x @ W0[e]^T + b0[e], row by row
        w0r, _, b0r, _ = shards(case, r, w0, w1, b0, b1)
        el = case.experts // (case.world // case.tp)
        if M:
            a = torch.stack([xs[row.source][row.token] for row in rows])
            expert = torch.tensor([row.local_expert for row in rows])
            y0_ref = ref._expert_gemm(a, expert, w0r, b0r).to(dtype)
            torch.testing.assert_close(y0[:M], y0_ref, **TOL[dtype])
        assert el == w0r.shape[0]
        torch.testing.assert_close(out, outs[r], **TOL[dtype])
    # the t ranks of one EP rank hold the same rows, in the same order, and the same y0 row order
    for r, (_, layout, _, _) in enumerate(results):
        first = results[r - r % case.tp][1]
        assert torch.equal(layout.row_source, first.row_source)
        assert torch.equal(layout.row_token, first.row_token)
        assert torch.equal(layout.recv_counts, first.recv_counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, dtype):
    inputs = make_inputs(case, dtype)
    check_forward(case, inputs, run(case, inputs), dtype)


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=str)
def test_transposed_weights_and_max_rows(case):
    inputs = make_inputs(case, torch.float32)
    bound = 64
    results = run(case, inputs, transposed=True, max_rows=bound)
    check_forward(case, inputs, results, torch.float32, max_rows=bound)
    for y0, layout, _, _ in results:
        M = int(layout.recv_counts.sum())
        assert torch.all(y0[M:] == 0) and torch.all(layout.row_source[M:] == -1)


def test_bitwise_run_to_run_and_across_splits():
    case = CASES[1]
    inputs = make_inputs(case, torch.bfloat16)
    first = run(case, inputs)
    again = run(case, inputs)
    split = run(case, inputs, n_comm=2, tile=(4, 16))
    for a, b, c in zip(first, again, split):
        assert torch.equal(a[2], b[2]) and torch.equal(a[2], c[2])
        assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0])


def test_tp1_is_expert_parallel():
    """tp_size=1 (the default) is the expert-parallel op: the same bits as a call without it."""
    case = TpCase("tp1", 2, 1, 4, (5, 3))
    inputs = make_inputs(case, torch.bfloat16)
    xs, w0, w1, b0, b1, ids, wts = inputs
    explicit = run(case, inputs)

    def plain(r, buf):
        w0r, w1r, b0r, b1r = shards(case, r, w0, w1, b0, b1)
        y0, layout = comet.moe_layer0(xs[r], w0r, ids[r], num_experts=4, b0=b0r, buffer=buf,
                                      n_comm=1, tile=(8, 8))
        assert layout.tp_size == 1
        return comet.moe_layer1(act(y0), w1r, wts[r], layout, b1=b1r, buffer=buf, n_comm=1,
                                tile=(8, 8))

    outs = run_threads(2, plain, buffers=comet.Buffer.simulated_world(2, timeout=20,
                                                                      ranks_per_node=2))
    for r in range(2):
        assert torch.equal(outs[r], explicit[r][2])


def _reference_grads(case, inputs, seeds):
    xs, w0, w1, b0, b1, ids, wts = inputs
    leaves = {"x": [x.clone().requires_grad_(True) for x in xs],
              "w": [w.clone().requires_grad_(True) for w in wts],
              "w0": w0.clone().requires_grad_(True), "w1": w1.clone().requires_grad_(True),
              "b0": b0.clone().requires_grad_(True), "b1": b1.clone().requires_grad_(True)}
    outs = ref.moe_tp_sim(leaves["x"], leaves["w0"], leaves["w1"], ids, leaves["w"], act,
                          leaves["b0"], leaves["b1"])
    sum((o * s).sum() for o, s in zip(outs, seeds)).backward()
    for name in ("x", "w"):  # an empty rank's leaves take no part: their gradient is empty
        for leaf in leaves[name]:
            if leaf.grad is None:
                leaf.grad = torch.zeros_like(leaf)
    return leaves


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case,transposed", [(CASES[0], False), (CASES[1], True),
                                             (CASES[2], False), (CASES[4], True),
                                             (CASES[5], False)],
                         ids=["ep1tp2", "ep2tp2-T", "ep1tp4", "ep3tp2-T", "ep2tp3"])
def test_backward_matches_reference_autograd(case, transposed, dtype):
    inputs = make_inputs(case, dtype)
    results = run(case, inputs, transposed=transposed, grad=True)
    seeds = [torch.randn(r[2].shape, generator=torch.Generator().manual_seed(7 + i)).to(dtype)
             for i, r in enumerate(results)]
    want = _reference_grads(case, inputs, seeds)
    tol = dict(atol=1e-9, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    W, t = case.world, case.tp
    for r, (_, _, _, got) in enumerate(results):
        torch.testing.assert_close(got["x"], want["x"][r].grad, **tol)
        torch.testing.assert_close(got["w"], want["w"][r].grad, **tol)
        dw0, dw1 = ref.tp_shard(want["w0"].grad, W, t, r, 1), ref.tp_shard(want["w1"].grad, W, t, r, 2)
        if transposed:
            dw0, dw1 = dw0.transpose(1, 2), dw1.transpose(1, 2)
        torch.testing.assert_close(got["w0"], dw0, **tol)
        torch.testing.assert_close(got["w1"], dw1, **tol)
        torch.testing.assert_close(got["b0"], ref.tp_shard(want["b0"].grad, W, t, r, 1), **tol)
        el = case.experts // (W // t)
        q = r // t  # db1 is the full gradient of the EP rank's b1 on every tp rank
        torch.testing.assert_close(got["b1"], want["b1"].grad[q * el:(q + 1) * el], **tol)


def _bf16_grads_match_reference(case, inputs, results):
    """The bf16 gradients of x and topk_weights on every rank against the reference's autograd
    (the output gradient seeded per rank); returns each rank's gradients."""
    seeds = [torch.randn(r[2].shape, generator=torch.Generator().manual_seed(7 + i)).to(
        torch.bfloat16) for i, r in enumerate(results)]
    want = _reference_grads(case, inputs, seeds)
    grads = []
    for r, (_, _, _, got) in enumerate(results):
        torch.testing.assert_close(got["x"], want["x"][r].grad, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(got["w"], want["w"][r].grad, atol=3e-2, rtol=3e-2)
        grads.append(got)
    return grads


def test_backward_with_dropped_slots_and_max_rows_bf16():
    case = CASES[3]
    inputs = make_inputs(case, torch.bfloat16)
    results = run(case, inputs, grad=True, max_rows=48)
    for r, got in enumerate(_bf16_grads_match_reference(case, inputs, results)):
        ids = inputs[5][r]
        assert torch.all(got["w"][ids < 0] == 0)


def test_backward_under_the_cuda_kernels_rules(monkeypatch):
    """Every call forward and backward make with t > 1 (the dx / dh calls, the virtual-token
    rows of the top-k weights and their [M, 8 t] gradient rows) takes only what the CUDA kernels
    accept (COMET_CPU_CUDA_RULES=1: bf16 activations, 16-byte rows), and the gradients match."""
    monkeypatch.setenv("COMET_CPU_CUDA_RULES", "1")
    case = TpCase("rules", 4, 2, 4, (6, 3, 0, 5), topk=2, hidden=16, n0=16, drop=0.2, seed=4)
    inputs = make_inputs(case, torch.bfloat16)
    results = run(case, inputs, grad=True)
    _bf16_grads_match_reference(case, inputs, results)


@pytest.mark.parametrize("reserve", [False, True], ids=["grow", "reserve"])
def test_required_bytes_with_tp_is_what_the_calls_ask_for(reserve):
    """comet.buffers.symm.required_bytes(tp_size=t) (layer1's receive region: min(k, EP) x t partial
    slots) is exactly what a t > 1 call grows the buffer to; Buffer(tp_size=t).reserve() sizes
    for it, so the calls do not grow it."""
    case = CASES[5]  # k = 3 > EP = 2: t x min(k, EP) = 6 slots, more than min(k, W) = 3
    inputs = make_inputs(case, torch.bfloat16)
    need = comet.buffers.symm.required_bytes(tokens=max(case.tokens), hidden=case.hidden,
                                     topk=case.topk, num_experts=case.experts, world=case.world,
                                     dtype=torch.bfloat16, tp_size=case.tp)
    assert need > comet.buffers.symm.required_bytes(tokens=max(case.tokens), hidden=case.hidden,
                                            topk=case.topk, num_experts=case.experts,
                                            world=case.world, dtype=torch.bfloat16)
    bufs = comet.Buffer.simulated_world(case.world, timeout=20, tp_size=case.tp,
                                        ranks_per_node=case.world)
    if reserve:
        run_threads(case.world, lambda r, b: b.reserve(
            tokens=max(case.tokens), hidden=case.hidden, topk=case.topk,
            num_experts=case.experts, dtype=torch.bfloat16), buffers=bufs)
        assert all(b.capacity_bytes == need for b in bufs)
    run(case, inputs, buffers=bufs)
    assert all(b.requested_bytes == need for b in bufs)
    if reserve:
        assert all(b.capacity_bytes == need for b in bufs)


# -- bad input: a clear error on every rank, before any kernel ---------------------------------


def _errors(world, fn, ranks_per_node=None):
    bufs = comet.Buffer.simulated_world(world, timeout=20, ranks_per_node=ranks_per_node or world)
    errs = [None] * world

    def rank(r, buf):
        try:
            fn(r, buf)
        except (ValueError, TypeError) as e:
            errs[r] = str(e)

    run_threads(world, rank, buffers=bufs)
    return errs


def _layer0(r, buf, *, tp, experts, el, n0=4, H=8, T=3):
    x = torch.randn(T, H)
    ids = torch.zeros(T, 1, dtype=torch.int32)
    comet.moe_layer0(x, torch.randn(el, n0, H), ids, num_experts=experts, buffer=buf, tp_size=tp,
                     n_comm=1, tile=(8, 8))


def test_error_tp_not_dividing_world():
    errs = _errors(4, lambda r, b: _layer0(r, b, tp=3, experts=4, el=4))
    assert all(e and "tp_size=3 does not divide the group size 4 "
               "(the group is TP-innermost: EP = W / tp_size)" in e for e in errs), errs


def test_error_ep_not_dividing_experts():
    errs = _errors(4, lambda r, b: _layer0(r, b, tp=2, experts=3, el=1))
    assert all(e and "num_experts=3 is not divisible by EP = group size 4 / tp_size 2" in e
               for e in errs), errs


def test_error_wrong_local_experts():
    # with tp=2 on 4 ranks E_local = 4 / 2 = 2: a weight of E / W = 1 expert is the EP-only shape
    errs = _errors(4, lambda r, b: _layer0(r, b, tp=2, experts=4, el=1))
    assert all(e and "w0 holds 1 local experts but num_experts / EP = 2" in e for e in errs), errs


def test_error_shard_width_differs():
    # rank 1 passes the full N0 where the others pass their shard
    errs = _errors(2, lambda r, b: _layer0(r, b, tp=2, experts=2, el=2, n0=8 if r == 1 else 4))
    assert all(e and "N0" in e for e in errs), errs


def test_error_ranks_disagree_on_tp():
    errs = _errors(2, lambda r, b: _layer0(r, b, tp=2 if r == 0 else 1, experts=2,
                                           el=2 if r == 0 else 1))
    assert all(e and "ranks disagree on tp_size" in e for e in errs), errs


def test_buffer_tp_size_is_checked():
    with pytest.raises(ValueError, match="tp_size must be an int >= 1 dividing the group size 4"):
        comet.Buffer.simulated_world(4, tp_size=3)


def test_error_group_spanning_nodes():
    errs = _errors(4, lambda r, b: _layer0(r, b, tp=2, experts=4, el=2), ranks_per_node=2)
    assert all(e and "tp_size=2 > 1 needs a group on one node (this group spans 2 nodes)" in e
               for e in errs), errs


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.data())
def test_partial_slot_with_tp_is_rank_order_over_the_ep_ranks_tp_ranks(ep, tp, el, data):
    """The home's partial order (comet/layout.h: partial_slot): the contributors of a token are
    the tp ranks of each distinct EP rank among its slots, ascending in rank; ordinal = position."""
    k = data.draw(st.integers(1, 5))
    ids = data.draw(st.lists(st.integers(-1, ep * el - 1), min_size=k, max_size=k))
    eps = sorted({e // el for e in ids if e >= 0})
    ranks = [q * tp + r for q in eps for r in range(tp)]
    assert len(ranks) <= min(k, ep) * tp  # the receive region's partial slots (symm_layout.h)
    for d in ranks:
        count, ordinal = _C.engine.partial_slot(ids, el, d, 0, 0, tp)
        assert (count, ordinal) == (len(ranks), ranks.index(d))
    if tp == 1:
        for d in ranks:
            assert _C.engine.partial_slot(ids, el, d) == _C.engine.partial_slot(ids, el, d, tp=1)


def test_nn_moe_tp_equals_the_unsharded_module():
    """comet.nn.MoE(tp_size=2) on 2 ranks (EP 1 x TP 2), each with its own tokens, computes the
    module of tp_size=1 on one rank over all the tokens (same seed: same router and full experts):
    outputs, dx, and each rank's shard of dW0 / dW1."""
    from comet.nn import MoE

    kw = dict(hidden_size=16, ffn_hidden_size=8, num_experts=4, topk=2, dtype=torch.float32,
              aux_loss_coeff=0.0, n_comm=1, tile=(8, 8), seed=3)
    xs = [torch.randn(5, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    seeds = [torch.randn(5, 16, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]

    one = MoE(buffer=comet.Buffer.simulated_world(1, timeout=20)[0], **kw)
    x1 = torch.cat(xs).requires_grad_(True)
    out1 = one(x1)
    (out1 * torch.cat(seeds)).sum().backward()

    def rank(r, buf):
        m = MoE(buffer=buf, **kw)
        assert m.tp_size == 2 and m.w0.shape == (4, 8, 16) and m.w1.shape == (4, 16, 4)
        x = xs[r].clone().requires_grad_(True)
        out = m(x)
        (out * seeds[r]).sum().backward()
        return out.detach(), x.grad, m.w0.grad, m.w1.grad, m

    res = run_threads(2, rank, buffers=comet.Buffer.simulated_world(2, timeout=20, tp_size=2,
                                                                    ranks_per_node=2))
    for r, (out, dx, dw0, dw1, m) in enumerate(res):
        torch.testing.assert_close(out, out1.detach()[5 * r:5 * (r + 1)], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dx, x1.grad[5 * r:5 * (r + 1)], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dw0, m._w0_shard(one.w0.grad), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dw1, m._w1_shard(one.w1.grad), atol=1e-5, rtol=1e-5)


def _opcheck(buf):
    """torch.library.opcheck (schema, fake kernels, autograd registration) of both ops with
    tp_size=2 (not thread-safe: one process per rank)."""
    E, H, N, T = 3, 16, 6, 7
    launch = (1, 1, 4, 8)
    g = torch.Generator().manual_seed(buf.rank)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, 2), generator=g)
    w0 = (torch.randn(E, N, H, generator=g) / 4).requires_grad_()
    w1 = (torch.randn(E, H, N, generator=g) / 4).requires_grad_()
    wts = torch.rand(T, 2, generator=g)
    torch.library.opcheck(torch.ops.comet.moe_layer0.default,
                          (x, w0, ids, E, buf.handle, *launch, None, False, 64, 2))
    y0, _a, rc, sp, *_ = torch.ops.comet.moe_layer0(x, w0.detach(), ids, E, buf.handle, *launch,
                                                    None, False, 64, 2)
    torch.library.opcheck(torch.ops.comet.moe_layer1.default,
                          (y0.requires_grad_(), w1, wts, ids, sp, rc, E, buf.handle, *launch,
                           None, False, 64, 1, 2))


def _example_and_opcheck(rank, world):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "tp_moe_layer.py")
    err = runpy.run_path(example)["run"](rank, world)
    _opcheck(comet.Buffer(tp_size=2))
    return err


def test_example_and_opcheck_on_gloo_processes():
    """examples/tp_moe_layer.py's rank function (Buffer(tp_size=2) on the default group) on 2
    processes, EP 1 x TP 2: output and gradients match the reference over the full experts (the
    example itself runs 4 processes, EP 2 x TP 2); then opcheck of both ops with tp_size=2."""
    errors = run_ranks(_example_and_opcheck, 2, timeout=240)
    assert max(errors) < 1e-4, errors



@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=str)
def test_fp8_matches_the_dequantised_fp32_layer(case):
    """FP8 with tp_size > 1 (x, each rank's w0 / w1 shard and h quantised): y0 and out equal, at
    bf16 tolerance, the fp32 TP layer run on the same operands dequantised (that layer matches
    the reference above), so the FP8 rows, scales and shards travel and combine as in fp32."""
    from comet import fp8

    xs, w0, w1, b0, b1, ids, wts = make_inputs(case, torch.float32, bias=False)
    bufs = [comet.Buffer.simulated_world(case.world, timeout=20, tp_size=case.tp,
                                         ranks_per_node=case.world) for _ in range(2)]

    def rank(r, buf8, buf32):
        w0r, w1r, _, _ = shards(case, r, w0, w1, None, None)
        (xq, xsc), (w0q, s0), (w1q, s1) = (fp8.quantize_rows(xs[r]), fp8.quantize_blocks(w0r),
                                            fp8.quantize_blocks(w1r))
        y0, layout = comet.moe_layer0(xq, w0q, ids[r], num_experts=case.experts, buffer=buf8,
                                      x_scale=xsc, w0_scale=s0, n_comm=1, tile=(8, 8))
        hq, hs = fp8.quantize_rows(act(y0.float()))
        out = comet.moe_layer1(hq, w1q, wts[r], layout, buffer=buf8, h_scale=hs, w1_scale=s1,
                               n_comm=1, tile=(8, 8))
        y0_32, layout32 = comet.moe_layer0(
            fp8.dequantize_rows(xq, xsc, torch.float32), fp8.dequantize_blocks(w0q, s0, torch.float32),
            ids[r], num_experts=case.experts, buffer=buf32, n_comm=1, tile=(8, 8))
        out_32 = comet.moe_layer1(fp8.dequantize_rows(hq, hs, torch.float32),
                                  fp8.dequantize_blocks(w1q, s1, torch.float32), wts[r], layout32,
                                  buffer=buf32, n_comm=1, tile=(8, 8))
        return y0, out, y0_32, out_32

    results = run_threads(case.world, lambda r, b: rank(r, b, bufs[1][r]), buffers=bufs[0])
    for y0, out, y0_32, out_32 in results:
        assert y0.dtype == out.dtype == torch.bfloat16
        torch.testing.assert_close(y0.float(), y0_32, **TOL[torch.bfloat16])
        torch.testing.assert_close(out.float(), out_32, **TOL[torch.bfloat16])
