"""The CUDA kernels with the ops' optional arguments, one process per GPU (see conftest.py for the
command; skips without a GPU):

* expert biases b0 / b1 (added in the GEMM epilogue: y0 = round(x @ W0^T + b0), the slot's fp32
  result h @ W1^T + b1 weighted by its top-k weight) and transposed weights (w0 [E_local, H, N0],
  w1 [E_local, N1, H]; read in place by the TMA path on sm_90a, copied into the kernel layout per
  call on the sm_80 path and for N % 8 != 0) against the pure-torch reference in bf16, on the
  awkward cases (both sm_80-path copy variants: aligned and H = 37) and on large aligned shapes
  with several column tiles (the TMA path on sm_90a, K a multiple of the 64-wide k-tile or not);
* max_rows as the ops' argument: padded outputs, the argument winning over the buffer setting
  (Buffer.capturable) and the setting as the fallback, CUDA-graph capture with the argument
  alone (with biases and transposed weights too), a bound that is too small reported by
  Buffer.check() with the buffer usable afterwards, h not padded to max_rows raising, a bound
  on one rank only rejected on every rank;
* autograd on CUDA in bf16: layer0 -> activation -> layer1 forward and backward against the
  reference's autograd gradients (dx, dw0, dw1, dtopk_weights; db0, db1 with the options), the
  backward's own calls (transposed weights, virtual-token rows, max_rows) running on the GPU.
"""
import dataclasses
import os

import pytest
import torch

import comet
from comet import reference as ref
from tests.cases import E6_ON_3, TOL, cases_for, h_from_y0, make_biases, make_inputs
from tests.gpu.test_cuda_ops import check_against_reference

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
CASES = cases_for(WORLD) + ([E6_ON_3] if WORLD == 3 else [])
BF16 = torch.bfloat16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 gradients, relative to the largest reference entry


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _buffer():
    from comet.buffers import symm_cuda

    return symm_cuda.buffer_for(None, _device())


def aligned_case(world):
    """H, N0, N1 multiples of 8 and above one 128-column tile: the TMA path on sm_90a (16-byte
    cp.async on sm_80), biases read at column offsets > 0 of several experts."""
    return dataclasses.replace(cases_for(world)[0], name="aligned", hidden=256, n0=384, n1=192,
                               tokens=tuple(300 + 17 * r for r in range(world)),
                               experts=4 * world, seed=9)


def ragged_k_case(world):
    """Like aligned_case, but K is not a multiple of the 64-wide k-tile in either layer (H = 200,
    N1 = 72) and the last column tile is partial (N0 = 136): on sm_90a the transposed weights'
    last k-tile and columns past N are zero-filled per expert by the MN-major TMA descriptor."""
    return dataclasses.replace(aligned_case(world), name="ragged-k", hidden=200, n0=136, n1=72,
                               seed=10)


def layer_args(rank, inputs, biases, *, bias, transposed):
    """This rank's op operands on the GPU: (x, w0, w1, topk_ids, topk_weights, b0, b1), the weights
    in the transposed layout when asked (the reference keeps the usual one)."""
    xs, w0s, w1s, ids, wts = inputs
    dev = _device()
    w0, w1 = w0s[rank], w1s[rank]
    if transposed:
        w0, w1 = w0.transpose(1, 2).contiguous(), w1.transpose(1, 2).contiguous()
    b0 = biases[0][rank].to(dev) if bias else None
    b1 = biases[1][rank].to(dev) if bias else None
    return (xs[rank].to(dev), w0.to(dev), w1.to(dev), ids[rank].to(dev), wts[rank].to(dev), b0, b1)


def run_layers(case, rank, inputs, biases, *, bias, transposed, max_rows=None, n_comm=None):
    """layer0 -> h_from_y0 -> layer1 on this rank with the options; (y0, layout, h, out)."""
    x, w0, w1, tid, tw, b0, b1 = layer_args(rank, inputs, biases, bias=bias, transposed=transposed)
    y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, b0=b0,
                                  w0_transposed=transposed, max_rows=max_rows, n_comm=n_comm)
    h = h_from_y0(y0, case.n1)
    out = comet.moe_layer1(h, w1, tw, layout, b1=b1, w1_transposed=transposed, n_comm=n_comm)
    torch.cuda.synchronize()
    return y0, layout, h, out


