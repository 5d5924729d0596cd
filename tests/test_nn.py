"""comet.nn.MoE: output and every gradient (input, router, experts, the attached load-balancing
loss) equal a dense pure-torch MoE on 1, 2 and 4 simulated ranks; initialisation independent of
the group size; the training example reduces its loss on 2 CPU processes."""
import os
import runpy

import pytest
import torch

import comet
import comet.nn
from tests import oracles
from tests.dist_utils import run_ranks
from tests.layer0_spy import spy_layer0
from tests.sim_world import run_threads

H, F, E, K = 12, 10, 4, 2


def dense_moe(x, router_w, w0, w1, k, renormalize, coeff):
    """Every expert on every token, gated by the top-k weights: out [T, H], aux loss."""
    probs = torch.softmax(x.float() @ router_w.float().t(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    gates = torch.zeros_like(probs).scatter_add(1, ids, weights)  # [T, E]
    y = torch.einsum("th,enh->etn", x.float(), w0.float())
    h = oracles.swiglu(y)
    per_expert = torch.einsum("etf,ehf->eth", h, w1.float())
    out = torch.einsum("te,eth->th", gates, per_expert)
    aux = coeff * oracles.switch_balance_loss(probs, ids, w0.shape[0])
    return out.to(x.dtype), aux


def token_batches(world, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, generator=g) for n in [7, 0, 11, 5][:world]], \
        [torch.randn(n, H, generator=g) for n in [7, 0, 11, 5][:world]]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_matches_dense_reference(world, renormalize):
    xs, vs = token_batches(world)
    coeff = 0.1
    bufs = comet.Buffer.simulated_world(world, timeout=20)

    def rank(r, buf):
        moe = comet.nn.MoE(H, F, E, K, buffer=buf, renormalize=renormalize, aux_loss_coeff=coeff,
                           init_std=0.3, seed=5, n_comm=2, tile=(4, 8))
        x = xs[r].clone().requires_grad_()
        out = moe(x)
        (out * vs[r]).sum().backward()
        return moe, x, out.detach()

    res = run_threads(world, rank, buffers=bufs)
    assert [m.fused_activation for m, _, _ in res] == ["swiglu"] * world  # fused into layer0
    router_w = res[0][0].router.weight.detach().clone().requires_grad_()
    w0 = torch.cat([m.w0.detach() for m, _, _ in res]).requires_grad_()
    w1 = torch.cat([m.w1.detach() for m, _, _ in res]).requires_grad_()
    total = 0.0
    for r in range(world):
        x = xs[r].clone().requires_grad_()
        out, aux = dense_moe(x, router_w, w0, w1, K, renormalize, coeff)
        moe, x_c, out_c = res[r]
        torch.testing.assert_close(out_c, out.detach(), atol=1e-5, rtol=1e-5)
        if xs[r].shape[0]:
            torch.testing.assert_close(moe.aux_loss, aux.detach(), atol=1e-6, rtol=1e-5)
        (out * vs[r]).sum().add(aux).backward()
        torch.testing.assert_close(x_c.grad, x.grad, atol=1e-5, rtol=1e-5)
        total = total + res[r][0].router.weight.grad
    torch.testing.assert_close(total, router_w.grad, atol=1e-5, rtol=1e-5)  # sum over ranks
    torch.testing.assert_close(torch.cat([m.w0.grad for m, _, _ in res]), w0.grad, atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(torch.cat([m.w1.grad for m, _, _ in res]), w1.grad, atol=1e-5,
                               rtol=1e-5)


def test_init_is_independent_of_group_size_and_bf16_runs():
    one = comet.nn.MoE(H, F, E, K, buffer=comet.Buffer.simulated_world(1)[0], seed=9)
    bufs = comet.Buffer.simulated_world(2)
    two = [comet.nn.MoE(H, F, E, K, buffer=b, seed=9) for b in bufs]
    assert torch.equal(one.router.weight, two[1].router.weight)
    assert torch.equal(one.w0, torch.cat([m.w0 for m in two]))
    assert torch.equal(one.w1, torch.cat([m.w1 for m in two]))
    assert [p.comet_expert_parallel for p in two[0].expert_parameters()] == [True, True]
    assert two[0].replicated_parameters() == [two[0].router.weight]
    with pytest.raises(ValueError, match="not divisible"):
        comet.nn.MoE(H, F, 3, K, buffer=bufs[0])

    x = torch.randn(2, 3, H, dtype=torch.bfloat16)  # any leading shape, bf16 experts

    def rank(r, buf):
        moe = comet.nn.MoE(H, F, E, K, buffer=buf, dtype=torch.bfloat16, seed=9)
        xr = x.clone().requires_grad_()
        out = moe(xr)
        out.float().square().mean().backward()
        return out, xr.grad, moe.w0.grad, moe.router.weight.grad

    for out, gx, gw0, gr in run_threads(2, rank, buffers=bufs):
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        assert all(torch.isfinite(t.float()).all() for t in (out, gx, gw0, gr))
        assert gw0.dtype == torch.bfloat16 and gr.dtype == torch.float32


def _train(rank, world, steps):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train_moe.py")
    return runpy.run_path(example)["train"](rank, world, steps, log=False)


def test_training_example_reduces_loss_on_two_processes():
    losses = run_ranks(_train, 2, 40, timeout=120)
    assert losses[0] == losses[1]  # the global mean, all-reduced
    first, last = losses[0][0], min(losses[0][-5:])
    assert last < 0.25 * first, losses[0]


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_shared_expert_equals_sequential_computation(world, gate):
    """A MoE with a shared expert (computed between moe_layer0 and moe_layer1) against the same
    routed MoE without one plus the shared expert computed separately and added: output and
    every gradient (input, router, routed and shared weights)."""
    S = 6
    xs, vs = token_batches(world, seed=8)
    bufs = comet.Buffer.simulated_world(world, timeout=20)
    ref_bufs = comet.Buffer.simulated_world(world, timeout=20)
    kw = dict(aux_loss_coeff=0.1, init_std=0.3, seed=4, n_comm=2, tile=(4, 8))

    def fused(r, buf):
        moe = comet.nn.MoE(H, F, E, K, buffer=buf, shared_ffn_hidden_size=S,
                           shared_expert_gate=gate, **kw)
        x = xs[r].clone().requires_grad_()
        out = moe(x)
        (out * vs[r]).sum().backward()
        return moe, x.grad, out.detach()

    def sequential(r, buf):
        moe = comet.nn.MoE(H, F, E, K, buffer=buf, **kw)  # same seed: same routed weights
        shared = {n: p.detach().clone().requires_grad_() for n, p in params[r].items()}
        x = xs[r].clone().requires_grad_()
        routed = moe(x)
        extra = torch.nn.functional.linear(
            oracles.swiglu(torch.nn.functional.linear(x, shared["shared_w0"])),
            shared["shared_w1"])
        if gate:
            extra = extra * torch.sigmoid(torch.nn.functional.linear(x, shared["shared_gate"]))
        out = routed + extra
        (out * vs[r]).sum().backward()
        return moe, x.grad, out.detach(), {n: p.grad for n, p in shared.items()}

    got = run_threads(world, fused, buffers=bufs)
    params = [{n: p for n, p in m.named_parameters() if n.startswith("shared_")} for m, _, _ in got]
    names = ["shared_w0", "shared_w1"] + (["shared_gate"] if gate else [])
    assert sorted(params[0]) == sorted(names)
    ref = run_threads(world, sequential, buffers=ref_bufs)
    for r in range(world):
        (m_c, dx_c, out_c), (m_r, dx_r, out_r, g_shared) = got[r], ref[r]
        if xs[r].shape[0]:
            assert out_r.abs().max() > 0.1, "outputs too small for a meaningful comparison"
        tight = dict(atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out_c, out_r, **tight)
        torch.testing.assert_close(dx_c, dx_r, **tight)
        for name in ("router.weight", "w0", "w1"):
            torch.testing.assert_close(m_c.get_parameter(name).grad, m_r.get_parameter(name).grad,
                                       **tight)
        for name, g in g_shared.items():
            torch.testing.assert_close(m_c.get_parameter(name).grad, g, **tight)
    # replicated like the router: averaged by allreduce_gradients, not owned per rank
    assert set(got[0][0].replicated_parameters()) >= set(params[0].values())


def test_shared_expert_arguments_are_checked():
    buf = comet.Buffer.simulated_world(1)[0]
    with pytest.raises(ValueError, match="shared_ffn_hidden_size=0 must be a positive int"):
        comet.nn.MoE(H, F, E, K, buffer=buf, shared_ffn_hidden_size=0)
    with pytest.raises(ValueError, match="shared_expert_gate=True needs shared_ffn_hidden_size"):
        comet.nn.MoE(H, F, E, K, buffer=buf, shared_expert_gate=True)
    a = comet.nn.MoE(H, F, E, K, buffer=buf, seed=3)
    b = comet.nn.MoE(H, F, E, K, buffer=buf, seed=3, shared_ffn_hidden_size=5)
    assert torch.equal(a.w0, b.w0) and torch.equal(a.router.weight, b.router.weight)
    assert b.shared_w0.shape == (10, H) and b.shared_w1.shape == (H, 5) and b.shared_gate is None


def test_shared_expert_runs_between_the_two_ops(monkeypatch):
    """The overlap point: the shared expert is issued after moe_layer0 and before moe_layer1."""
    order = []
    real0, real1 = comet.moe_layer0, comet.moe_layer1
    monkeypatch.setattr(comet, "moe_layer0",
                        lambda *a, **k: order.append("layer0") or real0(*a, **k))
    monkeypatch.setattr(comet, "moe_layer1",
                        lambda *a, **k: order.append("layer1") or real1(*a, **k))
    moe = comet.nn.MoE(H, F, E, K, buffer=comet.Buffer.simulated_world(1)[0],
                       shared_ffn_hidden_size=4)
    real_shared = moe.shared_expert
    moe.shared_expert = lambda t: order.append("shared") or real_shared(t)
    moe(torch.randn(5, H))
    assert order == ["layer0", "shared", "layer1"]


# --------------------------------------------------------------------------------------------------
# The sync-free path: capacity_factor / max_rows
# --------------------------------------------------------------------------------------------------


def test_drop_over_capacity_and_the_row_bound():
    ids = torch.tensor([[0, 1], [0, 2], [1, 0], [-1, 0], [2, 1]])
    kept = comet.nn.drop_over_capacity(ids, 3, 2)  # first come, first served, -1 takes nothing
    assert kept.tolist() == [[0, 1], [0, 2], [1, -1], [-1, -1], [2, -1]]
    assert comet.nn.expert_capacity(9, 2, 4, 0.6) == 3  # ceil(9 * 2 / 4 * 0.6)
    g = torch.Generator().manual_seed(1)
    for world, experts, k, tokens, capacity in [(2, 4, 2, 9, 3), (4, 8, 3, 6, None),
                                                (2, 8, 2, 5, 1), (1, 4, 4, 7, 2)]:
        bound = comet.nn.worst_case_rows(tokens, k, experts, world, capacity)
        local = experts // world
        rows = torch.zeros(world, dtype=torch.int64)
        for _ in range(world):  # every source rank routes its own tokens
            src = torch.rand(tokens, experts, generator=g).argsort(1)[:, :k]
            if capacity is not None:
                src = comet.nn.drop_over_capacity(src, experts, capacity)
            src = src[src >= 0]
            rows += torch.bincount(src // local, minlength=world)
        assert int(rows.max()) <= bound
    # every token to the experts of rank 0: the bound is reached
    assert comet.nn.worst_case_rows(5, 2, 8, 2) == 2 * 5 * 2
    assert comet.nn.worst_case_rows(5, 2, 8, 2, capacity=1) == 2 * 4 * 1


@pytest.mark.parametrize("world", [1, 2])
def test_bounded_moe_equals_the_dynamic_path(world):
    """capacity_factor (tokens dropped, bound derived) and max_rows=WORST_CASE take the sync-free
    path: layer0 gets the bound and returns that many rows, and output and every gradient equal
    the same layer on the dynamic path (max_rows=-1)."""
    T, cf = 9, 0.6
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(T, H, generator=g) for _ in range(world)]
    cases = [dict(capacity_factor=cf), dict(capacity_factor=cf, max_rows=-1),
             dict(max_rows=comet.nn.WORST_CASE), dict()]
    results, seen = [], []
    for case in cases:
        bufs = comet.Buffer.simulated_world(world, timeout=20)

        def rank(r, buf):
            moe = comet.nn.MoE(H, F, E, K, buffer=buf, init_std=0.3, seed=5, n_comm=2,
                               tile=(4, 8), **case)
            x = xs[r].clone().requires_grad_()
            out = moe(x)
            out.square().sum().backward()
            return out.detach(), x.grad, moe.w0.grad, moe.w1.grad, moe.router.weight.grad

        with spy_layer0() as calls:
            results.append(run_threads(world, rank, buffers=bufs))
        seen += calls
    capacity = comet.nn.expert_capacity(T, K, E, cf)
    bounds = [comet.nn.worst_case_rows(T, K, E, world, capacity), None,
              comet.nn.worst_case_rows(T, K, E, world), None]
    for i, bound in enumerate(bounds):
        calls = seen[i * world:(i + 1) * world]
        assert [b for b, _ in calls] == [bound] * world
        if bound is not None:
            assert all(rows == bound for _, rows in calls)
    for bounded, dynamic in ((results[0], results[1]), (results[2], results[3])):
        for got, want in zip(bounded, dynamic):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the capacity really dropped slots: its output differs from the undropped layer's
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(results[0], results[3]))


def test_bound_arguments_are_checked():
    buf = comet.Buffer.simulated_world(1)[0]
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        comet.nn.MoE(H, F, E, K, buffer=buf, capacity_factor=0)
    with pytest.raises(ValueError, match="max_rows='huge' must be"):
        comet.nn.MoE(H, F, E, K, buffer=buf, max_rows="huge")
    moe = comet.nn.MoE(H, F, E, K, buffer=buf, max_rows=3)  # a user's bound that is too small
    with pytest.raises(ValueError, match="receives 16 rows but max_rows is 3"):
        moe(torch.randn(8, H))
