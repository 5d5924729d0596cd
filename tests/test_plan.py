"""comet.plan: Placement and its replica rule, ExpertLoad, the Lysi planners, balance, and the
cost model's per-rank rows under skew (pure Python / torch on the CPU, fast)."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comet.tune import perfmodel as pm
from comet.plan import (ExpertLoad, Placement, balance, choose_replica, group_objective,
                        lysi_assign, lysi_assign_visits, lysi_group, parse_skew, route_table,
                        zipf_loads)
from comet.plan import skew


# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------

@st.composite
def placements(draw, max_world=6, max_experts=10):
    W = draw(st.integers(1, max_world))
    E = draw(st.integers(1, max_experts))
    ranks = [draw(st.sets(st.integers(0, W - 1), min_size=1, max_size=W)) for _ in range(E)]
    return Placement([sorted(r, reverse=True) for r in ranks], world=W)


@pytest.mark.parametrize("ranks, world, message", [
    ([[0], []], None, "expert 1 has no replica"),
    ([[0], [4]], 4, "expert 1: rank 4 is out of range for world=4"),
    ([[0], [-1]], None, "expert 1: rank -1 is negative"),
    ([[0, 1, 0]], None, "expert 0: rank 0 is listed twice"),
    ([], None, "expert_ranks is empty"),
    ([[0]], 0, "world must be >= 1, got 0"),
])
def test_placement_rejects_bad_input_naming_the_value(ranks, world, message):
    with pytest.raises(ValueError, match=message):
        Placement(ranks, world=world)


@settings(max_examples=100, deadline=None)
@given(placements(), st.data())
def test_placement_names_the_first_bad_expert_and_value(p, data):
    ranks = [list(r) for r in p.expert_ranks]
    e = data.draw(st.integers(0, len(ranks) - 1))
    flaw = data.draw(st.sampled_from(["empty", "high", "negative", "twice"]))
    if flaw == "empty":
        ranks[e] = []
        message = f"expert {e} has no replica"
    elif flaw == "high":
        bad = data.draw(st.integers(p.world, p.world + 5))
        ranks[e] = ranks[e] + [bad]
        message = f"expert {e}: rank {bad} is out of range for world={p.world}"
    elif flaw == "negative":
        bad = data.draw(st.integers(-5, -1))
        ranks[e] = [bad] + ranks[e]
        message = f"expert {e}: rank {bad} is negative"
    else:
        ranks[e] = ranks[e] + ranks[e][:1]
        message = f"expert {e}: rank {ranks[e][0]} is listed twice"
    with pytest.raises(ValueError) as err:
        Placement(ranks, world=p.world)
    assert str(err.value).startswith(message)


def test_placement_rejects_non_integer_ranks():
    with pytest.raises(TypeError, match="expert 0's rank must be an integer, got 1.5"):
        Placement([[1.5]])
    with pytest.raises(TypeError, match="expert 0: expected a list of ranks"):
        Placement([3])


@pytest.mark.parametrize("E, W", [(8, 8), (64, 8), (16, 4), (6, 3), (5, 1)])
def test_contiguous_is_todays_map(E, W):
    p = Placement.contiguous(E, W)
    assert p.expert_ranks == tuple((e // (E // W),) for e in range(E))
    assert p.slots() == (E // W,) * W
    assert p.is_contiguous()
    for r in range(W):
        assert p.local_experts(r) == tuple(range(r * E // W, (r + 1) * E // W))
    with pytest.raises(ValueError, match="W=3 >= 1 dividing E=8"):
        Placement.contiguous(8, 3)


@settings(max_examples=100, deadline=None)
@given(placements())
def test_local_slots_are_the_replicas_in_ascending_expert_order(p):
    for r in range(p.world):
        local = p.local_experts(r)
        assert list(local) == sorted(local)
        assert set(local) == {e for e in range(p.num_experts) if r in p.replicas(e)}
    assert sum(p.slots()) == sum(len(r) for r in p.expert_ranks)
    assert all(len(r) >= 1 for r in p.expert_ranks)
    assert Placement([list(r) for r in p.expert_ranks], world=p.world) == p


@settings(max_examples=100, deadline=None)
@given(placements(max_world=8), st.data())
def test_replica_rule_own_rank_then_node_then_spread(p, data):
    divisors = [d for d in range(1, p.world + 1) if p.world % d == 0]
    P = data.draw(st.sampled_from(divisors))
    table = route_table(p, P)
    assert table == route_table(p, P)  # deterministic
    for e in range(p.num_experts):
        reps = p.replicas(e)
        for s in range(p.world):
            r = table[s][e]
            assert r == choose_replica(p, e, s, P)
            assert r in reps
            if s in reps:
                assert r == s
            elif any(x // P == s // P for x in reps):
                assert r // P == s // P
        # sources of one tier are dealt evenly to that tier's replicas
        tiers = {}
        for s in range(p.world):
            if s in reps:
                continue
            near = tuple(x for x in reps if x // P == s // P)
            # a tier: the sources of one node served by its replicas, or all the sources whose
            # node has none, served by every replica
            key = (s // P, near) if near else (None, tuple(reps))
            tiers.setdefault(key, []).append(table[s][e])
        for (_, cands), chosen in tiers.items():
            counts = [chosen.count(c) for c in cands]
            assert max(counts) - min(counts) <= 1, (p, P, e, cands, chosen)


def _replica_by_the_rule(expert_ranks, world, P, e, s):
    """docs/placement.md's replica rule, restated from its text (not from comet.plan): the replica
    of expert e that serves source rank s, with ranks_per_node P."""
    reps = sorted(expert_ranks[e])
    if s in reps:                                       # 1. the source itself
        return s
    near = [r for r in reps if r // P == s // P]
    if near:                                            # 2. its node's replicas, dealt in turn to
        tier = [x for x in range(world)                 #    the node's sources without one
                if x // P == s // P and x not in reps]
        cands = near
    else:                                               # 3. every replica, dealt to the sources
        tier = [x for x in range(world)                 #    whose node holds none
                if x not in reps and not any(r // P == x // P for r in reps)]
        cands = reps
    i = tier.index(s)                                   # ascending rank order, from offset e
    return cands[(i + e) % len(cands)]


@settings(max_examples=150, deadline=None)
@given(placements(max_world=8), st.data())
def test_replica_rule_per_source_and_expert(p, data):
    """route_table and choose_replica give, for every source and expert, the replica the rule as
    docs/placement.md states it names."""
    P = data.draw(st.sampled_from([d for d in range(1, p.world + 1) if p.world % d == 0]))
    table = route_table(p, P)
    for e in range(p.num_experts):
        for s in range(p.world):
            want = _replica_by_the_rule(p.expert_ranks, p.world, P, e, s)
            assert table[s][e] == want, (p, P, e, s)
            assert choose_replica(p, e, s, P) == want


def test_replica_rule_on_hand_made_placements():
    """Tables worked out by hand from the rule."""
    p = Placement([[0, 1], [2], [3], [1, 3]])
    # one node: experts 1 and 2 have one replica; expert 0's sources 2, 3 take replicas 0, 1 from
    # offset 0; expert 3's sources 0, 2 take replicas 1, 3 from offset 3 % 2 = 1
    assert route_table(p) == [[0, 2, 3, 3], [1, 2, 3, 1], [0, 2, 3, 1], [1, 2, 3, 3]]
    # two nodes of 2: expert 0 has no replica on node 1, so node 1's sources 2, 3 share both
    # replicas; expert 3 has one on each node, so every source stays on its node
    assert route_table(p, 2) == [[0, 2, 3, 1], [1, 2, 3, 1], [0, 2, 3, 3], [1, 2, 3, 3]]
    # offset e: expert 1's three sources on replicas (0, 4) start at 1 % 2
    q = Placement([[4], [0, 4], [1]], world=6)
    assert [route_table(q)[s][1] for s in range(6)] == [0, 4, 0, 4, 4, 0]
    # two nodes of 3: sources 1, 2 use node 0's replica 0, sources 3 and 5 node 1's replica 4
    assert [route_table(q, 3)[s][1] for s in range(6)] == [0, 0, 0, 4, 4, 4]
    # three nodes of 3, both replicas on node 0: nodes 1 and 2 hold none, so their six sources are
    # one tier dealt across both nodes (source 6 is its 4th: replica 1), not a tier per node
    r = Placement([[0, 1]], world=9)
    assert [route_table(r, 3)[s][0] for s in range(9)] == [0, 1, 0, 0, 1, 0, 1, 0, 1]


def test_replica_rule_checks_its_arguments():
    p = Placement([[0, 1], [2]], world=4)
    with pytest.raises(ValueError, match="expert 2 is out of range for E=2"):
        choose_replica(p, 2, 0)
    with pytest.raises(ValueError, match="rank 4 is out of range for world=4"):
        choose_replica(p, 0, 4)
    with pytest.raises(ValueError, match="ranks_per_node=3 must be >= 1 and divide world=4"):
        choose_replica(p, 0, 0, 3)


def test_for_world_completes_a_placement_built_without_world():
    p = Placement([[0], [1, 0], [0]])                  # world inferred: 2
    assert p.world == 2 and not p.explicit_world and p.for_world(2) is p
    q = p.for_world(4)
    assert q == Placement([[0], [0, 1], [0]], world=4) and q.explicit_world
    assert q.expert_ranks == p.expert_ranks and q.slots() == (3, 1, 0, 0)
    assert q.local_experts(3) == () and q.for_world(4) is q
    assert route_table(q) == route_table(Placement([[0], [0, 1], [0]], world=4))
    with pytest.raises(ValueError, match=r"^the placement is for world=2 \(expert 1 is on rank 1\) "
                                         r"but the group has 1 ranks$"):
        p.for_world(1)
    with pytest.raises(ValueError,
                       match="^the placement is for world=4 but the group has 5 ranks$"):
        q.for_world(5)
    with pytest.raises(ValueError,
                       match="^the placement is for world=4 but the group has 3 ranks$"):
        Placement([[0]], world=4).for_world(3)
    assert Placement.contiguous(4, 2).explicit_world
    with pytest.raises(ValueError, match="for world=2 but the group has 4 ranks"):
        Placement.contiguous(4, 2).for_world(4)
    # equality is the map and the world; repr says which (and rebuilds the same kind)
    assert p == Placement([[0], [0, 1], [0]], world=2)
    assert repr(p) == "Placement([[0], [0, 1], [0]])"
    assert repr(q) == "Placement([[0], [0, 1], [0]], world=4)"
    for x in (p, q):
        y = eval(repr(x), {"Placement": Placement})
        assert y == x and y.explicit_world == x.explicit_world


@settings(max_examples=100, deadline=None)
@given(placements(), st.integers(0, 4))
def test_for_world_adds_ranks_holding_nothing(p, extra):
    """The map alone (no world=) completed to any group at least its size: the same map, the
    ranks past the largest it names hold nothing, and the replica rule is the explicit world's."""
    bare = Placement([list(r) for r in p.expert_ranks])
    W = bare.world + extra
    q = bare.for_world(W)
    assert q == Placement([list(r) for r in p.expert_ranks], world=W) and q.world == W
    assert all(q.local_experts(r) == () for r in range(bare.world, W))
    assert all(q.local_experts(r) == bare.local_experts(r) for r in range(bare.world))
    assert route_table(q) == route_table(Placement(p.expert_ranks, world=W))
    assert p.for_world(p.world) is p  # built with world=: that group only
    with pytest.raises(ValueError, match=f"for world={p.world} but the group has"):
        p.for_world(p.world + 1 + extra)


