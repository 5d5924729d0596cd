"""The CUDA kernels of torch.ops.comet.moe_layer0/1 against the pure-torch reference, with one
process per GPU (W = number of GPUs): the awkward routing cases of tests/cases.py in bf16 and fp16
for several n_comm, back-to-back calls with changing routing, CUDA-graph capture with max_rows,
and errors raised on every rank. Skips without a GPU (see conftest.py for the command)."""
import dataclasses
import os

import pytest
import torch

import comet
from comet import reference as ref
from tests.cases import E6_ON_3, TOL, cases_for, h_from_y0, make_inputs
from tests.gpu.conftest import all_gather_cpu

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
CASES = cases_for(WORLD) + ([E6_ON_3] if WORLD == 3 else [])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def run_layers(case, dtype, rank, n_comm=None, inputs=None, buffer=None):
    """layer0 -> h_from_y0 -> layer1 on this rank (on `buffer`, default: the group's); returns
    (y0, layout, h, out, inputs)."""
    inputs = inputs or make_inputs(case, dtype)
    xs, w0s, w1s, ids, wts = inputs
    dev = _device()
    y0, layout = comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev),
                                  num_experts=case.experts, n_comm=n_comm, buffer=buffer)
    h = h_from_y0(y0, case.n1)
    out = comet.moe_layer1(h, w1s[rank].to(dev), wts[rank].to(dev), layout, n_comm=n_comm,
                           buffer=buffer)
    torch.cuda.synchronize()
    return y0, layout, h, out, inputs


def check_against_reference(case, dtype, rank, world, y0, layout, h, out, inputs, rows=None,
                            biases=None, hs=None):
    """rows: the valid row count when the outputs are padded (calls with max_rows); biases:
    (b0s, b1s) the call used, or None; hs: every rank's h (default: gathered from the ranks'
    processes)."""
    xs, w0s, w1s, ids, wts = inputs
    b0s, b1s = biases if biases is not None else (None, None)
    expect = ref.dispatch_rows(ids, case.experts, rank)
    m = len(expect) if rows is None else rows
    assert m == len(expect)
    assert layout.row_source[:m].tolist() == [r.source for r in expect]
    assert layout.row_token[:m].tolist() == [r.token for r in expect]
    assert layout.row_slot[:m].tolist() == [r.slot for r in expect]
    assert tuple(y0.shape[1:]) == (case.n0,)
    y0_ref = ref.layer0_sim(xs, w0s, ids, case.experts, b0s)[rank]
    torch.testing.assert_close(y0[:m].cpu(), y0_ref, **TOL[dtype])
    # layer1 is checked on the h every rank actually produced (so layer0's rounding cancels out)
    hs = all_gather_cpu(h[:m].cpu(), world) if hs is None else hs
    out_ref = ref.layer1_sim(hs, w1s, wts, ids, case.experts, b1s)[rank]
    assert out.dtype == dtype and tuple(out.shape) == (case.tokens[rank], case.hidden)
    torch.testing.assert_close(out.cpu(), out_ref, **TOL[dtype])


@pytest.mark.parametrize("n_comm", [0, 1, 4, 16])  # 0: staged
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_layers_match_reference(world, case, dtype, n_comm):
    rank, w = world
    y0, layout, h, out, inputs = run_layers(case, dtype, rank, n_comm=n_comm)
    check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)


def test_large_aligned_shape_takes_the_tensor_core_path(world):
    """H, N multiples of 8 (the TMA path on sm_90a, 16-byte cp.async on sm_80), several tiles."""
    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], name="aligned", hidden=256, n0=384, n1=192,
                               tokens=tuple(300 + 17 * r for r in range(w)), experts=4 * w, seed=9)
    for dtype in DTYPES.values():
        y0, layout, h, out, inputs = run_layers(case, dtype, rank, n_comm=8)
        check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)


def test_back_to_back_calls_changing_routing(world):
    """Consecutive calls on one buffer, routing and token counts changing every call (epoch flags,
    the buffer-reuse handshake, growth of the data segment)."""
    rank, w = world
    base = cases_for(w)
    for i in range(8):
        case = dataclasses.replace(base[i % len(base)], seed=100 + i,
                                   tokens=tuple(3 + (5 * i + 7 * r) % 29 for r in range(w)))
        dtype = torch.bfloat16 if i % 2 else torch.float16
        y0, layout, h, out, inputs = run_layers(case, dtype, rank, n_comm=1 + i % 5)
        check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)


def run_captured(case, dtype, rank):
    """layer0 -> h_from_y0 -> layer1 on this rank's default buffer, captured in a CUDA graph
    inside Buffer.capturable(max_rows = every slot of every rank) after an eager call (which
    sizes the buffer) and a warm-up on a side stream, then replayed 3 times.
    Returns (y0, layout, h, out, inputs, max_rows)."""
    from comet.buffers import symm_cuda

    xs, w0s, w1s, ids, wts = inputs = make_inputs(case, dtype)
    dev = _device()
    x, w0, w1 = xs[rank].to(dev), w0s[rank].to(dev), w1s[rank].to(dev)
    tid, tw = ids[rank].to(dev), wts[rank].to(dev)
    buf = symm_cuda.buffer_for(None, dev)

    def step():
        y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, n_comm=2)
        h = h_from_y0(y0, case.n1)
        out = comet.moe_layer1(h, w1, tw, layout, n_comm=2)
        return y0, layout, h, out

    step()  # eager: sizes the buffer
    max_rows = sum(case.tokens) * case.topk  # every slot of every rank on this rank
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with buf.capturable(max_rows=max_rows):
        with torch.cuda.stream(side):
            step()  # warm-up in the same mode (allocator pools)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y0, layout, h, out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    buf.check()
    return y0, layout, h, out, inputs, max_rows


def test_cuda_graph_capture_with_max_rows(world):
    """Inside Buffer.capturable(max_rows) the ops never synchronise with the host: captured in a
    CUDA graph, replayed, results equal the reference (rows past M unspecified)."""
    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], hidden=64, n0=48, n1=32, seed=11)
    dtype = torch.bfloat16
    y0, layout, h, out, inputs, max_rows = run_captured(case, dtype, rank)
    assert y0.shape[0] == max_rows
    m = int(layout.recv_counts.sum())
    check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs, rows=m)


def test_bad_expert_id_raises_on_every_rank(world):
    rank, w = world
    case = cases_for(w)[0]
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.bfloat16)
    if case.tokens[0]:
        ids[0][0, 0] = case.experts  # out of range on rank 0
    with pytest.raises(ValueError, match="is not an expert id" if rank == 0 else "rank 0"):
        run_layers(case, torch.bfloat16, rank, inputs=(xs, w0s, w1s, ids, wts))
    # the buffer stays usable
    y0, layout, h, out, inputs = run_layers(case, torch.bfloat16, rank)
    check_against_reference(case, torch.bfloat16, rank, w, y0, layout, h, out, inputs)


def test_float32_names_the_supported_dtypes(world):
    rank, w = world
    case = cases_for(w)[0]
    with pytest.raises(TypeError, match="bfloat16 and float16"):
        run_layers(case, torch.float32, rank)
