"""Where each logical expert lives: :class:`Placement`, and which replica a source rank's rows use.

A placement maps every logical expert ``e`` of a layer to the sorted list of group ranks holding a
replica of it.  Counts may be uneven (a hot expert on several ranks, a rank holding none); every
expert has at least one replica and a rank holds at most one replica of an expert.  On rank ``r``
the weights ``w0 [E_r, N0, H]`` / ``w1 [E_r, H, N1]`` hold its slots in ascending logical expert
id (:meth:`Placement.local_experts`).

Group size: a placement built with ``world=`` is for that many ranks only.  Without it, it is for
``max(rank) + 1`` ranks and completes itself to the group it is used with
(:meth:`Placement.for_world`: the ranks past the largest it names hold no expert), so a rank that
holds no expert may be the group's last.  The ops, ``Buffer`` and ``comet.nn.MoE`` complete it
before they compile or compare it.

Replica choice (:func:`choose_replica`, vectorised as :func:`route_table`): the rows that source
rank ``s`` routes to expert ``e`` all go to one replica, chosen deterministically:

1. ``s`` itself, if ``s`` holds a replica of ``e`` (no link crossed);
2. else a replica on ``s``'s node (``ranks_per_node``; rank ``r`` is on node ``r // P``): the
   sources of that node that hold no replica, in ascending rank order, take the node's replicas
   in turn, starting at offset ``e`` (``cands[(i + e) % len(cands)]`` for the ``i``-th such
   source), so they spread evenly and different experts start on different replicas;
3. else (no replica on the node) every replica, dealt the same way to the sources of this tier.

The rule is a pure function of (placement, expert, source, ranks_per_node): every rank computes
the same table, so no exchange is needed to agree on it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

__all__ = ["Placement", "choose_replica", "route_table"]


def _as_int(value, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    return int(value.__index__())


class Placement:
    """Per logical expert, the group ranks holding a replica (see the module doc).

    ``Placement(expert_ranks, world=None)``: ``expert_ranks[e]`` is an iterable of ranks (any
    order, no duplicates).  ``world`` is the group size.  Without it the placement's world is
    ``max(rank) + 1`` and it completes itself to the group it is used with (:meth:`for_world`:
    the ranks past the largest it names hold no expert); with it, it is for that group size
    only.  Raises ``ValueError`` naming the offending expert and value for an expert with no
    replica, a rank out of ``[0, world)``, or a rank listed twice for one expert.
    """

    __slots__ = ("_ranks", "_world", "_local", "_explicit")

    def __init__(self, expert_ranks: Sequence[Sequence[int]], world: Optional[int] = None):
        if isinstance(expert_ranks, (str, bytes)) or not hasattr(expert_ranks, "__len__"):
            raise TypeError(f"expert_ranks must be a sequence of rank lists, got {expert_ranks!r}")
        if len(expert_ranks) == 0:
            raise ValueError("expert_ranks is empty: a placement needs at least one expert")
        ranks: List[Tuple[int, ...]] = []
        for e, rs in enumerate(expert_ranks):
            if isinstance(rs, (str, bytes)) or not hasattr(rs, "__iter__"):
                raise TypeError(f"expert {e}: expected a list of ranks, got {rs!r}")
            rl = [_as_int(r, f"expert {e}'s rank") for r in rs]
            if not rl:
                raise ValueError(
                    f"expert {e} has no replica (every expert needs at least one rank)")
            neg = [r for r in rl if r < 0]
            if neg:
                raise ValueError(f"expert {e}: rank {neg[0]} is negative")
            if len(set(rl)) != len(rl):
                dup = next(r for r in rl if rl.count(r) > 1)
                raise ValueError(f"expert {e}: rank {dup} is listed twice (a rank holds at most "
                                 f"one replica of an expert)")
            ranks.append(tuple(sorted(rl)))
        top = max(r[-1] for r in ranks)
        self._explicit = world is not None
        if world is None:
            world = top + 1
        world = _as_int(world, "world")
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if top >= world:
            e = next(i for i, r in enumerate(ranks) if r[-1] == top)
            raise ValueError(f"expert {e}: rank {top} is out of range for world={world}")
        self._ranks = tuple(ranks)
        self._world = world
        local: List[List[int]] = [[] for _ in range(world)]
        for e, rs in enumerate(ranks):  # ascending e: each rank's slots come out sorted
            for r in rs:
                local[r].append(e)
        self._local = tuple(tuple(l) for l in local)

    @classmethod
    def contiguous(cls, num_experts: int, world: int) -> "Placement":
        """Today's map: expert ``e`` on rank ``e // (E / W)`` (``W`` must divide ``E``)."""
        E, W = _as_int(num_experts, "num_experts"), _as_int(world, "world")
        if E < 1 or W < 1 or E % W:
            raise ValueError(f"contiguous placement needs W={W} >= 1 dividing E={E} >= 1")
        per = E // W
        return cls([[e // per] for e in range(E)], world=W)

    @property
    def num_experts(self) -> int:
        return len(self._ranks)

    @property
    def world(self) -> int:
        return self._world

    @property
    def explicit_world(self) -> bool:
        """True when built with ``world=`` (as :meth:`contiguous`, the planners and a completion
        by :meth:`for_world` build theirs): the placement is for that group size only.  False
        when the world was inferred from the largest rank: :meth:`for_world` completes it to a
        larger group."""
        return self._explicit

    def for_world(self, world: int) -> "Placement":
        """This placement on a group of ``world`` ranks, what the ops, ``Buffer`` and
        ``comet.nn.MoE`` run: ``self`` when its world is ``world``; for a placement built without
        ``world=`` and a larger group, the same expert map with ``world=world`` (the ranks past
        the largest it names hold no expert).  Raises ``ValueError`` when the world was given
        and differs from ``world``, or when the placement names a rank ``>= world``."""
        W = _as_int(world, "world")
        if W == self._world:
            return self
        if self._explicit:
            raise ValueError(f"the placement is for world={self._world} but the group has {W} "
                             f"ranks")
        if W < self._world:
            top = self._world - 1
            e = next(i for i, r in enumerate(self._ranks) if r[-1] == top)
            raise ValueError(f"the placement is for world={self._world} (expert {e} is on rank "
                             f"{top}) but the group has {W} ranks")
        return Placement(self._ranks, world=W)

    @property
    def expert_ranks(self) -> Tuple[Tuple[int, ...], ...]:
        """Per logical expert, its replicas' ranks, ascending."""
        return self._ranks

    def replicas(self, expert: int) -> Tuple[int, ...]:
        return self._ranks[self._check_expert(expert)]

    def local_experts(self, rank: int) -> Tuple[int, ...]:
        """Rank ``rank``'s slots: the logical experts it holds, ascending (the order of its
        ``w0`` / ``w1`` rows)."""
        return self._local[self._check_rank(rank)]

    def slots(self) -> Tuple[int, ...]:
        """``E_r`` per rank (may be 0)."""
        return tuple(len(l) for l in self._local)

    def is_contiguous(self) -> bool:
        """True when this is :meth:`contiguous`'s map (the ops' default)."""
        E, W = self.num_experts, self.world
        return E % W == 0 and self == Placement.contiguous(E, W)

    def _check_expert(self, expert) -> int:
        e = _as_int(expert, "expert")
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert {e} is out of range for E={self.num_experts}")
        return e

    def _check_rank(self, rank) -> int:
        r = _as_int(rank, "rank")
        if not 0 <= r < self.world:
            raise ValueError(f"rank {r} is out of range for world={self.world}")
        return r

    # Equality and the hash are the map and the world; whether the world was given is not part
    # of them (Placement(m) == Placement(m, world=Placement(m).world)).
    def __eq__(self, other) -> bool:
        return (isinstance(other, Placement) and self._world == other._world
                and self._ranks == other._ranks)

    def __hash__(self) -> int:
        return hash((self._world, self._ranks))

    def __repr__(self) -> str:
        ranks = [list(r) for r in self._ranks]
        return f"Placement({ranks}, world={self._world})" if self._explicit else \
            f"Placement({ranks})"


def _check_rpn(placement: Placement, ranks_per_node: Optional[int]) -> int:
    W = placement.world
    P = W if ranks_per_node is None else _as_int(ranks_per_node, "ranks_per_node")
    if P < 1 or W % P:
        raise ValueError(f"ranks_per_node={P} must be >= 1 and divide world={W}")
    return P


def _expert_routes(reps: Tuple[int, ...], e: int, W: int, P: int) -> List[int]:
    """Per source rank, the replica of expert ``e`` (on ``reps``) that serves it: the rule of the
    module doc, for all sources in one pass."""
    held = set(reps)
    near: dict = {}  # node -> its replicas, ascending
    for r in reps:
        near.setdefault(r // P, []).append(r)
    dest = [-1] * W
    dealt: dict = {}  # tier (a node, or None for "no replica on the node") -> sources so far
    for s in range(W):  # ascending: the i-th source of a tier takes cands[(i + e) % len]
        if s in held:
            dest[s] = s
            continue
        tier = s // P if s // P in near else None
        cands = near[tier] if tier is not None else reps
        i = dealt.get(tier, 0)
        dealt[tier] = i + 1
        dest[s] = cands[(i + e) % len(cands)]
    return dest


def choose_replica(placement: Placement, expert: int, src_rank: int,
                   ranks_per_node: Optional[int] = None) -> int:
    """The rank whose replica of ``expert`` serves source rank ``src_rank``'s rows (the rule in
    the module doc; ``ranks_per_node`` default: one node)."""
    P = _check_rpn(placement, ranks_per_node)
    e = placement._check_expert(expert)
    s = placement._check_rank(src_rank)
    return _expert_routes(placement.expert_ranks[e], e, placement.world, P)[s]


def route_table(placement: Placement, ranks_per_node: Optional[int] = None) -> List[List[int]]:
    """``table[s][e]`` = :func:`choose_replica` (placement, e, s, ranks_per_node) for every source
    ``s`` and expert ``e`` (a ``[W, E]`` list; ``torch.tensor(table)[s][topk_ids]`` gives every
    slot's destination rank)."""
    P = _check_rpn(placement, ranks_per_node)
    W = placement.world
    by_expert = [_expert_routes(reps, e, W, P) for e, reps in enumerate(placement.expert_ranks)]
    return [[by_expert[e][s] for e in range(placement.num_experts)] for s in range(W)]
