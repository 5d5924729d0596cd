"""Train a tiny expert-parallel MoE (comet.nn.MoE) on a toy regression task, on CPU ranks.

    python examples/train_moe.py                 # spawns 2 CPU ranks (gloo on 127.0.0.1)
    python examples/train_moe.py --world 4 --steps 100
    torchrun --nproc-per-node 2 examples/train_moe.py   # or let torchrun start the ranks

Task: tokens come from C clusters; the target of a token is a cluster-specific nonlinear map of it,
so a router that sends each cluster to its own experts wins. Each rank draws its own tokens (data
parallel over the expert-parallel group), the experts are sharded over the ranks, the router is
replicated; after backward, comet.nn.allreduce_gradients averages the router's gradients and
rescales the expert gradients so every rank steps on the gradient of the global mean loss.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist

import comet
import comet.nn


def toy_batch(gen: torch.Generator, centers, maps, tokens: int):
    c = torch.randint(0, centers.shape[0], (tokens,), generator=gen)
    x = centers[c] + 0.3 * torch.randn(tokens, centers.shape[1], generator=gen)
    y = torch.tanh(torch.einsum("th,thg->tg", x, maps[c]))
    return x, y


def train(rank: int, world: int, steps: int = 60, *, hidden: int = 16, ffn: int = 32,
          experts: int = 4, topk: int = 2, tokens: int = 64, lr: float = 1e-2,
          log: bool = True) -> list[float]:
    """One rank's training loop (torch.distributed already initialised). Returns the global mean
    loss of every step (identical on every rank)."""
    torch.manual_seed(0)
    task = torch.Generator().manual_seed(1234)  # the task is the same on every rank
    centers = 2.0 * torch.randn(4, hidden, generator=task)
    maps = torch.randn(4, hidden, hidden, generator=task) / hidden ** 0.5
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens

    moe = comet.nn.MoE(hidden, ffn, experts, topk, renormalize=True, aux_loss_coeff=1e-2,
                       init_std=0.1, seed=0)
    opt = torch.optim.Adam(moe.parameters(), lr=lr)
    history = []
    for step in range(steps):
        x, y = toy_batch(data, centers, maps, tokens)
        out = moe(x)
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # backward through both fused ops (+ the attached aux loss)
        comet.nn.allreduce_gradients(moe)
        opt.step()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        history.append(float(mean))
        if log and rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {history[-1]:.4f}  aux {float(moe.aux_loss):.4f}",
                  flush=True)
    return history


def _spawned(rank: int, world: int, port: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        train(rank, world, steps)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args.steps)
        finally:
            dist.destroy_process_group()
        return
    # One intra-op thread per rank: the ranks share this host's cores with comet's blocks.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(args.world, port, args.steps), nprocs=args.world)


if __name__ == "__main__":
    main()
