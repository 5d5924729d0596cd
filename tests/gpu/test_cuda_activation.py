"""moe_layer0(activation=...) on CUDA, one process per GPU (see conftest.py for the command).
WRITTEN, NEVER RUN: no machine of this project has had a GPU for it; the file skips without one.

The 16-bit kernels of both paths (the sm_80 path on sm_80 / sm_86 / sm_89 and newer GPUs, the
sm_90a TMA + wgmma kernels on sm_90) fuse the activation into layer0's epilogue (B-row remap, gate
and up accumulators paired in registers), and the sm_89 FP8 kernel; h_fp8 (h as packed FP8 rows,
each 1 x 128 block quantised in the epilogue) on the sm_80 path and sm_89. With FP8 operands or
h_fp8 on sm_90, and for FP8 gated forms with F % 64 != 0, the op refuses `activation=` (an error
on every rank before any kernel, the buffer then serving the next call) and comet.moe_layer0
applies it after the op.
Checked here, on whichever the GPU runs: each activation against a float64 oracle of the rank's
rows written in this file (bf16 tolerance), with biases, transposed weights, awkward shapes (odd
H, odd F, F spanning a partial n-tile, E_local = 3, dropped slots, more than one m-tile),
max_rows, tensor-parallel shards ([gate shard; up shard] per rank), bitwise run to run; the
direct op's fused result or its refusal; backward through the wrapper; h_fp8: the FP8 h and its
scales against the float64 oracle at FP8 tolerance, each block's scale its oracle amax / 448 and
its largest value +-448, bitwise run to run and across block splits and tile rows (where the op
does not fuse it: quantize_rows' bits of the activation applied after the op)."""
import math
import os

import pytest
import torch

import comet
from comet.layers import activation as _act
from tests.cases import Case, cases_for, make_biases, make_inputs
from tests.gpu.conftest import require_fp8

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
BF16 = torch.bfloat16
TOL = dict(atol=3e-2, rtol=3e-2)
NAMES = ["swiglu", "geglu", "silu", "gelu"]


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _buffer():
    from comet.buffers import symm_cuda

    return symm_cuda.buffer_for(None, _device())


def _quantises() -> bool:
    """Whether this GPU's kernels quantise h in the epilogue (h_fp8): the sm_80 path's and the
    sm_89 FP8 kernel's, not sm_90a's (on an sm_90 GPU the wrapper quantises after the op)."""
    return torch.cuda.get_device_capability(_device())[0] != 9


def _oracle(name, y):
    """act of the float64 pre-activation y [rows, N0], the pairing written out: gate columns
    [0, F), up columns [F, 2F)."""
    f = (lambda v: v / (1.0 + torch.exp(-v))) if name in ("swiglu", "silu") else \
        (lambda v: 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0))))
    if name in ("swiglu", "geglu"):
        n = y.shape[-1] // 2
        return f(y[..., :n]) * y[..., n:]
    return f(y)


def _big_case():
    # F = 136: two whole 64-column n-tiles of h and a partial one (8 columns); 300+ rows: more
    # than one m-tile; E_local = 3; H a multiple of 8 (16-byte copies).
    return Case(f"big-w{WORLD}", WORLD, 3 * WORLD, 2, tuple(300 - 17 * r for r in range(WORLD)),
                hidden=64, n0=272, routing="dropped", seed=11)


CASES = [cases_for(WORLD)[5], cases_for(WORLD)[1], _big_case()]  # odd H / F; empty rank; big


