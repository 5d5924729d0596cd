"""Expert placement (placement=) on the CUDA kernels, one process per GPU (see conftest.py for the
command). Written, never run here (no GPU on this project's machines).

The same path as the CPU backend (comet/layers/placed.py: virtual slot ids and zero-padded
weights before the kernels, reduction by slot after layer1, the placement's fingerprint in the
call metadata the kernels' prologue checks): bf16 out against a dense reference, bitwise equal
across the contiguous map, a replicated placement and (W >= 2) one with a rank holding no
expert; placements that differ across ranks raise on every rank."""
import os

import pytest
import torch

import comet
from comet.plan import Placement

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
H, N, K = 64, 32, 2
TOL = dict(atol=2e-2, rtol=2e-2)


def experts(world):
    return 2 * world


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _buffer():
    from comet.buffers import symm_cuda

    return symm_cuda.buffer_for(None, _device())


def placements(world=WORLD):
    E = experts(world)
    ps = {"contiguous": Placement.contiguous(E, world),
          "replicated": Placement([list(range(world))] + [[e // 2] for e in range(1, E)],
                                  world=world)}
    if world >= 2:  # the last rank holds nothing; rank 0 takes its experts
        ps["zero"] = Placement([[min(e // 2, world - 2)] for e in range(E)], world=world)
    return ps


def inputs(rank, world=WORLD):
    E = experts(world)
    g = torch.Generator().manual_seed(5)
    w0 = (torch.randn(E, N, H, generator=g) / H ** 0.5).bfloat16()
    w1 = (torch.randn(E, H, N, generator=g) / N ** 0.5).bfloat16()
    gr = torch.Generator().manual_seed(100 + rank)
    T = 48 + 7 * rank
    x = torch.randn(T, H, generator=gr).bfloat16()
    ids = torch.topk(torch.randn(T, E, generator=gr) - torch.arange(E).float().log1p(), K,
                     dim=1).indices.int()
    ids = torch.where(torch.rand(T, K, generator=gr) < 0.2, -1, ids)
    return x, w0, w1, ids, torch.rand(T, K, generator=gr)


def reference(x, w0, w1, ids, wts):
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            if e >= 0:
                h = torch.tanh(x[t].double() @ w0[e].double().T)
                out[t] += float(wts[t, j]) * (h @ w1[e].double().T)
    return out


def run(rank, p, buffer=None):
    """Both layers with placement p on rank `rank` of p's world (buffer: the group's default)."""
    x, w0, w1, ids, wts = inputs(rank, p.world)
    buffer = buffer or _buffer()
    dev, mine = buffer.device, list(p.local_experts(rank))
    y0, layout = comet.moe_layer0(x.to(dev), w0[mine].contiguous().to(dev), ids.to(dev),
                                  num_experts=experts(p.world), placement=p, buffer=buffer)
    h = torch.tanh(y0.float()).to(y0.dtype)
    return comet.moe_layer1(h, w1[mine].contiguous().to(dev), wts.to(dev), layout,
                            buffer=buffer).cpu()


def test_out_is_bitwise_equal_across_placements(world):
    rank, _ = world
    x, w0, w1, ids, wts = inputs(rank)
    outs = {name: run(rank, p) for name, p in placements().items()}
    torch.testing.assert_close(outs["contiguous"].double(), reference(x, w0, w1, ids, wts), **TOL)
    for name, out in outs.items():
        assert torch.equal(out, outs["contiguous"]), name


@pytest.mark.skipif(WORLD < 2, reason="needs two ranks to disagree")
def test_placements_that_differ_raise_on_every_rank(world):
    rank, _ = world
    ps = placements()
    with pytest.raises((ValueError, RuntimeError), match="placement"):
        run(rank, ps["replicated"] if rank == 1 else ps["contiguous"])
