"""One expert-parallel MoE layer forward, three ways, on one rank of a torch.distributed group:

* ``sequential``: Megatron-style: permute tokens by expert, all-to-all the counts, all-to-all the
  rows, grouped GEMM (one matmul per local expert), activation, grouped GEMM, all-to-all back,
  un-permute and weighted top-k combine. Nothing overlaps.
* ``pipelined``: Tutel-style coarse pipeline: the tokens split into ``c`` chunks, each chunk
  going through the same steps; chunk ``i+1``'s dispatch all-to-all and chunk ``i-1``'s combine
  all-to-all run asynchronously (``async_op=True``: gloo's worker threads on the CPU, NCCL's stream
  on a GPU) while chunk ``i``'s GEMMs run here.
* ``comet_forward``: ``comet.moe_layer0`` -> activation -> ``comet.moe_layer1``.

Plus the parts alone for the measured limit: ``comm_only`` (the three all-to-alls of the
sequential form, nothing else) and ``gemm_only`` (its grouped GEMMs and activation on rows that
are already in place). Every form uses the same activation (SwiGLU on the gated layer0 output)
and fp32 accumulation (torch matmul in the input dtype, fp32 for fp32 inputs).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from comet import reference as ref

swiglu = ref.swiglu


def make_inputs(rank: int, world: int, shape: Dict, tokens: int, dtype: torch.dtype,
                dev: torch.device, seed: int = 0):
    """This rank's tokens, softmax-top-k routing and local expert weights (seeded by rank)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    E, k, H, N0, N1 = shape["E"], shape["k"], shape["H"], shape["N0"], shape["N1"]
    El = E // world
    x = torch.randn(tokens, H, generator=g)
    weights, ids = ref.route(torch.randn(tokens, E, generator=g), k, renormalize=True)
    w0 = torch.randn(El, N0, H, generator=g) / H ** 0.5
    w1 = torch.randn(El, H, N1, generator=g) / N1 ** 0.5
    to = dict(device=dev, dtype=dtype)
    return dict(x=x.to(**to), ids=ids.to(dev), weights=weights.to(dev), w0=w0.to(**to),
                w1=w1.to(**to), E=E, El=El, k=k, H=H)


class Plan:
    """Routing of one chunk of tokens: send order, split sizes and the row bookkeeping."""

    def __init__(self, ids: torch.Tensor, counts: torch.Tensor, recv_counts: torch.Tensor,
                 world: int, El: int):
        k = ids.shape[1]
        self.k, self.T, self.world, self.El = k, ids.shape[0], world, El
        flat = ids.reshape(-1)
        self.order = torch.argsort(flat, stable=True)  # by global expert = (dest rank, local e)
        self.src_token = torch.div(self.order, k, rounding_mode="floor")
        cnt = counts.view(world, El)
        self.send_splits = cnt.sum(1).tolist()
        self.rc = recv_counts.view(world, El)  # [source, local expert]
        self.recv_splits = self.rc.sum(1).tolist()
        self.chunk_sizes = self.rc.reshape(-1).tolist()  # (source, local expert) source-major
        self.rows_per_expert = self.rc.sum(0).tolist()

    def to_experts(self, recv: torch.Tensor) -> List[torch.Tensor]:
        """Received rows (source-major) -> one tensor per local expert."""
        chunks = recv.split(self.chunk_sizes)
        W, El = self.world, self.El
        return [torch.cat([chunks[s * El + e] for s in range(W)]) if W > 1 else chunks[e]
                for e in range(El)]

    def to_sources(self, per_expert: List[torch.Tensor]) -> torch.Tensor:
        """Inverse of to_experts: per-expert outputs -> rows in source-major order."""
        W, El = self.world, self.El
        parts = [p.split(self.rc[:, e].tolist()) for e, p in enumerate(per_expert)]
        return torch.cat([parts[e][s] for s in range(W) for e in range(El)])