def _expected(name, case, xs, w0s, b0s, ids, lay, w0_local=None, b0_local=None):
    """The rank's h rows from float64: row (s, t, j) = act(x_s[t] @ w0[e]^T + b0[e])."""
    el = case.experts // WORLD
    w0 = torch.cat(w0s).double() if w0_local is None else w0_local.double()
    b0 = None if b0s is None else (torch.cat(b0s).double() if b0_local is None
                                   else b0_local.double())
    rows = []
    for s, t, j in zip(lay.row_source.tolist(), lay.row_token.tolist(), lay.row_slot.tolist()):
        e = int(ids[s][t, j])
        if w0_local is not None:
            e -= RANK * el
        y = xs[s][t].double() @ w0[e].T
        rows.append(_oracle(name, y if b0 is None else y + b0[e]))
    return torch.stack(rows) if rows else None


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("transposed", [False, True])
def test_activation_matches_float64_oracle(name, case, transposed):
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    b0s = make_biases(case, BF16)[0]
    dev = _device()
    w0 = w0s[RANK].transpose(1, 2).contiguous() if transposed else w0s[RANK]
    args = (xs[RANK].to(dev), w0.to(dev), ids[RANK].to(dev))
    kw = dict(num_experts=case.experts, b0=b0s[RANK].to(dev), activation=name,
              w0_transposed=transposed, buffer=_buffer())
    h, lay = comet.moe_layer0(*args, **kw)
    assert h.shape[1] == _act.out_cols(name, case.n0) and h.dtype == BF16
    want = _expected(name, case, xs, w0s, b0s, ids, lay)
    if want is not None:
        torch.testing.assert_close(h.cpu().double(), want, **TOL)
    again, _ = comet.moe_layer0(*args, **kw)
    assert torch.equal(h.view(torch.int16), again.view(torch.int16))  # bitwise run to run


@pytest.mark.parametrize("tile", [(128, 128), (64, 128)], ids=["tile128", "tile64"])
@pytest.mark.parametrize("name", ["swiglu", "silu"])
@pytest.mark.parametrize("transposed", [False, True])
def test_activation_both_tile_heights(name, tile, transposed):
    """Both tile heights of each path (on sm_90 the 128-row tile's two MMA warpgroups and the
    64-row tile's one), both weight layouts, against the oracle; H % 8 == 0 and F % 8 == 0 so the
    sm_90a kernels take it there. F = 136: h's last n-tile is partial (8 columns), its up box
    reads past the gate half's end."""
    case = _big_case()
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    b0s = make_biases(case, BF16)[0]
    dev = _device()
    w0 = w0s[RANK].transpose(1, 2).contiguous() if transposed else w0s[RANK]
    h, lay = comet.moe_layer0(xs[RANK].to(dev), w0.to(dev), ids[RANK].to(dev),
                              num_experts=case.experts, b0=b0s[RANK].to(dev), activation=name,
                              w0_transposed=transposed, tile=tile, buffer=_buffer())
    want = _expected(name, case, xs, w0s, b0s, ids, lay)
    if want is not None:
        torch.testing.assert_close(h.cpu().double(), want, **TOL)


@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_activation_with_max_rows_and_no_bias(name):
    case = _big_case()
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    dev = _device()
    bound = 2 * sum(case.tokens) * case.topk
    h, lay = comet.moe_layer0(xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev),
                              num_experts=case.experts, activation=name, max_rows=bound,
                              buffer=_buffer())
    assert h.shape[0] == bound
    want = _expected(name, case, xs, w0s, None, ids, lay)
    if want is not None:
        torch.testing.assert_close(h[:want.shape[0]].cpu().double(), want, **TOL)


@pytest.mark.skipif(WORLD < 2, reason="tensor parallelism needs a group of at least 2 ranks")
def test_activation_under_tensor_parallelism():
    """tp_size = WORLD: every rank one EP rank's tp shard, w0's shard [gate shard; up shard]."""
    t = WORLD
    case = Case(f"tp-w{WORLD}", WORLD, 3, 2, tuple(50 + 7 * r for r in range(WORLD)),
                hidden=64, n0=32 * t, routing="dropped", seed=13)
    g = torch.Generator().manual_seed(77)
    xs = [torch.randn(n, case.hidden, generator=g).to(BF16) for n in case.tokens]
    ids = [torch.randint(-1, case.experts, (n, case.topk), generator=g) for n in case.tokens]
    w0 = torch.randn(case.experts, case.n0, case.hidden, generator=g).to(BF16)  # [gate; up]
    f, fs = case.n0 // 2, case.n0 // 2 // t
    q = RANK % t
    shard = torch.cat([w0[:, q * fs:(q + 1) * fs], w0[:, f + q * fs:f + (q + 1) * fs]], dim=1)
    dev = _device()
    h, lay = comet.moe_layer0(xs[RANK].to(dev), shard.contiguous().to(dev), ids[RANK].to(dev),
                              num_experts=case.experts, activation="swiglu", tp_size=t,
                              buffer=_buffer())
    rows = [_oracle("swiglu", xs[s][tk].double() @ shard[int(ids[s][tk, j])].double().T)
            for s, tk, j in zip(lay.row_source.tolist(), lay.row_token.tolist(),
                                lay.row_slot.tolist())]
    assert h.shape[1] == fs
    if rows:
        torch.testing.assert_close(h.cpu().double(), torch.stack(rows), **TOL)


