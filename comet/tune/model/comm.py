"""The comm blocks' time in the cost model (comet.tune.perfmodel), in one node and across nodes.

Comm (alpha-beta, :func:`comm_time`): a comm block moves ``block_link_gbs`` over the link (what one
SM can keep in flight: Little's law, bytes in flight / remote latency), so the link bandwidth grows
linearly with ``n_comm`` until it saturates at the achievable link bandwidth
``link_gbs * link_eff``; likewise for the HBM-side work at ``2 * hbm / sm_count`` per block, capped
at ``hbm * hbm_eff``::

    remote(n) = remote_bytes / min(n * b_link, B_link),   local(n) = local_bytes / min(n * b_hbm, B_hbm)
    layer0: comm(n) = alpha + local(n) + remote(n)        (ring order: local copy, then the pulls)
    layer1: comm(n) = alpha + max(local(n), remote(n)) + final sum of partials at full HBM rate
                                                          (read, reduce, store: one stream)

It is non-increasing in ``n`` and constant from :func:`comm_saturation_blocks` on.

Over several nodes a block also moves ``block_nic_bw`` over the NIC (Little's law with the NIC's
round trip ``2 * nic_latency_us`` and, an assumption until the node-first kernel is measured, the
same 24 KiB in flight as its copy loop: 4.1 GB/s on the sm90 path), capped at ``nic_gbs *
nic_eff``.  The NIC part is ``nic(n) = nic_alpha + nic_bytes / min(n * b_nic, B_nic)``; the
NVLink part covers same-node rows and mirror reads (:func:`comm_split` reports both)::

    layer0: comm(n) = max(alpha + local(n) + same(n) + fan(n),          (the pull stream)
                          nic_alpha + nic(n) + fan(n) / R, nic_alpha + nic(n) / R + fan(n))
    layer1: comm(n) = max(alpha, nic_alpha) + max(local(n), same(n), nic(n)) + combine

with ``R = W - P`` remote sources.  Max, not sum: the NIC's DMA moves the rows a sender posted
while the comm blocks load from HBM and NVLink (separate links, separate windows), and layer1's
stores and puts are one stream like its HBM reads.  The fan-out of a remote node's rows can start
only when they have arrived, hence the two NIC terms (the last of R equal NIC chunks still has to
be fanned out; or all of the fan-out follows the first chunk).  The pipeline below orders layer0's
tiles local, same-node sources, then other nodes' sources, each released when the NIC delivered it.

More nodes at fixed ``W`` never lower the flat all-to-all's or layer1's predicted comm (rows move
from NVLink to the slower NIC).  With node-first dispatch they can, where the NIC is not the
bottleneck: the relay serves ``1 / P`` of a remote node's slot rows from its own memory and the
NIC's DMA adds bandwidth, so when ``k`` slots per token collapse into few NIC rows (k >= 4 on
H800's 160 GB/s NVLink vs 40 GB/s NIC, few comm blocks) 2 x 8 ranks can beat a hypothetical
16-rank NVLink domain, whose path pulls every slot row over NVLink (no per-rank dedup).

A TP shape's path (comet.tune.model.tp) is chosen here (:func:`choose_tp_path`): each path's comm
alone on the whole GPU, which is what this module computes.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, NamedTuple, Tuple

from .fp8 import _out_row_bytes
from .gemm import DEFAULT_TILE
from .hardware import GpuSpec
from .nodes import block_nic_rate, node_traffic
from .one_node import local_rows, remote_rows
from .shape import TP_PATHS, MoEShape, _check_layer, _link_elem_bytes, expert_rows
from .tp import TP_PATH_SLACK, _tp_combine_partials, _tp_hops, _tp_staging_bytes, tp_traffic

# The per-call prologue and the combine launch (seconds), estimated from the kernels' structure
# (csrc/cuda/prologue.cu, combine.cu; docs/design.md, "The per-call prologue"), not measured:
#   layer0: source kernel (send plan: count, scan (2 grid barriers), offsets, scatter: ~5 grid
#           barriers), begin kernel (metadata exchange: ~2 peer round trips), publish kernel
#           (m-tiles + layer0 order: ~6 grid barriers): 3 launches, ~11 grid barriers;
#   layer1: source (pair lists: ~5), begin, publish (m-tiles ~4 + reduce plan ~6): ~15 barriers,
#           plus the combine kernel's launch after the fused kernel.
# A grid barrier is an atomic arrival through L2 and a spin on the generation flag; each thread
# handles ~T*k/P elements (P = prologue threads, 4096 elements per block), a few passes. A
# prologue grid of one block (up to 4096 routing slots: every decode size) skips all that: its
# barriers are the block's own (comet/parallel.h, grid_sync), charged BLOCK_BARRIER_S.
KERNEL_GAP_S = 3e-6     # back-to-back launch on one stream (assumption)
GRID_BARRIER_S = 1.5e-6  # one grid-wide barrier of a multi-block prologue kernel (assumption)
BLOCK_BARRIER_S = 5e-8   # a grid barrier of a one-block grid: one __syncthreads (assumption)
PROLOGUE_ITEMS_PER_BLOCK = 4096  # 256 threads x 16 items (csrc/cuda/ops_cuda.cpp, prologue_blocks)
PROLOGUE_BARRIERS = {0: 11, 1: 15}
PROLOGUE_LAUNCHES = {0: 3, 1: 3}
# The call's other stream operations before its fused kernel (csrc/cuda/ops_cuda.cpp; docs/design.md,
# "Launches per call on CUDA"): each op's source data copies into the symmetric buffer and its
# flag clears run as one kernel (csrc/cuda/stream_copies.cu; before it, 5 device copies and 2
# memsets, each its own stream operation). dispatch_fp8 adds its quantise-and-pack kernel to
# layer0; the table's FP8 rows assume x quantised by the caller. Each stream operation is charged
# a launch gap like a kernel's (assumption, not measured). The decode model charges them
# (stream_ops_time); prologue_time, which the tuner's split and the throughput tables use, does
# not yet (a constant per call: it moves no split).
STREAM_OP_S = KERNEL_GAP_S
PROLOGUE_STREAM_OPS = {0: 1, 1: 1}


class _Parts(NamedTuple):
    """Seconds of the comm work of one layer with ``n_comm`` blocks, by stream."""

    alpha: float  # NVLink latency (first peer row visible), 0 when nothing crosses NVLink
    local_s: float  # HBM-side work inside this GPU (local rows; layer1: read GEMM rows, partials)
    remote_s: float  # same-node peers over NVLink
    tail: float  # after the kernel: layer1's combine
    nic_alpha: float = 0.0  # NIC latency, 0 when nothing crosses nodes
    nic_s: float = 0.0  # rows over the NIC
    fan_s: float = 0.0  # layer0 node-first: mirror reads (NVLink) and own-mirror copies (HBM);
                        # layer1 node-reduced: stores into the relays' stages (NVLink / HBM)
    far_sources: int = 0  # ranks on other nodes (the chunks of the NIC stream)
    relay_s: float = 0.0  # layer1 node-reduced: the relays' NIC puts, in the tail


def _comm_parts(shape: MoEShape, spec: GpuSpec, n_comm: int, layer: int) -> _Parts:
    """The streams of ``layer``'s comm work for ``n_comm`` blocks (see :func:`comm_time`)."""
    _check_layer(layer)
    if n_comm < 1:
        raise ValueError(f"n_comm must be >= 1, got {n_comm}")
    eb = _link_elem_bytes(shape, layer)
    tr = node_traffic(shape, layer)
    r_bytes = tr.same_node * shape.H * eb
    if layer == 0:
        # local rows: read from this rank's input, written into the shared tensor
        l_bytes = 2.0 * tr.local * shape.row_bytes
        tail = 0.0
    else:
        # read every GEMM output row, write the local partials
        m = sum(expert_rows(shape))
        l_bytes = m * _out_row_bytes(shape) + tr.local * shape.H * eb
        # the home rank sums its partials (local + received) at full HBM bandwidth
        # (the combine kernel, after the fused kernel, on every SM: full HBM rate plus a launch)
        tail = combine_time(shape, spec)
    if shape.tp_size > 1:
        l_bytes += _tp_staging_bytes(shape, layer)
    link_bw = min(n_comm * block_link_rate(shape, spec, layer), spec.link_bw)
    hbm_bw = min(n_comm * spec.block_hbm_bw, spec.hbm_bw)
    remote_s = r_bytes / link_bw if r_bytes > 0 else 0.0
    local_s = l_bytes / hbm_bw if l_bytes > 0 else 0.0
    if shape.nodes == 1:
        alpha = spec.alpha * _tp_hops(shape) if r_bytes > 0 else 0.0
        return _Parts(alpha, local_s, remote_s, tail)
    nic_bytes = tr.nic * shape.H * eb
    fan_nvl = tr.fanout_nvlink * shape.H * eb
    # layer0: own mirror -> shared tensor (read + write); layer1: store into the own stage
    fan_loc = (2.0 if layer == 0 else 1.0) * tr.fanout_local * shape.H * eb
    nic_bw = min(n_comm * block_nic_rate(shape, spec, layer), spec.nic_bw)
    nic_s = nic_bytes / nic_bw if nic_bytes > 0 else 0.0
    fan_s = (fan_nvl / link_bw if fan_nvl > 0 else 0.0) + (fan_loc / hbm_bw if fan_loc > 0 else 0.0)
    alpha = spec.alpha * _tp_hops(shape) if r_bytes > 0 or fan_nvl > 0 else 0.0
    nic_alpha = spec.nic_alpha if nic_bytes > 0 else 0.0
    if layer == 1 and shape.node_reduce:
        # The relay step runs in the combine kernel on every SM (full NIC rate): read the staged
        # rows (as many as this rank's node stages for it, F by symmetry), put the sums.
        staged = (tr.fanout_nvlink + tr.fanout_local) * shape.H * eb
        relay = (nic_alpha + (nic_bytes / spec.nic_bw if nic_bytes > 0 else 0.0)
                 + staged / spec.hbm_bw)
        # the stores into the stages join this rank's NVLink and HBM streams
        return _Parts(alpha, local_s + (fan_loc / hbm_bw if fan_loc > 0 else 0.0),
                      remote_s + (fan_nvl / link_bw if fan_nvl > 0 else 0.0), tail + relay,
                      far_sources=shape.W - shape.ranks_per_node, relay_s=relay)
    return _Parts(alpha, local_s, remote_s, tail, nic_alpha, nic_s, fan_s,
                  shape.W - shape.ranks_per_node)


