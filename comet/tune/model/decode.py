"""The decode regime in the cost model (comet.tune.perfmodel): a whole MoE layer (layer0, the
activation, layer1) at 1-256 tokens per rank, where the time goes to reading the experts'
weights from HBM and to latency, not to tensor-core work (``python -m comet.tune --table decode``;
the derivation is docs/tuning.md's "Decode").

Per rank, uniform routing over ``E`` experts, top-``k``, ``W`` ranks each with ``T`` tokens:

* active experts: a local expert is read only if some row reaches it; a token picks it with
  probability ``k / E``, so ``a = E_l (1 - (1 - k / E)^(W T))`` of the ``E_l = E / W`` local
  experts are read (:func:`active_experts`; DeepSeek-V3 at EP8: 7.2 of 32 at T = 1, all 32 from
  T = 32 on);
* weight bytes: ``a`` times one expert's w0 ``[2 F, H]`` and w1 ``[H, F]`` (FP8: 1 byte per value
  plus a float32 scale per 128 x 128 block; :func:`weight_bytes`);
* link bytes and the comm blocks' time: comet.tune.model.comm's, unchanged (layer0 rows per
  (token, slot), layer1 partials per (token, rank));
* the GEMM of a layer on ``n`` blocks: ``max(weights / (min(n, tiles) * block rate), waves *
  tile)`` (the roofline of comet.tune.model.gemm with only the active experts' weights: its
  activations and outputs are a few MB at most and are left out), a block's rate its share of HBM
  or what its stages keep in flight (comet.tune.model.small_tile.block_stream_rate);
* the tile: the CUDA kernels' 128 x 128 or 64 x 128, per layer the one with the least kernel time
  (comet.tune.model.small_tile.pick_tile; the 64-row tile only where every active expert has at
  most 64 rows, i.e. up to 256 tokens per rank at EP8): padded rows cost like real ones, a
  64-row tile's at the assumed MMA share of comet.tune.model.gemm.

The fused layer, as built (:func:`decode_fused`): the prologue of each layer (comet.tune.model.comm's
estimate, with the call's copies kernel at a launch gap: ``stream_ops_time``; at decode sizes its
grids are one block, whose grid barriers are block barriers), layer0's kernel, the activation (one
launch; its bytes are negligible here), layer1's kernel and the combine kernel.  layer0's kernel
is a two-stage pipeline over m-tiles (:func:`_layer0_kernel`): the comm blocks fill the m-tiles in
the GEMM's visit order, ``n_comm`` at a time (csrc/include/comet/comm_layer0.h), and at decode one
m-tile holds its expert's rows from every source rank, so an m-tile is ready at the end of its
comm round, not of the whole dispatch; the GEMM blocks walk the m-tiles in raster groups of
``g = raster_group(n_gemm)`` (csrc/include/comet/tile_order.h), so they start once the first
group's rounds are done (``first``) and the last group's GEMM follows the dispatch's end:
``max(first + G, C + G g / m)`` for ``m`` m-tiles, dispatch ``C`` and GEMM ``G``.  While the
first group's rows travel the GEMM blocks load the weights of their first pipeline stages
(small_tile.STAGES: 5 for the 128-row tile, 8 for the 64-row one, the sm_90a kernels'; "weights
before rows": csrc/cuda/weights_first.cuh with TMA, csrc/cuda/rows_wait.cuh with cp.async), at most what the
stream moves in ``first``.  layer1's h is local, so its GEMM streams w1 from the
start, and its comm blocks reduce and send each column band after the GEMM publishes it: ``max(P,
C) + min(P, C) / cols`` (docs/design.md's two-stage pipeline with ``cols`` equal chunks).  Each
layer's ``n_comm`` is the one with the least kernel time.  ``folded`` is the same without the
two prologues' launches and barriers (one launch each: not built, see docs/tuning.md).

The unfused chain (:func:`decode_unfused`, what a serving framework runs with low-latency
all-to-all kernels): dispatch, grouped GEMM, activation, grouped GEMM, combine, each a launch on
the whole GPU, one after the other (the dispatch and combine with comm.py's bytes and rates on
every SM; charged no layout step of its own).

The limit (:func:`decode_limit`): one launch plus the larger of the link bytes of both layers over
the link (the slower of NVLink and the NIC where the group spans nodes) and the weight bytes over
HBM, each at its achievable rate (``link_eff``, ``nic_eff``, ``hbm_eff``, as every other limit
of the model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .comm import (KERNEL_GAP_S, combine_time, comm_time, prologue_launches_and_barriers,
                   prologue_time, stream_ops_time)
from .fp8 import FP8_SCALE_BLOCK, FP8_SCALE_BYTES
from .gemm import DEFAULT_TILE, _tile_seconds, gemm_dims, raster_group
from .hardware import GpuSpec
from .nodes import internode_bytes, intranode_bytes
from .shape import MoEShape
from .small_tile import (CUDA_TILES, STAGES, WEIGHT_STAGE_BYTES, block_stream_rate, padded_rows,
                         pick_tile, small_tile_fits)

# DeepSeek-V3's MoE layer: 256 routed experts, top-8, hidden 7168, expert
# FFN 2048 (gated: layer0 produces 2 x 2048 columns).
DECODE_MODEL = dict(H=7168, ffn=2048, E=256, k=8, title="DeepSeek-V3 MoE layer")
DECODE_TOKENS = (1, 8, 32, 128, 256)
DECODE_GROUPS = ((8, 8), (16, 8))  # (W, ranks per node): 8 x H800 in one node, 16 in two
DECODE_GPU = "h800"

# Published low-latency kernel figures at 128 tokens per rank, hidden 7168, top-8 (measurements of
# other implementations, not of Comet): (ranks, GPU, source, dispatch us, combine us).
DECODE_ANCHORS = (
    (8, "h800", "DeepEP low-latency, 8 x H800", 77.0, 114.0),
    (16, "h800", "DeepEP low-latency, 16 x H800 (2 nodes)", 118.0, 195.0),
    (8, "h100", "pplx-kernels, 8 x H100", 83.6, 102.3),
)


@dataclass(frozen=True)
class DecodePoint:
    """One rank of a decode MoE layer: ``W`` ranks (``ranks_per_node`` per node), ``T`` tokens per
    rank, ``dtype`` "bf16" or "fp8", the expert shape (``H``, gated ``ffn``, ``E``, ``k``)."""

    W: int
    T: int
    dtype: str = "fp8"
    ranks_per_node: Optional[int] = None
    H: int = DECODE_MODEL["H"]
    ffn: int = DECODE_MODEL["ffn"]
    E: int = DECODE_MODEL["E"]
    k: int = DECODE_MODEL["k"]

    def shape(self, layer: int) -> MoEShape:
        """comet.tune.model's one-layer shape (layer0: N = 2 ffn, layer1: N = ffn)."""
        n = 2 * self.ffn if layer == 0 else self.ffn
        return MoEShape(W=self.W, E=self.E, k=self.k, H=self.H, N=n, T=self.T,
                        dtype_bytes=1 if self.dtype == "fp8" else 2,
                        ranks_per_node=self.ranks_per_node)


