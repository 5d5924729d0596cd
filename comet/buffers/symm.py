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
from typing import NamedTuple

import torch.distributed as dist

from comet._native import _C

DEFAULT_TIMEOUT = float(os.environ.get("COMET_TIMEOUT", "60"))

# handle -> world size, for the fake (meta) kernels, which only see the integer handle; and
# handle -> group rank, for backward (which tp rank adds layer1's bias term).
_WORLD_OF_HANDLE: dict[int, int] = {}
_RANK_OF_HANDLE: dict[int, int] = {}


def world_of_handle(handle: int) -> int:
    try:
        return _WORLD_OF_HANDLE[int(handle)]
    except KeyError:
        raise ValueError(f"comet: no live buffer with handle {handle}") from None


def rank_of_handle(handle: int) -> int:
    try:
        return _RANK_OF_HANDLE[int(handle)]
    except KeyError:
        raise ValueError(f"comet: no live buffer with handle {handle}") from None


def register_handle(handle: int, world: int, rank: int) -> None:
    _WORLD_OF_HANDLE[int(handle)] = int(world)
    _RANK_OF_HANDLE[int(handle)] = int(rank)


def forget_handle(handle: int) -> None:
    _WORLD_OF_HANDLE.pop(int(handle), None)
    _RANK_OF_HANDLE.pop(int(handle), None)


def placement_for_group(placement, world: int):
    """A buffer's default placement= on its group of `world` ranks: a comet.plan.Placement built
    without world= completed to the group (Placement.for_world); anything else, or a placement
    that does not fit the group, as given (the ops then raise on every rank when it is used)."""
    try:
        return placement.for_world(world) if hasattr(placement, "for_world") else placement
    except ValueError:
        return placement


def tp_size_setting(tp_size, world: int) -> int:
    """A buffer's tp_size (expert tensor parallelism; 1 = expert-parallel only): an int >= 1
    dividing the group size."""
    tp = 1 if tp_size is None else tp_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world % tp:
        raise ValueError(f"comet: tp_size must be an int >= 1 dividing the group size {world}, "
                         f"got {tp_size!r}")
    return tp


class Traffic(NamedTuple):
    """Buffer.traffic(): what this rank's comm blocks moved across links in its last calls."""
    layer0_rows: int   # token rows received from other ranks (once per token and rank)
    layer0_bytes: int  # their bytes (FP8: packed rows with their scales)
    layer1_rows: int   # partial rows sent to other ranks
    layer1_bytes: int


# Buffer.simulated_world's other devices: "cuda" -> comet.buffers.symm_cuda.simulated_world, which
# registers itself when imported (the package imports it), so this module, which symm_cuda builds
# on, does not import it.
_SIMULATED_WORLDS: dict = {}


def register_simulated_world(device_type: str, make) -> None:
    """Let Buffer.simulated_world(device=<device_type>...) build its buffers with `make`."""
    _SIMULATED_WORLDS[device_type] = make