def combine_time(shape: MoEShape, spec: GpuSpec) -> float:
    """layer1's combine kernel: read every partial (activation dtype) of this rank's tokens and
    write the output, on all SMs at the achievable HBM rate, after one launch gap."""
    shape = resolve_tp_path(shape, spec, 1)
    if shape.tp_size > 1:
        n_partials = _tp_combine_partials(shape)
    else:
        n_partials = local_rows(shape, 1) + remote_rows(shape, 1)
    eb = _link_elem_bytes(shape, 1)
    return KERNEL_GAP_S + (n_partials * shape.H * eb + shape.T * _out_row_bytes(shape)) / spec.hbm_bw


def prologue_time(shape: MoEShape, spec: GpuSpec, layer: int) -> float:
    """The per-call prologue kernels before the fused kernel (an estimate, see the constants):
    launches, grid barriers, two peer round trips of the metadata exchange (over the NIC when
    the group spans nodes), and each prologue thread's share of the T*k routing slots (a few
    passes at ~0.05 us per element)."""
    _check_layer(layer)
    threads = prologue_grid(shape) * 256
    per_thread = 3 * math.ceil(shape.T * shape.k / threads) * 0.05e-6
    alpha = spec.alpha if shape.nodes == 1 else max(spec.alpha, spec.nic_alpha)
    return prologue_launches_and_barriers(shape, layer) + 2 * alpha + per_thread


