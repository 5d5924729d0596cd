"""comet.buffers.symm's GPU backend: NVSHMEM symmetric memory for the CUDA kernels of comet's ops.

One `Buffer` per expert-parallel group owns, on every rank, a header (flags and call metadata) and
a growable data segment on the NVSHMEM heap, plus the peer pointer tables the kernels use
(nvshmem_ptr): the kernels load and store same-node peers' memory directly (NVLink / P2P). Peers
not reachable by pointer must form whole nodes of consecutive group ranks (comet/buffers/node_shape.py
infers `ranks_per_node` from every rank's reachability and refuses other shapes); they are reached
with NVSHMEM put-with-signal, issued by a proxy kernel that runs beside each call's kernels
(csrc/cuda/proxy.h), and each relay's data segment holds room for the mirrors of the other
nodes' sources (comet/topology.h).

NVSHMEM is bootstrapped once per process from torch.distributed: rank 0 creates a unique id and
broadcasts it over the default group (a process without torch.distributed is a world of one). A
buffer's group may be any process group (e.g. Megatron's expert-parallel group inside a larger
data-parallel world): group rank r is PE `get_process_group_ranks(group)[r]`. NVSHMEM allocations
are collective over all PEs, so buffers are created, reserved and closed by EVERY process of the
world at the same point, each for its own group (several groups alive at once, e.g. two EP groups
of 4 in a world of 8, each process creating the buffer of its group); a subgroup's buffer cannot
grow inside a call: reserve() it (or pass capacity_bytes) for the largest token count first, else
the call raises with the bytes it needs. The heap size is NVSHMEM's, fixed when NVSHMEM starts:
pass the largest shape as `reserve=dict(tokens=..., hidden=..., topk=..., num_experts=...)` to the
first Buffer (or init_nvshmem) and comet sets NVSHMEM_SYMMETRIC_SIZE from comet.buffers.symm.required_bytes
unless the user set it; a grow frees the old segment before allocating the new one.

Streams: a buffer's calls run on one stream at a time (comet/stream_rule.h): the first call binds
its stream; a call from another stream makes that stream wait for the bound one's queued work (an
event, no host synchronisation) and takes the buffer over; calls captured in a CUDA graph keep the
binding. Across nodes the proxy kernel runs on the buffer's own high-priority stream.

Calls without host synchronisation: inside `with buf.capturable(max_rows=R):` the ops never wait
for the GPU, so they can be captured in CUDA graphs. moe_layer0 then returns row-indexed outputs
of R rows (rows past M = recv_counts.sum() are unspecified) and the buffer must already be large
enough for the call's tokens (do one eager call, or `buf.reserve(...)`, before capturing). Errors
the GPU finds in such calls are raised by the next call or by `buf.check()`. Outside it, each op
reads back one small summary per call (its row count and every rank's verdict).

Lifetime: `close()` is collective (NVSHMEM frees are); a buffer dropped without close() keeps its
NVSHMEM memory until the process exits.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
import zlib

import torch
import torch.distributed as dist

from comet.buffers import node_shape
from comet.buffers import symm
from comet._native import _C

DEFAULT_TIMEOUT = symm.DEFAULT_TIMEOUT
DEFAULT_CAPACITY = int(os.environ.get("COMET_CUDA_BUFFER_BYTES", str(64 << 20)))
NVSHMEM_DEFAULT_HEAP = 1 << 30  # NVSHMEM's own default symmetric size
# SMs a call's kernels leave free by default in a group of several ranks (docs/gpu.md, "SM
# margin", says why 2).
DEFAULT_SM_MARGIN = 2


def default_sm_margin(world: int) -> int:
    """The sm_margin of a buffer created without one: DEFAULT_SM_MARGIN where peers exist, 0 in a
    world of one, where no kernel waits on another rank (the margin guards against a deadlock
    across ranks), so the GEMM keeps every SM."""
    return DEFAULT_SM_MARGIN if world > 1 else 0
# Room left for NVSHMEM's own symmetric allocations (teams, collectives) and for allocator
# alignment beside comet's buffer: a margin, not a measured figure.
NVSHMEM_HEADROOM = 128 << 20
BENCH_MODES = {"fused": 0, "comm": 1, "gemm": 2}

_lock = threading.RLock()
_nvshmem_world: tuple[int, int] | None = None


def available() -> bool:
    """True when this build has the CUDA kernels and a GPU is visible."""
    return bool(getattr(_C, "with_cuda", False)) and torch.cuda.is_available()


def _ops():
    if not getattr(_C, "with_cuda", False):
        raise RuntimeError("comet: this build has no CUDA kernels (rebuild with nvcc available "
                           "and COMET_CUDA unset)")
    return torch.ops.comet_cuda


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"comet.buffers.symm_cuda: {device} is not a CUDA device")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None
                        else device.index)


def heap_bytes(reserve, world: int | None = None) -> int:
    """NVSHMEM symmetric heap bytes one buffer takes for `reserve`: data segment bytes (int), or
    the shape as comet.buffers.symm.required_bytes' keywords (world defaults to the default group's size;
    ranks_per_node to one node), plus the header and NVSHMEM_HEADROOM."""
    if isinstance(reserve, dict):
        shape = dict(reserve)
        shape.setdefault("world", world or (dist.get_world_size() if _distributed() else 1))
        data, world = symm.required_bytes(**shape), shape["world"]
    else:
        data = int(reserve)
        world = world or (dist.get_world_size() if _distributed() else 1)
    return int(_ops().buffer_heap_bytes(world, data)) + NVSHMEM_HEADROOM


def init_nvshmem(device=None, *, reserve=None) -> None:
    """Bootstraps NVSHMEM for this process (collective over the default group; once).

    reserve: the largest shape the buffers will serve (a dict of comet.buffers.symm.required_bytes'
    keywords, or data segment bytes): NVSHMEM_SYMMETRIC_SIZE is set from it (never below
    NVSHMEM's default) unless the environment already sets it."""
    global _nvshmem_world
    with _lock:
        if _nvshmem_world is not None:
            return
        if reserve is not None and not os.environ.get("NVSHMEM_SYMMETRIC_SIZE"):
            need = max(heap_bytes(reserve), NVSHMEM_DEFAULT_HEAP)
            os.environ["NVSHMEM_SYMMETRIC_SIZE"] = f"{-(-need // (1 << 20))}M"
        dev = _device(device)
        torch.cuda.set_device(dev)
        ops = _ops()
        if _distributed():
            rank, world = dist.get_rank(), dist.get_world_size()
            uid = [bytes(ops.nvshmem_unique_id().tolist()) if rank == 0 else None]
            dist.broadcast_object_list(uid, src=0)
        else:
            rank, world = 0, 1
            uid = [bytes(ops.nvshmem_unique_id().tolist())]
        ops.nvshmem_bootstrap(torch.tensor(list(uid[0]), dtype=torch.uint8), rank, world,
                              dev.index)
        _nvshmem_world = (rank, world)


def _group_hash(members) -> int:
    return zlib.crc32(",".join(map(str, members)).encode())


class Buffer:
    """NVSHMEM symmetric memory and call state of one expert-parallel group on one GPU.

    Create it on every rank of `group` together - for a subgroup of the world, on every process
    of the world together, each for its own group (see the module docstring) - or let
    comet.moe_layer0/1 create one per group and device on first use. `timeout` (seconds, default $COMET_TIMEOUT or 60) bounds every
    spin-wait of the kernels: a wait that times out records which flag never arrived and
    returns (no kernel traps), and the op (or check(), or the next call) raises with that
    description; every rank then calls recover(). `capacity_bytes` is the initial data
    segment (default $COMET_CUDA_BUFFER_BYTES or 64 MiB); eager calls grow it as needed.

    `ranks_per_node` / `nodes`: how the group splits into nodes (consecutive group ranks that
    reach each other's memory by pointer; `ranks_per_node == world` on one node).
    `node_reduce` (default $COMET_NODE_REDUCE, else False): across nodes, layer1 sums each
    sending node's partials on the home's relay there and sends one row per (token, node)
    (comet.Buffer says more); the same on every rank.
    `reserve`: the largest shape its calls will have, dict(tokens=, hidden=, topk=, num_experts=,
    [dtype=, world=, ranks_per_node=, node_reduce=]): the first buffer of the process sets
    NVSHMEM_SYMMETRIC_SIZE from it (unless set), and the buffer reserves it at once.
    `sm_margin` (default DEFAULT_SM_MARGIN, 2; 0 in a world of one: default_sm_margin): SMs
    every call's kernels leave free for other
    kernels that peers may wait on (a collective on another stream, another buffer's call;
    docs/gpu.md, "SM margin"); a call's own sm_margin= overrides it.
    """

    def __init__(self, group=None, *, device=None, timeout: float | None = None,
                 capacity_bytes: int | None = None, node_reduce: bool | None = None,
                 reserve: dict | None = None, tp_size: int | None = None, placement=None,
                 sm_margin: int | None = None, _simulated=None):
        self.device = _device(device)
        # checked now, the default chosen once the group's size is known
        margin = None if sm_margin is None else symm.sm_margin_setting(sm_margin, DEFAULT_SM_MARGIN)
        self.group = group
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        capacity = DEFAULT_CAPACITY if capacity_bytes is None else int(capacity_bytes)
        ops = _ops()
        # (group, rank, world) from simulated_world: a rank of W on this GPU, no NVSHMEM, no
        # torch.distributed (the group meets in comet's own host rendezvous).
        self._simulated = _simulated is not None
        if self._simulated:
            sim_group, self.rank, self.world = _simulated
            self.handle = int(ops.buffer_create_sim(sim_group, self.rank, timeout,
                                                    _group_hash(list(range(self.world))),
                                                    capacity))
            self.subgroup = False
            # every rank reaches every other by pointer (one GPU): the same row everywhere
            reach = [[bool(v) for v in ops.buffer_reach(self.handle)]] * self.world
        else:
            reach = self._create_nvshmem(ops, group, reserve, timeout, capacity)
        distributed = _distributed() and not self._simulated
        self._barrier()  # every header is cleared before anyone uses it
        try:
            # Every rank sees the same matrix, so every rank accepts or raises alike.
            self.ranks_per_node = node_shape.ranks_per_node(reach)
            ops.buffer_set_ranks_per_node(self.handle, self.ranks_per_node)
            self.node_reduce = symm.node_reduce_setting(node_reduce)
            if distributed:
                symm._check_same_across_ranks(self.node_reduce, "node_reduce", group, self.world)
            ops.buffer_set_node_reduce(self.handle, self.node_reduce)
            ops.buffer_set_sm_margin(self.handle,
                                     default_sm_margin(self.world) if margin is None else margin)
        except (ValueError, RuntimeError):
            ops.buffer_release(self.handle)  # collective, like the creation
            raise
        self.nodes = self.world // self.ranks_per_node
        self._closed = False
        self.tp_size = symm.tp_size_setting(tp_size, self.world)  # comet.Buffer's tp_size
        # the ops' default placement= (None: the contiguous map), completed to the group
        self.placement = symm.placement_for_group(placement, self.world)
        symm.register_handle(self.handle, self.world, self.rank)
        self._finalizer = weakref.finalize(self, symm.forget_handle, self.handle)
        if reserve is not None:
            self.reserve(**{k: v for k, v in reserve.items() if k in _RESERVE_KEYS})

    def _create_nvshmem(self, ops, group, reserve, timeout, capacity):
        """This rank's buffer on the NVSHMEM heap (collective over NVSHMEM's world); returns the
        group's reachability matrix."""
        init_nvshmem(self.device, reserve=reserve)
        if _distributed():
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            # Group rank r is NVSHMEM PE members[r] (NVSHMEM's world is the default group).
            members = dist.get_process_group_ranks(group or dist.group.WORLD)
            # nvshmem_malloc is collective over the whole world, so every process creates its
            # buffer now (each for its own group) and the size must be equal everywhere.
            sizes = [None] * dist.get_world_size()
            dist.all_gather_object(sizes, capacity)
            capacity = max(sizes)
        else:
            self.rank, self.world, members = 0, 1, [0]
        self.handle = int(ops.buffer_create(self.rank, self.world, members, self.device.index,
                                            timeout, _group_hash(members), capacity))
        self.subgroup = bool(ops.buffer_is_subgroup(self.handle))
        reach = [[bool(v) for v in ops.buffer_reach(self.handle)]]
        if _distributed():
            everyone = [None] * self.world
            dist.all_gather_object(everyone, reach[0], group=group)
            reach = everyone
        return reach

    # -- settings -----------------------------------------------------------------------------

    @property
    def device_ranks(self) -> int:
        """Ranks of the group on this buffer's GPU: 1, or W in a simulated world (each rank's
        kernels then use at most floor(SMs / W) SMs: docs/gpu.md, "Several ranks on one GPU")."""
        return self.world if self._simulated else 1

    @property
    def sm_margin(self) -> int:
        """SMs this buffer's calls leave free (Buffer(sm_margin=); a call's own overrides it)."""
        return int(_ops().buffer_sm_margin(self.handle))

    @property
    def max_rows(self) -> int | None:
        r = int(_ops().buffer_max_rows(self.handle))
        return None if r < 0 else r

    @max_rows.setter
    def max_rows(self, rows: int | None) -> None:
        if rows is not None and int(rows) < 0:
            raise ValueError(f"max_rows must be >= 0, got {rows}")
        _ops().buffer_set_max_rows(self.handle, -1 if rows is None else int(rows))

    @contextlib.contextmanager
    def capturable(self, max_rows: int):
        """Calls inside run without any host synchronisation (CUDA-graph capturable): moe_layer0
        returns `max_rows` rows; see the module docstring."""
        before = self.max_rows
        self.max_rows = max_rows
        try:
            yield self
        finally:
            self.max_rows = before

    @contextlib.contextmanager
    def bench_mode(self, mode: str):
        """'comm': the fused kernels run without MMA work (the comm blocks' time); 'gemm': without
        moving rows or partial sums (the GEMM blocks' time); results are garbage in both. Every
        rank must use the same mode."""
        if mode not in BENCH_MODES:
            raise ValueError(f"bench mode {mode!r}: one of {sorted(BENCH_MODES)}")
        _ops().buffer_set_bench_mode(self.handle, BENCH_MODES[mode])
        try:
            yield self
        finally:
            _ops().buffer_set_bench_mode(self.handle, 0)

    def last_kernel_seconds(self) -> float:
        """Duration of the last fused kernel run on this buffer (its first block's start to its
        last warp's exit, from the GPU's global timer); waits for the buffer's stream."""
        return float(_ops().buffer_kernel_time(self.handle))

    def set_timeout(self, seconds: float) -> None:
        _ops().buffer_set_timeout(self.handle, float(seconds))

    @property
    def capacity_bytes(self) -> int:
        return int(_ops().buffer_capacity(self.handle))

    @property
    def requested_bytes(self) -> int:
        """The largest data segment a call or reserve() of this buffer asked for so far."""
        return int(_ops().buffer_requested(self.handle))

    def traffic(self):
        """comet.Buffer.traffic (comet/buffers/symm.py), as the GPU's comm blocks counted it."""
        return symm.Traffic(*(int(v) for v in _ops().buffer_traffic(self.handle)))

    @property
    def stream(self) -> int | None:
        """The cudaStream_t (as an int) the buffer's calls are bound to; None before the first."""
        s = int(_ops().buffer_stream(self.handle))
        return None if s == -1 else s

    @property
    def proxy_stream(self) -> int | None:
        """The buffer's own stream for the inter-node proxy (None on one node)."""
        s = int(_ops().buffer_proxy_stream(self.handle))
        return s or None

    # -- collective operations ------------------------------------------------------------------

    def reserve_bytes(self, nbytes: int) -> None:
        """Grows every rank's data segment to at least nbytes (collective over the group; for a
        subgroup's buffer over every process of the world, each reserving its own buffer)."""
        if self.subgroup:
            sizes = [None] * dist.get_world_size()
            dist.all_gather_object(sizes, int(nbytes))
            nbytes = max(sizes)
        _ops().buffer_reserve(self.handle, int(nbytes))
        self._barrier()

    def reserve(self, *, tokens: int, hidden: int, topk: int, num_experts: int,
                dtype=torch.bfloat16) -> None:
        """Room for calls of both layers with up to `tokens` tokens per rank (collective):
        comet.buffers.symm.required_bytes for this buffer's group."""
        self.reserve_bytes(symm.required_bytes_of(self, tokens=tokens, hidden=hidden, topk=topk,
                                                  num_experts=num_experts, dtype=dtype))

    def close(self) -> None:
        """Frees the NVSHMEM memory (collective: every rank calls it)."""
        if self._closed:
            return
        torch.cuda.synchronize(self.device)
        self._barrier()
        _ops().buffer_release(self.handle)
        self._closed = True
        self._finalizer()

    # -- errors -------------------------------------------------------------------------------

    def check(self) -> None:
        """Waits for this rank's queued work and raises what the GPU recorded (a timed-out wait,
        a rejected or overflowing call without host synchronisation)."""
        msg = str(_ops().buffer_check(self.handle))
        if msg:
            raise RuntimeError(msg)

    def recover(self) -> None:
        """Re-arm this buffer after a failed call (a timed-out wait, a layout that did not match
        the peers' routing, a failure of the inter-node transport), collectively: every rank
        of the group calls it within the timeout. Each rank waits for its queued work, and all
        continue from the group's newest call number with fresh counters; the segments are kept.
        Until then every call raises. Raises, and the buffer is unusable for good, when the CUDA
        context failed or a peer does not join (on CUDA the next call does not re-arm by itself:
        a rank that saw no failure could not tell its peers' state)."""
        _ops().buffer_recover(self.handle)

    @property
    def needs_recovery(self) -> bool:
        """True when a call of this rank failed and recover() has not re-armed the buffer yet."""
        return bool(_ops().buffer_needs_rearm(self.handle))

    @property
    def recoveries(self) -> int:
        """Re-arms this buffer completed so far (the same count on every rank after each)."""
        return int(_ops().buffer_rearm_round(self.handle))
    def set_call_tag(self, tag: int) -> None:
        """The placement fingerprint this rank's next calls announce (0: none; comet.layers.placed)."""
        _ops().buffer_set_call_tag(self.handle, int(tag))

    def fail_call(self, op: int, message: str, error: type = ValueError) -> None:
        """Report a local input error through the call protocol so every peer raises too (this
        rank `error`, its peers ValueError naming this rank, as for the ops' own checks)."""
        verdict = str(_ops().buffer_fail_call(self.handle, int(op), message))
        raise error(verdict or message)

    def _barrier(self):
        if self._simulated:  # the W threads' rendezvous (csrc/cuda/symm_sim.cpp)
            _ops().sim_barrier(self.handle)
        elif _distributed():  # NVSHMEM allocation is world-collective: a subgroup syncs the world
            dist.barrier(group=None if self.subgroup else self.group)

    def __repr__(self):
        return (f"comet.buffers.symm_cuda.Buffer(rank={self.rank}, world={self.world}, "
                f"ranks_per_node={self.ranks_per_node}, node_reduce={self.node_reduce}, "
                f"device={self.device}, "
                f"handle={self.handle})")


def simulated_world(world: int, *, device=None, timeout: float | None = None,
                    capacity_bytes: int | None = None, node_reduce: bool | None = None,
                    tp_size: int | None = None, placement=None,
                    sm_margin: int | None = None) -> list[Buffer]:
    """`world` CUDA buffers forming one group on ONE GPU (comet.Buffer.simulated_world(W,
    device="cuda")): rank r's ops are called from thread r, each thread with a torch.cuda.Stream
    of its own. The same kernels and call protocol as W GPUs; the symmetric memory is one device
    allocation per symmetric object for the group (no NVSHMEM), the collectives a rendezvous of
    the W threads (csrc/cuda/symm_sim.cpp), and each rank's kernels use at most floor(SMs / W)
    SMs minus sm_margin, so that the ranks' grids are co-resident. Needs
    CUDA_MODULE_LOADING=EAGER in the environment before CUDA starts: a lazy kernel load may
    synchronise the device while another rank's kernel waits for this rank."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"comet: a simulated world needs an int world >= 1, got {world!r}")
    if not getattr(_C, "with_cuda", False):
        raise RuntimeError("comet: Buffer.simulated_world(device='cuda') needs the CUDA kernels, "
                           "which this build of comet lacks (rebuild with nvcc available and "
                           "COMET_CUDA unset), or use device='cpu'")
    if not torch.cuda.is_available():
        raise RuntimeError("comet: Buffer.simulated_world(device='cuda') needs a CUDA GPU and "
                           "none is visible; use device='cpu'")
    loading = os.environ.get("CUDA_MODULE_LOADING", "")
    if loading.upper() != "EAGER":
        raise RuntimeError("comet: a simulated world on one GPU needs CUDA_MODULE_LOADING=EAGER "
                           f"(it is {loading or 'unset: lazy'}), set before CUDA starts: a lazy "
                           "kernel load may wait for every kernel on the device, including "
                           "another rank's kernel that waits for this rank")
    dev = _device(device)
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    symm.tp_size_setting(tp_size, world)  # every setting checked before any memory exists
    symm.node_reduce_setting(node_reduce)
    if sm_margin is not None:
        symm.sm_margin_setting(sm_margin, DEFAULT_SM_MARGIN)
    # The CUDA context (and, eagerly, every module) now, not in the ranks' threads, whose
    # rendezvous would count that time against the timeout.
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    group = int(_ops().sim_group_create(world, dev.index, timeout))
    buffers, errors = [None] * world, [None] * world

    def create(r):  # collective: each rank's constructor on a thread of its own
        try:
            torch.cuda.set_device(dev)
            buffers[r] = Buffer(device=dev, timeout=timeout, capacity_bytes=capacity_bytes,
                                node_reduce=node_reduce, tp_size=tp_size, placement=placement,
                                sm_margin=sm_margin, _simulated=(group, r, world))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e

    threads = [threading.Thread(target=create, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # the rendezvous times out after `timeout`
    for r, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"comet: creating rank {r} of the simulated world failed: {e}") from e
    return buffers


_RESERVE_KEYS = ("tokens", "hidden", "topk", "num_experts", "dtype")
_buffers: dict = {}


def buffer_for(group=None, device=None) -> Buffer:
    """The CUDA Buffer comet's ops use for `group` on `device` (None: the default group if
    torch.distributed is initialised, else a world of one; the current device), created
    collectively on first use."""
    dev = _device(device)
    key = (group if group is not None else (dist.group.WORLD if _distributed() else "local"),
           dev.index)
    with _lock:
        buf = _buffers.get(key)
        if buf is None or buf._closed:
            buf = _buffers[key] = Buffer(group, device=dev)
        return buf


symm.register_simulated_world("cuda", simulated_world)