class Buffer:
    """Symmetric memory and call state for one expert-parallel group.

    Create it on every rank of `group` (collectively), or let `comet.moe_layer0/1` create one per
    group on first use. `timeout` (seconds, default $COMET_TIMEOUT or 60) bounds every wait on a
    peer: a rank that died or called something else ends in an error naming what never arrived.
    `threads_per_block` (CPU backend only; default $COMET_CPU_BLOCK_THREADS or 1) runs every block
    of the CPU kernels as a team of that many OS threads, as a GPU block's threads cooperate.
    `resident_blocks` (CPU backend only; default $COMET_CPU_RESIDENT_BLOCKS, else 0: no limit)
    runs at most that many blocks of a CPU kernel at once, started in block-index order as slots
    free, as a GPU does when fewer blocks fit than the grid has (a kernel beside comet's); the
    `resident_blocks` property says what the calls run under.

    Several nodes on the CPU backend (the analog of a multi-node job, comet/topology.h):
    `ranks_per_node` (default $COMET_CPU_RANKS_PER_NODE, else the whole group: one node) groups
    consecutive ranks into nodes; ranks of other nodes are not mapped and are reached only by
    put-with-signal through a proxy thread per rank, delivering each put `link_latency_us` after
    it was issued (default $COMET_CPU_LINK_LATENCY_US or 10) at `link_gbps` GB/s (default
    $COMET_CPU_LINK_GBPS or 0: memcpy speed). Must be the same on every rank.
    `node_reduce` (default $COMET_NODE_REDUCE, else False): layer1 sums the partials of each
    sending node on the home's relay there and sends one row per (token, node) across the link
    instead of one per (token, sending rank): fewer inter-node bytes, one more rounding of the
    node's sum to the activation dtype (results match the reference at the dtype's tolerance,
    not a single node's bits). Only matters when the group spans nodes; the same on every rank.

    `sm_margin` (default 0 on the CPU backend): resident-block slots the calls' fused kernels and
    the grids that wait on themselves leave free for other kernels of the rank's device (another
    buffer's call, a kernel that waits across ranks), as `comet.buffers.symm_cuda.Buffer`'s leaves
    SMs free (docs/gpu.md, "SM margin"). On the CPU backend every buffer of a rank shares one
    device of `resident_blocks` slots (when that limit is set; without it nothing is shared and
    the margin is moot); each call's own sm_margin= overrides it.

    `heap_bytes` (CPU backend only; default $COMET_CPU_HEAP_BYTES, else 0: no cap) caps this
    rank's data segment, as NVSHMEM_SYMMETRIC_SIZE caps a CUDA buffer's: a call whose need fits
    the cap but not twice the old size grows to the need, and one whose need does not fit raises
    on every rank, naming both, with the buffer still serving calls at its old capacity.
    The same on every rank.

    `tp_size` (default 1): expert tensor parallelism, the default of the ops' tp_size for calls
    through this buffer. The group is TP-innermost: rank r is tp rank r % tp_size of EP rank
    r // tp_size, and EP = W / tp_size must divide num_experts (docs/api.md, "Expert tensor
    parallelism"). The same on every rank (each call checks that the ranks agree).
    `placement` (default None: the contiguous map): a comet.plan.Placement, the default of the
    ops' placement= for calls through this buffer (docs/placement.md, "Running a placement");
    one built without world= is completed to the group (Placement.for_world), so
    `buffer.placement.world == buffer.world`.
    """

    def __init__(self, group=None, *, timeout: float | None = None,
                 threads_per_block: int | None = None, ranks_per_node: int | None = None,
                 link_latency_us: float | None = None, link_gbps: float | None = None,
                 node_reduce: bool | None = None, resident_blocks: int | None = None,
                 tp_size: int | None = None, placement=None, heap_bytes: int | None = None,
                 sm_margin: int | None = None, _simulated=None):
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        heap_cap = heap_bytes_setting(heap_bytes)
        margin = sm_margin_setting(sm_margin, CPU_SM_MARGIN)
        if _simulated is not None:  # built by Buffer.simulated_world
            self.rank, self.world, self.handle, self.group = _simulated
            self.ranks_per_node = _C.heap_ranks_per_node(self.handle)
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
            link = _link_settings(self.world, ranks_per_node, link_latency_us, link_gbps)
            if _distributed(group):
                _check_same_across_ranks(link[0], "ranks_per_node", group, self.world)
            self.ranks_per_node = link[0]
            reduce = node_reduce_setting(node_reduce)
            if _distributed(group):
                _check_same_across_ranks(reduce, "node_reduce", group, self.world)
                _check_same_across_ranks(heap_cap, "heap_bytes", group, self.world)
            self.handle = _C.heap_create(self.rank, self.world, job, _group_hash(members), timeout,
                                         *link)
            _C.heap_set_node_reduce(self.handle, reduce)
            self._barrier()
            _C.heap_connect(self.handle)
            self._barrier()
            _C.heap_unlink_own(self.handle)
        self.node_reduce = _C.heap_node_reduce(self.handle)
        _C.heap_set_data_limit(self.handle, heap_cap)
        _C.heap_set_sm_margin(self.handle, margin)
        self.tp_size = tp_size_setting(tp_size, self.world)
        # The ops' default placement= (a comet.plan.Placement; None: the contiguous map).
        self.placement = placement_for_group(placement, self.world)
        register_handle(self.handle, self.world, self.rank)
        self._finalizer = weakref.finalize(self, _release, self.handle)
        if threads_per_block is not None:
            self.set_threads_per_block(threads_per_block)
        if resident_blocks is not None:
            self.set_resident_blocks(resident_blocks)

    @classmethod
    def simulated_world(cls, world: int, *, timeout: float | None = None,
                        threads_per_block: int | None = None, ranks_per_node: int | None = None,
                        link_latency_us: float | None = None,
                        link_gbps: float | None = None,
                        node_reduce: bool | None = None,
                        resident_blocks: int | None = None,
                        tp_size: int | None = None, placement=None,
                        heap_bytes: int | None = None,
                        sm_margin: int | None = None, device="cpu",
                        capacity_bytes: int | None = None) -> list:
        """`world` buffers forming one group inside this process: rank r's ops run from thread r.
        The same shared-memory code path as separate processes, for fast tests.

        device="cuda" (or "cuda:i"): the W ranks share one GPU instead
        (comet.buffers.symm_cuda.simulated_world: CUDA buffers, the same kernels and protocol as W
        GPUs; each rank's thread runs its calls on a torch.cuda.Stream of its own). The CPU
        backend's settings (threads_per_block, ranks_per_node, link_*, resident_blocks,
        heap_bytes) do not apply there; capacity_bytes (the CUDA buffers' initial data segment)
        only applies there."""
        if str(device) != "cpu":
            cpu_only = dict(threads_per_block=threads_per_block, ranks_per_node=ranks_per_node,
                            link_latency_us=link_latency_us, link_gbps=link_gbps,
                            resident_blocks=resident_blocks, heap_bytes=heap_bytes)
            given = sorted(k for k, v in cpu_only.items() if v is not None)
            if given:
                raise ValueError(f"comet: {', '.join(given)} of Buffer.simulated_world are the "
                                 f"CPU backend's; device={device!r} takes none of them")
            return _SIMULATED_WORLDS["cuda"](world, device=device, timeout=timeout,
                                             node_reduce=node_reduce, tp_size=tp_size,
                                             placement=placement, sm_margin=sm_margin,
                                             capacity_bytes=capacity_bytes)
        if capacity_bytes is not None:
            raise ValueError("comet: capacity_bytes of Buffer.simulated_world is the CUDA "
                             "buffers'; the CPU backend's cap is heap_bytes")
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        tp_size_setting(tp_size, world)
        job = f"{os.getpid():x}{secrets.token_hex(4)}"
        gh = _group_hash(list(range(world)))
        link = _link_settings(world, ranks_per_node, link_latency_us, link_gbps)
        reduce = node_reduce_setting(node_reduce)  # every setting checked before any segment exists
        handles = [_C.heap_create(r, world, job, gh, timeout, *link) for r in range(world)]
        for r, h in enumerate(handles):
            _C.heap_set_node_reduce(h, reduce)
            _C.heap_set_device(h, r)  # each rank its own device (slot pool), as with W GPUs
        for h in handles:
            _C.heap_connect(h)
        for h in handles:
            _C.heap_unlink_own(h)
        heap_bytes_setting(heap_bytes)
        sm_margin_setting(sm_margin, CPU_SM_MARGIN)
        return [cls(_simulated=(r, world, h, None), threads_per_block=threads_per_block,
                    resident_blocks=resident_blocks, tp_size=tp_size, placement=placement,
                    heap_bytes=heap_bytes, sm_margin=sm_margin)
                for r, h in enumerate(handles)]

    def set_timeout(self, seconds: float) -> None:
        _C.heap_set_timeout(self.handle, float(seconds))

    def set_threads_per_block(self, threads: int) -> None:
        """OS threads per block of the CPU kernels (1-1024); no effect on the CUDA backend."""
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
            raise ValueError(f"comet: threads_per_block must be an int in [1, 1024], got {threads!r}")
        _C.heap_set_block_threads(self.handle, threads)

    def set_resident_blocks(self, blocks: int) -> None:
        """Blocks of a CPU kernel live at once (>= 0, 0: no limit); no effect on the CUDA backend."""
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 0 <= blocks < 2**31:
            raise ValueError(f"comet: resident_blocks must be an int >= 0 (0: no limit), "
                             f"got {blocks!r}")
        _C.heap_set_resident_blocks(self.handle, blocks)

    @property
    def resident_blocks(self) -> int:
        """The residency limit this buffer's CPU calls run under (0: none): its own setting, else
        $COMET_CPU_RESIDENT_BLOCKS as it is now."""
        return _C.heap_resident_blocks(self.handle)

    def set_call_tag(self, tag: int) -> None:
        """The placement fingerprint this rank's next calls announce (0: none; comet.layers.placed)."""
        _C.heap_set_call_tag(self.handle, int(tag))

    def fail_call(self, op: int, message: str, error: type = ValueError) -> None:
        """Report a local input error through the call protocol so every peer raises too (this
        rank `error`, its peers ValueError naming this rank, as for the ops' own checks)."""
        verdict = _C.heap_fail_call(self.handle, op, message)
        raise error(verdict or message)

    def recover(self) -> None:
        """Re-arm this buffer after a failed or timed-out call, collectively (every rank of the
        group calls it, or makes its next op call, within the timeout; in a simulated world each
        rank's thread). The next op call does the same by itself when this rank or a peer failed,
        so calling this is only needed to re-arm at a chosen point. Every rank drains what it
        still had in flight and continues from the group's newest call number, so nothing written
        before can be taken for a later call's data; the segments are kept. Raises, and the buffer
        stays unusable for good, if a rank of the group has exited."""
        _C.heap_recover(self.handle)

    @property
    def needs_recovery(self) -> bool:
        """True when this rank or a peer failed a call and the buffer has not been re-armed yet
        (the next call, or recover(), re-arms it)."""
        return bool(_C.heap_needs_rearm(self.handle))

    @property
    def recoveries(self) -> int:
        """Re-arms this buffer completed so far (the same count on every rank after each)."""
        return int(_C.heap_rearm_round(self.handle))

    def close(self) -> None:
        self._finalizer()

    def _barrier(self):
        if _distributed(self.group):
            dist.barrier(group=self.group)

    def reserve(self, *, tokens: int, hidden: int, topk: int, num_experts: int,
                dtype=None) -> None:
        """Grows the data segment once to what calls of both layers with up to `tokens` tokens
        per rank need (required_bytes), so such calls never grow it (collective: every rank of
        the group, between calls; in a simulated world each rank's thread)."""
        _C.heap_reserve(self.handle, required_bytes_of(self, tokens=tokens, hidden=hidden,
                                                       topk=topk, num_experts=num_experts,
                                                       dtype=dtype))

    @property
    def capacity_bytes(self) -> int:
        """This rank's data segment bytes now (grown to max(need, twice the old size), or to the
        need when the doubling passes heap_bytes: comet/grow_rule.h)."""
        return int(_C.heap_capacity(self.handle))

    @property
    def sm_margin(self) -> int:
        """Resident-block slots this buffer's calls leave free for the rank's other kernels
        (Buffer(sm_margin=); a call's own sm_margin= overrides it). It only matters under a
        residency limit (resident_blocks), the slots of the rank's one device that every kernel of
        every buffer of the rank shares."""
        return int(_C.heap_sm_margin(self.handle))

    @property
    def heap_bytes(self) -> int:
        """The cap on this rank's data segment (0: none; Buffer(heap_bytes=))."""
        return int(_C.heap_data_limit(self.handle))

    @property
    def requested_bytes(self) -> int:
        """The largest data segment a call or reserve() of this buffer asked for so far."""
        return int(_C.heap_requested(self.handle))

    def link_stats(self) -> tuple[int, int]:
        """(puts issued, bytes delivered) by this rank's link to other nodes (CPU backend)."""
        return tuple(_C.heap_link_stats(self.handle))

    def traffic(self) -> "Traffic":
        """The token rows (and their bytes) this rank received from other ranks in its last
        layer0 call and sent to other ranks in its last layer1 call, as its comm blocks counted
        them; a rank's own rows do not count, FP8 rows count their packed bytes."""
        return Traffic(*(int(v) for v in _C.heap_traffic(self.handle)))

    def __repr__(self):
        return (f"comet.Buffer(rank={self.rank}, world={self.world}, "
                f"ranks_per_node={self.ranks_per_node}, node_reduce={self.node_reduce}, "
                f"tp_size={self.tp_size}, handle={self.handle})")


