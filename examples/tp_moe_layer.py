"""One MoE layer with expert tensor parallelism on 4 CPU ranks: EP 2 x TP 2 (gloo on 127.0.0.1).

    python examples/tp_moe_layer.py
    torchrun --nproc-per-node 4 examples/tp_moe_layer.py

The group of 4 ranks is TP-innermost: ranks 0, 1 are tp ranks 0, 1 of EP rank 0 (experts 0-2),
ranks 2, 3 those of EP rank 1 (experts 3-5). Every rank brings its own tokens and holds its
shard of its EP rank's experts: w0 [E_local, N0 / 2, H] (its gate rows and its up rows, so SwiGLU
applies per shard), w1 [E_local, H, N1 / 2]. layer0 gives both tp ranks of an EP rank the same
rows; layer1 returns each token's full sum over the shards and the top-k slots to its home rank.
Each rank checks its output and its gradients against comet.reference over the full experts.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

# Run from a checkout: this repository's comet before any installed one.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import comet  # noqa: E402
from comet import reference as ref  # noqa: E402
from comet.nn import swiglu  # noqa: E402

E, K, H, F, TP = 6, 2, 32, 16, 2  # experts, top-k, hidden, FFN width (w0 has 2F rows), tp_size


def full_experts():
    g = torch.Generator().manual_seed(0)  # the same full experts on every rank
    return (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5,
            torch.randn(E, H, F, generator=g) / F ** 0.5)


def my_shards(w0, w1, rank, world):
    """Rank `rank`'s experts (its EP rank's) and its tp shard of them."""
    el, q, r, f = E // (world // TP), rank // TP, rank % TP, F // TP
    w0, w1 = w0[q * el:(q + 1) * el], w1[q * el:(q + 1) * el]
    gate, up = w0.chunk(2, dim=1)
    w0r = torch.cat([gate[:, r * f:(r + 1) * f], up[:, r * f:(r + 1) * f]], dim=1)
    return w0r.contiguous(), w1[:, :, r * f:(r + 1) * f].contiguous()


def tokens_of(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8 + 3 * rank, H, generator=g)
    weights, ids = torch.topk(torch.softmax(torch.randn(x.shape[0], E, generator=g), -1), K)
    return x, ids, weights


def run(rank: int, world: int) -> float:
    buf = comet.Buffer(tp_size=TP)  # the default group; rank r: EP r // 2, tp r % 2
    w0, w1 = full_experts()
    w0r, w1r = (w.requires_grad_(True) for w in my_shards(w0, w1, rank, world))
    x, ids, weights = tokens_of(rank)
    x.requires_grad_(True)

    y0, layout = comet.moe_layer0(x, w0r, ids, num_experts=E, buffer=buf)  # y0 [M, 2F / 2]
    out = comet.moe_layer1(swiglu(y0), w1r, weights, layout, buffer=buf)   # out [T, H]
    out.square().sum().backward()

    # The reference: the whole layer over the full experts, every rank's tokens (all ranks run it).
    xs, ids_all, w_all = zip(*(tokens_of(r) for r in range(world)))
    xs = [t.clone().requires_grad_(True) for t in xs]
    w0f, w1f = w0.clone().requires_grad_(True), w1.clone().requires_grad_(True)
    outs = ref.moe_tp_sim(xs, w0f, w1f, ids_all, w_all, ref.swiglu)
    sum(o.square().sum() for o in outs).backward()
    dw0, dw1 = my_shards(w0f.grad, w1f.grad, rank, world)
    err = max((out - outs[rank]).abs().max(), (x.grad - xs[rank].grad).abs().max(),
              (w0r.grad - dw0).abs().max(), (w1r.grad - dw1).abs().max()).item()
    print(f"rank {rank} (EP {rank // TP}, tp {rank % TP}): {x.shape[0]} tokens, "
          f"{layout.num_rows} rows, y0 {tuple(y0.shape)}, out {tuple(out.shape)}; "
          f"max |difference| to the reference (out, dx, dw0, dw1): {err:.2e}", flush=True)
    return err


def _spawned(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        assert run(rank, world) < 1e-4
    finally:
        dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            run(dist.get_rank(), dist.get_world_size())
        finally:
            dist.destroy_process_group()
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(4, port), nprocs=4)


if __name__ == "__main__":
    main()