def check_reference(case, dtype, rank, world, y0, layout, h, out, inputs, biases, *, bias,
                    rows=None):
    """y0 and out against the reference with the same biases (bias=False: without)."""
    check_against_reference(case, dtype, rank, world, y0, layout, h, out, inputs, rows=rows,
                            biases=biases if bias else None)


OPTIONS = {"bias": dict(bias=True, transposed=False),
           "transposed": dict(bias=False, transposed=True),
           "bias+transposed": dict(bias=True, transposed=True)}


# --------------------------------------------------------------------------------------------------
# Biases and transposed weights
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opts", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_biases_and_transposed_weights_match_reference(world, case, opts):
    rank, w = world
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    y0, layout, h, out = run_layers(case, rank, inputs, biases, n_comm=2, **opts)
    check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=opts["bias"])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_biases_and_transposed_weights_on_the_tensor_core_path(world, dtype):
    """Several column tiles and experts: each tile adds its own expert's bias slice."""
    rank, w = world
    for case in (aligned_case(w), ragged_k_case(w)):
        inputs, biases = make_inputs(case, dtype), make_biases(case, dtype)
        for opts in OPTIONS.values():
            y0, layout, h, out = run_layers(case, rank, inputs, biases, n_comm=8, **opts)
            check_reference(case, dtype, rank, w, y0, layout, h, out, inputs, biases,
                            bias=opts["bias"])


def test_transposed_weights_give_the_same_bits(world):
    """The transposed layout computes exactly what the usual one does: the same kernel on a copy
    (sm_80 path, N % 8 != 0), or on sm_90a the MN-major B kernel, whose wgmmas only read B
    transposed from shared memory (same tiles, same k order, the same zero-filled tail)."""
    rank, _w = world
    for case in (cases_for(WORLD)[0], cases_for(WORLD)[5], aligned_case(WORLD),
                 ragged_k_case(WORLD)):
        inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
        plain = run_layers(case, rank, inputs, biases, bias=True, transposed=False)
        trans = run_layers(case, rank, inputs, biases, bias=True, transposed=True)
        assert torch.equal(plain[0], trans[0]) and torch.equal(plain[3], trans[3]), case


def test_zero_bias_is_no_bias(world):
    rank, _w = world
    case = cases_for(WORLD)[0]
    inputs = make_inputs(case, BF16)
    el = case.experts // case.world
    zeros = ([torch.zeros(el, case.n0, dtype=BF16)] * case.world,
             [torch.zeros(el, case.hidden, dtype=BF16)] * case.world)
    with_b = run_layers(case, rank, inputs, zeros, bias=True, transposed=False)
    without = run_layers(case, rank, inputs, zeros, bias=False, transposed=False)
    assert torch.equal(with_b[0], without[0]) and torch.equal(with_b[3], without[3])


# --------------------------------------------------------------------------------------------------
# max_rows as the ops' argument
# --------------------------------------------------------------------------------------------------


def bound_for(case):
    """A max_rows above every rank's row count (rows <= sum of all tokens * k)."""
    return sum(case.tokens) * case.topk + 3


@pytest.mark.parametrize("opts", [dict(bias=False, transposed=False), OPTIONS["bias+transposed"]],
                         ids=["plain", "bias+transposed"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_max_rows_argument_pads_the_outputs(world, case, opts):
    rank, w = world
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    run_layers(case, rank, inputs, biases, **opts)  # eager: sizes the buffer
    bound = bound_for(case)
    y0, layout, h, out = run_layers(case, rank, inputs, biases, max_rows=bound, n_comm=2, **opts)
    assert y0.shape[0] == bound and layout.max_rows == bound and layout.num_rows == bound
    assert h.shape[0] == bound
    m = int(layout.recv_counts.sum())
    check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=opts["bias"],
                    rows=m)
    _buffer().check()


def test_max_rows_argument_wins_over_the_buffer_setting(world):
    rank, w = world
    case = cases_for(w)[0]
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    buf = _buffer()
    run_layers(case, rank, inputs, biases, bias=True, transposed=False)  # eager: sizes the buffer
    bound = bound_for(case)
    with buf.capturable(max_rows=bound + 5):
        y0, layout, h, out = run_layers(case, rank, inputs, biases, bias=True, transposed=False,
                                        max_rows=bound)
        assert y0.shape[0] == bound and layout.max_rows == bound
        m = int(layout.recv_counts.sum())
        check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=True,
                        rows=m)
        # without the argument the buffer's setting still applies
        y0, layout, h, out = run_layers(case, rank, inputs, biases, bias=True, transposed=False)
        assert y0.shape[0] == bound + 5 and layout.max_rows == -1
        check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=True,
                        rows=m)
    assert buf.max_rows is None
    buf.check()
    # and without either, the outputs have M rows again
    y0, layout, h, out = run_layers(case, rank, inputs, biases, bias=True, transposed=False)
    assert y0.shape[0] == int(layout.recv_counts.sum())


