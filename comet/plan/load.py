"""Expert loads: routing histograms accumulated over steps (:class:`ExpertLoad`) and synthetic
skewed loads (:func:`zipf_loads`) for the planners and the cost model."""

from __future__ import annotations

import random
from typing import List, Optional

import torch

__all__ = ["ExpertLoad", "zipf_loads", "parse_skew"]


class ExpertLoad:
    """Accumulates how many (token, slot) rows each of ``num_experts`` experts received.

    ``update(topk_ids)`` adds one step's ``topk_ids`` (any shape, integer; ``-1`` marks a dropped
    slot and is ignored) with one ``index_add_`` into a fixed-size histogram on the ids' device:
    no host sync, so it can run every step (``torch.bincount`` on a GPU reads the largest id
    back to size its output: a sync).  The counts are float64, exact up to 2**53 rows, so the
    order of the device's atomic adds does not matter.  An id outside ``[-1, E)`` raises on the
    CPU; on a GPU, where checking would need a sync, it counts as dropped.  ``loads()`` returns
    the counts on the CPU (this syncs); ``reset()`` starts over.  ``decay`` in (0, 1] scales the history before each update (1: plain sum), so a
    planner can follow drifting routing.
    """

    def __init__(self, num_experts: int, decay: float = 1.0, device=None):
        if isinstance(num_experts, bool) or int(num_experts) != num_experts or num_experts < 1:
            raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
        if not 0.0 < float(decay) <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.num_experts = int(num_experts)
        self.decay = float(decay)
        self.steps = 0
        self._counts = torch.zeros(self.num_experts, dtype=torch.float64, device=device)

    def update(self, topk_ids: torch.Tensor) -> None:
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError(f"topk_ids must be a tensor, got {type(topk_ids).__name__}")
        dt = topk_ids.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        ids = topk_ids.reshape(-1).to(torch.int64)
        if ids.device != self._counts.device:
            self._counts = self._counts.to(ids.device)
        # an id outside [-1, E) is a caller bug; check on the host only when the ids already
        # live there (no device sync on the hot path)
        if ids.device.type == "cpu" and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -1 or hi >= self.num_experts:
                bad = lo if lo < -1 else hi
                raise ValueError(
                    f"topk_ids holds expert id {bad}, outside [-1, {self.num_experts})")
        # bin 0 takes the dropped slots (and, on a GPU, out-of-range ids) and is thrown away
        E = self.num_experts
        bins = torch.where((ids >= 0) & (ids < E), ids + 1, torch.zeros_like(ids))
        hist = torch.zeros(E + 1, dtype=torch.float64, device=ids.device)
        hist.index_add_(0, bins, torch.ones(bins.shape, dtype=torch.float64, device=ids.device))
        if self.decay != 1.0:
            self._counts.mul_(self.decay)
        self._counts.add_(hist[1:])
        self.steps += 1

    def loads(self) -> List[float]:
        return [float(x) for x in self._counts.cpu().tolist()]

    def reset(self) -> None:
        self._counts.zero_()
        self.steps = 0


def zipf_loads(num_experts: int, s: float, total: float = 1.0,
               seed: Optional[int] = 0) -> List[float]:
    """Per-expert loads that follow Zipf's law with exponent ``s``: the ``i``-th hottest expert
    (``i`` from 1) gets a share proportional to ``1 / i**s``, the shares scaled to ``total``.
    ``seed`` shuffles which expert id gets which rank (a fixed ``random.Random(seed)`` shuffle,
    the same on every platform); ``None`` keeps expert 0 the hottest."""
    if isinstance(num_experts, bool) or int(num_experts) != num_experts or num_experts < 1:
        raise ValueError(f"num_experts must be an integer >= 1, got {num_experts!r}")
    if not float(s) >= 0.0:
        raise ValueError(f"Zipf exponent s must be >= 0, got {s!r}")
    E = int(num_experts)
    w = [1.0 / (i + 1) ** float(s) for i in range(E)]
    z = sum(w)
    order = list(range(E))
    if seed is not None:
        random.Random(seed).shuffle(order)
    loads = [0.0] * E
    for i, e in enumerate(order):
        loads[e] = total * w[i] / z
    return loads


def parse_skew(text: str) -> float:
    """``"zipf:1.2"`` -> 1.2 (the routing skew option of ``python -m comet.tune``)."""
    kind, _, value = str(text).partition(":")
    if kind.strip().lower() != "zipf" or not value:
        raise ValueError(f"skew must look like zipf:<s>, e.g. zipf:1.2; got {text!r}")
    try:
        s = float(value)
    except ValueError:
        raise ValueError(f"skew must look like zipf:<s> with a number s; got {text!r}") from None
    if not s >= 0.0:
        raise ValueError(f"Zipf exponent must be >= 0; got {text!r}")
    return s
