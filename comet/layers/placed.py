"""The ops with an expert placement (comet.plan.Placement): how a placement becomes the engine's
dispatch, in one place for both backends (docs/placement.md, "Running a placement").

Slot space. Rank r holds E_r slots, its logical experts in ascending id
(Placement.local_experts). The engine runs over a virtual expert space of W x S slots, S = max_r
E_r, laid out rank-major: virtual id r * S + i is slot i of rank r. Source rank s sends the rows
of logical expert e to the replica the placement's route table names (comet.plan.route_table,
ranks_per_node = the buffer's): virtual id route[s][e] * S + (e's index among that rank's slots).
So the destination of a (token, slot) comes from the placement's table, and everything the engine
derives from the virtual id (send plan, dispatch layout, m-tiles, reduce plan, combine, node-first
routing across nodes) follows the placement unchanged, on the CPU backend and in the CUDA kernels
alike. A rank with E_r < S gets zero rows for its padding slots; its weights are padded with
zeros for the call (a copy of w0 / w1 when E_r < S; none when every rank holds S slots, e.g.
comet.plan.balance's placements).

Reduction by slot. out [T, H] must not depend on the placement, so layer1 does not add a token's
slots per destination rank (that grouping would follow the placement): it runs over the T * k
(token, slot) pairs as tokens of one slot each, so each slot's weighted row comes home on its
own, and the home adds the k rows in fp32 in slot order (the same order for any placement), then
rounds once to the activation dtype. Any two placements give bitwise equal out and equal y0 rows
(up to their order in the dispatch layout). The price: one row per (token, slot) crosses to the
home instead of one per (token, rank) (at most k rows per token either way).

Agreement. The placement's fingerprint goes into the call metadata every rank checks before any
data moves (Buffer.set_call_tag, around the forward calls; the backward calls carry 0 on every rank
alike), so placements that differ across ranks fail on every rank.
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading

import torch

from comet.plan.placement import Placement, route_table


@dataclasses.dataclass(frozen=True)
class PlacedRoutes:
    """A placement compiled for one source rank of a group: what the ops need per call."""

    placement: Placement
    rank: int
    slots: int               # S = max E_r: virtual experts per rank
    local: int               # E_r: this rank's slots
    virtual_ids: tuple       # [E] this source's virtual id of each logical expert
    fingerprint: int         # nonzero int31 of (placement, ranks_per_node), the same on all ranks

    @property
    def num_virtual(self) -> int:
        return self.placement.world * self.slots

    def virtual_table(self, device) -> torch.Tensor:
        return _table(self, device)


_cache: dict = {}
_lock = threading.Lock()


def placed_routes(placement: Placement, rank: int, ranks_per_node: int | None) -> PlacedRoutes:
    """The routes of `placement` for source `rank` (memoised per (placement, rank, P))."""
    key = (placement, int(rank), ranks_per_node)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    table = route_table(placement, ranks_per_node)
    counts = placement.slots()
    S = max(counts)
    index = [{e: i for i, e in enumerate(placement.local_experts(r))} for r in range(placement.world)]
    vids = tuple(d * S + index[d][e] for e, d in enumerate(table[rank]))
    digest = hashlib.blake2b(repr((placement.world, placement.expert_ranks,
                                   ranks_per_node)).encode(), digest_size=4).digest()
    fp = (int.from_bytes(digest, "little") & 0x7FFFFFFF) or 1
    routes = PlacedRoutes(placement, int(rank), S, counts[rank], vids, fp)
    with _lock:
        _cache[key] = routes
    return routes


_tables: dict = {}


def _table(routes: PlacedRoutes, device) -> torch.Tensor:
    key = (routes.placement, routes.rank, routes.fingerprint, str(device))
    t = _tables.get(key)
    if t is None:
        t = torch.tensor(routes.virtual_ids, dtype=torch.int64, device=device)
        _tables[key] = t
    return t


def virtual_ids(routes: PlacedRoutes, topk_ids: torch.Tensor) -> torch.Tensor:
    """topk_ids [T, k] (logical ids, -1 dropped; validated by the caller) as virtual ids, int32."""
    ids = topk_ids.to(torch.int64)
    table = routes.virtual_table(ids.device)
    E = table.shape[0]
    mapped = table[ids.clamp(0, E - 1)]
    # ids >= E become W * S + (id - E): out of the engine's range, so it rejects them
    mapped = torch.where(ids >= E, ids - E + routes.num_virtual, mapped)
    return torch.where(ids >= 0, mapped, ids).to(torch.int32)


def pad_slots(w: torch.Tensor | None, routes: PlacedRoutes) -> torch.Tensor | None:
    """w [E_r, ...] padded with zero slots to [S, ...] (the engine's E_local); w itself when
    E_r == S. Differentiable: the padding's gradient is dropped."""
    if w is None or w.shape[0] == routes.slots:
        return w
    pad = w.new_zeros((routes.slots - w.shape[0], *w.shape[1:]))
    return torch.cat([w, pad], dim=0)




def sum_by_slot(out_slots: torch.Tensor, tokens: int, topk: int, dtype) -> torch.Tensor:
    """out_slots [T * k, H] (each slot's weighted row) -> out [T, H]: fp32 sum in slot order."""
    rows = out_slots.view(tokens, topk, out_slots.shape[-1])
    acc = rows[:, 0].float()
    for j in range(1, topk):
        acc = acc + rows[:, j].float()
    return acc.to(dtype)
