"""layer1's reduction order, written down once more from docs/design.md ("The layer1 reduction order") and
nothing else: an fp32 implementation in plain torch element-wise ops (every op one IEEE rounding,
no fused multiply-add), independent of the engine's code, so that a test can demand the op's bits.

The order, for a token t of home rank d:
 1. GEMM (each expert rank, each dispatched row): C[row, n] = dot(h[row], w1[e][n]) + b1[e][n],
    the dot product over K = N1 in 8 interleaved fp32 lanes (lane l takes K indices l, l+8, ...
    in ascending order, starting from 0), combined as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); the
    bias is added last. C stays fp32.
 2. Partial (each rank s holding at least one of t's slots): acc = 0; for the slots j of t in
    ascending j whose expert lives on s: acc += float(topk_weights[t, j]) * C[row(t, j)];
    rounded once to the activation dtype.
 3. Node-reduced only (several nodes, node_reduce): for each other node B than d's, the partials
    of B's ranks are added in fp32 in ascending rank from 0 and rounded once more: one partial
    per (token, node).
 4. Home: acc = 0; acc += each partial in ascending contributor order (rank; a node-reduced node
    counts at its first rank); rounded to the output dtype.

Column bands, tiles, block splits and thread teams change only who computes which piece, never
this order: nothing here takes them (a future `band_n` needs no parameter either)."""
from __future__ import annotations

import torch

LANES = 8


def fixed_order_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """a [rows, K] @ b [N, K]^T (+ bias [N]) in the stated lane order; fp32 in, fp32 out."""
    rows, k = a.shape
    lanes = [torch.zeros(rows, b.shape[0], dtype=torch.float32) for _ in range(LANES)]
    for i in range(k):
        prod = a[:, i, None] * b[None, :, i]  # rounded product, then a rounded add: no FMA
        lanes[i % LANES] = lanes[i % LANES] + prod
    l = lanes
    out = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    if bias is not None:
        out = out + bias[None, :]
    return out


def layer1_exact(hs, w1s, wts, ids, num_experts, rows_of, *, b1s=None, ranks_per_node=None,
                 node_reduce=False, w1_transposed=False):
    """The op's output on every rank, bit for bit (fp32 accumulation; bf16/fp16 activations).

    hs[r] [M_r, N1] rank r's dispatched rows; w1s[r] [E_local, H, N1] (or [E_local, N1, H]
    transposed); wts[r], ids[r] [T_r, k]; rows_of(dest, source, token, slot) -> the row of that
    slot in dest's dispatch layout. ranks_per_node None: one node."""
    world = len(hs)
    el = num_experts // world
    rpn = ranks_per_node or world
    reduced = node_reduce and rpn < world
    dtype = hs[0].dtype
    outs = []
    for d in range(world):
        T, k = ids[d].shape
        H = w1s[d].shape[2] if w1_transposed else w1s[d].shape[1]
        out = torch.zeros(T, H, dtype=torch.float32)
        for t in range(T):
            slots = [(j, int(ids[d][t, j])) for j in range(k) if int(ids[d][t, j]) >= 0]
            senders = sorted({e // el for _, e in slots})
            partial = {}
            for s in senders:  # step 2
                acc = torch.zeros(H, dtype=torch.float32)
                for j, e in slots:
                    if e // el != s:
                        continue
                    w = w1s[s][e % el].float()
                    w = w.t() if w1_transposed else w  # [H, N1]
                    bias = None if b1s is None else b1s[s][e % el].float()
                    c = fixed_order_gemm(hs[s][rows_of(s, d, t, j)].float()[None, :], w, bias)[0]
                    acc = acc + float(wts[d][t, j].float()) * c
                partial[s] = acc.to(dtype).float()
            contributions = []  # (key, partial) in the home's order
            for s in senders:
                same_node = s // rpn == d // rpn
                if not reduced or same_node:
                    contributions.append((s, partial[s]))
                elif not any(key == s // rpn * rpn for key, _ in contributions):  # step 3
                    acc = torch.zeros(H, dtype=torch.float32)
                    for s2 in senders:
                        if s2 // rpn == s // rpn:
                            acc = acc + partial[s2]
                    contributions.append((s // rpn * rpn, acc.to(dtype).float()))
            acc = torch.zeros(H, dtype=torch.float32)
            for _, p in sorted(contributions, key=lambda kp: kp[0]):  # step 4
                acc = acc + p
            out[t] = acc
        outs.append(out.to(dtype))
    return outs


def rows_from_reference(ids, num_experts):
    """rows_of for layer1_exact from comet.reference's dispatch layout (not the op's)."""
    from comet import reference as ref

    world = len(ids)
    where = {}
    for dest in range(world):
        for i, row in enumerate(ref.dispatch_rows(ids, num_experts, dest)):
            where[(dest, row.source, row.token, row.slot)] = i
    return lambda dest, source, token, slot: where[(dest, source, token, slot)]
