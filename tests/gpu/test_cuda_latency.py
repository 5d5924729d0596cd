"""Per-call latency of the CUDA prologue (csrc/cuda/prologue.cu) with one process per GPU (W =
number of GPUs), and that calls with max_rows never synchronise with the host. Written, never run
(no GPU where it was written); skips without a GPU (see conftest.py for the command).

The begin kernel is a grid program (a peer per thread for the waits, puts and metadata copies, the
dispatch layout as one scan over the E_local x (W+1) segment cells): at W = 8 and E = 256 it used to
be one thread doing W x E_local remote loads, W CallMeta copies and the O(E x W) layout build
(about 0.3-0.5 ms per call). The kernels are timed from the profiler's kernel records; a begin
kernel also waits for the slowest peer to arrive, so the ranks line up on a barrier first."""
import os

import pytest
import torch

import comet
from comet.buffers import symm_cuda
from tests.gpu.conftest import all_gather_cpu

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
CALLS = 20


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _small_layer(rank, w, tokens=16, hidden=128, n0=64):
    """A layer whose GEMMs are tiny, so the prologue dominates the call: E = 256 (or 32 W)."""
    dev = _device()
    experts = 256 if 256 % w == 0 else 32 * w
    g = torch.Generator(device=dev).manual_seed(77 + rank)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, generator=g)
    w0 = torch.randn(experts // w, n0, hidden, device=dev, dtype=torch.bfloat16, generator=g)
    ids = torch.rand(tokens, experts, device=dev, generator=g).topk(8, dim=1).indices
    return x, w0, ids, experts


def _kernel_us(prof, name):
    """Mean device time (us) of the kernels whose name contains `name`."""
    times = [e.device_time for e in prof.key_averages() if name in e.key]
    return times[0] if times else float("nan")


def test_begin_and_finish_latency_per_call(world, capsys):
    """Mean device time of the begin and finish kernels over CALLS calls with max_rows (no host
    read between calls), max over ranks; printed, and bounded well below the one-thread begin's
    0.3 ms at W = 8, E = 256."""
    import torch.distributed as dist

    rank, w = world
    x, w0, ids, experts = _small_layer(rank, w)
    buf = symm_cuda.buffer_for(None, _device())
    comet.moe_layer0(x, w0, ids, num_experts=experts)  # eager: sizes the buffer
    max_rows = x.shape[0] * ids.shape[1] * w
    for _ in range(3):
        comet.moe_layer0(x, w0, ids, num_experts=experts, max_rows=max_rows)
    torch.cuda.synchronize()
    if w > 1:
        dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            comet.moe_layer0(x, w0, ids, num_experts=experts, max_rows=max_rows)
        torch.cuda.synchronize()
    buf.check()
    begin = max(all_gather_cpu(_kernel_us(prof, "begin_kernel"), w))
    finish = max(all_gather_cpu(_kernel_us(prof, "finish_kernel"), w))
    source = max(all_gather_cpu(_kernel_us(prof, "source_kernel"), w))
    publish = max(all_gather_cpu(_kernel_us(prof, "publish_kernel"), w))
    with capsys.disabled():
        print(f"\nprologue per call at W={w}, E={experts}, T={x.shape[0]}, k={ids.shape[1]} "
              f"(max over ranks of the mean): source {source:.1f} us, begin {begin:.1f} us, "
              f"publish {publish:.1f} us, finish {finish:.1f} us")
    assert begin < 150.0, begin
    assert finish < 20.0, finish


@pytest.mark.parametrize("layer", [0, 1])
def test_max_rows_calls_never_synchronise(world, layer):
    """With max_rows every call is captured in a CUDA graph in the "global" capture mode, where any
    synchronising CUDA call (cudaStreamSynchronize, a blocking copy) from any thread fails the
    capture: the sync-free path has none, the dynamic path's one stream synchronisation would."""
    rank, w = world
    x, w0, ids, experts = _small_layer(rank, w)
    dev = _device()
    n1 = 32
    w1 = torch.randn(experts // w, x.shape[1], n1, device=dev, dtype=torch.bfloat16)
    wts = torch.rand(ids.shape, device=dev)
    comet.moe_layer0(x, w0, ids, num_experts=experts)  # eager: sizes the buffer
    max_rows = x.shape[0] * ids.shape[1] * w
    buf = symm_cuda.buffer_for(None, dev)

    def step():
        y, lay = comet.moe_layer0(x, w0, ids, num_experts=experts)
        if layer == 0:
            return y
        return comet.moe_layer1(y[:, :n1].contiguous(), w1, wts, lay)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with buf.capturable(max_rows=max_rows):
        with torch.cuda.stream(side):
            step()  # warm-up (allocator pools)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="global"):
            step()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    buf.check()
