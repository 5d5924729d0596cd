"""Node-reduced combine across nodes (Buffer(node_reduce=True), comet/topology.h): the ranks of a
sending node stage their partial rows on the home's relay on that node, which sums them and sends
one row per (token, node). Checked on the CPU analog: every awkward case at 2x2, 2x3 and 3x2 against
the reference, bitwise reproducible whatever the block, thread and link timing; fewer bytes on the
link, exactly one row per (token, node); with one rank per node it is the per-rank combine bit for
bit; the process suite under $COMET_NODE_REDUCE; the slot order as a property."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comet
from tests.cases import cases_for, make_inputs
from tests.dist_utils import comet_segments, run_ranks
from tests.sim_world import run_threads
from tests.test_ops_dist import _compare_all_cases, check_suite_settings
from tests.test_ops_sim import check_against_reference, run_layers

TOPOLOGIES = [(4, 2), (6, 3), (6, 2)]
CASES = [(c, rpn) for w, rpn in TOPOLOGIES for c in cases_for(w)]


def _nodes(world, rpn, node_reduce=True, **kw):
    return comet.Buffer.simulated_world(world, timeout=20, ranks_per_node=rpn,
                                        node_reduce=node_reduce, **kw)


def _link_bytes(bufs):
    return sum(b.link_stats()[1] for b in bufs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case,rpn", CASES, ids=lambda v: str(v))
def test_node_reduced_matches_reference_and_is_reproducible(case, rpn, dtype):
    bufs = _nodes(case.world, rpn)
    assert all(b.node_reduce for b in bufs)
    got, inputs = run_layers(case, dtype, n_comm=2, n_gemm=2, buffers=bufs)
    check_against_reference(case, dtype, got, inputs)
    # Other block counts, tiles and thread teams: the same bits (fixed summation order).
    again, _ = run_layers(case, dtype, n_comm=3, n_gemm=1, tile=(5, 7), inputs=inputs,
                          buffers=_nodes(case.world, rpn, threads_per_block=2))
    for a, b in zip(got, again):
        assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])


def test_one_rank_per_node_is_the_per_rank_combine_bitwise():
    """With one rank per node a node sends at most one partial per token: nothing to pre-reduce,
    and the home's order is the rank order, so node-reduced equals per-rank bit for bit."""
    for case in cases_for(4):
        inputs = make_inputs(case, torch.bfloat16)
        a, _ = run_layers(case, torch.bfloat16, n_comm=2, n_gemm=2, inputs=inputs,
                          buffers=_nodes(4, 1))
        b, _ = run_layers(case, torch.bfloat16, n_comm=2, n_gemm=2, inputs=inputs,
                          buffers=_nodes(4, 1, node_reduce=False))
        for x, y in zip(a, b):
            assert torch.equal(x[3], y[3]), case


