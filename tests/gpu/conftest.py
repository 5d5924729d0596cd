"""Set-up of the GPU tests (tests/gpu): they skip cleanly without a GPU or without a build of comet
that has its CUDA kernels. Under torchrun every process takes the GPU of its LOCAL_RANK and joins
torch.distributed (gloo: the tests' own collectives move CPU objects; comet's ops use NVSHMEM):

    torchrun --nproc-per-node N -m pytest tests/gpu -q -s      # N = 1..8 GPUs of one node

A plain `pytest tests/gpu` is a world of one on the current GPU. Every rank runs the same tests in
the same order (collectives inside the tests rely on it)."""
import datetime
import os

import pytest
import torch


def cuda_ready() -> bool:
    try:
        from comet._native import _C
    except ImportError:
        return False
    return bool(getattr(_C, "with_cuda", False)) and torch.cuda.is_available()


_HERE = os.path.dirname(os.path.abspath(__file__))


def fp8_capable(device=None) -> bool:
    """Whether comet runs FP8 operands on this GPU (csrc/cuda/ops_cuda.cpp's rule): sm_89 (the
    mma.sync e4m3 kernels), sm_90 (wgmma) and newer GPUs (sm_89's kernels by PTX); sm_80 and
    sm_86 have no FP8 tensor cores and refuse it."""
    cap = torch.cuda.get_device_capability(device)
    return cap == (8, 9) or cap[0] >= 9


def require_fp8(device=None):
    """Skips the calling test on a GPU without FP8 tensor cores, naming it."""
    if not fp8_capable(device):
        cap = torch.cuda.get_device_capability(device)
        pytest.skip(f"FP8 needs sm_89, sm_90 or newer; this GPU is sm_{cap[0]}{cap[1]}")


def pytest_configure(config):
    config.addinivalue_line("markers", "host_only: a test of the CUDA backend that needs no GPU")


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (sm_80 or sm_90) and comet built with its "
                                   "CUDA kernels")
    for item in items:
        if (os.path.abspath(str(item.fspath)).startswith(_HERE)
                and item.get_closest_marker("host_only") is None):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def world():
    """(rank, world size); initialises torch.distributed under torchrun."""
    import torch.distributed as dist

    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        torch.cuda.set_device(local % torch.cuda.device_count())
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(torch.cuda.current_device())
    return 0, 1


def all_gather_cpu(obj, world_size):
    """Every rank's `obj` (CPU tensors / picklable values), ordered by rank."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world_size
    dist.all_gather_object(out, obj)
    return out