def prologue_launches_and_barriers(shape: MoEShape, layer: int) -> float:
    """The part of prologue_time that folding the prologue into the fused kernel would remove:
    its kernels' launch gaps and grid barriers (their work and round trips stay)."""
    _check_layer(layer)
    return (PROLOGUE_LAUNCHES[layer] * KERNEL_GAP_S
            + PROLOGUE_BARRIERS[layer] * barrier_time(prologue_grid(shape)))


def prologue_grid(shape: MoEShape) -> int:
    """Blocks of the prologue kernels' grids: one per PROLOGUE_ITEMS_PER_BLOCK routing slots (the
    source kernel's rule; the m-tile and row counts of the other two are of the same order under
    uniform routing, so the model gives all three this grid)."""
    return max(1, math.ceil(shape.T * shape.k / PROLOGUE_ITEMS_PER_BLOCK))


def barrier_time(blocks: int) -> float:
    """One grid barrier of a prologue grid of ``blocks`` blocks: GRID_BARRIER_S, or a block
    barrier's BLOCK_BARRIER_S for one block (comet/parallel.h, grid_sync)."""
    return GRID_BARRIER_S if blocks > 1 else BLOCK_BARRIER_S


def stream_ops_time(layer: int) -> float:
    """Seconds of ``layer``'s memsets and device copies on the stream (PROLOGUE_STREAM_OPS at
    STREAM_OP_S each)."""
    _check_layer(layer)
    return PROLOGUE_STREAM_OPS[layer] * STREAM_OP_S


