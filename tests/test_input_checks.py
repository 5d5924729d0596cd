"""Every input check of the ops (csrc/op_checks.cpp, comet/layers/ops.py) triggered once: on a simulated
group of 2 ranks rank 1 passes the bad input, rank 0 a good one; both must raise, rank 1 with the
check's message (the offending value in it), rank 0 naming rank 1; the buffer serves the next call.

tools/check_coverage.py lists the checks (every message fragment in op_checks.cpp and every
fail_call in ops.py) and fails when one appears in no expected message below
(test_every_check_has_a_test runs it)."""
import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import comet
from tests.dist_utils import run_ranks
from tests.sim_world import run_threads

W, E, K, H, N0, N1, T = 2, 4, 2, 8, 6, 5, 5
EL = E // W


def _layer0_args(r):
    g = torch.Generator().manual_seed(r)
    return dict(x=torch.randn(T, H, generator=g), w0=torch.randn(EL, N0, H, generator=g),
                topk_ids=torch.randint(0, E, (T, K), generator=g), num_experts=E)


def _layer1_args(r, buf, layout_over=None, **l0_over):
    """A valid layer0 call (on every rank), then layer1's arguments."""
    a0 = _layer0_args(r)
    y0, layout = comet.moe_layer0(a0.pop("x"), a0.pop("w0"), a0.pop("topk_ids"), buffer=buf, **a0,
                                  **l0_over)
    g = torch.Generator().manual_seed(10 + r)
    return dict(h=y0[:, :N1].contiguous(), w1=torch.randn(EL, H, N1, generator=g),
                topk_weights=torch.rand(T, K, generator=g), layout=layout)


def _run(layer, bad_over, l0_over=None):
    """Both ranks call `layer` (0 or 1); rank 1 with `bad_over(args)` applied. Returns each rank's
    exception (or None) and whether a good call afterwards succeeds on both."""
    bufs = comet.Buffer.simulated_world(W, timeout=20)

    def rank(r, buf):
        if layer == 0:
            args = _layer0_args(r)
        else:
            args = _layer1_args(r, buf, **(l0_over or {}))
        if r == 1:
            args = bad_over(args, buf)
        err = None
        try:
            if layer == 0:
                comet.moe_layer0(args.pop("x"), args.pop("w0"), args.pop("topk_ids"),
                                 buffer=args.pop("buffer", buf), **args)
            else:
                comet.moe_layer1(args.pop("h"), args.pop("w1"), args.pop("topk_weights"),
                                 args.pop("layout"), buffer=args.pop("buffer", buf), **args)
        except (ValueError, TypeError) as e:
            err = e
        a0 = _layer0_args(r)  # the buffer still works
        y0, _ = comet.moe_layer0(a0.pop("x"), a0.pop("w0"), a0.pop("topk_ids"), buffer=buf, **a0)
        return err, y0.shape[1] == N0

    return run_threads(W, rank, buffers=bufs)


def _set(**over):
    return lambda args, buf: {**args, **over}


def _with(fn):
    return lambda args, buf: fn(args)


def _layout(**over):
    return lambda args, buf: {**args, "layout": dataclasses.replace(args["layout"], **over)}


def _ids(v):
    def f(args):
        ids = args["topk_ids"].clone()
        ids[2, 1] = v
        return {**args, "topk_ids": ids}
    return f


def _other_buffer(args, buf):
    # A layout made on another group's buffer (a world of 2 of its own, rank 1's handle)
    other = comet.Buffer.simulated_world(1, timeout=5)[0]
    return {**args, "layout": dataclasses.replace(args["layout"], buffer=other.handle)}


