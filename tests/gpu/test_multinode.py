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
    from comet.buffers import symm_cuda

    return symm_cuda.buffer_for(None, _device())


def test_buffer_finds_the_nodes(world):
    rank, w = world
    buf = _buffer()
    assert (buf.ranks_per_node, buf.nodes) == (LOCAL, w // LOCAL)
    assert f"ranks_per_node={LOCAL}" in repr(buf)


@pytest.mark.parametrize("n_comm", [1, 4])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", cases_for(WORLD), ids=str)
def test_layers_match_reference(world, case, dtype, n_comm):
    rank, w = world
    y0, layout, h, out, inputs = run_layers(case, dtype, rank, n_comm=n_comm)
    check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)


def test_large_shape_across_nodes(world):
    """Several tiles per expert and runs of tokens long enough to take many ring slots."""
    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], name="large", hidden=512, n0=384, n1=256,
                               tokens=tuple(700 + 31 * r for r in range(w)), experts=2 * w,
                               seed=21)
    y0, layout, h, out, inputs = run_layers(case, torch.bfloat16, rank, n_comm=8)
    check_against_reference(case, torch.bfloat16, rank, w, y0, layout, h, out, inputs)


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


def test_cuda_graph_capture_across_nodes_is_refused(world):
    """A call on a buffer across nodes refuses to be captured before it enqueues anything: it
    needs the proxy kernel running beside it, which a graph's branches do not promise
    (docs/gpu.md, "CUDA graphs"). Eager calls go on, equal to the reference."""
    from comet.buffers import symm_cuda

    rank, w = world
    case = dataclasses.replace(cases_for(w)[0], hidden=64, n0=48, n1=32, seed=23)
    dtype = torch.bfloat16
    xs, w0s, _, ids, _ = make_inputs(case, dtype)
    dev = _device()
    run_layers(case, dtype, rank)  # eager: sizes the buffer
    buf = symm_cuda.buffer_for(None, dev)
    max_rows = sum(case.tokens) * case.topk
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match=f"spans {w // LOCAL} nodes cannot be captured in a "
                                         "CUDA graph"):
        with torch.cuda.graph(graph):
            torch.ops.comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev),
                                       case.experts, buf.handle, 2, 0, 128, 128,
                                       max_rows=max_rows)
    assert not buf.needs_recovery
    y0, layout, h, out, inputs = run_layers(case, dtype, rank)
    check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)


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


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_node_reduced_combine_matches_reference(world, dtype):
    """Buffer(node_reduce=True): a node's partials summed on the home's relay there (in the combine
    kernel) and one row per (token, node) put across; every awkward case against the reference
    at the dtype's tolerance, back to back on one buffer."""
    from comet.buffers import symm_cuda

    rank, w = world
    buf = symm_cuda.Buffer(device=_device(), node_reduce=True)
    assert buf.node_reduce and "node_reduce=True" in repr(buf)
    for case in cases_for(w):
        y0, layout, h, out, inputs = run_layers(case, dtype, rank, n_comm=2, buffer=buf)
        check_against_reference(case, dtype, rank, w, y0, layout, h, out, inputs)
    buf.check()
    buf.close()