def block_link_rate(shape: MoEShape, spec: GpuSpec, layer: int) -> float:
    """Bytes/s one comm block moves over the link for ``layer``. layer0: per m-tile a block first
    resolves the rows' origins (two dependent peer index loads, all rows of the tile at once),
    then streams the tile's rows at spec.block_link_bw: tile_bytes / (tile_bytes / rate + 2 round
    trips). layer1: spec.block_link_bw (stores of partials, no index round trips per tile)."""
    rate = spec.block_link_bw
    if layer == 1:
        return rate
    tile_bytes = DEFAULT_TILE[0] * shape.row_bytes
    return tile_bytes / (tile_bytes / rate + 2 * spec.remote_load_us * 1e-6)


def _layer0_stream(p: _Parts) -> float:
    """layer0's comm alone, from its streams.  One node: the local copy, then the pulls from the
    peers in ring order (they add).  Several nodes: the sender's NIC pushes overlap the
    destination's pulls (the NIC's DMA moves the rows while the comm blocks load from HBM and
    NVLink: separate links, so max, not sum); a remote node's rows can be read from the mirror only
    once they have arrived, so with ``R`` equal chunks on the NIC the pull stream ends no earlier
    than ``nic + fan / R`` (the last chunk's fan-out) nor ``nic / R + fan`` (all fan-out after the
    first chunk)."""
    pull = p.alpha + (p.local_s + p.remote_s + p.fan_s)
    if p.far_sources == 0:
        return pull
    r = p.far_sources
    return max(pull, p.nic_alpha + p.nic_s + p.fan_s / r, p.nic_alpha + p.nic_s / r + p.fan_s)


def _layer1_stream(p: _Parts) -> Tuple[float, float]:
    """(latency, streaming seconds) of layer1's comm: a block reads a GEMM output row, reduces it
    and stores the partial to its home (NVLink) or posts it to the NIC (other nodes) in one
    stream: HBM reads, NVLink stores and NIC puts overlap (max)."""
    if p.far_sources == 0:
        return p.alpha, max(p.local_s, p.remote_s)
    return max(p.alpha, p.nic_alpha), max(p.local_s, p.remote_s, p.nic_s)