# (name, layer, how rank 1's arguments go bad, regex its message must match)
CHECKS = [
    # layer0: x, w0, E, b0, topk_ids, max_rows, launch
    ("x empty", 0, _set(x=torch.Tensor()), r"x must be 2-D, got shape \[0\]"),
    ("mixed devices", 0, _set(x=torch.randn(T, H, device="meta")),
     r"w0 is on cpu but x is on meta; all inputs must share a device"),
    ("x dims", 0, _set(x=torch.randn(T, H, 1)), r"x must be 2-D, got shape \[5, 8, 1\]"),
    ("x contiguous", 0, _set(x=torch.randn(H, T).t()),
     r"x with shape \[5, 8\] must be contiguous \(call \.contiguous\(\)\)"),
    ("x dtype", 0, _with(lambda a: {**a, "x": a["x"].to(torch.int32)}),
     r"x has dtype int32; supported: float32, bfloat16, float16, float64"),
    ("w0 dtype", 0, _with(lambda a: {**a, "w0": a["w0"].double()}),
     r"w0 has dtype float64 but x has float32; they must match"),
    ("w0 H", 0, _set(w0=torch.randn(EL, N0, H + 1)),
     r"w0 must be \[E_local, N0, H\] with H = 8 \(x's columns\), got shape \[2, 6, 9\]"),
    ("w0 transposed H", 0, _set(w0_transposed=True),
     r"w0 must be \[E_local, H, N0\] \(w0_transposed\) with H = 8 \(x's columns\), got shape "
     r"\[2, 6, 8\]"),
    ("num_experts >= 1", 0, _set(num_experts=0), r"num_experts must be >= 1, got 0"),
    ("E divisible", 0, _set(num_experts=5),
     r"num_experts=5 is not divisible by the expert-parallel group size 2"),
    ("w0 E_local", 0, _set(w0=torch.randn(EL + 1, N0, H)),
     r"w0 holds 3 local experts but num_experts / group size = 2"),
    ("b0 shape", 0, _set(b0=torch.randn(EL, N0 + 1)),
     r"b0 must be \[E_local, 6\] = \[2, 6\], got shape \[2, 7\]"),
    ("b0 dtype", 0, _set(b0=torch.randn(EL, N0).double()),
     r"b0 has dtype float64 but x has float32; they must match"),
    ("topk_ids dims", 0, _set(topk_ids=torch.zeros(T, dtype=torch.int64)),
     r"topk_ids must be 2-D, got shape \[5\]"),
    ("topk_ids dtype", 0, _with(lambda a: {**a, "topk_ids": a["topk_ids"].float()}),
     r"topk_ids has dtype float32; expected int32 or int64"),
    ("topk_ids rows", 0, _with(lambda a: {**a, "topk_ids": a["topk_ids"][:3].contiguous()}),
     r"topk_ids has 3 rows but there are 5 tokens"),
    ("topk_ids columns", 0, _set(topk_ids=torch.zeros(T, 0, dtype=torch.int64)),
     r"topk_ids must have at least one column \(topk >= 1\)"),
    ("topk_ids value", 0, _with(_ids(E)),
     r"topk_ids\[2, 1\] = 4 is not an expert id: valid ids are 0\.\.3 and -1 \(dropped slot\)"),
    ("topk_ids below -1", 0, _with(_ids(-2)), r"topk_ids\[2, 1\] = -2 is not an expert id"),
    ("max_rows", 0, _set(max_rows=-3),
     r"max_rows must be >= 0 \(an upper bound on the dispatched rows\) or -1 \(no bound\), got -3"),
    ("n_comm", 0, _set(n_comm=-1, tile=(4, 4)), r"n_comm must be >= 0 \(0: no comm blocks beside "
     r"the GEMM, the layer runs staged\), got -1"),
    ("tile", 0, _set(n_comm=1, tile=(0, 4)), r"tile shape must be positive, got 0x4"),
    ("tile over int32", 0, _set(n_comm=1, tile=(2 ** 32, 4)),
     r"tile shape must be at most 2147483647 in each dimension, got 4294967296x4"),
    ("n_comm over the CPU grid", 0, _set(n_comm=1024, tile=(4, 4)),
     r"n_comm=1024 leaves no GEMM block in a grid of at most 1024 blocks \(the CPU backend's "
     r"limit: each block is a team of OS threads\): n_comm must be at most 1023"),
    ("tp_size 0", 0, _set(tp_size=0),
     r"comet\.moe_layer0: tp_size must be >= 1 \(1: no expert tensor parallelism\), got 0"),
    ("tp_size 0 with a placement", 0, _set(tp_size=0, placement=comet.Placement.contiguous(E, W)),
     r"comet\.moe_layer0: tp_size must be >= 1 \(1: no expert tensor parallelism\), got 0"),
    # layer1: h, w1, b1, topk_weights, layout, rows
    ("h dtype", 1, _with(lambda a: {**a, "h": a["h"].to(torch.int64)}),
     r"h has dtype int64; supported"),
    ("h dims", 1, _with(lambda a: {**a, "h": a["h"][None]}), r"h must be 2-D, got shape \[1, "),
    ("w1 dtype", 1, _with(lambda a: {**a, "w1": a["w1"].half()}),
     r"w1 has dtype float16 but h has float32; they must match"),
    ("w1 N1", 1, _set(w1=torch.randn(EL, H, N1 + 1)),
     r"w1 must be \[E_local, H, N1\] with N1 = 5 \(h's columns\), got shape \[2, 8, 6\]"),
    ("w1 transposed N1", 1, _set(w1_transposed=True),
     r"w1 must be \[E_local, N1, H\] \(w1_transposed\) with N1 = 5 \(h's columns\)"),
    ("w1 E_local", 1, _set(w1=torch.randn(EL - 1, H, N1)),
     r"w1 holds 1 local experts but num_experts / group size = 2"),
    ("w1 device", 1, _set(w1=torch.randn(EL, H, N1, device="meta")),
     r"w1 is on meta but h is on cpu; all inputs must share a device"),
    ("b1 shape", 1, _set(b1=torch.randn(EL, H - 1)),
     r"b1 must be \[E_local, 8\] = \[2, 8\], got shape \[2, 7\]"),
    ("topk_weights shape", 1, _set(topk_weights=torch.rand(T, 1)),
     r"topk_weights has shape \[5, 1\] but topk_ids has \[5, 2\]"),
    ("topk_weights dtype", 1, _with(lambda a: {**a, "topk_weights": a["topk_weights"].double()}),
     r"topk_weights has dtype float64; expected float32 or h's dtype"),
    ("topk_weights dims", 1, _set(topk_weights=torch.rand(T * K)),
     r"topk_weights must be 2-D, got shape \[10\]"),
    # a transposed [k', T] weight: its shape is reported before its contiguity
    ("topk_weights non-contiguous of another shape", 1, _set(topk_weights=torch.rand(3, T).t()),
     r"topk_weights has shape \[5, 3\] but topk_ids has \[5, 2\]"),
    ("topk_weights contiguous", 1, _set(topk_weights=torch.rand(K, T).t()),
     r"topk_weights with shape \[5, 2\] must be contiguous \(call \.contiguous\(\)\)"),
    ("send_pos shape", 1, lambda a, b: _layout(send_pos=a["layout"].send_pos[:, :1].contiguous())(a, b),
     r"layout\.send_pos has shape \[5, 1\] but topk_ids has \[5, 2\]: the layout belongs to "
     r"another call"),
    ("send_pos dtype", 1, lambda a, b: _layout(send_pos=a["layout"].send_pos.long())(a, b),
     r"layout\.send_pos has dtype int64; expected int32"),
    ("recv_counts shape", 1,
     lambda a, b: _layout(recv_counts=a["layout"].recv_counts[:, :1].contiguous())(a, b),
     r"layout\.recv_counts has shape \[2, 1\], expected \[2, 2\]"),
    ("recv_counts dtype", 1, lambda a, b: _layout(recv_counts=a["layout"].recv_counts.long())(a, b),
     r"layout\.recv_counts has dtype int64; expected int32"),
    ("h rows", 1, _with(lambda a: {**a, "h": a["h"][1:].contiguous()}),
     r"h has \d+ rows but the layout dispatches \d+: pass the layout moe_layer0 returned with "
     r"this h"),
    ("layout from another buffer", 1, _other_buffer,
     r"comet\.moe_layer1: layout was produced on another buffer/group"),
    ("layout None", 1, _set(layout=None),
     r"comet\.moe_layer1: layout must be the comet\.Layout moe_layer0 returned, got None"),
    ("layout is layer0's result", 1, lambda a, b: {**a, "layout": (a["h"], a["layout"])},
     r"layout must be the comet\.Layout moe_layer0 returned, got moe_layer0's whole result, a "
     r"tuple \(y0, Layout\): pass its second element \(y0, layout = comet\.moe_layer0\(\.\.\.\)\)"),
    ("layout a tuple", 1, lambda a, b: {**a, "layout": tuple(dataclasses.astuple(a["layout"]))},
     r"layout must be the comet\.Layout moe_layer0 returned, got a tuple of "
     rf"{len(dataclasses.fields(comet.Layout))} elements"),
]
# layer1 checks that need layer0 to have run with a bound (max_rows) first.
BOUNDED_CHECKS = [
    ("h not padded to max_rows", 1, _with(lambda a: {**a, "h": a["h"][:-1].contiguous()}),
     r"h has 39 rows but max_rows is 40: with max_rows, h has max_rows rows \(as layer0's y0\)"),
    ("rows over max_rows", 1,
     lambda a, b: {**_layout(max_rows=3)(a, b), "h": a["h"][:3].contiguous()},
     r"the layout dispatches \d+ rows to this rank, more than max_rows = 3"),
]