def test_rank_shapes_complete_a_placement_built_without_world():
    shape = pm.MoEShape(W=4, E=4, k=2, H=256, N=512, T=1024)
    loads = [4.0, 2.0, 1.0, 1.0]
    bare = Placement([[0], [1], [0, 1], [2]])          # rank 3 holds nothing
    assert skew.rank_shapes(shape, 0, bare, loads) == \
        skew.rank_shapes(shape, 0, Placement(bare.expert_ranks, world=4), loads)
    with pytest.raises(ValueError, match="placement is for W=3"):
        skew.rank_shapes(shape, 0, Placement(bare.expert_ranks, world=3), loads)


# ---------------------------------------------------------------------------------------------
# Loads
# ---------------------------------------------------------------------------------------------

def test_expert_load_counts_slots_and_ignores_dropped():
    load = ExpertLoad(4)
    load.update(torch.tensor([[0, 1], [1, -1], [3, 1]]))
    load.update(torch.tensor([2, -1, -1], dtype=torch.int32))
    assert load.loads() == [1.0, 3.0, 1.0, 1.0]
    assert load.steps == 2
    load.reset()
    assert load.loads() == [0.0] * 4 and load.steps == 0
    decayed = ExpertLoad(2, decay=0.5)
    decayed.update(torch.tensor([0, 0]))
    decayed.update(torch.tensor([1]))
    assert decayed.loads() == [1.0, 1.0]