@pytest.mark.parametrize("opts", [dict(bias=False, transposed=False), OPTIONS["bias+transposed"]],
                         ids=["plain", "bias+transposed"])
def test_cuda_graph_capture_with_the_max_rows_argument(world, opts):
    """max_rows passed to the ops (no Buffer.capturable): no host synchronisation, so the calls
    are captured in a CUDA graph, replayed, and equal the reference (rows past M unspecified)."""
    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], hidden=64, n0=48, n1=32, seed=11)
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    x, w0, w1, tid, tw, b0, b1 = layer_args(rank, inputs, biases, **opts)
    t = opts["transposed"]
    buf = _buffer()
    bound = bound_for(case)

    def step(max_rows):
        y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, b0=b0,
                                      w0_transposed=t, max_rows=max_rows, n_comm=2)
        h = h_from_y0(y0, case.n1)
        out = comet.moe_layer1(h, w1, tw, layout, b1=b1, w1_transposed=t, n_comm=2)
        return y0, layout, h, out

    step(None)  # eager: sizes the buffer
    assert buf.max_rows is None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(bound)  # warm-up in the same mode (allocator pools)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y0, layout, h, out = step(bound)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    buf.check()
    assert y0.shape[0] == bound and layout.max_rows == bound
    m = int(layout.recv_counts.sum())
    check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=opts["bias"],
                    rows=m)


def test_too_small_max_rows_argument_is_reported_by_check(world):
    rank, w = world
    case = cases_for(w)[0]
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    buf = _buffer()
    run_layers(case, rank, inputs, biases, bias=False, transposed=False)  # eager: sizes the buffer
    rows = [len(ref.dispatch_rows(inputs[3], case.experts, d)) for d in range(w)]
    if min(rows) == 0:
        pytest.skip("a rank receives no rows in this case")
    x, w0, _w1, tid, _tw, _b0, _b1 = layer_args(rank, inputs, biases, bias=False, transposed=False)
    small = min(rows) - 1  # every rank receives more
    y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, max_rows=small)
    assert y0.shape[0] == small
    with pytest.raises(RuntimeError, match="max_rows"):
        buf.check()
    # the buffer stays usable
    y0, layout, h, out = run_layers(case, rank, inputs, biases, bias=True, transposed=True)
    check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=True)


def test_h_not_padded_to_max_rows_raises(world):
    rank, w = world
    case = cases_for(w)[0]
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    run_layers(case, rank, inputs, biases, bias=False, transposed=False)  # eager: sizes the buffer
    x, w0, w1, tid, tw, _b0, _b1 = layer_args(rank, inputs, biases, bias=False, transposed=False)
    bound = bound_for(case)
    y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, max_rows=bound)
    h = h_from_y0(y0, case.n1)[:-1].contiguous()
    with pytest.raises(ValueError, match="max_rows"):
        comet.moe_layer1(h, w1, tw, layout)
    _buffer().check()
    y0, layout, h, out = run_layers(case, rank, inputs, biases, bias=False, transposed=False)
    check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=False)


# --------------------------------------------------------------------------------------------------
# Autograd on the GPU
# --------------------------------------------------------------------------------------------------


def activation(y0, n1):
    """Differentiable stand-in activation [M, N0] -> [M, N1] (as tests/test_autograd.py)."""
    return torch.tanh(y0.float()[:, :n1]).to(y0.dtype).contiguous()


def cotangents(case, dtype):
    g = torch.Generator().manual_seed(77 + case.seed)
    return [torch.randn(T, case.hidden, generator=g).to(dtype) for T in case.tokens]


