"""Tests of comet.reference: the pure-torch definition of the MoE layer semantics."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comet import reference as ref
from comet.reference import Row

try:  # tests/ as a package or as a plain directory on sys.path
    from tests.dist_utils import RankError, RankTimeout, run_ranks
except ImportError:  # pragma: no cover - depends on how pytest was invoked
    from dist_utils import RankError, RankTimeout, run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def make_world(world, num_experts, tokens, k, H=8, N0=6, N1=3, dtype=torch.float32, seed=0,
               drop=0.2, ids_dtype=torch.int64, weights_dtype=torch.float32):
    """Random per-rank inputs: xs, w0s, w1s, ids, weights (ids may repeat; ~drop of slots are -1)."""
    g = torch.Generator().manual_seed(seed)
    e_local = num_experts // world
    xs = [torch.randn(t, H, generator=g).to(dtype) for t in tokens]
    w0s = [(torch.randn(e_local, N0, H, generator=g) / math.sqrt(H)).to(dtype) for _ in range(world)]
    w1s = [(torch.randn(e_local, H, N1, generator=g) / math.sqrt(N1)).to(dtype) for _ in range(world)]
    ids, weights = [], []
    for t in tokens:
        i = torch.randint(0, num_experts, (t, k), generator=g)
        i[torch.rand(t, k, generator=g) < drop] = -1
        ids.append(i.to(ids_dtype))
        weights.append(torch.rand(t, k, generator=g).to(weights_dtype))
    return xs, w0s, w1s, ids, weights


def row_map(ids, num_experts):
    """{(s, t, j): (dest, row index, local expert)} for every valid slot."""
    where = {}
    for d in range(len(ids)):
        for i, r in enumerate(ref.dispatch_rows(ids, num_experts, d)):
            where[(r.source, r.token, r.slot)] = (d, i, r.local_expert)
    return where


def brute_layer0(xs, w0s, ids, num_experts):
    """Row by row, in float64, from dispatch_rows."""
    outs = []
    for d in range(len(xs)):
        rows = ref.dispatch_rows(ids, num_experts, d)
        y = torch.zeros(len(rows), w0s[d].shape[1], dtype=torch.float64)
        for i, r in enumerate(rows):
            y[i] = w0s[d][r.local_expert].double() @ xs[r.source][r.token].double()
        outs.append(y)
    return outs


def brute_layer1(hs, w1s, weights, ids, num_experts):
    """Token by token, in float64: out_s[t] = sum_j w[t, j] * (h[row(s,t,j)] @ W1[e_j]^T)."""
    where = row_map(ids, num_experts)
    H = w1s[0].shape[1]
    outs = []
    for s in range(len(ids)):
        T, k = ids[s].shape
        out = torch.zeros(T, H, dtype=torch.float64)
        for t in range(T):
            for j in range(k):
                e = int(ids[s][t, j])
                if e < 0:
                    continue
                d, i, le = where[(s, t, j)]
                assert le == e % (num_experts // len(ids)) and d == e // (num_experts // len(ids))
                out[t] += float(weights[s][t, j]) * (w1s[d][le].double() @ hs[d][i].double())
        outs.append(out)
    return outs


def assert_close(actual, expected, dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------------
# (1) Hand-checked tiny cases
# --------------------------------------------------------------------------------------------------


def test_dispatch_order_ring_from_self_duplicates_and_drops():
    # W=2, E=4: rank 0 owns experts 0, 1; rank 1 owns experts 2, 3.
    ids0 = torch.tensor([[1, 2], [2, -1], [0, 2]])
    ids1 = torch.tensor([[3, 0], [2, 2]], dtype=torch.int32)  # token 1 picks expert 2 twice
    ids = [ids0, ids1]
    assert ref.dispatch_rows(ids, 4, 0) == [
        Row(0, 2, 0, 0),  # expert 0, source 0 first (ring starts at self) ...
        Row(1, 0, 1, 0),  # ... then source 1
        Row(0, 0, 0, 1),  # expert 1
    ]
    assert ref.dispatch_rows(ids, 4, 1) == [
        Row(1, 1, 0, 0),  # expert 2: source 1 first (self), both slots of the duplicate
        Row(1, 1, 1, 0),
        Row(0, 0, 1, 0),  # then source 0, by token then slot; (0, 1, 1) is dropped
        Row(0, 1, 0, 0),
        Row(0, 2, 1, 0),
        Row(1, 0, 0, 1),  # expert 3
    ]
    # Field names
    r = ref.dispatch_rows(ids, 4, 0)[1]
    assert (r.source, r.token, r.slot, r.local_expert) == (1, 0, 1, 0)


def test_dispatch_order_three_ranks_with_empty_rank():
    ids = [torch.tensor([[2], [1]]), torch.zeros(0, 1, dtype=torch.int64), torch.tensor([[0], [2], [-1]])]
    assert ref.dispatch_rows(ids, 3, 0) == [Row(2, 0, 0, 0)]
    assert ref.dispatch_rows(ids, 3, 1) == [Row(0, 1, 0, 0)]
    # ring order from 2: 2, 0, 1
    assert ref.dispatch_rows(ids, 3, 2) == [Row(2, 1, 0, 0), Row(0, 0, 0, 0)]
    assert ref.ring_order(2, 3) == [2, 0, 1]
    assert ref.dispatch_counts(ids[2], 3).tolist() == [1, 0, 1]


def test_hand_computed_layer0_layer1():
    # W=1, E=2, H=N0=N1=1 so every number can be checked by hand.
    x = torch.tensor([[1.0], [2.0], [3.0]])
    ids = torch.tensor([[0, 1], [1, 1], [-1, -1]])  # token 1: expert 1 twice; token 2: all dropped
    w0 = torch.tensor([[[10.0]], [[100.0]]])
    (y0,) = ref.layer0_sim([x], [w0], [ids], 2)
    # expert 0: (t0, j0); expert 1: (t0, j1), (t1, j0), (t1, j1)
    assert y0.tolist() == [[10.0], [100.0], [200.0], [200.0]]
    w1 = torch.tensor([[[1.0]], [[0.5]]])
    nan = float("nan")
    weights = torch.tensor([[0.25, 0.75], [1.0, 2.0], [nan, nan]])  # dropped weights never read
    (out,) = ref.layer1_sim([y0], [w1], [weights], [ids], 2)
    assert out.tolist() == [[0.25 * 10 + 0.75 * 50], [1.0 * 100 + 2.0 * 100], [0.0]]
    assert out.dtype == torch.float32


def test_hand_computed_two_ranks_with_empty_rank():
    # W=2, E=2: expert 0 on rank 0, expert 1 on rank 1; rank 1 has no tokens.
    x0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    x1 = torch.zeros(0, 2)
    ids = [torch.tensor([[1, 0], [1, -1]]), torch.zeros(0, 2, dtype=torch.int64)]
    w0 = [torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.0, 1.0]]])]  # picks coordinate 0 / 1
    y0 = ref.layer0_sim([x0, x1], w0, ids, 2)
    assert y0[0].tolist() == [[1.0]]
    assert y0[1].tolist() == [[2.0], [4.0]]
    w1 = [torch.tensor([[[1.0], [1.0]]]), torch.tensor([[[1.0], [-1.0]]])]  # H=2, N1=1
    weights = [torch.tensor([[0.5, 2.0], [1.0, 9.0]]), torch.zeros(0, 2)]
    out = ref.layer1_sim(y0, w1, weights, ids, 2)
    # token 0: 0.5 * (2 * [1, -1]) + 2 * (1 * [1, 1]); token 1: 1 * (4 * [1, -1])
    assert out[0].tolist() == [[3.0, 1.0], [4.0, -4.0]]
    assert out[1].shape == (0, 2)


def test_all_ranks_empty():
    xs, w0s, w1s, ids, weights = make_world(2, 4, [0, 0], 2)
    y0 = ref.layer0_sim(xs, w0s, ids, 4)
    assert [tuple(y.shape) for y in y0] == [(0, 6), (0, 6)]
    out = ref.moe_sim(xs, w0s, w1s, ids, weights, 4)
    assert [tuple(o.shape) for o in out] == [(0, 8), (0, 8)]


def test_expert_rank_and_local_expert():
    assert [ref.expert_rank(e, 6, 3) for e in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [ref.local_expert(e, 6, 3) for e in range(6)] == [0, 1, 0, 1, 0, 1]
    assert ref.check_world(8, 4) == 2


# --------------------------------------------------------------------------------------------------
# (2) Simulated world vs brute force
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "world,num_experts,tokens,k",
    [(1, 3, [6], 2), (2, 4, [5, 0], 3), (3, 6, [4, 0, 7], 2), (4, 4, [3, 5, 1, 2], 4)],
)
def test_sim_matches_brute_force(world, num_experts, tokens, k, dtype):
    xs, w0s, w1s, ids, weights = make_world(world, num_experts, tokens, k, dtype=dtype, seed=world)
    y0 = ref.layer0_sim(xs, w0s, ids, num_experts)
    for y, e in zip(y0, brute_layer0(xs, w0s, ids, num_experts)):
        assert y.shape == e.shape
        assert_close(y, e, dtype)
    hs = [ref.swiglu(y) for y in y0]
    out = ref.layer1_sim(hs, w1s, weights, ids, num_experts)
    for o, e, x in zip(out, brute_layer1(hs, w1s, weights, ids, num_experts), xs):
        assert o.shape == x.shape
        assert_close(o, e, dtype)
    moe = ref.moe_sim(xs, w0s, w1s, ids, weights, num_experts)
    for a, b in zip(moe, out):
        assert torch.equal(a, b)


def test_sim_accepts_int32_ids_and_weights_in_x_dtype():
    base = make_world(3, 6, [4, 2, 5], 2, dtype=torch.bfloat16, seed=7)
    xs, w0s, w1s, ids, weights = base
    ids32 = [i.to(torch.int32) for i in ids]
    w_bf16 = [w.to(torch.bfloat16) for w in weights]
    w_from_bf16 = [w.float() for w in w_bf16]
    a = ref.moe_sim(xs, w0s, w1s, ids32, w_bf16, 6)
    b = ref.moe_sim(xs, w0s, w1s, ids, w_from_bf16, 6)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_layer1_accumulates_over_slots_in_fp32_then_casts():
    # One token, three slots on one expert: fp32 sum 1 + 2^-8 + 2^-8 = 1 + 2^-7 is a bf16 value,
    # while accumulating in bf16 would round each 1 + 2^-8 back to 1.
    ids = torch.tensor([[0, 0, 0]])
    h = torch.ones(3, 1, dtype=torch.bfloat16)
    w1 = torch.ones(1, 1, 1, dtype=torch.bfloat16)
    wts = torch.tensor([[1.0, 2.0**-8, 2.0**-8]])
    (out,) = ref.layer1_sim([h], [w1], [wts], [ids], 1)
    assert out.dtype == torch.bfloat16
    assert out.item() == 1.0 + 2.0**-7


def test_layer1_sums_slots_in_ascending_order():
    # fp32: ((0 + 2^24) + 1) + (-2^24) = 0 in ascending order (the 1 is absorbed);
    # descending order would give ((0 - 2^24) + 1) + 2^24 = 1.
    ids = torch.tensor([[0, 1, 0]])
    h = torch.ones(3, 1)  # rows: (t0, j0) and (t0, j2) on expert 0, then (t0, j1) on expert 1
    w1 = torch.ones(2, 1, 1)
    wts = torch.tensor([[2.0**24, 1.0, -(2.0**24)]])
    (out,) = ref.layer1_sim([h], [w1], [wts], [ids], 2)
    assert out.item() == 0.0


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 4),
    e_local=st.integers(1, 3),
    k=st.integers(1, 4),
    data=st.data(),
)
def test_dispatch_rows_is_a_permutation_in_layout_order(world, e_local, k, data):
    E = world * e_local
    tokens = data.draw(st.lists(st.integers(0, 5), min_size=world, max_size=world))
    ids = [
        torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, E - 1), min_size=k, max_size=k),
                                        min_size=t, max_size=t)), dtype=torch.int64).reshape(t, k)
        for t in tokens
    ]
    seen = []
    for d in range(world):
        rows = ref.dispatch_rows(ids, E, d)
        # sort key: (local expert, ring position of the source, token, slot)
        keys = [(r.local_expert, (r.source - d) % world, r.token, r.slot) for r in rows]
        assert keys == sorted(keys)
        for r in rows:
            assert int(ids[r.source][r.token, r.slot]) == d * e_local + r.local_expert
        assert len(rows) == sum(int(ref.dispatch_counts(i, E)[d * e_local:(d + 1) * e_local].sum())
                                for i in ids)
        seen += [(r.source, r.token, r.slot) for r in rows]
    valid = [(s, t, j) for s in range(world) for t in range(tokens[s]) for j in range(k)
             if int(ids[s][t, j]) >= 0]
    assert sorted(seen) == sorted(valid)
    assert len(set(seen)) == len(seen)


# --------------------------------------------------------------------------------------------------
# (3) Simulated world == torch.distributed form (gloo, W processes)
# --------------------------------------------------------------------------------------------------

# (num_experts, tokens per rank, k, drop fraction, ids dtype, weights in x dtype?)
DIST_CASES = {
    1: [(2, [5], 2, 0.2, torch.int64, False), (3, [0], 2, 0.0, torch.int64, False)],
    2: [(4, [7, 0], 3, 0.3, torch.int32, False), (2, [0, 4], 2, 0.2, torch.int64, True)],
    3: [(6, [5, 0, 9], 2, 0.3, torch.int64, False), (3, [1, 6, 2], 3, 0.5, torch.int32, True)],
    4: [(8, [3, 6, 0, 4], 3, 0.25, torch.int64, False), (4, [2, 0, 5, 1], 2, 0.0, torch.int64, True)],
}
DIST_DTYPES = [torch.float32, torch.bfloat16]


def _dist_inputs(world):
    cases = []
    for c, (E, tokens, k, drop, ids_dtype, w_in_x) in enumerate(DIST_CASES[world]):
        for dtype in DIST_DTYPES:
            xs, w0s, w1s, ids, weights = make_world(
                world, E, tokens, k, dtype=dtype, seed=100 * world + c, drop=drop,
                ids_dtype=ids_dtype, weights_dtype=dtype if w_in_x else torch.float32,
            )
            if sum(tokens) > 0:  # make sure one token has all slots dropped
                s = max(range(world), key=lambda r: tokens[r])
                ids[s][0] = -1
            cases.append((E, xs, w0s, w1s, ids, weights))
    return cases


def _dist_body(rank, world, cases):
    """Runs on every rank: the distributed form on this rank's slice of every case."""
    import torch.distributed as dist

    results = []
    for E, xs, w0s, w1s, ids, weights in cases:
        y0 = ref.layer0_dist(xs[rank], w0s[rank], ids[rank], E)
        out = ref.layer1_dist(ref.swiglu(y0), w1s[rank], weights[rank], ids[rank], E)
        moe = ref.moe_dist(xs[rank], w0s[rank], w1s[rank], ids[rank], weights[rank], E)
        results.append((y0, out, moe))
    # Sub-groups: {0, 2} and {1, 3} each run the first case as their own 2-rank world.
    sub = None
    if world == 4:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group = groups[rank % 2]
        # Both groups feed group rank g with rank g's slice of case 0 (so both equal one sim).
        E, xs, w0s, w1s, ids, weights = cases[0]
        gr = dist.get_rank(group)
        E2 = 4
        ids2 = [i.clamp(max=E2 - 1) for i in ids]  # keep ids valid for 4 experts
        sub = ref.moe_dist(xs[gr], w0s[gr][:2], w1s[gr][:2], ids2[gr], weights[gr], E2, group=group)
    return results, sub


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dist_matches_sim(world):
    cases = _dist_inputs(world)
    per_rank = run_ranks(_dist_body, world, cases, timeout=120)
    for c, (E, xs, w0s, w1s, ids, weights) in enumerate(cases):
        y0_sim = ref.layer0_sim(xs, w0s, ids, E)
        hs = [ref.swiglu(y) for y in y0_sim]
        out_sim = ref.layer1_sim(hs, w1s, weights, ids, E)
        for r in range(world):
            y0, out, moe = per_rank[r][0][c]
            assert y0.dtype == xs[r].dtype and out.dtype == xs[r].dtype
            assert torch.equal(y0, y0_sim[r]), (c, r)
            assert torch.equal(out, out_sim[r]), (c, r)
            assert torch.equal(moe, out_sim[r]), (c, r)
    if world == 4:
        E, xs, w0s, w1s, ids, weights = cases[0]
        ids2 = [i.clamp(max=3) for i in ids]
        for members in ([0, 2], [1, 3]):
            sim = ref.moe_sim([xs[i] for i in range(2)], [w[:2] for w in w0s[:2]],
                              [w[:2] for w in w1s[:2]], ids2[:2], weights[:2], 4)
            for gr, r in enumerate(members):
                assert torch.equal(per_rank[r][1], sim[gr]), (members, r)


