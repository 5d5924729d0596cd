"""The grouped GEMM in the cost model (comet.tune.perfmodel).

GEMM (roofline with wave quantisation, :func:`gemm_time`): the grouped GEMM has
``tiles = sum_e ceil(M_e / tile_m) * ceil(n_out / tile_n)`` output tiles, a tile costs
``t_tile = 2 * tile_m * tile_n * K / (peak_flops * gemm_eff / sm_count)`` on one SM (padded rows
cost like real ones), the GEMM blocks run ``waves = ceil(tiles / n_gemm)`` rounds, and the
operands must stream from HBM, of which the GEMM blocks get their per-SM share (the comm blocks use
HBM too)::

    gemm(n) = max(waves(n) * t_tile, bytes / (hbm * hbm_eff * n / sm_count))

``bytes`` counts the local experts' weights and the output once and the A operand (layer0's
``a``, layer1's ``h``) :func:`a_sweeps` times and the weights :func:`weight_reads` times (the
kernels walk raster groups of m-tiles, tile_order.h): layer0 runs all n-tiles of a group's m-tiles
before the next group (one sweep); layer1 runs column bands of ``b`` n-tiles, groups inside a
band, and reads h once per band, ``ceil(n_out / tile_n / b)`` sweeps, unless h fits ``L2_REUSE_FRACTION`` of the L2
(``GpuSpec.l2_mb``: 50 MB on H100/H800) -- b = 1, plain column order, reads Mixtral's 235 MB h
32 times (7.5 GB, 2.8 ms at H800's 3.35 TB/s x hbm_eff against 1.3 ms of tensor-core work).  A
band's W1 columns of the experts live at once must fit the same share of L2
(:func:`max_band`).  :func:`choose_band` picks b (the fewest sweeps among the bands whose
pipelined kernel is within ``BAND_SLACK`` of the fastest: a wider band starts the comm blocks
later).  The unfused baseline's GEMM is charged one sweep (an L2-friendly raster).  At a fixed
band both terms are non-increasing in ``n``, hence so is ``gemm``: more SMs never make it
slower.  ``n_out, K`` are ``N, H`` for layer0
(``[M, H] x [H, N0]``) and ``H, N`` for layer1 (``[M, N1] x [N1, H]``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

from .fp8 import _fp8_gemm_bytes, fp8_promotion_charged, fp8_promotion_seconds, fp8_scale_bytes
from .hardware import GpuSpec
from .shape import MoEShape, _check_layer, expert_rows

DEFAULT_TILE: Tuple[int, int] = (128, 128)
# The CUDA kernels' other tile: 64 rows (one MMA warpgroup on sm_90a) for few rows per expert
# (comet.tune.model.small_tile picks between the two).
SMALL_TILE: Tuple[int, int] = (64, 128)
# Share of an SM's tensor-core rate a 64-row tile's MMAs get against the 128-row tile's
# (assumption, not measured): the 128-row tile keeps two MMA warpgroups issuing wgmma (one's
# epilogue and barriers hide behind the other's MMAs), the 64-row tile one, and each of its
# k-steps moves 1.5x the shared-memory operand bytes per FLOP ((64 + 128) / (64 x 128) against
# 256 / (128 x 128)).  Any share in (1/2, 3/4] gives small_tile's rule (a 64-row tile costs less
# MMA time exactly when an expert has at most 64 rows); above 3/4 it would also win at 129-192
# rows (docs/tuning.md, "The small-batch tile").
SMALL_TILE_MMA_SHARE = 0.7


def gemm_dims(shape: MoEShape, layer: int) -> Tuple[int, int]:
    """(output columns, reduction size) of ``layer``'s per-expert GEMM."""
    _check_layer(layer)
    return (shape.N, shape.H) if layer == 0 else (shape.H, shape.N)


def _tile(tile) -> Tuple[int, int]:
    tm, tn = int(tile[0]), int(tile[1])
    if tm < 1 or tn < 1:
        raise ValueError(f"tile sizes must be >= 1, got {tile!r}")
    return tm, tn


def gemm_tiles(shape: MoEShape, layer: int, tile=DEFAULT_TILE) -> Tuple[int, int]:
    """(tiles per N-column = sum_e ceil(M_e / tile_m), number of N-columns = ceil(n_out / tile_n))."""
    tm, tn = _tile(tile)
    n_out, _ = gemm_dims(shape, layer)
    per_col = sum(math.ceil(r / tm - 1e-9) for r in expert_rows(shape) if r > 0)
    return per_col, math.ceil(n_out / tn)


def _sm_flops(shape: MoEShape, spec: GpuSpec) -> float:
    """FLOP/s one SM's GEMM sustains in the shape's dtype (the tensor-core rate for 16-bit)."""
    return spec.peak_flops(shape.dtype_bytes) * spec.gemm_eff / spec.sm_count


