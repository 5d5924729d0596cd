"""The copies kernel (csrc/cuda/stream_copies.cu) on the CUDA ops (written, never run: no GPU here;
skips without one): each op copies its source data into the symmetric buffer and clears its
flags in one launch, where it used to make 5 device copies and 2 memsets. A wrong descriptor (a
region, a width, a pitch, a missed clear) shows as a wrong y0 or out, so each case runs layer0 ->
tanh -> layer1 against tests/test_decode_small_t.py's float64 oracle: token counts 0, 1, 37 and 64
per rank rotated across the ranks, then every rank empty (64 bf16 rows of x are 6 KiB: the copy
grid's several blocks), with and without max_rows (without it, the flags' workspace is allocated
only after the begin kernel), int64 and int32 ids, and, on sm_89 / sm_90, FP8 with x quantised
by the caller (its values and scales: two strided descriptors) and with dispatch_fp8 (the pack
kernel after the copies kernel; tests/test_decode_small_t.py's one_step makes the calls). Each
case runs twice on the same buffer: the second call sees
the first one's flags, which the copies kernel must clear.

    torchrun --nproc-per-node N -m pytest tests/gpu/test_cuda_copies.py -q -s"""
import os

import pytest
import torch

from tests.gpu.conftest import all_gather_cpu, fp8_capable
from tests.test_decode_small_t import TOPK, _step_inputs, check_against_oracle, one_step

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
SIZES = (0, 1, 37, 64)
E = 16


def _steps(world):
    rot = [tuple(SIZES[(s + r) % len(SIZES)] for r in range(world)) for s in range(len(SIZES))]
    return rot + [(0,) * world]


def _cases():
    fp8_ok = torch.cuda.is_available() and fp8_capable()
    cases = [("bf16", True, torch.int64), ("bf16", False, torch.int32)]
    if fp8_ok:
        cases += [("fp8", True, torch.int32), ("fp8", False, torch.int64),
                  ("dispatch_fp8", True, torch.int64)]
    return cases


@pytest.mark.skipif(E % WORLD != 0, reason="E = 16 experts over the ranks")
def test_copies_kernel_against_the_oracle(world):
    rank, w = world
    dev = torch.device("cuda", torch.cuda.current_device())
    R = w * max(SIZES) * min(TOPK, E // w)
    for mode, bounded, ids_dtype in _cases():
        for step, tokens in enumerate(_steps(w)):
            inp = _step_inputs(w, E, tokens, seed=7000 + step)
            for rep in range(2):  # the second call finds the first call's flags set
                label = f"{mode} max_rows={bounded} ids {ids_dtype} tokens {tokens} call {rep}"
                dtype = "bf16" if mode == "bf16" else "fp8"
                y0, out, h_val, used = one_step(rank, w, E, dtype, inp, R if bounded else None,
                                                None, dev, ids_dtype=ids_dtype,
                                                dispatch_fp8=mode == "dispatch_fp8")
                check_against_oracle(rank, w, E, dtype, inp, y0, out, h_val, used, label,
                                     lambda obj: all_gather_cpu(obj, w), zero_past_m=False)
