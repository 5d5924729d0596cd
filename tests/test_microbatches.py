"""Calls of several micro-batches interleaved on one buffer (layer0 A, layer0 B, layer1 A, layer1 B,
and backward in any order, as a pipeline schedule runs them) are supported: each call carries its
whole state in its arguments (layer1's in the layout and h), so the results are the reference's and
bitwise those of the calls one micro-batch after the other. What layer1 can tell is a mix-up: h
with another row count than the layout's, or h that is the y0 of another layer0 call (an identity
or in-place activation), raises on every rank (docs/api.md, "Several micro-batches")."""
import pytest
import torch

import comet
from comet import reference as ref
from tests.cases import TOL, cases_for, h_from_y0, make_inputs
from tests.sim_world import run_threads

ORDERS = {"one after the other": ("0A", "1A", "0B", "1B"),
          "interleaved": ("0A", "0B", "1A", "1B"),
          "interleaved, B first": ("0B", "0A", "1A", "1B")}


def _microbatches(world):
    """Two micro-batches of different routing and token counts on the same experts."""
    a, b = cases_for(world)[0], cases_for(world)[3]  # uniform; dropped slots, top-3
    ia, ib = make_inputs(a, torch.float32), make_inputs(b, torch.float32)
    # the same experts (a's weights) for both, as one layer's micro-batches have
    ib = (ib[0], ia[1], ia[2], ib[3], ib[4])
    return {"A": (a, ia), "B": (b, ib)}


def _forward(world, order, max_rows=None):
    """Every rank runs both micro-batches' layers in `order`; returns out per rank and batch."""
    batches = _microbatches(world)

    def rank(r, buf):
        state, outs = {}, {}
        for step in order:
            layer, name = int(step[0]), step[1]
            case, (xs, w0s, w1s, ids, wts) = batches[name]
            if layer == 0:
                state[name] = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts,
                                               buffer=buf, max_rows=max_rows)
            else:
                y0, layout = state[name]
                outs[name] = comet.moe_layer1(h_from_y0(y0, case.n1), w1s[r], wts[r], layout,
                                              buffer=buf)
        return outs

    return batches, run_threads(world, rank)


@pytest.mark.parametrize("world,max_rows", [(2, None), (3, None), (2, 64)],
                         ids=["w2", "w3", "w2-max_rows"])
def test_interleaved_calls_match_the_reference_and_the_sequential_bits(world, max_rows):
    batches, base = _forward(world, ORDERS["one after the other"], max_rows)
    for order in ("interleaved", "interleaved, B first"):
        _, got = _forward(world, ORDERS[order], max_rows)
        for r in range(world):
            for name in "AB":
                assert torch.equal(got[r][name], base[r][name]), (order, r, name)
    for name, (case, (xs, w0s, w1s, ids, wts)) in batches.items():
        y0 = ref.layer0_sim(xs, w0s, ids, case.experts)
        want = ref.layer1_sim([h_from_y0(y, case.n1) for y in y0], w1s, wts, ids, case.experts)
        for r in range(world):
            torch.testing.assert_close(base[r][name], want[r], **TOL[torch.float32])


def _grads(world, backward_order):
    """Both micro-batches forward (A then B), then backward in `backward_order`: the gradients of
    x, w0, w1 and topk_weights per rank and batch."""
    batches = _microbatches(world)
    g = torch.Generator().manual_seed(3)
    cot = {name: [torch.randn(T, case.hidden, generator=g) for T in case.tokens]
           for name, (case, _) in batches.items()}

    def rank(r, buf):
        outs, leaves = {}, {}
        for name, (case, (xs, w0s, w1s, ids, wts)) in batches.items():
            leaves[name] = [t[r].clone().requires_grad_() for t in (xs, w0s, w1s, wts)]
            x, w0, w1, wt = leaves[name]
            y0, layout = comet.moe_layer0(x, w0, ids[r], num_experts=case.experts, buffer=buf)
            outs[name] = comet.moe_layer1(torch.tanh(y0[:, :case.n1]).contiguous(), w1, wt,
                                          layout, buffer=buf)
        for name in backward_order:
            outs[name].backward(cot[name][r])
        return {name: [t.grad for t in ts] for name, ts in leaves.items()}

    return run_threads(world, rank)


def test_backward_of_interleaved_micro_batches_in_either_order():
    """A pipeline's order (forward A, forward B, backward B, backward A) gives the gradients of
    the other order, bit for bit."""
    ab, ba = _grads(2, "AB"), _grads(2, "BA")
    for r in range(2):
        for name in "AB":
            for got, want in zip(ba[r][name], ab[r][name]):
                assert torch.equal(got, want), (r, name)


def test_h_that_is_another_calls_y0_raises_on_every_rank():
    """Two bounded layer0 calls (so y0 and h have max_rows rows either way) with N0 = N1, so y0
    itself is a valid h: rank 1 hands layer1 B's y0 with A's layout. Both ranks raise before any
    kernel (rank 1 naming the two calls, rank 0 naming rank 1) and the buffer serves the next call;
    y0 with its own layout is fine."""
    W, E, k, H, N, T, R = 2, 4, 2, 8, 6, 5, 32
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g) for _ in range(W)]
    ids = [torch.randint(0, E, (T, k), generator=g) for _ in range(W)]
    w0s = [torch.randn(E // W, N, H, generator=g) for _ in range(W)]
    w1s = [torch.randn(E // W, H, N, generator=g) for _ in range(W)]
    wts = [torch.rand(T, k, generator=g) for _ in range(W)]

    def rank(r, buf):
        y0a, lay_a = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=E, buffer=buf,
                                      max_rows=R)
        y0b, lay_b = comet.moe_layer0(xs[r].flip(0), w0s[r], ids[r], num_experts=E, buffer=buf,
                                      max_rows=R)
        assert lay_b.call > lay_a.call > 0
        err = None
        try:
            comet.moe_layer1(y0b if r == 1 else y0a, w1s[r], wts[r], lay_a, buffer=buf)
        except ValueError as e:
            err = str(e)
        ok = comet.moe_layer1(y0b, w1s[r], wts[r], lay_b, buffer=buf)  # its own layout
        return err, lay_a.call, lay_b.call, ok.shape == (T, H)

    (err0, *_), (err1, a, b, ok) = run_threads(W, rank)
    assert err1 == (f"comet.moe_layer1: h is the y0 of moe_layer0 call {b} but the layout is "
                    f"call {a}'s (calls numbered per process): pass each call's layout with the "
                    "h made from its own y0"), err1
    assert err0 and "rank 1" in err0, err0
    assert ok


def test_a_dead_y0_is_forgotten():
    """Only live y0s are remembered (a freed y0's memory may come back as any tensor)."""
    from comet.layers import ops

    buf = comet.Buffer.simulated_world(1)[0]
    x, ids = torch.randn(5, 8), torch.randint(0, 2, (5, 2))
    y0, layout = comet.moe_layer0(x, torch.randn(2, 6, 8), ids, num_experts=2, buffer=buf)
    key = ops._storage_key(y0)
    assert ops._y0_call(y0) == layout.call and key in ops._Y0_CALLS
    del y0
    assert key not in ops._Y0_CALLS
