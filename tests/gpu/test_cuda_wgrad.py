"""The weight-gradient GEMM on a GPU (comet::expert_weight_grad): torch's grouped matmul against a
float64 reference, bitwise reproducible, exact zeros for an expert without rows, padded rows not
read, and no host synchronisation on the bf16 route (torch's sync debug mode raises on one).
Written, never run: no GPU here. Needs no comet CUDA kernels, only a GPU (skipped like the rest
of tests/gpu otherwise)."""
import pytest
import torch

import comet  # noqa: F401
import comet.layers.autograd as cag

COUNTS = [[40, 0, 0, 72], [24, 8, 0, 200]]  # [W=2, E_local=4]; expert 2 has no rows


def _operands(dtype, p=256, q=384, pad=16):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = sum(map(sum, COUNTS))
    grad = torch.randn(rows + pad, p, device="cuda", generator=g).to(dtype)
    inp = torch.randn(rows + pad, q, device="cuda", generator=g).to(dtype)
    grad[rows:] = float("nan")  # a max_rows bound's padding
    inp[rows:] = float("nan")
    return grad, inp, torch.tensor(COUNTS, dtype=torch.int32, device="cuda"), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_weight_grad_matches_reference(dtype):
    grad, inp, counts, rows = _operands(dtype)
    out = cag.expert_weight_grad(grad, inp, counts, dtype)
    again = cag.expert_weight_grad(grad, inp, counts, dtype)
    assert torch.equal(out, again)  # bitwise run to run
    assert not out[2].any()
    ref, begin = [], 0
    for n in torch.tensor(COUNTS).sum(0).tolist():
        ref.append(grad[begin:begin + n].double().t() @ inp[begin:begin + n].double())
        begin += n
    torch.testing.assert_close(out.double(), torch.stack(ref), atol=0.25, rtol=2e-2)
    wide = cag.expert_weight_grad(grad, inp, counts, torch.float32)  # the loop where torch refuses
    torch.testing.assert_close(wide.double(), torch.stack(ref), atol=1e-3, rtol=1e-4)


def test_bf16_route_does_not_synchronise():
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch's grouped matmul reads offsets on the host outside sm90/sm100")
    grad, inp, counts, _ = _operands(torch.bfloat16)
    cag.expert_weight_grad(grad, inp, counts, torch.bfloat16)  # warm up (lazy loads)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cag.expert_weight_grad(grad, inp, counts, torch.bfloat16)
        cag._expert_bias_grad(grad, counts, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
