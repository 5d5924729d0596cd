"""Comm-only, GEMM-only and fused times of both CUDA kernels on a Qwen2-MoE-like layer, printed as
a table (shown even without -s), so the overlap is visible:

    overlap = (comm + gemm - fused) / min(comm, gemm)      1: perfect overlap, 0: none

Kernel times are the fused kernel alone (first block start to last warp exit, GPU global timer,
comet.buffers.symm_cuda.Buffer.last_kernel_seconds); "op" is the whole call (prologue kernels and copies
included) in a call without host synchronisation. Each is the maximum over ranks of the mean of
10 calls. COMET_GPU_BENCH_TOKENS sets the tokens per rank (default 4096). Skips without a GPU."""
import os

import torch

import comet
from comet.buffers import symm_cuda
from tests.gpu.conftest import all_gather_cpu

HIDDEN, N0, N1, TOPK = 2048, 2 * 1408, 1408, 4
TOKENS = int(os.environ.get("COMET_GPU_BENCH_TOKENS", "4096"))
ITERS = 10


def _times(fn, buf, world_size):
    """(fused-kernel ms, whole-op ms), max over ranks of the means."""
    for _ in range(3):
        fn()
    kernel = 0.0
    for _ in range(ITERS):
        fn()
        kernel += buf.last_kernel_seconds() * 1e3 / ITERS
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    stop.record()
    torch.cuda.synchronize()
    op = start.elapsed_time(stop) / ITERS
    return max(all_gather_cpu(kernel, world_size)), max(all_gather_cpu(op, world_size))


def test_comm_and_gemm_timings(world, capsys):
    rank, w = world
    dev = torch.device("cuda", torch.cuda.current_device())
    experts = 64 if 64 % w == 0 else 8 * w
    el = experts // w
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    dtype = torch.bfloat16
    x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=dtype, generator=g)
    w0 = (torch.randn(el, N0, HIDDEN, device=dev, generator=g) / HIDDEN ** 0.5).to(dtype)
    w1 = (torch.randn(el, HIDDEN, N1, device=dev, generator=g) / N1 ** 0.5).to(dtype)
    ids = torch.rand(TOKENS, experts, device=dev, generator=g).topk(TOPK, dim=1).indices
    wts = torch.rand(TOKENS, TOPK, device=dev, generator=g)
    buf = symm_cuda.buffer_for(None, dev)
    buf.reserve(tokens=TOKENS, hidden=HIDDEN, topk=TOPK, num_experts=experts, dtype=dtype)

    y0, layout = comet.moe_layer0(x, w0, ids, num_experts=experts)  # eager: this rank's M
    max_rows = max(all_gather_cpu(int(layout.recv_counts.sum()), w))
    h = torch.tanh(y0[:, :N1].float()).to(dtype)

    rows = []
    with buf.capturable(max_rows=max_rows):
        _, layout_c = comet.moe_layer0(x, w0, ids, num_experts=experts)
        h_pad = torch.zeros(max_rows, N1, device=dev, dtype=dtype)
        h_pad[: h.shape[0]] = h
        for name, fn in (
                ("layer0", lambda: comet.moe_layer0(x, w0, ids, num_experts=experts)),
                ("layer1", lambda: comet.moe_layer1(h_pad, w1, wts, layout_c))):
            t = {}
            for mode in ("fused", "comm", "gemm"):
                with buf.bench_mode(mode):
                    t[mode] = _times(fn, buf, w)
            k = {m: v[0] for m, v in t.items()}
            overlap = (k["comm"] + k["gemm"] - k["fused"]) / max(1e-9, min(k["comm"], k["gemm"]))
            rows.append((name, k["fused"], k["comm"], k["gemm"], overlap, t["fused"][1]))
    buf.check()
    if rank == 0:
        with capsys.disabled():
            print(f"\ncomet CUDA kernels, {w} GPU(s) ({torch.cuda.get_device_name(dev)}), "
                  f"T={TOKENS}/rank, H={HIDDEN}, N0={N0}, N1={N1}, E={experts}, k={TOPK}, bf16")
            print(f"{'kernel':8} {'fused ms':>9} {'comm-only':>10} {'GEMM-only':>10} "
                  f"{'overlap':>8} {'op ms':>8}")
            for name, fused, comm, gemm, overlap, op in rows:
                print(f"{name:8} {fused:9.3f} {comm:10.3f} {gemm:10.3f} {overlap:8.2f} {op:8.3f}")
    for name, fused, comm, gemm, _, op in rows:
        assert fused > 0 and comm > 0 and gemm > 0
        # Bounds, not just "> 0": the fused kernel does the work of both halves, so it cannot
        # beat the slower one, and overlap means it does not take longer than both in sequence
        # (10% for launch noise); the whole op adds the prologue around the kernel.
        assert fused >= 0.9 * max(comm, gemm), (name, fused, comm, gemm)
        assert fused <= 1.1 * (comm + gemm), (name, fused, comm, gemm)
        assert op >= 0.9 * fused, (name, op, fused)
        # Roofline of the GEMM half at >= 50 TFLOP/s (bf16 tensor cores of an A100 or better,
        # slack included): a kernel 10x slower than that has lost its tensor-core path.
        flops = 2.0 * TOKENS * TOPK * HIDDEN * (N0 if name == "layer0" else N1)
        assert gemm <= 10 * flops / 50e12 * 1e3, (name, gemm, flops)