def test_expert_load_rejects_bad_ids():
    load = ExpertLoad(4)
    with pytest.raises(ValueError, match="expert id 4, outside"):
        load.update(torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="expert id -2, outside"):
        load.update(torch.tensor([-2, 1]))
    with pytest.raises(TypeError, match="integer tensor"):
        load.update(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="decay must be in"):
        ExpertLoad(4, decay=0.0)


@pytest.mark.parametrize("E, s", [(8, 1.0), (64, 1.2), (16, 1.5), (5, 0.0)])
def test_zipf_loads(E, s):
    loads = zipf_loads(E, s, total=100.0)
    assert math.isclose(sum(loads), 100.0)
    ordered = sorted(loads, reverse=True)
    for i in range(1, E):
        assert math.isclose(ordered[i] / ordered[0], 1.0 / (i + 1) ** s)
    assert zipf_loads(E, s, seed=None) == sorted(zipf_loads(E, s, seed=None), reverse=True)
    assert zipf_loads(E, s) == zipf_loads(E, s)


def test_parse_skew():
    assert parse_skew("zipf:1.2") == 1.2
    for bad in ("zipf", "zipf:x", "uniform:1", "zipf:-1"):
        with pytest.raises(ValueError, match="zipf"):
            parse_skew(bad)