@pytest.mark.parametrize("name,layer,bad,message", CHECKS + BOUNDED_CHECKS,
                         ids=[c[0].replace(" ", "_") for c in CHECKS + BOUNDED_CHECKS])
def test_check_raises_on_every_rank(name, layer, bad, message):
    l0_over = dict(max_rows=40) if (name, layer, bad, message) in BOUNDED_CHECKS else None
    (err0, ok0), (err1, ok1) = _run(layer, bad, l0_over)
    assert err1 is not None, f"{name}: the bad input was accepted"
    assert re.search(message, str(err1)), f"{name}: {err1}"
    assert f"comet.moe_layer{layer}" in str(err1)
    assert err0 is not None, f"{name}: rank 0 did not raise"
    assert "rank 1" in str(err0), f"{name}: rank 0 does not name rank 1: {err0}"
    assert ok0 and ok1


@pytest.mark.parametrize("bad", [None, "tuple", "tensor"])
def test_a_layout_that_is_not_one_is_a_type_error_on_every_rank(bad):
    """Every rank passes the wrong thing (moe_layer0's whole result is the usual slip): each
    raises TypeError naming what it got, before any kernel, and the buffer serves the next call."""
    bufs = comet.Buffer.simulated_world(W, timeout=20)

    def rank(r, buf):
        a = _layer1_args(r, buf)
        layout = {None: None, "tuple": (a["h"], a["layout"]), "tensor": a["h"]}[bad]
        with pytest.raises(TypeError) as err:
            comet.moe_layer1(a["h"], a["w1"], a["topk_weights"], layout, buffer=buf)
        a = _layer1_args(r, buf)
        comet.moe_layer1(a["h"], a["w1"], a["topk_weights"], a["layout"], buffer=buf)
        return str(err.value)

    for msg in run_threads(W, rank, buffers=bufs):
        assert msg.startswith("comet.moe_layer1: layout must be the comet.Layout moe_layer0 "
                              "returned, got "), msg
        assert {None: "got None", "tuple": "moe_layer0's whole result",
                "tensor": "got a Tensor of shape ["}[bad] in msg, msg