def reference_grads(case, inputs, biases, vs, *, bias):
    """The reference's output and gradients (x, w0, w1, topk_weights[, b0, b1]) of every rank
    (CPU)."""
    groups = list(inputs) + (list(biases) if bias else [])
    leaves = [[t.detach().clone().requires_grad_(t.dtype.is_floating_point) for t in group]
              for group in groups]
    xs, w0s, w1s, ids, wts = leaves[:5]
    b0s, b1s = leaves[5:] if bias else (None, None)
    y0s = ref.layer0_sim(xs, w0s, ids, case.experts, b0s)
    outs = ref.layer1_sim([activation(y, case.n1) for y in y0s], w1s, wts, ids, case.experts, b1s)
    sum((o.float() * v.float()).sum() for o, v in zip(outs, vs)).backward()
    grad = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731
    result = []
    for r in range(case.world):
        leaves_r = [xs[r], w0s[r], w1s[r], wts[r]] + ([b0s[r], b1s[r]] if bias else [])
        result.append((outs[r].detach(), [grad(t) for t in leaves_r]))
    return result


def comet_grads(case, rank, inputs, biases, vs, *, bias, transposed, max_rows):
    """This rank's output and gradients through the wrappers on the GPU, in the reference's
    layouts (the gradient of a transposed weight transposed back), on the CPU."""
    x, w0, w1, tid, tw, b0, b1 = layer_args(rank, inputs, biases, bias=bias, transposed=transposed)
    leaves = [x, w0, w1, tw] + ([b0, b1] if bias else [])
    for t in leaves:
        t.requires_grad_()
    y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, b0=b0,
                                  w0_transposed=transposed, max_rows=max_rows)
    if max_rows is not None:
        assert y0.shape[0] == max_rows
    out = comet.moe_layer1(activation(y0, case.n1), w1, tw, layout, b1=b1,
                           w1_transposed=transposed)
    out.backward(vs[rank].to(out.device))
    torch.cuda.synchronize()
    grads = [t.grad for t in leaves]
    if transposed:
        grads[1], grads[2] = grads[1].transpose(1, 2), grads[2].transpose(1, 2)
    return out.detach().cpu(), [None if g is None else g.cpu() for g in grads]


GRAD_NAMES = ("dx", "dw0", "dw1", "dtopk_weights", "db0", "db1")
AUTOGRAD_OPTIONS = {"plain": dict(bias=False, transposed=False, bounded=False),
                    "bias+transposed+max_rows": dict(bias=True, transposed=True, bounded=True)}


