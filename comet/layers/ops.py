"""Python surface of torch.ops.comet.moe_layer0 / moe_layer1: fake kernels for tracing, the
`Layout` of a dispatch, and thin wrappers that pick the buffer and launch configuration and call
one op each. Input validation happens inside the op kernels (so direct torch.ops calls get it too)
and is exchanged between ranks, so a bad input on one rank raises on every rank."""
from __future__ import annotations

import dataclasses
import itertools
import os
import weakref

import torch

from comet.tune import perfmodel as pm
from comet.buffers import symm
from comet.formats import fp8 as _fp8
from comet.formats.fp8 import row_bytes as fp8_row_bytes
from comet.layers import activation as _act
from comet.layers import placed
from comet._native import _C  # noqa: F401  (registers the ops)

CPU_TILE = (32, 64)
CUDA_TILE = (128, 128)  # csrc/cuda/launch.h kTileMs[0] x kTileN
# Every tile the CUDA kernels are compiled for (kTileMs x kTileN): the tuner picks among them
# (comet.tune.model.small_tile: 64 rows for few rows per expert).
CUDA_TILES = ((128, 128), (64, 128))


@dataclasses.dataclass
class Layout:
    """Where every row of this rank's dispatch layout came from (output of moe_layer0, input of
    moe_layer1). Rows: by local expert, then source rank in ring order from this rank, then token,
    then slot.

    recv_counts [W, E_local] int32: rows from source rank s for local expert el.
    send_pos    [T, k] int32: position of this rank's slot (t, j) inside its expert's bucket at the
                destination (-1 for dropped slots).
    row_source, row_token, row_slot [M] int32: each row's (source rank, token, slot); [max_rows]
                when the call had a bound (rows >= M: -1 on the CPU backend).
    max_rows    the bound moe_layer0 was called with (-1: none); moe_layer1 passes it on, so h
                has max_rows rows too.
    tp_size     the call's expert tensor parallelism (1: none); moe_layer1 passes it on. With
                t > 1 the ring starts at this rank's EP rank's first rank, and the t ranks of one
                EP rank hold the same layout.
    """

    num_experts: int
    buffer: int
    topk_ids: torch.Tensor
    recv_counts: torch.Tensor
    send_pos: torch.Tensor
    row_source: torch.Tensor
    row_token: torch.Tensor
    row_slot: torch.Tensor
    max_rows: int = -1
    tp_size: int = 1
    # With a placement (comet/layers/placed.py): its compiled routes; num_experts, recv_counts and
    # topk_ids are then in the virtual slot space (W x S slots), and layer1 reduces by slot.
    routes: object = None
    # The moe_layer0 call that made it, numbered per process (0: unknown, e.g. a Layout built by
    # hand or while torch.compile traces): moe_layer1 names a y0 of another call passed as h.
    call: int = 0

    @property
    def world(self) -> int:
        return self.recv_counts.shape[0]

    @property
    def num_rows(self) -> int:
        """Rows of the row-indexed tensors (max_rows when the call had a bound, else M)."""
        return self.row_source.shape[0]

    @property
    def expert_counts(self) -> torch.Tensor:
        """Rows per local expert [E_local]."""
        return self.recv_counts.sum(0)

    @property
    def expert_offsets(self) -> torch.Tensor:
        """[E_local + 1] start row of each local expert."""
        counts = self.expert_counts.to(torch.int64)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def result_dtype(act, w, fp8_wire: bool = False, out_dtype=None) -> torch.dtype:
    """The dtype of a call's y0 / out: out_dtype, else bfloat16 when an input is FP8 (or goes FP8
    on the wire), else the activation's dtype (csrc/op_checks.h: result_dtype)."""
    if out_dtype is not None:
        return out_dtype
    fp8 = fp8_wire or act.dtype == torch.float8_e4m3fn or w.dtype == torch.float8_e4m3fn
    return torch.bfloat16 if fp8 else act.dtype


