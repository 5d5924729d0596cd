"""EPLB-like balancing: replicate the hottest experts into spare slots, then pack the replicas."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from .lysi import _floats
from .placement import Placement, _check_rpn, _expert_routes

__all__ = ["balance"]


def _peak_share(replicas: int, world: int) -> float:
    """The largest share of an expert's rows that one of its ``replicas`` serves under the
    replica rule on one node: a holder serves its own rank's rows, the ``world - replicas``
    other sources are dealt out evenly, so the busiest replica serves
    ``1 + ceil((world - replicas) / replicas)`` of the ``world`` sources."""
    return (1 + math.ceil((world - replicas) / replicas)) / world


def _counts_by_mean(f: List[float], W: int, spare: int,
                    reps: Optional[List[int]] = None) -> List[int]:
    """Replica counts (from ``reps``, default one each): each spare slot to the expert with the
    most rows per replica."""
    reps = [1] * len(f) if reps is None else list(reps)
    for _ in range(spare):
        live = [e for e in range(len(f)) if reps[e] < W]
        if not live:
            break
        e = max(live, key=lambda x: (f[x] / reps[x], -x))
        reps[e] += 1
    return reps


def _counts_by_peak(f: List[float], W: int, spare: int) -> List[int]:
    """Replica counts: the expert whose busiest replica serves the most rows gets as many more
    replicas as it takes to lower that peak (on 8 ranks 4 replicas serve 2 sources each; a 5th
    would not help); an expert that cannot afford its next step is passed over, and the slots
    left at the end go as in :func:`_counts_by_mean`."""
    reps = [1] * len(f)
    passed = set()
    while spare > 0:
        live = [e for e in range(len(f)) if reps[e] < W and e not in passed]
        if not live:
            break
        e = max(live, key=lambda x: (f[x] * _peak_share(reps[x], W), -x))
        step = next(c for c in range(reps[e] + 1, W + 1)
                    if _peak_share(c, W) < _peak_share(reps[e], W))
        if step - reps[e] > spare or f[e] == 0:
            passed.add(e)
            continue
        spare -= step - reps[e]
        reps[e] = step
    return _counts_by_mean(f, W, spare, reps)


def _fits(demands: List[int], free: List[int]) -> bool:
    """Whether experts needing ``demands`` distinct ranks each fit ranks with ``free`` slots
    (Gale-Ryser: the ``i`` largest demands never exceed ``sum_r min(free_r, i)``)."""
    d = sorted(demands, reverse=True)
    if sum(d) > sum(free):
        return False
    head = 0
    for i in range(1, min(len(d), max(free, default=0)) + 1):  # beyond: sum(free) bounds it
        head += d[i - 1]
        if head > sum(min(c, i) for c in free):
            return False
    return True


def _pack(f: List[float], reps: List[int], W: int, S: int, P: int):
    """Experts in descending peak onto the least-loaded ranks with room, as long as the experts
    still to come fit (else onto the ranks with the most room, else with fewer replicas):
    (expert_ranks, rows per rank in units of loads)."""
    E = len(f)
    rank_load = [0.0] * W
    free = [S] * W
    expert_ranks: List[List[int]] = [[] for _ in range(E)]
    order = sorted(range(E), key=lambda x: (-f[x] * _peak_share(reps[x], W), x))
    for i, e in enumerate(order):
        later = [reps[x] for x in order[i + 1:]]
        open_ranks = [r for r in range(W) if free[r] > 0]
        least_loaded = sorted(open_ranks, key=lambda r: (rank_load[r], r))
        most_room = sorted(open_ranks, key=lambda r: (-free[r], rank_load[r], r))
        chosen = least_loaded[:1]  # if nothing else fits, later experts keep fewer replicas
        for n in range(min(reps[e], len(open_ranks)), 0, -1):
            fit = next((c[:n] for c in (least_loaded, most_room)
                        if _fits(later, [free[r] - (r in c[:n]) for r in range(W)])), None)
            if fit is not None:
                chosen = fit
                break
        chosen = tuple(sorted(chosen))
        for r in _expert_routes(chosen, e, W, P):
            rank_load[r] += f[e] / W
        for r in chosen:
            expert_ranks[e].append(r)
            free[r] -= 1
    return expert_ranks, rank_load


def balance(loads: Sequence[float], world: int, slots_per_rank: int,
            ranks_per_node: Optional[int] = None) -> Placement:
    """A :class:`Placement` of ``len(loads)`` experts on ``world`` ranks of ``slots_per_rank``
    slots each (``world * slots_per_rank >= E``) that evens out the rows per rank, assuming
    every source rank routes like ``loads``.

    1. Replica counts, two ways: every expert starts with one, and the spare slots go either
       one at a time to the expert with the most rows per replica (``loads[e] / replicas[e]``),
       or in steps to the expert whose busiest replica serves the most rows (``loads[e]`` times
       the share the replica rule gives its busiest replica), each step as many replicas as it
       takes to lower that peak (slots left over go the first way); at most one replica per
       rank; ties to the lower id.
    2. Packing, for each: experts in descending peak (ties: lower id), each onto the ranks with
       the least rows so far that have a free slot (ties: lower rank), as long as the experts
       still to come can get all their replicas (Gale-Ryser), else onto the ranks with the most
       free slots.  The rows a replica adds
       are what :func:`comet.plan.choose_replica` (with ``ranks_per_node``) routes to it.  An
       expert keeps fewer replicas only when fewer ranks have room (the slot bound always
       holds).

    Of the two packings the one whose busiest rank has fewer rows wins (ties: the first).
    Deterministic.
    """
    f = _floats(loads, "loads")
    E = len(f)
    if E == 0:
        raise ValueError("loads is empty: need at least one expert")
    for name, v in (("world", world), ("slots_per_rank", slots_per_rank)):
        if isinstance(v, bool) or int(v) != v or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    W, S = int(world), int(slots_per_rank)
    if W * S < E:
        raise ValueError(f"{W} ranks x {S} slots = {W * S} slots cannot hold E={E} experts")
    P = _check_rpn(Placement([[0]], world=W), ranks_per_node)
    packs = [_pack(f, counts(f, W, W * S - E), W, S, P) for counts in (_counts_by_mean,
                                                                       _counts_by_peak)]
    expert_ranks, _ = min(packs, key=lambda pk: max(pk[1]))
    return Placement(expert_ranks, world=W)
