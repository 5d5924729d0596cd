"""Pure-torch reference of Comet's expert-parallel MoE layer.

This module *defines* the semantics that the fused operators (``torch.ops.comet.moe_layer0`` and
``torch.ops.comet.moe_layer1``) and every backend must reproduce.  It is written for clarity, not
speed, and it needs nothing but torch.

Terms (see docs/design.md, section "Semantics")
-----------------------------------------------
* ``W`` ranks (the expert-parallel group), ``E`` experts, ``E_local = E // W`` experts per rank.
  ``W`` must divide ``E``.  Expert ``e`` lives on rank ``e // E_local`` as local expert
  ``e % E_local``.
* Rank ``r`` holds ``x_r [T_r, H]``, ``topk_ids_r [T_r, k]`` (int32 or int64) and
  ``topk_weights_r [T_r, k]`` (float32 or x's dtype).  ``T_r`` may be 0.  An id of ``-1`` marks a
  dropped slot: no row, contributes nothing.  Any other id outside ``[0, E)`` is a ``ValueError``.
  The same expert may appear twice in a token's top-k: each (token, slot) is its own row.
* Dispatch layout on destination rank ``d``: rows grouped by local expert (ascending); inside an
  expert by source rank in ring order starting at ``d`` (``d, d+1, ..., d-1 mod W``); inside a
  source rank by token index, then slot (ascending).  Row ``(s, t, j)`` carries ``x_s[t]``.
  ``M_d`` is the number of rows on ``d``.
* layer0 on ``d``: ``y0[row(s,t,j)] = x_s[t] @ W0[e]^T`` with local weights
  ``W0 [E_local, N0, H]``; output ``[M_d, N0]`` in x's dtype, computed in fp32 and cast once.
* layer1 on ``d`` takes ``h [M_d, N1]`` (same layout) and ``W1 [E_local, H, N1]``; the result lands
  on each source rank ``s``:
  ``out_s[t] = sum_j topk_weights_s[t, j] * (h[row(s,t,j)] @ W1[e_j]^T)``, everything in fp32, the
  sum taken over ``j`` in ascending order starting from 0.0, dropped slots contribute nothing
  (so a token whose slots are all dropped gets exact zeros), cast to h's dtype at the end.
  ``out_s`` is ``[T_s, H]``.
* dtypes: float32, bfloat16, float16; fp32 accumulation everywhere.  Weights may be given in a
  different floating dtype than the activations; they are converted to fp32 like everything else.
* Order of floating-point operations: the top-k reduce is fixed (fp32, ``j`` ascending, as above).
  Inside one dot product over ``H`` (layer0) or ``N1`` (layer1) the summation order is whatever
  torch's fp32 matmul uses; it is not part of the semantics, so other implementations (tiled
  GEMMs) match this reference up to fp32 rounding of the dot products, not bitwise.

Expert tensor parallelism (``tp_size`` t > 1): see the section at the end of this module
(``tp_dispatch_rows``, ``tp_shard``, ``moe_tp_sim``).

Two forms
---------
* Simulated world (``*_sim``): lists of per-rank tensors, ``W = len(list)``; runs in one process.
* torch.distributed (``*_dist``): one call per rank over a process group, using
  ``dist.all_gather`` for the routing counts and ``dist.all_to_all_single`` (variable split sizes)
  for the token exchange.  Works with gloo on CPU.

Both forms build the same per-rank operands and share the same compute helpers
(:func:`_expert_gemm` and :func:`_combine`), so they produce bitwise identical results.
"""

from __future__ import annotations

import operator
from collections import namedtuple
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "Row",
    "SUPPORTED_DTYPES",
    "route",
    "swiglu",
    "check_world",
    "check_routing",
    "expert_rank",
    "local_expert",
    "ring_order",
    "dispatch_rows",
    "dispatch_counts",
    "layer0_sim",
    "layer1_sim",
    "moe_sim",
    "layer0_dist",
    "layer1_dist",
    "moe_dist",
    "tp_dispatch_rows",
    "tp_shard",
    "moe_tp_sim",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, except float64 (CPU gradient checks), which accumulates in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32