def active_experts(W: int, E: int, k: int, T: int) -> float:
    """Expected local experts with at least one row: ``E / W * (1 - (1 - k / E) ** (W * T))``."""
    return E / W * (1.0 - (1.0 - k / E) ** (W * T))


def _expert_weight_bytes(shape: MoEShape, layer: int) -> float:
    n_out, k_red = gemm_dims(shape, layer)
    if shape.is_fp8:
        blocks = math.ceil(n_out / FP8_SCALE_BLOCK) * math.ceil(k_red / FP8_SCALE_BLOCK)
        return n_out * k_red + FP8_SCALE_BYTES * blocks
    return n_out * k_red * shape.dtype_bytes


def weight_bytes(p: DecodePoint, layer: int) -> float:
    """HBM bytes of ``layer``'s weights this rank reads: its active experts' (see module doc)."""
    return active_experts(p.W, p.E, p.k, p.T) * _expert_weight_bytes(p.shape(layer), layer)


def _rows_per_expert(p: DecodePoint) -> float:
    """Rows per active expert (T k rows reach a rank); 0 without tokens."""
    a = active_experts(p.W, p.E, p.k, p.T)
    return 0.0 if a <= 0 or p.T == 0 else p.T * p.k / a


def _mtiles(p: DecodePoint, tile=DEFAULT_TILE) -> int:
    """m-tiles of the active experts (m-tiles never straddle experts)."""
    rows = _rows_per_expert(p)
    if rows <= 0:
        return 0
    return math.ceil(active_experts(p.W, p.E, p.k, p.T) - 1e-9) * math.ceil(rows / tile[0] - 1e-9)