def comm_time(shape: MoEShape, spec: GpuSpec, n_comm: int, layer: int) -> float:
    """Seconds the comm part of ``layer`` takes with ``n_comm`` blocks, alone (alpha-beta)."""
    shape = resolve_tp_path(shape, spec, layer)
    p = _comm_parts(shape, spec, n_comm, layer)
    if layer == 0:
        return _layer0_stream(p) + p.tail
    lat, body = _layer1_stream(p)
    return lat + body + p.tail


def comm_split(shape: MoEShape, spec: GpuSpec, n_comm: int, layer: int) -> Dict[str, float]:
    """The two links' parts of :func:`comm_time`, each alone with ``n_comm`` blocks:
    ``intra`` (NVLink: latency + same-node rows + mirror reads over NVLink), ``inter`` (NIC:
    latency + rows over the NIC), and the row counts ``intra_rows``, ``inter_rows``."""
    shape = resolve_tp_path(shape, spec, layer)
    p = _comm_parts(shape, spec, n_comm, layer)
    tr = node_traffic(shape, layer)
    eb = _link_elem_bytes(shape, layer)
    link_bw = min(n_comm * block_link_rate(shape, spec, layer), spec.link_bw)
    nvl_bytes = tr.nvlink * shape.H * eb
    intra = (p.alpha + nvl_bytes / link_bw) if nvl_bytes > 0 else 0.0
    inter = p.nic_alpha + p.nic_s + p.relay_s
    return {"intra": intra, "inter": inter, "intra_rows": tr.nvlink, "inter_rows": tr.nic}


def comm_saturation_blocks(shape: MoEShape, spec: GpuSpec, layer: int) -> int:
    """Smallest ``n_comm`` from which :func:`comm_time` no longer decreases (it is constant after)."""
    _check_layer(layer)
    shape = resolve_tp_path(shape, spec, layer)
    hi = max(1, math.ceil(spec.link_bw / block_link_rate(shape, spec, layer) - 1e-9),
             math.ceil(spec.hbm_bw / spec.block_hbm_bw - 1e-9))
    if shape.nodes > 1:
        hi = max(hi, math.ceil(spec.nic_bw / block_nic_rate(shape, spec, layer) - 1e-9))
    floor = comm_time(shape, spec, hi, layer)
    for n in range(1, hi + 1):  # comm_time is non-increasing: the first n at the floor
        if comm_time(shape, spec, n, layer) <= floor * (1 + 1e-12):
            return n
    return hi


def choose_tp_path(shape: "MoEShape", spec: "GpuSpec", layer: int) -> str:
    """The TP path whose comm, alone on the whole GPU, is shorter: "group" where it is shorter
    by more than TP_PATH_SLACK, else "direct" (also without TP)."""
    if shape.tp_size == 1:
        return "direct"
    t = {path: comm_time(replace(shape, tp_path=path), spec, spec.max_blocks, layer)
         for path in TP_PATHS}
    return "group" if t["group"] < t["direct"] * (1 - TP_PATH_SLACK) else "direct"


def resolve_tp_path(shape: "MoEShape", spec: "GpuSpec", layer: int) -> "MoEShape":
    """``shape`` with its TP path set (the model's choice where it is None)."""
    if shape.tp_size == 1 or shape.tp_path is not None:
        return shape
    return replace(shape, tp_path=choose_tp_path(shape, spec, layer))


def tp_alternatives(shape: "MoEShape", spec: "GpuSpec", layer: int) -> Dict[str, Dict[str, float]]:
    """Both TP paths side by side: per path the rows over NVLink and over the NIC, the HBM copy
    rows and the comm alone on the whole GPU (seconds)."""
    out = {}
    for path in TP_PATHS:
        s = replace(shape, tp_path=path)
        tr = tp_traffic(s, layer)
        out[path] = {"nvlink_rows": tr.nvlink, "nic_rows": tr.nic, "local_rows": tr.local,
                     "comm_full": comm_time(s, spec, spec.max_blocks, layer)}
    return out
