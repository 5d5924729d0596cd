"""layer1's GEMM in column bands (csrc/include/comet/tile_order.h, gemm_schedule.h): b n-tiles per
band, m-major inside a band, a band published to the comm blocks as a unit.

The band changes only the order the GEMM tiles are computed in and when the comm blocks may
start, never the reduction order of a column: out (and backward, which calls layer1) is bitwise
the same for b = 1 (column-major), 2 and all n-tiles, on one node, across two nodes of the CPU
analog and node-reduced. The schedule itself is checked by property tests on the engine's order
and on its publish protocol; a bad band is refused on every rank."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comet
from comet import reference as ref
from comet._C import engine as eng
from tests.cases import E6_ON_3, TOL, cases_for, h_from_y0, make_inputs
from tests.sim_world import run_threads

BANDS = (1, 2, 0)  # column-major, two n-tiles, all n-tiles in one band
CASES = [cases_for(1)[0], cases_for(2)[3], cases_for(3)[5], cases_for(4)[1], cases_for(4)[4],
         E6_ON_3]


def _layer1_by_band(case, dtype, tile, bufs=None, n_comm=2, n_gemm=3):
    """layer0 once, then layer1 with every band of BANDS on the same inputs: {band: outs}."""
    xs, w0s, w1s, ids, wts = make_inputs(case, dtype)
    bufs = bufs or comet.Buffer.simulated_world(case.world, timeout=20)
    kw = dict(n_comm=n_comm, tile=tile)
    l0 = run_threads(case.world, lambda r, b: comet.moe_layer0(
        xs[r], w0s[r], ids[r], num_experts=case.experts, buffer=b, **kw), buffers=bufs)
    hs = [h_from_y0(y0, case.n1) for y0, _ in l0]
    outs = {band: run_threads(case.world, lambda r, b: comet.moe_layer1(
        hs[r], w1s[r], wts[r], l0[r][1], buffer=b, band=band, **kw), buffers=bufs)
        for band in BANDS}
    return outs, ref.layer1_sim(hs, w1s, wts, ids, case.experts)


def _assert_bitwise_equal_and_reference(outs, expect, dtype):
    for band in BANDS:
        for r, out in enumerate(outs[band]):
            assert torch.equal(out, outs[1][r]), (band, r)
            torch.testing.assert_close(out, expect[r], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_out_is_bitwise_the_same_for_every_band(case, dtype):
    # tile_n 8: 3 n-tiles of H = 24 (bands 1+1+1, 2+1, 3), 5 of H = 37 (2+2+1), 3 of H = 20
    outs, expect = _layer1_by_band(case, dtype, (8, 8))
    _assert_bitwise_equal_and_reference(outs, expect, dtype)


def test_bands_with_one_gemm_block_and_many_n_tiles():
    case = cases_for(3)[5]  # H = 37: 10 n-tiles of 4 columns
    outs, expect = _layer1_by_band(case, torch.float32, (5, 4), n_comm=1, n_gemm=1)
    _assert_bitwise_equal_and_reference(outs, expect, torch.float32)


@pytest.mark.parametrize("node_reduce", [False, True], ids=["per-rank", "node-reduced"])
def test_bands_across_two_nodes(node_reduce):
    """2 nodes x 2 ranks of the CPU analog: staged rows sent per chunk once all of its n-tiles
    are reduced (chunk_done), or node-reduced through the relays: the same bits for every band."""
    case = cases_for(4)[5]  # skewed routing, odd sizes
    bufs = comet.Buffer.simulated_world(4, timeout=20, ranks_per_node=2, node_reduce=node_reduce)
    outs, expect = _layer1_by_band(case, torch.bfloat16, (8, 8), bufs=bufs)
    _assert_bitwise_equal_and_reference(outs, expect, torch.bfloat16)


def test_backward_is_bitwise_the_same_for_every_band():
    """d(h, w1, topk_weights) through layer1 with each forward band (backward's layer1 call runs
    in the forward's band): the same bits."""
    case = cases_for(3)[3]  # dropped slots
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.float32)
    bufs = comet.Buffer.simulated_world(case.world, timeout=20)
    l0 = run_threads(case.world, lambda r, b: comet.moe_layer0(
        xs[r], w0s[r], ids[r], num_experts=case.experts, buffer=b, n_comm=2, tile=(4, 4)),
        buffers=bufs)
    g = torch.Generator().manual_seed(7)
    douts = [torch.randn(T, case.hidden, generator=g) for T in case.tokens]

    def grads(band):
        def rank(r, b):
            h = h_from_y0(l0[r][0], case.n1).detach().requires_grad_()
            w1 = w1s[r].clone().requires_grad_()
            wt = wts[r].clone().requires_grad_()
            out = comet.moe_layer1(h, w1, wt, l0[r][1], buffer=b, n_comm=2, tile=(4, 4),
                                   band=band)
            out.backward(douts[r])
            return h.grad, w1.grad, wt.grad

        return run_threads(case.world, rank, buffers=bufs)

    first = grads(1)
    for band in BANDS[1:]:
        for r, got in enumerate(grads(band)):
            for a, b in zip(got, first[r]):
                assert torch.equal(a, b), (band, r)


