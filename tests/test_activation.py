"""The activation fused into layer0's epilogue (moe_layer0(activation=...), comet/activation.h) on
the CPU backend, against float64 oracles written here from the published definitions:

* forward: every dispatched row of h equals act(x_s[t] @ w0[e]^T + b0[e]) (gated: act(gate) * up
  with w0 = [gate; up]) in float64, fp32 at 1e-5 and bf16 at its tolerance, on 1-4 simulated
  ranks over the awkward cases (empty rank, skew, dropped slots, duplicates, odd sizes, E not a
  power of two), with biases, transposed weights, max_rows, EP x TP and a placement;
* bitwise run to run and across block splits and tiles;
* backward: layer0(activation) -> layer1 in float64, every gradient (x, w0, b0, w1, topk_weights)
  against torch autograd of the float64 oracle, also with the weight gradients deferred, and in
  two gloo processes;
* bad input (unknown name, odd N0 for a gated form) raises on every rank before any kernel;
* h_fp8=True: h quantised in the epilogue equals comet.fp8.quantize_rows of the fp32 h bit for
  bit (16/32-bit and FP8 inputs), across splits and tiles, padded rows of scale 1, into layer1.
"""
import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comet
import comet.fp8
from comet.plan import Placement
from tests.cases import E6_ON_3, TOL, cases_for, make_biases, make_inputs
from tests.dist_utils import run_ranks
from tests.sim_world import run_threads

ACTS = ("swiglu", "geglu", "silu", "gelu")
GATED = ("swiglu", "geglu")


# -- The oracle (float64, from the definitions: Shazeer 2020 for the GLU forms, Hendrycks and
# Gimpel 2016 for GELU's exact erf form, Elfwing et al. 2018 for SiLU) ---------------------------

def oracle_act(name, y):
    """y [..., N0] float64 -> the activation's output."""
    def silu(v):
        return v / (1.0 + torch.exp(-v))

    def gelu(v):
        return 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0)))

    f = silu if name in ("swiglu", "silu") else gelu
    if name in GATED:
        n = y.shape[-1] // 2
        return f(y[..., :n]) * y[..., n:]
    return f(y)


def oracle_rows(name, xs, w0_full, b0_full, ids, layout, experts):
    """h's rows for this rank's layout from every rank's x, the full experts' weights [E, N0, H]
    and biases [E, N0] (float64)."""
    rows = []
    for s, t, j in zip(layout.row_source.tolist(), layout.row_token.tolist(),
                       layout.row_slot.tolist()):
        if s < 0:
            break
        e = int(ids[s][t, j])
        pre = xs[s][t].double() @ w0_full[e].double().T
        if b0_full is not None:
            pre = pre + b0_full[e].double()
        rows.append(oracle_act(name, pre))
    return torch.stack(rows) if rows else torch.zeros(0, 1, dtype=torch.float64)


def full_experts(per_rank):
    return torch.cat(per_rank, 0)


# -- Forward ------------------------------------------------------------------------------------

def _forward(case, name, dtype, *, bias=True, transposed=False, max_rows=None, launch=None):
    xs, w0s, _w1s, ids, _wts = make_inputs(case, dtype)
    b0s = make_biases(case, dtype)[0] if bias else [None] * case.world
    launch = launch or {}

    def body(r, buf):
        w0 = w0s[r].transpose(1, 2).contiguous() if transposed else w0s[r]
        h, lay = comet.moe_layer0(xs[r], w0, ids[r], num_experts=case.experts, b0=b0s[r],
                                  w0_transposed=transposed, buffer=buf, activation=name,
                                  max_rows=max_rows, **launch)
        return h, lay

    return run_threads(case.world, body), (xs, w0s, b0s, ids)


def _check_forward(case, name, dtype, **kw):
    results, (xs, w0s, b0s, ids) = _forward(case, name, dtype, **kw)
    b0_full = None if b0s[0] is None else full_experts(b0s)
    for r, (h, lay) in enumerate(results):
        m = int(lay.recv_counts.sum())
        want = oracle_rows(name, xs, full_experts(w0s), b0_full, ids, lay, case.experts)
        f = case.n0 // 2 if name in GATED else case.n0
        assert h.dtype == dtype and h.shape[1] == f, (case, name, h.shape)
        if m:
            torch.testing.assert_close(h[:m].double(), want.to(dtype).double(), **TOL[dtype],
                                       msg=lambda s: f"{case} {name} rank {r}: {s}")
        if kw.get("max_rows") is not None:
            assert h.shape[0] == kw["max_rows"] and torch.all(h[m:] == 0)
    return results