def test_one_rank_with_a_bad_layout_raises_type_error_there_and_names_it_elsewhere():
    (err0, ok0), (err1, ok1) = _run(1, _set(layout=None))
    assert isinstance(err1, TypeError) and isinstance(err0, ValueError)
    assert "rank 1" in str(err0) and ok0 and ok1


def test_cuda_dtype_rule_raises_on_every_rank(monkeypatch):
    """COMET_CPU_CUDA_RULES=1: the CPU backend refuses what the CUDA kernels refuse (rank 0 passes
    bf16, which they take; rank 1 float32)."""
    monkeypatch.setenv("COMET_CPU_CUDA_RULES", "1")
    bufs = comet.Buffer.simulated_world(W, timeout=20)

    def rank(r, buf):
        a = _layer0_args(r)
        dtype = torch.float32 if r == 1 else torch.bfloat16
        try:
            comet.moe_layer0(a["x"].to(dtype), a["w0"].to(dtype), a["topk_ids"], num_experts=E,
                             buffer=buf)
        except (ValueError, TypeError) as e:
            return str(e)
        return None

    err0, err1 = run_threads(W, rank, buffers=bufs)
    assert err1 and re.search(
        r"x has dtype float32; the CUDA kernels support bfloat16 and float16 \(float32 and "
        r"float64 run on the CPU backend\) \[COMET_CPU_CUDA_RULES is set\]", err1), err1
    assert err0 and "rank 1" in err0, err0


