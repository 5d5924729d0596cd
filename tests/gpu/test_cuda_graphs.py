"""CUDA graphs and the buffer's growth (docs/gpu.md, "CUDA graphs"): a graph captured before the
buffer grew, replayed after a bigger eager call grew it, skips its calls on every rank and
Buffer.check() raises the stale replay (naming both sizes) instead of the kernels touching the
freed segment; no re-arm is needed, and a graph captured again after the grow replays to the
reference. Written, never run (no GPU where it was written). Skips without a GPU."""
import dataclasses

import pytest
import torch

import comet
from comet.buffers import symm_cuda
from tests.cases import cases_for, h_from_y0, make_inputs
from tests.gpu.test_cuda_ops import _device, check_against_reference


def _step(case, x, w0, w1, tid, tw):
    y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, n_comm=2)
    h = h_from_y0(y0, case.n1)
    out = comet.moe_layer1(h, w1, tw, layout, n_comm=2)
    return y0, layout, h, out


def _capture(buf, case, args, max_rows):
    """An eager call (sizes the buffer), a warm-up on a side stream, then one step captured."""
    _step(case, *args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with buf.capturable(max_rows=max_rows):
        with torch.cuda.stream(side):
            _step(case, *args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _step(case, *args)
    return graph, outs


def _replayed_equal_reference(graph, outs, buf, case, dtype, rank, world, inputs):
    graph.replay()
    torch.cuda.synchronize()
    buf.check()
    y0, layout, h, out = outs
    check_against_reference(case, dtype, rank, world, y0, layout, h, out, inputs,
                            rows=int(layout.recv_counts.sum()))


def test_replay_after_a_grow_raises_and_a_recaptured_graph_works(world):
    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], hidden=64, n0=48, n1=32, seed=13)
    dtype = torch.bfloat16
    xs, w0s, w1s, ids, wts = inputs = make_inputs(case, dtype)
    dev = _device()
    args = tuple(t.to(dev) for t in (xs[rank], w0s[rank], w1s[rank], ids[rank], wts[rank]))
    buf = symm_cuda.buffer_for(None, dev)
    max_rows = sum(case.tokens) * case.topk  # every slot of every rank on this rank

    graph, outs = _capture(buf, case, args, max_rows)
    _replayed_equal_reference(graph, outs, buf, case, dtype, rank, w, inputs)

    # A bigger eager call grows the segment (every rank alike: the same sizes everywhere).
    before = buf.capacity_bytes
    big = 1024
    while comet.required_bytes(tokens=big, hidden=case.hidden, topk=case.topk,
                               num_experts=case.experts, world=w) <= before:
        big *= 2
    g = torch.Generator().manual_seed(77)
    gx = torch.randn(big, case.hidden, generator=g).to(dtype).to(dev)
    gids = torch.randint(0, case.experts, (big, case.topk), generator=g).to(dev)
    gw = torch.rand(big, case.topk, generator=g).to(dev)
    y, lay = comet.moe_layer0(gx, args[1], gids, num_experts=case.experts)
    comet.moe_layer1(h_from_y0(y, case.n1), args[2], gw, lay)
    torch.cuda.synchronize()
    after = buf.capacity_bytes
    assert after > before

    graph.replay()  # stale: its calls are skipped on every rank
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=f"captured before the buffer grew from {before} to "
                                           f"{after} bytes was replayed"):
        buf.check()
    assert not buf.needs_recovery  # nothing moved: no re-arm
    buf.check()  # reported once

    graph2, outs2 = _capture(buf, case, args, max_rows)
    _replayed_equal_reference(graph2, outs2, buf, case, dtype, rank, w, inputs)
