"""The cost model under skewed routing: per-rank rows from expert loads and a placement, so that
the model (and the tuner's choice) prices the slowest rank instead of the uniform expectation.

Inputs: ``loads[e]`` (any scale: a routing histogram from :class:`comet.plan.ExpertLoad`, or
:func:`comet.plan.zipf_loads`), a :class:`Placement`, ``T`` tokens per rank and top-``k``.  Every
source rank is assumed to route like the histogram (the same expert shares on every rank).

* Slot shares: ``p_e = loads[e] / sum(loads)`` of a token's ``k`` slots go to expert ``e``; a
  token holds an expert at most once, so ``k p_e <= 1``: shares above ``1 / k`` are capped and
  the excess is spread over the others in proportion (:func:`slot_shares`).
* Rows: source ``s`` sends ``T k p_e`` rows of expert ``e`` to the replica
  :func:`comet.plan.choose_replica` picks.  Rank ``r``'s GEMM rows per slot follow exactly.
* layer0 rows received and layer1 partial rows: one per (token, remote rank it has a slot on)
  (layer0 pulls a token once per destination rank, its other slot rows there are local copies).  For source ``s`` and rank
  ``r`` serving experts with inclusion probabilities ``pi_i = k p_i`` (descending), the model
  takes ``P(no slot on r) = prod_i max(0, 1 - pi_i / (1 - sum_{j<i} pi_j / k))``: exact for one
  expert and for uniform routing (the hypergeometric ``C(E - E_l, k) / C(E, k)``), an
  approximation in between.  Rows received by ``r`` in layer0 and partial rows sent by ``r`` in
  layer1 are both ``T sum_{s != r} P(slot on r)``.
* Each rank becomes a :class:`comet.tune.perfmodel.MoEShape` with these measured ``expert_rows`` and
  ``remote_rows`` (padded to the largest slot count with empty experts); the rest of the model is
  unchanged.  Approximations beyond the uniform model: layer1's local partials and its combine
  keep the uniform model's formulas for the padded shape (the combine is charged the rows this
  rank sends, not the ones it receives), and across nodes the remote rows split between NVLink
  and NIC in the uniform proportions.

With uniform loads and the contiguous placement every rank's shape predicts the uniform model
to rounding (a test keeps it so).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, NamedTuple, Optional, Sequence

from comet.tune import perfmodel as pm
from .lysi import _floats
from .placement import Placement, route_table

__all__ = ["RankRows", "slot_shares", "rank_rows", "rank_shapes", "predict_slowest",
           "choose_n_comm_slowest", "link_matrices"]


class RankRows(NamedTuple):
    """One rank's expected rows per step (see the module doc)."""

    slot_rows: tuple  # GEMM rows per local slot, ascending logical expert id
    received: float  # layer0 rows pulled from other ranks (one per (token, remote source))
    partials_sent: float  # layer1 partial rows to other ranks' tokens
    partials_local: float  # layer1 partial rows for this rank's own tokens

    @property
    def rows(self) -> float:
        return float(sum(self.slot_rows))


def slot_shares(loads: Sequence[float], k: int) -> List[float]:
    """Per expert the share of a token's slots, ``sum = 1``, each at most ``1 / k`` (a token
    holds an expert once): the shares above the cap are clipped and the excess is spread over
    the uncapped experts in proportion to their loads, repeatedly (water filling)."""
    f = _floats(loads, "loads")
    if isinstance(k, bool) or int(k) != k or not 1 <= k <= len(f):
        raise ValueError(f"k={k!r} must be an integer in [1, E={len(f)}]")
    total = sum(f)
    if total <= 0:
        raise ValueError("loads are all zero: no routing to model")
    cap = 1.0 / k
    p = [x / total for x in f]
    for _ in range(len(f)):
        over = [e for e, x in enumerate(p) if x > cap * (1 + 1e-12)]
        if not over:
            break
        excess = sum(p[e] - cap for e in over)
        for e in over:
            p[e] = cap
        free = [e for e, x in enumerate(p) if x < cap * (1 - 1e-12)]
        mass = sum(f[e] for e in free)
        if mass > 0:
            for e in free:
                p[e] += excess * f[e] / mass
        else:  # zero-load experts take the rest evenly
            for e in free:
                p[e] += excess / len(free)
    return p


def _p_slot_on(pis: List[float], k: int) -> float:
    miss, taken = 1.0, 0.0
    for pi in sorted(pis, reverse=True):
        room = 1.0 - taken / k
        miss *= max(0.0, 1.0 - pi / room) if room > 0 else 0.0
        taken += pi
    return 1.0 - miss