@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_forward_matches_float64_oracle_fp32(world, name):
    for case in cases_for(world) + ([E6_ON_3] if world == 3 else []):
        _check_forward(case, name, torch.float32)


@pytest.mark.parametrize("name", ACTS)
def test_forward_bf16_transposed_without_bias(name):
    for case in cases_for(3):
        _check_forward(case, name, torch.bfloat16, transposed=True, bias=False)


@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_forward_with_max_rows_pads_with_zeros(name):
    case = cases_for(2)[5]  # skewed, odd sizes
    _check_forward(case, name, torch.float32, max_rows=sum(case.tokens) * case.topk)


def test_bitwise_run_to_run_and_across_splits_and_tiles():
    case = cases_for(3)[5]
    base = [h for h, _ in _forward(case, "swiglu", torch.bfloat16)[0]]
    for launch in ({}, dict(n_comm=0, tile=(1, 1)), dict(n_comm=2, tile=(3, 5)),
                   dict(n_comm=1, tile=(64, 128))):
        again = [h for h, _ in _forward(case, "swiglu", torch.bfloat16, launch=launch)[0]]
        for a, b in zip(base, again):
            assert torch.equal(a, b), launch


def test_fused_is_computed_from_the_accumulators_not_a_rounded_y0():
    """bf16: h is act(acc) rounded once; act(rounded y0) differs in some element (the rounding
    the fusion saves), so a fused result equal to the unfused one would show it is not fused."""
    case = cases_for(2)[0]
    fused = _forward(case, "swiglu", torch.bfloat16)[0]
    xs, w0s, _w1s, ids, _ = make_inputs(case, torch.bfloat16)
    b0s = make_biases(case, torch.bfloat16)[0]

    def plain(r, buf):
        return comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts, b0=b0s[r],
                                buffer=buf)[0]

    y0s = run_threads(case.world, plain)
    differs = False
    for (h, _), y0 in zip(fused, y0s):
        unfused = oracle_act("swiglu", y0.double()).to(torch.bfloat16)
        differs |= not torch.equal(h, unfused)
    assert differs


def test_expert_tensor_parallel_shards_of_f():
    """tp_size=2 on 4 ranks: each rank's w0 shard is [gate shard; up shard] of its EP rank's
    experts, and h is that rank's shard of F."""
    W, tp, E, H, F = 4, 2, 4, 12, 10
    g = torch.Generator().manual_seed(7)
    tokens = (5, 0, 6, 3)
    xs = [torch.randn(T, H, generator=g) for T in tokens]
    ids = [torch.randint(0, E, (T, 2), generator=g) for T in tokens]
    ids[3][1, 0] = -1
    gate = torch.randn(E, F, H, generator=g) / H ** 0.5
    up = torch.randn(E, F, H, generator=g) / H ** 0.5
    bg, bu = torch.randn(E, F, generator=g), torch.randn(E, F, generator=g)
    el, fs = E // (W // tp), F // tp

    def shard(r):
        ep, t = divmod(r, tp)
        es, cols = slice(ep * el, (ep + 1) * el), slice(t * fs, (t + 1) * fs)
        return (torch.cat([gate[es, cols], up[es, cols]], 1).contiguous(),
                torch.cat([bg[es, cols], bu[es, cols]], 1).contiguous())

    def body(r, buf):
        w0, b0 = shard(r)
        return comet.moe_layer0(xs[r], w0, ids[r], num_experts=E, b0=b0, buffer=buf, tp_size=tp,
                                activation="swiglu")

    for r, (h, lay) in enumerate(run_threads(W, body)):
        t = r % tp
        full = oracle_rows("swiglu", xs, torch.cat([gate, up], 1), torch.cat([bg, bu], 1), ids,
                           lay, E)
        assert h.shape[1] == fs
        if full.shape[0]:
            torch.testing.assert_close(h.double(), full[:, t * fs:(t + 1) * fs],
                                       **TOL[torch.float32])