def test_a_bad_band_is_refused_on_every_rank():
    case = cases_for(2)[0]
    xs, w0s, w1s, ids, wts = make_inputs(case)
    bufs = comet.Buffer.simulated_world(2, timeout=20)
    l0 = run_threads(2, lambda r, b: comet.moe_layer0(xs[r], w0s[r], ids[r],
                                                        num_experts=case.experts, buffer=b),
                     buffers=bufs)
    hs = [h_from_y0(y0, case.n1) for y0, _ in l0]
    errors = [None, None]

    def rank(r, b):
        try:  # only rank 0 passes the bad value
            comet.moe_layer1(hs[r], w1s[r], wts[r], l0[r][1], buffer=b, band=-3 if r == 0 else 1)
        except ValueError as e:
            errors[r] = str(e)

    run_threads(2, rank, buffers=bufs)
    assert "band_n (n-tiles per column band of layer1; 0 = all) must be >= 0, got -3" in errors[0]
    assert errors[1] is not None, "rank 1 did not raise"
    # and the group still works afterwards
    outs = run_threads(2, lambda r, b: comet.moe_layer1(hs[r], w1s[r], wts[r], l0[r][1],
                                                        buffer=b), buffers=bufs)
    expect = ref.layer1_sim(hs, w1s, wts, ids, case.experts)
    for out, e in zip(outs, expect):
        torch.testing.assert_close(out, e, **TOL[torch.float32])


# ------------------------------------------------------------------------------------------------
# The schedule (engine bindings)
# ------------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.integers(1, 4), st.integers(1, 7),
       st.integers(0, 9))
def test_banded_order_is_a_permutation_m_major_inside_each_band(rows, tile_m, num_ntiles, band):
    expert_off = [0]
    for r in rows:
        expert_off.append(expert_off[-1] + r)
    mtiles = eng.mtiles(expert_off, tile_m)
    mt = len(mtiles)
    order = eng.tile_order(1, expert_off, [0] * (len(rows) * 2), 1, tile_m, num_ntiles,
                           band_n=band)
    assert sorted(order) == sorted((m, n) for m in range(mt) for n in range(num_ntiles))
    b = num_ntiles if band == 0 or band > num_ntiles else band
    at = 0
    for first in range(0, num_ntiles, b):
        width = min(b, num_ntiles - first)
        # the band: its n-tiles, m-tile after m-tile (all of m-tile 0's, then m-tile 1's, ...)
        assert order[at:at + mt * width] == [(m, n) for m in range(mt)
                                             for n in range(first, first + width)]
        at += mt * width
    if band == 1:  # b = 1 is column-major order
        assert order == [(m, n) for n in range(num_ntiles) for m in range(mt)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(0, 7), st.integers(1, 4),
       st.integers(1, 2))
def test_a_band_is_published_only_after_all_its_tiles(num_mtiles, num_ntiles, band, blocks,
                                                      threads):
    """The real layer1_gemm on a CPU grid: no tile of a band starts after any flag of its band is
    up, every flag is up at the end and every arrival counter is back to zero (self-reset)."""
    seen, flags, counts = eng.layer1_schedule(num_mtiles, num_ntiles, band, blocks, threads)
    assert sorted((m, n) for m, n, _ in seen) == sorted(
        (m, n) for m in range(num_mtiles) for n in range(num_ntiles))
    assert all(published == 0 for _, _, published in seen)
    assert flags == [1] * num_ntiles
    assert counts == [0] * num_ntiles