@pytest.mark.parametrize("n_comm,n_gemm,message", [
    (1, -1, "n_gemm must be >= 0, got -1"),
    (1000, 100, "n_comm=1000 + n_gemm=100 blocks are more than a grid of at most 1024 blocks "
                "(the CPU backend's limit: each block is a team of OS threads); lower n_comm or "
                "n_gemm"),
])
def test_raw_launch_shape_raises_on_every_rank(n_comm, n_gemm, message):
    """n_gemm is not a wrapper argument (the tuner picks it): the raw op takes it."""
    bufs = comet.Buffer.simulated_world(W, timeout=20)

    def rank(r, buf):
        a = _layer0_args(r)
        try:
            torch.ops.comet.moe_layer0(a["x"], a["w0"], a["topk_ids"], E, buf.handle,
                                       n_comm if r == 1 else 1, n_gemm if r == 1 else 1, 4, 4,
                                       None, False, -1)
        except (ValueError, TypeError, RuntimeError) as e:
            return str(e)
        return None

    err0, err1 = run_threads(W, rank, buffers=bufs)
    assert err1 and message in err1, err1
    assert err0 and "rank 1" in err0, err0


def test_cpu_grid_grows_with_n_comm_up_to_its_limit():
    """The wrappers give the GEMM the rest of the CPU block budget, at least one block: an n_comm
    at or over the budget grows the grid (n_comm + 1 blocks), the largest one allowed too."""
    buf = comet.Buffer.simulated_world(1, timeout=20)[0]
    a = _layer0_args(0)
    x, w0, ids = a["x"], torch.cat([a["w0"]] * W), a["topk_ids"]  # every expert on one rank
    want, _ = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf, n_comm=1, tile=(4, 4))
    for n_comm in (7, 1023):
        y0, _ = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf, n_comm=n_comm,
                                 tile=(4, 4))
        assert torch.equal(y0, want)


# The CUDA kernels' launch rules are checked by the same code (Checker::launch, Checker::grid),
# which comet._C.engine.launch_check runs for a device type without a call or a GPU.
def test_cuda_launch_takes_only_the_compiled_tiles():
    from comet import _C
    from comet.layers.ops import CUDA_TILES

    assert CUDA_TILES == ((128, 128), (64, 128))
    for tile in CUDA_TILES:
        assert _C.engine.launch_check("cuda", 2, 0, *tile) == ""
    for tile in ((32, 128), (128, 64), (96, 128)):
        assert _C.engine.launch_check("cuda", 2, 0, *tile) == (
            "comet.moe_layer0: the CUDA kernels are compiled for 128x128 and 64x128 tiles, "
            f"got tile=({tile[0]}, {tile[1]})")
    assert _C.engine.launch_check("cpu", 2, 0, 32, 128) == ""  # the CPU backend takes any tile