def rank_rows(placement: Placement, loads: Sequence[float], tokens: int, k: int,
              ranks_per_node: Optional[int] = None) -> List[RankRows]:
    """Per rank of ``placement``, its expected rows for one step (module doc)."""
    if len(loads) != placement.num_experts:
        raise ValueError(f"loads has {len(loads)} entries, the placement {placement.num_experts} "
                         f"experts")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    W, E = placement.world, placement.num_experts
    p = slot_shares(loads, k)
    table = route_table(placement, ranks_per_node)
    rows = [[0.0] * E for _ in range(W)]  # rows[r][e]: rows rank r serves for expert e
    served = [[[] for _ in range(W)] for _ in range(W)]  # served[s][r]: inclusion probs
    for s in range(W):
        for e in range(E):
            r = table[s][e]
            n = tokens * k * p[e]
            rows[r][e] += n
            served[s][r].append(k * p[e])
    out = []
    for r in range(W):
        hit = [_p_slot_on(served[s][r], k) for s in range(W)]
        # tokens of other ranks with a slot here: layer0 pulls each once, layer1 sends each a
        # partial (the same count, two directions)
        remote = tokens * sum(h for s, h in enumerate(hit) if s != r)
        out.append(RankRows(tuple(rows[r][e] for e in placement.local_experts(r)), remote, remote,
                            tokens * hit[r]))
    return out


def rank_shapes(shape: pm.MoEShape, layer: int, placement: Placement,
                loads: Sequence[float]) -> List[pm.MoEShape]:
    """Per rank, ``shape`` (the uniform one: W, E, k, H, N, T, dtype, nodes) with the rows of
    :func:`rank_rows` for ``layer`` measured in (``E`` padded to ``W * max slots``). A placement
    built without ``world=`` is completed to ``shape.W`` ranks (:meth:`Placement.for_world`)."""
    if not placement.explicit_world and placement.world < shape.W:
        placement = placement.for_world(shape.W)
    if placement.world != shape.W or placement.num_experts != shape.E:
        raise ValueError(f"placement is for W={placement.world}, E={placement.num_experts}; "
                         f"the shape has W={shape.W}, E={shape.E}")
    if layer not in (0, 1):
        raise ValueError(f"layer must be 0 or 1, got {layer!r}")
    per = rank_rows(placement, loads, shape.T, shape.k, shape.ranks_per_node)
    S = max(1, max(placement.slots()))
    out = []
    for rr in per:
        remote = rr.received if layer == 0 else rr.partials_sent
        padded = tuple(rr.slot_rows) + (0.0,) * (S - len(rr.slot_rows))
        out.append(replace(shape, E=shape.W * S, expert_rows=padded, remote_rows=remote))
    return out


def _total(spec: pm.GpuSpec, n_blocks: Optional[int]) -> int:
    return spec.max_blocks if n_blocks is None else min(spec.max_blocks, int(n_blocks))


def predict_slowest(shapes: Sequence[pm.MoEShape], spec: pm.GpuSpec, n_comm: int, layer: int,
                    tile=pm.DEFAULT_TILE, *, n_blocks: Optional[int] = None,
                    band: Optional[int] = None) -> Dict[str, float]:
    """:func:`comet.tune.perfmodel.predict` of the slowest rank (largest ``fused``) when every rank
    runs the same split (and, layer1, the same band: by default the one the model picks for the
    rank with the most GEMM rows).  Adds ``rank`` (the slowest) and ``rows_max_over_mean``."""
    if not shapes:
        raise ValueError("no ranks to predict")
    if layer == 1 and band is None:
        heavy = max(shapes, key=lambda s: sum(pm.expert_rows(s)))
        band = pm.choose_band(heavy, spec, n_comm, tile, n_blocks=_total(spec, n_blocks))
    preds = [pm.predict(s, spec, n_comm, layer, tile, n_blocks=n_blocks, band=band) for s in shapes]
    r = max(range(len(preds)), key=lambda i: (preds[i]["fused"], -i))
    rows = [sum(pm.expert_rows(s)) for s in shapes]
    mean = sum(rows) / len(rows)
    return {**preds[r], "rank": r, "rows_max_over_mean": max(rows) / mean if mean > 0 else 1.0}


def choose_n_comm_slowest(shapes: Sequence[pm.MoEShape], spec: pm.GpuSpec, layer: int,
                          max_blocks: Optional[int] = None, tile=pm.DEFAULT_TILE) -> int:
    """The ``n_comm`` with the least predicted time of the slowest rank (ties: smallest)."""
    total = _total(spec, max_blocks)
    if total < 2:
        raise ValueError(f"need at least 2 co-resident blocks (1 comm + 1 GEMM), have {total}")
    times = [predict_slowest(shapes, spec, n, layer, tile, n_blocks=total)["fused"]
             for n in range(1, total)]
    best = min(times)
    return 1 + next(i for i, t in enumerate(times) if t <= best * (1 + 1e-12))


def link_matrices(spec: pm.GpuSpec, world: int, ranks_per_node: Optional[int] = None):
    """``(alpha, beta)`` for :func:`comet.plan.lysi_group` from the cost model's links:
    same-node pairs get NVLink's latency and ``1 / link_bw``, pairs on different nodes the NIC's
    (``ranks_per_node`` default: one node).  Diagonals are 0."""
    P = world if ranks_per_node is None else int(ranks_per_node)
    if world < 1 or P < 1 or world % P:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 and divide world={world}")

    def matrix(near: float, far: float):
        return [[0.0 if i == j else (near if i // P == j // P else far) for j in range(world)]
                for i in range(world)]

    return (matrix(spec.alpha, spec.nic_alpha),
            matrix(1.0 / spec.link_bw, 1.0 / spec.nic_bw))
