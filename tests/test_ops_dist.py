"""comet's ops across real processes (torch.distributed gloo on 127.0.0.1, shared-memory symmetric
heap): results vs the reference on 1-4 ranks, bad input raising on every rank within seconds, and
a rank killed mid-call ending in an error on the survivors instead of a hang."""
import os
import time

import pytest
import torch

from tests.cases import E6_ON_3, TOL, cases_for, h_from_y0, make_inputs
from tests.dist_utils import check_last_rank_killed, run_ranks


def _compare_all_cases(rank, world, cases):
    import comet
    from comet import reference as ref

    errors = {}
    for case in cases:
        for dtype in (torch.float32, torch.bfloat16):
            xs, w0s, w1s, ids, wts = make_inputs(case, dtype)
            y0, layout = comet.moe_layer0(xs[rank], w0s[rank], ids[rank], num_experts=case.experts)
            h = h_from_y0(y0, case.n1)
            out = comet.moe_layer1(h, w1s[rank], wts[rank], layout)
            # Reference: the torch.distributed form on the same group, plus the simulated form
            # with every rank's h gathered (layer1 must be checked on exactly this h).
            y0_ref = ref.layer0_dist(xs[rank], w0s[rank], ids[rank], case.experts)
            out_ref = ref.layer1_dist(h, w1s[rank], wts[rank], ids[rank], case.experts)
            torch.testing.assert_close(y0, y0_ref, **TOL[dtype])
            torch.testing.assert_close(out, out_ref, **TOL[dtype])
            errors[(case.name, str(dtype))] = float((out.float() - out_ref.float()).abs().max()) \
                if out.numel() else 0.0
    buf = comet.buffers.symm.buffer_for(None)  # the settings the calls ran with, as the buffer reports them
    return {"errors": errors, "ranks_per_node": buf.ranks_per_node, "node_reduce": buf.node_reduce,
            "link_puts": buf.link_stats()[0]}


def check_suite_settings(results, cases, world, ranks_per_node=None, node_reduce=False):
    """Every case ran on every rank, under the node settings the test (or the environment, for
    make test-py-nodes) asked for, and with several nodes the link proxy carried puts: a buffer
    that ignored the settings would pass the comparisons on one node."""

    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("COMET_CPU_RANKS_PER_NODE", world))
    for r, res in enumerate(results):
        assert len(res["errors"]) == 2 * len(cases), r
        assert res["ranks_per_node"] == ranks_per_node, (r, res["ranks_per_node"])
        assert res["node_reduce"] == (node_reduce and ranks_per_node < world), (r, res)
    if ranks_per_node < world:
        assert sum(res["link_puts"] for res in results) > 0


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ops_match_reference_across_processes(world):
    cases = cases_for(world) + ([E6_ON_3] if world == 3 else [])
    results = run_ranks(_compare_all_cases, world, cases, timeout=240)
    check_suite_settings(results, cases, world,
                         node_reduce=os.environ.get("COMET_NODE_REDUCE", "0") == "1")