def _exchange_counts(ids_chunks: List[torch.Tensor], E: int, world: int,
                     group) -> Tuple[list, list]:
    """One all-to-all of every chunk's per-expert row counts; returns (sent, received) per chunk."""
    El = E // world
    c = len(ids_chunks)
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids_chunks])  # [c, E]
    send = counts.view(c, world, El).permute(1, 0, 2).contiguous()  # [dest, c, El]
    recv = torch.empty_like(send)  # [source, c, El]
    dist.all_to_all_single(recv, send, group=group)
    return [counts[i] for i in range(c)], [recv[:, i, :].contiguous() for i in range(c)]


def _experts_ffn(rows: List[torch.Tensor], w0: torch.Tensor,
                 w1: torch.Tensor) -> List[torch.Tensor]:
    """Grouped GEMM -> SwiGLU -> grouped GEMM, one matmul per local expert."""
    return [swiglu(r @ w0[e].t()) @ w1[e].t() for e, r in enumerate(rows)]


def _combine(back: torch.Tensor, plan: Plan, weights: torch.Tensor) -> torch.Tensor:
    partial = torch.empty(plan.T * plan.k, back.shape[1], dtype=torch.float32, device=back.device)
    partial[plan.order] = back.float()
    w = weights.float().unsqueeze(-1)
    return (partial.view(plan.T, plan.k, -1) * w).sum(1)


def sequential(inp: Dict, world: int, group=None) -> torch.Tensor:
    x, ids, E, El = inp["x"], inp["ids"], inp["E"], inp["El"]
    (counts,), (rc,) = _exchange_counts([ids], E, world, group)
    plan = Plan(ids, counts, rc, world, El)
    send = x[plan.src_token]
    recv = x.new_empty(sum(plan.recv_splits), x.shape[1])
    dist.all_to_all_single(recv, send, plan.recv_splits, plan.send_splits, group=group)
    out_rows = plan.to_sources(_experts_ffn(plan.to_experts(recv), inp["w0"], inp["w1"]))
    back = x.new_empty(send.shape[0], x.shape[1])
    dist.all_to_all_single(back, out_rows, plan.send_splits, plan.recv_splits, group=group)
    return _combine(back, plan, inp["weights"]).to(x.dtype)


