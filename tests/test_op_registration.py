"""The ops as PyTorch operators: schema/fake-kernel consistency (torch.library.opcheck) and
torch.compile(fullgraph=True) through both ops, on a world of one (no process group)."""
import pytest
import torch

import comet
from comet import reference as ref
from tests.cases import TOL


@pytest.fixture(scope="module")
def buf():
    return comet.Buffer.simulated_world(1)[0]


def inputs(dtype=torch.float32, T=9, H=16, N0=12, N1=8, E=3, k=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[0, 1] = -1
    w0 = torch.randn(E, N0, H, generator=g).to(dtype)
    w1 = torch.randn(E, H, N1, generator=g).to(dtype)
    wts = torch.rand(T, k, generator=g)
    return x, w0, w1, ids, wts, E


LAUNCH = (1, 1, 4, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_layer0(buf, dtype):
    x, w0, _w1, ids, _w, E = inputs(dtype)
    torch.library.opcheck(torch.ops.comet.moe_layer0.default, (x, w0, ids, E, buf.handle, *LAUNCH))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_layer1(buf, dtype):
    x, w0, w1, ids, wts, E = inputs(dtype)
    y0, _a, rc, sp, *_ = torch.ops.comet.moe_layer0(x, w0, ids, E, buf.handle, *LAUNCH)
    h = y0[:, : w1.shape[2]].contiguous()
    torch.library.opcheck(torch.ops.comet.moe_layer1.default,
                          (h, w1, wts, ids, sp, rc, E, buf.handle, *LAUNCH))


def test_compile_fullgraph_both_ops(buf):
    x, w0, w1, ids, wts, E = inputs()
    handle = buf.handle

    def moe(x, w0, w1, ids, wts):
        y0, _a, rc, sp, _rs, _rt, _rsl = torch.ops.comet.moe_layer0(x, w0, ids, E, handle, *LAUNCH)
        h = torch.nn.functional.silu(y0[:, : w1.shape[2]]).contiguous()
        return torch.ops.comet.moe_layer1(h, w1, wts, ids, sp, rc, E, handle, *LAUNCH)

    compiled = torch.compile(moe, fullgraph=True)  # inductor: the ops stay opaque calls in its code
    out = compiled(x, w0, w1, ids, wts)
    y0 = ref.layer0_sim([x], [w0], [ids], E)[0]
    expect = ref.layer1_sim([torch.nn.functional.silu(y0[:, : w1.shape[2]])], [w1], [wts], [ids], E)[0]
    torch.testing.assert_close(out, expect, **TOL[torch.float32])
    # inductor fuses the silu (its rounding may differ by an ulp from eager), not the ops
    torch.testing.assert_close(out, moe(x, w0, w1, ids, wts), **TOL[torch.float32])


def test_compile_fullgraph_python_api(buf):
    """The public wrappers trace too (Layout is a plain dataclass of tensors)."""
    x, w0, w1, ids, wts, E = inputs()

    def moe(x, w0, w1, ids, wts):
        y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf)
        return comet.moe_layer1(y0[:, : w1.shape[2]].contiguous(), w1, wts, layout, buffer=buf)

    out = torch.compile(moe, fullgraph=True, backend="aot_eager")(x, w0, w1, ids, wts)
    torch.testing.assert_close(out, moe(x, w0, w1, ids, wts), atol=0, rtol=0)