def test_op_fuses_or_refuses_on_every_rank():
    """The op itself: fused for 16-bit operands on every GPU (the oracle's values); h_fp8 and an
    odd N0 refused (ValueError on every rank, the buffer then serving the next call)."""
    case = cases_for(WORLD)[0]
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    dev = _device()
    buf = _buffer()
    args = (xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev), case.experts, buf.handle,
            8, 0, 128, 128)
    h, _a, _rc, _sp, src, tok, slot = torch.ops.comet.moe_layer0(*args, activation="swiglu")
    rows = [_oracle("swiglu", xs[s][t].double() @ torch.cat(w0s)[int(ids[s][t, j])].double().T)
            for s, t, j in zip(src.tolist(), tok.tolist(), slot.tolist())]
    if rows:
        torch.testing.assert_close(h.cpu().double(), torch.stack(rows), **TOL)
    if _quantises():  # h_fp8: packed FP8 rows, uint8 [M, fp8.row_bytes(F)]
        from comet import fp8

        hq = torch.ops.comet.moe_layer0(*args, activation="swiglu", h_fp8=True)[0]
        assert hq.dtype == torch.uint8 and hq.shape[1] == fp8.row_bytes(case.n0 // 2)
    else:
        with pytest.raises(ValueError, match="h_fp8=True is not fused into the sm_90a kernels"):
            torch.ops.comet.moe_layer0(*args, activation="swiglu", h_fp8=True)
    with pytest.raises(ValueError, match="pairs w0's gate and up halves"):
        torch.ops.comet.moe_layer0(*args[:1], w0s[RANK][:, :19].contiguous().to(dev), *args[2:],
                                   activation="geglu")
    comet.moe_layer0(xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev),
                     num_experts=case.experts, buffer=buf)  # the buffer serves the next call


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
    for a, b in zip(*grads):  # the fused h and the unfused one round differently
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


# -- h_fp8 ------------------------------------------------------------------------------------

H_FP8_CASES = [  # F % 128: 0 (256), in (64, 128) (200: a block of two GEMM tiles, the second
    # partial), in (0, 64] (136: a last block of one GEMM tile); odd H, E_local = 3, dropped slots
    Case(f"hfp8-f256-w{WORLD}", WORLD, 2 * WORLD, 2, tuple(150 + 9 * r for r in range(WORLD)),
         hidden=64, n0=512, routing="skewed", seed=21),
    Case(f"hfp8-f200-w{WORLD}", WORLD, 3 * WORLD, 2, tuple(70 - 30 * (r % 2) for r in range(WORLD)),
         hidden=37, n0=400, routing="dropped", seed=22),
    _big_case(),
    cases_for(WORLD)[1],  # an empty rank
]