def required_bytes_of(buf, *, tokens: int, hidden: int, topk: int, num_experts: int,
                      dtype=None) -> int:
    """required_bytes for buffer `buf`'s group (its world, ranks_per_node, node_reduce and
    tp_size): what reserve() grows to, on either backend."""
    return required_bytes(tokens=tokens, hidden=hidden, topk=topk, num_experts=num_experts,
                          world=buf.world, dtype=dtype, ranks_per_node=buf.ranks_per_node,
                          node_reduce=buf.node_reduce, tp_size=getattr(buf, "tp_size", 1))


def required_bytes(*, tokens: int, hidden: int, topk: int, num_experts: int, world: int,
                   dtype=None, ranks_per_node: int | None = None, node_reduce: bool = False,
                   op: int | None = None, tp_size: int = 1) -> int:
    """Bytes of symmetric data segment per rank that calls with up to `tokens` tokens per rank
    need (both layers, or only `op` 0 / 1), on a group of `world` ranks in nodes of
    `ranks_per_node` (default: one node), with `node_reduce` as the buffer's; dtype: the
    activations' (default bfloat16).

    Computed by the layout code the kernels use (comet/symm_layout.h: call_regions), so it is
    exactly what a call of that shape grows the buffer to ask for. The FFN width does not enter:
    no symmetric region is FFN-wide (layer0's output and layer1's input live in ordinary device
    memory). Layer1's receive region dominates: min(topk, world) x tokens x hidden x element
    bytes (with tp_size t: min(topk, world / t) x t partial slots). The header (flags, call
    metadata; a few KiB) is separate.

    FP8 (dtype torch.float8_e4m3fn: FP8 token rows, x FP8 or dispatch_fp8): layer0's rows travel
    packed with their scales (comet/fp8_rows.h), layer1's partial rows in bfloat16 (the default
    out_dtype), as the ops size them."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    for name, v, low in (("tokens", tokens, 0), ("hidden", hidden, 0), ("topk", topk, 1),
                         ("num_experts", num_experts, 1), ("world", world, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"comet.buffers.symm.required_bytes: {name} must be an int >= {low}, "
                             f"got {v!r}")
    # The CPU backend accumulates float64 inputs' weights in float64 (ops_cpu.cpp), else float32.
    acc = 8 if dtype == torch.float64 else 4
    ops = (0, 1) if op is None else (op,)
    fp8 = dtype == torch.float8_e4m3fn

    def rows(o):  # (row elements, element bytes) of op o's token rows
        if fp8:
            return (int(_C.engine.fp8_row_bytes(hidden)), 1) if o == 0 else (hidden, 2)
        return hidden, dtype.itemsize

    return max(int(_C.engine.region_bytes(o, tokens, rows(o)[0], topk, num_experts, world,
                                          rows(o)[1], acc, ranks_per_node or 0,
                                          bool(node_reduce), tp_size_setting(tp_size, world)))
               for o in ops)


def header_bytes(world: int) -> int:
    """Bytes of a buffer's symmetric header per rank (flags and call metadata)."""
    return int(_C.engine.header_bytes(world))


