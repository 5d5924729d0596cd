"""EPLB-like balancing: replicate the hottest experts into spare slots, then pack the replicas."""

from __future__ import annotations

from typing import List, Sequence

from .lysi import _floats
from .placement import Placement

__all__ = ["balance"]


def balance(loads: Sequence[float], world: int, slots_per_rank: int) -> Placement:
    """A :class:`Placement` of ``len(loads)`` experts on ``world`` ranks of ``slots_per_rank``
    slots each (``world * slots_per_rank >= E``) that evens out the load per rank.

    1. Replicas: every expert starts with one; while slots remain, the expert with the highest
       load per replica (``loads[e] / replicas[e]``; ties: lower id) gets another, at most one
       per rank (``world``).
    2. Packing: replicas in descending load per replica (ties: lower expert id) go, one expert's
       replicas at a time, to the ranks with the least load so far that have a free slot and no
       replica of it yet (ties: lower rank).  If fewer such ranks remain than the expert has
       replicas, it keeps fewer (never happens with ``slots_per_rank >= E / world`` rounded up
       and distinct-enough loads; the slot bound always holds).

    Deterministic.  The expected load of a replica is ``loads[e] / replicas[e]`` when sources are
    dealt to replicas evenly (:func:`comet.plan.choose_replica`).
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
    reps = [1] * E
    for _ in range(W * S - E):
        best = max((e for e in range(E) if reps[e] < W), key=lambda e: (f[e] / reps[e], -e),
                   default=None)
        if best is None:
            break
        reps[best] += 1
    rank_load = [0.0] * W
    free = [S] * W
    expert_ranks: List[List[int]] = [[] for _ in range(E)]
    for e in sorted(range(E), key=lambda e: (-f[e] / reps[e], e)):
        open_ranks = sorted((r for r in range(W) if free[r] > 0), key=lambda r: (rank_load[r], r))
        # the expert's replicas may not outnumber the ranks with room, nor leave later experts
        # without a slot
        later = sum(1 for x in expert_ranks if not x) - 1
        room = sum(free) - later
        chosen = open_ranks[:max(1, min(reps[e], len(open_ranks), room))]
        for r in chosen:
            expert_ranks[e].append(r)
            rank_load[r] += f[e] / len(chosen)
            free[r] -= 1
    return Placement(expert_ranks, world=W)
