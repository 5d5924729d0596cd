"""comet.buffers.symm.required_bytes (the symmetric data bytes a configuration needs, from the layout code
the kernels use), Buffer.reserve and the stream rule of the CUDA buffers
(comet/stream_rule.h, a pure function checked here with made-up stream ids)."""

import pytest
import torch

import comet
from comet.buffers import symm
from comet._native import _C
from tests.cases import Case, h_from_y0, make_inputs
from tests.sim_world import run_threads

# (case, ranks_per_node, node_reduce): one node, and two nodes per rank / node-reduced (the
# regions that only exist across nodes: mirrors, layer1's stage or node_stage).
SHAPES = [
    (Case("w2", 2, 4, 2, (7, 11), hidden=24, n0=16, n1=8), None, False),
    (Case("w4-two-nodes", 4, 8, 3, (5, 9, 0, 6), hidden=40, n0=16, n1=8, seed=3), 2, False),
    (Case("w4-two-nodes-reduced", 4, 8, 3, (5, 9, 0, 6), hidden=40, n0=16, n1=8, seed=3), 2,
     True),
]


def _need(case, dtype, rpn, reduce, **over):
    shape = dict(tokens=max(case.tokens), hidden=case.hidden, topk=case.topk,
                 num_experts=case.experts, world=case.world, dtype=dtype, ranks_per_node=rpn,
                 node_reduce=reduce)
    return symm.required_bytes(**{**shape, **over})


def _run(case, dtype, rpn, reduce, reserve: bool):
    """Both layers once on a fresh simulated world; per rank (capacity before the calls, after,
    the largest request)."""
    xs, w0s, w1s, ids, wts = make_inputs(case, dtype)
    bufs = comet.Buffer.simulated_world(case.world, ranks_per_node=rpn, node_reduce=reduce,
                                        timeout=20)

    def rank(r, buf):
        if reserve:
            buf.reserve(tokens=max(case.tokens), hidden=case.hidden, topk=case.topk,
                        num_experts=case.experts, dtype=dtype)
        before = buf.capacity_bytes
        y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts,
                                      buffer=buf)
        comet.moe_layer1(h_from_y0(y0, case.n1), w1s[r], wts[r], layout, buffer=buf)
        return before, buf.capacity_bytes, buf.requested_bytes

    try:
        return run_threads(case.world, rank, buffers=bufs)
    finally:
        for b in bufs:
            b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case,rpn,reduce", SHAPES, ids=[str(s[0]) for s in SHAPES])
def test_required_bytes_is_what_the_calls_ask_for(case, rpn, reduce, dtype):
    need = _need(case, dtype, rpn, reduce)
    for before, after, requested in _run(case, dtype, rpn, reduce, reserve=False):
        assert before == 0
        assert requested == need  # the largest of layer0's and layer1's requests
        assert after >= need


# Many tokens per rank: every region of the layout is then several of its 256-byte alignment units
# (comet/symm_layout.h), so an element or accumulator size off by a factor shows in the total
# instead of vanishing in a region's rounding up (a dozen tokens' 4-byte weights, 48 bytes, and
# their 8-byte ones, 96, both take one unit).
MANY = [
    (Case("w2-many", 2, 4, 2, (70, 45), hidden=24, n0=16, n1=8), None, False),
    (Case("w4-two-nodes-many", 4, 8, 3, (40, 66, 0, 51), hidden=40, n0=16, n1=8, seed=3), 2,
     False),
    (Case("w4-two-nodes-reduced-many", 4, 8, 3, (40, 66, 0, 51), hidden=40, n0=16, n1=8,
          seed=3), 2, True),
]
ALIGN = 256


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
@pytest.mark.parametrize("case,rpn,reduce", MANY, ids=[str(s[0]) for s in MANY])
def test_required_bytes_of_every_dtype_is_what_many_tokens_ask_for(case, rpn, reduce, dtype):
    """Every activation dtype the ops take, with enough tokens that the routing weights alone
    (tokens x topk, 4 bytes each, 8 for float64 inputs on the CPU backend) fill more than one
    alignment unit."""
    assert max(case.tokens) * case.topk * 4 > ALIGN
    need = _need(case, dtype, rpn, reduce)
    for before, after, requested in _run(case, dtype, rpn, reduce, reserve=False):
        assert before == 0
        assert requested == need
        assert after >= need


@pytest.mark.parametrize("case,rpn,reduce", SHAPES[:2] + MANY[:2],
                         ids=[str(s[0]) for s in SHAPES[:2] + MANY[:2]])
def test_required_bytes_of_fp8_rows_is_what_the_calls_ask_for(case, rpn, reduce):
    """dtype float8_e4m3fn: layer0's packed FP8 rows (values and scales) and layer1's bf16
    partials, as the FP8 calls size them."""
    from comet import fp8

    xs, w0s, w1s, ids, wts = make_inputs(case, torch.bfloat16)
    bufs = comet.Buffer.simulated_world(case.world, ranks_per_node=rpn, node_reduce=reduce,
                                        timeout=20)

    def rank(r, buf):
        w0q, s0 = fp8.quantize_blocks(w0s[r])
        w1q, s1 = fp8.quantize_blocks(w1s[r])
        y0, layout = comet.moe_layer0(xs[r], w0q, ids[r], num_experts=case.experts, buffer=buf,
                                      w0_scale=s0, dispatch_fp8=True)
        layer0 = buf.requested_bytes
        hq, hs = fp8.quantize_rows(h_from_y0(y0, case.n1))
        comet.moe_layer1(hq, w1q, wts[r], layout, buffer=buf, h_scale=hs, w1_scale=s1)
        return layer0, buf.requested_bytes

    try:
        got = run_threads(case.world, rank, buffers=bufs)
    finally:
        for b in bufs:
            b.close()
    fp8_rows = _need(case, torch.float8_e4m3fn, rpn, reduce, op=0)
    assert fp8_rows != _need(case, torch.bfloat16, rpn, reduce, op=0)
    assert got == [(fp8_rows, _need(case, torch.float8_e4m3fn, rpn, reduce))] * case.world