#: One row of a destination rank's dispatch layout: token ``token`` of source rank ``source``,
#: top-k slot ``slot``, routed to local expert ``local_expert`` of the destination rank.
#: (``local_expert`` is the 4th field so that ``row.source, row.token, row.slot`` read naturally.)
Row = namedtuple("Row", ["source", "token", "slot", "local_expert"])


# --------------------------------------------------------------------------------------------------
# Routing helpers
# --------------------------------------------------------------------------------------------------


def route(logits: torch.Tensor, k: int, renormalize: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax-top-k router.

    ``logits [T, E]`` -> ``(topk_weights float32 [T, k], topk_ids int64 [T, k])``.
    The softmax over experts is computed in fp32; ties are broken the way ``torch.topk`` breaks
    them.  With ``renormalize=True`` each token's ``k`` weights are divided by their sum so they
    add up to 1.
    """
    if logits.dim() != 2:
        raise ValueError(f"route: logits must be 2-D [T, E], got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    try:
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"route: k must be an integer, got {k!r}") from None
    if k < 1 or k > num_experts:
        raise ValueError(f"route: k={k} must be an int in [1, num_experts={num_experts}]")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int64)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """Gated SiLU on a layer0 output: ``silu(y[..., :N0//2]) * y[..., N0//2:]``.

    Computed in fp32, returned in ``y.dtype``.  ``N0`` (the last dimension) must be even.
    """
    n0 = y.shape[-1]
    if n0 % 2 != 0:
        raise ValueError(f"swiglu: last dimension N0={n0} must be even")
    yf = y.float()
    half = n0 // 2
    return (F.silu(yf[..., :half]) * yf[..., half:]).to(y.dtype)


def check_world(num_experts: int, world: int) -> int:
    """Validate the expert/rank split and return ``E_local = num_experts // world``."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts % world != 0:
        raise ValueError(
            f"the number of experts ({num_experts}) must be divisible by the world size ({world})"
        )
    return num_experts // world


def check_routing(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ``ValueError`` unless every id is -1 (dropped) or in ``[0, num_experts)``.

    ``topk_ids`` must be a 2-D integer tensor ``[T, k]`` (int32 or int64 in practice).
    The message names the first offending value and where it sits.
    """
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"topk_ids must be a tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must have an integer dtype, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D [T, k], got shape {tuple(topk_ids.shape)}")
    ids = topk_ids.to(torch.int64)
    bad = (ids != -1) & ((ids < 0) | (ids >= num_experts))
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        value = int(ids[t, j])
        raise ValueError(
            f"invalid expert id {value} at token {t}, slot {j}: ids must be -1 (dropped) "
            f"or in [0, {num_experts})"
        )


def expert_rank(e: int, num_experts: int, world: int) -> int:
    """The rank that owns global expert ``e``: ``e // (num_experts // world)``."""
    e_local = check_world(num_experts, world)
    if not 0 <= e < num_experts:
        raise ValueError(f"invalid expert id {e}: must be in [0, {num_experts})")
    return e // e_local


def local_expert(e: int, num_experts: int, world: int) -> int:
    """The index of global expert ``e`` among its owner's local experts: ``e % E_local``."""
    e_local = check_world(num_experts, world)
    if not 0 <= e < num_experts:
        raise ValueError(f"invalid expert id {e}: must be in [0, {num_experts})")
    return e % e_local


def ring_order(dest: int, world: int) -> List[int]:
    """Source ranks in the order a destination rank lays them out: ``dest, dest+1, ..., dest-1``."""
    return [(dest + i) % world for i in range(world)]


def dispatch_rows(topk_ids_list: Sequence[torch.Tensor], num_experts: int, dest: int) -> List[Row]:
    """The rows of destination rank ``dest``, in dispatch order.

    ``topk_ids_list[s]`` is rank ``s``'s ``[T_s, k]`` ids; ``W = len(topk_ids_list)``.
    Returns a list of :class:`Row` ``(source, token, slot, local_expert)``; its length is ``M_dest``
    and ``rows[i]`` is what row ``i`` of ``dest``'s layer0 output / layer1 input holds.
    """
    world = len(topk_ids_list)
    e_local = check_world(num_experts, world)
    if not 0 <= dest < world:
        raise ValueError(f"dest={dest} must be in [0, {world})")
    for ids in topk_ids_list:
        check_routing(ids, num_experts)
    rows: List[Row] = []
    for le in range(e_local):
        expert = dest * e_local + le
        for s in ring_order(dest, world):
            ids = topk_ids_list[s].tolist()
            for t, token_ids in enumerate(ids):
                for j, e in enumerate(token_ids):
                    if e == expert:
                        rows.append(Row(s, t, j, le))
    return rows


def dispatch_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows one rank sends to each global expert: int64 ``[num_experts]`` (dropped slots ignored)."""
    check_routing(topk_ids, num_experts)
    ids = topk_ids.to(torch.int64).reshape(-1)
    ids = ids[ids >= 0]
    return torch.bincount(ids, minlength=num_experts)


# --------------------------------------------------------------------------------------------------
# Building blocks shared by the simulated and the distributed form
# --------------------------------------------------------------------------------------------------


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: float32, bfloat16, float16, float64")


def _check_tokens(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, rank: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"rank {rank}: x must be 2-D [T, H], got shape {tuple(x.shape)}")
    _check_dtype(f"rank {rank}: x", x)
    check_routing(topk_ids, num_experts)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"rank {rank}: topk_ids has {topk_ids.shape[0]} tokens but x has {x.shape[0]}"
        )


def _check_weights(topk_weights: torch.Tensor, topk_ids: torch.Tensor, rank: int) -> None:
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"rank {rank}: topk_weights must be floating point, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"rank {rank}: topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape "
            f"{tuple(topk_ids.shape)}"
        )


def _check_w0(w0: torch.Tensor, e_local: int, hidden: Optional[int], rank: int) -> None:
    _check_dtype(f"rank {rank}: w0", w0)
    if w0.dim() != 3 or w0.shape[0] != e_local or (hidden is not None and w0.shape[2] != hidden):
        raise ValueError(
            f"rank {rank}: w0 must be [E_local={e_local}, N0, H={hidden}], got {tuple(w0.shape)}"
        )


def _check_w1(w1: torch.Tensor, e_local: int, rank: int) -> None:
    _check_dtype(f"rank {rank}: w1", w1)
    if w1.dim() != 3 or w1.shape[0] != e_local:
        raise ValueError(f"rank {rank}: w1 must be [E_local={e_local}, H, N1], got {tuple(w1.shape)}")


def _send_order(topk_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs a source rank sends, in send order.

    Send order = sorted by (global expert, token, slot).  Because expert ``e`` lives on rank
    ``e // E_local`` as local expert ``e % E_local``, this is "by destination rank, then by local
    expert, then token, then slot": exactly one source's segment of every expert on every
    destination, in order.  Returns ``(tokens, slots, experts)``, int64 vectors of equal length.
    """
    k = topk_ids.shape[1]
    flat = topk_ids.to(torch.int64).reshape(-1)  # index t * k + j: token-major, slot-minor
    valid = (flat >= 0).nonzero().reshape(-1)
    experts = flat[valid]
    order = torch.sort(experts, stable=True).indices  # stable: keeps (token, slot) order per expert
    pos = valid[order]
    return pos // max(k, 1), pos % max(k, 1), experts[order]


def _expert_gemm(a: torch.Tensor, row_experts: torch.Tensor, w: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[i] = a[i] @ w[row_experts[i]]^T (+ bias[row_experts[i]])`` in fp32 (returns fp32
    ``[M, w.shape[1]]``); the bias is added to the fp32 product, before any rounding.

    Rows of one expert are contiguous in the dispatch layout; one fp32 matmul per local expert.
    """
    acc = acc_dtype(a.dtype)
    out = torch.zeros(a.shape[0], w.shape[1], dtype=acc)
    af = a.to(acc)
    for le in range(w.shape[0]):
        idx = (row_experts == le).nonzero().reshape(-1)
        if idx.numel() > 0:
            out[idx] = af[idx] @ w[le].to(acc).t()
            if bias is not None:
                out[idx] = out[idx] + bias[le].to(acc)
    return out


def _check_bias(name: str, b: Optional[torch.Tensor], e_local: int, n: int, rank: int) -> None:
    if b is not None and tuple(b.shape) != (e_local, n):
        raise ValueError(f"rank {rank}: {name} must be [E_local={e_local}, {n}], "
                         f"got {tuple(b.shape)}")


def _combine(partials: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Weighted top-k reduce on a source rank.

    ``partials [T, k, H]`` fp32 holds ``h[row(s,t,j)] @ W1[e_j]^T`` (anything for dropped slots).
    Returns fp32 ``[T, H]``: ``sum_j w[t, j] * partials[t, j]``, starting from 0.0, ``j`` ascending,
    dropped slots skipped (masked, so a NaN/inf weight on a dropped slot cannot leak in).
    """
    T, k, H = partials.shape
    w = topk_weights.to(partials.dtype)
    valid = topk_ids >= 0
    out = torch.zeros(T, H, dtype=partials.dtype)
    for j in range(k):
        term = w[:, j : j + 1] * partials[:, j, :]
        out = out + torch.where(valid[:, j : j + 1], term, torch.zeros_like(term))
    return out


# --------------------------------------------------------------------------------------------------
# Simulated world: lists of per-rank tensors
# --------------------------------------------------------------------------------------------------


def _sim_layout(topk_ids_list: Sequence[torch.Tensor], num_experts: int):
    """Per destination rank: (sources, tokens, slots, local_experts) int64 vectors in dispatch order."""
    world = len(topk_ids_list)
    e_local = check_world(num_experts, world)
    sends = [_send_order(ids) for ids in topk_ids_list]  # per source: tokens, slots, experts
    layouts = []
    for d in range(world):
        src, tok, slot, lexp = [], [], [], []
        for le in range(e_local):
            expert = d * e_local + le
            for s in ring_order(d, world):
                tokens, slots, experts = sends[s]
                sel = experts == expert
                n = int(sel.sum())
                src.append(torch.full((n,), s, dtype=torch.int64))
                tok.append(tokens[sel])
                slot.append(slots[sel])
                lexp.append(torch.full((n,), le, dtype=torch.int64))
        layouts.append(tuple(torch.cat(v) if v else torch.zeros(0, dtype=torch.int64)
                             for v in (src, tok, slot, lexp)))
    return layouts


def _check_world_list(name: str, lst: Sequence, world: int) -> None:
    if len(lst) != world:
        raise ValueError(f"{name} has {len(lst)} entries but the world has {world} ranks")


def layer0_sim(
    xs: Sequence[torch.Tensor],
    w0s: Sequence[torch.Tensor],
    topk_ids_list: Sequence[torch.Tensor],
    num_experts: int,
    b0s: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> List[torch.Tensor]:
    """Dispatch + first expert GEMM on a simulated world.

    ``xs[r] [T_r, H]``, ``w0s[r] [E_local, N0, H]`` (rank r's local experts), ``topk_ids_list[r]
    [T_r, k]``, optional ``b0s[r] [E_local, N0]`` expert biases (added in fp32 before rounding).
    Returns ``y0s[d] [M_d, N0]`` in dispatch layout, dtype of ``xs[d]``.
    """
    world = len(topk_ids_list)
    e_local = check_world(num_experts, world)
    _check_world_list("xs", xs, world)
    _check_world_list("w0s", w0s, world)
    for r in range(world):
        _check_tokens(xs[r], topk_ids_list[r], num_experts, r)
        _check_w0(w0s[r], e_local, xs[r].shape[1], r)
    hidden = {x.shape[1] for x in xs}
    if len(hidden) != 1:
        raise ValueError(f"all ranks must have the same hidden size H, got {sorted(hidden)}")
    (H,) = hidden
    n0 = {w.shape[1] for w in w0s}
    if len(n0) != 1:
        raise ValueError(f"all ranks must have the same N0, got {sorted(n0)}")
    dtypes = {x.dtype for x in xs}
    if len(dtypes) != 1:
        raise ValueError(f"all ranks must use the same activation dtype, got {dtypes}")

    outs = []
    for d, (src, tok, _slot, lexp) in enumerate(_sim_layout(topk_ids_list, num_experts)):
        # Gather A (the dispatched token rows) exactly as the exchange would deliver them.
        a = torch.empty(src.numel(), H, dtype=xs[d].dtype)
        for s in range(world):
            sel = (src == s).nonzero().reshape(-1)
            a[sel] = xs[s][tok[sel]]
        b0 = None if b0s is None else b0s[d]
        _check_bias("b0", b0, e_local, w0s[d].shape[1], d)
        outs.append(_expert_gemm(a, lexp, w0s[d], b0).to(xs[d].dtype))
    return outs


def layer1_sim(
    hs: Sequence[torch.Tensor],
    w1s: Sequence[torch.Tensor],
    topk_weights_list: Sequence[torch.Tensor],
    topk_ids_list: Sequence[torch.Tensor],
    num_experts: int,
    b1s: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> List[torch.Tensor]:
    """Second expert GEMM + weighted top-k reduce + combine on a simulated world.

    ``hs[d] [M_d, N1]`` in dispatch layout, ``w1s[d] [E_local, H, N1]``,
    ``topk_weights_list[s]`` / ``topk_ids_list[s]`` ``[T_s, k]``, optional ``b1s[d] [E_local, H]``
    expert biases (part of each slot's result, so weighted like it).
    Returns ``outs[s] [T_s, H]`` in the dtype of ``hs`` (all ``hs`` must share one dtype).
    """
    world = len(topk_ids_list)
    e_local = check_world(num_experts, world)
    _check_world_list("hs", hs, world)
    _check_world_list("w1s", w1s, world)
    _check_world_list("topk_weights_list", topk_weights_list, world)
    for r in range(world):
        check_routing(topk_ids_list[r], num_experts)
        _check_weights(topk_weights_list[r], topk_ids_list[r], r)
        _check_w1(w1s[r], e_local, r)
        _check_dtype(f"rank {r}: h", hs[r])
    dtypes = {h.dtype for h in hs}
    if len(dtypes) != 1:
        raise ValueError(f"all ranks must use the same activation dtype, got {dtypes}")
    (dtype,) = dtypes
    H = w1s[0].shape[1]
    if any(w.shape[1:] != w1s[0].shape[1:] for w in w1s):
        raise ValueError("all ranks must have the same W1 shape [E_local, H, N1]")
    layouts = _sim_layout(topk_ids_list, num_experts)

    # Each destination computes its rows' partial results (fp32).
    partial_rows = []
    for d, (src, tok, slot, lexp) in enumerate(layouts):
        h = hs[d]
        if h.dim() != 2 or h.shape[0] != src.numel() or h.shape[1] != w1s[d].shape[2]:
            raise ValueError(
                f"rank {d}: h must be [M_d={src.numel()}, N1={w1s[d].shape[2]}], got {tuple(h.shape)}"
            )
        b1 = None if b1s is None else b1s[d]
        _check_bias("b1", b1, e_local, H, d)
        partial_rows.append(_expert_gemm(h, lexp, w1s[d], b1))

    # Each row's fp32 result goes back to its (source, token, slot); sources reduce over slots.
    outs = []
    for s in range(world):
        T, k = topk_ids_list[s].shape
        partials = torch.zeros(T, k, H, dtype=acc_dtype(dtype))
        for d, (src, tok, slot, _lexp) in enumerate(layouts):
            sel = (src == s).nonzero().reshape(-1)
            partials[tok[sel], slot[sel]] = partial_rows[d][sel]
        outs.append(_combine(partials, topk_weights_list[s], topk_ids_list[s]).to(dtype))
    return outs


def moe_sim(
    xs: Sequence[torch.Tensor],
    w0s: Sequence[torch.Tensor],
    w1s: Sequence[torch.Tensor],
    topk_ids_list: Sequence[torch.Tensor],
    topk_weights_list: Sequence[torch.Tensor],
    num_experts: int,
    activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
) -> List[torch.Tensor]:
    """layer0 -> ``activation`` (per destination rank, on ``[M_d, N0]``) -> layer1."""
    y0s = layer0_sim(xs, w0s, topk_ids_list, num_experts)
    hs = [activation(y) for y in y0s]
    return layer1_sim(hs, w1s, topk_weights_list, topk_ids_list, num_experts)


# --------------------------------------------------------------------------------------------------
# torch.distributed form
# --------------------------------------------------------------------------------------------------
#
# Wire format: every tensor that crosses ranks is float32 (token rows are up-cast, which is exact for
# bf16/fp16, and cast back on arrival, which is exact too) or int64 (counts).  Not every
# torch.distributed backend handles 16-bit floats in all_to_all_single (older gloo builds reject
# bf16, and gloo rejects int16 so the "send the bits as int16" trick is not available), while
# float32/int64 work everywhere.  A reference does not care about the doubled traffic.


class _DistPlan:
    """Everything a rank knows about the exchange after the counts all-gather."""

    def __init__(
        self,
        topk_ids: torch.Tensor,
        num_experts: int,
        group,
        local_error: Optional[str],
        given_rows: int = -1,
    ):
        import torch.distributed as dist

        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.e_local = check_world(num_experts, self.world)
        W, EL, r = self.world, self.e_local, self.rank

        # Per rank: [rows sent to expert 0..E-1, error flag, rows of the layer1 input h (or -1)].
        # The flag and the row count let every rank raise when any rank's input is bad, instead of
        # the healthy ranks hanging in the next collective.
        mine = torch.zeros(num_experts + 2, dtype=torch.int64)
        if local_error is None:
            mine[:num_experts] = dispatch_counts(topk_ids, num_experts)
        else:
            mine[num_experts] = 1
        mine[num_experts + 1] = given_rows
        gathered = [torch.zeros_like(mine) for _ in range(W)]
        dist.all_gather(gathered, mine, group=group)
        allg = torch.stack(gathered)  # [W, E + 2]
        if local_error is not None:
            raise ValueError(local_error)
        bad = allg[:, num_experts].nonzero().reshape(-1).tolist()
        if bad:
            raise ValueError(f"invalid inputs on rank(s) {bad} of the group (see their error)")
        allc = allg[:, :num_experts].reshape(W, W, EL)  # [source, dest, local expert]
        rows_per_dest = allc.sum(dim=(0, 2))  # M_d of every rank
        given = allg[:, num_experts + 1]
        wrong = ((given >= 0) & (given != rows_per_dest)).nonzero().reshape(-1).tolist()
        if wrong:
            detail = ", ".join(
                f"rank {d}: h has {int(given[d])} rows, dispatch layout has {int(rows_per_dest[d])}"
                for d in wrong
            )
            raise ValueError(f"layer1 input h does not match the dispatch layout ({detail})")

        self.send_tokens, self.send_slots, _ = _send_order(topk_ids)
        self.send_splits = allc[r].sum(dim=1).tolist()  # rows to each dest
        self.recv_counts = allc[:, r, :]  # [source, local expert] rows arriving here
        self.recv_splits = self.recv_counts.sum(dim=1).tolist()  # rows from each source
        self.num_rows = int(self.recv_counts.sum())  # M_d

        # Received rows are grouped by source (rank order), inside a source by (local expert,
        # token, slot).  perm[i] = index in the receive buffer of dispatch row i.
        src_start = [0] * W
        for s in range(1, W):
            src_start[s] = src_start[s - 1] + self.recv_splits[s - 1]
        perm, lexp = [], []
        for le in range(EL):
            for s in ring_order(r, W):
                base = src_start[s] + int(self.recv_counts[s, :le].sum())
                n = int(self.recv_counts[s, le])
                perm.extend(range(base, base + n))
                lexp.extend([le] * n)
        self.perm = torch.tensor(perm, dtype=torch.int64)
        self.row_experts = torch.tensor(lexp, dtype=torch.int64)

    def exchange(self, send: torch.Tensor, forward: bool) -> torch.Tensor:
        """all_to_all_single of fp32 rows (fp64 rows stay fp64); ``forward`` = source -> dest,
        else dest -> source."""
        import torch.distributed as dist

        in_splits, out_splits = (
            (self.send_splits, self.recv_splits) if forward else (self.recv_splits, self.send_splits)
        )
        wire = acc_dtype(send.dtype)
        send = send.to(wire).contiguous()
        recv = torch.empty(sum(out_splits), send.shape[1], dtype=wire)
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        return recv


def _plan(topk_ids, num_experts, group, check: Callable[[], None], given_rows: int = -1) -> _DistPlan:
    """Run the local input checks, then build the plan (which all-gathers the error flags)."""
    try:
        check()
        error = None
    except ValueError as exc:
        error = str(exc)
    return _DistPlan(topk_ids, num_experts, group, error, given_rows)


def layer0_dist(
    x: torch.Tensor,
    w0: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    group=None,
) -> torch.Tensor:
    """Dispatch + first expert GEMM; call on every rank of ``group`` (None = default group).

    ``x [T, H]``, ``w0 [E_local, N0, H]`` (this rank's experts), ``topk_ids [T, k]``.
    Returns this rank's ``y0 [M_d, N0]`` in dispatch layout, dtype of ``x``.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)

    def check():
        e_local = check_world(num_experts, world)
        _check_tokens(x, topk_ids, num_experts, rank)
        _check_w0(w0, e_local, x.shape[1], rank)

    plan = _plan(topk_ids, num_experts, group, check)
    recv = plan.exchange(x[plan.send_tokens], forward=True)
    a = recv[plan.perm].to(x.dtype)  # dispatch layout; exact round trip through fp32
    return _expert_gemm(a, plan.row_experts, w0).to(x.dtype)


def layer1_dist(
    h: torch.Tensor,
    w1: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    group=None,
) -> torch.Tensor:
    """Second expert GEMM + weighted top-k reduce + combine; call on every rank of ``group``.

    ``h [M_d, N1]`` in this rank's dispatch layout, ``w1 [E_local, H, N1]``, and this rank's own
    tokens' ``topk_weights`` / ``topk_ids [T, k]``.  Returns ``out [T, H]`` in h's dtype.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)

    def check():
        e_local = check_world(num_experts, world)
        check_routing(topk_ids, num_experts)
        _check_weights(topk_weights, topk_ids, rank)
        _check_w1(w1, e_local, rank)
        _check_dtype(f"rank {rank}: h", h)
        if h.dim() != 2 or h.shape[1] != w1.shape[2]:
            raise ValueError(f"rank {rank}: h must be [M_d, N1={w1.shape[2]}], got {tuple(h.shape)}")

    # h's row count travels with the routing counts, so a mismatch on any rank fails on all ranks.
    plan = _plan(topk_ids, num_experts, group, check, given_rows=int(h.shape[0]) if h.dim() == 2 else -1)
    H = w1.shape[1]
    partial_rows = _expert_gemm(h, plan.row_experts, w1)  # fp32 [M_d, H], dispatch layout
    # Back to "grouped by source, then (local expert, token, slot)" and home to the sources.
    by_source = torch.empty_like(partial_rows)
    by_source[plan.perm] = partial_rows
    back = plan.exchange(by_source, forward=False)  # rows in this rank's send order
    T, k = topk_ids.shape
    partials = torch.zeros(T, k, H, dtype=acc_dtype(h.dtype))
    partials[plan.send_tokens, plan.send_slots] = back.reshape(-1, H)
    return _combine(partials, topk_weights, topk_ids).to(h.dtype)


def moe_dist(
    x: torch.Tensor,
    w0: torch.Tensor,
    w1: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
    group=None,
) -> torch.Tensor:
    """layer0 -> ``activation`` -> layer1 over a process group; returns this rank's ``[T, H]``."""
    y0 = layer0_dist(x, w0, topk_ids, num_experts, group=group)
    return layer1_dist(activation(y0), w1, topk_weights, topk_ids, num_experts, group=group)


# --------------------------------------------------------------------------------------------------
# Expert tensor parallelism (tp_size t > 1): the semantics in terms of the full experts
# --------------------------------------------------------------------------------------------------
#
# The group of W ranks is TP-innermost: rank r is tp rank r % t of EP rank r // t; the E experts
# are split over the EP = W / t EP ranks (E_local = E / EP each) and rank r holds shard r % t of
# each of its EP rank's experts: w0 rows [N0/t * (r%t), N0/t * (r%t + 1)), w1 columns likewise of
# N1. The MoE layer it computes is the one of the full experts (an elementwise activation applied
# to each shard of y0 is the activation of the full y0), so its reference is the per-token
# formula over the full weights (moe_tp_sim); the per-rank layout is tp_dispatch_rows.


def tp_dispatch_rows(topk_ids_list: Sequence[torch.Tensor], num_experts: int, dest: int,
                     tp: int) -> List[Row]:
    """The rows of rank ``dest`` with tp_size ``tp``, in dispatch order: the rows routed to its
    EP rank ``q = dest // tp`` from every one of the W sources, grouped by local expert, then by
    source in ring order from ``q * tp`` (the same on the tp ranks of q), then token, then slot."""
    world = len(topk_ids_list)
    if tp < 1 or world % tp:
        raise ValueError(f"tp_size={tp} must divide the group size {world}")
    ep = world // tp
    e_local = check_world(num_experts, ep)
    q = dest // tp
    rows: List[Row] = []
    for le in range(e_local):
        expert = q * e_local + le
        for s in ring_order(q * tp, world):
            for t, token_ids in enumerate(topk_ids_list[s].tolist()):
                for j, e in enumerate(token_ids):
                    if e == expert:
                        rows.append(Row(s, t, j, le))
    return rows


def tp_shard(w: torch.Tensor, world: int, tp: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s shard of a full per-expert tensor ``w [E, ...]``: its EP rank's experts, and
    along ``dim`` (1 or 2) the ``rank % tp``-th of ``tp`` equal pieces (contiguous copy)."""
    ep = world // tp
    e_local = check_world(w.shape[0], ep)
    q, r = rank // tp, rank % tp
    mine = w[q * e_local:(q + 1) * e_local]
    width = mine.shape[dim] // tp
    return mine.narrow(dim, r * width, width).contiguous()


def moe_tp_sim(
    xs: Sequence[torch.Tensor],
    w0: torch.Tensor,
    w1: torch.Tensor,
    topk_ids_list: Sequence[torch.Tensor],
    topk_weights_list: Sequence[torch.Tensor],
    activation: Callable[[torch.Tensor], torch.Tensor],
    b0: Optional[torch.Tensor] = None,
    b1: Optional[torch.Tensor] = None,
) -> List[torch.Tensor]:
    """The MoE layer over the full experts ``w0 [E, N0, H]``, ``w1 [E, H, N1]`` (biases
    ``[E, N0]`` / ``[E, H]``) for every rank's tokens: ``y0 = x @ W0[e]^T + b0[e]`` in fp32, cast
    to x's dtype; ``h = activation(y0)`` (elementwise); ``out[t] = sum_j w[t, j] * (h @ W1[e_j]^T
    + b1[e_j])`` in fp32, j ascending, dropped slots skipped, cast to x's dtype. What the ops with
    any tp_size compute, up to the fp32 rounding of dot products (and, with t > 1, the rounding of
    each tp rank's partial sum to the activation dtype before the home adds them)."""
    num_experts = w0.shape[0]
    outs = []
    for x, ids, wts in zip(xs, topk_ids_list, topk_weights_list):
        check_routing(ids, num_experts)
        T, k = ids.shape
        flat = ids.to(torch.int64).reshape(-1)
        rows = x.repeat_interleave(k, dim=0) if T else x.new_zeros(0, x.shape[1])
        experts = flat.clamp(min=0)
        y0 = _expert_gemm(rows, experts, w0, b0).to(x.dtype)
        h = activation(y0)
        part = _expert_gemm(h, experts, w1, b1).reshape(T, k, w1.shape[1])
        outs.append(_combine(part, wts, ids).to(x.dtype))
    return outs