@torch.library.register_fake("comet::moe_layer0")
def _layer0_fake(x, w0, topk_ids, num_experts, buffer, n_comm, n_gemm, tile_m, tile_n, b0=None,
                 w0_transposed=False, max_rows=-1, tp_size=1, x_scale=None, w0_scale=None,
                 out_dtype=None, dispatch_fp8=False, activation=None, h_fp8=False, sm_margin=-1):
    world = symm.world_of_handle(buffer)
    ep = max(1, world // max(1, tp_size))
    # With a bound the shapes are static; without one M is data-dependent.
    rows = max_rows if max_rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    i32 = dict(dtype=torch.int32, device=x.device)
    fp8_rows = dispatch_fp8 or x.dtype == torch.float8_e4m3fn
    return (
        x.new_empty(rows, fp8_row_bytes(_act.out_cols(activation, w0.shape[2 if w0_transposed
                                                                     else 1])),
                    dtype=torch.uint8) if h_fp8 else
        x.new_empty(rows, _act.out_cols(activation, w0.shape[2 if w0_transposed else 1]),
                    dtype=result_dtype(x, w0, dispatch_fp8, out_dtype)),
        x.new_empty(rows, fp8_row_bytes(x.shape[1]), dtype=torch.uint8) if fp8_rows else
        x.new_empty(rows, x.shape[1]),
        torch.empty(world, num_experts // ep, **i32),
        torch.empty(topk_ids.shape, **i32),
        torch.empty(rows, **i32),
        torch.empty(rows, **i32),
        torch.empty(rows, **i32),
    )


@torch.library.register_fake("comet::moe_layer1")
def _layer1_fake(h, w1, topk_weights, topk_ids, send_pos, recv_counts, num_experts, buffer,
                 n_comm, n_gemm, tile_m, tile_n, b1=None, w1_transposed=False, max_rows=-1,
                 band_n=1, tp_size=1, h_scale=None, w1_scale=None, out_dtype=None,
                 sm_margin=-1):
    return h.new_empty(topk_ids.shape[0], w1.shape[2 if w1_transposed else 1],
                       dtype=result_dtype(h, w1, False, out_dtype))


# -- Launch configuration: the tuner's choice unless the caller says otherwise ---------------------
#
# Key: (arch, blocks, dtype, layer, W, E, k, H, N, token bucket), see comet.tune.tuner.TuneKey.
# * arch/blocks: the CUDA device's model name as comet.tune.tuner.detect_device spells it and its SM
#   count; on the CPU "cpu" and the per-rank thread budget ($COMET_CPU_BLOCKS, else
#   max(2, cores // W): the ranks of a group share one host's cores). n_gemm: 0 on the GPU (every
#   SM not used for comm), blocks - n_comm (at least 1) on the CPU.
# * W, E, k, H, N, dtype: the op checks that every rank agrees on them.
# * token bucket: the power of two >= the local token count T, or >= the count given to
#   set_tuning_tokens(). Ranks whose T fall into different buckets may pick different configs.
#   That is safe here: n_comm, n_gemm and the tile only shape a rank's own blocks and its own
#   readiness flags (layer0 M-tiles, layer1 N-tile columns); what crosses ranks (token rows pulled
#   from a peer's input, partial rows written into the home rank's receive buffer, one arrival
#   flag per rank) does not depend on them (and on the CPU backend results are bitwise the same
#   for any split and tile, see tests/test_ops_sim.py). It only costs speed (a collective runs at
#   its slowest rank). Should a protocol signal per tile across ranks (e.g. NVSHMEM puts with
#   per-tile signals between nodes), tiles must agree: set_tuning_tokens(T_max) with the same value
#   on every rank takes T out of the key, so every rank looks up the same entry.
# Cost: a few microseconds per call. The answer is memoised per shape here and reused while the
# process-wide Tuner still memoises it (its tune/store/clear drop that); under torch.compile it is
# taken at trace time (a constant of the graph; with dynamic shapes one graph per token bucket).

_tuning_tokens: int | None = None
_launch_memo: dict = {}
_cuda_arch: dict = {}
_cores: list = []


def _cpu_cores() -> int:
    if not _cores:  # os.cpu_count() costs microseconds: once per process
        _cores.append(os.cpu_count() or 2)
    return _cores[0]


def set_tuning_tokens(tokens: int | None) -> None:
    """Make the tuner's token bucket rank-independent: pick configs for `tokens` tokens per rank
    (e.g. the batch's maximum; the same value on every rank) instead of each rank's own count.
    None (the default) goes back to the local count."""
    global _tuning_tokens
    _tuning_tokens = None if tokens is None else max(0, int(tokens))


def _token_bucket(t) -> int:
    # Comparisons only, so a symbolic T under torch.compile guards on its bucket, not its value.
    b = 1
    while b < t:
        b *= 2
    return b


def _static_int(v) -> int:
    """v as a Python int; a symbolic size under torch.compile(dynamic=True) is specialised by
    comparisons (int() would stay symbolic there)."""
    if not torch.compiler.is_compiling():
        return int(v)
    lo, hi = 0, 1 << 31
    while lo < hi:
        mid = (lo + hi) // 2
        if v <= mid:
            hi = mid
        else:
            lo = mid + 1
    return lo


@torch.compiler.assume_constant_result
def launch_choice(device_type: str, device_index, layer: int, world: int, num_experts: int,
                  topk: int, hidden: int, n: int, token_bucket: int, dtype: str,
                  n_comm=None, tile=None, ranks_per_node=None, node_reduce=False, tp_size=1,
                  device_ranks=1):
    """(n_comm, n_gemm, tile_m, tile_n, source, band_n): launch_config's answer; source is the
    tuner's ("measured", "cache", "cache-nearest", "model", "default"), "explicit" when both were
    given, or "fallback" when the shape is not one the tuner handles (the op's checks then report
    it); band_n is layer1's band width (the tuner's; 1, column order, without one).
    device_ranks: ranks of the group on this GPU (a simulated world's W): the tuner splits the
    rank's share of the SMs, floor(SMs / device_ranks), as the kernels' grids do."""
    from comet.tune import tuner as tn

    cpu = device_type != "cuda"
    if cpu:
        env = os.environ.get("COMET_CPU_BLOCKS", "")
        blocks = int(env) if env.isdigit() and int(env) >= 2 else \
            max(2, _cpu_cores() // max(1, world))
        arch = "cpu"
    else:
        idx = torch.cuda.current_device() if device_index is None else int(device_index)
        if idx not in _cuda_arch:
            name = torch.cuda.get_device_name(idx)
            sms = torch.cuda.get_device_properties(idx).multi_processor_count
            _cuda_arch[idx] = (pm.spec_from_device_name(name) or tn._norm_arch(name), int(sms))
        arch, blocks = _cuda_arch[idx]
        blocks = max(1, blocks // max(1, int(device_ranks)))

    def done(nc, tl, source, band=1):
        nc = int(nc)
        return nc, (max(1, blocks - nc) if cpu else 0), int(tl[0]), int(tl[1]), source, int(band)

    default_tile = CPU_TILE if cpu else CUDA_TILE
    # CUDA without an explicit tile: the tuner's choice among the compiled tiles (a measurement's,
    # else the model's); the CPU backend runs any tile and keeps its default.
    choices = None if cpu else CUDA_TILES
    tuner = tn.default_tuner()
    raw = (arch, blocks, dtype, layer, world, num_experts, topk, hidden, n, token_bucket, n_comm,
           tile, ranks_per_node, node_reduce, tp_size)
    hit = _launch_memo.get(raw)
    # Valid while the tuner still memoises the same answer (tune/store/clear drop its memo); an
    # explicit config's answer (None: the model's band only) stays valid.
    if hit is not None and hit[1] is tuner and (hit[2] is None or
                                                hit[2] in getattr(tuner, "_memo", ())):
        return hit[0]
    try:
        key = tn.TuneKey(arch, blocks, dtype, world, num_experts, topk, hidden, n, token_bucket,
                         layer, ranks_per_node=ranks_per_node, node_reduce=node_reduce,
                         tp_size=tp_size)
        if n_comm is not None and tile is not None:
            # Both given: layer1 still runs the model's band for them (not column order).
            cfg, source = tn.Config(int(n_comm), *tile), "explicit"
            cfg.band_n = tuner.model_band(key, cfg.n_comm, cfg.tile)
        else:
            asked = tile or (None if choices else default_tile)
            cfg, source = tuner.choose(key, tile=asked, tiles=choices, explain=True)
    except Exception:  # noqa: BLE001 - never fail here: bad inputs are reported by the op itself
        nc = 1 if cpu else max(1, round(0.2 * blocks))
        return done(nc if n_comm is None else n_comm, tile or default_tile,
                    "explicit" if n_comm is not None and tile is not None else "fallback")
    if n_comm is not None and source != "explicit":
        source = "explicit n_comm"
        if int(n_comm) != cfg.n_comm:  # the tuner's band was for its own split
            cfg.band_n = tuner.model_band(key, int(n_comm), tile or cfg.tile)
    elif tile is not None and source != "explicit":
        source += ", explicit tile"
    result = done(cfg.n_comm if n_comm is None else n_comm, tile or cfg.tile, source, cfg.band_n)
    _launch_memo[raw] = (result, tuner, None if source == "explicit" else
                         (key, None, None, None, None if asked is None else tuple(asked),
                          choices))
    return result


def launch_config(device: torch.device, n_comm: int | None, tile: tuple[int, int] | None, *,
                  layer: int, world: int, num_experts: int, x, w, topk_ids,
                  w_transposed: bool = False, ranks_per_node: int | None = None,
                  node_reduce: bool = False, with_band: bool = False, tp_size: int = 1,
                  fp8: bool = False, device_ranks: int = 1):
    """(n_comm, n_gemm, tile_m, tile_n) for one call of moe_layer{layer}: the autotuner's choice
    (comet.tune.tuner: measured cache, else cost model) for this shape; explicit n_comm / tile win.
    with_band: also layer1's band_n (n-tiles per column band), the tuner's choice.

    layer0: x [T, H], w = w0 [E_local, N0, H]; layer1: x = h [M, N1], w = w1 [E_local, H, N1]
    (w_transposed: the last two dimensions swapped); topk_ids [T, k]. Malformed inputs get a
    fallback config (the op's checks report them). fp8: the call runs in FP8 (its dtype key is
    float8_e4m3fn whatever x's dtype). device_ranks: ranks of the group on this GPU
    (launch_choice).
    """
    pick = (lambda c: (*c[:4], c[5])) if with_band else (lambda c: c[:4])
    shaped = topk_ids.dim() == 2 and x.dim() == 2 and w.dim() == 3
    tokens = topk_ids.shape[0] if shaped else 0
    if _tuning_tokens is not None:
        tokens = _tuning_tokens
    # Under torch.compile with dynamic shapes this specialises on H, N and k (fixed per model),
    # while the token count only guards on its bucket.
    out_dim, in_dim = (2, 1) if w_transposed else (1, 2)
    hidden, n = ((x.shape[1], w.shape[out_dim]) if layer == 0 else
                 (w.shape[out_dim], w.shape[in_dim])) if shaped else (0, 0)
    return pick(launch_choice(device.type, device.index, layer, int(world), int(num_experts),
                              _static_int(topk_ids.shape[1]) if shaped else 0, _static_int(hidden),
                              _static_int(n), _token_bucket(tokens),
                              "float8_e4m3fn" if fp8 else str(x.dtype).replace("torch.", ""),
                              None if n_comm is None else int(n_comm),
                              None if tile is None else (int(tile[0]), int(tile[1])),
                              ranks_per_node, bool(node_reduce), int(tp_size),
                              int(device_ranks)))


def _buffer_for(buffer, group, t):
    """The explicit buffer, else the group's buffer of the backend t lives on (CUDA tensors: the
    NVSHMEM one of comet.buffers.symm_cuda when this build has CUDA kernels)."""
    if buffer is not None:
        return buffer
    # A plain dict read, which torch.compile traces (and guards on); the lookup that may create
    # the buffer is not traced (_group_buffer_key).
    return _GROUP_BUFFERS[_group_buffer_key(_group_name(group), t.device
                                            if isinstance(t, torch.Tensor) else None)]


def _group_name(group) -> str | None:
    """The group's name, which torch.compile can hand to _group_buffer_key as a constant (a
    ProcessGroup object it cannot: it traces one as an opaque fake)."""
    if group is None:
        return None
    if torch.compiler.is_compiling():
        # ranks and tag are what dynamo evaluates at trace time for a ProcessGroup (their group:
        # the first with these members and tag, the same members for comet's buffer)
        c10d = torch.distributed.distributed_c10d
        return c10d._resolve_group_name_by_ranks_and_tag(
            torch.distributed.get_process_group_ranks(group), c10d._get_group_tag(group))
    return group.group_name


# (backend, buffer handle) -> the buffer of a group, filled by _group_buffer_key.
_GROUP_BUFFERS: dict = {}


# Under torch.compile this runs while tracing instead of being traced (the registries' locks and
# the collective creation on first use cannot be), and its result is a constant of the graph:
# the calls without buffer= compile with fullgraph=True. A graph keeps the buffer it was traced
# with; a group's buffer lives as long as the process.
@torch.compiler.assume_constant_result
def _group_buffer_key(group_name, device) -> tuple:
    group = None if group_name is None else \
        torch.distributed.distributed_c10d._resolve_process_group(group_name)
    if device is not None and device.type == "cuda" and _C.with_cuda:
        from comet.buffers import symm_cuda

        buf, backend = symm_cuda.buffer_for(group, device), "cuda"
    else:
        buf, backend = symm.buffer_for(group), "cpu"
    key = (backend, int(buf.handle))
    _GROUP_BUFFERS[key] = buf  # the same object for the same key: no lock needed
    return key


def _same_device(buf: symm.Buffer, op: int, tensors: dict[str, torch.Tensor]) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            buf.fail_call(op, f"{'comet.moe_layer' + str(op)}: {name} is on {dev} but "
                              f"{next(iter(devices))} is on {first}; all inputs must share a device")
    if first.type == "cuda" and not _C.with_cuda:
        buf.fail_call(op, f"comet.moe_layer{op}: inputs are on {first} but this build of comet has "
                          "no CUDA kernels (rebuild with nvcc available and COMET_CUDA unset)")
    return first


def _is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn


# -- The wrappers' preamble: one for comet.moe_layer0/1 and comet.fp8's master-weight wrappers ----
#
# What a call resolves before its op runs: the buffer, every tensor the op reads on one device
# (a failure raises on every rank through fail_call, so peers never wait on a rank that stopped
# in Python), tp_size, the bound and the launch configuration.


@dataclasses.dataclass
class Call:
    """One wrapper call's preamble (layer0_call / layer1_call).

    buf     the group's buffer the call runs on;  cfg (n_comm, n_gemm, tile_m, tile_n);
    tp      the call's tp_size;  rows  the bound (max_rows, -1: none; layer1: the layout's);
    band_n  layer1's band width (n-tiles per column band; layer0: 1)."""

    buf: object
    cfg: tuple
    tp: int
    rows: int
    band_n: int = 1

    def layout(self, num_experts, topk_ids, outs) -> tuple[torch.Tensor, Layout]:
        """(y0, Layout) from the seven outputs of this layer0 call's op."""
        y0, _a, recv_counts, send_pos, rs, rt, rsl = outs
        call = _remember_y0(y0)
        return y0, Layout(int(num_experts), self.buf.handle, topk_ids, recv_counts, send_pos, rs,
                          rt, rsl, self.rows, self.tp, call=call)


# -- Which call a y0 came from ---------------------------------------------------------------------
#
# Calls of several micro-batches may interleave on one buffer (layer0 A, layer0 B, layer1 A,
# layer1 B): each call carries its whole state in its arguments, layer1's in the layout and h. What
# layer1 cannot check is that h was computed from the layout's y0. It can when h is itself a y0 (an
# identity or in-place activation): every live y0 is remembered by its storage, and a y0 of another
# call raises. A y0's storage is not reused while the y0 lives, and a dead y0 is forgotten.

_call_numbers = itertools.count(1)
_Y0_CALLS: dict[int, tuple[weakref.ref, int]] = {}  # y0's storage address -> (y0, its call)


def _storage_key(t) -> int:
    """The address of t's storage (0: none to go by: empty, meta, traced by torch.compile)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - no storage to go by (tensor subclasses, functorch wrappers)
        return 0


def _remember_y0(y0) -> int:
    """Numbers a layer0 call and remembers its y0 while it lives; returns the call's number."""
    if torch.compiler.is_compiling():
        return 0
    call, key = next(_call_numbers), _storage_key(y0)
    if key:
        def forget(ref, key=key):
            if _Y0_CALLS.get(key, (None,))[0] is ref:
                _Y0_CALLS.pop(key, None)

        _Y0_CALLS[key] = (weakref.ref(y0, forget), call)
    return call


def _y0_call(t) -> int:
    """The layer0 call whose y0 t is (or is a view of); 0: none comet knows of."""
    if torch.compiler.is_compiling():
        return 0
    ref, call = _Y0_CALLS.get(_storage_key(t), (None, 0))
    return call if ref is not None and ref() is not None else 0


def _describe(value) -> str:
    """What an error message calls a value passed where a Layout belongs."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], Layout):
        return (f"moe_layer0's whole result, a {type(value).__name__} (y0, Layout): pass its "
                f"second element (y0, layout = comet.moe_layer0(...))")
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} elements"
    return "None" if value is None else f"a {type(value).__name__}"


def call_buffer(buffer, group, t):
    """The buffer a layer0 call runs on: the explicit one, else the group's for t's device."""
    return _buffer_for(buffer, group, t)


def layer1_buffer(buffer, group, h, layout) -> object:
    """The buffer a layer1 call runs on, after what only the wrapper can check (each failure
    raises on every rank): layout is a Layout, produced on this buffer, and h is not the y0 of
    another layer0 call."""
    buf = _buffer_for(buffer, group, h)
    if not isinstance(layout, Layout):
        buf.fail_call(1, f"comet.moe_layer1: layout must be the comet.Layout moe_layer0 returned, "
                         f"got {_describe(layout)}", TypeError)
    if buf.handle != layout.buffer:
        buf.fail_call(1, "comet.moe_layer1: layout was produced on another buffer/group")
    made_by = _y0_call(h)
    if made_by and layout.call and made_by != layout.call:
        buf.fail_call(1, f"comet.moe_layer1: h is the y0 of moe_layer0 call {made_by} but the "
                         f"layout is call {layout.call}'s (calls numbered per process): pass "
                         "each call's layout with the h made from its own y0")
    return buf


def call_margin(buf, op: int, sm_margin) -> int:
    """A call's sm_margin for the op: -1 (the buffer's) when None; anything but an int fails the
    call on every rank (a negative int is the op's own check, on every rank too)."""
    if sm_margin is None:
        return -1
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int):
        buf.fail_call(op, f"comet.moe_layer{op}: sm_margin must be an int >= 0 (SMs left free "
                          f"for other kernels), got {sm_margin!r}", TypeError)
    return int(sm_margin)


def call_tp(buf, tp_size: int | None) -> int:
    """A layer0 call's tp_size: the caller's, else the buffer's (1 unless Buffer(tp_size=))."""
    return int(getattr(buf, "tp_size", 1) if tp_size is None else tp_size)


def layer0_call(buf, x, w0, topk_ids, *, num_experts: int, b0=None, w0_transposed: bool = False,
                max_rows: int | None = None, n_comm: int | None = None, tile=None,
                tp_size: int | None = None, fp8: bool = False, **scales) -> Call:
    """moe_layer0's preamble on `buf` (a placement call has gone its own way before): x, w0,
    topk_ids, b0 and `scales` (x_scale / w0_scale, when given) on one device, tp_size (default
    the buffer's), the bound, the launch configuration (fp8: the call runs in FP8)."""
    device = _same_device(buf, 0, {"x": x, "w0": w0, "topk_ids": topk_ids, "b0": b0, **scales})
    tp = call_tp(buf, tp_size)
    cfg = launch_config(device, n_comm, tile, layer=0, world=buf.world, num_experts=num_experts,
                        ranks_per_node=getattr(buf, "ranks_per_node", None),
                        x=x, w=w0, topk_ids=topk_ids, w_transposed=w0_transposed, tp_size=tp,
                        fp8=fp8, device_ranks=getattr(buf, "device_ranks", 1))
    return Call(buf, tuple(cfg), tp, -1 if max_rows is None else int(max_rows))


def layer1_call(buf, h, w1, topk_weights, layout: Layout, *, b1=None, w1_transposed: bool = False,
                n_comm: int | None = None, tile=None, band: int | None = None, fp8: bool = False,
                **scales) -> Call:
    """moe_layer1's preamble on `buf` (layer1_buffer checked the layout): h, w1, topk_weights,
    the layout's topk_ids, b1 and `scales` (h_scale / w1_scale) on one device, the launch
    configuration and band width (band: the caller's, else the tuner's); tp_size and the bound
    are the layout's."""
    device = _same_device(buf, 1, {"h": h, "w1": w1, "topk_weights": topk_weights,
                                   "topk_ids": layout.topk_ids, "b1": b1, **scales})
    cfg = launch_config(device, n_comm, tile, layer=1, world=buf.world,
                        ranks_per_node=getattr(buf, "ranks_per_node", None),
                        node_reduce=getattr(buf, "node_reduce", False),
                        num_experts=layout.num_experts, x=h, w=w1, topk_ids=layout.topk_ids,
                        w_transposed=w1_transposed, with_band=True,
                        tp_size=int(layout.tp_size), fp8=fp8,
                        device_ranks=getattr(buf, "device_ranks", 1))
    return Call(buf, tuple(cfg[:4]), int(layout.tp_size), int(layout.max_rows),
                cfg[4] if band is None else int(band))


def moe_layer0(x, w0, topk_ids, *, num_experts: int, b0=None, w0_transposed: bool = False,
               max_rows: int | None = None, group=None, n_comm: int | None = None,
               tile: tuple[int, int] | None = None, buffer: symm.Buffer | None = None,
               tp_size: int | None = None, x_scale=None, w0_scale=None,
               out_dtype: torch.dtype | None = None, dispatch_fp8: bool = False,
               placement=None, activation: str | None = None, h_fp8: bool = False,
               sm_margin: int | None = None):
    """Dispatch tokens to their experts' ranks fused with the first expert GEMM.

    x [T, H], w0 [E_local, N0, H] (or [E_local, H, N0] with w0_transposed=True, read as it is),
    topk_ids [T, k] (int32/int64, -1 = dropped slot), b0 [E_local, N0] an optional expert bias.
    max_rows: an upper bound on the rows any rank of the group receives (the same on every rank):
    the row-indexed outputs then have max_rows rows (static shapes, no host synchronisation on
    CUDA, CUDA-graph capturable); a call exceeding it raises on every rank.
    tp_size: expert tensor parallelism (default: the buffer's, 1 unless Buffer(tp_size=) says
    otherwise). The group is TP-innermost (rank r: EP rank r // t, tp rank r % t), w0 / b0 are
    this rank's shard [E / (W / t), N0 / t, H] / [E_local, N0 / t], and y0 [M, N0 / t] holds the
    rows routed to this rank's EP rank from all W ranks, in the same order on its t ranks.
    FP8 (comet.fp8, docs/api.md): x and/or w0 float8_e4m3fn with x_scale [T, ceil(H/128)] /
    w0_scale [E_local, ceil(N0/128), ceil(H/128)] float32; dispatch_fp8=True quantises a 16/32-bit
    x on the sending side (its rows travel as FP8 with their scales); y0 in out_dtype (default
    bfloat16 when FP8 is involved).
    placement: a comet.plan.Placement (default: the buffer's, else the contiguous map, today's
    bits; one built without world= completes to the group, Placement.for_world): w0 / b0 then
    hold this rank's E_r slots in ascending logical expert id, each (token, slot) goes to the
    replica the placement's route table names, and moe_layer1 reduces by slot, so out does not
    depend on the placement (comet/layers/placed.py; not with tp_size > 1). Gradients: each
    replica's w0 / b0 gradient covers only the rows it served; these ops do not sum over
    replicas (comet.nn.MoE does).
    activation: "swiglu" / "geglu" (w0 = [gate; up], N0 even: h [M, N0 / 2] = act(gate) * up)
    or "silu" / "gelu" (h [M, N0] = act(y0)), from the fp32 accumulators with b0 added, rounded
    once; returned in y0's place (docs/api.md). Fused into the GEMM's epilogue on the CPU
    backend, the sm_80 path's CUDA kernels (sm_80 / sm_86 / sm_89 and newer GPUs) and the sm_89
    FP8 kernel (gated forms: N0 a multiple of 128); applied after the op from the rounded y0
    elsewhere on CUDA (sm_90 GPUs; not fused there yet).
    h_fp8=True (with an activation): h comes quantised for an FP8 layer1, ((h float8_e4m3fn
    [M, F], h_scale float32 [M, ceil(F/128)]), Layout): quantize_rows' bits of the fp32 h,
    quantised in the epilogue (CPU backend and the CUDA kernels that fuse the activation; where
    the activation is applied after the op, quantize_rows of that h), not differentiable.
    sm_margin: SMs (CPU backend: resident-block slots) the call's kernels leave free for other
    kernels of the device that peers wait on (docs/gpu.md, "SM margin"); default the buffer's.
    Returns (y0 [M, N0] in the dispatch layout, or h with an activation, Layout).
    """
    buf = call_buffer(buffer, group, x)
    margin = call_margin(buf, 0, sm_margin)
    if h_fp8 and activation is None:
        buf.fail_call(0, "comet.moe_layer0: h_fp8=True quantises the fused activation's h: pass "
                         "activation= too")
    if activation is not None and _unfused_activation(x, w0, w0_transposed, activation,
                                                      dispatch_fp8, h_fp8):
        h, layout = _activated_after(buf, activation, x, w0, w0_transposed, lambda: moe_layer0(
            x, w0, topk_ids, num_experts=num_experts, b0=b0, w0_transposed=w0_transposed,
            max_rows=max_rows, group=group, n_comm=n_comm, tile=tile, buffer=buffer,
            tp_size=tp_size, x_scale=x_scale, w0_scale=w0_scale, out_dtype=out_dtype,
            dispatch_fp8=dispatch_fp8, placement=placement, sm_margin=sm_margin))
        return (_fp8.quantize_rows(h.float()) if h_fp8 else h), layout
    if placement is None:
        placement = getattr(buf, "placement", None)
    if placement is not None:
        _no_fp8_with_placement(buf, 0, x_scale=x_scale, w0_scale=w0_scale, out_dtype=out_dtype,
                               dispatch_fp8=dispatch_fp8 or None)
        if h_fp8:
            _no_fp8_with_placement(buf, 0, h_fp8=True)
        return _placed_layer0(buf, x, w0, topk_ids, num_experts, b0, w0_transposed, max_rows,
                              n_comm, tile, tp_size, placement, activation, margin)
    c = layer0_call(buf, x, w0, topk_ids, num_experts=num_experts, b0=b0,
                    w0_transposed=w0_transposed, max_rows=max_rows, n_comm=n_comm, tile=tile,
                    tp_size=tp_size, fp8=bool(dispatch_fp8) or _is_fp8(x), x_scale=x_scale,
                    w0_scale=w0_scale)
    h, layout = c.layout(num_experts, topk_ids, torch.ops.comet.moe_layer0(
        x, w0, topk_ids, int(num_experts), buf.handle, *c.cfg, b0, bool(w0_transposed), c.rows,
        c.tp, x_scale=x_scale, w0_scale=w0_scale, out_dtype=out_dtype,
        dispatch_fp8=bool(dispatch_fp8), activation=activation, h_fp8=bool(h_fp8),
        sm_margin=margin))
    if h_fp8:  # the packed rows as layer1 takes them: values and their scales
        n0 = w0.shape[2 if w0_transposed else 1]
        return _fp8.unpack_rows(h, _act.out_cols(activation, n0)), layout
    return h, layout


def _unfused_activation(x, w0, w0_transposed, activation, dispatch_fp8, h_fp8) -> bool:
    """Whether the op cannot fuse the activation of this call (csrc/cuda/ops_cuda.cpp refuses it
    there, the same rule): on CUDA the sm_80 path's kernels (sm_80 / sm_86 / sm_89 and newer
    GPUs) and the sm_89 FP8 kernel fuse it, h_fp8 included, and the sm_90a 16-bit kernels without
    h_fp8; on an sm_90 GPU h_fp8 and FP8 operands are not fused (yet), nor anywhere a gated form
    in FP8 whose F = N0 / 2 is not a multiple of 64."""
    if not (isinstance(x, torch.Tensor) and x.device.type == "cuda"):
        return False
    fp8 = bool(dispatch_fp8) or _is_fp8(x) or _is_fp8(w0)
    if (fp8 or h_fp8) and torch.cuda.get_device_capability(x.device)[0] == 9:
        return True
    shaped = isinstance(w0, torch.Tensor) and w0.dim() == 3
    n0 = w0.shape[2 if w0_transposed else 1] if shaped else 0
    return fp8 and activation in _act.GATED and n0 % 128 != 0


def _activated_after(buf, activation, x, w0, w0_transposed, layer0):
    """The activation applied after a plain layer0 call (`layer0()`), where the op does not fuse
    it: the same checks first (a failure raises on every rank), then act(y0) from the rounded y0
    (one rounding more than the fused epilogue)."""
    shaped = isinstance(w0, torch.Tensor) and w0.dim() == 3
    why = _act.problem(activation, w0.shape[2 if w0_transposed else 1] if shaped else 0)
    if why is not None:
        buf.fail_call(0, f"comet.moe_layer0: {why}")
    y0, layout = layer0()
    return _act.apply(activation, y0), layout


def moe_layer1(h, w1, topk_weights, layout: Layout, *, b1=None, w1_transposed: bool = False,
               group=None, n_comm: int | None = None, tile: tuple[int, int] | None = None,
               buffer: symm.Buffer | None = None, band: int | None = None, h_scale=None,
               w1_scale=None, out_dtype: torch.dtype | None = None,
               sm_margin: int | None = None):
    """Second expert GEMM fused with the weighted top-k reduce and the combine back home.

    h [M, N1] in `layout`'s dispatch layout ([max_rows, N1] when layer0 had a bound), w1
    [E_local, H, N1] (or [E_local, N1, H] with w1_transposed=True), topk_weights [T, k] (float32
    or h's dtype), b1 [E_local, H] an optional expert bias (weighted per slot like the rest).
    band: n-tiles per column band of the GEMM (h is read once per band; 0 = all n-tiles), default
    the tuner's; the result does not depend on it.
    With the layout's tp_size t > 1, h [M, N1 / t] and w1 [E_local, H, N1 / t] are this rank's
    shard; out is the full sum over the t shards and the top-k slots (b1 added once).
    FP8: h and/or w1 float8_e4m3fn with h_scale [rows of h, ceil(N1/128)] / w1_scale [E_local,
    ceil(H/128), ceil(N1/128)] float32; out in out_dtype (default bfloat16 when FP8 is involved).
    sm_margin: as moe_layer0's (default the buffer's).
    Returns out [T, H] on every rank for its own tokens.
    """
    buf = layer1_buffer(buffer, group, h, layout)
    margin = call_margin(buf, 1, sm_margin)
    if layout.routes is not None:
        _no_fp8_with_placement(buf, 1, h_scale=h_scale, w1_scale=w1_scale, out_dtype=out_dtype)
        return _placed_layer1(buf, h, w1, topk_weights, layout, b1, w1_transposed, n_comm, tile,
                              band, margin)
    c = layer1_call(buf, h, w1, topk_weights, layout, b1=b1, w1_transposed=w1_transposed,
                    n_comm=n_comm, tile=tile, band=band, fp8=_is_fp8(h), h_scale=h_scale,
                    w1_scale=w1_scale)
    return torch.ops.comet.moe_layer1(h, w1, topk_weights, layout.topk_ids, layout.send_pos,
                                      layout.recv_counts, layout.num_experts, buf.handle, *c.cfg,
                                      b1, bool(w1_transposed), c.rows, c.band_n, c.tp,
                                      h_scale=h_scale, w1_scale=w1_scale, out_dtype=out_dtype,
                                      sm_margin=margin)


# -- With a placement (comet/layers/placed.py: the virtual slot space and the reduction by slot) --

def _placed_routes(buf, op: int, placement, num_experts: int, tp: int):
    """Checks what a placement call needs that the engine cannot see (each failure raises on every
    rank through fail_call) and returns the compiled routes."""
    from comet.plan.placement import Placement

    name = f"comet.moe_layer{op}"
    if not isinstance(placement, Placement):
        buf.fail_call(op, f"{name}: placement must be a comet.plan.Placement, got "
                          f"{type(placement).__name__}")
    try:  # a placement built without world= completes to the group (Placement.for_world)
        placement = placement.for_world(buf.world)
    except ValueError as e:
        buf.fail_call(op, f"{name}: {e}")
    if int(num_experts) != placement.num_experts:
        buf.fail_call(op, f"{name}: num_experts={int(num_experts)} but the placement places "
                          f"{placement.num_experts} experts")
    if tp < 1:
        buf.fail_call(op, f"{name}: tp_size must be >= 1 (1: no expert tensor parallelism), "
                          f"got {tp}")
    if tp != 1:
        buf.fail_call(op, f"{name}: tp_size={tp} > 1 is not supported with a placement "
                          "(expert tensor parallelism needs the contiguous map)")
    return placed.placed_routes(placement, buf.rank, getattr(buf, "ranks_per_node", None))


def _check_slots(buf, op: int, routes, name: str, w) -> None:
    if w is not None and (w.dim() < 1 or w.shape[0] != routes.local):
        buf.fail_call(op, f"comet.moe_layer{op}: {name} has {w.shape[0] if w.dim() else 0} "
                          f"experts but the placement gives rank {buf.rank} E_r={routes.local} "
                          f"slots (experts {list(routes.placement.local_experts(buf.rank))})")


def _placed_layer0(buf, x, w0, topk_ids, num_experts, b0, w0_transposed, max_rows, n_comm, tile,
                   tp_size, placement, activation=None, sm_margin=-1):
    tp = call_tp(buf, tp_size)
    routes = _placed_routes(buf, 0, placement, num_experts, tp)
    _check_slots(buf, 0, routes, "w0", w0)
    _check_slots(buf, 0, routes, "b0", b0)
    # On the CPU a host check names the logical id; on CUDA (no host sync) virtual_ids maps an id
    # >= E out of the virtual range, which the kernels' own check rejects on every rank.
    if isinstance(topk_ids, torch.Tensor) and topk_ids.numel() and \
            not topk_ids.is_floating_point() and topk_ids.device.type == "cpu":
        top = int(topk_ids.max())
        if top >= routes.placement.num_experts:
            buf.fail_call(0, f"comet.moe_layer0: topk_ids holds expert {top}, out of range for "
                             f"num_experts={routes.placement.num_experts}")
    ids = placed.virtual_ids(routes, topk_ids) if isinstance(topk_ids, torch.Tensor) and \
        not topk_ids.is_floating_point() else topk_ids
    buf.set_call_tag(routes.fingerprint)
    try:
        y0, layout = moe_layer0(x, placed.pad_slots(w0, routes), ids,
                                num_experts=routes.num_virtual, b0=placed.pad_slots(b0, routes),
                                w0_transposed=w0_transposed, max_rows=max_rows, n_comm=n_comm,
                                tile=tile, buffer=_Placed(buf), tp_size=1,
                                activation=activation, sm_margin=sm_margin)
    finally:
        buf.set_call_tag(0)
    layout.routes = routes
    return y0, layout


def _placed_layer1(buf, h, w1, topk_weights, layout, b1, w1_transposed, n_comm, tile, band,
                   sm_margin=-1):
    routes = layout.routes
    _check_slots(buf, 1, routes, "w1", w1)
    _check_slots(buf, 1, routes, "b1", b1)
    T, k = layout.topk_ids.shape
    if not (isinstance(topk_weights, torch.Tensor) and tuple(topk_weights.shape) == (T, k)):
        shape = tuple(topk_weights.shape) if isinstance(topk_weights, torch.Tensor) else None
        buf.fail_call(1, f"comet.moe_layer1: topk_weights has shape {shape}, expected {(T, k)}")
    # The T * k (token, slot) pairs as tokens of one slot each: the same flat slot order as
    # layer0's send plan, so send_pos and the dispatch layout carry over unchanged.
    one = dataclasses.replace(layout, topk_ids=layout.topk_ids.reshape(T * k, 1),
                              send_pos=layout.send_pos.reshape(T * k, 1), routes=None)
    buf.set_call_tag(routes.fingerprint)
    try:
        out_slots = moe_layer1(h, placed.pad_slots(w1, routes), topk_weights.reshape(T * k, 1),
                               one, b1=placed.pad_slots(b1, routes), w1_transposed=w1_transposed,
                               n_comm=n_comm, tile=tile, buffer=_Placed(buf), band=band,
                               sm_margin=sm_margin)
    finally:
        buf.set_call_tag(0)
    return placed.sum_by_slot(out_slots, T, k, out_slots.dtype)


class _Placed:
    """buf as the plain ops see it inside a placement call: without its default placement (the
    call is already in the virtual slot space). The call tag is set around the forward calls
    only; the ops' backward calls run with tag 0 on every rank alike."""

    def __init__(self, buf):
        self._buf = buf

    def __getattr__(self, name):
        if name == "placement":
            raise AttributeError(name)
        return getattr(self._buf, name)


def _no_fp8_with_placement(buf, op: int, **fp8_args) -> None:
    """FP8 runs on the contiguous map only: a placement call with FP8 arguments fails on every
    rank."""
    given = sorted(name for name, v in fp8_args.items() if v is not None)
    if given:
        buf.fail_call(op, f"comet.moe_layer{op}: FP8 ({', '.join(given)}) with a placement is not "
                          "supported (FP8 runs on the contiguous map)")