def test_placement_rows_match_oracle():
    W, E, H, N0 = 3, 4, 16, 12
    placement = Placement([[0, 2], [0, 1], [1], [2]], world=W)  # expert 0 on ranks 0 and 2
    g = torch.Generator().manual_seed(11)
    tokens = (6, 4, 0)
    xs = [torch.randn(T, H, generator=g) for T in tokens]
    ids = [torch.randint(0, E, (T, 2), generator=g) for T in tokens]
    w0 = torch.randn(E, N0, H, generator=g) / H ** 0.5
    b0 = torch.randn(E, N0, generator=g)

    def body(r, buf):
        mine = list(placement.local_experts(r))
        h, lay = comet.moe_layer0(xs[r], w0[mine].contiguous(), ids[r], num_experts=E,
                                  b0=b0[mine].contiguous(), buffer=buf, placement=placement,
                                  activation="geglu")
        return h, lay

    for h, lay in run_threads(W, body):
        m = int(lay.recv_counts.sum())
        want = oracle_rows("geglu", xs, w0, b0, ids, lay, E)
        assert h.shape == (m, N0 // 2)
        if m:
            torch.testing.assert_close(h.double(), want, **TOL[torch.float32])


# -- Backward -----------------------------------------------------------------------------------

def _chain_oracle(name, xs, w0s, b0s, w1s, ids, wts, experts, gouts):
    """sum over ranks and tokens of <out_s[t], gout_s[t]> in float64, out from the definitions."""
    w0, b0, w1 = full_experts(w0s), full_experts(b0s), full_experts(w1s)
    loss = 0.0
    for s, x in enumerate(xs):
        for t in range(x.shape[0]):
            out = torch.zeros(w1.shape[1], dtype=torch.float64)
            for j in range(ids[s].shape[1]):
                e = int(ids[s][t, j])
                if e < 0:
                    continue
                h = oracle_act(name, x[t] @ w0[e].T + b0[e])
                out = out + wts[s][t, j] * (h @ w1[e].T)
            loss = loss + (out * gouts[s][t]).sum()
    return loss


def _chain_inputs(case, name):
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.float64)
    b0s = make_biases(case, torch.float64)[0]
    g = torch.Generator().manual_seed(99)
    f = case.n0 // 2 if name in GATED else case.n0
    w1s = [torch.randn(w.shape[0], case.hidden, f, generator=g, dtype=torch.float64) / f ** 0.5
           for w in w1s]
    wts = [w.double() for w in wts]
    gouts = [torch.randn(x.shape[0], case.hidden, generator=g, dtype=torch.float64) for x in xs]
    return xs, w0s, b0s, w1s, ids, wts, gouts


def _leaves(ts):
    return [t.clone().requires_grad_(True) for t in ts]


def _expected_grads(case, name, inputs):
    xs, w0s, b0s, w1s, ids, wts, gouts = inputs
    leaves = [_leaves(v) for v in (xs, w0s, b0s, w1s, wts)]
    _chain_oracle(name, *leaves[:4], ids, leaves[4], case.experts, gouts).backward()
    return [[t.grad for t in group] for group in leaves]


def _rank_chain(r, buf, case, name, inputs, deferred=False):
    xs, w0s, b0s, w1s, ids, wts, gouts = inputs
    x, w0, b0, w1, wt = _leaves([xs[r], w0s[r], b0s[r], w1s[r], wts[r]])
    h, lay = comet.moe_layer0(x, w0, ids[r], num_experts=case.experts, b0=b0, buffer=buf,
                              activation=name)
    out = comet.moe_layer1(h, w1, wt, lay, buffer=buf)
    loss = (out * gouts[r]).sum()
    if deferred:
        with comet.defer_weight_grads() as q:
            loss.backward()
        assert w0.grad is None and len(q) >= 1
        q.compute()
    else:
        loss.backward()
    return [t.grad for t in (x, w0, b0, w1, wt)]


def _check_grads(case, name, got, inputs):
    want = _expected_grads(case, name, inputs)
    for r, grads in enumerate(got):
        for label, g, w in zip(("x", "w0", "b0", "w1", "topk_weights"), grads,
                               [group[r] for group in want]):
            if w is None:  # an input the oracle never used (an empty rank's x): zero
                w = torch.zeros_like(g)
            torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9,
                                       msg=lambda s: f"{case} {name} d{label} rank {r}: {s}")


