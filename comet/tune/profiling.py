"""Profiling hooks of the autotuner: measure one fused op call per candidate config on the real
backend (the CPU backend's threads and shared memory here, the CUDA kernels on a GPU).

``import comet`` registers them in ``comet.tune.tuner.PROFILERS``, so ``comet.tune.tuner.profile``
and ``python -m comet.tune --profile`` measure real candidates::

    # CPU backend, 2 ranks, a scaled-down shape; --sm-count = threads per rank (= the key's
    # block budget, which comet.layers.ops takes from $COMET_CPU_BLOCKS or max(2, cores // W))
    torchrun --nproc-per-node 2 -m comet.tune --model custom --hidden 128 --ffn 448 \\
        --experts 8 --topk 2 --tokens 512 --dtype fp32 --gpu cpu --sm-count 2 --world 2 --profile

A hook is ``factory(key, shape, group) -> run_fn`` and ``run_fn(config) -> seconds``. The factory
runs on every rank of the group (it calls layer0 once to get a dispatch layout for layer1); every
rank then calls ``run_fn`` with the same configs in the same order (``Tuner.tune``'s protocol).
Inputs are synthetic: ``T = shape.T`` tokens per rank, uniform top-k routing over distinct
experts, seeded by rank. One measurement is one op call after a barrier of the group: wall clock
on the CPU, CUDA events on a GPU (the GPU path is untested: no GPU where this was written).
``n_gemm`` follows comet.layers.ops: ``key.sm_count - n_comm`` (at least 1) on the CPU, 0 (every SM not
used for comm) on a GPU.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from comet.buffers import symm
from comet.formats.fp8 import quantize_blocks, quantize_rows
from comet.tune import tuner as tn

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# FP8 keys (comet.fp8) profile bf16 tokens quantised on dispatch, FP8 weights and an FP8 h.
_FP8 = ("fp8", "float8_e4m3fn")


def _device(key: tn.TuneKey) -> torch.device:
    if key.arch == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _routing(T: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Uniform top-k over distinct experts: [T, k] int64."""
    return torch.rand(T, E, generator=gen).topk(k, dim=1).indices


def _group_rank(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class Timer:
    """One timed call after a barrier: wall clock on the CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device, group):
        self.device, self.group = device, group
        self.dist = dist.is_available() and dist.is_initialized()

    def __call__(self, fn) -> float:
        if self.dist:
            dist.barrier(group=self.group)
        if self.device.type == "cuda":  # untested here (no GPU)
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _setup(key: tn.TuneKey, shape, group):
    rank, world = _group_rank(group)
    if world != key.W:
        raise ValueError(f"profiling {key.id()}: the key has W={key.W} but the group has {world} "
                         f"ranks")
    fp8 = key.dtype in _FP8
    dtype = torch.bfloat16 if fp8 else _DTYPES[key.dtype]
    device = _device(key)
    T = int(shape.T if shape is not None else key.tokens)
    gen = torch.Generator().manual_seed(1234 + rank)
    E, k, H, El = key.E, key.k, key.H, key.E // key.W
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    ids = _routing(T, E, k, gen).to(device)
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=1).to(device)
    buf = symm.buffer_for(group)

    def launch(cfg: tn.Config):
        n_gemm = max(1, key.sm_count - cfg.n_comm) if device.type == "cpu" else 0
        return int(cfg.n_comm), int(n_gemm), int(cfg.tile_m), int(cfg.tile_n)

    return dict(x=x, ids=ids, weights=weights, buf=buf, device=device, gen=gen, dtype=dtype,
                E=E, El=El, H=H, launch=launch, timer=Timer(device, group), fp8=fp8)


def _weights(s, shape, fan_in):
    """(w, scale or None): a synthetic expert weight, quantised for an FP8 key."""
    w = (torch.randn(*shape, generator=s["gen"]) / fan_in ** 0.5).to(device=s["device"],
                                                                      dtype=s["dtype"])
    return quantize_blocks(w) if s["fp8"] else (w, None)


def layer0_profiler(key: tn.TuneKey, shape=None, group=None):
    """run_fn(config) -> seconds of one torch.ops.comet.moe_layer0 call (N = N0 columns)."""
    s = _setup(key, shape, group)
    w0, w0_scale = _weights(s, (s["El"], key.N, s["H"]), s["H"])
    op = torch.ops.comet.moe_layer0

    def run(cfg: tn.Config) -> float:
        args = (s["x"], w0, s["ids"], s["E"], s["buf"].handle, *s["launch"](cfg))
        fp8 = dict(w0_scale=w0_scale, dispatch_fp8=s["fp8"])
        return s["timer"](lambda: op(*args, **fp8))

    return run


def layer1_profiler(key: tn.TuneKey, shape=None, group=None):
    """run_fn(config) -> seconds of one torch.ops.comet.moe_layer1 call (N = N1 reduction size);
    its input h and layout come from one layer0 call made here (on every rank)."""
    s = _setup(key, shape, group)
    w0 = (torch.randn(s["El"], key.N, s["H"], generator=s["gen"]) / s["H"] ** 0.5).to(
        device=s["device"], dtype=s["dtype"])
    w1, w1_scale = _weights(s, (s["El"], s["H"], key.N), key.N)
    first = s["launch"](tn.Config(1))
    h, _a, recv_counts, send_pos, *_ = torch.ops.comet.moe_layer0(
        s["x"], w0, s["ids"], s["E"], s["buf"].handle, *first)
    h, h_scale = quantize_rows(h) if s["fp8"] else (h, None)
    op = torch.ops.comet.moe_layer1

    def run(cfg: tn.Config) -> float:
        args = (h, w1, s["weights"], s["ids"], send_pos, recv_counts, s["E"], s["buf"].handle,
                *s["launch"](cfg), None, False, -1, int(cfg.band_n))
        fp8 = dict(h_scale=h_scale, w1_scale=w1_scale)
        return s["timer"](lambda: op(*args, **fp8))

    return run


def register() -> None:
    """Install the hooks in comet.tune.tuner.PROFILERS (called by comet on import)."""
    tn.PROFILERS["layer0"] = layer0_profiler
    tn.PROFILERS["layer1"] = layer1_profiler