def _bad_input_body(rank, world):
    """Rank 1 gets a bad input; every rank must raise ValueError (nobody hangs), and the group
    stays usable afterwards (each case runs in the same processes, one after the other)."""
    xs, w0s, w1s, ids, weights = make_world(world, 4, [3] * world, 2, seed=3, drop=0.0)
    msgs = {}
    for which in ["id", "h_rows", "world"]:
        msgs[which] = None
        try:
            if which == "id":
                bad_ids = ids[rank].clone()
                if rank == 1:
                    bad_ids[2, 1] = 4
                ref.layer0_dist(xs[rank], w0s[rank], bad_ids, 4)
            elif which == "h_rows":
                h = ref.swiglu(ref.layer0_dist(xs[rank], w0s[rank], ids[rank], 4))
                if rank == 1:
                    h = h[1:]
                ref.layer1_dist(h, w1s[rank], weights[rank], ids[rank], 4)
            else:
                ref.layer0_dist(xs[rank], w0s[rank], ids[rank], 3)  # 3 experts on 2 ranks
        except ValueError as exc:
            msgs[which] = str(exc)
    ok = ref.moe_dist(xs[rank], w0s[rank], w1s[rank], ids[rank], weights[rank], 4)
    return msgs, ok


def test_dist_bad_input_raises_on_every_rank():
    res = run_ranks(_bad_input_body, 2, timeout=60)
    msgs = [m for m, _ in res]
    for which in ["id", "h_rows", "world"]:
        assert all(m[which] is not None for m in msgs), (which, msgs)
    assert "invalid expert id 4" in msgs[1]["id"]
    assert "rank(s) [1]" in msgs[0]["id"]
    assert all("rank 1" in m["h_rows"] for m in msgs)
    assert all("(3)" in m["world"] and "(2)" in m["world"] for m in msgs)
    xs, w0s, w1s, ids, weights = make_world(2, 4, [3, 3], 2, seed=3, drop=0.0)
    sim = ref.moe_sim(xs, w0s, w1s, ids, weights, 4)
    assert all(torch.equal(res[r][1], sim[r]) for r in range(2))