@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("world", [1, 3])
def test_backward_matches_float64_oracle(world, name):
    for case in (cases_for(world)[3], cases_for(world)[5]):  # dropped slots; skewed, odd sizes
        inputs = _chain_inputs(case, name)
        got = run_threads(case.world, lambda r, buf: _rank_chain(r, buf, case, name, inputs))
        _check_grads(case, name, got, inputs)


def test_backward_with_deferred_weight_grads():
    case = cases_for(2)[1]  # an empty rank
    inputs = _chain_inputs(case, "swiglu")
    got = run_threads(2, lambda r, buf: _rank_chain(r, buf, case, "swiglu", inputs, True))
    _check_grads(case, "swiglu", got, inputs)


def _process_chain(rank, world, case, name, inputs):
    return _rank_chain(rank, None, case, name, inputs)


def test_backward_two_processes():
    case = cases_for(2)[5]
    inputs = _chain_inputs(case, "geglu")
    got = run_ranks(_process_chain, 2, case, "geglu", inputs, timeout=180)
    _check_grads(case, "geglu", got, inputs)


# -- Bad input ----------------------------------------------------------------------------------

def _errors_on_every_rank(world, bad_rank, **bad):
    case = cases_for(world)[0]
    xs, w0s, _w1s, ids, _ = make_inputs(case)

    def body(r, buf):
        kw = dict(activation="swiglu")
        if bad_rank is None or r == bad_rank:  # None: every rank
            kw.update(bad)
        w0 = kw.pop("w0", w0s[r])
        try:
            comet.moe_layer0(xs[r], w0, ids[r], num_experts=case.experts, buffer=buf, **kw)
        except ValueError as e:
            return str(e)
        return None

    return run_threads(world, body)


def test_unknown_activation_raises_on_every_rank():
    msgs = _errors_on_every_rank(3, 1, activation="relu")
    assert all(m is not None for m in msgs), msgs
    assert ("activation must be None, 'swiglu', 'geglu', 'silu' or 'gelu', got 'relu'"
            in msgs[1]), msgs[1]
    assert all("rank 1" in m for i, m in enumerate(msgs) if i != 1), msgs


def test_odd_tp_shard_for_a_gated_form_raises_on_every_rank():
    """tp_size=2: the shard's N0 counts (each shard is its own [gate; up])."""
    case = cases_for(2)[0]
    xs, _w0s, _w1s, ids, _ = make_inputs(case)
    odd = torch.randn(case.experts, 7, case.hidden)  # EP = 1: every expert on both ranks

    def body(r, buf):
        with pytest.raises(ValueError) as err:
            comet.moe_layer0(xs[r], odd, ids[r], num_experts=case.experts, buffer=buf,
                             tp_size=2, activation="swiglu")
        return str(err.value)

    msgs = run_threads(2, body)
    want = ("activation='swiglu' pairs w0's gate and up halves ([gate; up]), so its "
            "N0 must be even, got N0 = 7 (this rank's shard of tp_size=2)")
    assert all(want in m for m in msgs), msgs


