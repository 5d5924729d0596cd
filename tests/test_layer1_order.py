"""moe_layer1 bit for bit against tests/layer1_order.py, an independent fp32 statement of its
reduction order (docs/design.md, "The layer1 reduction order"): the other bitwise tests compare the op
with itself, so an order changed everywhere at once (the home's partials added in reverse, the
slots of a partial in another order) would pass them; it cannot pass this.

On 1-4 ranks (every awkward case), every block split, tile shape, column band and thread team, with biases
and transposed weights, across nodes per rank and node-reduced."""
import pytest
import torch

import comet
from tests.cases import E6_ON_3, Case, cases_for, h_from_y0, make_biases, make_inputs
from tests.layer1_order import layer1_exact, rows_from_reference
from tests.sim_world import run_threads

DTYPES = [torch.float32, torch.bfloat16]
ALL_CASES = [c for w in (1, 2, 3, 4) for c in cases_for(w)] + [E6_ON_3]
# (n_comm, n_gemm, tile, threads per block, layer1's column band): splits, tiles that do and do
# not divide H, teams, bands of 1 n-tile (column order), 2, 3 and all (0).
LAUNCHES = [(1, 1, (8, 8), 1, 1), (3, 2, (5, 7), 1, 2), (2, 3, (4, 16), 2, 0),
            (3, 1, (64, 64), 4, 1), (1, 2, (1, 3), 2, 3)]


def run_op(case, dtype, *, n_comm=1, n_gemm=1, tile=(8, 8), threads=1, ranks_per_node=None,
           node_reduce=False, bias=False, w1_transposed=False, inputs=None, layer1_kw=None):
    """layer1_kw: more moe_layer1 arguments (e.g. a column band): they must not change a bit."""
    xs, w0s, w1s, ids, wts = inputs or make_inputs(case, dtype)
    b1s = make_biases(case, dtype)[1] if bias else None
    w1_arg = [w.transpose(1, 2).contiguous() for w in w1s] if w1_transposed else w1s
    bufs = comet.Buffer.simulated_world(case.world, timeout=20, threads_per_block=threads,
                                        ranks_per_node=ranks_per_node, node_reduce=node_reduce)
    # The settings took effect (a buffer that ignored them would test one node, one thread).
    for b in bufs:
        assert b.ranks_per_node == (ranks_per_node or case.world)
        assert b.node_reduce == (node_reduce and (ranks_per_node or case.world) < case.world)

    def rank(r, buf):
        y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts,
                                      buffer=buf, n_comm=n_comm, tile=tile)
        h = h_from_y0(y0, case.n1)
        out = comet.moe_layer1(h, w1_arg[r], wts[r], layout, buffer=buf, n_comm=n_comm,
                               tile=tile, b1=None if b1s is None else b1s[r],
                               w1_transposed=w1_transposed, **(layer1_kw or {}))
        return h, out

    got = run_threads(case.world, rank, buffers=bufs)
    want = layer1_exact([h for h, _ in got], w1_arg, wts, ids, case.experts,
                        rows_from_reference(ids, case.experts), b1s=b1s,
                        ranks_per_node=ranks_per_node, node_reduce=node_reduce,
                        w1_transposed=w1_transposed)
    return [out for _, out in got], want, bufs


def assert_bitwise(got, want, what):
    for r, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, r)
        if not torch.equal(a, b):
            bad = (a.float() - b.float()).abs()
            raise AssertionError(f"{what}: rank {r} differs from the stated order in "
                                 f"{int((bad > 0).sum())} of {a.numel()} values (max {bad.max()})")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_every_case_is_the_stated_order(case, dtype):
    got, want, _ = run_op(case, dtype)
    assert_bitwise(got, want, case.name)


@pytest.mark.parametrize("launch", LAUNCHES,
                         ids=lambda l: f"c{l[0]}g{l[1]}t{l[2][0]}x{l[2][1]}x{l[3]}b{l[4]}")
@pytest.mark.parametrize("case", [cases_for(2)[3], cases_for(3)[5], cases_for(4)[4], E6_ON_3],
                         ids=str)
def test_splits_tiles_and_teams_are_the_stated_order(case, launch):
    n_comm, n_gemm, tile, threads, band = launch
    got, want, _ = run_op(case, torch.bfloat16, n_comm=n_comm, n_gemm=n_gemm, tile=tile,
                          threads=threads, layer1_kw={"band": band})
    assert_bitwise(got, want, f"{case.name} {launch}")


@pytest.mark.parametrize("w1_transposed", [False, True], ids=["w1", "w1T"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_biases_and_transposed_weights_are_the_stated_order(dtype, w1_transposed):
    case = cases_for(3)[1]
    got, want, _ = run_op(case, dtype, bias=True, w1_transposed=w1_transposed, n_comm=2)
    assert_bitwise(got, want, case.name)


def test_long_k_uses_every_lane():
    """N1 = 37: the 8 lanes, the tail, the tree, all exercised (K < 8 in most cases)."""
    case = Case("long-k", 2, 4, 2, (9, 6), hidden=16, n0=40, n1=37, seed=9)
    for dtype in DTYPES:
        got, want, _ = run_op(case, dtype, n_comm=2, tile=(4, 8))
        assert_bitwise(got, want, f"long-k {dtype}")


NODE_CASES = [(cases_for(4)[0], 2), (cases_for(4)[3], 2), (cases_for(4)[4], 1),
              (cases_for(6)[0], 3), (cases_for(6)[4], 2), (cases_for(6)[5], 3)]


@pytest.mark.parametrize("node_reduce", [False, True], ids=["per-rank", "node-reduced"])
@pytest.mark.parametrize("case,rpn", NODE_CASES, ids=lambda v: str(v))
def test_across_nodes_is_the_stated_order(case, rpn, node_reduce):
    for dtype, launch in ((torch.bfloat16, LAUNCHES[1]), (torch.float32, LAUNCHES[2])):
        n_comm, n_gemm, tile, threads, band = launch
        got, want, bufs = run_op(case, dtype, n_comm=n_comm, n_gemm=n_gemm, tile=tile,
                                 threads=threads, ranks_per_node=rpn, node_reduce=node_reduce,
                                 layer1_kw={"band": band})
        assert_bitwise(got, want, f"{case.name} {rpn} per node {dtype}")
        # The node path ran: the ranks' puts crossed the link proxy.
        assert sum(b.link_stats()[0] for b in bufs) > 0

