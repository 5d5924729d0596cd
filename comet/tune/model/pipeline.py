"""Comm and GEMM overlapped in the fused kernel: the cost model's prediction of a split and its
choice (comet.tune.perfmodel).

Pipeline (``fused``, :func:`predict`): a two-stage in-order pipeline (a two-machine flow shop);
for chunks ``i`` with producer times ``p_i`` and consumer times ``c_i`` the makespan is
``max_j (sum_{i<=j} p_i + sum_{i>=j} c_i)``, between ``max(P, C)`` and ``P + C``.  With ``K`` equal
chunks it is ``max(P, C) + min(P, C) / K``: perfect overlap plus one non-overlappable head or tail
chunk.

* layer0: comm produces, GEMM consumes.  Chunks are the source ranks in ring order (local rows
  first, so the GEMM starts on local tiles at once while remote rows are in flight), each cut into
  pieces of about one M-tile per local expert; a chunk's GEMM share is proportional to its rows.
  At least one tile time remains after the last row has arrived.
* layer1: GEMM produces bands of ``b`` N-tile columns (across all local experts inside a
  band, in raster groups of m-tiles); the band ending at column ``c`` is complete after ``ceil((c + 1) * tiles_per_column /
  n_gemm)`` waves; comm blocks then reduce and send its columns' slice of every row (``1 /
  columns`` of the comm work per column), in order.

``predict`` returns ``comm``, ``gemm`` (this split), ``fused``, ``sequential = comm + gemm`` (same
split, no overlap), ``baseline = comm_full + gemm_full`` (unfused: each part alone on the whole
GPU, one after the other, like torch + NCCL) and ``limit = max(comm_full, gemm_full)`` (perfect
overlap with every SM serving both; no split reaches it).  Always
``limit <= fused <= sequential``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

from .comm import (KERNEL_GAP_S, _comm_parts, _layer1_stream, comm_split, comm_time, prologue_time,
                   resolve_tp_path)
from .gemm import (DEFAULT_TILE, _tile, _tile_seconds, a_sweeps, band_width, gemm_tiles, gemm_time,
                   max_band)
from .hardware import GpuSpec
from .nodes import node_traffic
from .one_node import local_rows, remote_rows
from .shape import MoEShape, _check_layer

# Bands whose predicted kernel time is within this fraction of the fastest band's start the comm
# blocks early enough; of those the model takes the one with the fewest sweeps of h (HBM traffic
# the model does not otherwise charge: the comm blocks' share, other kernels), see choose_band.
BAND_SLACK = 0.02


def _flow_shop(first: Sequence[float], second: Sequence[float],
               release: Optional[Sequence[float]] = None) -> float:
    """Makespan of an in-order two-stage pipeline (chunk i: stage-1 time first[i], then second[i]);
    with ``release``, chunk i's stage 1 starts no earlier than release[i] (its data's arrival)."""
    t1 = t2 = 0.0
    if release is None:
        for a, b in zip(first, second):
            t1 += a
            t2 = max(t2, t1) + b
        return t2
    for a, b, r in zip(first, second, release):
        t1 = max(t1, r) + a
        t2 = max(t2, t1) + b
    return t2


_MAX_CHUNKS = 512


def _pipeline_chunks(shape, tile, sources, gemm: float, total_rows: float):
    """layer0's pipeline chunks, in source order, as (comm seconds, GEMM seconds, release times)
    for :func:`_flow_shop`. sources: (rows, pull seconds, latency on the first piece, delivery
    window start, end) each; a source is cut into pieces of about one M-tile per local expert
    (at most _MAX_CHUNKS / W), its pull seconds and its share of the GEMM split evenly, piece q
    released at the window's (q + 1) / n point (0 for rows that are there from the start)."""
    tm, _ = _tile(tile)
    piece = max(1.0, float(tm * shape.E_local))
    cap = max(1, _MAX_CHUNKS // shape.W)
    c_times, g_times, rel = [], [], []
    for rows, secs, lat, r0, r1 in sources:
        if rows <= 0:
            continue
        n = min(cap, max(1, math.ceil(rows / piece - 1e-9)))
        for q in range(n):
            c_times.append(secs / n + (lat if q == 0 else 0.0))
            g_times.append(gemm * rows / total_rows / n)
            rel.append(r0 + (r1 - r0) * (q + 1) / n)
    return c_times, g_times, rel


def _fused_layer0(shape, spec, n_comm, n_gemm, tile, comm, gemm) -> float:
    if shape.nodes > 1:
        return _fused_layer0_nodes(shape, spec, n_comm, n_gemm, tile, comm, gemm)
    alpha, local_s, remote_s, tail = _comm_parts(shape, spec, n_comm, 0)[:4]
    W = shape.W
    loc = local_rows(shape, 0)
    rem = remote_rows(shape, 0)
    total_rows = loc + rem
    if total_rows <= 0 or gemm <= 0:
        return comm + gemm
    # ring order: the local rank first, then d+1, d+2, ...; every row is here from the start
    sources = [(loc, local_s, 0.0, 0.0, 0.0)]
    if W > 1:
        sources += [(rem / (W - 1), remote_s / (W - 1), alpha if s == 0 else 0.0, 0.0, 0.0)
                    for s in range(W - 1)]
    fused = _flow_shop(*_pipeline_chunks(shape, tile, sources, gemm, total_rows)) + tail
    # after the last row has landed at least one tile still has to run
    fused = max(fused, comm + min(gemm, _tile_seconds(shape, spec, 0, tile)))
    return fused


def _fused_layer0_nodes(shape, spec, n_comm, n_gemm, tile, comm, gemm) -> float:
    """layer0 over several nodes: tiles in the order local rows, same-node sources, then the
    sources of other nodes (least remote data first; an assumption on the node-first kernel's
    tile order).  A remote source's rows enter the pull stream (mirror reads; nothing to pull
    without node-first dispatch: the NIC writes them in place) only once the NIC has delivered
    them: the NIC carries the R remote sources one after another (release times)."""
    p = _comm_parts(shape, spec, n_comm, 0)
    tr = node_traffic(shape, 0)
    P, R = shape.ranks_per_node, p.far_sources
    far_slots = tr.fanout_nvlink + tr.fanout_local if shape.node_first else tr.nic
    total_rows = tr.local + tr.same_node + far_slots
    if total_rows <= 0 or gemm <= 0:
        return comm + gemm
    sources = [(tr.local, p.local_s, 0.0, 0.0, 0.0)]
    if P > 1:
        sources += [(tr.same_node / (P - 1), p.remote_s / (P - 1), p.alpha if s == 0 else 0.0,
                     0.0, 0.0) for s in range(P - 1)]
    sources += [(far_slots / R, p.fan_s / R, 0.0, p.nic_alpha + p.nic_s * i / R,
                 p.nic_alpha + p.nic_s * (i + 1) / R) for i in range(R)]
    fused = _flow_shop(*_pipeline_chunks(shape, tile, sources, gemm, total_rows)) + p.tail
    return max(fused, comm + min(gemm, _tile_seconds(shape, spec, 0, tile)))


def _fused_layer1(shape, spec, n_comm, n_gemm, tile, comm, gemm, band=1) -> float:
    """The GEMM publishes bands of ``band`` columns (all tiles of a band before the next); a
    band is complete after ``ceil(last column * tiles_per_column / n_gemm)`` waves, then the comm
    blocks reduce and send its columns.  Wider bands publish later (the comm blocks start later
    and the last band's comm is a longer tail) but sweep h fewer times (gemm, the caller's)."""
    p = _comm_parts(shape, spec, n_comm, 1)
    per_col, cols = gemm_tiles(shape, 1, tile)
    tiles = per_col * cols
    if tiles == 0 or gemm <= 0:
        return comm + gemm
    waves = math.ceil(tiles / n_gemm)
    t_wave = gemm / waves
    b = band_width(band, cols)
    # chunks of whole bands, grouped so that at most _MAX_CHUNKS chunks are simulated
    group = max(1, math.ceil(math.ceil(cols / b) / _MAX_CHUNKS)) * b
    n_chunks = math.ceil(cols / group)
    lat, body = _layer1_stream(p)
    per_chunk = body / cols
    t = 0.0
    for c in range(n_chunks):
        last_col = min(cols, (c + 1) * group)
        done = math.ceil(last_col * per_col / n_gemm) * t_wave
        ncols = last_col - c * group
        t = max(t, done) + per_chunk * ncols
    return t + lat + p.tail


def predict(
    shape: MoEShape,
    spec: GpuSpec,
    n_comm: int,
    layer: int,
    tile=DEFAULT_TILE,
    *,
    n_blocks: Optional[int] = None,
    band: Optional[int] = None,
) -> Dict[str, float]:
    """Predicted seconds for ``layer`` with ``n_comm`` comm blocks (see the module doc).

    ``n_blocks`` bounds the grid (co-residency); the GEMM gets ``min(spec.max_blocks, n_blocks) -
    n_comm`` blocks.  ``band``: layer1's n-tiles per band (0: all), default :func:`choose_band`'s;
    the result's ``band`` and ``a_sweeps`` (:func:`a_sweeps`: HBM reads of the GEMM's A operand,
    charged in ``gemm``; ``gemm_full`` and the baseline use an L2-friendly raster, one sweep).  Returns ``comm``, ``gemm``, ``prologue``, ``combine`` (layer1's combine
    kernel, part of comm), ``kernel`` (the pipelined fused kernel), ``fused`` (prologue + kernel),
    ``sequential`` (comm + gemm),
    ``baseline``, ``limit``, ``comm_full``, ``gemm_full``, ``intra`` and ``inter`` (the NVLink and
    NIC parts of comm, each alone, see :func:`comm_split`; seconds), ``intra_rows``,
    ``inter_rows`` and ``n_comm``, ``n_gemm``; ``tp_path`` (a string: the TP path the
    prediction used, the model's choice unless ``shape.tp_path`` is set; "direct" without TP).
    """
    _check_layer(layer)
    shape = resolve_tp_path(shape, spec, layer)
    total = spec.max_blocks if n_blocks is None else min(spec.max_blocks, int(n_blocks))
    if total < 2:
        raise ValueError(f"need at least 2 co-resident blocks (1 comm + 1 GEMM), have {total}")
    if not 0 <= n_comm <= total - 1:
        raise ValueError(f"n_comm={n_comm} outside [0, {total - 1}]")
    n_gemm = total - n_comm
    # n_comm = 0: staged (comet/block_roles.h), the comm program on the whole grid before
    # (layer0) or after (layer1) the GEMM on the whole grid, one more launch.
    staged = n_comm == 0
    comm = comm_time(shape, spec, total if staged else n_comm, layer)
    comm_full = comm_time(shape, spec, spec.max_blocks, layer)
    gemm_full = gemm_time(shape, spec, spec.sm_count, layer, tile)
    if staged:
        # layer1's band only times the comm blocks' start: staged, one band (h read once)
        band = 1 if layer == 0 else band_width(0 if band is None else band,
                                               gemm_tiles(shape, 1, tile)[1])
        gemm = gemm_time(shape, spec, n_gemm, layer, tile, band)
        fused = comm + gemm + KERNEL_GAP_S
    elif layer == 0:
        band = 1
        gemm = gemm_time(shape, spec, n_gemm, layer, tile, band)
        fused = _fused_layer0(shape, spec, n_comm, n_gemm, tile, comm, gemm)
        # guard the exact bounds against float rounding: max(comm, gemm) <= fused <= comm + gemm
        fused = min(max(fused, comm, gemm), comm + gemm)
    else:
        if band is None:
            band = choose_band(shape, spec, n_comm, tile, n_blocks=total)
        band = band_width(band, gemm_tiles(shape, 1, tile)[1])
        gemm, fused = _layer1_kernel(shape, spec, n_comm, n_gemm, tile, comm, band)
    # The per-call prologue runs before the fused kernel. The baseline is charged nothing for its
    # own layout/notify steps (a conservative comparison against Comet).
    prologue = prologue_time(shape, spec, layer)
    return {
        "comm": comm,
        "gemm": gemm,
        "prologue": prologue,
        # layer1's tail after the fused kernel: the combine (and, node-reduced, the relays' step)
        "combine": _comm_parts(shape, spec, total if staged else n_comm, 1).tail
        if layer == 1 else 0.0,
        "kernel": fused,
        "fused": fused + prologue,
        "sequential": comm + gemm,
        "baseline": comm_full + gemm_full,
        "limit": max(comm_full, gemm_full),
        "comm_full": comm_full,
        "gemm_full": gemm_full,
        "n_comm": n_comm,
        "n_gemm": n_gemm,
        "band": band,
        "a_sweeps": a_sweeps(shape, spec, layer, tile, band),
        "tp_path": shape.tp_path or "direct",
        **comm_split(shape, spec, total if staged else n_comm, layer),
    }


def _layer1_kernel(shape, spec, n_comm, n_gemm, tile, comm, band) -> Tuple[float, float]:
    """(gemm, pipelined kernel) seconds of layer1 with ``band`` n-tiles per band."""
    gemm = gemm_time(shape, spec, n_gemm, 1, tile, band)
    fused = _fused_layer1(shape, spec, n_comm, n_gemm, tile, comm, gemm, band)
    # guard the exact bounds against float rounding: max(comm, gemm) <= fused <= comm + gemm
    return gemm, min(max(fused, comm, gemm), comm + gemm)


def choose_band(shape: MoEShape, spec: GpuSpec, n_comm: int, tile=DEFAULT_TILE,
                n_blocks: Optional[int] = None) -> int:
    """layer1's band width (n-tiles per band, tile_order.h) for ``n_comm`` comm blocks.

    Candidates: b = 1 .. :func:`max_band`, the narrowest b of each sweep count ``ceil(cols / b)``
    (a wider band with as many sweeps only publishes later).  A band trades the earliness of
    the first publish (and the length of the last band's comm tail) against the sweeps of h:
    the pipelined kernel time of each candidate is predicted, and of those within
    ``BAND_SLACK`` of the fastest the one with the fewest sweeps wins.  h in L2 (one sweep
    whatever b): 1, the earliest publish."""
    shape = resolve_tp_path(shape, spec, 1)
    _, cols = gemm_tiles(shape, 1, tile)
    if n_comm == 0:
        return 0  # staged: the comm blocks start after the GEMM anyway; one band reads h once
    if cols <= 1 or a_sweeps(shape, spec, 1, tile, 1) <= 1.0:
        return 1
    total = spec.max_blocks if n_blocks is None else min(spec.max_blocks, int(n_blocks))
    n_gemm = total - n_comm
    comm = comm_time(shape, spec, n_comm, 1)
    candidates, seen = [], set()
    for b in range(1, max_band(shape, spec, tile) + 1):
        s = math.ceil(cols / b)
        if s not in seen:
            seen.add(s)
            candidates.append((b, _layer1_kernel(shape, spec, n_comm, n_gemm, tile, comm, b)[1]))
    best = min(t for _, t in candidates)
    return max(b for b, t in candidates if t <= best * (1 + BAND_SLACK))


def choose_n_comm(
    shape: MoEShape,
    spec: GpuSpec,
    layer: int,
    max_blocks: Optional[int] = None,
    tile=DEFAULT_TILE,
    staged: bool = True,
) -> int:
    """The ``n_comm`` in ``[0, blocks - 1]`` with the least predicted fused time (ties: smallest);
    0 is the staged layer (no comm blocks beside the GEMM: the comm work on the whole grid before
    or after it): always where no row crosses a link (a world of one), else where the model
    predicts it faster (little crosses, or the GEMM dominates so much that every SM it loses to
    comm blocks costs more than the overlap saves).

    ``blocks = min(spec.max_blocks, max_blocks)``: the persistent kernel needs every block
    co-resident, so ``max_blocks`` (if given) bounds the whole grid, comm and GEMM blocks together.
    ``staged=False``: the fused splits only (``[1, blocks - 1]``).
    """
    total = spec.max_blocks if max_blocks is None else min(spec.max_blocks, int(max_blocks))
    if total < 2:
        raise ValueError(f"need at least 2 co-resident blocks (1 comm + 1 GEMM), have {total}")
    shape = resolve_tp_path(shape, spec, layer)
    if staged:
        split = comm_split(shape, spec, total, layer)
        if split["intra_rows"] + split["inter_rows"] <= 0:
            return 0  # no row crosses a link: comm blocks would only hold SMs from the GEMM
    best_n, best_t = 0, math.inf
    for n in range(0 if staged else 1, total):
        t = predict(shape, spec, n, layer, tile, n_blocks=total)["fused"]
        if t < best_t * (1 - 1e-12):
            best_n, best_t = n, t
    return best_n
