"""comet.nn.MoE: output and every gradient (input, router, experts, the attached load-balancing
loss) equal a dense pure-torch MoE on 1, 2 and 4 simulated ranks; initialisation independent of
the group size; the training example reduces its loss on 2 CPU processes."""
import os
import runpy

import pytest
import torch

import comet
import comet.nn
from tests.dist_utils import run_ranks
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
    h = comet.nn.swiglu(y)
    per_expert = torch.einsum("etf,ehf->eth", h, w1.float())
    out = torch.einsum("te,eth->th", gates, per_expert)
    aux = coeff * comet.nn.load_balancing_loss(probs, ids, w0.shape[0])
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