@pytest.mark.parametrize("opts", list(AUTOGRAD_OPTIONS.values()), ids=list(AUTOGRAD_OPTIONS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_autograd_bf16_matches_reference(world, case, opts):
    rank, _w = world
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    vs = cotangents(case, BF16)
    expect_out, expect = reference_grads(case, inputs, biases, vs, bias=opts["bias"])[rank]
    if opts["bounded"]:
        run_layers(case, rank, inputs, biases, bias=False, transposed=False)  # sizes the buffer
    out, grads = comet_grads(case, rank, inputs, biases, vs, bias=opts["bias"],
                             transposed=opts["transposed"],
                             max_rows=bound_for(case) if opts["bounded"] else None)
    torch.testing.assert_close(out, expect_out, **TOL[BF16])
    for name, g, e in zip(GRAD_NAMES, grads, expect):
        assert g is not None and g.dtype == e.dtype and g.shape == e.shape, (case, name)
        scale = max(1.0, float(e.float().abs().max())) if e.numel() else 1.0
        torch.testing.assert_close(g.float() / scale, e.float() / scale, **GRAD_TOL,
                                   msg=lambda m, name=name: f"{case} {name}: {m}")
    ids = inputs[3][rank]
    assert torch.all(grads[3][ids < 0] == 0), "dropped slots must get zero weight gradient"


def _sized_pair(world):
    """A group of at least 2 ranks whose buffer an eager call has sized: (rank, world size, case,
    inputs, biases, this rank's (x, w0, topk_ids), a max_rows bound for the case)."""
    rank, w = world
    if w < 2:
        pytest.skip("needs a peer")
    case = cases_for(w)[0]
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    run_layers(case, rank, inputs, biases, bias=False, transposed=False)  # eager: sizes the buffer
    x, w0, _w1, tid, _tw, _b0, _b1 = layer_args(rank, inputs, biases, bias=False, transposed=False)
    return rank, w, case, inputs, biases, (x, w0, tid), bound_for(case)


def test_failure_without_host_sync_is_reported_once_not_in_turns(world):
    """A call with max_rows (no host synchronisation) that one rank's bad input rejects: the ranks
    that could not know raise after their NEXT call, which itself runs (so the peers are not
    rejected in turn and the ranks do not take turns failing); the call after that is clean."""
    rank, w, case, inputs, biases, (x, w0, tid), bound = _sized_pair(world)
    bad = x.to(torch.float32) if rank == 1 else x  # rank 1's host check rejects its own call
    if rank == 1:
        with pytest.raises(TypeError):
            comet.moe_layer0(bad, w0, tid, num_experts=case.experts, max_rows=bound)
    else:
        comet.moe_layer0(bad, w0, tid, num_experts=case.experts, max_rows=bound)  # no read-back
    # next call: valid everywhere; the ranks other than 1 report the rejected call after it
    if rank == 1:
        comet.moe_layer0(x, w0, tid, num_experts=case.experts, max_rows=bound)
    else:
        with pytest.raises(ValueError, match="earlier call"):
            comet.moe_layer0(x, w0, tid, num_experts=case.experts, max_rows=bound)
    # and the one after runs clean on every rank, with correct results
    y0, layout, h, out = run_layers(case, rank, inputs, biases, bias=False, transposed=False,
                                    max_rows=bound)
    _buffer().check()
    check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=False,
                    rows=int(layout.recv_counts.sum()))


def test_max_rows_on_one_rank_only_raises_on_every_rank(world):
    """Rank 0 passes max_rows, the others none: max_rows is in the call metadata, so the call is
    rejected everywhere. The ranks without a bound read the verdict back and raise at once, naming
    both values; rank 0 (no read-back) reports it after its next call, as any rejected call without
    host synchronisation; then every rank runs clean. (Written, never run: no GPU here.)"""
    rank, w, case, inputs, biases, (x, w0, tid), bound = _sized_pair(world)
    if rank == 0:
        comet.moe_layer0(x, w0, tid, num_experts=case.experts, max_rows=bound)  # no read-back
        with pytest.raises(ValueError, match="earlier call.*max_rows"):
            comet.moe_layer0(x, w0, tid, num_experts=case.experts)
    else:
        with pytest.raises(ValueError,
                           match=f"ranks disagree on max_rows .*rank 0 has {bound}, rank 1 has -1"):
            comet.moe_layer0(x, w0, tid, num_experts=case.experts)
        comet.moe_layer0(x, w0, tid, num_experts=case.experts)
    y0, layout, h, out = run_layers(case, rank, inputs, biases, bias=False, transposed=False)
    _buffer().check()
    check_reference(case, BF16, rank, w, y0, layout, h, out, inputs, biases, bias=False)


# --------------------------------------------------------------------------------------------------
# SM margin (docs/gpu.md, "SM margin")
# --------------------------------------------------------------------------------------------------


def test_sm_margin_changes_no_bit_and_one_that_leaves_no_sm_is_refused(world):
    """The buffer's default (2 with peers, 0 in a world of one), a call's own margin and none give the same bits; a margin of
    every SM is refused on every rank (here: every rank passes it) and the buffer serves the next
    call."""
    from comet.buffers import symm_cuda

    rank, w = world
    case = cases_for(w)[0]
    inputs, biases = make_inputs(case, BF16), make_biases(case, BF16)
    x, w0, w1, tid, tw, _b0, _b1 = layer_args(rank, inputs, biases, bias=False, transposed=False)
    buf = _buffer()
    assert buf.sm_margin == (2 if w > 1 else 0) and symm_cuda.DEFAULT_SM_MARGIN == 2
    outs = []
    for margin in (None, 0, 5):
        y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, sm_margin=margin)
        out = comet.moe_layer1(h_from_y0(y0, case.n1), w1, tw, layout, sm_margin=margin)
        torch.cuda.synchronize()
        outs.append((y0, out))
    for y0, out in outs[1:]:
        assert torch.equal(y0, outs[0][0]) and torch.equal(out, outs[0][1])
    sms = torch.cuda.get_device_properties(_device()).multi_processor_count
    with pytest.raises(ValueError, match=f"sm_margin={sms} leaves none of this GPU's {sms} SMs"):
        comet.moe_layer0(x, w0, tid, num_experts=case.experts, sm_margin=sms)
    y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts)
    torch.cuda.synchronize()
    assert torch.equal(y0, outs[0][0])