# --------------------------------------------------------------------------------------------------
# The multi-process helper itself
# --------------------------------------------------------------------------------------------------


def _helper_body(rank, world, scale, offset=0, mode="ok"):
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    if mode == "raise" and rank == 1:
        raise KeyError("boom from rank 1")
    if mode == "hang" and rank == 0:
        time.sleep(3600)
    if mode == "die" and rank == 1:
        os._exit(3)
    if mode != "ok":
        dist.barrier()  # the healthy rank waits for the broken one in a collective
    return (rank, world, float(t) * scale + offset, torch.arange(rank))


def test_run_ranks_returns_results_by_rank():
    res = run_ranks(_helper_body, 3, 2.0, offset=1, timeout=60)
    assert [(r[0], r[1], r[2]) for r in res] == [(r, 3, 7.0) for r in range(3)]
    assert [r[3].tolist() for r in res] == [[], [0], [0, 1]]


def test_run_ranks_propagates_exceptions_and_timeouts():
    with pytest.raises(RankError) as info:
        run_ranks(_helper_body, 2, 1.0, mode="raise", timeout=60)
    assert info.value.rank == 1 and "boom from rank 1" in str(info.value)
    assert "KeyError" in str(info.value)
    start = time.monotonic()
    with pytest.raises(RankTimeout):
        run_ranks(_helper_body, 2, 1.0, mode="hang", timeout=6)
    assert time.monotonic() - start < 20
    with pytest.raises(RankError) as info:
        run_ranks(_helper_body, 2, 1.0, mode="die", timeout=60)
    assert info.value.rank == 1 and "exited with code 3" in str(info.value)


