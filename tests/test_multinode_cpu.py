"""The CPU analog of a multi-node group (comet/topology.h, csrc/cpu/link_proxy.h): ranks grouped
into nodes, other nodes' memory reached only by put-with-signal through a proxy thread with link
latency. Every awkward case at 2x2, 2x3 and 3x2 must equal the reference and be bitwise equal to
the one-node run; node-first dispatch must move each token's row to a node once; stress with
random delays and a slow link; a rank dying on the other node ends in an error, not a hang."""
import pytest
import torch

import comet
from tests.cases import E6_ON_3, cases_for, make_inputs
from tests.dist_utils import check_last_rank_killed, run_ranks
from tests.test_ops_dist import _compare_all_cases, check_suite_settings
from tests.test_ops_sim import check_against_reference, run_layers

# (world, ranks per node): 2 nodes x 2, 2 nodes x 3, 3 nodes x 2
TOPOLOGIES = [(4, 2), (6, 3), (6, 2)]
CASES = [(c, rpn) for w, rpn in TOPOLOGIES for c in cases_for(w)] + [(E6_ON_3, 1)]


def _nodes(case, rpn, **kw):
    return comet.Buffer.simulated_world(case.world, timeout=20, ranks_per_node=rpn, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case,rpn", CASES, ids=lambda v: str(v))
def test_across_nodes_matches_reference_and_one_node_bitwise(case, rpn, dtype):
    bufs = _nodes(case, rpn)
    assert all(b.ranks_per_node == rpn for b in bufs)
    got, inputs = run_layers(case, dtype, n_comm=2, n_gemm=2, buffers=bufs)
    check_against_reference(case, dtype, got, inputs)
    one, _ = run_layers(case, dtype, n_comm=2, n_gemm=2, inputs=inputs,
                        buffers=comet.Buffer.simulated_world(case.world, timeout=20))
    for (y0, layout, _h, out), (y0_1, layout_1, _h1, out_1) in zip(got, one):
        assert torch.equal(y0, y0_1) and torch.equal(out, out_1)
        assert torch.equal(layout.row_token, layout_1.row_token)
    assert sum(b.link_stats()[1] for b in bufs) > 0  # data did cross the link


def test_thread_teams_and_stress_with_a_slow_link(monkeypatch):
    """Random delays in every block and thread (COMET_STRESS) over a 300 us link at 1 GB/s,
    teams of 2 threads per block: still bitwise equal to one node, over back-to-back calls."""
    case = cases_for(4)[5]  # skewed routing, odd sizes
    inputs = make_inputs(case, torch.bfloat16)
    one, _ = run_layers(case, torch.bfloat16, inputs=inputs, n_comm=2, n_gemm=2,
                        buffers=comet.Buffer.simulated_world(4, timeout=20))
    bufs = _nodes(case, 2, link_latency_us=300, link_gbps=1.0, threads_per_block=2)
    for seed in (1, 2, 3):
        monkeypatch.setenv("COMET_STRESS", str(seed))
        got, _ = run_layers(case, torch.bfloat16, inputs=inputs, n_comm=2, n_gemm=2, buffers=bufs)
        for a, b in zip(got, one):
            assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])


def _layer0_link_bytes(bufs, ids, x, w0, E):
    """Bytes each rank's link delivered during one moe_layer0 call."""
    from tests.sim_world import run_threads

    before = [b.link_stats()[1] for b in bufs]
    run_threads(len(bufs), lambda r, b: comet.moe_layer0(x[r], w0[r], ids[r], num_experts=E,
                                                          buffer=b), buffers=bufs)
    return [b.link_stats()[1] - before[r] for r, b in enumerate(bufs)]


