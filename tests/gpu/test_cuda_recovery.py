"""Recovery of the CUDA buffer after a failed call (docs/reliability.md, "After a failure"): a
timed-out wait records and returns instead of trapping, so the context survives; every rank calls
Buffer.recover() and the group's default buffer serves ten calls equal to the reference. Written,
never run (no GPU where it was written). Skips without a GPU (see conftest.py for the command)."""
import os

import pytest
import torch
import torch.distributed as dist

import comet
from comet.buffers import symm_cuda
from tests.cases import cases_for
from tests.gpu.test_cuda_ops import check_against_reference, run_layers

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
CASE = cases_for(WORLD)[0]


def _ten_good_calls(rank, world):
    for _ in range(10):
        check_against_reference(CASE, torch.bfloat16, rank, world,
                                *run_layers(CASE, torch.bfloat16, rank))


def test_recover_on_a_healthy_buffer_is_one_collective_rearm(world):
    rank, w = world
    buf = symm_cuda.buffer_for(None)
    before = buf.recoveries
    buf.recover()
    assert buf.recoveries == before + 1 and not buf.needs_recovery
    _ten_good_calls(rank, w)


@pytest.mark.skipif(WORLD < 2, reason="needs 2 or more ranks (torchrun)")
def test_extra_call_times_out_then_recover_and_ten_good_calls(world):
    rank, w = world
    buf = symm_cuda.buffer_for(None)
    buf.set_timeout(2.0)
    try:
        before = buf.recoveries
        if rank == w - 1:  # one call more than its peers: its wait for their metadata times out
            xs, w0s, _, ids, _ = run_layers(CASE, torch.bfloat16, rank)[4]
            dev = torch.device("cuda", torch.cuda.current_device())
            with pytest.raises(RuntimeError, match="gave up"):
                comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev),
                                 num_experts=CASE.experts)
                torch.cuda.synchronize()
            assert buf.needs_recovery
            with pytest.raises(RuntimeError, match="needs re-arming"):
                comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev),
                                 num_experts=CASE.experts)
        else:
            run_layers(CASE, torch.bfloat16, rank)
        dist.barrier()
        buf.recover()
        assert buf.recoveries == before + 1 and not buf.needs_recovery
        _ten_good_calls(rank, w)
    finally:
        buf.set_timeout(60.0)


@pytest.mark.skipif(WORLD < 2, reason="needs 2 or more ranks (torchrun)")
def test_layout_moved_between_ranks_fails_without_a_trap_then_recover(world):
    """A row moved from rank 0's layout to rank 1's (the group's totals still agree, so the
    metadata verdict passes): the publish kernels find that the peers' routing does not send
    their layout's rows, record it and return (no trap: the CUDA context survives); rank 0 or 1
    reports the layout error, every rank calls recover(), and ten good calls follow."""
    rank, w = world
    dev = torch.device("cuda", torch.cuda.current_device())
    E, K, T, H, N = 2 * w, 2, 8, 64, 32
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    w0 = (torch.randn(E // w, N, H, generator=g) / 4).to(torch.bfloat16).to(dev)
    w1 = (torch.randn(E // w, H, N, generator=g) / 4).to(torch.bfloat16).to(dev)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[0, 0], ids[0, 1] = 0, E // w  # every rank sends rows to ranks 0 and 1
    ids, wts = ids.to(dev), torch.rand(T, K, generator=g).to(dev)
    buf = symm_cuda.buffer_for(None)
    buf.set_timeout(2.0)
    try:
        y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E)
        rc, h = layout.recv_counts.clone(), y0
        if rank in (0, 1):
            cell = int((rc.flatten() > 0).nonzero()[0])
            rc.view(-1)[cell] += 1 if rank == 1 else -1
            h = torch.cat([y0, y0[:1]]) if rank == 1 else y0[:-1]
        torch.ops.comet.moe_layer1(h, w1, wts, ids, layout.send_pos, rc, E, buf.handle, 2, 0,
                                   128, 128)
        torch.cuda.synchronize()  # no trap: the context survives
        msg = ""
        try:
            buf.check()
        except RuntimeError as e:
            msg = str(e)
        if rank in (0, 1):
            assert buf.needs_recovery, msg
            assert ("the peers' routing sends rank" in msg and "its layout (recv_counts) "
                    "dispatches" in msg) or "gave up" in msg, msg
        names = [None] * w
        dist.all_gather_object(names, "the peers' routing sends rank" in msg)
        assert any(names[:2]), names  # an edited layout's rank named the mismatch
        dist.barrier()
        buf.recover()
        assert not buf.needs_recovery
        _ten_good_calls(rank, w)
    finally:
        buf.set_timeout(60.0)
