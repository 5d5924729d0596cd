"""comet.Buffer.simulated_world(W, device="cuda") from a machine without a GPU: what it refuses and
why, before anything is created (tests/gpu/test_cuda_sim.py runs the world itself on a GPU), and
the autotuner's split of a rank's share of the SMs when W ranks share one GPU."""
import pytest

import comet
from comet._native import _C
from comet.buffers import symm_cuda
from comet.layers import ops
from comet.tune import tuner as tn


def test_default_device_is_the_cpu_world():
    bufs = comet.Buffer.simulated_world(2)
    assert [type(b) for b in bufs] == [comet.Buffer] * 2
    assert [(b.rank, b.world) for b in bufs] == [(0, 2), (1, 2)]


def test_cuda_without_the_cuda_build_says_so(monkeypatch):
    monkeypatch.setattr(_C, "with_cuda", False, raising=False)
    with pytest.raises(RuntimeError, match="needs the CUDA kernels.*device='cpu'"):
        comet.Buffer.simulated_world(2, device="cuda")


def test_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(_C, "with_cuda", True, raising=False)
    monkeypatch.setattr(symm_cuda.torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU and none is visible"):
        comet.Buffer.simulated_world(2, device="cuda:0")


def test_cuda_needs_eager_module_loading(monkeypatch):
    monkeypatch.setattr(_C, "with_cuda", True, raising=False)
    monkeypatch.setattr(symm_cuda.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    with pytest.raises(RuntimeError, match="CUDA_MODULE_LOADING=EAGER.*it is LAZY"):
        comet.Buffer.simulated_world(2, device="cuda")


@pytest.mark.parametrize("world", [0, -1, 2.0, True])
def test_cuda_world_must_be_a_positive_int(monkeypatch, world):
    monkeypatch.setattr(_C, "with_cuda", True, raising=False)
    with pytest.raises(ValueError, match=f"int world >= 1, got {world!r}"):
        symm_cuda.simulated_world(world)


def test_cpu_settings_are_refused_on_cuda_by_name():
    with pytest.raises(ValueError, match="heap_bytes, threads_per_block of Buffer.simulated_world"):
        comet.Buffer.simulated_world(2, device="cuda", threads_per_block=2, heap_bytes=1 << 20)


def test_capacity_bytes_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="capacity_bytes.*heap_bytes"):
        comet.Buffer.simulated_world(2, capacity_bytes=1 << 20)


def test_the_tuner_splits_a_ranks_share_of_the_sms(monkeypatch, tmp_path):
    """W ranks on one GPU of S SMs: each rank's split is the one for a GPU of floor(S / W) SMs (the
    grid it may use), not for the whole GPU."""
    monkeypatch.setenv(tn.CACHE_ENV, str(tmp_path / "empty"))
    tn.default_tuner().clear()
    monkeypatch.setitem(ops._cuda_arch, 0, ("h800", 132))
    shape = (8, 8, 2, 4096, 14336, 4096, "bf16")  # world, E, k, H, N, tokens, dtype
    try:
        shared = ops.launch_choice("cuda", 0, 0, *shape, device_ranks=4)
        alone = ops.launch_choice("cuda", 0, 0, *shape)
        key = tn.TuneKey("h800", 33, "bf16", 8, 8, 2, 4096, 14336, 4096, 0)
        want = tn.Tuner(tmp_path / "model").choose(key, tile=(128, 128))
    finally:
        tn.default_tuner().clear()
    assert shared[0] == want.n_comm
    assert shared[0] != alone[0]  # the share's split is another one (else this shows nothing)