# ---------------------------------------------------------------------------------------------
# Planners
# ---------------------------------------------------------------------------------------------

@st.composite
def assign_problems(draw):
    """(flops, integer loads, memory slots that can hold every expert)."""
    loads = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=24))
    flops = draw(st.lists(st.integers(1, 8), min_size=1, max_size=8))
    W, E = len(flops), len(loads)
    slots = draw(st.lists(st.integers(0, E), min_size=W, max_size=W).filter(lambda m: sum(m) >= E))
    return flops, loads, slots


@settings(max_examples=150, deadline=None)
@given(assign_problems())
def test_lysi_assign_places_every_expert_within_memory(problem):
    flops, loads, slots = problem
    W, E = len(flops), len(loads)
    p = lysi_assign(flops, loads, slots)
    assert p == lysi_assign(flops, loads, slots)  # deterministic
    assert p.world == W and p.num_experts == E
    assert all(len(r) == 1 for r in p.expert_ranks)  # one replica each
    assert all(n <= m for n, m in zip(p.slots(), slots))


@settings(max_examples=150, deadline=None)
@given(assign_problems())
def test_lysi_assign_visits_keep_their_flops_share(problem):
    flops, loads, slots = problem
    W, E = len(flops), len(loads)
    visits = lysi_assign_visits(flops, loads, slots)
    placed = [x for _, _, xs in visits for x in xs]
    assert sorted(placed) == list(range(E))
    left = {j for j in range(W) if slots[j] > 0}
    held = list(slots)
    for j, budget, xs in visits:
        assert xs, "every visit makes progress"
        assert held[j] >= len(xs)
        # the budget is the worker's FLOPS share of all experts' cost among the workers left
        share = flops[j] * sum(loads) / sum(flops[i] for i in left)
        assert math.isclose(budget, share, rel_tol=1e-12, abs_tol=1e-12)
        held[j] -= len(xs)
        if held[j] == 0:
            left.discard(j)
        # a visit takes at most its budget, or a single expert when none fits
        assert sum(loads[x] for x in xs) <= budget * (1 + 1e-12) or len(xs) == 1
    p = lysi_assign(flops, loads, slots)
    assert all(len(p.local_experts(j)) == slots[j] - held[j] for j in range(W))


def test_lysi_assign_follows_flops():
    # a worker twice as fast gets about twice the compute
    p = lysi_assign([2, 1], [10] * 12, 12)
    assert p.slots() == (8, 4)
    with pytest.raises(ValueError, match="slots hold 3 experts in all, fewer than the 4"):
        lysi_assign([1, 1], [1] * 4, [2, 1])
    with pytest.raises(ValueError, match=r"flops\[1\] = 0.0"):
        lysi_assign([1, 0], [1] * 4, 4)


