"""The autograd suite on the CPU backend under the CUDA kernels' rules (COMET_CPU_CUDA_RULES=1:
the CPU op then rejects every dtype the CUDA op rejects). Every call that backward makes - the
dx / dh collectives and the "virtual token" calls carrying per-slot weights and their gradients -
must pass those checks, or training on GPUs would fail; here it is proven without a GPU.

* the rules reject float32/float64 activations with the CUDA op's message;
* the per-slot scalar encoding (three bf16 pieces per fp32 value) is exact (hypothesis);
* gradients in bf16 and fp16 equal the reference's on every awkward case (simulated ranks),
  with biases, transposed weights and max_rows too, and across gloo processes.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comet
import comet.layers.autograd as cag
from tests import test_autograd as ta
from tests import test_op_options as to
from tests.cases import E6_ON_3, cases_for, make_inputs
from tests.dist_utils import run_ranks

HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]


@pytest.fixture
def cuda_rules(monkeypatch):
    monkeypatch.setenv("COMET_CPU_CUDA_RULES", "1")


def test_rules_reject_what_the_cuda_op_rejects(cuda_rules):
    buf = comet.Buffer.simulated_world(1)[0]
    x, w0, _w1, ids, _wts, E = ta.small_inputs(torch.float32)
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(TypeError, match=f"x has dtype {str(dtype)[6:]}; the CUDA kernels "
                                            "support bfloat16 and float16.*COMET_CPU_CUDA_RULES"):
            comet.moe_layer0(x.to(dtype), w0.to(dtype), ids, num_experts=E, buffer=buf)
    y0, _ = comet.moe_layer0(x.bfloat16(), w0.bfloat16(), ids, num_experts=E, buffer=buf)
    assert y0.dtype == torch.bfloat16


# Exact for 0 and 2^-100 <= |v| <= 2^127: the pieces of a value below ~2^-110 would fall under
# bf16's subnormal granularity (2^-133, coarser than fp32's 2^-149), an absolute error < 2^-133.
magnitude = st.floats(width=32, min_value=2.0 ** -100, max_value=2.0 ** 127)
finite_f32 = st.one_of(st.just(0.0), magnitude, magnitude.map(lambda m: -m))


@settings(max_examples=200, deadline=None)
@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_scalar_encoding_is_exact(values):
    v = torch.tensor(values, dtype=torch.float32)
    rows = cag.encode_scalars(v)
    assert rows.dtype == torch.bfloat16 and rows.shape == (len(values), cag.VT_WIDTH)
    assert torch.equal(cag.decode_scalars(rows), v)


def test_virtual_tokens_exact_through_the_ops_under_the_rules(cuda_rules):
    """Per-slot fp32 values (awkward magnitudes) go out to the rows and back home bit-exactly."""
    case = cases_for(3)[3]  # dropped slots, a token with all slots dropped
    xs, w0s, _w1s, ids, _wts = make_inputs(case, torch.bfloat16)
    el = case.experts // case.world
    g = torch.Generator().manual_seed(9)

    def body(r, buf):
        _y0, lay = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts, buffer=buf)
        T, k = ids[r].shape
        vals = torch.randn(T, k, generator=g) * torch.logspace(-20, 20, T * k).reshape(T, k)
        rows = cag._slots_to_rows(vals, ids[r], el, case.experts, buf.handle, (1, 1, 4, 8))
        back = cag._rows_to_slots(rows, ids[r], lay.send_pos, lay.recv_counts, case.experts,
                                  buf.handle, (1, 1, 4, 8))
        assert torch.equal(back, torch.where(ids[r] >= 0, vals, 0.0))

    from tests.sim_world import run_threads
    run_threads(case.world, body)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("case", ta.SIM_CASES, ids=str)
def test_gradients_match_reference_under_the_rules(case, dtype, cuda_rules):
    inputs = make_inputs(case, dtype)
    vs = ta.cotangents(case, dtype)
    expect_outs, expect = ta.reference_grads(case, dtype, inputs, vs)
    got = ta.comet_grads(case, inputs, vs, n_comm=2, tile=(4, 8))
    ta.check_grads(case, dtype, got, expect_outs, expect)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("case", [cases_for(2)[3], cases_for(3)[5], E6_ON_3], ids=str)
def test_options_gradients_under_the_rules(case, dtype, cuda_rules):
    """Biases, transposed weights and max_rows: backward under the rules too."""
    to.run_case(case, dtype, transposed=True, bounded=True, n_comm=2, tile=(4, 8))


def test_deferred_and_compiled_backward_under_the_rules(cuda_rules):
    buf = comet.Buffer.simulated_world(1)[0]
    x, w0, w1, ids, wts, E = ta.small_inputs(torch.bfloat16)
    v = torch.randn(x.shape[0], x.shape[1]).bfloat16()
    eager = [t.clone().requires_grad_() for t in (x, w0, w1, wts)]
    ta._run_small(buf, eager, ids, E, lambda o: o.backward(v))
    late = [t.clone().requires_grad_() for t in (x, w0, w1, wts)]
    with cag.defer_weight_grads() as q:
        ta._run_small(buf, late, ids, E, lambda o: o.backward(v))
    q.compute()
    for a, b in zip(late, eager):
        assert torch.equal(a.grad, b.grad)
    compiled = [t.clone().requires_grad_() for t in (x, w0, w1, wts)]
    fn = torch.compile(lambda *t: ta._run_small(buf, list(t), ids, E, lambda o: None),
                       fullgraph=True, backend="aot_eager")
    fn(*compiled).backward(v)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=1e-2, rtol=1e-2)


def _dist_under_rules(rank, world, cases):
    import os
    os.environ["COMET_CPU_CUDA_RULES"] = "1"
    return ta._dist_grads(rank, world, cases, dtypes=tuple(HALF))


def test_gradients_across_processes_under_the_rules():
    cases = cases_for(2)
    results = run_ranks(_dist_under_rules, 2, cases, timeout=180)
    assert all(len(r) == 2 * len(cases) for r in results)