def test_node_first_dispatch_sends_a_token_to_a_node_once():
    """Every token of node 0 sends all its k = 4 slots to experts of node 1: layer0 moves each
    such row across once (T rows, not T*k), plus 12 bytes of routing per slot (its send-plan
    entry, its expert id and bucket position: the destinations' dedup reads the latter two). Measured as the
    difference to a call with no tokens (metadata only)."""
    W, rpn, E, k, H, T = 4, 2, 8, 4, 16, 10
    bufs = comet.Buffer.simulated_world(W, timeout=20, ranks_per_node=rpn, link_latency_us=0)
    w0 = [torch.randn(E // W, 6, H) for _ in range(W)]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g) for _ in range(W)]
    # node 0's ranks route to experts 4..7 (node 1), node 1's ranks to their own node only
    ids = [torch.stack([torch.randperm(4, generator=g)[:k] + (4 if r < rpn else 4 * (r // rpn))
                        for _ in range(T)]) for r in range(W)]
    empty = _layer0_link_bytes(bufs, [i[:0] for i in ids], [x[:0] for x in xs], w0, E)
    full = _layer0_link_bytes(bufs, ids, xs, w0, E)
    for r in range(W):
        expect = T * H * 4 + T * k * 12 if r < rpn else 0
        assert full[r] - empty[r] == expect, (r, full[r], empty[r])


def _layer0_link_stats(bufs, ids, xs, w0, E, blocks):
    """(puts, bytes) each rank's link issued during one moe_layer0 call on `blocks` blocks."""
    from tests.sim_world import run_threads

    before = [b.link_stats() for b in bufs]
    run_threads(len(bufs), lambda r, b: torch.ops.comet.moe_layer0(
        xs[r], w0[r], ids[r], E, b.handle, 1, blocks - 1, 16, 16, None, False, -1), buffers=bufs)
    return [(a[0] - c[0], a[1] - c[1]) for a, c in zip((b.link_stats() for b in bufs), before)]


@pytest.mark.parametrize("blocks,threads", [(2, 4), (3, 5)])
def test_node_push_puts_runs_of_tokens_not_tokens(blocks, threads):
    """Every token of node 0 has a slot on node 1: each block's contiguous range of tokens is ONE
    put per remote node (node_push.h), so layer0's row puts per call are at most blocks x remote
    nodes however many tokens and threads (the per-thread split put one per thread's share, and
    on the GPU's wide grids about one per token). Rows and bytes are unchanged."""
    W, rpn, E, k, H, T = 4, 2, 8, 2, 8, 61
    bufs = comet.Buffer.simulated_world(W, timeout=20, ranks_per_node=rpn, link_latency_us=0,
                                        threads_per_block=threads)
    g = torch.Generator().manual_seed(1)
    w0 = [torch.randn(E // W, 6, H, generator=g) for _ in range(W)]
    xs = [torch.randn(T, H, generator=g) for _ in range(W)]
    ids = [torch.stack([torch.randperm(4, generator=g)[:k] + (4 if r < rpn else 4 * (r // rpn))
                        for _ in range(T)]) for r in range(W)]
    _layer0_link_stats(bufs, ids, xs, w0, E, blocks)  # sizes the buffers (growth sends flags)
    empty = _layer0_link_stats(bufs, [i[:0] for i in ids], [x[:0] for x in xs], w0, E, blocks)
    full = _layer0_link_stats(bufs, ids, xs, w0, E, blocks)
    for r in range(rpn):
        row_puts = full[r][0] - empty[r][0]
        assert 1 <= row_puts <= blocks * 1, (r, full[r], empty[r])
        assert full[r][1] - empty[r][1] == T * H * 4 + T * k * 12
    # Routing with gaps: every third token stays home, so runs break: one put per run inside a
    # block's range (a block boundary may split a run). Results: the bitwise tests above.
    for r in range(rpn):
        ids[r][::3] = torch.randperm(4, generator=g)[:k]
    gapped = _layer0_link_stats(bufs, ids, xs, w0, E, blocks)
    for r in range(rpn):
        runs = (T + 2) // 3  # runs of two tokens between the home tokens 0, 3, 6, ...
        assert gapped[r][0] - empty[r][0] <= runs + blocks, (r, gapped[r])


def test_ranks_per_node_must_divide_the_group():
    with pytest.raises(ValueError, match="ranks_per_node must divide the group size 4, got 3"):
        comet.Buffer.simulated_world(4, ranks_per_node=3)
    with pytest.raises(ValueError, match="link_latency_us must be a number >= 0"):
        comet.Buffer.simulated_world(4, ranks_per_node=2, link_latency_us=-1)


@pytest.mark.parametrize("world,rpn", [(4, 2), (6, 3)])
def test_full_op_suite_across_processes_on_two_nodes(world, rpn):
    """The process suite of test_ops_dist (every case, fp32 and bf16, vs the torch.distributed
    reference) with the group split into 2 nodes by the environment, as a user would set it."""
    cases = cases_for(world)
    results = run_ranks(_compare_all_cases, world, cases, timeout=300,
                        env={"COMET_CPU_RANKS_PER_NODE": str(rpn),
                             "COMET_CPU_LINK_LATENCY_US": "50"})
    check_suite_settings(results, cases, world, ranks_per_node=rpn)


@pytest.mark.parametrize("node_reduce", [False, True], ids=["per-rank", "node-reduced"])
def test_rank_dying_on_the_other_node_fails_survivors_not_hangs(node_reduce):
    """Rank 3 (node 1; ranks 0 and 1 are node 0) dies. Node-reduced too: the dead rank is the
    relay of the other node's homes."""
    check_last_rank_killed(4, experts=8, tokens=150, stress=5, timeout=150, ranks_per_node=2,
                           link_latency_us=100, node_reduce=node_reduce)


@pytest.mark.parametrize("nodes,rpn", [(1, 4), (2, 1), (2, 3), (3, 2), (4, 2), (8, 1), (5, 3)])
def test_relays_and_mirror_slots_are_a_bijection(nodes, rpn):
    """topology.h: for every node b, the sources of the other nodes map one-to-one onto (relay on
    b, mirror slot in [0, nodes - 1)), each relay holding one source per other node, rail-aligned
    (same local index as the source)."""
    from comet._C import engine

    world = nodes * rpn
    for b in range(nodes):
        seen = set()
        for s in range(world):
            if s // rpn == b:
                continue
            relay, slot = engine.node_route(world, rpn, s, b)
            assert relay // rpn == b and relay % rpn == s % rpn
            assert 0 <= slot < nodes - 1
            seen.add((relay, slot))
        assert len(seen) == (nodes - 1) * rpn


@pytest.mark.parametrize("node_reduce", [False, True], ids=["flat", "node-reduced"])
def test_layer1_puts_runs_of_rows_not_rows(node_reduce):
    """Every token of a rank goes to the rank with its local index on the other node (E = W,
    k = 1): a home's partial rows are consecutive tokens in one partial slot, so the combine puts
    runs of them (comm_layer1.h: put_runs), flat from the staging region or node-reduced from the
    relay, not one put per row: layer1's puts per call are far fewer than its T rows, and the
    results equal the reference."""
    from comet import reference as ref
    from tests.sim_world import run_threads

    W, rpn, E, k, H, T = 4, 2, 4, 1, 8, 61
    bufs = comet.Buffer.simulated_world(W, timeout=20, ranks_per_node=rpn, link_latency_us=0,
                                        node_reduce=node_reduce)
    g = torch.Generator().manual_seed(2)
    w0 = [torch.randn(1, 6, H, generator=g) for _ in range(W)]
    w1 = [torch.randn(1, H, 6, generator=g) for _ in range(W)]
    xs = [torch.randn(T, H, generator=g) for _ in range(W)]
    ids = [torch.full((T, k), (r + rpn) % W, dtype=torch.int64) for r in range(W)]
    wts = [torch.rand(T, k, generator=g) for _ in range(W)]

    def rank(r, b):
        outs = []
        for _ in range(2):  # the first call sizes the buffer (its growth sends flags)
            y0, layout = comet.moe_layer0(xs[r], w0[r], ids[r], num_experts=E, buffer=b)
            before = b.link_stats()[0]
            outs.append((y0, comet.moe_layer1(y0, w1[r], wts[r], layout, buffer=b),
                         b.link_stats()[0] - before))
        return outs[1]

    try:
        got = run_threads(W, rank, buffers=bufs)
    finally:
        for b in bufs:
            b.close()
    out_ref = ref.layer1_sim([y0 for y0, _, _ in got], w1, wts, ids, E)
    for r, (_y0, out, puts) in enumerate(got):
        torch.testing.assert_close(out, out_ref[r], rtol=1e-5, atol=1e-5)
        assert puts < T // 2, (r, puts)  # one per row would be T, plus routing and flags