def mma_share(tile_m: int) -> float:
    """The tensor-core rate share of a tile of ``tile_m`` rows: :data:`SMALL_TILE_MMA_SHARE` for
    the CUDA kernels' 64-row tile, 1 otherwise (the 128-row tile; the CPU backend's tiles, whose
    pseudo-spec rates already are its own)."""
    return SMALL_TILE_MMA_SHARE if int(tile_m) == SMALL_TILE[0] else 1.0


def _tile_seconds(shape: MoEShape, spec: GpuSpec, layer: int, tile) -> float:
    """One output tile on one SM: the tensor cores' MMAs, plus FP8's promotion on the CUDA cores
    (not overlapped with them; comet.tune.model.fp8)."""
    tm, tn = _tile(tile)
    _, k_red = gemm_dims(shape, layer)
    mma = 2.0 * tm * tn * k_red / (_sm_flops(shape, spec) * mma_share(tm))
    if not fp8_promotion_charged(shape, spec):
        return mma
    return mma + fp8_promotion_seconds(tm, tn, k_red, spec.fma_rate / spec.sm_count)


# Share of the L2 that the operand a band reuses may hold; the rest is for the A rows and output
# tiles streaming through and the comm blocks' reads of C (assumption).
L2_REUSE_FRACTION = 0.5


def band_width(band: Optional[int], cols: int) -> int:
    """n-tiles per layer1 band as the kernel runs it: ``band`` <= 0, None or more than ``cols``
    (csrc/include/comet/tile_order.h: layer1_band) means all ``cols`` n-tiles."""
    return cols if band is None or band <= 0 or band > cols else int(band)


def _l2_budget(spec: GpuSpec) -> float:
    return spec.l2_mb * 1e6 * L2_REUSE_FRACTION


def max_band(shape: MoEShape, spec: GpuSpec, tile=DEFAULT_TILE) -> int:
    """The widest layer1 band whose W1 columns stay in L2 while the band's m-tiles stream by.

    A band of ``b`` n-tiles needs, per expert, ``b * tile_n * N1`` elements of W1 (the ``[H, N1]``
    weight's rows for the band's columns).  Inside a band the GEMM blocks walk the experts' m-tiles
    (in raster groups, n-major over the band's n-tiles; modelled as m-major), and ``n_gemm <= sm_count`` blocks work on ``ceil(sm_count / b)`` consecutive m-tiles
    at once, so the experts live at once are those that window spans:
    ``min(E_l, 1 + ceil(sm_count / b / m-tiles per expert))``.  Their slabs must fit
    ``L2_REUSE_FRACTION`` of the L2, else each wave re-reads W1 and banding trades one HBM stream
    for another.  At least 1: column order, whose one-n-tile slab the model does not check."""
    tm, tn = _tile(tile)
    per_col, cols = gemm_tiles(shape, 1, tile)
    experts = sum(1 for r in expert_rows(shape) if r > 0)
    if per_col == 0 or experts == 0:
        return 1
    per_expert = per_col / experts
    best = 1
    for b in range(2, cols + 1):
        live = min(experts, 1 + math.ceil(math.ceil(spec.sm_count / b) / per_expert - 1e-9))
        if live * b * tn * shape.N * shape.dtype_bytes > _l2_budget(spec):
            break
        best = b
    return best


def a_sweeps(shape: MoEShape, spec: GpuSpec, layer: int, tile=DEFAULT_TILE,
             band: Optional[int] = None) -> float:
    """How often ``layer``'s GEMM reads its A operand from HBM (1.0 = once).

    * layer0 visits all n-tiles of a raster group's m-tiles before the next group
      (tile_order.h: layer0_tile), and consecutive tiles run at once on consecutive GEMM blocks,
      so a group's rows of ``a`` come from HBM once and serve its ``ceil(N0 / tile_n)`` n-tiles
      from L2: 1 sweep.
    * layer1 in bands of ``b`` n-tiles, raster groups inside a band: the band's ``b`` tiles of an m-tile
      run at once and share its rows of ``h``; the next band needs them again after the whole of
      ``h [M, N1]`` went through the L2.  So h is read ``ceil(H / tile_n / b)`` times, unless it
      fits ``L2_REUSE_FRACTION`` of the L2 (then once).  b = 1 (plain column-major order) reads
      it ``H / tile_n`` times: Mixtral (H = 4096, M = 8192 rows of N1 = 14336 bf16: 235 MB) 32
      sweeps, 7.5 GB, 2.8 ms at H800's 3.35 TB/s x hbm_eff, against 1.3 ms of tensor-core work.
    * ``band`` None: an L2-friendly raster (the unfused baseline's CUTLASS grouped GEMM): 1."""
    _check_layer(layer)
    if layer == 0 or band is None:
        return 1.0
    per_col, cols = gemm_tiles(shape, 1, tile)
    if shape.is_fp8:
        h_bytes = sum(expert_rows(shape)) * (shape.N + fp8_scale_bytes(shape.N))
    else:
        h_bytes = sum(expert_rows(shape)) * shape.N * shape.dtype_bytes
    if cols == 0 or h_bytes <= _l2_budget(spec):
        return 1.0
    return float(math.ceil(cols / band_width(band, cols)))


