"""Forward progress beside another kernel (comet/block_roles.h): both fused layers run while a long
loop of large matmuls on a side stream holds most SMs, so fewer of their blocks are resident than
the occupancy query promised. layer1's GEMM blocks come first (its comm blocks, which wait for
them, last), layer0's comm blocks first: every run must finish (no hang, no device-wait trap) with
the reference's result. Skips without a GPU (see conftest.py for the command); written, never run
on a GPU here."""
import os

import pytest
import torch

from tests.cases import cases_for
from tests.gpu.conftest import all_gather_cpu
from tests.gpu.test_cuda_ops import check_against_reference, run_layers

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def _busy_side_stream(iterations: int = 40, n: int = 8192):
    """Enqueues ~`iterations` n x n bf16 matmuls on a new stream (each fills every SM for a while)
    and returns (stream, its end event)."""
    side = torch.cuda.Stream()
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        for _ in range(iterations):
            a = (a @ b) * (1.0 / n)
        done.record()
    return side, done, a


@pytest.mark.parametrize("n_comm", [2, 16])
def test_layers_finish_beside_a_busy_side_stream(world, n_comm):
    rank, w = world
    case = cases_for(w)[0]
    dtype = torch.bfloat16
    # Every rank starts its side-stream load before its layers (gloo barrier: together).
    all_gather_cpu(0, w)
    _side, side_done, _keep = _busy_side_stream()
    # The matmuls are still running when comet's kernels are queued (else the test shows nothing).
    overlapped = not side_done.query()
    y0, layout, h, out, inputs = run_layers(case, dtype, rank, n_comm=n_comm)  # synchronises
    check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)
    print(f"rank {rank}: n_comm={n_comm}, comet's kernels queued while the side stream ran: "
          f"{overlapped}")
