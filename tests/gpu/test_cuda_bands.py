"""layer1's column bands on the CUDA kernels (the sm_90a producer warp and the sm_80 kernel walk
layer1_tile with the call's band): out is bitwise the same for b = 1, 2 and all n-tiles, and the
reference's values. Written, never run here (no GPU); skips without one (conftest.py)."""
import dataclasses

import pytest
import torch

import comet
from comet import reference as ref
from tests.cases import TOL, cases_for, h_from_y0, make_inputs
from tests.gpu.conftest import all_gather_cpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_out_is_bitwise_the_same_for_every_band(world, dtype):
    rank, w = world
    # H = 640: 5 n-tiles of the kernels' 128 columns (bands 1+1+1+1+1, 2+2+1, 5); 300+ rows per
    # rank: several m-tiles per expert
    case = dataclasses.replace(cases_for(w)[0], name="bands", hidden=640, n0=256, n1=128,
                               tokens=tuple(300 + 17 * r for r in range(w)), experts=4 * w, seed=11)
    xs, w0s, w1s, ids, wts = make_inputs(case, dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    y0, layout = comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev),
                                  num_experts=case.experts, n_comm=8)
    h = h_from_y0(y0, case.n1)
    outs = {band: comet.moe_layer1(h, w1s[rank].to(dev), wts[rank].to(dev), layout, n_comm=8,
                                   band=band).cpu() for band in (1, 2, 0)}
    for band in (2, 0):
        assert torch.equal(outs[band], outs[1]), band
    hs = all_gather_cpu(h.cpu(), w)
    expect = ref.layer1_sim(hs, w1s, wts, ids, case.experts)[rank]
    torch.testing.assert_close(outs[1], expect, **TOL[dtype])