def _two_nodes(W=4, P=2):
    """NVLink-like links inside a node (1 us, 100 GB/s), NIC-like across (100 us, 1 GB/s)."""
    def link(near, far):
        return [[0.0 if i == j else (near if i // P == j // P else far) for j in range(W)]
                for i in range(W)]
    return link(1e-6, 1e-4), link(1e-11, 1e-9)


def test_lysi_group_keeps_nodes_apart_when_links_are_slow():
    a, b = _two_nodes()
    # each node can hold all 4 experts and compute is cheap: crossing the slow link does not pay
    groups = lysi_group(a, b, [1e12] * 4, [1e3] * 4, 2, d=1e6)
    assert groups == [[0, 1], [2, 3]]
    inside = group_objective([0, 1], 2, a, b, [1e12] * 4, [1e3] * 4, 2, d=1e6)
    across = group_objective([0, 1, 2, 3], 1, a, b, [1e12] * 4, [1e3] * 4, 2, d=1e6)
    assert inside < across
    # compute-heavy experts: the union's FLOPS win over the slow link, one group
    assert lysi_group(a, b, [1e12] * 4, [1e10] * 4, 2, d=1e6) == [[0, 1, 2, 3]]
    # a rank holds only one expert: single workers are infeasible (T = inf) and merge
    assert math.isinf(group_objective([0], 4, a, b, [1e12] * 4, [1e3] * 4, 1, d=1e6))
    assert lysi_group(a, b, [1e12] * 4, [1e3] * 4, 1, d=1e6) == [[0, 1, 2, 3]]


def _objective_by_hand(group, n_groups, alpha, beta, flops, loads, slots, d, d_ar=0.0):
    """T(g) with eta = gamma = 1, as comet/plan/lysi.py's module doc writes it (the paper's
    equations 3 and 4), restated here: inf without memory for every expert, else the group's
    compute, its busiest worker's links, and the all-reduce across the groups."""
    if sum(slots[j] for j in group) < len(loads):
        return math.inf
    pairs = [(i, j) for i in range(len(flops)) for j in range(len(flops)) if i != j]
    a_star = max((alpha[i][j] for i, j in pairs), default=0.0)
    b_star = max((beta[i][j] for i, j in pairs), default=0.0)
    compute = sum(loads) / sum(flops[j] for j in group)
    links = max(sum(alpha[i][j] + d / len(group) * beta[i][j] for j in group if j != i)
                for i in group)
    return compute + links + 2 * (n_groups - 1) * (a_star + d_ar * b_star / n_groups)


def _merges_by_the_rule(alpha, beta, flops, loads, slots, d, d_ar=0.0):
    """Two workers, one edge: LysiGroup merges them when the union (one group) beats each worker
    alone (two groups), a worker without memory for every expert (T = inf) counting as beaten."""
    t0, t1 = (_objective_by_hand([j], 2, alpha, beta, flops, loads, slots, d, d_ar)
              for j in (0, 1))
    t01 = _objective_by_hand([0, 1], 1, alpha, beta, flops, loads, slots, d, d_ar)
    return (t0 == math.inf or t01 < t0) and (t1 == math.inf or t01 < t1)


def _link(x):
    return [[0.0, x], [x, 0.0]]


# Two workers, latency 1 s on their link (so a worker alone pays 2 (|G| - 1) alpha* = 2 s of
# all-reduce), one expert of cost 2 unless given: T(one worker) = 2 / F + 2, T(both) =
# 2 / (F0 + F1) + 1 + d / 2 * beta, each worked out by hand.
LYSI_MERGE_CASES = {
    # T(0) = T(1) = 4 > T(both) = 2
    "merge-union-halves-compute": (dict(flops=[1, 1], beta=0.0, d=0.0), True, (4.0, 2.0)),
    # T(both) = 1 + 1 + 5 = 7 > 4: the bytes on the link cost more than the union saves
    "apart-link-too-slow": (dict(flops=[1, 1], beta=1.0, d=10.0), False, (4.0, 7.0)),
    # T(0) = 4 / 4 + 2 = 3, T(1) = 4 + 2 = 6, T(both) = 0.8 + 1 + 3 = 4.8: beats worker 1 only
    "apart-union-beats-one-side-only": (dict(flops=[4, 1], loads=[4.0], beta=1.0, d=6.0), False,
                                        (3.0, 4.8)),
    # T(both) = 1 + 1 + 2 = 4 = T(0) = T(1): a tie is not a win
    "apart-tie": (dict(flops=[1, 1], beta=1.0, d=4.0), False, (4.0, 4.0)),
    # neither worker holds both experts (T = inf): they merge, whatever the union costs
    "merge-both-sides-infeasible": (dict(flops=[1, 1], loads=[1.0, 1.0], slots=[1, 1], beta=1.0,
                                         d=1e6), True, (math.inf, None)),
    # worker 1 holds nothing (T = inf, beaten), worker 0 alone: T = 2 + 2 = 4 < T(both) = 7
    "apart-feasible-side-beats-union": (dict(flops=[1, 1], slots=[1, 0], beta=1.0, d=10.0),
                                        False, (4.0, 7.0)),
}


@pytest.mark.parametrize("case", list(LYSI_MERGE_CASES))
def test_lysi_group_merges_only_when_the_union_beats_both_sides(case):
    kw, merges, (t_alone, t_union) = LYSI_MERGE_CASES[case]
    flops, loads, slots = kw["flops"], kw.get("loads", [2.0]), kw.get("slots", [1, 1])
    alpha, beta, d = _link(1.0), _link(kw["beta"]), kw["d"]
    assert _merges_by_the_rule(alpha, beta, flops, loads, slots, d) == merges  # the worked case
    assert _objective_by_hand([0], 2, alpha, beta, flops, loads, slots, d) == t_alone
    assert group_objective([0], 2, alpha, beta, flops, loads, slots, d=d) == t_alone
    if t_union is not None:
        assert _objective_by_hand([0, 1], 1, alpha, beta, flops, loads, slots, d) == t_union
        assert group_objective([0, 1], 1, alpha, beta, flops, loads, slots, d=d) == t_union
    groups = lysi_group(alpha, beta, flops, loads, slots, d=d)
    assert groups == ([[0, 1]] if merges else [[0], [1]])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=2, max_size=2),
       st.lists(st.integers(0, 50), min_size=1, max_size=4),
       st.lists(st.integers(0, 4), min_size=2, max_size=2),
       st.integers(0, 4), st.integers(0, 4), st.integers(0, 20), st.integers(0, 20))