def raster_group(n_gemm: int) -> int:
    """m-tiles per raster group of the kernels' tile orders for ``n_gemm`` GEMM blocks: the largest
    ``g`` with ``g * g <= n_gemm`` (csrc/include/comet/tile_order.h: raster_group, which
    tests/test_raster_groups.py checks this against)."""
    return max(1, math.isqrt(max(1, int(n_gemm))))


def weight_reads(shape: MoEShape, spec: GpuSpec, layer: int, n_gemm: int, tile=DEFAULT_TILE,
                 band: Optional[int] = None) -> float:
    """How many experts' weights the kernel's GEMM reads from HBM, counting re-reads (the number of
    experts with rows = each read once).

    The kernels walk m-tiles in raster groups of ``g = raster_group(n_gemm)``, n-major inside a
    group (tile_order.h): a group loads each of its expert's weight slabs once and its ``g``
    m-tiles share it from L2, so an expert of ``mt`` m-tiles has its weights read ``ceil(mt / g)``
    times (they are gone from L2 before the next group needs them), unless all of them fit
    ``L2_REUSE_FRACTION`` of the L2 (then once).  layer1 with one n-tile per band walks the band's
    m-tiles of each expert consecutively and reuses the expert's one slab: once.  ``band`` None
    (and layer0's ``band`` None): the unfused baseline's L2-friendly raster, once per expert.
    The plain m-major order (g = 1, before raster groups) read Mixtral's w0 once per m-tile:
    8 times at 4096 tokens on one GPU."""
    _check_layer(layer)
    tm, _ = _tile(tile)
    n_out, k_red = gemm_dims(shape, layer)
    rows = [r for r in expert_rows(shape) if r > 0]
    if band is None or (layer == 1 and band_width(band, gemm_tiles(shape, 1, tile)[1]) == 1):
        return float(len(rows))
    if n_out * k_red * shape.dtype_bytes <= _l2_budget(spec):
        return float(len(rows))
    g = raster_group(n_gemm)
    return float(sum(math.ceil(math.ceil(r / tm - 1e-9) / g) for r in rows))


def _gemm_unique_bytes(shape: MoEShape, layer: int, sweeps: float = 1.0,
                       weights: Optional[float] = None) -> float:
    """HBM bytes of ``layer``'s grouped GEMM: A ``sweeps`` times, ``weights`` experts' weights
    (default: each expert with rows once, :func:`weight_reads`), the output once."""
    n_out, k_red = gemm_dims(shape, layer)
    m = sum(expert_rows(shape))
    experts = sum(1 for r in expert_rows(shape) if r > 0) if weights is None else weights
    if shape.is_fp8:
        return _fp8_gemm_bytes(shape, m, experts, n_out, k_red, sweeps)
    return shape.dtype_bytes * (sweeps * m * k_red + experts * n_out * k_red + m * n_out)


def gemm_time(shape: MoEShape, spec: GpuSpec, n_gemm: int, layer: int, tile=DEFAULT_TILE,
              band: Optional[int] = None) -> float:
    """Seconds of ``layer``'s grouped GEMM on ``n_gemm`` SMs (roofline + wave quantisation), its
    HBM bytes counting A :func:`a_sweeps` times and the weights :func:`weight_reads` times
    (comet's kernels: ``band`` set, layer1's n-tiles per band, any value for layer0; None: the
    unfused baseline's L2-friendly raster, every operand read once)."""
    if n_gemm < 1:
        raise ValueError(f"n_gemm must be >= 1, got {n_gemm}")
    per_col, cols = gemm_tiles(shape, layer, tile)
    tiles = per_col * cols
    if tiles == 0:
        return 0.0
    waves = math.ceil(tiles / n_gemm)
    compute = waves * _tile_seconds(shape, spec, layer, tile)
    sweeps = a_sweeps(shape, spec, layer, tile, band)
    weights = weight_reads(shape, spec, layer, n_gemm, tile, band)
    memory = _gemm_unique_bytes(shape, layer, sweeps, weights) / (
        spec.hbm_bw * min(n_gemm, spec.sm_count) / spec.sm_count)
    return max(compute, memory)
