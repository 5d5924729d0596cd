"""Run a small computation (a shared expert) beside comet's fused MoE kernels.

On CUDA the work goes to a side stream, so it overlaps the routed path's dispatch + GEMM kernels
on the current stream; on the CPU it simply runs where it is called (between moe_layer0 and
moe_layer1 the CPU backend's blocks are done, so there is nothing to overlap with).

    ready = sidestream.mark_ready(x)          # before comet.moe_layer0: x is complete here
    y0, layout = comet.moe_layer0(x, ...)     # enqueued on the current stream
    pending = sidestream.run_beside(fn, x, ready)
    out = comet.moe_layer1(...)               # enqueued on the current stream
    shared = sidestream.join(pending)         # current stream waits for the side stream

Stream discipline: the side stream waits for the event recorded when x was ready (not for the
current stream as a whole, which would serialise it behind moe_layer0); x and the result are
marked as used by the other stream (record_stream) so the caching allocator does not hand their
memory to another tensor while the other stream may still touch it. Autograd records the stream
of every forward op and runs its backward there, syncing across streams by itself.
"""
from __future__ import annotations

import threading

import torch

__all__ = ["mark_ready", "run_beside", "join"]

_streams: dict = {}
_lock = threading.Lock()


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
        return stream


def mark_ready(x: torch.Tensor):
    """An event on the current CUDA stream marking that x is complete (None off CUDA)."""
    if x.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(x.device))
    return event


class _Pending:
    def __init__(self, out, stream, device):
        self.out, self.stream, self.device = out, stream, device


def run_beside(fn, x: torch.Tensor, ready):
    """fn(x), on a side stream after `ready` when there is one (CUDA), else inline."""
    if ready is None:
        return fn(x)
    stream = _side_stream(x.device)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        x.record_stream(stream)
        out = fn(x)
    return _Pending(out, stream, x.device)


def join(pending):
    """The result of run_beside, usable on the current stream."""
    if not isinstance(pending, _Pending):
        return pending
    current = torch.cuda.current_stream(pending.device)
    current.wait_stream(pending.stream)
    pending.out.record_stream(current)
    return pending.out
