"""Moving expert weights from one placement to another: :func:`migrate`.

Every rank knows both placements, so every rank computes the same transfer plan without an
exchange: slot ``i`` of rank ``r`` under the new placement (logical expert ``e``) is copied from
``r``'s own old slot when ``r`` held ``e`` before, else from old replica
``old.replicas(e)[r % len]`` (the sources of a replicated expert are spread over its replicas).
All tensors of one call (``w0``, ``w1`` and any extras, e.g. biases or an optimiser's moments)
travel packed in ONE ``all_to_all_single`` over the group; 16-bit tensors travel as float32
(exact both ways; gloo does not move 16-bit floats everywhere).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from .placement import Placement

__all__ = ["migrate", "migration_sources"]


def migration_sources(old: Placement, new: Placement, rank: int) -> List[int]:
    """For each new slot of ``rank`` (ascending logical expert), the old rank it is copied from."""
    if old.num_experts != new.num_experts or old.world != new.world:
        raise ValueError(f"migrate: placements differ in shape: old places {old.num_experts} "
                         f"experts on {old.world} ranks, new {new.num_experts} on {new.world}")
    out = []
    for e in new.local_experts(rank):
        reps = old.replicas(e)
        out.append(rank if rank in reps else reps[rank % len(reps)])
    return out


def _wire(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.element_size() < 4 and t.is_floating_point() else t.dtype


def migrate(old: Placement, new: Placement, w0: torch.Tensor, w1: torch.Tensor, *extra,
            group=None) -> Tuple[torch.Tensor, ...]:
    """This rank's weights under ``old`` (``w0 [E_r, ...]``, ``w1 [E_r, ...]``, and any ``extra``
    tensors with the same leading slot dimension) -> its weights under ``new`` (``[E_r', ...]``
    each, new tensors), with one ``all_to_all_single`` over ``group`` (every rank of the group
    calls it, with the same placements). A world of one (or no torch.distributed) copies locally.
    With torch.distributed, a placement built without ``world=`` is completed to the group
    (:meth:`Placement.for_world`); one whose world was given must be the group's.
    """
    tensors = (w0, w1) + tuple(extra)
    if dist.is_available() and dist.is_initialized():
        G = dist.get_world_size(group)
        try:
            old, new = old.for_world(G), new.for_world(G)
        except ValueError as e:
            raise ValueError(f"migrate: {e}") from None
    W = old.world
    rank = dist.get_rank(group) if W > 1 else 0
    if W > 1 and dist.get_world_size(group) != W:
        raise ValueError(f"migrate: the placements are for world={W} but the group has "
                         f"{dist.get_world_size(group)} ranks")
    mine = old.local_experts(rank)
    for i, t in enumerate(tensors):
        if t.shape[0] != len(mine):
            raise ValueError(f"migrate: tensor {i} has {t.shape[0]} slots but the old placement "
                             f"gives rank {rank} E_r={len(mine)}")
    widths = [int(t[0].numel()) if t.shape[0] else int(torch.Size(t.shape[1:]).numel())
              for t in tensors]
    row = sum(widths)
    wire = torch.float64 if any(_wire(t) == torch.float64 for t in tensors) else torch.float32
    old_slot = {e: i for i, e in enumerate(mine)}

    def pack(slots: Sequence[int]) -> torch.Tensor:
        if not slots:
            return torch.zeros(0, row, dtype=wire, device=w0.device)
        return torch.cat([t[list(slots)].reshape(len(slots), -1).to(wire) for t in tensors], dim=1)

    # what rank d receives, and from whom (the same computation on every rank)
    sources = [migration_sources(old, new, d) for d in range(W)]
    send = [[old_slot[e] for e, s in zip(new.local_experts(d), sources[d]) if s == rank]
            for d in range(W)]
    send_buf = torch.cat([pack(sl) for sl in send]) if W > 1 else pack(send[0])
    recv_from = sources[rank]
    recv_counts = [sum(1 for s in recv_from if s == q) for q in range(W)]
    if W > 1:
        recv_buf = send_buf.new_empty(sum(recv_counts), row)
        dist.all_to_all_single(recv_buf, send_buf, output_split_sizes=recv_counts,
                               input_split_sizes=[len(sl) for sl in send], group=group)
    else:
        recv_buf = send_buf
    # rows arrive grouped by source rank, each source's in ascending new slot
    start = [0] * W
    for q in range(1, W):
        start[q] = start[q - 1] + recv_counts[q - 1]
    order = []
    for s in recv_from:
        order.append(start[s])
        start[s] += 1
    rows = recv_buf[order] if order else recv_buf[:0]
    out, off = [], 0
    for t, n in zip(tensors, widths):
        out.append(rows[:, off:off + n].to(t.dtype).reshape(len(order), *t.shape[1:]).contiguous())
        off += n
    return tuple(out)
