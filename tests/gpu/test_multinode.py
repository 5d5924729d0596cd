"""Expert parallelism across nodes on the CUDA backend: a group spanning nodes, every rank of a node
reaching its node's ranks by pointer and the other nodes through NVSHMEM put-with-signal (the put
ring and proxy kernel, csrc/cuda/proxy.h), against the pure-torch reference. Needs at least two
nodes; launch one process per GPU on every node, e.g. two nodes of four GPUs:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m pytest tests/gpu/test_multinode.py -q -s

(WORLD_SIZE / LOCAL_WORLD_SIZE from torchrun say how many nodes there are.) Skips without a GPU
(conftest.py) or on one node. Every rank runs the same tests in the same order."""
import dataclasses
import os

import pytest
import torch

import comet
from tests.cases import cases_for, make_inputs
from tests.gpu.test_cuda_ops import DTYPES, check_against_reference, run_layers

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL = int(os.environ.get("LOCAL_WORLD_SIZE", str(WORLD)))

pytestmark = pytest.mark.skipif(
    WORLD <= LOCAL or WORLD % LOCAL != 0,
    reason="needs at least 2 nodes with the same number of GPUs each (torchrun --nnodes >= 2)")


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _buffer():
    from comet import symm_cuda

    return symm_cuda.buffer_for(None, _device())


def _wired():
    try:
        return bool(torch.ops.comet_cuda.cross_node_wired())
    except (AttributeError, RuntimeError):  # a build without the CUDA backend
        return False


def test_buffer_finds_the_nodes(world):
    rank, w = world
    buf = _buffer()
    assert (buf.ranks_per_node, buf.nodes) == (LOCAL, w // LOCAL)
    assert f"ranks_per_node={LOCAL}" in repr(buf)


def test_protocol_across_nodes_while_data_paths_are_refused(world):
    """Before the cross-node data paths are wired, every call is refused on every rank, through
    the metadata exchange across nodes (header mailboxes written by put-with-signal); repeated
    calls exercise the buffer-reuse handshake across nodes (the proxy's end kernel) and must not
    leave a timed-out wait behind."""
    if _wired():
        pytest.skip("cross-node calls run: test_layers_match_reference covers them")
    rank, w = world
    case = cases_for(w)[0]
    for _ in range(3):
        with pytest.raises(ValueError, match="cross-node data paths are not wired"):
            run_layers(case, torch.bfloat16, rank)
    torch.cuda.synchronize()
    _buffer().check()  # no wait timed out, no ring or proxy failure


needs_wiring = pytest.mark.skipif("not _wired()", reason="the CUDA kernels' cross-node data "
                                  "paths are not wired yet (ops refuse such calls)")


@needs_wiring
@pytest.mark.parametrize("n_comm", [1, 4])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", cases_for(WORLD), ids=str)
def test_layers_match_reference(world, case, dtype, n_comm):
    rank, w = world
    y0, layout, h, out, inputs = run_layers(case, dtype, rank, n_comm=n_comm)
    check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)


@needs_wiring
def test_large_shape_across_nodes(world):
    """Several tiles per expert and runs of tokens long enough to take many ring slots."""
    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], name="large", hidden=512, n0=384, n1=256,
                               tokens=tuple(700 + 31 * r for r in range(w)), experts=2 * w,
                               seed=21)
    y0, layout, h, out, inputs = run_layers(case, torch.bfloat16, rank, n_comm=8)
    check_against_reference(case, torch.bfloat16, rank, w, y0, layout, h, out, inputs)


@needs_wiring
def test_back_to_back_calls_and_growth_across_nodes(world):
    """Changing routing and token counts every call (mailbox handshakes, mirrors rewritten), and a
    call whose tokens need a larger data segment (the proxy paused around the collective grow)."""
    rank, w = world
    base = cases_for(w)
    for i in range(6):
        tokens = tuple(3 + (5 * i + 7 * r) % 29 for r in range(w))
        if i == 4:
            tokens = tuple(4096 + r for r in range(w))  # past the initial capacity with mirrors
        case = dataclasses.replace(base[i % len(base)], seed=200 + i, tokens=tokens)
        y0, layout, h, out, inputs = run_layers(case, torch.bfloat16, rank, n_comm=1 + i % 3)
        check_against_reference(case, torch.bfloat16, rank, w, y0, layout, h, out, inputs)


@needs_wiring
def test_cuda_graph_capture_across_nodes(world):
    """The proxy's fork / join on a side stream is captured with the op's kernels."""
    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], hidden=64, n0=48, n1=32, seed=23)
    dtype = torch.bfloat16
    xs, w0s, w1s, ids, wts = inputs = make_inputs(case, dtype)
    dev = _device()
    x, w0, w1 = xs[rank].to(dev), w0s[rank].to(dev), w1s[rank].to(dev)
    tid, tw = ids[rank].to(dev), wts[rank].to(dev)
    buf = _buffer()

    def step():
        from tests.cases import h_from_y0

        y0, layout = comet.moe_layer0(x, w0, tid, num_experts=case.experts, n_comm=2)
        h = h_from_y0(y0, case.n1)
        return y0, layout, h, comet.moe_layer1(h, w1, tw, layout, n_comm=2)

    step()
    max_rows = sum(case.tokens) * case.topk
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with buf.capturable(max_rows=max_rows):
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y0, layout, h, out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    buf.check()
    m = int(layout.recv_counts.sum())
    check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs, rows=m)


@needs_wiring
def test_bad_expert_id_on_another_node_raises_everywhere(world):
    """Rank 0's bad input reaches the other node through the metadata mailboxes."""
    rank, w = world
    case = cases_for(w)[0]
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.bfloat16)
    ids[0][0, 0] = case.experts
    with pytest.raises(ValueError, match="is not an expert id" if rank == 0 else "rank 0"):
        run_layers(case, torch.bfloat16, rank, inputs=(xs, w0s, w1s, ids, wts))
    y0, layout, h, out, inputs = run_layers(case, torch.bfloat16, rank)
    check_against_reference(case, torch.bfloat16, rank, w, y0, layout, h, out, inputs)


@needs_wiring
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_node_reduced_combine_matches_reference(world, dtype):
    """Buffer(node_reduce=True): a node's partials summed on the home's relay there (in the combine
    kernel) and one row per (token, node) put across; every awkward case against the reference
    at the dtype's tolerance, back to back on one buffer."""
    from comet import symm_cuda

    rank, w = world
    buf = symm_cuda.Buffer(device=_device(), node_reduce=True)
    assert buf.node_reduce and "node_reduce=True" in repr(buf)
    for case in cases_for(w):
        xs, w0s, w1s, ids, wts = inputs = make_inputs(case, dtype)
        dev = _device()
        y0, layout = comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev),
                                      num_experts=case.experts, n_comm=2, buffer=buf)
        from tests.cases import h_from_y0

        h = h_from_y0(y0, case.n1)
        out = comet.moe_layer1(h, w1s[rank].to(dev), wts[rank].to(dev), layout, n_comm=2,
                               buffer=buf)
        torch.cuda.synchronize()
        check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)
    buf.check()
    buf.close()
