"""The awkward routing cases every implementation is checked on, generated deterministically from a
seed so each rank of a multi-process test can rebuild every rank's inputs (and the reference)."""
from __future__ import annotations

import dataclasses

import torch

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=1e-2, rtol=1e-2), torch.float64: dict(atol=1e-10, rtol=1e-10)}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    world: int
    experts: int
    topk: int
    tokens: tuple[int, ...]  # per rank
    hidden: int = 24
    n0: int = 20
    n1: int = 12
    routing: str = "uniform"  # uniform | one_expert | dropped | duplicates | skewed
    seed: int = 0

    def __str__(self):
        return self.name


def cases_for(world: int) -> list[Case]:
    w = world
    return [
        Case(f"uniform-w{w}", w, 2 * w, 2, tuple(7 + 3 * r for r in range(w))),
        Case(f"empty-rank-w{w}", w, 2 * w, 2, tuple(0 if r == w - 1 else 9 for r in range(w)), seed=1),
        Case(f"one-expert-w{w}", w, 2 * w, 2, tuple([6] * w), routing="one_expert", seed=2),
        Case(f"dropped-w{w}", w, 2 * w, 3, tuple(5 + r for r in range(w)), routing="dropped", seed=3),
        Case(f"duplicates-w{w}", w, w, 3, tuple(4 + 2 * r for r in range(w)), routing="duplicates",
             seed=4),
        Case(f"skewed-odd-w{w}", w, 3 * w, 2, tuple(13 - r for r in range(w)), hidden=37, n0=30,
             n1=17, routing="skewed", seed=5),
    ]


E6_ON_3 = Case("e6-on-3", 3, 6, 2, (5, 0, 8), hidden=20, n0=14, n1=10, seed=6)


def make_inputs(case: Case, dtype=torch.float32):
    """Per-rank lists: xs, w0s, w1s, topk_ids (int64), topk_weights (float32)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    W, E, k, H = case.world, case.experts, case.topk, case.hidden
    el = E // W
    xs, ids, wts = [], [], []
    for T in case.tokens:
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        if case.routing == "one_expert":
            t_ids = torch.full((T, k), E - 1, dtype=torch.int64)  # every slot, same expert
        elif case.routing == "duplicates":
            t_ids = torch.randint(0, E, (T, k), generator=g)
            t_ids[:, 1] = t_ids[:, 0]
        elif case.routing == "skewed":  # most slots to the first expert of rank 0
            t_ids = torch.randint(0, E, (T, k), generator=g)
            hot = torch.rand(T, k, generator=g) < 0.7
            t_ids[hot] = 0
        else:
            if k <= E and T:  # distinct experts per token, like a softmax top-k router
                t_ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            else:
                t_ids = torch.randint(0, E, (T, k), generator=g)
        if case.routing == "dropped" and T:
            drop = torch.rand(T, k, generator=g) < 0.35
            t_ids[drop] = -1
            t_ids[0, :] = -1  # a token with every slot dropped
        ids.append(t_ids.to(torch.int64))
        wts.append(torch.rand(T, k, generator=g))
    w0s = [(torch.randn(el, case.n0, H, generator=g) / H ** 0.5).to(dtype) for _ in range(W)]
    w1s = [(torch.randn(el, H, case.n1, generator=g) / case.n1 ** 0.5).to(dtype) for _ in range(W)]
    return xs, w0s, w1s, ids, wts


def make_biases(case: Case, dtype=torch.float32):
    """Per-rank expert biases b0s [E_local, N0], b1s [E_local, H] (deterministic, like
    make_inputs)."""
    g = torch.Generator().manual_seed(500 + case.seed)
    el = case.experts // case.world
    b0s = [torch.randn(el, case.n0, generator=g).to(dtype) for _ in range(case.world)]
    b1s = [torch.randn(el, case.hidden, generator=g).to(dtype) for _ in range(case.world)]
    return b0s, b1s


def h_from_y0(y0: torch.Tensor, n1: int) -> torch.Tensor:
    """A deterministic stand-in activation mapping y0 [M, N0] to h [M, N1] (any function works:
    layer1 is checked on the same h the reference gets)."""
    return torch.tanh(y0.float()[:, :n1]).to(y0.dtype).contiguous()
