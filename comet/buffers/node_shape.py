"""Nodes of an expert-parallel group from who reaches whom by pointer (comet/topology.h's model:
nodes of `ranks_per_node` consecutive group ranks; same-node peers are reached by pointer, the
others only by put-with-signal).

comet.buffers.symm_cuda gathers every rank's row (nvshmem_ptr != null for the peer's header and data) and
calls `ranks_per_node`; a group that does not split into such nodes is refused with the ranks that
break the pattern, because the kernels would otherwise dereference memory they cannot reach or
route through relays that are not there. Pure Python, so it is tested without GPUs."""
from __future__ import annotations

from typing import Sequence


def _span(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}..{ranks[-1]}"
    return ", ".join(map(str, ranks))


def ranks_per_node(reach: Sequence[Sequence[bool]]) -> int:
    """`reach[r][s]`: group rank r reaches rank s's symmetric memory by pointer. Returns the number
    of ranks per node n (n == len(reach): one node). Raises ValueError unless every rank r reaches
    exactly the ranks [r // n * n, r // n * n + n), n being what rank 0 reaches."""
    world = len(reach)
    if world == 0:
        raise ValueError("comet: an empty group has no nodes")
    rows = []
    for r, row in enumerate(reach):
        if len(row) != world:
            raise ValueError(f"comet: rank {r} reported reachability for {len(row)} ranks, "
                             f"the group has {world}")
        rows.append({s for s, ok in enumerate(row) if ok})
    for r, row in enumerate(rows):
        if r not in row:
            raise ValueError(f"comet: rank {r} cannot reach its own symmetric memory by pointer "
                             "(NVSHMEM set-up problem)")
    n = len(rows[0])
    if rows[0] != set(range(n)) or world % n != 0:
        raise ValueError(
            f"comet: rank 0 reaches ranks {_span(rows[0])} by pointer, which is not a node of "
            f"consecutive ranks 0..n-1 with n dividing the group of {world} (comet needs nodes of "
            "consecutive group ranks; order the group's ranks node by node)")
    bad = []
    for r, row in enumerate(rows):
        first = r // n * n
        want = set(range(first, first + n))
        if row != want:
            extra, missing = sorted(row - want), sorted(want - row)
            what = []
            if missing:
                what.append(f"not {_span(missing)} of its node")
            if extra:
                what.append(f"also {_span(extra)} of another node")
            bad.append(f"rank {r} reaches {_span(row)} ({'; '.join(what)})")
    if bad:
        raise ValueError(
            f"comet: the group does not split into nodes of {n} consecutive ranks (what rank 0 "
            "reaches by pointer): " + "; ".join(bad) + ". Every rank must reach exactly the ranks "
            "of its node (GPUs of a node need peer-to-peer access to each other)")
    return n
