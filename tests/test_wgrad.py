"""comet::expert_weight_grad, the weight-gradient GEMM of backward: per local expert
grad_e^T @ inp_e over the expert's rows, against a float64 reference; padded rows (a max_rows
bound) ignored; empty experts exactly zero; mixed fp32 / 16-bit operands read in the 16-bit dtype;
bitwise reproducible; and the CUDA route (torch's grouped mm over device offsets) traced on fake
CUDA tensors to show it reads nothing back to the host."""
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

import comet  # noqa: F401  (registers the ops)
import comet.layers.autograd as cag

# recv_counts [W=2, E_local=4]: expert 2 receives no rows, 22 rows in all.
COUNTS = torch.tensor([[3, 0, 0, 5], [4, 1, 0, 9]], dtype=torch.int32)
ROWS = int(COUNTS.sum())


def operands(dtype, p=16, q=24, pad=0, seed=0, inp_dtype=None):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(ROWS + pad, p, generator=g).to(dtype)
    inp = torch.randn(ROWS + pad, q, generator=g).to(inp_dtype or dtype)
    if pad:  # a max_rows bound's padding: never read
        grad[ROWS:] = float("nan")
        inp[ROWS:] = float("nan")
    return grad, inp


def reference(grad, inp, counts=COUNTS):
    out, begin = [], 0
    for n in counts.sum(0).tolist():
        out.append(grad[begin:begin + n].double().t() @ inp[begin:begin + n].double())
        begin += n
    return torch.stack(out)


@pytest.mark.parametrize("dtype,out_dtype,tol", [
    (torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 1e-2),
    (torch.bfloat16, torch.float32, 1e-5), (torch.float16, torch.float16, 1e-3),
    (torch.float64, torch.float64, 1e-12)])
@pytest.mark.parametrize("pad", [0, 5])
def test_matches_reference(dtype, out_dtype, tol, pad):
    grad, inp = operands(dtype, pad=pad)
    out = cag.expert_weight_grad(grad, inp, COUNTS, out_dtype)
    assert out.shape == (4, 16, 24) and out.dtype == out_dtype
    ref = reference(grad[:ROWS], inp[:ROWS])
    torch.testing.assert_close(out.double(), ref, atol=tol * 8, rtol=tol)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # no rows: exactly zero


def test_mixed_operands_read_in_the_16bit_dtype():
    """layer1's dW1: an fp32 w * dout against bf16 h is one bf16 GEMM (the fp32 operand rounded
    once), fp32-accumulated: it equals the reference on the rounded operand to fp32 precision."""
    grad, inp = operands(torch.float32, inp_dtype=torch.bfloat16)
    out = cag.expert_weight_grad(grad, inp, COUNTS, torch.float32)
    ref = reference(grad.to(torch.bfloat16), inp)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="do not share a GEMM dtype"):
        cag.expert_weight_grad(grad.half(), inp, COUNTS, torch.float32)


def test_bitwise_reproducible_and_no_rows():
    grad, inp = operands(torch.bfloat16, pad=3)
    a = cag.expert_weight_grad(grad, inp, COUNTS, torch.float32)
    b = cag.expert_weight_grad(grad.clone(), inp.clone(), COUNTS, torch.float32)
    assert torch.equal(a, b)
    empty = cag.expert_weight_grad(grad[:0], inp[:0], torch.zeros(2, 4, dtype=torch.int32),
                                   torch.bfloat16)
    assert empty.shape == (4, 16, 24) and not empty.any()


def test_bias_grad_sums_each_experts_rows():
    grad, _ = operands(torch.float32, p=10, pad=2)  # P not 16-byte aligned in bf16: the loop
    for out_dtype in (torch.float32, torch.bfloat16):
        db = cag._expert_bias_grad(grad, COUNTS, out_dtype)
        rows = grad[:ROWS].to(out_dtype).double()  # a 16-bit bias: its dtype's GEMM operand
        ref = torch.stack([s.sum(0) for s in rows.split(COUNTS.sum(0).tolist())])
        assert db.shape == (4, 10) and db.dtype == out_dtype
        tol = 1e-5 if out_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(db.double(), ref, atol=tol * 4, rtol=tol)


def test_grouped_path_equals_the_loop():
    """The grouped route (torch's grouped mm, which also runs on the CPU) against the loop, with
    padded rows and an expert without rows."""
    for dtype in (torch.float32, torch.bfloat16):
        grad, inp = operands(dtype, pad=4)
        ends = cag._expert_row_ends(COUNTS)
        assert cag._grouped_mm_fits(grad, inp)
        grouped = cag._grouped_weight_grad(grad, inp, ends, dtype)
        looped = cag._looped_weight_grad(grad, inp, ends, dtype)
        assert torch.equal(grouped[2], torch.zeros_like(grouped[2]))
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(grouped.double(), looped.double(), atol=tol * 8, rtol=tol)
    # grad^T needs 16-byte rows: 10 bf16 columns do not fit
    assert not cag._grouped_mm_fits(torch.zeros(4, 10, dtype=torch.bfloat16),
                                    torch.zeros(4, 8, dtype=torch.bfloat16))
    shifted = torch.zeros(33, dtype=torch.bfloat16)[1:].view(4, 8)  # data 2 bytes off alignment
    assert not cag._grouped_mm_fits(shifted, torch.zeros(4, 8, dtype=torch.bfloat16))


def test_wide_output_refusal_is_probed_once(monkeypatch):
    """torch 2.14's grouped mm writes only the operands' dtype: an fp32 out_dtype from bf16 is
    refused once, remembered, and left to the loop."""
    monkeypatch.setattr(cag, "_wide_grouped_out", None)
    calls = []
    real = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    grad, inp = operands(torch.bfloat16)
    ends = cag._expert_row_ends(COUNTS)
    first = cag._grouped_weight_grad(grad, inp, ends, torch.float32)
    if first is None:  # torch refused: remembered, not asked again
        assert cag._wide_grouped_out is False
        assert cag._grouped_weight_grad(grad, inp, ends, torch.float32) is None
        assert calls == [torch.float32]
    else:
        assert cag._wide_grouped_out is True and first.dtype == torch.float32


def test_cuda_route_reads_nothing_back(monkeypatch):
    """On fake CUDA tensors (no GPU needed) the bf16 route runs torch's grouped mm over offsets
    computed on the device: any host read of a device value (.tolist(), .item()) would raise
    DataDependentOutputException here, as the fixed-order loop does."""
    monkeypatch.setattr(cag, "_wide_grouped_out", False)  # torch 2.14: no fp32 output
    with FakeTensorMode():
        grad = torch.empty(40, 16, dtype=torch.bfloat16, device="cuda")
        inp = torch.empty(40, 24, dtype=torch.bfloat16, device="cuda")
        wd = torch.empty(40, 16, dtype=torch.float32, device="cuda")
        counts = torch.empty(2, 3, dtype=torch.int32, device="cuda")
        for g, x in ((grad, inp), (inp, grad), (wd, inp)):  # dW0, dW0 transposed, dW1
            out = cag._weight_grad(g, x, counts, torch.bfloat16)
            assert out.shape == (3, g.shape[1], x.shape[1]) and out.device.type == "cuda"
        db = cag._expert_bias_grad(wd, counts, torch.bfloat16)
        assert db.shape == (3, 16)
        with pytest.raises(DataDependentOutputException):  # the loop: only where torch refuses
            cag._weight_grad(grad, inp, counts, torch.float32)
