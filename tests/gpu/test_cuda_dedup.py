"""layer0's dispatch on the GPU sends a token once per destination rank (comm_layer0.h): the same
bits as with one row per slot ($COMET_LAYER0_DEDUP=0), bf16 and FP8 rows (dispatch_fp8), several
n_comm including the staged layer (0), and Buffer.traffic() equal to the distinct (token, rank)
pairs counted here from the routing. One process per GPU (see conftest.py); a world of one
checks the local fan-out and a traffic of zero. Skips without a GPU."""
import pytest
import torch

import comet
from comet import fp8
from tests.gpu.conftest import all_gather_cpu, require_fp8


def _routing(world, E, k, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = []
    for r in range(world):
        t = torch.randint(0, E, (T, k), generator=g)
        t = torch.where(torch.rand(T, k, generator=g) < 0.2, -1, t)
        t[0] = torch.arange(k) % 2 + (E - 2)  # every slot on the last rank's experts
        t[1, 1] = t[1, 0]                     # the same expert twice
        t[2] = -1                             # all dropped
        ids.append(t.to(torch.int32))
    return ids


def _run(rank, world, ids, E, dedup, monkeypatch, n_comm, fp8_rows):
    monkeypatch.setenv("COMET_LAYER0_DEDUP", "1" if dedup else "0")
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(100 + rank)
    H, N = 256, 256
    el = E // world
    x = torch.randn(ids[rank].shape[0], H, generator=g).to(torch.bfloat16).to(dev)
    w0 = (torch.randn(el, N, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(dev)
    w1 = (torch.randn(el, H, N, generator=g) / N ** 0.5).to(torch.bfloat16).to(dev)
    wt = torch.rand(ids[rank].shape, generator=g).to(dev)
    buf = comet.buffer_for()
    if fp8_rows:
        w0q, w0s = fp8.quantize_blocks(w0)
        y0, layout = comet.moe_layer0(x, w0q, ids[rank].to(dev), num_experts=E, n_comm=n_comm,
                                      w0_scale=w0s, dispatch_fp8=True)
        out = None
    else:
        y0, layout = comet.moe_layer0(x, w0, ids[rank].to(dev), num_experts=E, n_comm=n_comm)
    tr0 = buf.traffic()
    if not fp8_rows:
        out = comet.moe_layer1(torch.tanh(y0.float()).to(torch.bfloat16), w1, wt, layout,
                               n_comm=n_comm)
    torch.cuda.synchronize()
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return cpu(y0), cpu(layout.row_source), cpu(layout.row_token), cpu(out), tr0, buf.traffic()


@pytest.mark.parametrize("fp8_rows", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n_comm", [None, 0, 2])
def test_same_bits_as_one_row_per_slot_and_traffic(world, monkeypatch, n_comm, fp8_rows):
    rank, W = world
    if fp8_rows:
        require_fp8()
    E, k, T = 4 * W, 4, 37
    ids = _routing(W, E, k, T, seed=W)
    on = _run(rank, W, ids, E, True, monkeypatch, n_comm, fp8_rows)
    off = _run(rank, W, ids, E, False, monkeypatch, n_comm, fp8_rows)
    for a, b in zip(on[:4], off[:4]):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    el = E // W
    pairs = sum(any(e >= 0 and e // el == rank for e in row)
                for s in range(W) if s != rank for row in ids[s].tolist())
    row_bytes = fp8.row_bytes(256) if fp8_rows else 256 * 2
    assert on[4][:2] == (pairs, pairs * row_bytes)
    if not fp8_rows:
        assert on[5][2:] == (pairs, pairs * 256 * 2)
    all_gather_cpu(on[4], W)  # every rank reaches the end together
