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
