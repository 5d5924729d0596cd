"""Cost model for Comet's fused MoE operators: how to split a GPU between comm and GEMM blocks.

Each of the two ops (``moe_layer0``: dispatch + first expert GroupGEMM; ``moe_layer1``: second
GroupGEMM + weighted top-k reduce + combine) is one persistent kernel with one block per SM:
``n_comm`` blocks move token rows between ranks, the other ``n_gemm = n_blocks - n_comm`` blocks run
GEMM tiles, overlapped at tile granularity.  The model predicts the time of both parts and of
their pipeline as a function of ``n_comm`` (and of the GEMM tile shape), so that
:func:`choose_n_comm` can pick a split when nothing was measured.  It is pure Python (no torch, no
compiled code) and cheap: a full search over ``n_comm`` takes milliseconds.

This module is the model's one public face: every name below comes from one of its parts, in
comet/tune/model/, each documenting what it models (a part imports only the parts listed before it):

* ``hardware`` -- the GPUs: :class:`GpuSpec`, :data:`GPUS`, the CPU backend's pseudo-spec.
* ``fp8`` -- FP8 operands: the bytes their rows and blocks carry with the scales, and the
  blockwise scaling's promotion on the CUDA cores (derived from the kernels' code).
* ``shape`` -- the problem: :class:`MoEShape` (one rank's view of one layer), the dtypes, what
  uniform routing gives every part (:func:`hit_probability`, :func:`expert_rows`).
* ``tp`` -- expert tensor parallelism: the rows of its two paths ("direct", "group") per link.
* ``gemm`` -- the grouped GEMM: tiles, waves, layer1's bands and the HBM sweeps of its operands
  (:func:`gemm_time`).
* ``one_node`` -- the rows one rank moves in one NVLink domain (:func:`remote_rows`,
  :func:`local_rows`).
* ``nodes`` -- several nodes: the rows by link (NVLink, NIC, the relays' mirrors:
  :func:`node_traffic`) and a comm block's NIC rate.
* ``comm`` -- the comm blocks' time, alpha-beta, one node and across nodes (:func:`comm_time`),
  the per-call prologue and combine, and the choice of a TP path.
* ``pipeline`` -- comm and GEMM overlapped in the fused kernel: :func:`predict`,
  :func:`choose_n_comm`, :func:`choose_band`.
* ``backward`` -- a training step's second half: :func:`predict_backward`.
* ``activation`` -- the activation between the ops, separate or fused into layer0's epilogue:
  :func:`predict_activation`.
* ``small_tile`` -- which of the CUDA kernels' two tiles (128 or 64 rows) a layer runs with:
  padding, MMA share and the per-block weight stream (read as comet.tune.model.small_tile, not
  re-exported here).
* ``decode`` -- a whole layer at 1-256 tokens per rank, bound by the weight stream: the fused
  layer as built, the unfused low-latency chain and the limit (``--table decode``; read as
  comet.tune.model.decode, not re-exported here).

Skewed routing enters as measured counts (``MoEShape.expert_rows``, ``MoEShape.remote_rows``);
comet.plan.skew measures each rank's counts under a placement and prices the slowest rank with
this model.

What it leaves out: per-tile mainloop efficiency (so it cannot rank tile shapes on its own: the
tile is an input; only the CUDA kernels' 64-row tile is charged an assumed MMA share,
``gemm.SMALL_TILE_MMA_SHARE``, for ``small_tile``'s choice between their two tiles), L2 effects beyond the A sweeps (``gemm``), NVLink contention between ranks, load imbalance beyond the measured
counts, launch overheads; across nodes: message-rate limits of small puts (layer1 is modelled as
if its partials leave in messages of at least a row; per-N-tile slices of 256 bytes would be
message-rate bound), switch congestion beyond rail alignment, the PCIe path between GPU and NIC,
and the extra HBM traffic of the NIC's writes.  Constants marked "assumption" are to be calibrated by measurement; the
measured autotuner (comet.tune.tuner.tune) overrides the model wherever it has run.
"""

from __future__ import annotations

from .model.activation import activation_kernel_time, predict_activation
from .model.backward import predict_backward, weight_grad_time
from .model.comm import (GRID_BARRIER_S, KERNEL_GAP_S, PROLOGUE_BARRIERS, PROLOGUE_LAUNCHES,
                         _comm_parts, block_link_rate, choose_tp_path, combine_time,
                         comm_saturation_blocks, comm_split, comm_time, prologue_time,
                         resolve_tp_path, tp_alternatives)
from .model.fp8 import (FP8_OUT_BYTES, FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK, FP8_SCALE_BLOCK,
                        FP8_SCALE_BYTES, fp8_promotion_charged, fp8_promotion_seconds,
                        fp8_scale_bytes)
from .model.gemm import (DEFAULT_TILE, L2_REUSE_FRACTION, _tile, _tile_seconds, a_sweeps,
                         band_width, gemm_dims, gemm_tiles, gemm_time, max_band, raster_group,
                         weight_reads)
from .model.hardware import (COPY_UNROLL, CPU, GPUS, GpuSpec, cpu_spec, get_spec,
                             spec_from_device_name)
from .model.nodes import (block_nic_rate, expected_distinct_nodes, internode_bytes, internode_rows,
                          intranode_bytes, intranode_rows, node_traffic)
from .model.one_node import local_rows, remote_rows, traffic_bytes
from .model.pipeline import BAND_SLACK, choose_band, choose_n_comm, predict
from .model.shape import (DTYPE_BYTES, TP_PATHS, MoEShape, NodeTraffic, dtype_bytes, dtype_name,
                          expected_distinct_ranks, expert_rows, hit_probability)
from .model.tp import BUILT_TP_PATH, TP_PATH_SLACK, tp_traffic

__all__ = [
    "GpuSpec", "GPUS", "CPU", "cpu_spec", "get_spec", "spec_from_device_name", "MoEShape",
    "DTYPE_BYTES", "dtype_bytes", "hit_probability", "expected_distinct_ranks",
    "expected_distinct_nodes", "NodeTraffic", "node_traffic", "internode_rows", "intranode_rows",
    "internode_bytes", "intranode_bytes", "expert_rows", "remote_rows", "local_rows",
    "traffic_bytes", "gemm_dims", "gemm_tiles", "comm_time", "comm_split", "block_nic_rate",
    "comm_saturation_blocks", "gemm_time", "predict", "prologue_time", "combine_time",
    "choose_n_comm", "choose_band", "max_band", "a_sweeps", "weight_reads", "raster_group",
    "band_width", "DEFAULT_TILE", "BUILT_TP_PATH", "TP_PATHS", "TP_PATH_SLACK", "tp_traffic",
    "choose_tp_path", "resolve_tp_path", "tp_alternatives", "dtype_name", "fp8_scale_bytes",
    "FP8_SCALE_BLOCK", "FP8_SCALE_BYTES", "FP8_OUT_BYTES",
    "FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK", "fp8_promotion_charged", "fp8_promotion_seconds",
    "weight_grad_time", "predict_backward", "activation_kernel_time", "predict_activation",
]
# Not in __all__ but read as perfmodel.<name> by the tests and tools: the model's constants, a
# comm block's link rate, and the helpers tests/test_perfmodel.py checks on their own.
_ALSO = (COPY_UNROLL, KERNEL_GAP_S, GRID_BARRIER_S, PROLOGUE_BARRIERS, PROLOGUE_LAUNCHES,
         L2_REUSE_FRACTION, BAND_SLACK, block_link_rate, _tile, _tile_seconds, _comm_parts)