def _env_number(name: str, default, kind=float):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"comet: ${name} must be a number, got {raw!r}") from None


def _link_settings(world, ranks_per_node, latency_us, gbps) -> tuple[int, float, float]:
    """(ranks_per_node, link latency in us, link GB/s) from the arguments, else the environment."""
    rpn = _env_number("COMET_CPU_RANKS_PER_NODE", world, int) if ranks_per_node is None \
        else ranks_per_node
    if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1 or world % rpn:
        raise ValueError(f"comet: ranks_per_node must divide the group size {world}, got {rpn!r}")
    lat = _env_number("COMET_CPU_LINK_LATENCY_US", 10.0) if latency_us is None else latency_us
    bw = _env_number("COMET_CPU_LINK_GBPS", 0.0) if gbps is None else gbps
    for name, v in (("link_latency_us", lat), ("link_gbps", bw)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
            raise ValueError(f"comet: {name} must be a number >= 0, got {v!r}")
    return int(rpn), float(lat), float(bw)


def node_reduce_setting(value) -> bool:
    """The node_reduce argument, else $COMET_NODE_REDUCE (0/1), else False."""
    if value is None:
        raw = os.environ.get("COMET_NODE_REDUCE", "")
        if raw not in ("", "0", "1"):
            raise ValueError(f"comet: $COMET_NODE_REDUCE must be 0 or 1, got {raw!r}")
        return raw == "1"
    if not isinstance(value, bool):
        raise ValueError(f"comet: node_reduce must be a bool, got {value!r}")
    return value


# The CPU backend's default sm_margin: 0, since its device is unlimited unless resident_blocks says
# otherwise (the CUDA default, comet.buffers.symm_cuda.DEFAULT_SM_MARGIN, is argued in docs/gpu.md).
CPU_SM_MARGIN = 0


def sm_margin_setting(value, default: int) -> int:
    """The sm_margin argument, else `default`: an int >= 0."""
    margin = default if value is None else value
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"comet: sm_margin must be an int >= 0 (SMs left free for other "
                         f"kernels), got {margin!r}")
    return margin


def heap_bytes_setting(value) -> int:
    """The heap_bytes argument, else $COMET_CPU_HEAP_BYTES, else 0 (no cap): an int >= 0."""
    cap = _env_number("COMET_CPU_HEAP_BYTES", 0, int) if value is None else value
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"comet: heap_bytes must be an int >= 0 (0: no cap), got {cap!r}")
    return cap


def _check_same_across_ranks(value, name, group, world):
    values = [None] * world
    dist.all_gather_object(values, value, group=group)
    if any(v != values[0] for v in values):
        raise ValueError(f"comet: {name} differs across the ranks of the group: {values}")


def _release(handle):
    forget_handle(handle)
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