def _bad_inputs(rank, world):
    """Every rank runs the same sequence; only rank 1 passes the bad input (or, for disagreements,
    every rank passes its own). Each call must raise on every rank, quickly, and leave the buffer
    usable for the next call."""
    import comet

    E, k, H, N0 = 6, 2, 8, 6
    T = 5
    x = torch.randn(T, H)
    w0 = torch.randn(E // world, N0, H)
    ids = torch.randint(0, E, (T, k))
    bad = rank == 1

    def call(**over):
        args = dict(x=x, w0=w0, topk_ids=ids, num_experts=E)
        args.update(over)
        return comet.moe_layer0(args.pop("x"), args.pop("w0"), args.pop("topk_ids"), **args)

    cases = {
        "dtype": dict(x=x.to(torch.int32)) if bad else {},
        "device": dict(w0=w0.to("meta")) if bad else {},
        "shape": dict(w0=torch.randn(E // world, N0, H + 1)) if bad else {},
        "contiguity": dict(x=torch.randn(H, T).t()) if bad else {},
        "id out of range": dict(topk_ids=ids.clone().fill_(E)) if bad else {},
        "id below -1": dict(topk_ids=ids.clone().fill_(-2)) if bad else {},
        "E not divisible": dict(num_experts=E + 1, w0=w0),
        "hidden disagrees": dict(x=torch.randn(T, H + rank), w0=torch.randn(E // world, N0, H + rank)),
        "experts disagree": dict(num_experts=E * (1 + rank), w0=torch.randn(E * (1 + rank) // world, N0, H)),
        "topk disagrees": dict(topk_ids=torch.randint(0, E, (T, k + rank))),
    }
    seen = {}
    for name, over in cases.items():
        t0 = time.monotonic()
        try:
            call(**over)
        except (ValueError, TypeError) as e:
            seen[name] = (type(e).__name__, str(e), time.monotonic() - t0)
        else:
            seen[name] = ("no error", "", time.monotonic() - t0)
        # The buffer still works after every rejected call.
        y0, layout = call()
        assert y0.shape[1] == N0
    # layer1 with an h that does not match the layout
    y0, layout = call()
    try:
        comet.moe_layer1(y0[:, :3][: (-1 if bad else None)].contiguous(), torch.randn(E // world, H, 3),
                         torch.rand(T, k), layout)
        seen["layer1 rows"] = ("no error", "", 0.0)
    except ValueError as e:
        seen["layer1 rows"] = ("ValueError", str(e), 0.0)
    return seen


def test_bad_inputs_raise_on_every_rank_within_seconds():
    world = 3
    results = run_ranks(_bad_inputs, world, timeout=180)
    for name in results[0]:
        for r in range(world):
            kind, msg, took = results[r][name]
            assert kind in ("ValueError", "TypeError"), f"{name}: rank {r} got {kind}"
            assert took < 10, f"{name}: rank {r} took {took:.1f} s to raise"
            assert "comet" in msg, msg
    # The failing rank names the offending value; its peers name the failing rank.
    assert "int32" in results[1]["dtype"][1] and "rank 1" in results[0]["dtype"][1]
    assert "= 6" in results[1]["id out of range"][1] and "= -2" in results[1]["id below -1"][1]
    assert "meta" in results[1]["device"][1]
    assert "contiguous" in results[1]["contiguity"][1]
    assert "not divisible" in results[0]["E not divisible"][1]
    assert "disagree on the hidden size" in results[0]["hidden disagrees"][1]
    assert "disagree on num_experts" in results[2]["experts disagree"][1]
    assert "disagree on topk" in results[1]["topk disagrees"][1]
    assert "rows" in results[1]["layer1 rows"][1]


def test_rank_killed_mid_call_fails_survivors_not_hangs():
    check_last_rank_killed(3, experts=6, tokens=200, stress=3, timeout=120)


def _two_groups(rank, world):
    """World of 4, expert-parallel groups {0, 1} and {2, 3} running their calls at the same time
    (the case of EP inside a larger data-parallel world): each group's results as the reference
    computed over that group, and a group's buffer never sees the other group's ranks."""
    import torch.distributed as dist

    import comet
    from comet import reference as ref

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    mine = groups[rank // 2]
    buf = comet.buffers.symm.buffer_for(mine)
    assert (buf.rank, buf.world) == (rank % 2, 2)
    errs = []
    for i, case in enumerate(cases_for(2)):
        xs, w0s, w1s, ids, wts = make_inputs(case, torch.float32)
        r = rank % 2
        if rank // 2 == 1:  # the second group routes differently (same shapes, other seed)
            g = torch.Generator().manual_seed(100 + i)
            ids = [torch.where(t >= 0, torch.randint(0, case.experts, t.shape, generator=g), t)
                   for t in ids]
        y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts, group=mine)
        h = h_from_y0(y0, case.n1)
        out = comet.moe_layer1(h, w1s[r], wts[r], layout, group=mine)
        y0_ref = ref.layer0_dist(xs[r], w0s[r], ids[r], case.experts, group=mine)
        out_ref = ref.layer1_dist(h, w1s[r], wts[r], ids[r], case.experts, group=mine)
        torch.testing.assert_close(y0, y0_ref, **TOL[torch.float32])
        torch.testing.assert_close(out, out_ref, **TOL[torch.float32])
        errs.append(float((out - out_ref).abs().max()) if out.numel() else 0.0)
    return errs


def test_two_disjoint_groups_at_once():
    results = run_ranks(_two_groups, 4, timeout=240)
    assert all(len(r) == len(cases_for(2)) for r in results)
