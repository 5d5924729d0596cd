"""Lysi's expert placement (the Aristos & Lysi paper): LysiGroup forms expert-parallel groups of
workers from an alpha-beta cost model, LysiAssign places the experts on the workers of a group.

Notation (the paper's Table 2): workers ``j`` with FLOP rate ``F_j`` (FLOP/s) and memory for
``m_j`` experts; experts ``x`` with compute cost ``f_x`` (FLOPs per step: the expert's load in
rows times the FLOPs per row, e.g. ``rows * 2 * 3 * H * ffn`` for a gated FFN forward); links
``(i, j)`` with latency ``alpha_ij`` (s) and inverse bandwidth ``beta_ij`` (s per byte).

The objective of a group ``g`` (workers ``V_g``, every pair of them an edge of ``E_g``), with
``|G|`` groups in all (paper, equations 3 and 4)::

    T(g) = inf                                              if sum_{j in V_g} m_j < |X|
    T(g) = gamma * ( sum_x f_x / sum_{j in V_g} F_j
                     + max_{i in V_g} sum_{j in V_g, j != i} eta (alpha_ij + d / |V_g| beta_ij) )
           + 2 (|G| - 1) * (alpha* + d_ar * beta* / |G|)    otherwise

``gamma`` (the paper's gamma(omega) >= 1): how often the layer runs per iteration; ``eta``: how
often an edge carries a message per layer call; ``d``: bytes a worker exchanges per layer call
(split over the group's ``|V_g|`` peers); ``d_ar``: bytes of the data-parallel all-reduce across
groups (0 for inference, where the paper drops T_rho); ``alpha*``, ``beta*``: the largest
``alpha_ij``, ``beta_ij`` over all pairs of distinct workers (our reading of the paper's "for all
a, b in G": the all-reduce across groups may cross any link).

Both algorithms are deterministic: every tie is broken by the lower worker / expert index.
"""

from __future__ import annotations

import bisect
import math
from typing import List, Sequence

from .placement import Placement

__all__ = ["lysi_group", "lysi_assign", "lysi_assign_visits", "group_objective"]