def test_lysi_group_decision_on_two_workers_is_the_objectives(flops, loads, slots, a, b, d, d_ar):
    """Every two-worker instance (small integers: the objectives compare exactly or nearly so):
    merged exactly when the union's T beats both workers' (as restated above)."""
    alpha, beta = _link(float(a)), _link(b / 8)
    groups = lysi_group(alpha, beta, flops, loads, slots, d=float(d), d_ar=float(d_ar))
    merges = _merges_by_the_rule(alpha, beta, flops, loads, slots, float(d), float(d_ar))
    assert groups == ([[0, 1]] if merges else [[0], [1]]), (flops, loads, slots, a, b, d, d_ar)
    for g, n in (([0], 2), ([1], 2), ([0, 1], 1)):
        want = _objective_by_hand(g, n, alpha, beta, flops, loads, slots, float(d), float(d_ar))
        got = group_objective(g, n, alpha, beta, flops, loads, slots, d=float(d), d_ar=float(d_ar))
        assert got == want or math.isclose(got, want, rel_tol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 100), min_size=1, max_size=8), st.data())
def test_lysi_group_partitions_the_workers_deterministically(W, loads, data):
    lat = st.floats(1e-7, 1e-4)
    a = [[data.draw(lat) for _ in range(W)] for _ in range(W)]
    b = [[data.draw(st.floats(0, 1e-9)) for _ in range(W)] for _ in range(W)]
    slots = data.draw(st.lists(st.integers(0, 4), min_size=W, max_size=W))
    flops = data.draw(st.lists(st.floats(1e9, 1e12), min_size=W, max_size=W))
    groups = lysi_group(a, b, flops, loads, slots, d=1e6, d_ar=1e6)
    assert sorted(w for g in groups for w in g) == list(range(W))
    assert groups == lysi_group(a, b, flops, loads, slots, d=1e6, d_ar=1e6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=1, max_size=20), st.integers(1, 6), st.data())
