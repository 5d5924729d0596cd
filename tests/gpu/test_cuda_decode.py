"""Decode-sized calls on the CUDA kernels (written, never run: no GPU here; skips without one):
the steps of tests/test_decode_small_t.py (0, 1, 2 or 5 tokens per rank mixed, every rank empty,
top-8 over E = 16 and 32, dropped slots) at one fixed max_rows on the group's buffer, bf16 and,
on sm_89 / sm_90, FP8, each step against the float64 oracle written there and bitwise equal to the
same call on a fresh buffer (y0's first M rows and out). On sm_90a this runs layer0's producer
with the weights loaded before the rows (csrc/cuda/weights_first.cuh), the case where every
m-tile waits for rows from every source. Each step runs with both CUDA tiles, 128 x 128 (checked
against the oracle) and the small-batch 64 x 128 (one MMA warpgroup on sm_90a), which must give
the same bits.

    torchrun --nproc-per-node N -m pytest tests/gpu/test_cuda_decode.py -q -s"""
import os

import pytest
import torch

from tests.gpu.conftest import all_gather_cpu, fp8_capable
from tests.test_decode_small_t import check_results, run_steps

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


@pytest.mark.parametrize("experts", [e for e in (16, 32) if e % WORLD == 0])
def test_small_batches_at_a_fixed_max_rows(world, experts):
    from comet.buffers import symm_cuda

    rank, w = world
    dev = torch.device("cuda", torch.cuda.current_device())
    dtypes = ("bf16", "fp8") if fp8_capable() else ("bf16",)
    res = run_steps(rank, w, experts, dtypes, dev, lambda obj: all_gather_cpu(obj, w),
                    lambda: symm_cuda.Buffer(device=dev), tiles=((128, 128), (64, 128)))
    check_results(all_gather_cpu(res, w), w, experts, dtypes)
