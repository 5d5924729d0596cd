"""Several ranks on ONE GPU (comet.Buffer.simulated_world(W, device="cuda")): a test body runs on W
threads of this process, each rank with its own CUDA stream, over CUDA buffers whose symmetric
memory is one device allocation per symmetric object; the same kernels and call protocol as W
GPUs. A hang fails the test (every thread is joined with a timeout). `make test-gpu-sim` runs the
tests that use it (tests/gpu/test_cuda_sim.py).

Rank bodies synchronise their own stream, never the device: a device-wide wait in one rank's
thread would also wait for the other ranks' kernels, which may be waiting for this rank's next
launch. CUDA_MODULE_LOADING=EAGER is set here, before CUDA starts (the simulated world refuses to
run without it: a lazy kernel load may wait for every kernel on the device)."""
from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402

import comet  # noqa: E402
from tests.sim_world import run_threads  # noqa: E402

WORLDS = (2, 4)
_worlds: dict = {}


def sim_world(world: int, *, fresh: bool = False, **settings):
    """The simulated CUDA world of `world` ranks with these settings: created once and reused
    (calls on one buffer are its normal life), again when fresh or after a failed call."""
    key = (world, tuple(sorted(settings.items())))
    bufs = _worlds.get(key)
    if fresh or bufs is None or any(b.needs_recovery for b in bufs):
        bufs = _worlds[key] = comet.Buffer.simulated_world(world, device="cuda", **settings)
        for b in bufs:  # one stream per rank for all its calls (consecutive: distinct streams)
            b.test_stream = torch.cuda.Stream(b.device)
    return bufs


def run_ranks(bufs, fn, *, timeout: float = 120.0):
    """fn(rank, buffer) on one thread per rank (tests/sim_world.py's run_threads), each on a
    torch.cuda.Stream of its own; returns the results by rank and re-raises the first rank's
    error. A rank still running after `timeout` seconds fails the test (a hang)."""
    device = bufs[0].device

    def body(r, buf):
        torch.cuda.set_device(device)
        stream = getattr(buf, "test_stream", None) or torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            result = fn(r, buf)
            torch.cuda.current_stream().synchronize()
        return result

    return run_threads(len(bufs), body, timeout=timeout, buffers=bufs)


def rank_errors(bufs, fn, *, timeout: float = 120.0):
    """Like run_ranks, but returns every rank's exception (None where the body returned)."""
    errors = [None] * len(bufs)

    def catch(r, buf):
        try:
            fn(r, buf)
        except Exception as e:  # noqa: BLE001 - the result
            errors[r] = e

    run_ranks(bufs, catch, timeout=timeout)
    return errors
