"""How a buffer's data segment grows on a heap of fixed size (comet/grow_rule.h; the CPU heap's
cap, Buffer(heap_bytes=), stands for NVSHMEM_SYMMETRIC_SIZE): a need that fits never fails for the
doubling's sake, a need that does not fit raises on every rank naming the bytes and the cap, and
the buffer then serves calls at its old capacity. Also the size of layer1's staging region across
nodes (one row per token of the other nodes' ranks, not per token of every rank)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comet
from comet import reference as ref
from comet._native import _C
from comet.buffers import symm
from tests.cases import TOL, Case, h_from_y0, make_inputs
from tests.sim_world import run_threads


def _round(x, a):
    return -(-x // a) * a if a > 1 else x


@settings(max_examples=300, deadline=None)
@given(need=st.integers(1, 1 << 40), cap=st.integers(0, 1 << 40),
       align=st.sampled_from([1, 256, 1 << 20]), limit=st.integers(0, 1 << 42))
def test_grow_rule(need, cap, align, limit):
    """Oracle: try twice the old size (at least the need), then the need alone, the first that
    fits the limit; nothing when the need itself does not."""
    if need <= cap:
        need = cap + 1
    doubled = _round(max(need, 2 * cap), align)
    exact = _round(need, align)
    first, second = _C.engine.grow_steps(need, cap, align)
    assert (first, second) == (doubled, 0 if exact == doubled else exact)
    got = _C.engine.grow_size_within(need, cap, align, limit)
    if limit == 0 or doubled <= limit:
        assert got == doubled
    elif exact <= limit:
        assert got == exact
    else:
        assert got == 0


CASE = Case("w2", 2, 4, 2, (7, 11), hidden=24, n0=16, n1=8)


def _shape(tokens):
    return dict(tokens=tokens, hidden=CASE.hidden, topk=CASE.topk, num_experts=CASE.experts,
                dtype=torch.float32)


def _layer_pair(buf, r, xs, w0s, w1s, ids, wts):
    y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=CASE.experts, buffer=buf)
    h = h_from_y0(y0, CASE.n1)
    return y0, h, comet.moe_layer1(h, w1s[r], wts[r], layout, buffer=buf)


def test_capped_heap_grows_to_the_need_then_refuses_and_keeps_serving():
    small = symm.required_bytes(**_shape(4), world=2)
    cap = symm.required_bytes(**_shape(max(CASE.tokens)), world=2)
    assert small < cap < 2 * small  # the doubling does not fit, the need does
    xs, w0s, w1s, ids, wts = make_inputs(CASE)
    g = torch.Generator().manual_seed(7)
    big_x = [torch.randn(64, CASE.hidden, generator=g) for _ in range(2)]
    big_ids = [torch.randint(0, CASE.experts, (64, CASE.topk), generator=g) for _ in range(2)]
    too_much = symm.required_bytes(**_shape(64), world=2, op=0)
    assert too_much > cap
    bufs = comet.Buffer.simulated_world(2, timeout=20, heap_bytes=cap)

    def rank(r, buf):
        assert buf.heap_bytes == cap
        buf.reserve(**_shape(4))
        before = buf.capacity_bytes
        first = _layer_pair(buf, r, xs, w0s, w1s, ids, wts)
        grown = buf.capacity_bytes
        with pytest.raises(RuntimeError) as err:
            comet.moe_layer0(big_x[r], w0s[r], big_ids[r], num_experts=CASE.experts, buffer=buf)
        after_error = buf.capacity_bytes
        again = _layer_pair(buf, r, xs, w0s, w1s, ids, wts)
        return before, grown, str(err.value), after_error, buf.needs_recovery, first, again

    try:
        got = run_threads(2, rank, buffers=bufs)
    finally:
        for b in bufs:
            b.close()
    y0_ref = ref.layer0_sim(xs, w0s, ids, CASE.experts)
    for r, (before, grown, msg, after_error, needs_recovery, first, again) in enumerate(got):
        assert before == small
        assert grown == cap  # to the need, not refused for twice `small`
        assert f"{too_much} bytes" in msg and f"cap of {cap} bytes" in msg
        assert "heap_bytes" in msg and "NVSHMEM_SYMMETRIC_SIZE" in msg
        assert after_error == cap and not needs_recovery  # refused before anything changed
        for y0, h, out in (first, again):
            torch.testing.assert_close(y0, y0_ref[r], **TOL[torch.float32])
        hs = [got[s][5][1] for s in range(2)]
        out_ref = ref.layer1_sim(hs, w1s, wts, ids, CASE.experts)
        torch.testing.assert_close(first[2], out_ref[r], **TOL[torch.float32])
        torch.testing.assert_close(again[2], first[2], rtol=0, atol=0)


def test_reserve_beyond_the_cap_raises_and_changes_nothing():
    cap = symm.required_bytes(**_shape(8), world=1)
    buf = comet.Buffer(heap_bytes=cap, timeout=20)
    try:
        buf.reserve(**_shape(8))
        with pytest.raises(RuntimeError, match=f"cap of {cap} bytes"):
            buf.reserve(**_shape(200))
        assert buf.capacity_bytes == cap
    finally:
        buf.close()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1G"])
def test_heap_bytes_must_be_a_count(bad):
    with pytest.raises(ValueError, match="heap_bytes"):
        comet.Buffer(heap_bytes=bad)


@pytest.mark.parametrize("world,rpn", [(16, 8), (8, 2), (4, 2)])
def test_flat_layer1_staging_holds_the_other_nodes_tokens(world, rpn):
    """Across nodes (partials per rank, not node-reduced) layer1 stages the rows it puts to homes
    on other nodes: at most one per token of each rank on another node, (W - P) * T rows of H.
    The regions of one node and of several differ by that stage plus the mirrors of the other
    nodes' published routing (a few bytes per slot)."""
    T, H, k, E = 8192, 7168, 8, 256
    one = symm.required_bytes(tokens=T, hidden=H, topk=k, num_experts=E, world=world, op=1)
    nodes = symm.required_bytes(tokens=T, hidden=H, topk=k, num_experts=E, world=world, op=1,
                                ranks_per_node=rpn)
    stage = (world - rpn) * T * H * 2
    mirrors = (world // rpn - 1) * (T * k * (4 + 4 + 4 + 4) + 4 * (world + 1) + 5 * 256)
    assert stage <= nodes - one <= stage + mirrors
    assert nodes - one < world * T * H * 2  # not a row per token of every rank
