"""The small-batch tile in the cost model: which of the CUDA kernels' two tiles, 128 x 128 or
64 x 128 (``tile_m`` = 128 or 64 rows by 128 columns), a layer runs with when nothing was measured
(docs/tuning.md, "The small-batch tile", has the derivation).

Per local expert of ``r`` rows (uniform routing: ``W T k / E``; or the measured counts):

* **Padding.** An expert's rows are cut into ``ceil(r / tile_m)`` m-tiles and each computes
  ``tile_m`` rows, so ``ceil(r / tile_m) tile_m - r`` rows are padding (:func:`padded_rows`):
  at 32 rows (DeepSeek-V3 at EP8, 128 tokens per rank) a 128-row tile is three quarters padding,
  a 64-row tile half.
* **MMA rate.** The 64-row tile runs on one MMA warpgroup, the 128-row tile on two; the model
  charges the 64-row tile's MMAs at ``SMALL_TILE_MMA_SHARE`` (0.7, an assumption) of the SM's
  tensor-core rate (comet.tune.model.gemm).  So for ``r <= 64`` a 64-row tile costs
  ``64 / 0.7 = 91`` row-units of MMA time against 128, and for ``r > 64`` it never costs less:
  ``ceil(r / 64) 64 / 0.7 >= ceil(r / 128) 128`` (at 65-128 rows 183 against 128, at 129-192
  274 against 256, and the ratio tends to 1 / 0.7).
* **Weight stream per block.** A GEMM block keeps ``stages`` k-tiles of its weight slab in
  flight (sm_90a 16-bit: 5 stages for 128 rows, 8 for 64, each a 128-column slab of 16 KiB), so
  by Little's law it streams at most ``stages x 16 KiB / HBM_LATENCY_S`` (82 and 131 GB/s at
  the assumed 1 us), against its share of HBM, ``hbm / sm_count`` (20 GB/s on H800): with one
  block per SM neither tile limits the weight stream (:func:`block_stream_rate`), and both tiles
  read an expert's weight slab once per m-tile, i.e. equally often while ``r <= 64``.  Where the
  layer is bound by the weight stream (decode) the two tiles take the same time.
* **Choice** (:func:`pick_tile`): the least predicted time; ties (the weight-bound case) go to
  fewer tiles (fewer waits, epilogues and weight re-reads), then to fewer padded rows, then to
  the larger tile.  The 64-row tile is a candidate only where it removes padding, i.e. every
  expert with rows has at most 64 (:func:`small_tile_fits`): beyond that its MMA time is never
  less (above), and what else differs between the tiles in the fused-layer model is the
  granularity of its comm / GEMM pipeline (m-tiles as chunks), which the model prices without
  the per-tile costs (waits, epilogues) that finer chunks bring.  So: ``tile_m = 64`` when every
  expert has at most 64 rows and the model does not predict it slower, else 128
  (tests/test_small_tile.py checks the rule).

:func:`choose_tile` applies it to the fused-layer model (comet.tune.model.pipeline, the tuner's
model path); comet.tune.model.decode applies :func:`pick_tile` to its decode-regime kernels.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Tuple

from .gemm import DEFAULT_TILE, SMALL_TILE, _tile, gemm_tiles  # noqa: F401 (SMALL_TILE: public)
from .hardware import GpuSpec
from .pipeline import choose_band, choose_n_comm, predict
from .shape import MoEShape, expert_rows

# The tiles the CUDA kernels are compiled for (csrc/cuda/launch.h: kTileMs x kTileN).
CUDA_TILES: Tuple[Tuple[int, int], ...] = (DEFAULT_TILE, SMALL_TILE)

# Pipeline stages of the sm_90a 16-bit mainloop per tile_m (csrc/cuda/fused_sm90.cuh:
# GemmConfig::kStages), and the weight bytes one stage holds (128 columns x 64 k-values x 2
# bytes; FP8: 128 x 128 x 1, the same 16 KiB).
STAGES = {DEFAULT_TILE[0]: 5, SMALL_TILE[0]: 8}
WEIGHT_STAGE_BYTES = 16 * 1024
# Time from a block's load request to its data under a full weight stream (assumption, not
# measured): what Little's law divides the bytes in flight by.
HBM_LATENCY_S = 1e-6


def padded_rows(rows: Iterable[float], tile_m: int) -> float:
    """Rows the m-tiles of experts with ``rows`` rows compute: ``sum ceil(r / tile_m) tile_m``."""
    return float(sum(math.ceil(r / tile_m - 1e-9) * tile_m for r in rows if r > 0))


def stream_rate(spec: GpuSpec, in_flight: float) -> float:
    """HBM bytes/s of one streaming block (one per SM) with ``in_flight`` bytes outstanding: its
    SM's share of HBM, or its bytes in flight over the HBM latency (Little's law), whichever is
    less. Both are assumptions; tools/hbm_stream.py measures the rate on a GPU beside this."""
    return min(spec.hbm_bw / spec.sm_count, in_flight / HBM_LATENCY_S)


def block_stream_rate(spec: GpuSpec, tile_m: int) -> float:
    """HBM bytes/s one GEMM block streams weights at (:func:`stream_rate`), its pipeline stages'
    weight bytes in flight."""
    return stream_rate(spec, STAGES.get(int(tile_m), STAGES[DEFAULT_TILE[0]]) * WEIGHT_STAGE_BYTES)


def pick_tile(options: Sequence[Tuple[Tuple[int, int], float, float, float]]) -> Tuple[int, int]:
    """The tile of ``options`` ``(tile, seconds, tiles, padded rows)`` with the least seconds;
    ties (within 1e-9 relative) to fewer tiles, then fewer padded rows, then the larger tile."""
    best = min(t for _, t, _, _ in options)
    tied = [o for o in options if o[1] <= best * (1 + 1e-9)]
    return min(tied, key=lambda o: (o[2], o[3], -o[0][0]))[0]


def small_tile_fits(rows: Iterable[float]) -> bool:
    """Whether the 64-row tile removes padding: every expert with rows has at most 64."""
    return max((r for r in rows if r > 0), default=0.0) <= SMALL_TILE[0] + 1e-9


def choose_tile(shape: MoEShape, spec: GpuSpec, layer: int, max_blocks: Optional[int] = None,
                tiles: Sequence[Tuple[int, int]] = CUDA_TILES) -> Tuple[int, int]:
    """The tile (of ``tiles``) the model runs ``layer`` fastest with, each at its own best
    ``n_comm`` and band (module doc: :func:`pick_tile`'s order breaks ties)."""
    total = spec.max_blocks if max_blocks is None else min(spec.max_blocks, int(max_blocks))
    rows = expert_rows(shape)
    options = []
    for tile in tiles:
        tile = _tile(tile)
        if tile[0] < DEFAULT_TILE[0] and not small_tile_fits(rows):
            continue
        n = choose_n_comm(shape, spec, layer, max_blocks=total, tile=tile)
        band = choose_band(shape, spec, n, tile, n_blocks=total) if layer == 1 else None
        t = predict(shape, spec, n, layer, tile, n_blocks=total, band=band)["fused"]
        per_col, cols = gemm_tiles(shape, layer, tile)
        options.append((tile, t, float(per_col * cols), padded_rows(rows, tile[0])))
    return pick_tile(options)