def _tiles(p: DecodePoint, layer: int, tile=DEFAULT_TILE) -> int:
    """Output tiles of ``layer``'s grouped GEMM: the active experts' m-tiles times the n-tiles."""
    n_out, _ = gemm_dims(p.shape(layer), layer)
    return _mtiles(p, tile) * math.ceil(n_out / tile[1])


def _stream_rate(spec: GpuSpec, blocks: int, tiles: int, tile=DEFAULT_TILE) -> float:
    """HBM bytes/s of ``blocks`` GEMM blocks with ``tiles`` tiles: each busy block at
    small_tile.block_stream_rate (its SM's share of HBM, unless its stages hold less)."""
    return block_stream_rate(spec, tile[0]) * min(blocks, max(tiles, 1), spec.sm_count)


def decode_gemm(p: DecodePoint, spec: GpuSpec, layer: int, n_gemm: int,
                prefetched: float = 0.0, tile=DEFAULT_TILE) -> float:
    """Seconds of ``layer``'s GEMM on ``n_gemm`` blocks with ``tile``, ``prefetched`` of its
    weight bytes already loaded: the weight stream or the tiles' waves, whichever is longer."""
    tiles = _tiles(p, layer, tile)
    if tiles == 0:
        return 0.0
    stream = max(0.0, weight_bytes(p, layer) - prefetched) / _stream_rate(spec, n_gemm, tiles,
                                                                        tile)
    waves = math.ceil(tiles / n_gemm) * _tile_seconds(p.shape(layer), spec, layer, tile)
    return max(stream, waves)


def _layer0_kernel(p: DecodePoint, spec: GpuSpec, n_comm: int, tile=DEFAULT_TILE) -> float:
    """The dispatch and the GEMM as a two-stage pipeline over m-tiles (module doc): the comm
    blocks fill the m-tiles in the GEMM's visit order, ``n_comm`` at a time; the GEMM blocks walk
    them in raster groups of ``g`` m-tiles, so they start when the first group is filled and
    the last group's GEMM follows the dispatch's end."""
    n_gemm = spec.max_blocks - n_comm
    comm = comm_time(p.shape(0), spec, n_comm, 0)
    m = _mtiles(p, tile)
    if m == 0:
        return comm
    rounds = math.ceil(m / n_comm)
    group = min(raster_group(n_gemm), m)
    first = comm * min(rounds, math.ceil(group / n_comm)) / rounds
    # weights before rows: while the first group's rows travel, each GEMM block's first stages of
    # B are loaded (at most what the stream moves in that time)
    rate = _stream_rate(spec, n_gemm, _tiles(p, 0, tile), tile)
    prefetch = min(weight_bytes(p, 0), n_gemm * STAGES[tile[0]] * WEIGHT_STAGE_BYTES, rate * first)
    gemm = decode_gemm(p, spec, 0, n_gemm, prefetch, tile)
    return max(first + gemm, comm + gemm * group / m)


def _layer1_kernel(p: DecodePoint, spec: GpuSpec, n_comm: int, tile=DEFAULT_TILE) -> float:
    """The GEMM's column bands, each reduced and sent by the comm blocks after it is published
    (without the combine kernel, which comm_time includes and decode_fused adds after it)."""
    s = p.shape(1)
    gemm = decode_gemm(p, spec, 1, spec.max_blocks - n_comm, tile=tile)
    comm = comm_time(s, spec, n_comm, 1) - _combine(p, spec)
    cols = math.ceil(s.H / tile[1])
    return max(gemm, comm) + min(gemm, comm) / cols


def _combine(p: DecodePoint, spec: GpuSpec) -> float:
    return combine_time(p.shape(1), spec)


def _best_split(kernel, p: DecodePoint, spec: GpuSpec, tile) -> Tuple[int, float]:
    """(n_comm, seconds) of the fastest split of a layer's kernel, n_comm in [1, blocks - 1]."""
    return min(((n, kernel(p, spec, n, tile)) for n in range(1, spec.max_blocks)),
               key=lambda nt: (nt[1], nt[0]))


