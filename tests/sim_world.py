"""Run rank functions as threads of this process over a simulated group (Buffer.simulated_world):
the ops' real shared-memory code path, without process start-up cost. A hang fails the test."""
from __future__ import annotations

import threading

import comet


def run_threads(world: int, fn, *, timeout: float = 60.0, buffers=None, comm_timeout: float = 20.0):
    """fn(rank, buffer) on `world` threads; returns results by rank; re-raises the first error."""
    bufs = buffers or comet.Buffer.simulated_world(world, timeout=comm_timeout)
    results, errors = [None] * world, [None] * world

    def body(r):
        try:
            results[r] = fn(r, bufs[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"simulated world of {world} did not finish within {timeout} s")
    for r, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"rank {r} failed: {e!r}") from e
    return results
