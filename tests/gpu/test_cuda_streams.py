"""Streams and symmetric memory of the CUDA buffers (written, never run: no GPU here):

* the weight-gradient overlap follows the caller's stream: backward on a non-default stream gives
  the same weight gradients with the overlap (worker thread + side stream + events) as inline,
  and so does a background DeferredWeightGrads computed on yet another stream;
* one stream at a time: a call from a second stream is ordered after the first stream's calls
  (hand-over) and results stay right; a call while the bound stream captures a graph raises;
* the inter-node proxy runs on the buffer's own stream, not the default stream nor a pooled one;
* Buffer(reserve=...) sizes the data segment once, and calls of that shape never grow it.
"""
import contextlib
import dataclasses

import pytest
import torch

import comet
import comet.layers.autograd as cag
from comet.buffers import symm
from comet.buffers import symm_cuda
from tests.cases import cases_for, h_from_y0, make_inputs
from tests.gpu.test_cuda_ops import check_against_reference, run_layers


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _weight_grads(case, rank, stream, overlap: bool, deferred: bool = False):
    """dW0, dW1 of layer0 -> tanh -> layer1 with forward and backward on `stream`."""
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.bfloat16)
    dev = _device()
    before = cag.weight_grad_overlap()
    cag.set_weight_grad_overlap(overlap)
    try:
        # The queue is active during the forward, which the ops remember: CUDA backward runs on
        # autograd's device thread, where a queue activated around backward() is not seen.
        q = cag.DeferredWeightGrads(background=True)
        queue = cag.defer_weight_grads(q) if deferred else contextlib.nullcontext()
        with torch.cuda.stream(stream), queue:
            x = xs[rank].to(dev)
            w0 = w0s[rank].to(dev).requires_grad_()
            w1 = w1s[rank].to(dev).requires_grad_()
            y0, layout = comet.moe_layer0(x, w0, ids[rank].to(dev), num_experts=case.experts)
            h = torch.tanh(y0[:, :case.n1].float()).to(y0.dtype).contiguous()
            out = comet.moe_layer1(h, w1, wts[rank].to(dev), layout)
        with torch.cuda.stream(stream):
            out.float().square().sum().backward()
        if deferred:
            other = torch.cuda.Stream()
            other.wait_stream(stream)
            with torch.cuda.stream(other):
                q.compute()  # waits on its own stream for the worker's events
            torch.cuda.current_stream().wait_stream(other)
        torch.cuda.synchronize()
        return w0.grad.cpu(), w1.grad.cpu()
    finally:
        cag.set_weight_grad_overlap(before)


def test_weight_grad_overlap_on_a_side_stream_matches_inline(world):
    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], hidden=64, n0=48, n1=32, seed=21)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    inline = _weight_grads(case, rank, side, overlap=False)
    overlapped = _weight_grads(case, rank, side, overlap=True)
    deferred = _weight_grads(case, rank, side, overlap=True, deferred=True)
    for a, b, c in zip(inline, overlapped, deferred):
        assert torch.equal(a, b) and torch.equal(a, c)  # the same GEMM, only the stream differs


def test_a_second_stream_takes_the_buffer_over_in_order(world):
    """Calls on stream A, then at once (no host synchronisation) on stream B: B waits for A's
    queued calls, so the epochs never interleave; results match the reference."""
    rank, w = world
    dev = _device()
    buf = symm_cuda.Buffer(None, device=dev)
    try:
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        a.wait_stream(torch.cuda.current_stream())
        base = cases_for(w)
        results = []
        for i, s in enumerate((a, b, a, b)):
            case = dataclasses.replace(base[i % len(base)], seed=300 + i)
            inputs = make_inputs(case, torch.bfloat16)
            xs, w0s, w1s, ids, wts = inputs
            with torch.cuda.stream(s):
                y0, layout = comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev),
                                              ids[rank].to(dev), num_experts=case.experts,
                                              buffer=buf)
                h = h_from_y0(y0, case.n1)
                out = comet.moe_layer1(h, w1s[rank].to(dev), wts[rank].to(dev), layout,
                                       buffer=buf)
            assert buf.stream == s.cuda_stream
            results.append((case, y0, layout, h, out, inputs))
        torch.cuda.synchronize()
        for case, y0, layout, h, out, inputs in results:
            check_against_reference(case, torch.bfloat16, rank, w, y0, layout, h, out, inputs)
    finally:
        buf.close()


def test_call_while_the_bound_stream_captures_raises(world):
    rank, w = world
    dev = _device()
    buf = symm_cuda.Buffer(None, device=dev)
    try:
        case = cases_for(w)[0]
        xs, w0s, w1s, ids, _wts = make_inputs(case, torch.bfloat16)
        x, w0, tid = xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev)
        bound = torch.cuda.Stream()
        bound.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(bound):
            comet.moe_layer0(x, w0, tid, num_experts=case.experts, buffer=buf)  # binds, sizes
        bound.synchronize()
        other = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="is capturing a CUDA graph"):
            with buf.capturable(max_rows=sum(case.tokens) * case.topk):
                with torch.cuda.graph(graph, stream=bound):
                    comet.moe_layer0(x, w0, tid, num_experts=case.experts, buffer=buf)
                    with torch.cuda.stream(other):
                        comet.moe_layer0(x, w0, tid, num_experts=case.experts, buffer=buf)
        torch.cuda.synchronize()
    finally:
        buf.close()


def test_proxy_stream_is_the_buffers_own(world):
    buf = symm_cuda.buffer_for(None, _device())
    if buf.nodes == 1:
        assert buf.proxy_stream is None
        pytest.skip("one node: no proxy (run tests/gpu/test_multinode.py's command)")
    own = buf.proxy_stream
    assert own not in (torch.cuda.default_stream().cuda_stream,
                       torch.cuda.current_stream().cuda_stream)
    # torch.cuda.Stream() hands out torch's pooled streams round-robin: none of them is it
    pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1, -2) for _ in range(64)}
    assert own not in pooled


def test_reserve_sizes_the_buffer_once_for_a_large_shape(world):
    rank, w = world
    dev = _device()
    case = dataclasses.replace(cases_for(w)[0], name="large", hidden=2048, n0=64, n1=64,
                               experts=2 * w, topk=2, tokens=tuple([4096] * w), seed=31)
    shape = dict(tokens=4096, hidden=case.hidden, topk=case.topk, num_experts=case.experts)
    buf = symm_cuda.Buffer(None, device=dev, reserve=shape)
    try:
        need = symm.required_bytes(**shape, world=w, ranks_per_node=buf.ranks_per_node,
                                   node_reduce=buf.node_reduce)
        cap = buf.capacity_bytes
        assert cap >= need and buf.requested_bytes == need
        y0, layout, h, out, inputs = run_layers(case, torch.bfloat16, rank, buffer=buf)
        check_against_reference(case, torch.bfloat16, rank, w, y0, layout, h, out, inputs)
        assert buf.capacity_bytes == cap  # no grow during the calls
    finally:
        buf.close()