def test_grid_rule_names_the_value_and_the_grid():
    """What plan_launch applies on a GPU with the co-resident count as the limit (here 132)."""
    from comet import _C

    def grid(n_comm, n_gemm):
        return _C.engine.launch_check("cuda", n_comm, n_gemm, 128, 128, grid_limit=132,
                                      limit_why="132 co-resident")

    assert grid(131, 1) == "" and grid(4, 128) == ""
    assert grid(132, 1) == ("comet.moe_layer0: n_comm=132 leaves no GEMM block in a grid of at "
                            "most 132 blocks (132 co-resident): n_comm must be at most 131")
    assert grid(4, 129) == ("comet.moe_layer0: n_comm=4 + n_gemm=129 blocks are more than a grid "
                            "of at most 132 blocks (132 co-resident); lower n_comm or n_gemm")


def test_every_check_has_a_test():
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "tools" / "check_coverage.py")],
                       capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr


# max_rows shapes every rank's outputs and decides whether all raise on overflow, so it travels in
# the call metadata: a rank passing another bound (or none) makes every rank raise at once, with
# both values, instead of one rank raising and its peers waiting out the timeout later.
MAX_ROWS_DISAGREE = (r"comet\.moe_layer{layer}: ranks disagree on max_rows \(-1: none; layer1 "
                     r"takes it from layer0's layout\): rank 0 has {a}, rank 1 has {b}")


def _bounded_call(r, bound, buf=None):
    """Rank r's layer0 call with max_rows=bound: (its error, seconds it took, whether a good call
    afterwards works). buf None: the default group's buffer."""
    a = _layer0_args(r)
    start = time.monotonic()
    try:
        comet.moe_layer0(a.pop("x"), a.pop("w0"), a.pop("topk_ids"), buffer=buf, max_rows=bound,
                         **a)
        err = None
    except ValueError as e:
        err = str(e)
    took = time.monotonic() - start
    a = _layer0_args(r)  # the buffer serves the next (agreeing) call
    y0, _ = comet.moe_layer0(a.pop("x"), a.pop("w0"), a.pop("topk_ids"), buffer=buf, **a)
    return err, took, y0.shape[1] == N0


@pytest.mark.parametrize("bounds", [(40, None), (40, 30), (None, 40)])
def test_max_rows_disagreeing_raises_on_every_rank_at_once(bounds):
    bufs = comet.Buffer.simulated_world(W, timeout=20)

    a, b = (-1 if v is None else v for v in bounds)
    for err, took, ok in run_threads(W, lambda r, buf: _bounded_call(r, bounds[r], buf),
                                     buffers=bufs):
        assert err and re.search(MAX_ROWS_DISAGREE.format(layer=0, a=a, b=b), err), err
        assert took < 10 and ok


def test_layer1_max_rows_disagreeing_raises_on_every_rank():
    """Rank 1 drops the bound of layer0's layout (and unpads h to match): its input is
    consistent, but its peers' h has max_rows rows; both raise."""
    def drop_bound(args, buf):
        lay = args["layout"]
        rows = int(lay.recv_counts.sum())
        return {**args, "layout": dataclasses.replace(lay, max_rows=-1),
                "h": args["h"][:rows].contiguous()}

    (err0, ok0), (err1, ok1) = _run(1, drop_bound, dict(max_rows=40))
    for err in (err0, err1):
        assert err is not None and re.search(
            MAX_ROWS_DISAGREE.format(layer=1, a=40, b=-1), str(err)), err
    assert ok0 and ok1


def _dist_max_rows(rank, world):
    return _bounded_call(rank, 40 if rank == 0 else None)


def test_max_rows_disagreeing_across_processes():
    for err, took, ok in run_ranks(_dist_max_rows, W, timeout=120):
        assert err and re.search(MAX_ROWS_DISAGREE.format(layer=0, a=40, b=-1), err), err
        assert took < 10 and ok
