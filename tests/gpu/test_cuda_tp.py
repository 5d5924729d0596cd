"""Expert tensor parallelism (tp_size > 1) on the CUDA kernels, one process per GPU (see
conftest.py for the command; skips without a GPU, and with one process: t > 1 needs a group of at
least 2). Written, never run here (no GPU on this project's machines).

For every tp_size t > 1 dividing the world: layer0 -> an elementwise activation -> layer1 in bf16
against comet.reference.moe_tp_sim over the full experts (each rank given its shard, biases,
transposed weights), the layout rows equal on the t ranks of an EP rank, bitwise run to run, and
backward (dx, dw0, dw1, db0, db1, dtopk_weights) against the reference's autograd."""
import os

import pytest
import torch

import comet
from comet import reference as ref
from tests.gpu.conftest import all_gather_cpu
from tests.test_tp import TpCase, act, make_inputs, shards

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
TPS = [t for t in range(2, WORLD + 1) if WORLD % t == 0]
BF16 = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)
GRAD_TOL = dict(atol=3e-2, rtol=3e-2)

pytestmark = pytest.mark.skipif(not TPS, reason="tp_size > 1 needs a group of at least 2 ranks")


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _buffer():
    from comet.buffers import symm_cuda

    return symm_cuda.buffer_for(None, _device())


def _case(tp):
    # 16-byte rows and shards (H, N0 / t multiples of 8: the CUDA kernels' vector width)
    return TpCase(f"cuda-t{tp}", WORLD, tp, 3 * (WORLD // tp), tuple(40 + 13 * r for r in
                                                                    range(WORLD)),
                  topk=2, hidden=64, n0=16 * tp, drop=0.2, seed=tp)


def _run(case, rank, inputs, transposed=False, grad=False):
    xs, w0, w1, b0, b1, ids, wts = inputs
    dev = _device()
    w0r, w1r, b0r, b1r = (t.to(dev) for t in shards(case, rank, w0, w1, b0, b1, transposed))
    x, wt = xs[rank].to(dev), wts[rank].to(dev)
    if grad:
        for leaf in (x, w0r, w1r, wt, b0r, b1r):
            leaf.requires_grad_(True)
    y0, layout = comet.moe_layer0(x, w0r, ids[rank].to(dev), num_experts=case.experts, b0=b0r,
                                  w0_transposed=transposed, tp_size=case.tp, buffer=_buffer())
    out = comet.moe_layer1(act(y0), w1r, wt, layout, b1=b1r, w1_transposed=transposed,
                           buffer=_buffer())
    grads = None
    if grad:
        seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank)).to(
            out.dtype)
        (out * seed.to(dev)).sum().backward()
        grads = {k: v.grad.cpu() for k, v in
                 dict(x=x, w0=w0r, w1=w1r, w=wt, b0=b0r, b1=b1r).items()}
    return y0.detach().cpu(), layout, out.detach().cpu(), grads


@pytest.mark.parametrize("transposed", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("tp", TPS)
def test_forward_matches_reference(world, tp, transposed):
    rank, _ = world
    case = _case(tp)
    inputs = make_inputs(case, BF16)
    y0, layout, out, _ = _run(case, rank, inputs, transposed)
    xs, w0, w1, b0, b1, ids, wts = inputs
    want = ref.moe_tp_sim(xs, w0, w1, ids, wts, act, b0, b1)[rank]
    torch.testing.assert_close(out, want, **TOL)
    rows = ref.tp_dispatch_rows(ids, case.experts, rank, tp)
    assert layout.row_source.cpu().tolist() == [r.source for r in rows]
    assert layout.row_token.cpu().tolist() == [r.token for r in rows]
    again = _run(case, rank, inputs, transposed)[2]
    assert torch.equal(out, again)  # fixed reduction order: bitwise run to run
    sources = all_gather_cpu(layout.row_source.cpu(), WORLD)
    assert torch.equal(sources[rank], sources[rank - rank % tp])  # same rows on the TP group


@pytest.mark.parametrize("tp", TPS)
def test_backward_matches_reference_autograd(world, tp):
    rank, _ = world
    case = _case(tp)
    inputs = make_inputs(case, BF16)
    got = _run(case, rank, inputs, grad=True)[3]
    xs, w0, w1, b0, b1, ids, wts = inputs
    leaves = [t.clone().requires_grad_(True) for t in (w0, w1, b0, b1)]
    x_l = [x.clone().requires_grad_(True) for x in xs]
    w_l = [w.clone().requires_grad_(True) for w in wts]
    outs = ref.moe_tp_sim(x_l, *leaves[:2], ids, w_l, act, *leaves[2:])
    seeds = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + r)).to(o.dtype)
             for r, o in enumerate(outs)]
    sum((o * s).sum() for o, s in zip(outs, seeds)).backward()
    dw0, dw1, db0, _ = shards(case, rank, leaves[0].grad, leaves[1].grad, leaves[2].grad,
                              leaves[3].grad)
    el, q = case.experts // (WORLD // tp), rank // tp
    torch.testing.assert_close(got["x"], x_l[rank].grad, **GRAD_TOL)
    torch.testing.assert_close(got["w"], w_l[rank].grad, **GRAD_TOL)
    torch.testing.assert_close(got["w0"], dw0, **GRAD_TOL)
    torch.testing.assert_close(got["w1"], dw1, **GRAD_TOL)
    torch.testing.assert_close(got["b0"], db0, **GRAD_TOL)
    torch.testing.assert_close(got["b1"], leaves[3].grad[q * el:(q + 1) * el], **GRAD_TOL)
