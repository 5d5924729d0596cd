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

import threading  # noqa: E402

import torch  # noqa: E402

import comet  # noqa: E402

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
    """fn(rank, buffer) on one thread per rank, each on a torch.cuda.Stream of its own; returns
    the results by rank and re-raises the first rank's error. A rank still running after
    `timeout` seconds fails the test (a hang)."""
    world = len(bufs)
    results, errors = [None] * world, [None] * world
    device = bufs[0].device

    def body(r):
        try:
            torch.cuda.set_device(device)
            stream = getattr(bufs[r], "test_stream", None) or torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                results[r] = fn(r, bufs[r])
                torch.cuda.current_stream().synchronize()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a simulated CUDA world of {world} ranks did not finish within "
                           f"{timeout} s (a hang)")
    for r, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"rank {r} failed: {e!r}") from e
    return results


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