def pipelined(inp: Dict, world: int, chunks: int, group=None) -> torch.Tensor:
    """Tutel-style: ``chunks`` token chunks, comm of one chunk overlapped with GEMMs of another."""
    x, ids, E, El = inp["x"], inp["ids"], inp["E"], inp["El"]
    T = x.shape[0]
    bounds = [(T * i) // chunks for i in range(chunks + 1)]
    ids_c = [ids[bounds[i]:bounds[i + 1]] for i in range(chunks)]
    counts, rcs = _exchange_counts(ids_c, E, world, group)
    plans = [Plan(ids_c[i], counts[i], rcs[i], world, El) for i in range(chunks)]

    def dispatch(i):
        p = plans[i]
        send = x[bounds[i]:bounds[i + 1]][p.src_token]
        recv = x.new_empty(sum(p.recv_splits), x.shape[1])
        work = dist.all_to_all_single(recv, send, p.recv_splits, p.send_splits, group=group,
                                      async_op=True)
        return send, recv, work

    combines = []
    pending = dispatch(0)
    for i in range(chunks):
        send, recv, work = pending
        if i + 1 < chunks:
            pending = dispatch(i + 1)  # in flight while this chunk computes
        work.wait()
        p = plans[i]
        rows = p.to_sources(_experts_ffn(p.to_experts(recv), inp["w0"], inp["w1"]))
        back = x.new_empty(send.shape[0], x.shape[1])
        combines.append((back, dist.all_to_all_single(back, rows, p.send_splits, p.recv_splits,
                                                      group=group, async_op=True)))
        del send
    outs = []
    for i, (back, work) in enumerate(combines):
        work.wait()
        outs.append(_combine(back, plans[i], inp["weights"][bounds[i]:bounds[i + 1]]))
    return torch.cat(outs).to(x.dtype)


def comet_forward(inp: Dict, n_comm=None, tile=None, buffer=None) -> torch.Tensor:
    import comet

    y0, layout = comet.moe_layer0(inp["x"], inp["w0"], inp["ids"], num_experts=inp["E"],
                                  n_comm=n_comm, tile=tile, buffer=buffer)
    return comet.moe_layer1(swiglu(y0), inp["w1"], inp["weights"], layout, n_comm=n_comm,
                            tile=tile, buffer=buffer)


def quantized_weights(inp: Dict) -> Dict:
    """w0 / w1 in comet's FP8 format (comet.fp8.quantize_blocks), once, as inference keeps them."""
    from comet import fp8

    return dict(w0=fp8.quantize_blocks(inp["w0"]), w1=fp8.quantize_blocks(inp["w1"]))


def comet_forward_fp8(inp: Dict, q: Dict, n_comm=None, tile=None, buffer=None):
    """comet_forward in FP8: the bf16 tokens quantised on dispatch (their rows travel as FP8 with
    their scales), FP8 weights `q`, the SwiGLU output quantised per row; result in x's dtype."""
    import comet
    from comet import fp8

    (w0, s0), (w1, s1) = q["w0"], q["w1"]
    dtype = inp["x"].dtype
    y0, layout = comet.moe_layer0(inp["x"], w0, inp["ids"], num_experts=inp["E"], w0_scale=s0,
                                  dispatch_fp8=True, out_dtype=dtype, n_comm=n_comm, tile=tile,
                                  buffer=buffer)
    h, hs = fp8.quantize_rows(swiglu(y0))
    return comet.moe_layer1(h, w1, inp["weights"], layout, n_comm=n_comm, tile=tile,
                            buffer=buffer, h_scale=hs, w1_scale=s1, out_dtype=dtype)


def parts(inp: Dict, world: int, group=None):
    """(comm_only, gemm_only) callables for this rank's routing: the three all-to-alls of
    ``sequential`` on prepared buffers, and its grouped GEMMs + activation on prepared rows."""
    x, ids, E, El = inp["x"], inp["ids"], inp["E"], inp["El"]
    (counts,), (rc,) = _exchange_counts([ids], E, world, group)
    plan = Plan(ids, counts, rc, world, El)
    send = x[plan.src_token].contiguous()
    recv = x.new_empty(sum(plan.recv_splits), x.shape[1])
    back = x.new_empty(send.shape[0], x.shape[1])
    rows = [r.contiguous() for r in plan.to_experts(recv.normal_())]
    out_rows = torch.randn(recv.shape, dtype=x.dtype, device=x.device)
    cnt_send = torch.zeros(world, 1, El, dtype=torch.int64, device=x.device)
    cnt_recv = torch.empty_like(cnt_send)

    def comm_only():
        dist.all_to_all_single(cnt_recv, cnt_send, group=group)
        dist.all_to_all_single(recv, send, plan.recv_splits, plan.send_splits, group=group)
        dist.all_to_all_single(back, out_rows, plan.send_splits, plan.recv_splits, group=group)

    def gemm_only():
        _experts_ffn(rows, inp["w0"], inp["w1"])

    return comm_only, gemm_only, sum(plan.rows_per_expert)


def comet_local(inp: Dict, launch0: tuple, launch1: tuple):
    """Comet's forward on a world of one (a private simulated buffer): every expert local, the
    same rows (this rank's T*k) and the same launch configs, no peer traffic. Its time is the
    CPU backend's compute floor for this shape (tile GEMMs + local copies + activation)."""
    import comet

    buf = comet.Buffer.simulated_world(1)[0]
    g = torch.Generator().manual_seed(7)
    E, H = inp["E"], inp["H"]
    N0, N1 = inp["w0"].shape[1], inp["w1"].shape[2]
    to = dict(device=inp["x"].device, dtype=inp["x"].dtype)
    w0 = (torch.randn(E, N0, H, generator=g) / H ** 0.5).to(**to)
    w1 = (torch.randn(E, H, N1, generator=g) / N1 ** 0.5).to(**to)
    x, ids, wts = inp["x"], inp["ids"], inp["weights"]

    def run():
        y0, _a, rc, sp, *_ = torch.ops.comet.moe_layer0(x, w0, ids, E, buf.handle, *launch0)
        return torch.ops.comet.moe_layer1(swiglu(y0), w1, wts, ids, sp, rc, E, buf.handle,
                                          *launch1)

    run.buffer = buf  # keep it alive as long as the callable
    return run