@pytest.mark.parametrize("case,rpn,reduce", SHAPES, ids=[str(s[0]) for s in SHAPES])
def test_reserve_then_calls_do_not_grow(case, rpn, reduce):
    need = _need(case, torch.bfloat16, rpn, reduce)
    for before, after, requested in _run(case, torch.bfloat16, rpn, reduce, reserve=True):
        assert before == need  # a fresh buffer grows to exactly what reserve asked for
        assert after == before
        assert requested == need


def test_required_bytes_is_monotone_in_each_argument():
    base = dict(tokens=64, hidden=96, topk=2, num_experts=8, world=4, dtype=torch.bfloat16)
    up = dict(tokens=65, hidden=97, topk=3, num_experts=16, world=8, dtype=torch.float32)
    for rpn, reduce in ((None, False), (2, False), (2, True)):
        b = symm.required_bytes(**base, ranks_per_node=rpn, node_reduce=reduce)
        for name, v in up.items():
            grown = symm.required_bytes(**{**base, name: v}, ranks_per_node=rpn,
                                        node_reduce=reduce)
            assert grown >= b, (name, rpn, reduce)
        for t in (0, 1, 7, 64, 1000):  # and strictly in tokens from 0 up
            assert (symm.required_bytes(**{**base, "tokens": t + 1}, ranks_per_node=rpn,
                                        node_reduce=reduce)
                    > symm.required_bytes(**{**base, "tokens": t}, ranks_per_node=rpn,
                                          node_reduce=reduce))
    # across nodes adds regions; fewer ranks per node (more nodes) adds mirrors
    one = symm.required_bytes(**base)
    assert symm.required_bytes(**base, ranks_per_node=2) > one
    assert symm.required_bytes(**base, ranks_per_node=1) > symm.required_bytes(**base,
                                                                               ranks_per_node=2)


def test_layer1_receive_region_dominates():
    """min(k, W) x tokens x H x elem plus small routing regions (DeepSeek-V3's shape: k=8, 8K
    tokens, H=7168 is ~940 MB per rank, near NVSHMEM's 1 GiB default)."""
    for T, H, k, E, W in ((4096, 4096, 2, 8, 8), (8192, 7168, 8, 256, 8), (100, 24, 5, 4, 2)):
        need = symm.required_bytes(tokens=T, hidden=H, topk=k, num_experts=E, world=W)
        recv = min(k, W) * T * H * 2
        assert recv <= need <= recv + 16 * T * k + 4096, (T, H, k, E, W)
        assert symm.required_bytes(tokens=T, hidden=H, topk=k, num_experts=E, world=W,
                                   op=1) == need


def test_required_bytes_rejects_bad_arguments():
    ok = dict(tokens=8, hidden=16, topk=2, num_experts=4, world=2)
    for name, bad in (("tokens", -1), ("hidden", 1.5), ("topk", 0), ("num_experts", True),
                      ("world", 0)):
        with pytest.raises(ValueError, match=name):
            symm.required_bytes(**{**ok, name: bad})
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        symm.required_bytes(**ok, ranks_per_node=3)


# ------------------------------------------------------------------------------------------------
# The CUDA buffers' stream rule (comet/stream_rule.h), with made-up stream ids
# ------------------------------------------------------------------------------------------------

BIND, SAME, HAND_OVER, CAPTURE, REFUSE = range(5)


@pytest.mark.parametrize("has_bound,bound,bound_cap,current,current_cap,step", [
    (False, 0, False, 0, False, BIND),            # first call, on the legacy default stream (id 0)
    (False, 0, False, 7, False, BIND),
    (True, 0, False, 0, False, SAME),             # the default stream is a stream like any other
    (True, 7, False, 7, False, SAME),
    (True, 7, False, 9, False, HAND_OVER),        # another stream: it waits for 7, then owns it
    (True, 0, False, 9, False, HAND_OVER),
    (True, 7, True, 9, False, REFUSE),            # 7 is capturing this buffer's calls
    (True, 7, False, 9, True, CAPTURE),           # captured calls run at replay: binding stays
    (False, 0, False, 9, True, CAPTURE),
    (True, 7, True, 7, True, CAPTURE),            # the bound stream captures its own calls
    (True, 7, True, 9, True, REFUSE),             # two captures of one buffer at once
    (False, 0, True, 9, False, BIND),             # nothing bound: its capture state is moot
])
def test_stream_rule(has_bound, bound, bound_cap, current, current_cap, step):
    assert _C.engine.stream_step(has_bound, bound, bound_cap, current, current_cap) == step
