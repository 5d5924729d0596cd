"""Symmetric memory for comet's ops: one `Buffer` per process group owns the per-rank segments the
fused kernels read and write one-sidedly (NVSHMEM's model).

CPU backend: a POSIX shared-memory header and a growable data segment per rank, mapped by every
rank of the group. Segment names are exchanged through the group once; every name is unlinked as
soon as all ranks have mapped it, so nothing is left in /dev/shm even if a process dies.
"""
from __future__ import annotations

import os
import secrets
import threading
import weakref
import zlib

import torch.distributed as dist

from comet._native import _C

DEFAULT_TIMEOUT = float(os.environ.get("COMET_TIMEOUT", "60"))

# handle -> world size, for the fake (meta) kernels, which only see the integer handle.
_WORLD_OF_HANDLE: dict[int, int] = {}


def world_of_handle(handle: int) -> int:
    try:
        return _WORLD_OF_HANDLE[int(handle)]
    except KeyError:
        raise ValueError(f"comet: no live buffer with handle {handle}") from None


class Buffer:
    """Symmetric memory and call state for one expert-parallel group.

    Create it on every rank of `group` (collectively), or let `comet.moe_layer0/1` create one per
    group on first use. `timeout` (seconds, default $COMET_TIMEOUT or 60) bounds every wait on a
    peer: a rank that died or called something else ends in an error naming what never arrived.
    `threads_per_block` (CPU backend only; default $COMET_CPU_BLOCK_THREADS or 1) runs every block
    of the CPU kernels as a team of that many OS threads, as a GPU block's threads cooperate.
    """

    def __init__(self, group=None, *, timeout: float | None = None,
                 threads_per_block: int | None = None, _simulated=None):
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        if _simulated is not None:  # built by Buffer.simulated_world
            self.rank, self.world, self.handle, self.group = _simulated
        else:
            self.group = group
            if _distributed(group):
                self.rank = dist.get_rank(group)
                self.world = dist.get_world_size(group)
                members = dist.get_process_group_ranks(group or dist.group.WORLD)
                token = [f"{os.getpid():x}{secrets.token_hex(4)}" if self.rank == 0 else None]
                dist.broadcast_object_list(token, group=group, group_src=0)
                job = token[0]
            else:
                self.rank, self.world, members = 0, 1, [0]
                job = f"{os.getpid():x}{secrets.token_hex(4)}"
            self.handle = _C.heap_create(self.rank, self.world, job, _group_hash(members), timeout)
            self._barrier()
            _C.heap_connect(self.handle)
            self._barrier()
            _C.heap_unlink_own(self.handle)
        _WORLD_OF_HANDLE[self.handle] = self.world
        self._finalizer = weakref.finalize(self, _release, self.handle)
        if threads_per_block is not None:
            self.set_threads_per_block(threads_per_block)

    @classmethod
    def simulated_world(cls, world: int, *, timeout: float | None = None,
                        threads_per_block: int | None = None) -> list["Buffer"]:
        """`world` buffers forming one group inside this process: rank r's ops run from thread r.
        The same shared-memory code path as separate processes, for fast tests."""
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        job = f"{os.getpid():x}{secrets.token_hex(4)}"
        gh = _group_hash(list(range(world)))
        handles = [_C.heap_create(r, world, job, gh, timeout) for r in range(world)]
        for h in handles:
            _C.heap_connect(h)
        for h in handles:
            _C.heap_unlink_own(h)
        return [cls(_simulated=(r, world, h, None), threads_per_block=threads_per_block)
                for r, h in enumerate(handles)]

    def set_timeout(self, seconds: float) -> None:
        _C.heap_set_timeout(self.handle, float(seconds))

    def set_threads_per_block(self, threads: int) -> None:
        """OS threads per block of the CPU kernels (1-1024); no effect on the CUDA backend."""
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
            raise ValueError(f"comet: threads_per_block must be an int in [1, 1024], got {threads!r}")
        _C.heap_set_block_threads(self.handle, threads)

    def fail_call(self, op: int, message: str) -> None:
        """Report a local input error through the call protocol so every peer raises too."""
        verdict = _C.heap_fail_call(self.handle, op, message)
        raise ValueError(verdict or message)

    def close(self) -> None:
        self._finalizer()

    def _barrier(self):
        if _distributed(self.group):
            dist.barrier(group=self.group)

    def __repr__(self):
        return f"comet.Buffer(rank={self.rank}, world={self.world}, handle={self.handle})"


def _release(handle):
    _WORLD_OF_HANDLE.pop(handle, None)
    _C.heap_release(handle)


def _distributed(group) -> bool:
    return group is not None or (dist.is_available() and dist.is_initialized())


def _group_hash(members) -> int:
    return zlib.crc32(",".join(map(str, members)).encode())


_buffers: dict = {}
_buffers_lock = threading.Lock()


def buffer_for(group=None) -> Buffer:
    """The Buffer comet's ops use for `group` (None: the default group if torch.distributed is
    initialised, else a world of one), created collectively on first use."""
    key = group if group is not None else (dist.group.WORLD if _distributed(None) else "local")
    with _buffers_lock:
        buf = _buffers.get(key)
        if buf is None:
            buf = _buffers[key] = Buffer(group)
        return buf