def test_balance_places_every_expert_within_slots(loads, W, data):
    E = len(loads)
    S = data.draw(st.integers(-(-E // W), -(-E // W) + 3))
    p = balance(loads, W, S)
    assert p == balance(loads, W, S)
    assert p.num_experts == E and p.world == W
    assert all(n <= S for n in p.slots())
    assert all(len(r) >= 1 for r in p.expert_ranks)  # Placement checks it, too
    # spare slots become replicas, at most one per rank per expert
    assert sum(p.slots()) == min(W * S, E * W)


def _fits_by_brute_force(demands, free):
    """Whether every expert i can get demands[i] distinct ranks, rank r holding at most free[r] of
    them: try every choice of ranks, expert by expert."""
    if not demands:
        return True
    first, rest = demands[0], demands[1:]
    for ranks in itertools.combinations(range(len(free)), first):
        if all(free[r] > 0 for r in ranks):
            left = [f - (r in ranks) for r, f in enumerate(free)]
            if _fits_by_brute_force(rest, left):
                return True
    return False


def test_balance_feasibility_check_is_the_brute_forces():
    """balance's Gale-Ryser check (which keeps later experts room for all their replicas) against
    an exhaustive search, on every instance of up to 4 ranks with 0-3 free slots each and up to 4
    experts needing 1-4 ranks each (unsorted)."""
    from comet.plan.balance import _fits

    checked = 0
    for W in range(1, 5):
        for free in itertools.product(range(4), repeat=W):
            for n in range(0, 5):
                for demands in itertools.combinations_with_replacement(range(1, 5), n):
                    demands = list(demands)[::-1] if n % 2 else list(demands)
                    want = _fits_by_brute_force(demands, list(free))
                    assert _fits(demands, list(free)) == want, (demands, free)
                    checked += 1
    assert checked > 20000


def _max_over_mean(p, loads, k=2, T=1024):
    rows = [r.rows for r in skew.rank_rows(p, loads, T, k)]
    return max(rows) / (sum(rows) / len(rows))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(8, 8, 2), (16, 8, 2), (64, 8, 4), (32, 4, 4)]),
       st.floats(0.8, 2.0), st.integers(0, 1000))
