"""Formulas the tests check comet against, written from their published definitions and not from
comet's code (an oracle that calls the code under test passes whatever that code does)."""
from __future__ import annotations

import torch


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): y = [gate | up] along the last
    dimension (gate first, as Mixtral's w1 / w3 stacked), out = gate * sigmoid(gate) * up,
    computed in fp64 and returned in fp32 (the tests compare at fp32 tolerances)."""
    n = y.shape[-1] // 2
    gate, up = y[..., :n].double(), y[..., n:].double()
    return (gate / (1.0 + torch.exp(-gate)) * up).float()


def switch_balance_loss(probs: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4) for top-k routing as
    Megatron-core computes it: E * sum_e f_e * P_e, with f_e = (slots routed to e) / (T * k)
    (dropped slots, id -1, count in T * k but for no expert) and P_e = mean over tokens of the
    router probability of e. 1.0 for a perfectly balanced router."""
    T, k = topk_ids.shape
    if T == 0:
        return probs.sum() * 0.0
    routed = torch.zeros(num_experts, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(topk_ids[t, j])
            if e >= 0:
                routed[e] += 1.0
    f = routed / (T * k)
    p = probs.double().sum(0) / T
    return (num_experts * (f * p).sum()).to(probs.dtype)
