"""FP8 on the CUDA backend: not built yet, so an FP8 call (FP8 activation or weights, or
dispatch_fp8) raises a clear TypeError on every rank before anything runs, and the buffer serves
the next bf16 call. Written, never run here (no GPU); skips without one (conftest.py)."""
import pytest
import torch

import comet
from comet import fp8

MESSAGE = r"FP8 inputs \(float8_e4m3fn, dispatch_fp8\) run on the CPU backend only in this build"


@pytest.mark.parametrize("form", ["fp8-x", "fp8-w0", "dispatch"])
def test_fp8_is_refused_before_anything_runs(world, form):
    rank, w = world
    dev = torch.device("cuda", torch.cuda.current_device())
    E, T, H, N0 = 2 * w, 64, 256, 128
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    w0 = torch.randn(E // w, N0, H, generator=g).to(dev, torch.bfloat16)
    ids = torch.randint(0, E, (T, 2), generator=g).to(dev)
    x_bf16, w0_bf16, kw = x, w0, {}
    if form == "fp8-x":
        x, kw["x_scale"] = fp8.quantize_rows(x)
    elif form == "fp8-w0":
        w0q, kw["w0_scale"] = fp8.quantize_blocks(w0)
        w0 = w0q
    else:
        kw["dispatch_fp8"] = True
    with pytest.raises(TypeError, match=MESSAGE):
        comet.moe_layer0(x, w0, ids, num_experts=E, **kw)
    # the buffer serves the next call
    y0, _layout = comet.moe_layer0(x_bf16, w0_bf16, ids, num_experts=E)
    assert y0.shape[1] == N0