def _best(kernel, p: DecodePoint, spec: GpuSpec, layer: int):
    """(tile, n_comm, seconds) of a layer's kernel: each candidate tile (CUDA_TILES; the 64-row
    one where every active expert has at most 64 rows) at its fastest split, then
    small_tile.pick_tile's order."""
    rows = _rows_per_expert(p)
    fits = small_tile_fits([rows])
    best = {}
    for tile in CUDA_TILES:
        if tile[0] < DEFAULT_TILE[0] and not fits:
            continue
        best[tile] = _best_split(kernel, p, spec, tile)
    tile = pick_tile([(t, sec, float(_tiles(p, layer, t)), padded_rows([rows], t[0]))
                      for t, (_, sec) in best.items()])
    return (tile, *best[tile])


def _activation(p: DecodePoint, spec: GpuSpec) -> float:
    """The caller's activation between the layers: a launch and its HBM bytes (T k rows of 2 ffn
    in, ffn out, bf16)."""
    return KERNEL_GAP_S + p.T * p.k * 3 * p.ffn * 2 / spec.hbm_bw


def decode_fused(p: DecodePoint, spec: GpuSpec) -> Dict[str, float]:
    """The fused layer as built (module doc): seconds of each part, ``fused`` their sum, and
    ``folded`` (the prologues' launches and grid barriers gone, not built)."""
    t0, n0, k0 = _best(_layer0_kernel, p, spec, 0)
    t1, n1, k1 = _best(_layer1_kernel, p, spec, 1)
    # each layer's prologue kernels and its memsets and device copies (stream operations too)
    pro = sum(prologue_time(p.shape(l), spec, l) + stream_ops_time(l) for l in (0, 1))
    act = _activation(p, spec)
    comb = _combine(p, spec)
    fused = pro + KERNEL_GAP_S + k0 + act + KERNEL_GAP_S + k1 + comb
    # folded: the prologue's launches and grid barriers gone (its memsets and copies, its work and its metadata
    # exchange's round trips stay, inside the fused kernel)
    folded = fused - sum(prologue_launches_and_barriers(p.shape(l), l) for l in (0, 1))
    return {"n_comm0": n0, "n_comm1": n1, "tile_m0": t0[0], "tile_m1": t1[0], "prologue": pro, "layer0": k0, "activation": act,
            "layer1": k1, "combine": comb, "fused": fused, "folded": folded}


def decode_unfused(p: DecodePoint, spec: GpuSpec) -> Dict[str, float]:
    """The unfused chain (module doc): ``dispatch``, ``gemm0``, ``activation``, ``gemm1``,
    ``combine`` and their sum ``unfused``, each step a launch on the whole GPU."""
    blocks = spec.max_blocks
    dispatch = KERNEL_GAP_S + comm_time(p.shape(0), spec, blocks, 0)
    combine = KERNEL_GAP_S + comm_time(p.shape(1), spec, blocks, 1)
    g0 = KERNEL_GAP_S + decode_gemm(p, spec, 0, blocks)
    g1 = KERNEL_GAP_S + decode_gemm(p, spec, 1, blocks)
    act = _activation(p, spec)
    return {"dispatch": dispatch, "gemm0": g0, "activation": act, "gemm1": g1,
            "combine": combine, "unfused": dispatch + g0 + act + g1 + combine}


def link_seconds(p: DecodePoint, spec: GpuSpec) -> float:
    """Both layers' link bytes at the achievable link rates (NVLink and NIC in parallel)."""
    nvl = sum(intranode_bytes(p.shape(l), l) for l in (0, 1))
    nic = sum(internode_bytes(p.shape(l), l) for l in (0, 1))
    return max(nvl / spec.link_bw, nic / spec.nic_bw if nic > 0 else 0.0)


def decode_limit(p: DecodePoint, spec: GpuSpec) -> float:
    """One launch plus the larger of the link seconds and the weights' HBM seconds."""
    weights = (weight_bytes(p, 0) + weight_bytes(p, 1)) / spec.hbm_bw
    return KERNEL_GAP_S + max(link_seconds(p, spec), weights)