def _floats(values, what: str, positive: bool = False) -> List[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a sequence of numbers, got {values!r}") from None
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            need = "> 0" if positive else ">= 0"
            raise ValueError(f"{what}[{i}] = {v!r}; every entry must be finite and {need}")
    return out


def _slots(slots, workers: int) -> List[int]:
    if isinstance(slots, int) and not isinstance(slots, bool):
        slots = [slots] * workers
    out = list(slots)
    if len(out) != workers:
        raise ValueError(f"slots has {len(out)} entries for {workers} workers")
    for j, m in enumerate(out):
        if isinstance(m, bool) or int(m) != m or m < 0:
            raise ValueError(f"slots[{j}] = {m!r}; memory slots must be integers >= 0")
    return [int(m) for m in out]


def _matrix(m, n: int, what: str) -> List[List[float]]:
    rows = [list(r) for r in m]
    if len(rows) != n or any(len(r) != n for r in rows):
        raise ValueError(f"{what} must be a {n} x {n} matrix (one row and column per worker)")
    return [_floats(r, f"{what}[{i}]") for i, r in enumerate(rows)]


def lysi_assign(flops: Sequence[float], loads: Sequence[float], slots) -> Placement:
    """LysiAssign (the paper's Algorithm 3): place every expert on one worker of the group.

    ``flops[j]`` = ``F_j`` (> 0), ``loads[x]`` = ``f_x`` (>= 0, any unit: only ratios matter),
    ``slots`` = ``m_j`` per worker (or one int for all); ``sum(slots) >= len(loads)``.  Returns a
    :class:`Placement` over ``len(flops)`` ranks, one replica per expert.

    Workers are visited round-robin in descending ``F_j`` (ties: lower index).  A visit gets the
    budget ``F_j * sum_x f_x / sum_{i in W'} F_i`` (``W'``: the workers still in the
    round-robin; the paper rounds it up to a whole FLOP, left out here so that costs in any unit,
    e.g. load shares summing to 1, behave alike) and takes, while budget and memory last, the
    best fit: the costliest expert with ``f_x <= budget`` (ties: lower id).  When none fits, the
    visit ends, unless it has taken nothing yet: then it takes the cheapest expert left (so an
    expert costlier than every budget, or a zero-cost one, is placed too, and every visit makes
    progress).  A worker leaves the round-robin when its memory is full; the others wrap around
    until every expert is placed.  So every expert is placed, no worker holds more than ``m_j``
    experts, and a visit never takes more than its budget except for a single expert.
    """
    F = _floats(flops, "flops", positive=True)
    f = _floats(loads, "loads")
    expert_ranks: List[List[int]] = [[] for _ in f]
    for j, _budget, xs in lysi_assign_visits(F, f, slots):
        for x in xs:
            expert_ranks[x].append(j)
    return Placement(expert_ranks, world=len(F))


def lysi_assign_visits(flops: Sequence[float], loads: Sequence[float], slots):
    """:func:`lysi_assign`'s round-robin, one ``(worker, budget, experts taken)`` per visit (what
    the tests check the FLOPS-share rule on)."""
    F = _floats(flops, "flops", positive=True)
    f = _floats(loads, "loads")
    if not F:
        raise ValueError("flops is empty: need at least one worker")
    if not f:
        raise ValueError("loads is empty: need at least one expert")
    m = _slots(slots, len(F))
    if sum(m) < len(f):
        raise ValueError(f"slots hold {sum(m)} experts in all, fewer than the {len(f)} experts")
    order = sorted(range(len(F)), key=lambda j: (-F[j], j))
    active = [j for j in order if m[j] > 0]
    pool = sorted(range(len(f)), key=lambda x: (f[x], x))  # the paper's binary search structure B
    keys = [f[x] for x in pool]
    total = sum(f)
    visits = []
    pos = 0
    while pool:
        j = active[pos]
        budget = F[j] * total / sum(F[i] for i in active)
        left, taken = budget, []
        while m[j] > 0 and pool and (left > 0 or not taken):
            i = bisect.bisect_right(keys, left) - 1  # costliest f <= budget ...
            if i >= 0:
                i = bisect.bisect_left(keys, keys[i])  # ... of the lowest id among equal costs
            elif taken:
                break  # nothing fits: the visit ends
            else:
                i = 0  # nothing fits and nothing taken yet: the cheapest
            x = pool.pop(i)
            keys.pop(i)
            taken.append(x)
            left -= f[x]
            m[j] -= 1
        visits.append((j, budget, taken))
        if m[j] == 0:
            active.pop(pos)
            if active:
                pos %= len(active)
        else:
            pos = (pos + 1) % len(active)
    return visits


def group_objective(group: Sequence[int], n_groups: int, alpha, beta, flops, loads, slots, *,
                    d: float, eta: float = 1.0, d_ar: float = 0.0, gamma: float = 1.0) -> float:
    """``T(g)`` of the module doc for the workers ``group`` when there are ``n_groups`` groups."""
    W = len(flops)
    F = _floats(flops, "flops", positive=True)
    f = _floats(loads, "loads")
    m = _slots(slots, W)
    a, b = _matrix(alpha, W, "alpha"), _matrix(beta, W, "beta")
    return _objective(list(group), n_groups, a, b, F, f, m, _extremes(a, b), float(d), float(eta),
                      float(d_ar), float(gamma))


def _extremes(a, b):
    W = len(a)
    pairs = [(i, j) for i in range(W) for j in range(W) if i != j]
    return (max((a[i][j] for i, j in pairs), default=0.0),
            max((b[i][j] for i, j in pairs), default=0.0))


def _objective(g, n_groups, a, b, F, f, m, ext, d, eta, d_ar, gamma) -> float:
    if sum(m[j] for j in g) < len(f):
        return math.inf
    compute = sum(f) / sum(F[j] for j in g)
    comm = max(sum(eta * (a[i][j] + d / len(g) * b[i][j]) for j in g if j != i) for i in g)
    a_star, b_star = ext
    allreduce = 2 * (n_groups - 1) * (a_star + d_ar * b_star / n_groups)
    return gamma * (compute + comm) + allreduce


def lysi_group(alpha, beta, flops: Sequence[float], loads: Sequence[float], slots, *,
               d: float, eta: float = 1.0, d_ar: float = 0.0,
               gamma: float = 1.0) -> List[List[int]]:
    """LysiGroup (the paper's Algorithm 2): partition the workers into expert-parallel groups.

    ``alpha[i][j]`` (s), ``beta[i][j]`` (s/byte): the link between workers ``i`` and ``j``
    (``W x W``; only ``i != j`` is read); ``flops[j]`` = ``F_j``; ``loads[x]`` = ``f_x`` (FLOPs);
    ``slots`` = ``m_j``; ``d``, ``eta``, ``d_ar``, ``gamma`` as in the module doc, where ``T(g)``
    is written out.  Kruskal-like: start with every worker alone, visit the edges ``(u, v)`` in
    ascending ``alpha_uv + d * beta_uv`` (ties: lower ``(u, v)``), and merge the groups of ``u``
    and ``v`` when the union's objective (with one group fewer) beats each side's own objective,
    an infeasible side (``T = inf``: too little memory for all experts) counting as beaten.
    Returns the groups, each sorted, ordered by their lowest worker.
    """
    F = _floats(flops, "flops", positive=True)
    f = _floats(loads, "loads")
    W = len(F)
    if W == 0 or not f:
        raise ValueError("need at least one worker and one expert")
    m = _slots(slots, W)
    a, b = _matrix(alpha, W, "alpha"), _matrix(beta, W, "beta")
    for name, v in (("d", d), ("eta", eta), ("d_ar", d_ar)):
        if not (math.isfinite(float(v)) and float(v) >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    if not float(gamma) >= 1.0:
        raise ValueError(f"gamma must be >= 1 (the paper's gamma(omega)), got {gamma!r}")
    ext = _extremes(a, b)
    args = (a, b, F, f, m, ext, float(d), float(eta), float(d_ar), float(gamma))
    parent = list(range(W))
    members = {j: [j] for j in range(W)}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    edges = sorted((a[u][v] + float(d) * b[u][v], u, v)
                   for u in range(W) for v in range(u + 1, W))
    for _, u, v in edges:
        gu, gv = find(u), find(v)
        if gu == gv:
            continue
        n = len(members)
        t_u = _objective(members[gu], n, *args)
        t_v = _objective(members[gv], n, *args)
        t_uv = _objective(members[gu] + members[gv], n - 1, *args)
        if (t_u == math.inf or t_uv < t_u) and (t_v == math.inf or t_uv < t_v):
            keep, gone = min(gu, gv), max(gu, gv)
            parent[gone] = keep
            members[keep] = members[keep] + members.pop(gone)
    return sorted((sorted(g) for g in members.values()), key=lambda g: g[0])