def test_balance_with_a_spare_slot_beats_the_contiguous_map_under_zipf(dims, s, seed):
    E, W, k = dims
    loads = zipf_loads(E, s, seed=seed)
    shares = skew.slot_shares(loads, k)
    planned = balance(shares, W, E // W + 1)
    contiguous = Placement.contiguous(E, W)
    assert _max_over_mean(planned, loads, k) <= _max_over_mean(contiguous, loads, k) + 1e-9


def test_balance_rejects_too_few_slots():
    with pytest.raises(ValueError, match="2 ranks x 1 slots = 2 slots cannot hold E=3"):
        balance([1, 1, 1], 2, 1)


# ---------------------------------------------------------------------------------------------
# Cost model under skew
# ---------------------------------------------------------------------------------------------

PAPER = [(8, 2, 4096, 14336), (64, 4, 2048, 1408), (16, 2, 4096, 6400)]


@pytest.mark.parametrize("E, k, H, ffn", PAPER)
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("ranks_per_node, node_reduce", [(8, False), (4, False), (4, True)])
def test_uniform_contiguous_reproduces_the_uniform_model(E, k, H, ffn, layer, ranks_per_node,
                                                        node_reduce):
    spec = pm.get_spec("h800")
    shape = pm.MoEShape(W=8, E=E, k=k, H=H, N=2 * ffn if layer == 0 else ffn, T=4096,
                        ranks_per_node=ranks_per_node, node_reduce=node_reduce)
    shapes = skew.rank_shapes(shape, layer, Placement.contiguous(E, 8), [3.0] * E)
    n = pm.choose_n_comm(shape, spec, layer)
    assert skew.choose_n_comm_slowest(shapes, spec, layer) == n
    want = pm.predict(shape, spec, n, layer)
    got = skew.predict_slowest(shapes, spec, n, layer)
    for key in ("comm", "gemm", "fused", "baseline"):
        assert math.isclose(got[key], want[key], rel_tol=1e-12), key
    assert math.isclose(got["rows_max_over_mean"], 1.0)


@settings(max_examples=60, deadline=None)
@given(placements(max_world=6, max_experts=12), st.integers(1, 4), st.data())
def test_rank_rows_conserve_every_slot(p, k, data):
    k = min(k, p.num_experts)
    loads = data.draw(st.lists(st.floats(0.01, 10), min_size=p.num_experts,
                               max_size=p.num_experts))
    T = 100
    rr = skew.rank_rows(p, loads, T, k)
    assert math.isclose(sum(r.rows for r in rr), p.world * T * k, rel_tol=1e-9)
    shares = skew.slot_shares(loads, k)
    assert math.isclose(sum(shares), 1.0) and max(shares) <= 1 / k + 1e-12
    for r in rr:
        assert len(r.slot_rows) == len(p.local_experts(rr.index(r)))
        assert 0 <= r.received <= r.rows + 1e-9
        assert 0 <= r.partials_sent <= T * (p.world - 1) + 1e-9


def test_skew_prices_the_slowest_rank():
    spec = pm.get_spec("h800")
    shape = pm.MoEShape(W=8, E=64, k=4, H=2048, N=2816, T=4096)
    loads = zipf_loads(64, 1.2)
    slow = skew.rank_shapes(shape, 0, Placement.contiguous(64, 8), loads)
    even = skew.rank_shapes(shape, 0, balance(skew.slot_shares(loads, 4), 8, 9), loads)
    n = pm.choose_n_comm(shape, spec, 0)
    uniform = pm.predict(shape, spec, n, 0)["fused"]
    t_slow = skew.predict_slowest(slow, spec, n, 0)
    t_even = skew.predict_slowest(even, spec, n, 0)
    assert t_slow["fused"] > 2 * uniform and t_even["fused"] < 1.25 * uniform
    assert t_slow["rows_max_over_mean"] > 2 > 1.25 > t_even["rows_max_over_mean"]


def test_tune_cli_prices_the_slowest_rank_under_skew(capsys, monkeypatch, tmp_path):
    from comet.tune import cli as cli

    monkeypatch.setenv("COMET_CACHE_DIR", str(tmp_path))
    small = ["--model", "custom", "--hidden", "1024", "--ffn", "512", "--experts", "16",
             "--topk", "2", "--gpu", "h800", "--sm-count", "16", "--no-profile"]
    two_nodes = ["--world", "4", "--ranks-per-node", "2", "--spare-slots", "2"]
    for extra in (["--world", "8"], two_nodes):
        assert cli.main(small + extra + ["--skew", "zipf:1.2"]) == 0
        out = capsys.readouterr().out
        assert "Zipf s=1.2" in out
        rows = {line.split()[0]: line.split() for line in out.splitlines()
                if line.split() and line.split()[0] in ("contiguous", "balance", "lysi_assign")}
        assert set(rows) == {"contiguous", "balance", "lysi_assign"}
        # cells: placement, max/mean rows, n_comm "a / b" (3 words), layer0, layer1, layer ms
        assert float(rows["balance"][1]) < float(rows["contiguous"][1])
        assert float(rows["balance"][7]) < float(rows["contiguous"][7])
    for bad in ("zipf:x", "pareto:1"):
        with pytest.raises(SystemExit):
            cli.main(small + ["--world", "8", "--skew", bad])


def test_lysi_group_on_the_cost_models_links():
    # 2 nodes of 4 H800, Mixtral's 8 experts (2 slots per rank: one node holds them all). In the
    # paper's objective a group computes all experts, so more workers divide the compute; the
    # NIC is worth crossing unless a worker's bytes per call make its links slower than that
    spec = pm.get_spec("h800")
    alpha, beta = skew.link_matrices(spec, 8, 4)
    assert alpha[0][1] == spec.alpha and alpha[0][4] == spec.nic_alpha
    assert beta[0][5] == 1 / spec.nic_bw and beta[2][2] == 0.0
    flops = [spec.peak_flops(2) * spec.gemm_eff] * 8
    f = [4096 * 2 * 6 * 4096 * 14336] * 8  # FLOPs per expert and call: rows x 2 x 3 GEMMs
    assert lysi_group(alpha, beta, flops, f, 2, d=4096 * 2 * 8192) == [list(range(8))]
    assert lysi_group(alpha, beta, flops, f, 2, d=1e9) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="ranks_per_node=3 must be >= 1 and divide world=8"):
        skew.link_matrices(spec, 8, 3)