# --------------------------------------------------------------------------------------------------
# (4) route() and swiglu()
# --------------------------------------------------------------------------------------------------


def _route_by_hand(logits, k, renorm):
    """The softmax-top-k router from its definition, in fp64 Python (not the torch.softmax /
    torch.topk calls route() makes): weights [T, k] float32 and ids [T, k] int64, descending."""
    ws, idss = [], []
    for row in logits.double().tolist():
        top = max(row)
        ex = [math.exp(v - top) for v in row]
        probs = [v / sum(ex) for v in ex]
        ids = sorted(range(len(row)), key=lambda e: (-probs[e], e))[:k]
        w = [probs[e] for e in ids]
        if renorm:
            w = [v / sum(w) for v in w]
        ws.append(w)
        idss.append(ids)
    return (torch.tensor(ws, dtype=torch.float32).reshape(len(ws), k),
            torch.tensor(idss, dtype=torch.int64).reshape(len(idss), k))


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 6), E=st.integers(1, 9), data=st.data(), renorm=st.booleans())
def test_route_properties(T, E, data, renorm):
    k = data.draw(st.integers(1, E))
    seed = data.draw(st.integers(0, 2**16))
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 3
    w, ids = ref.route(logits, k, renormalize=renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.shape == (T, k) and ids.shape == (T, k)
    exp_w, exp_ids = _route_by_hand(logits, k, renorm)
    assert torch.equal(ids, exp_ids)
    if T:
        assert ((ids >= 0) & (ids < E)).all()
        assert all(len(set(row)) == k for row in ids.tolist())  # distinct experts per token
        assert (w[:, :-1] >= w[:, 1:]).all()  # descending
        assert (w >= 0).all()
    torch.testing.assert_close(w, exp_w, rtol=1e-5, atol=1e-7)
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(T), rtol=0, atol=1e-6)
    else:
        assert (w.sum(-1) <= 1 + 1e-6).all()