def _check_h_fp8(q, s, want):
    """q [M, F] e4m3 and s [M, ceil(F/128)] against the float64 h `want` [M, F]: each block's scale
    is its amax / 448 (1 for a zero block; fp32 against fp64 values: 1e-4 relative), its largest
    |q| is 448, and q * s is want within e4m3's rounding (half a step: 2^-4 relative, or half the
    smallest subnormal step 2^-10 * s) and the fp32 arithmetic's slack. (Bitwise equality with
    quantize_rows would need the kernel's own fp32 h, which no call returns.)"""
    from comet import fp8

    m, f = want.shape
    assert q.shape == (m, f) and s.shape == (m, -(-f // 128)) and s.dtype == torch.float32
    q, s = q.cpu(), s.cpu()
    blocks = torch.nn.functional.pad(want.abs(), (0, s.shape[1] * 128 - f)).view(m, -1, 128)
    amax = blocks.amax(dim=2)
    want_s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    torch.testing.assert_close(s.double(), want_s, rtol=1e-4, atol=0)
    qa = torch.nn.functional.pad(q.float().abs(), (0, s.shape[1] * 128 - f)).view(m, -1, 128)
    assert torch.equal(qa.amax(dim=2)[amax > 0], torch.full_like(amax[amax > 0], 448.0).float())
    deq = fp8.dequantize_rows(q, s).double()
    # (the fp32 sums' error under cancellation: 1% of a scale step, i.e. 2e-5 of the block's amax)
    step = s.double().repeat_interleave(128, dim=1)[:, :f]
    slack = step * (2.0 ** -10 + 0.01) + 1e-4 * want.abs()
    assert ((deq - want).abs() <= want.abs() * 2.0 ** -4 + slack).all()


def _h_fp8_op(args, name, n_comm, tile_m, b0):
    """The direct op's packed FP8 h (uint8 [M, fp8.row_bytes(F)]) for one block split and tile
    rows."""
    return torch.ops.comet.moe_layer0(*args, _buffer().handle, n_comm, 0, tile_m, 128, b0,
                                      activation=name, h_fp8=True)[0]


@pytest.mark.parametrize("case", H_FP8_CASES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_h_fp8_against_float64_oracle(name, case):
    """The wrapper's (q, h_scale) with a bias, transposed weights for the plain forms; bitwise run
    to run. Where the op does not fuse the activation: quantize_rows of act(y0)."""
    from comet import fp8

    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    b0s = make_biases(case, BF16)[0]
    dev = _device()
    transposed = name in ("silu", "gelu")
    w0 = w0s[RANK].transpose(1, 2).contiguous() if transposed else w0s[RANK]
    args = (xs[RANK].to(dev), w0.to(dev), ids[RANK].to(dev))
    kw = dict(num_experts=case.experts, b0=b0s[RANK].to(dev), activation=name,
              w0_transposed=transposed, buffer=_buffer())
    (q, s), lay = comet.moe_layer0(*args, **kw, h_fp8=True)
    f = _act.out_cols(name, case.n0)
    assert q.dtype == torch.float8_e4m3fn and q.shape[1] == f
    if not _quantises():
        y0, _ = comet.moe_layer0(*args, **{**kw, "activation": None})
        want_q, want_s = fp8.quantize_rows(_act.apply(name, y0).float())
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s, want_s)
        return
    want = _expected(name, case, xs, w0s, b0s, ids, lay)
    if want is not None:
        _check_h_fp8(q, s, want)
    (q2, s2), _ = comet.moe_layer0(*args, **kw, h_fp8=True)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_h_fp8_bitwise_across_splits_and_tiles(name):
    """The packed rows (values, scales, padding) do not depend on the comm / GEMM block split or
    the tile rows (each 128-column block is quantised inside one tile)."""
    if not _quantises():
        pytest.skip("the sm_90a kernels do not quantise h (h_fp8) in their epilogue")
    case = H_FP8_CASES[1]
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    b0s = make_biases(case, BF16)[0]
    dev = _device()
    args = (xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev), case.experts)
    b0 = b0s[RANK].to(dev)
    ref = _h_fp8_op(args, name, 8, 128, b0)
    assert ref.dtype == torch.uint8
    for n_comm, tile_m in ((4, 128), (16, 64), (2, 64)):
        assert torch.equal(_h_fp8_op(args, name, n_comm, tile_m, b0), ref), (n_comm, tile_m)


def test_h_fp8_with_max_rows():
    """max_rows: [R, F] / [R, ceil(F/128)], the first M rows as without it (rows past M are
    unspecified on CUDA)."""
    case = _big_case()
    xs, w0s, _w1s, ids, _ = make_inputs(case, BF16)
    dev = _device()
    args = (xs[RANK].to(dev), w0s[RANK].to(dev), ids[RANK].to(dev))
    bound = 2 * sum(case.tokens) * case.topk
    kw = dict(num_experts=case.experts, activation="swiglu", h_fp8=True, buffer=_buffer())
    (q, s), lay = comet.moe_layer0(*args, **kw, max_rows=bound)
    (q0, s0), _ = comet.moe_layer0(*args, **kw)
    m = q0.shape[0]
    assert q.shape == (bound, case.n0 // 2) and s.shape == (bound, -(-(case.n0 // 2) // 128))
    assert torch.equal(q[:m].view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s[:m], s0)
    want = _expected("swiglu", case, xs, w0s, None, ids, lay)
    if want is not None and _quantises():
        _check_h_fp8(q0, s0, want)


# -- FP8 (sm_89's mma.sync kernel fuses it; sm_90 applies it after the op) ----------------------

FP8_CASES = [  # N0 % 128 == 0 (fused on sm_89); N0 = 144: F = 72, applied after the op there
    Case(f"fp8-w{WORLD}", WORLD, 3 * WORLD, 2, tuple(150 + 11 * r for r in range(WORLD)),
         hidden=208, n0=384, routing="dropped", seed=31),
    Case(f"fp8-f72-w{WORLD}", WORLD, 2 * WORLD, 2, tuple(40 + 3 * r for r in range(WORLD)),
         hidden=144, n0=144, seed=32),
]


def _fp8_call(case):
    """FP8 x and w0 (quantize_rows / quantize_blocks of the case's inputs) with a bf16 bias:
    (args, kwargs) of comet.moe_layer0 and oracle(name, layout), the float64 h of the rank's rows
    from the dequantised values. Skips without FP8 tensor cores."""
    from comet import fp8

    require_fp8(_device())
    xs, w0s, _w1s, ids, _ = make_inputs(case)
    b0s = make_biases(case, BF16)[0]
    xq = [fp8.quantize_rows(x) for x in xs]
    wq = [fp8.quantize_blocks(w) for w in w0s]
    dev = _device()
    kw = dict(num_experts=case.experts, x_scale=xq[RANK][1].to(dev), w0_scale=wq[RANK][1].to(dev),
              b0=b0s[RANK].to(dev), buffer=_buffer())
    args = (xq[RANK][0].to(dev), wq[RANK][0].to(dev), ids[RANK].to(dev))
    xd = [fp8.dequantize_rows(*q).double() for q in xq]
    wd = [fp8.dequantize_blocks(*q).double() for q in wq]
    return args, kw, lambda name, lay: _expected(name, case, xd, wd, b0s, ids, lay)


@pytest.mark.parametrize("case", FP8_CASES, ids=str)
@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_fp8_activation_matches_float64_oracle(name, case):
    """FP8 x and w0 (1 x 128 / 128 x 128 scales): h against the oracle on the dequantised values,
    with a bias; bitwise run to run."""
    args, kw, oracle = _fp8_call(case)
    h, lay = comet.moe_layer0(*args, **kw, activation=name)
    want = oracle(name, lay)
    if want is not None:
        torch.testing.assert_close(h.cpu().double(), want, **TOL)
    again, _ = comet.moe_layer0(*args, **kw, activation=name)
    assert torch.equal(h.view(torch.int16), again.view(torch.int16))


@pytest.mark.parametrize("case", FP8_CASES, ids=str)
@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_fp8_h_fp8(name, case):
    """FP8 x and w0 with h_fp8: fused on sm_89 (gated forms: N0 % 128 == 0), (q, h_scale) against
    the oracle on the dequantised inputs at FP8 tolerance and bitwise run to run; where the op
    does not fuse the activation, quantize_rows' bits of act(y0)."""
    from comet import fp8

    args, kw, oracle = _fp8_call(case)
    (q, s), lay = comet.moe_layer0(*args, **kw, activation=name, h_fp8=True)
    fused = _quantises() and (name not in _act.GATED or case.n0 % 128 == 0)
    if not fused:
        y0, _ = comet.moe_layer0(*args, **kw)
        want_q, want_s = fp8.quantize_rows(_act.apply(name, y0).float())
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s, want_s)
        return
    want = oracle(name, lay)
    if want is not None:
        _check_h_fp8(q, s, want)
    (q2, s2), _ = comet.moe_layer0(*args, **kw, activation=name, h_fp8=True)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