def test_odd_n0_for_a_gated_form_raises_on_every_rank():
    case = cases_for(2)[0]
    odd = torch.randn(case.experts // 2, 7, case.hidden)
    msgs = _errors_on_every_rank(2, 0, w0=odd, activation="geglu")
    assert all(m is not None for m in msgs), msgs
    assert "N0 = 7" in msgs[0] and "even" in msgs[0]
    # a plain form takes an odd N0
    assert _errors_on_every_rank(2, None, w0=odd, activation="gelu") == [None, None]


def test_op_refuses_bad_activation_directly():
    buf = comet.Buffer.simulated_world(1)[0]
    try:
        with pytest.raises(ValueError, match="'tanh'"):
            torch.ops.comet.moe_layer0(torch.ones(2, 4), torch.ones(1, 6, 4),
                                       torch.zeros(2, 1, dtype=torch.int64), 1, buf.handle,
                                       1, 1, 4, 8, activation="tanh")
    finally:
        buf.close()


# -- FP8 h for layer1 (h_fp8=True) -------------------------------------------------------------

def _fp8_h(case, name, launch=None, max_rows=None, fp8_inputs=False):
    """Every rank's ((hq, h_scale), layout) and its fp32 h from the same call without h_fp8."""
    xs, w0s, w1s, ids, wts = make_inputs(case)
    b0s = make_biases(case)[0]
    launch = launch or {}

    def body(r, buf):
        x, w0, kw = xs[r], w0s[r], {}
        if fp8_inputs:  # FP8 operands: their fp32 activation is out_dtype=float32's h
            (x, xsc), (w0, wsc) = comet.fp8.quantize_rows(x), comet.fp8.quantize_blocks(w0)
            kw = dict(x_scale=xsc, w0_scale=wsc, out_dtype=torch.float32)
        args = dict(num_experts=case.experts, b0=b0s[r], buffer=buf, activation=name,
                    max_rows=max_rows, **kw)
        q, lay = comet.moe_layer0(x, w0, ids[r], h_fp8=True, **args, **launch)
        h32, _ = comet.moe_layer0(x, w0, ids[r], **args)
        out = comet.moe_layer1(q[0], (w1s[r][..., :q[0].shape[1]] * 1.0).contiguous(), wts[r],
                               lay, buffer=buf, h_scale=q[1], out_dtype=torch.float32)
        return q, h32, lay, out

    return run_threads(case.world, body)


@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_fp8_h_is_quantize_rows_of_the_fp32_activation_bit_for_bit(name):
    # F = 150 (gated) / 300: several 128-wide scale blocks, the last one ragged
    case = dataclasses.replace(cases_for(3)[5], n0=300, n1=150 if name in GATED else 300)
    for fp8_inputs in (False, True):
        for (q, s), h32, lay, out in _fp8_h(case, name, fp8_inputs=fp8_inputs):
            want_q, want_s = comet.fp8.quantize_rows(h32)
            assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(s, want_s)
            assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_fp8_h_across_splits_and_with_max_rows():
    case = dataclasses.replace(cases_for(2)[0], n0=276, n1=138)
    base = _fp8_h(case, "swiglu")
    for launch in (dict(n_comm=0, tile=(1, 1)), dict(n_comm=2, tile=(3, 200))):
        for (a, _, _, _), (b, _, _, _) in zip(base, _fp8_h(case, "swiglu", launch)):
            assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
            assert torch.equal(a[1], b[1])
    bound = sum(case.tokens) * case.topk
    for ((q, s), h32, lay, _), ((q0, s0), _, _, _) in zip(_fp8_h(case, "swiglu", max_rows=bound),
                                                         base):
        m = q0.shape[0]
        assert q.shape[0] == bound and torch.equal(q[:m].view(torch.uint8), q0.view(torch.uint8))
        assert torch.equal(s[:m], s0) and torch.all(s[m:] == 1) and torch.all(q[m:].float() == 0)


def test_h_fp8_needs_an_activation():
    msgs = _errors_on_every_rank(2, 0, activation=None, h_fp8=True)
    want = "comet.moe_layer0: h_fp8=True quantises the fused activation's h: pass activation= too"
    assert all(m is not None for m in msgs) and want in msgs[0], msgs
    buf = comet.Buffer.simulated_world(1)[0]
    try:
        with pytest.raises(ValueError, match="pass activation= too"):
            torch.ops.comet.moe_layer0(torch.ones(2, 4), torch.ones(1, 6, 4),
                                       torch.zeros(2, 1, dtype=torch.int64), 1, buf.handle,
                                       1, 1, 4, 8, h_fp8=True)
    finally:
        buf.close()


# -- The op as a PyTorch operator: fake kernel and autograd registration (torch.library.opcheck) --

@pytest.mark.parametrize("kw", [dict(activation="swiglu"), dict(activation="gelu"),
                                dict(activation="geglu", h_fp8=True)])
def test_opcheck_with_activation(kw):
    buf = comet.Buffer.simulated_world(1)[0]
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(9, 16, generator=g)
        w0 = torch.randn(3, 12, 16, generator=g)
        ids = torch.randint(0, 3, (9, 2), generator=g)
        ids[0, 1] = -1
        grad = not kw.get("h_fp8")
        torch.library.opcheck(torch.ops.comet.moe_layer0.default,
                              (x.requires_grad_(grad), w0.requires_grad_(grad), ids, 3,
                               buf.handle, 1, 1, 4, 8), kw)
    finally:
        buf.close()


# -- The tile walk over h's columns (hypothesis): any tile and split, the same bits --------------

@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(f=st.integers(1, 41), tile_m=st.integers(1, 40), tile_n=st.integers(1, 70),
       n_comm=st.integers(0, 3), name=st.sampled_from(ACTS))
def test_any_tile_and_split_gives_the_oracle_and_the_same_bits(f, tile_m, tile_n, n_comm, name):
    n0 = 2 * f if name in GATED else f
    case = dataclasses.replace(cases_for(2)[3], n0=n0, n1=max(1, f))  # dropped slots
    base = _check_forward(case, name, torch.float32)
    again = _forward(case, name, torch.float32,
                     launch=dict(n_comm=n_comm, tile=(tile_m, tile_n)))[0]
    for (a, _), (b, _) in zip(base, again):
        assert torch.equal(a, b), (tile_m, tile_n, n_comm)


# -- The B-row remap every backend's loader uses (hypothesis) ------------------------------------

@settings(max_examples=200, deadline=None)
@given(f=st.integers(1, 300), half=st.sampled_from([1, 3, 8, 64]))
def test_b_row_remap_covers_each_w0_row_once(f, half):
    """The tiles of h's columns [j0, j0 + half) (the CUDA tiles: half = 64) load, in B rows
    [0, half), the gate rows j0 + i and, in [half, 2 half), the up rows F + j0 + i, out of range
    past F; over all tiles every row of w0 = [gate; up] exactly once."""
    from comet._C import engine

    seen = []
    for j0 in range(0, f, half):
        rows = engine.activation_b_rows(half, f, j0)
        assert len(rows) == 2 * half
        for i, r in enumerate(rows):
            col = j0 + i % half
            assert r == (-1 if col >= f else col if i < half else f + col), (j0, i)
        seen += [r for r in rows if r >= 0]
    assert sorted(seen) == list(range(2 * f))


# -- Where CUDA fuses it: the wrapper's mirror of the op's rule (csrc/cuda/ops_cuda.cpp) ---------

@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (9, 0), (10, 0)], ids=lambda c: f"sm{c[0]}{c[1]}")
def test_cuda_fusion_rule_mirrors_the_op(cap, monkeypatch):
    """comet.moe_layer0 applies the activation after the op exactly where moe_layer0_cuda refuses
    it: 16-bit operands fuse on every GPU (sm_80 path, sm_90a kernels), FP8 on sm_90 does not,
    a gated FP8 form needs N0 % 128 == 0, h_fp8 fuses except on sm_90 (the sm_80 path's and
    sm_89's epilogues quantise, sm_90a's do not yet); CPU tensors always fuse. The CUDA tensors
    are fake (no GPU needed), the capability is the test's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from comet.layers.ops import _unfused_activation

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    with FakeTensorMode():
        x16 = torch.empty(4, 64, device="cuda", dtype=torch.bfloat16)
        x8 = torch.empty(4, 64, device="cuda", dtype=torch.float8_e4m3fn)
        w_256 = torch.empty(2, 256, 64, device="cuda", dtype=torch.bfloat16)  # N0 = 256
        w_144 = torch.empty(2, 144, 64, device="cuda", dtype=torch.bfloat16)  # F = 72
        w8_144 = torch.empty(2, 144, 64, device="cuda", dtype=torch.float8_e4m3fn)
    fp8_here = cap == (9, 0)  # the sm_90a kernels fuse neither FP8 nor h_fp8
    for name in ACTS:
        for w in (w_256, w_144):
            assert not _unfused_activation(x16, w, False, name, False, False)
            assert _unfused_activation(x16, w, False, name, False, True) == fp8_here  # h_fp8
        assert _unfused_activation(x8, w8_144, False, name, False, False) == (
            fp8_here or name in GATED)
        assert _unfused_activation(x16, w_256, False, name, True, False) == fp8_here
        assert _unfused_activation(x16, w_144, False, name, True, False) == (
            fp8_here or name in GATED)
        assert _unfused_activation(x16, w_144.transpose(1, 2), True, name, True, False) == (
            fp8_here or name in GATED)
        cpu = torch.empty(4, 64, dtype=torch.bfloat16)
        assert not _unfused_activation(cpu, torch.empty(2, 144, 64), False, name, True, True)