def test_route_low_precision_logits_and_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]], dtype=torch.bfloat16)
    w, ids = ref.route(logits, 2)
    assert w.dtype == torch.float32
    assert set(ids[0].tolist()) == {1, 2}
    assert torch.equal(ids, _route_by_hand(logits, 2, False)[1]) or ids[0].tolist() == [2, 1]
    torch.testing.assert_close(w[0, 0], w[0, 1])
    w1, ids1 = ref.route(torch.zeros(2, 4), 4, renormalize=True)
    torch.testing.assert_close(w1, torch.full((2, 4), 0.25))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    y = torch.randn(5, 8).to(dtype)
    out = ref.swiglu(y)
    assert out.dtype == dtype and out.shape == (5, 4)
    yf = y.float()
    expected = (yf[:, :4] * torch.sigmoid(yf[:, :4]) * yf[:, 4:]).to(dtype)
    torch.testing.assert_close(out, expected, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6)
    assert ref.swiglu(torch.zeros(0, 8, dtype=dtype)).shape == (0, 4)


# --------------------------------------------------------------------------------------------------
# (5) Bad input -> ValueError
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [6, 7, -2, 100])
def test_check_routing_names_bad_id(bad):
    ids = torch.tensor([[0, -1], [5, bad]])
    with pytest.raises(ValueError, match=rf"invalid expert id {bad}\b"):
        ref.check_routing(ids, 6)
    ids32 = ids.to(torch.int32)
    with pytest.raises(ValueError, match=str(bad)):
        ref.check_routing(ids32, 6)
    xs, w0s, w1s, _, weights = make_world(1, 6, [2], 2)
    with pytest.raises(ValueError, match=str(bad)):
        ref.layer0_sim(xs, w0s, [ids], 6)
    with pytest.raises(ValueError, match=str(bad)):
        ref.dispatch_rows([ids], 6, 0)