def test_combine_sends_a_token_to_a_node_once():
    """Node 1's tokens each have one expert on rank 0 and one on rank 1 (both node 0): per rank,
    2 partial rows per token cross back to node 1; node-reduced, 1. The layer1 link bytes differ
    by exactly T rows of H fp32 values per home on node 1 (the routing mirrors are the same)."""
    W, rpn, E, k, H, T, N = 4, 2, 8, 2, 16, 10, 6
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g) for _ in range(W)]
    w0 = [torch.randn(E // W, 2 * N, H, generator=g) for _ in range(W)]
    w1 = [torch.randn(E // W, H, N, generator=g) for _ in range(W)]
    wts = [torch.rand(T, k, generator=g) for _ in range(W)]
    ids = [torch.stack([torch.randint(0, 2, (T,), generator=g),
                        torch.randint(2, 4, (T,), generator=g)], 1) for _ in range(W)]

    def layer1_bytes(node_reduce):
        bufs = _nodes(W, rpn, node_reduce=node_reduce, link_latency_us=0)
        l0 = run_threads(W, lambda r, b: comet.moe_layer0(xs[r], w0[r], ids[r], num_experts=E,
                                                            buffer=b), buffers=bufs)
        hs = [torch.nn.functional.silu(y[:, :N]) * y[:, N:] for y, _ in l0]
        before = _link_bytes(bufs)
        outs = run_threads(W, lambda r, b: comet.moe_layer1(hs[r].contiguous(), w1[r], wts[r],
                                                             l0[r][1], buffer=b), buffers=bufs)
        return _link_bytes(bufs) - before, outs

    flat, out_flat = layer1_bytes(False)
    reduced, out_reduced = layer1_bytes(True)
    assert flat - reduced == 2 * T * H * 4, (flat, reduced)
    for a, b in zip(out_flat, out_reduced):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_stress_with_a_slow_link_is_reproducible(monkeypatch):
    """Random delays in every block and thread over a 300 us, 1 GB/s link, teams of 2 threads:
    the same bits on every run, and the reference's values."""
    case = cases_for(4)[5]  # skewed routing, odd sizes
    inputs = make_inputs(case, torch.bfloat16)
    first = None
    bufs = _nodes(4, 2, link_latency_us=300, link_gbps=1.0, threads_per_block=2)
    for seed in (1, 2, 3):
        monkeypatch.setenv("COMET_STRESS", str(seed))
        got, _ = run_layers(case, torch.bfloat16, inputs=inputs, n_comm=2, n_gemm=2, buffers=bufs)
        check_against_reference(case, torch.bfloat16, got, inputs)
        if first is None:
            first = got
        for a, b in zip(got, first):
            assert torch.equal(a[3], b[3])


@pytest.mark.parametrize("world,rpn", [(4, 2), (6, 3)])
def test_process_suite_node_reduced_on_two_nodes(world, rpn):
    """The process suite of test_ops_dist with the group split into 2 nodes and node_reduce set
    by the environment, as a user would set them."""
    cases = cases_for(world)
    results = run_ranks(_compare_all_cases, world, cases, timeout=300,
                        env={"COMET_CPU_RANKS_PER_NODE": str(rpn), "COMET_NODE_REDUCE": "1",
                             "COMET_CPU_LINK_LATENCY_US": "50"})
    check_suite_settings(results, cases, world, ranks_per_node=rpn, node_reduce=True)


def test_bad_node_reduce_values_are_refused(monkeypatch):
    """Refused before any shared memory exists (nothing left in /dev/shm)."""
    before = comet_segments()
    with pytest.raises(ValueError, match="node_reduce must be a bool, got 'yes'"):
        comet.Buffer.simulated_world(2, node_reduce="yes")
    monkeypatch.setenv("COMET_NODE_REDUCE", "2")
    with pytest.raises(ValueError, match=r"COMET_NODE_REDUCE must be 0 or 1, got '2'"):
        comet.Buffer.simulated_world(2)
    assert comet_segments() <= before


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_node_reduced_slots_are_one_per_contributor_in_rank_order(data):
    """layout.h: for a token homed at h, node-reduced, the contributors are h's node's ranks one
    by one and every other node as one; their slots are 0..count-1 in ascending (first) rank.
    A sender on another node takes its slot within its node (the relay's node_stage row)."""
    from comet._C import engine

    nodes = data.draw(st.integers(1, 4))
    rpn = data.draw(st.integers(1, 3))
    el = data.draw(st.integers(1, 3))
    world = nodes * rpn
    k = data.draw(st.integers(1, 6))
    ids = data.draw(st.lists(st.integers(-1, world * el - 1), min_size=k, max_size=k))
    home = data.draw(st.integers(0, world - 1))
    ranks = sorted({i // el for i in ids if i >= 0})
    key = {r: r if r // rpn == home // rpn else (r // rpn) * rpn for r in ranks}
    keys = sorted(set(key.values()))
    for r in ranks:
        count, ordinal = engine.partial_slot(ids, el, r, rpn, home)
        if r // rpn == home // rpn:
            assert (count, ordinal) == (len(keys), keys.index(key[r]))
        else:
            mates = [m for m in ranks if m // rpn == r // rpn]
            assert (count, ordinal) == (len(mates), mates.index(r))
    # what the home adds: one slot per contributor
    if ranks:
        assert engine.partial_slot(ids, el, home, rpn, home)[0] == len(keys)
    # flat (reduce_rpn = 0): every rank on its own
    for r in ranks:
        assert engine.partial_slot(ids, el, r) == (len(ranks), ranks.index(r))
