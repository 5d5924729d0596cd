"""moe_layer0(activation=...) on CUDA, one process per GPU (see conftest.py for the command).
WRITTEN, NEVER RUN: no machine of this project has a GPU; the file skips without one.

The CUDA kernels do not fuse the activation yet: the op refuses `activation=` (an error on every
rank before any kernel, the buffer then serving the next call) and comet.moe_layer0 applies it
after the op. Checked here: the wrapper's h against a float64 oracle of its rows (bf16 tolerance),
the direct op's refusal, backward through the wrapper against the same call without
activation followed by torch's silu (bf16 tolerance: the two may round differently), and
h_fp8's quantize_rows bits."""
import math
import os

import pytest
import torch

import comet
from tests.cases import cases_for, make_biases, make_inputs

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
BF16 = torch.bfloat16


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _oracle(name, y):
    f = (lambda v: v / (1.0 + torch.exp(-v))) if name in ("swiglu", "silu") else \
        (lambda v: 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0))))
    if name in ("swiglu", "geglu"):
        n = y.shape[-1] // 2
        return f(y[..., :n]) * y[..., n:]
    return f(y)


@pytest.mark.parametrize("name", ["swiglu", "geglu", "silu", "gelu"])
def test_wrapper_activation_matches_float64_oracle(name):
    case = cases_for(WORLD)[5]  # skewed, odd sizes (n0 = 30: even)
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    b0s = make_biases(case, BF16)[0]
    dev = _device()
    h, lay = comet.moe_layer0(xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev),
                              num_experts=case.experts, b0=b0s[RANK].to(dev), activation=name)
    w0 = torch.cat(w0s).double()
    b0 = torch.cat(b0s).double()
    rows = []
    for s, t, j in zip(lay.row_source.tolist(), lay.row_token.tolist(), lay.row_slot.tolist()):
        e = int(ids[s][t, j])
        rows.append(_oracle(name, xs[s][t].double() @ w0[e].T + b0[e]))
    if rows:
        torch.testing.assert_close(h.cpu().double(), torch.stack(rows), atol=3e-2, rtol=3e-2)


def test_op_refuses_activation_on_every_rank():
    case = cases_for(WORLD)[0]
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    dev = _device()
    from comet.buffers import symm_cuda

    buf = symm_cuda.buffer_for(None, dev)
    with pytest.raises(ValueError, match="not fused into the CUDA kernels"):
        torch.ops.comet.moe_layer0(xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev),
                                   case.experts, buf.handle, 8, 0, 128, 128,
                                   activation="swiglu")
    # the buffer serves the next call
    comet.moe_layer0(xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev),
                     num_experts=case.experts)


def test_wrapper_backward_equals_unfused():
    case = cases_for(WORLD)[0]
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    dev = _device()
    grads = []
    for fused in (True, False):
        x = xs[RANK].to(dev).requires_grad_(True)
        w0 = w0s[RANK].to(dev).requires_grad_(True)
        if fused:
            h, _ = comet.moe_layer0(x, w0, ids[RANK].to(dev), num_experts=case.experts,
                                    activation="swiglu")
        else:
            y0, _ = comet.moe_layer0(x, w0, ids[RANK].to(dev), num_experts=case.experts)
            gate, up = y0.float().chunk(2, dim=1)
            h = (torch.nn.functional.silu(gate) * up).to(BF16)
        h.float().square().sum().backward()
        grads.append((x.grad, w0.grad))
    for a, b in zip(*grads):  # torch's silu and the fallback's may round differently
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_h_fp8_is_quantize_rows_of_the_activation():
    """On CUDA the wrapper quantises the activation's output (the fused epilogue is the CPU
    backend's): the same format, quantize_rows' bits of the bf16 h it returns without h_fp8."""
    from comet import fp8

    case = cases_for(WORLD)[0]
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    dev = _device()
    args = (xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev))
    (q, s), _ = comet.moe_layer0(*args, num_experts=case.experts, activation="swiglu",
                                 h_fp8=True)
    h, _ = comet.moe_layer0(*args, num_experts=case.experts, activation="swiglu")
    want_q, want_s = fp8.quantize_rows(h.float())
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)