def test_check_routing_accepts_valid_and_rejects_non_integer():
    ref.check_routing(torch.tensor([[0, 5, -1]], dtype=torch.int32), 6)
    ref.check_routing(torch.zeros(0, 3, dtype=torch.int64), 6)
    with pytest.raises(ValueError):
        ref.check_routing(torch.tensor([[0.0, 1.0]]), 6)
    with pytest.raises(ValueError):
        ref.check_routing(torch.tensor([0, 1]), 6)  # not 2-D


def test_world_must_divide_experts():
    with pytest.raises(ValueError, match=r"\(6\).*\(4\)"):
        ref.check_world(6, 4)
    xs, w0s, w1s, ids, weights = make_world(2, 4, [2, 2], 2)
    with pytest.raises(ValueError, match=r"\(5\).*\(2\)"):
        ref.layer0_sim(xs, w0s, ids, 5)
    with pytest.raises(ValueError, match=r"\(5\).*\(2\)"):
        ref.dispatch_rows(ids, 5, 0)
    with pytest.raises(ValueError):
        ref.expert_rank(4, 4, 2)


def test_bad_shapes_and_dtypes():
    xs, w0s, w1s, ids, weights = make_world(2, 4, [3, 2], 2)
    with pytest.raises(ValueError):  # token count mismatch
        ref.layer0_sim([xs[0][:2], xs[1]], w0s, ids, 4)
    with pytest.raises(ValueError):  # wrong number of local experts
        ref.layer0_sim(xs, [w0s[0][:1], w0s[1]], ids, 4)
    with pytest.raises(ValueError):  # unsupported dtype
        ref.layer0_sim([x.to(torch.int32) for x in xs], w0s, ids, 4)
    with pytest.raises(ValueError):  # list lengths disagree with the world
        ref.layer0_sim(xs[:1], w0s, ids, 4)
    y0 = ref.layer0_sim(xs, w0s, ids, 4)
    hs = [ref.swiglu(y) for y in y0]
    with pytest.raises(ValueError):  # h rows != M_d
        ref.layer1_sim([hs[0][1:], hs[1]], w1s, weights, ids, 4)
    with pytest.raises(ValueError):  # weights shape != ids shape
        ref.layer1_sim(hs, w1s, [weights[0][:, :1], weights[1]], ids, 4)
    with pytest.raises(ValueError):
        ref.swiglu(torch.zeros(2, 5))
    with pytest.raises(ValueError):
        ref.route(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError):
        ref.route(torch.zeros(2, 4), 0)
