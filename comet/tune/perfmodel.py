"""Cost model for Comet's fused MoE operators: how to split a GPU between comm and GEMM blocks.

Each of the two ops (``moe_layer0``: dispatch + first expert GroupGEMM; ``moe_layer1``: second
GroupGEMM + weighted top-k reduce + combine) is one persistent kernel with one block per SM:
``n_comm`` blocks move token rows between ranks, the other ``n_gemm = n_blocks - n_comm`` blocks run
GEMM tiles, overlapped at tile granularity.  This module predicts the time of both parts and of
their pipeline as a function of ``n_comm`` (and of the GEMM tile shape), so that
:func:`choose_n_comm` can pick a split when nothing was measured.  It is pure Python (no torch, no
compiled code) and cheap: a full search over ``n_comm`` takes milliseconds.

The model, per rank and per layer (all times in seconds)
-------------------------------------------------------
Traffic (:func:`remote_rows`, :func:`local_rows`), uniform routing, top-k over distinct experts,
``E_l = E / W`` local experts, every rank holding ``T`` tokens:

* layer0 pulls one row of ``H`` elements per (token, slot) routed here from a remote rank:
  ``R0 = T * k * (W - 1) / W`` rows; the ``T * k / W`` local rows are copied into the shared tensor
  by the same comm blocks (HBM read + write).
* layer1 sends one partial row of ``H`` elements per (token, remote destination rank):
  ``R1 = T * (W - 1) * p_hit`` with ``p_hit = 1 - C(E - E_l, k) / C(E, k)`` the probability that a
  token has at least one slot on a given rank, i.e. ``R1 = T * d`` with ``d`` the expected number of
  distinct remote ranks per token.  Comm blocks also read all ``M = T * k`` GEMM output rows and
  write the ``T * p_hit`` local partials (HBM); the home rank finally sums its partials (HBM).
* The "2 * T * d * H * bytes / link_bw" of docs/peers.md ("The limit of overlap") is the two
  layers together: ``R0 + R1`` is ``2 * T * d`` when a token's slots land on distinct ranks.
* Measured counts replace the expectations: ``MoEShape.remote_rows`` (rows this rank moves over the
  links for the layer) and ``MoEShape.expert_rows`` (GEMM rows per local expert).

Several nodes (MoNTA-style: intra- and inter-node links separately, :func:`node_traffic`):
``MoEShape.ranks_per_node = P`` groups the ``W`` ranks into ``n = W / P`` nodes; same-node peers
are reached over NVLink by pointer, other nodes over the GPU's own NIC (one per GPU,
rail-aligned; ``GpuSpec.nic_gbs`` per direction, ``nic_eff``, ``nic_latency_us``).  Of the
``R`` remote rows above, ``R (P - 1) / (W - 1)`` stay in the node, ``F = R (W - P) / (W - 1)``
involve other nodes:

* layer0, node-first dispatch (csrc/include/comet/topology.h, ``node_first=True``): a token
  crosses to a remote node once if any of its k slots lands there, into the mirror on the relay
  (the rank of that node with the source's local index), then fans out inside the node.  NIC rows
  ``T (n - 1) q`` with ``q = 1 - C(E - E/n, k) / C(E, k)`` (:func:`hit_probability` with nodes
  for ranks: ``(n - 1) q`` is the expected number of distinct remote nodes per token), at most
  the flat ``F = T k (W - P) / W`` (union bound), strictly less for ``k >= 2`` with several
  experts per node.  The ``F`` slot rows are then read from mirrors: ``F (P - 1) / P`` over
  NVLink from a same-node relay, ``F / P`` from this rank's own mirror (HBM, read + write).
* layer0, flat (``node_first=False``, MoNTA's plain all-to-all): ``F`` slot rows over the NIC,
  fetched by the destination like a same-node pull (two index round trips over the NIC per
  m-tile), landing in place (no fan-out).
* layer1 per rank (``node_reduce=False``, the default): ``F`` partial rows over the NIC, one per
  (token, sending rank) to a home on another node, put by the comm blocks as they reduce (inside
  the fused kernel); results bitwise equal to one node.
* layer1 node-reduced (``node_reduce=True``, ``Buffer(node_reduce=True)``): the ``F`` rows go
  over NVLink (``F (P - 1) / P``) or into this rank's own stage (``F / P``) to the home's relay on
  this node; the relay sums them and puts one row per (token, node): ``T (n - 1) q`` NIC rows (as
  node-first layer0), at most ``F``.  The relay runs in the combine kernel after the fused
  kernel, on every SM, so its NIC time (at the full NIC rate) and the read of its staged rows
  (HBM) are added to the tail: fewer NIC bytes, but not overlapped with the GEMM.
* With one node (``P = W``, the default) nothing crosses a NIC and every formula below is the
  single-node one, bit for bit (tests/data/perfmodel_one_node.json holds its predictions).
* A measured ``remote_rows`` is split in the same proportions.

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

GEMM (roofline with wave quantisation, :func:`gemm_time`): the grouped GEMM has
``tiles = sum_e ceil(M_e / tile_m) * ceil(n_out / tile_n)`` output tiles, a tile costs
``t_tile = 2 * tile_m * tile_n * K / (peak_flops * gemm_eff / sm_count)`` on one SM (padded rows
cost like real ones), the GEMM blocks run ``waves = ceil(tiles / n_gemm)`` rounds, and the
operands must stream from HBM, of which the GEMM blocks get their per-SM share (the comm blocks use
HBM too)::

    gemm(n) = max(waves(n) * t_tile, bytes / (hbm * hbm_eff * n / sm_count))

``bytes`` counts the local experts' weights and the output once and the A operand (layer0's
``a``, layer1's ``h``) :func:`a_sweeps` times: layer0 runs all n-tiles of an m-tile together (one
sweep); layer1 runs column bands of ``b`` n-tiles, m-major inside a band, and reads h once per
band, ``ceil(n_out / tile_n / b)`` sweeps, unless h fits ``L2_REUSE_FRACTION`` of the L2
(``GpuSpec.l2_mb``: 50 MB on H100/H800) -- b = 1, plain column order, reads Mixtral's 235 MB h
32 times (7.5 GB, 2.8 ms at H800's 3.35 TB/s x hbm_eff against 1.3 ms of tensor-core work).  A
band's W1 columns of the experts live at once must fit the same share of L2
(:func:`max_band`).  :func:`choose_band` picks b (the fewest sweeps among the bands whose
pipelined kernel is within ``BAND_SLACK`` of the fastest: a wider band starts the comm blocks
later).  The unfused baseline's GEMM is charged one sweep (an L2-friendly raster).  At a fixed
band both terms are non-increasing in ``n``, hence so is ``gemm``: more SMs never make it
slower.  ``n_out, K`` are ``N, H`` for layer0
(``[M, H] x [H, N0]``) and ``H, N`` for layer1 (``[M, N1] x [N1, H]``).

Pipeline (``fused``, :func:`predict`): a two-stage in-order pipeline (a two-machine flow shop);
for chunks ``i`` with producer times ``p_i`` and consumer times ``c_i`` the makespan is
``max_j (sum_{i<=j} p_i + sum_{i>=j} c_i)``, between ``max(P, C)`` and ``P + C``.  With ``K`` equal
chunks it is ``max(P, C) + min(P, C) / K``: perfect overlap plus one non-overlappable head or tail
chunk.

* layer0: comm produces, GEMM consumes.  Chunks are the source ranks in ring order (local rows
  first, so the GEMM starts on local tiles at once while remote rows are in flight), each cut into
  pieces of about one M-tile per local expert; a chunk's GEMM share is proportional to its rows.
  At least one tile time remains after the last row has arrived.
* layer1: GEMM produces bands of ``b`` N-tile columns (m-major across all local experts inside a
  band); the band ending at column ``c`` is complete after ``ceil((c + 1) * tiles_per_column /
  n_gemm)`` waves; comm blocks then reduce and send its columns' slice of every row (``1 /
  columns`` of the comm work per column), in order.

``predict`` returns ``comm``, ``gemm`` (this split), ``fused``, ``sequential = comm + gemm`` (same
split, no overlap), ``baseline = comm_full + gemm_full`` (unfused: each part alone on the whole
GPU, one after the other, like torch + NCCL) and ``limit = max(comm_full, gemm_full)`` (perfect
overlap with every SM serving both; no split reaches it).  Always
``limit <= fused <= sequential``.

Expert tensor parallelism (``MoEShape.tp_size = t``, :func:`tp_traffic`): TP-innermost ranks,
``EP = W / t`` expert-parallel groups, each rank holding ``1 / t`` of every local expert's N
columns (``N`` is the shard).  Each layer has two ways to move its rows, derived in the section
"Expert tensor parallelism" below: layer0 sends every slot row to each of the t ranks ("direct")
or each token once per EP rank and then all-gathers inside the TP group ("group", MoNTA's
split); layer1 sends t partial rows home ("direct") or reduce-scatters over H inside the group
and sends H / t columns home ("group").  The model computes both paths' rows per link and takes
the group path where its comm alone is shorter by more than ``TP_PATH_SLACK``, else direct
(:func:`choose_tp_path`); ``predict`` reports it.

FP8 (``dtype_bytes = 1``, section "FP8" below): layer0's rows carry H bytes plus 4 ceil(H / 128)
scale bytes; layer1's partials stay bf16 (the output dtype); the GEMM runs at
``GpuSpec.fp8_tflops`` (the datasheets' dense FP8 figure, 2x bf16 on sm_90) on FP8 operands with
their scales and a bf16 output, plus the blockwise scaling's promotion on the CUDA cores:

* What the kernels do.  Both FP8 kernels run each 128-wide k-tile (exactly one scale block,
  ``FP8_SCALE_BLOCK``) into a partial accumulator on the tensor cores and then promote it into
  the fp32 accumulator with one FP32 FMA per accumulator element, ``acc += partial * scale``.
  sm_90a (csrc/cuda/fused_sm90.cuh, ``Fp8GemmConfig``: CUTLASS's blockwise FP8 mainloop, tiles
  128 x 128 x 128): ``mma()`` of sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp
  issues the k-tile's wgmmas into the partial (``ScaleOut::Zero`` first: a fresh partial per
  k-tile, since ``ScalePromotionInterval = 128 / 32 = 4`` MMAs is one k-tile), then
  ``warpgroup_wait<0>()``, then ``GmmaFP8Accumulation::scale_core`` (fp8_accumulation.hpp):
  ``accum(i) += accum_temp(i) * scale(i)`` for every element, the row's A scale already
  multiplied by the tile's B scale (``ScaleMsPerTile = 128``, ``ScaleNsPerTile = 1``: a few
  multiplies per thread, not per element).  sm_89 (csrc/cuda/sm89_fp8_tile_gemm.cuh):
  ``acc(i) = fmaf(part(i), row_scale * b_scale, acc(i))`` per element after each k-tile's
  mma.sync (the scale product is per row, shared by a thread's elements of that row).
* Why it is not overlapped with the tensor cores.  The sm_90a kernel uses the cooperative
  schedule (``KernelTmaWarpSpecializedCooperativeFP8Blockwise``): both MMA warpgroups compute
  halves of the same tile from the same pipeline stage, so they reach the promotion together,
  and each must wait for its wgmmas (the FMAs read the partial they write) and must finish the
  FMAs before issuing the next k-tile's wgmmas (which overwrite that partial).  So while an SM
  promotes, none of its wgmmas is in flight (only the ping-pong schedule, which staggers two
  warpgroups on different tiles, would hide it).  On sm_89 a warp's FMAs likewise wait for its
  mma.sync results and precede its next k-tile's; other warps may overlap, so there the charge
  is an upper bound (3% of the k-tile, below).
* The charge.  An FP8 GEMM ``[M, N, K]`` costs
  ``2 M N K / (fp8_rate * gemm_eff) + FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK * M N ceil(K / 128)
  / fma_rate`` with ``fma_rate = GpuSpec.fma_rate`` (``fp32_tflops / 2``: the datasheets count an
  FMA as 2 FLOPs), i.e. a tile costs ``t_tile + tile_m tile_n ceil(K / 128) / (fma_rate /
  sm_count)`` on its SM (``gemm_eff`` stays on the tensor-core part).  Per 128 x 128 x 128
  k-tile at peak rates the promotion takes ``(128 * 128 / (67e12 / 2)) / (2 * 128^3 / 1979e12)
  = 0.49 ns / 2.12 ns = 0.23`` of the tensor-core time on H100 / H800 / H200 (0.17 of the
  modelled k-tile at gemm_eff 0.75), H20 ``(128^2 / 22e12) / (2 * 128^3 / 296e12) = 0.05``, L20
  ``(128^2 / 29.9e12) / (2 * 128^3 / 239e12) = 0.03`` (FP8 tensor-core FLOP/s are 30x the FP32
  FLOP/s on H100, 4x on L20).
* Not charged: GPUs without FP8 tensor cores (``fp8_tflops`` None: no FP8 kernel; the bf16 rate
  stands for a loader that dequantises) and the CPU backend's pseudo-spec
  (``fp8_promotion=False``: its tile, csrc/cpu/tile_gemm.h, does the block scaling with the same
  fp32 units as every other multiply-add, one more per 128 of the dot product, inside its
  figure).

What it leaves out: per-tile mainloop efficiency (so it cannot rank tile shapes on its own: the
tile is an input), L2 effects beyond the A sweeps above, NVLink contention between ranks, load imbalance beyond the measured
counts, launch overheads; across nodes: message-rate limits of small puts (layer1 is modelled as
if its partials leave in messages of at least a row; per-N-tile slices of 256 bytes would be
message-rate bound), switch congestion beyond rail alignment, the PCIe path between GPU and NIC,
and the extra HBM traffic of the NIC's writes.  Constants marked "assumption" are to be calibrated by measurement; the
measured autotuner (comet.tune.tuner.tune) overrides the model wherever it has run.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

__all__ = [
    "GpuSpec",
    "GPUS",
    "CPU",
    "cpu_spec",
    "get_spec",
    "spec_from_device_name",
    "MoEShape",
    "DTYPE_BYTES",
    "dtype_bytes",
    "hit_probability",
    "expected_distinct_ranks",
    "expected_distinct_nodes",
    "NodeTraffic",
    "node_traffic",
    "internode_rows",
    "intranode_rows",
    "internode_bytes",
    "intranode_bytes",
    "expert_rows",
    "remote_rows",
    "local_rows",
    "traffic_bytes",
    "gemm_dims",
    "gemm_tiles",
    "comm_time",
    "comm_split",
    "block_nic_rate",
    "comm_saturation_blocks",
    "gemm_time",
    "predict",
    "prologue_time",
    "combine_time",
    "choose_n_comm",
    "choose_band",
    "max_band",
    "a_sweeps",
    "weight_reads",
    "raster_group",
    "band_width",
    "DEFAULT_TILE",
]

DEFAULT_TILE: Tuple[int, int] = (128, 128)

# Independent 16-byte loads in flight per thread in layer0's row copy: kCopyUnroll of
# csrc/include/comet/copy.h (tests/test_perfmodel.py checks they agree).
COPY_UNROLL = 4

# The per-call prologue and the combine launch (seconds), estimated from the kernels' structure
# (csrc/cuda/prologue.cu, combine.cu; docs/design.md, "The per-call prologue"), not measured:
#   layer0: source kernel (send plan: count, scan (2 grid barriers), offsets, scatter: ~5 grid
#           barriers), begin kernel (metadata exchange: ~2 peer round trips), publish kernel
#           (m-tiles + layer0 order: ~6 grid barriers): 3 launches, ~11 grid barriers;
#   layer1: source (pair lists: ~5), begin, publish (m-tiles ~4 + reduce plan ~6): ~15 barriers,
#           plus the combine kernel's launch after the fused kernel.
# A grid barrier is an atomic arrival through L2 and a spin on the generation flag; each thread
# handles ~T*k/P elements (P = prologue threads, 4096 elements per block), a few passes.
KERNEL_GAP_S = 3e-6     # back-to-back launch on one stream (assumption)
GRID_BARRIER_S = 1.5e-6  # one grid-wide barrier of a prologue kernel (assumption)
PROLOGUE_BARRIERS = {0: 11, 1: 15}
PROLOGUE_LAUNCHES = {0: 3, 1: 3}

# ----------------------------------------------------------------------------------------------
# Hardware
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    """Per-GPU constants of the cost model (datasheet units; SI conversions as properties).

    ``link_gbs`` is the per-GPU bandwidth in one direction (NVLink: half the datasheet's
    bidirectional total; PCIe: half of the x16 bidirectional figure).  ``blocks_per_sm`` is the
    co-residency assumption of the persistent kernel (one block per SM, as Comet's kernels use all
    of an SM's shared memory), so at most ``sm_count * blocks_per_sm`` blocks can run at once.
    """

    name: str
    sm_count: int
    bf16_tflops: float  # dense tensor-core bf16/fp16 peak, TFLOP/s (no sparsity)
    fp32_tflops: float  # non-tensor fp32 peak, TFLOP/s (used for float32 operands)
    hbm_gbs: float  # device memory bandwidth, GB/s (1e9 B/s)
    link_gbs: float  # peer link bandwidth per GPU per direction, GB/s
    link_latency_us: float  # alpha: first remote row visible after this long (assumption)
    link: str = "nvlink"
    blocks_per_sm: int = 1
    # What one comm block moves over the link, derived from the kernel (see block_link_bw);
    # a number here overrides the derivation (used for the CPU backend's spec).
    block_link_gbs: Optional[float] = None
    comm_threads: int = 384  # threads of a comm block = the fused kernel's block (sm90 path 384, sm80 256)
    remote_load_us: float = 2.0  # round trip of a peer load under load (assumption; Little's law below)
    gemm_eff: float = 0.75  # fraction of tensor peak a tuned grouped GEMM mainloop reaches
    hbm_eff: float = 0.80  # achievable fraction of HBM bandwidth
    link_eff: float = 0.80  # achievable fraction of link bandwidth (DeepEP: ~160 of 200 GB/s on H800)
    block_hbm_gbs: Optional[float] = None  # one block's HBM copy rate; default 2 * hbm / sm_count
    source: str = ""
    # Inter-node link (the NIC, one per GPU, rail-aligned): per direction, GB/s; achievable
    # fraction; one-way latency of a put-with-signal (alpha of the inter-node part).
    nic_gbs: float = 50.0  # one 400 Gb/s NIC (ConnectX-7 NDR) per GPU
    nic_eff: float = 0.80  # DeepEP: 43 of ~50 GB/s at EP16 on H800; MoNTA: r1 = 0.74 (2 x 8 A800)
    nic_latency_us: float = 3.0  # put-with-signal over IB/RoCE, first byte visible (assumption)
    # What one comm block moves over the NIC (see block_nic_bw); a number here overrides it.
    block_nic_gbs: Optional[float] = None
    # Last-level (L2) cache, MB (1e6 B): decides how often layer1's GEMM re-reads h from HBM
    # (:func:`a_sweeps`).
    l2_mb: float = 50.0
    # Dense tensor-core FP8 (e4m3/e5m2) peak, TFLOP/s (no sparsity); None: no FP8 tensor cores
    # (sm_80: the model charges the bf16 rate, as for operands dequantised in the GEMM's loader).
    fp8_tflops: Optional[float] = None
    # Whether an FP8 GEMM on FP8 tensor cores pays the blockwise scaling's promotion: one FP32
    # FMA on the CUDA cores per output element and 128-wide K block, after the tensor cores
    # (section "FP8").  False for the CPU backend's pseudo-spec (its tile does every
    # multiply-add on the same fp32 units, so there is no second unit to charge).
    fp8_promotion: bool = True

    # -- derived, SI units --------------------------------------------------------------------
    @property
    def max_blocks(self) -> int:
        return self.sm_count * self.blocks_per_sm

    def peak_flops(self, nbytes: int = 2) -> float:
        """FLOP/s of the whole GPU for operands of ``nbytes`` bytes (4: fp32; 1: FP8 tensor cores
        where the GPU has them, else the bf16 rate; otherwise bf16/fp16 tensor cores)."""
        if nbytes >= 4:
            return self.fp32_tflops * 1e12
        if nbytes == 1 and self.fp8_tflops is not None:
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12

    @property
    def fma_rate(self) -> float:
        """FP32 FMAs per second of the whole GPU's CUDA cores: ``fp32_tflops`` is the
        datasheets' FP32 FLOP/s, which count an FMA as 2 FLOPs (H100 SXM: 132 SMs x 128 FP32
        lanes x 2 x 1.98 GHz = 67 TFLOP/s), so half of it."""
        return self.fp32_tflops * 1e12 / 2.0

    @property
    def hbm_bw(self) -> float:
        return self.hbm_gbs * 1e9 * self.hbm_eff

    @property
    def link_bw(self) -> float:
        return self.link_gbs * 1e9 * self.link_eff

    @property
    def block_link_bw(self) -> float:
        """Bytes/s one comm block moves over the link. Little's law: bytes in flight / latency.
        layer0's row copy (csrc/include/comet/copy.h, checked in the SASS by tools/sass_check.py)
        keeps COPY_UNROLL independent 16-byte loads in flight per thread, so a block has
        comm_threads * COPY_UNROLL * 16 bytes outstanding per remote round trip
        (sm90 path: 384 * 4 * 16 = 24 KiB / 2 us = 12.3 GB/s; sm80 path: 256 threads, 8.2 GB/s).
        layer1's partial stores do not wait for a round trip, so this bounds them from below."""
        if self.block_link_gbs is not None:
            return self.block_link_gbs * 1e9
        return self.comm_threads * COPY_UNROLL * 16 / (self.remote_load_us * 1e-6)

    @property
    def block_hbm_bw(self) -> float:
        if self.block_hbm_gbs is not None:
            return self.block_hbm_gbs * 1e9
        return 2.0 * self.hbm_gbs * 1e9 / self.sm_count

    @property
    def alpha(self) -> float:
        return self.link_latency_us * 1e-6

    @property
    def nic_bw(self) -> float:
        return self.nic_gbs * 1e9 * self.nic_eff

    @property
    def nic_alpha(self) -> float:
        return self.nic_latency_us * 1e-6

    @property
    def block_nic_bw(self) -> float:
        """Bytes/s one comm block moves over the NIC. Little's law again, with the NIC's round
        trip: a block keeps as many bytes of put-with-signal in flight as its copy loop keeps
        loads (comm_threads * COPY_UNROLL * 16 bytes; an assumption until the node-first kernel
        is measured) and a put completes after 2 * nic_latency_us
        (sm90 path: 24 KiB / 6 us = 4.1 GB/s; sm80 path: 2.7 GB/s).  Never more than
        block_link_bw while the NIC's latency is at least a peer load's round trip / 2: a row
        does not move faster over the NIC than over NVLink, per block or in aggregate."""
        if self.block_nic_gbs is not None:
            return self.block_nic_gbs * 1e9
        return self.comm_threads * COPY_UNROLL * 16 / (2.0 * self.nic_latency_us * 1e-6)

    def scaled(self, sm_count: int) -> "GpuSpec":
        """The same chip with ``sm_count`` SMs (e.g. a PCIe or MIG variant): flops scale with SMs."""
        if sm_count == self.sm_count:
            return self
        if sm_count < 1:
            raise ValueError(f"sm_count must be >= 1, got {sm_count}")
        f = sm_count / self.sm_count
        return replace(
            self,
            sm_count=sm_count,
            bf16_tflops=self.bf16_tflops * f,
            fp32_tflops=self.fp32_tflops * f,
            fp8_tflops=None if self.fp8_tflops is None else self.fp8_tflops * f,
            block_hbm_gbs=self.block_hbm_bw / 1e9,  # per-block rate is a property of the SM
        )


# Sources (figures as printed by NVIDIA; dense = without structured sparsity, i.e. half of the
# "with sparsity" figure; NVLink per direction = half of the bidirectional total).
# Inter-node (nic_*): NIC line rate per GPU per direction (400 Gb/s = 50 GB/s), from the DGX
# datasheets' NIC lists (one single-port NIC per GPU: rail-aligned) or DeepEP's test setup; the
# efficiency default 0.80 sits between DeepEP's 43/50 = 0.86 (EP16 over CX7 on H800) and MoNTA's
# measured r1 = 0.741 (2 x 8 A800, IB 200 Gb/s; used for the A100); latencies are assumptions.
GPUS: Dict[str, GpuSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 tensor 312 TFLOPS dense, FP32 19.5,
    # HBM2e 2,039 GB/s, NVLink 600 GB/s; NVIDIA A100 Tensor Core GPU Architecture whitepaper:
    # 108 SMs.  The sm80 kernel path: 256 threads per block, so less in flight per comm block.
    # No FP8 tensor cores (fp8_tflops None): FP8 operands are charged the bf16 rate.
    "a100": GpuSpec(
        "a100", 108, 312.0, 19.5, 2039.0, 300.0, 2.0, comm_threads=256,  # sm80 path
        gemm_eff=0.80, l2_mb=40.0,  # A100 whitepaper: 40 MB L2
        nic_gbs=25.0, nic_eff=0.74,  # DGX A100: one 200 Gb/s HDR NIC per GPU; MoNTA r1 = 0.741
        source="NVIDIA A100 datasheet (SXM4 80GB); A100 architecture whitepaper; DGX A100 "
               "datasheet (NICs); MoNTA (IB efficiency)",
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOPS with sparsity -> 989.5
    # dense, FP8 3,958 with sparsity -> 1,979 dense (2x bf16), FP32 67, HBM3 3.35 TB/s, NVLink
    # 900 GB/s; NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs on H100 SXM5.
    "h100": GpuSpec(
        "h100", 132, 989.5, 67.0, 3350.0, 450.0, 2.0, fp8_tflops=1979.0,
        l2_mb=50.0,  # H100 whitepaper: 50 MB L2 (H100 SXM5)
        nic_gbs=50.0,  # DGX H100: 8x ConnectX-7 400 Gb/s, one per GPU
        source="NVIDIA H100 datasheet (SXM); H100 architecture whitepaper; DGX H100 datasheet (NICs)",
    ),
    # NVIDIA H800 Tensor Core GPU datasheet (H800 SXM5): compute (BF16 1,979 / FP8 3,958 TFLOPS
    # with sparsity: 989.5 / 1,979 dense) and HBM3 3.35 TB/s as H100 SXM, NVLink 400 GB/s (MoNTA
    # table 5: 200 GB/s unidirectional; DeepEP measures ~155-160 GB/s).
    "h800": GpuSpec(
        "h800", 132, 989.5, 67.0, 3350.0, 200.0, 2.0, fp8_tflops=1979.0,
        l2_mb=50.0,  # the H100 SXM5 configuration of GH100 (H100 whitepaper: 50 MB L2)
        nic_gbs=50.0,  # DeepEP README: each H800 with a CX7 400 Gb/s NIC, ~50 GB/s
        source="NVIDIA H800 datasheet (SXM5); H100 architecture whitepaper (GH100, 132 SMs); "
               "DeepEP README (NIC per GPU, 43 GB/s measured at EP16)",
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 1,979 / FP8 3,958 TFLOPS with
    # sparsity, FP32 67, HBM3e 4.8 TB/s, NVLink 900 GB/s; same GH100 configuration as H100 SXM:
    # 132 SMs.
    "h200": GpuSpec(
        "h200", 132, 989.5, 67.0, 4800.0, 450.0, 2.0, fp8_tflops=1979.0,
        l2_mb=50.0,  # same GH100 configuration as H100 SXM5 (50 MB L2)
        nic_gbs=50.0,  # DGX H200: 8x ConnectX-7 400 Gb/s, one per GPU
        source="NVIDIA H200 datasheet (SXM); H100 architecture whitepaper; DGX H200 datasheet (NICs)",
    ),
    # NVIDIA HGX H20 product brief: FP16/BF16 tensor 148 TFLOPS dense, FP8 296, FP32 44, HBM3 4.0 TB/s,
    # NVLink 900 GB/s (MoNTA table 5: 450 GB/s unidirectional); 78 SMs as reported by the device
    # (one of the SM counts flux/Comet's release hard-codes: 92/108/78/132).
    "h20": GpuSpec(
        "h20", 78, 148.0, 44.0, 4000.0, 450.0, 2.0, fp8_tflops=296.0,
        l2_mb=50.0,  # assumption: GH100's 50 MB (not in the product brief)
        nic_gbs=50.0,  # assumption: built like HGX H100 (one 400 Gb/s NIC per GPU)
        source="NVIDIA HGX H20 product brief; device query (78 SMs); NIC per GPU assumed",
    ),
    # NVIDIA L20 datasheet: FP16/BF16 tensor 119.5 TFLOPS dense (239 with sparsity), FP8 239 dense
    # (478 with sparsity; Ada's FP8 mma.sync, sm_89), FP32 59.8,
    # GDDR6 864 GB/s, PCIe Gen4 x16 (64 GB/s bidirectional -> 32 GB/s per direction, no NVLink);
    # 11,776 CUDA cores / 128 per Ada SM (NVIDIA Ada GPU architecture whitepaper) = 92 SMs.
    # Peer traffic crosses PCIe: a longer round trip (assumption: 4 us), so less per block.
    "l20": GpuSpec(
        "l20", 92, 119.5, 59.8, 864.0, 32.0, 5.0, link="pcie", comm_threads=256,  # sm80 path
        fp8_tflops=239.0,
        remote_load_us=4.0, link_eff=0.75,
        l2_mb=96.0,  # Ada whitepaper: AD102's 96 MB L2 (assumption: L20 keeps all of it)
        nic_gbs=12.5, nic_latency_us=5.0,  # assumption: one 200 Gb/s NIC per two GPUs, via PCIe
        source="NVIDIA L20 datasheet; Ada architecture whitepaper (128 cores/SM); NIC assumed",
    ),
}

# Aliases accepted by get_spec().
_ALIASES = {
    "a100-sxm": "a100", "a100_sxm": "a100", "a100-80g": "a100", "sm80": "a100",
    "h100-sxm": "h100", "h100_sxm": "h100", "sm90": "h100",
    "h800-sxm": "h800", "h200-sxm": "h200",
}


def cpu_spec(
    threads: Optional[int] = None,
    gflops_per_thread: Optional[float] = None,
    mem_gbs: Optional[float] = None,
    measure: bool = False,
) -> GpuSpec:
    """Pseudo-spec of the CPU backend: OS threads play the blocks, shared memory the links.

    A rough placeholder, used only to pick a default split on the CPU (where the kernels are run
    for correctness, not speed).  ``threads`` (default: ``os.cpu_count()``, at least 2) plays the
    SM count; every dtype computes in fp32 through the backend's portable tile GEMM.  Figures come
    from the arguments, else the environment (``COMET_CPU_GFLOPS`` per thread,
    ``COMET_CPU_MEM_GBS``), else a quick measurement when ``measure`` is true (a single-threaded
    fp32 matmul and a memcpy through torch, ~0.1 s), else defaults of 8 GFLOP/s per thread and
    10 GB/s.  Peer "links" are memcpy between processes' shared-memory segments: half the memory
    bandwidth, ~3 GB/s per thread, 10 us to wake a waiting thread; "other nodes" (the CPU analog
    of the NIC: a proxy thread) a quarter of the memory bandwidth, 20 us (assumptions).
    """
    if threads is None:
        threads = os.cpu_count() or 2
    threads = max(2, int(threads))
    if gflops_per_thread is None and os.environ.get("COMET_CPU_GFLOPS"):
        gflops_per_thread = float(os.environ["COMET_CPU_GFLOPS"])
    if mem_gbs is None and os.environ.get("COMET_CPU_MEM_GBS"):
        mem_gbs = float(os.environ["COMET_CPU_MEM_GBS"])
    if measure and (gflops_per_thread is None or mem_gbs is None):
        g, m = _measure_cpu()
        gflops_per_thread = g if gflops_per_thread is None else gflops_per_thread
        mem_gbs = m if mem_gbs is None else mem_gbs
    gflops_per_thread = 8.0 if gflops_per_thread is None else float(gflops_per_thread)
    mem_gbs = 10.0 if mem_gbs is None else float(mem_gbs)
    tflops = threads * gflops_per_thread / 1e3
    return GpuSpec(
        name="cpu",
        sm_count=threads,
        bf16_tflops=tflops,
        fp32_tflops=tflops,
        fp8_tflops=tflops,  # the CPU backend dequantises FP8 and computes in fp32
        # ... on the same fp32 units, the block scaling included (csrc/cpu/tile_gemm.h: each
        # 128-wide K block's partial sum times its scales is one more multiply-add per 128 of
        # the dot product, inside the measured or placeholder figure): no separate charge
        fp8_promotion=False,
        hbm_gbs=mem_gbs,
        link_gbs=mem_gbs / 2.0,
        link_latency_us=10.0,
        link="shm",
        block_link_gbs=min(3.0, mem_gbs / 2.0),
        block_hbm_gbs=min(3.0, mem_gbs / 2.0),
        gemm_eff=1.0,
        hbm_eff=1.0,
        link_eff=1.0,
        # the CPU analog of other nodes: a proxy thread per rank copying puts (placeholder)
        nic_gbs=mem_gbs / 4.0,
        nic_eff=1.0,
        nic_latency_us=20.0,
        block_nic_gbs=min(1.5, mem_gbs / 4.0),
        l2_mb=2.0,  # placeholder: a core's L2 plus its share of the last-level cache
        source="placeholder for the CPU backend (configurable / measured), not a datasheet",
    )


def _measure_cpu() -> Tuple[float, float]:
    """(GFLOP/s of one thread's fp32 matmul, GB/s of a large copy), measured with torch."""
    import torch  # only here: the module itself must not need torch

    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = torch.randn(256, 256)
        b = torch.randn(256, 256)
        torch.mm(a, b)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            torch.mm(a, b)
            reps += 1
        gflops = 2 * 256**3 * reps / (time.perf_counter() - t0) / 1e9
        src = torch.empty(32 << 20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            dst.copy_(src)
            reps += 1
        mem = 2 * src.numel() * reps / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(prev)
    return gflops, mem


# The default CPU pseudo-spec (see cpu_spec: a placeholder used to pick a default on the CPU).
CPU: GpuSpec = cpu_spec()


def spec_from_device_name(name: str) -> Optional[str]:
    """Map a CUDA device name (``torch.cuda.get_device_name``) to a key of :data:`GPUS`, or None."""
    n = name.upper().replace("NVIDIA", " ")
    tokens = n.replace("-", " ").replace("_", " ").split()
    # Most specific first: "H200" and "H20" share a prefix, as do "L20" and "L20S"-like names.
    for key, pat in (("h200", "H200"), ("h800", "H800"), ("h100", "H100"), ("h20", "H20"),
                     ("a100", "A100"), ("l20", "L20")):
        if any(t == pat or t.startswith(pat) and not t[len(pat):len(pat) + 1].isdigit()
               for t in tokens):
            return key
    return None


def get_spec(arch: str, sm_count: Optional[int] = None) -> Optional[GpuSpec]:
    """Spec for ``arch`` (a key of :data:`GPUS`, an alias, ``"cpu"`` or a device name), or None.

    With ``sm_count`` given and different from the table's, the spec is scaled to it (CPU: the
    number of threads).
    """
    a = str(arch).strip().lower()
    if a == "cpu":
        return cpu_spec(threads=sm_count) if sm_count else CPU
    a = _ALIASES.get(a, a)
    spec = GPUS.get(a)
    if spec is None:
        k = spec_from_device_name(arch)
        spec = GPUS.get(k) if k else None
    if spec is not None and sm_count:
        spec = spec.scaled(int(sm_count))
    return spec


# ----------------------------------------------------------------------------------------------
# Problem shape and traffic
# ----------------------------------------------------------------------------------------------

# "fp8": float8_e4m3fn or float8_e5m2 operands with float32 scales, one per 1 x 128 values of a
# row (x, h) and one per 128 x 128 block of a weight (comet.fp8's format; see the FP8 section).
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "e4m3": "fp8",
                  "e5m2": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def dtype_name(dtype) -> str:
    """Canonical dtype name, "bf16", "fp16", "fp32" or "fp8" (torch names or a torch.dtype too)."""
    s = str(dtype).replace("torch.", "").strip().lower()
    s = _DTYPE_ALIASES.get(s, s)
    if s not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of bf16, fp16, fp32, fp8")
    return s


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype`` ("bf16"/"fp16"/"fp32"/"fp8", torch names or a torch.dtype)."""
    return DTYPE_BYTES[dtype_name(dtype)]


@dataclass(frozen=True)
class MoEShape:
    """One rank's view of one layer.

    ``W`` ranks, ``E`` experts (``W`` divides ``E``), top-``k``, hidden size ``H`` (the width of
    every row that crosses the links), ``N`` the per-expert GEMM size that is not ``H`` (layer0:
    output columns ``N0``, e.g. ``2 * ffn`` for a gated FFN; layer1: reduction size ``N1 = ffn``),
    ``T`` tokens per rank, ``dtype_bytes`` per element (1: FP8 operands with their scales, see the
    module's section "FP8").  Optional measurements replace the
    uniform-routing expectations: ``remote_rows`` (rows this rank moves over the links for this
    layer: layer0 rows received, layer1 partial rows sent) and ``expert_rows`` (GEMM rows of each
    local expert, ``E / W`` values).  ``partial_bytes`` is the element size of layer1's partial
    rows (default: ``dtype_bytes``).

    ``ranks_per_node`` groups the ranks into ``W / ranks_per_node`` nodes (rank r on node
    ``r // ranks_per_node``; default ``W``: one node, the model of a single NVLink domain).
    ``node_first`` (only used with several nodes) selects node-first dispatch: a token's row
    crosses to a remote node once, to the relay, and fans out inside that node
    (csrc/include/comet/topology.h); false models the flat all-to-all, every (token, slot) row
    over the NIC on its own.  ``node_reduce`` (only used with several nodes) models layer1's
    node-reduced combine (module doc).

    ``tp_size = t`` (expert tensor parallelism, :func:`tp_traffic`): the ``W`` ranks are
    TP-innermost, ``EP = W / t`` expert-parallel groups of ``t`` ranks; each rank holds a ``1 / t``
    shard of every expert of its EP rank, so ``N`` is then this rank's shard (``N0 / t`` or
    ``N1 / t``: the weight the rank holds, as the tuner's key sees it) and ``E_local = E / EP``.
    ``tp_path`` picks how rows reach the TP group: "direct" or "group" (None: the model picks,
    :func:`choose_tp_path`).  With ``t > 1`` the model has no node-first relay and no node-reduced
    combine (``node_first`` is set false; ``node_reduce`` and a measured ``remote_rows`` are
    refused): the "group" path is the TP layout's own de-duplication.  ``t = 1`` is the model
    without TP, unchanged.
    """

    W: int
    E: int
    k: int
    H: int
    N: int
    T: int
    dtype_bytes: int = 2
    remote_rows: Optional[float] = None
    expert_rows: Optional[Tuple[float, ...]] = None
    partial_bytes: Optional[int] = None
    ranks_per_node: Optional[int] = None
    node_first: bool = True
    node_reduce: bool = False
    tp_size: int = 1
    tp_path: Optional[str] = None

    def __post_init__(self):
        for f in ("W", "E", "k", "H", "N"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"MoEShape.{f} must be >= 1, got {getattr(self, f)}")
        if self.T < 0:
            raise ValueError(f"MoEShape.T must be >= 0, got {self.T}")
        _check_tp(self)
        if self.E % self.ep_size:
            raise ValueError(f"W={self.W}" + (f" / tp_size={self.tp_size}" if self.tp_size > 1 else "")
                             + f" must divide E={self.E}")
        if self.k > self.E:
            raise ValueError(f"k={self.k} exceeds E={self.E}")
        rpn = self.W if self.ranks_per_node is None else int(self.ranks_per_node)
        if rpn < 1 or self.W % rpn:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1 and divide W={self.W}")
        object.__setattr__(self, "ranks_per_node", rpn)
        object.__setattr__(self, "node_first", bool(self.node_first))
        object.__setattr__(self, "node_reduce", bool(self.node_reduce))
        if self.expert_rows is not None:
            object.__setattr__(self, "expert_rows", tuple(self.expert_rows))
            if len(self.expert_rows) != self.E_local:
                raise ValueError(
                    f"expert_rows has {len(self.expert_rows)} entries, expected "
                    f"E/{'W' if self.tp_size == 1 else 'EP'}={self.E_local}")

    @property
    def ep_size(self) -> int:
        """Expert-parallel groups: ``W / tp_size``."""
        return self.W // self.tp_size

    @property
    def E_local(self) -> int:
        return self.E // self.ep_size

    @property
    def is_fp8(self) -> bool:
        return self.dtype_bytes == 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one input row (x, or a row on layer0's links): H elements, plus FP8's scales."""
        if self.is_fp8:
            return self.H * self.dtype_bytes + fp8_scale_bytes(self.H)
        return self.H * self.dtype_bytes

    @property
    def nodes(self) -> int:
        return self.W // self.ranks_per_node


def hit_probability(W: int, E: int, k: int) -> float:
    """P(a token has at least one of its k distinct experts on a given rank) = 1 - C(E-E_l,k)/C(E,k)."""
    el = E // W
    if E - el < k:
        return 1.0
    return 1.0 - math.comb(E - el, k) / math.comb(E, k)


def expected_distinct_ranks(W: int, E: int, k: int) -> float:
    """Expected number of distinct ranks a token's top-k slots land on (uniform routing)."""
    return W * hit_probability(W, E, k)


def expert_rows(shape: MoEShape) -> Tuple[float, ...]:
    """GEMM rows per local expert: measured, else ``W * T * k / E`` each (uniform routing)."""
    if shape.expert_rows is not None:
        return tuple(float(r) for r in shape.expert_rows)
    return (shape.W * shape.T * shape.k / shape.E,) * shape.E_local


def remote_rows(shape: MoEShape, layer: int, measured: Optional[float] = None) -> float:
    """Rows of ``H`` elements this rank moves over the links for ``layer`` (see module doc).

    layer0: ``T * k * (W - 1) / W`` rows received; layer1: ``T * (W - 1) * p_hit`` partial rows
    sent.  ``measured`` (or ``shape.remote_rows``) overrides the expectation.
    """
    _check_layer(layer)
    if measured is not None:
        return float(measured)
    if shape.remote_rows is not None:
        return float(shape.remote_rows)
    if shape.tp_size > 1:
        tr = tp_traffic(shape, layer)
        return tr.same_node + tr.nic
    W, T = shape.W, shape.T
    if layer == 0:
        return T * shape.k * (W - 1) / W
    return T * (W - 1) * hit_probability(W, shape.E, shape.k)


def expected_distinct_nodes(W: int, E: int, k: int, ranks_per_node: int) -> float:
    """Expected number of distinct nodes a token's top-k slots land on (uniform routing): a node
    hosts ``E / nodes`` experts, so this is :func:`expected_distinct_ranks` with nodes for ranks."""
    if ranks_per_node < 1 or W % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide W={W}")
    return expected_distinct_ranks(W // ranks_per_node, E, k)


class NodeTraffic(NamedTuple):
    """Rows of ``H`` elements one rank's comm blocks move for a layer, by the path they take
    (expected under uniform routing, or scaled from the measured ``remote_rows``).

    ``local``: copied inside this GPU (layer0: its own tokens' rows into the shared tensor;
    layer1: partials homed here).  ``same_node``: over NVLink to / from the other ranks of the node
    (layer0 pulls, layer1 partial stores).  ``nic``: over the inter-node link, per direction
    (layer0: rows pushed to other nodes -- one per (token, remote node) with node-first dispatch,
    one per (token, slot) without; by symmetry also what arrives; layer1: partial rows to homes on
    other nodes).  ``fanout_nvlink`` / ``fanout_local``: layer0 with node-first dispatch, the
    slot rows of other nodes' tokens this rank reads from the mirror of a same-node relay (over
    NVLink) or from its own mirror (it is the relay); layer1 node-reduced, the partial rows for
    homes on other nodes this rank stores into a same-node relay's stage or its own.
    """

    local: float
    same_node: float
    nic: float
    fanout_nvlink: float = 0.0
    fanout_local: float = 0.0

    @property
    def nvlink(self) -> float:
        """All rows over NVLink: same-node peers plus mirror reads."""
        return self.same_node + self.fanout_nvlink


def node_traffic(shape: MoEShape, layer: int) -> NodeTraffic:
    """Where this rank's rows go for ``layer`` (see :class:`NodeTraffic` and the module doc).

    With ``P = ranks_per_node``, ``n = W / P`` nodes and ``R`` = :func:`remote_rows` (rows to or
    from other ranks, any node): a share ``(P - 1) / (W - 1)`` of ``R`` stays in the node, the
    rest, ``F = R (W - P) / (W - 1)``, involves other nodes.  layer0 flat: ``F`` slot rows over the
    NIC.  layer0 node-first: ``T (n - 1) q`` token rows over the NIC, ``q = 1 - C(E - E/n, k) /
    C(E, k)`` (a token's probability of a slot on a given node), i.e. ``F`` times
    ``(n - 1) q / (k (W - P) / W)`` (<= 1, < 1 for k >= 2 with several experts per node); the
    ``F`` slot rows are then read from mirrors, ``1 / P`` of them from this rank's own.  layer1:
    ``F`` partial rows over the NIC (one per (token, sending rank)); node-reduced, ``T (n - 1) q``
    (one per (token, node), sent by the relays) after ``F`` rows into the relays' stages.
    One node: ``same_node = R``, nothing else moves -- the single-node model unchanged.
    """
    _check_layer(layer)
    if shape.tp_size > 1:
        return tp_traffic(shape, layer)
    R = remote_rows(shape, layer)
    loc = local_rows(shape, layer)
    W, P = shape.W, shape.ranks_per_node
    if P == W:
        return NodeTraffic(loc, R, 0.0)
    same = R * (P - 1) / (W - 1)
    far = R * (W - P) / (W - 1)
    n = shape.nodes
    tokens_far = (n - 1) * hit_probability(n, shape.E, shape.k)  # expected remote nodes per token
    if layer == 1:
        if not shape.node_reduce:
            return NodeTraffic(loc, same, far)
        # F = T (W - P) p_hit expected (token, remote rank) entries; the relays send one row
        # per (token, node) of the homes they relay: T (n - 1) q per rank.
        entries_far = (W - P) * hit_probability(W, shape.E, shape.k)
        nic = far * tokens_far / entries_far if entries_far > 0 else 0.0
        return NodeTraffic(loc, same, nic, far * (P - 1) / P, far / P)
    if not shape.node_first:
        return NodeTraffic(loc, same, far)
    slots_far = shape.k * (W - P) / W  # expected remote-node slots per token
    return NodeTraffic(loc, same, far * tokens_far / slots_far, far * (P - 1) / P, far / P)


def internode_rows(shape: MoEShape, layer: int) -> float:
    """Rows this rank moves over the NIC for ``layer`` (per direction)."""
    return node_traffic(shape, layer).nic


def intranode_rows(shape: MoEShape, layer: int) -> float:
    """Rows this rank moves over NVLink for ``layer`` (same-node peers and mirror reads)."""
    return node_traffic(shape, layer).nvlink


def internode_bytes(shape: MoEShape, layer: int) -> float:
    return internode_rows(shape, layer) * shape.H * _link_elem_bytes(shape, layer)


def intranode_bytes(shape: MoEShape, layer: int) -> float:
    return intranode_rows(shape, layer) * shape.H * _link_elem_bytes(shape, layer)


def local_rows(shape: MoEShape, layer: int) -> float:
    """Rows the comm blocks handle inside this GPU: layer0 local rows copied into the shared
    tensor (``M - remote``); layer1 partial rows whose home is this rank (``T * p_hit``)."""
    _check_layer(layer)
    if shape.tp_size > 1:
        return tp_traffic(shape, layer).local
    if layer == 0:
        return max(0.0, sum(expert_rows(shape)) - remote_rows(shape, 0))
    return shape.T * hit_probability(shape.W, shape.E, shape.k)


def traffic_bytes(shape: MoEShape, layer: int, measured: Optional[float] = None) -> float:
    """Bytes this rank moves over the links for ``layer``."""
    return remote_rows(shape, layer, measured) * shape.H * _link_elem_bytes(shape, layer)


def _link_elem_bytes(shape: MoEShape, layer: int) -> float:
    """Bytes per element of a row on ``layer``'s links (FP8: layer0 rows carry their scales,
    layer1's partials are the bf16 output; see the FP8 section)."""
    if layer == 1 and shape.partial_bytes is not None:
        return shape.partial_bytes
    if shape.is_fp8:
        return shape.row_bytes / shape.H if layer == 0 else FP8_OUT_BYTES
    return shape.dtype_bytes


def _check_layer(layer: int) -> None:
    if layer not in (0, 1):
        raise ValueError(f"layer must be 0 or 1, got {layer!r}")


# ----------------------------------------------------------------------------------------------
# Expert tensor parallelism (tp_size > 1): the two ways rows reach a TP group
# ----------------------------------------------------------------------------------------------
#
# Layout (docs/api.md): the W ranks are TP-innermost, rank r = ep * t + j (ep_rank = r // t,
# tp_rank j = r % t), EP = W / t; the E / EP experts of EP rank ep live on all its t ranks, rank j
# holding the j-th 1/t of each expert's N columns (w0 [E_l, N0/t, H], w1 [E_l, H, N1/t]).  Every
# rank brings T tokens (sequence-parallel).  With several nodes the TP groups lie inside a node
# (t divides P).  Per rank, uniform routing, rows of H elements per direction; p = 1 - C(E - E_l,
# k) / C(E, k) with E_l = E / EP (a token's probability of a slot on a given EP rank, so EP * p is
# the expected number of distinct EP ranks per token, <= k):
#
# layer0 (every rank of EP rank ep needs all M = t T k slot rows routed to ep's experts):
#   direct: each (token, slot) row is pulled by each of the t ranks of the slot's EP rank, as
#           without TP.  A source sends T k / EP slot rows to each rank: local T k / EP (own
#           tokens, HBM copy), over NVLink T k (P - 1) / EP, over the NIC T k (W - P) / EP.
#   group (MoNTA's split: cross-group traffic once, then an all-gather inside the group): source
#           (ep', j) sends each token once per EP rank it hits, to that EP rank's rank j (the same
#           tp index: rail-aligned), into a token stage: T p rows per (source, EP rank); then each
#           rank of the group pulls from its t - 1 peers the token rows they staged (EP T p
#           each) and every rank expands its staged tokens into its slot rows (HBM).  Rows:
#           own stage T p + expansion t T k (HBM copies, read + write), over NVLink
#           (P / t - 1) T p (cross-group, same node) + (t - 1) EP T p (all-gather), over the NIC
#           (W - P) / t * T p.  Two dependent hops: two link latencies.
#   One node: NVLink rows direct T k (W - 1) / EP, group T p (W - 1): the group path moves
#   EP p / k of direct's bytes (<= 1: it de-duplicates a token's slots per EP rank; k / EP slots
#   per token and EP rank versus p), at the price of the expansion copy.  Across nodes the NIC
#   rows shrink by EP p / (k t) <= 1 / t: a token crosses once per EP rank, not t times per slot.
#
# layer1 (rank (ep, j) has a partial of the output row of every token that hits ep, summed over
# its local slots and its 1/t of N; the home needs the sum over the t ranks and the EP ranks):
#   direct: every rank sends its partial row home: one per (token, home): local T p, over
#           NVLink (P - 1) T p, over the NIC (W - P) T p; the home's combine sums t EP p T rows.
#   group (reduce-scatter over H inside the TP group, then H / t columns home): rank j sends
#           column block j' of each of its W T p partial rows to peer j' ((t - 1) / t W T p
#           rows of NVLink), stages its own block (W T p / t rows, HBM write), sums the t blocks
#           of each token (reads W T p rows' worth, HBM) and sends its H / t columns home: local
#           T p / t, over NVLink (P - 1) T p / t, over the NIC (W - P) T p / t rows' worth; the
#           home's combine sums EP p T rows.  Two dependent hops: two link latencies.
#   One node: NVLink rows direct T p (W - 1), group T p (W - 1 / t): the group path moves more
#   (the reduce-scatter) and costs HBM; it pays across nodes, where the NIC rows drop t-fold.
#
# t = 1: both paths are the model without TP (EP = W, p = p_hit); the functions below are only
# called for t > 1, so the model's predictions for t = 1 are unchanged bit for bit.
#
# The choice (:func:`choose_tp_path`): each path's comm alone on the whole GPU (every link and
# the HBM side at its achievable rate, the links overlapping as in :func:`comm_time`); "group"
# wins only when it is shorter by more than TP_PATH_SLACK, else "direct".  :func:`tp_alternatives` reports both paths' rows per link.
# The pipeline (:func:`predict`) runs the chosen path's rows as today's streams: the group path's
# all-gather (layer0) is treated as rows available from the start once its extra latency is paid,
# which is optimistic about the second hop's dependency.

TP_PATHS = ("direct", "group")
# The group path must beat direct's comm by more than this fraction to be chosen: its second hop
# depends on the first, which the pipeline treats optimistically (see above), and it needs the
# TP group in step (a policy margin, not a measured constant).
TP_PATH_SLACK = 0.02

# The path comet's kernels implement (csrc/include/comet/layout.h, comm_layer1.h): layer0's tp ranks
# each pull every slot row from its source, layer1's t partial rows all go home. The tuner prices
# real calls with it; "group" (MoNTA's split) is modelled so the docs can say what it would save.
BUILT_TP_PATH = "direct"

__all__ += ["BUILT_TP_PATH", "TP_PATHS", "TP_PATH_SLACK", "tp_traffic", "choose_tp_path", "resolve_tp_path", "tp_alternatives",
            "dtype_name", "fp8_scale_bytes", "FP8_SCALE_BLOCK", "FP8_SCALE_BYTES", "FP8_OUT_BYTES",
            "FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK", "fp8_promotion_charged", "fp8_promotion_seconds"]


def _check_tp(shape: "MoEShape") -> None:
    """MoEShape's validation of the TP fields (called from __post_init__)."""
    t = int(shape.tp_size)
    object.__setattr__(shape, "tp_size", t)
    if t < 1 or shape.W % t:
        raise ValueError(f"tp_size={shape.tp_size} must be >= 1 and divide W={shape.W}")
    if shape.tp_path is not None and shape.tp_path not in TP_PATHS:
        raise ValueError(f"tp_path={shape.tp_path!r}: expected one of {TP_PATHS} or None")
    if t == 1:
        return
    rpn = shape.W if shape.ranks_per_node is None else int(shape.ranks_per_node)
    if rpn >= 1 and rpn % t:
        raise ValueError(f"tp_size={t} must divide ranks_per_node={rpn} (a TP group inside a node)")
    if shape.node_reduce:
        raise ValueError("node_reduce with tp_size > 1 is not modelled")
    if shape.remote_rows is not None:
        raise ValueError("a measured remote_rows with tp_size > 1 is not modelled")
    object.__setattr__(shape, "node_first", False)


def _tp_path(shape: "MoEShape") -> str:
    if shape.tp_path is None:
        raise ValueError("tp_size > 1 needs tp_path ('direct' or 'group'): pass it, or let "
                         "resolve_tp_path(shape, spec, layer) / predict / comm_time choose")
    return shape.tp_path


def tp_traffic(shape: "MoEShape", layer: int, path: Optional[str] = None) -> "NodeTraffic":
    """Rows (of H elements) one rank moves for ``layer`` with ``tp_size > 1`` on ``path``
    (default ``shape.tp_path``), as :class:`NodeTraffic` (see the derivation above): ``local`` the
    HBM copies (layer0: read + write each; layer1: partials homed here), ``same_node`` over
    NVLink (group path: the all-gather / reduce-scatter included), ``nic`` over the NIC."""
    _check_layer(layer)
    path = _tp_path(shape) if path is None else path
    if path not in TP_PATHS:
        raise ValueError(f"path={path!r}: expected one of {TP_PATHS}")
    W, P, t, EP = shape.W, shape.ranks_per_node, shape.tp_size, shape.ep_size
    T, k = shape.T, shape.k
    p = hit_probability(EP, shape.E, k)
    if layer == 0:
        if path == "direct":
            return NodeTraffic(T * k / EP, T * k * (P - 1) / EP, T * k * (W - P) / EP)
        return NodeTraffic(T * p + t * T * k, (P // t - 1) * T * p + (t - 1) * EP * T * p,
                           (W - P) // t * T * p)
    if path == "direct":
        return NodeTraffic(T * p, (P - 1) * T * p, (W - P) * T * p)
    return NodeTraffic(T * p / t, (t - 1) / t * W * T * p + (P - 1) * T * p / t,
                       (W - P) * T * p / t)


def _tp_staging_bytes(shape: "MoEShape", layer: int) -> float:
    """HBM bytes of the comm blocks beyond :func:`tp_traffic`'s ``local`` rows: layer1's group
    path stages its own column block (W T p / t rows' worth written) and re-reads the t blocks
    (W T p rows' worth) before sending home."""
    if layer == 0 or _tp_path(shape) == "direct":
        return 0.0
    W, t = shape.W, shape.tp_size
    rows = W * shape.T * hit_probability(shape.ep_size, shape.E, shape.k)
    return (rows / t + rows) * shape.H * _link_elem_bytes(shape, 1)


def _tp_hops(shape: "MoEShape") -> int:
    """Dependent link latencies before the last row lands: 2 on the group path."""
    return 2 if shape.tp_size > 1 and _tp_path(shape) == "group" else 1


def _tp_combine_partials(shape: "MoEShape") -> float:
    """Partial rows (H elements' worth) the home's combine reads per rank with TP: t EP p T on the
    direct path (one per (token, rank of each EP rank hit)), EP p T on the group path."""
    ep_hits = shape.ep_size * shape.T * hit_probability(shape.ep_size, shape.E, shape.k)
    return ep_hits * (shape.tp_size if _tp_path(shape) == "direct" else 1)


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


# ----------------------------------------------------------------------------------------------
# FP8 (dtype_bytes = 1): bytes on the links and in HBM
# ----------------------------------------------------------------------------------------------
#
# comet.fp8's format: x / h in float8 (e4m3 or e5m2, 1 byte) with one float32 scale per 1 x 128
# values of a row; weights in float8 with one float32 scale per 128 x 128 block; the GEMM
# accumulates in fp32 and writes its output in bf16 (the default out_dtype).  So:
# * a layer0 row on the links (and its local copy) is H bytes + 4 ceil(H / 128) scale bytes:
#   (H + 4 H / 128) / (2 H) = 0.516 of bf16's bytes for H a multiple of 128;
# * layer1 sends its partial rows in the output dtype, bf16 (2 H bytes: what it sends today), so
#   FP8 leaves layer1's link bytes unchanged; only its GEMM's operands (h, w1) shrink;
# * the GEMM runs at GpuSpec.fp8_tflops (sm_90: 2x bf16, datasheet; sm_80: no FP8 tensor cores,
#   the bf16 rate) with the same gemm_eff, plus the promotion of its fp32 accumulators after
#   every 128 K values: FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK FP32 FMA per output element on
#   the CUDA cores, not overlapped with the tensor cores (derived in the module docstring, "FP8");
# * its HBM operand bytes: A (K + 4 ceil(K / 128) per row), the weights (1 byte + 4 per 128 x 128
#   block), the output in bf16;
# * the backward runs in bf16 (the saved FP8 inputs are dequantised, docs/api.md), so
#   :func:`predict_backward` models it at bf16.

FP8_SCALE_BLOCK = 128  # values per scale along a row (1 x 128) and per weight block side (128 x 128)
FP8_SCALE_BYTES = 4  # a float32 scale
FP8_OUT_BYTES = 2  # the GEMM output / layer1 partials: bfloat16 (out_dtype's default)
# FP32 FMAs per output element per FP8_SCALE_BLOCK of K that the FP8 kernels run on the CUDA cores
# to promote a k-tile's tensor-core partial (acc += partial * scale; see the module docstring)
FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK = 1


def fp8_promotion_charged(shape: "MoEShape", spec: "GpuSpec") -> bool:
    """Whether ``shape``'s GEMM on ``spec`` pays the promotion: FP8 operands on FP8 tensor cores
    (not the bf16 rate of a GPU without them, nor the CPU backend's tile)."""
    return shape.is_fp8 and spec.fp8_tflops is not None and spec.fp8_promotion


def fp8_promotion_seconds(m: float, n: float, k: int, fma_rate: float) -> float:
    """Seconds of the promotion of an ``[m, n, k]`` FP8 GEMM's accumulators at ``fma_rate``
    FMA/s: one FMA per output element and 128-wide K block."""
    return FP8_PROMOTION_FMAS_PER_ELEMENT_PER_BLOCK * m * n * math.ceil(k / FP8_SCALE_BLOCK) / fma_rate


def fp8_scale_bytes(n: int) -> int:
    """Scale bytes that travel with an FP8 row of ``n`` values: one float32 per 128."""
    return FP8_SCALE_BYTES * math.ceil(n / FP8_SCALE_BLOCK)


def _out_row_bytes(shape: "MoEShape") -> int:
    """Bytes of one GEMM output row of H elements (layer1's partial before it is sent; the
    combine's output row): bf16 for FP8 operands, else the activation dtype."""
    return shape.H * FP8_OUT_BYTES if shape.is_fp8 else shape.row_bytes


def _fp8_gemm_bytes(shape: "MoEShape", m: float, experts: int, n_out: int, k_red: int,
                    sweeps: float) -> float:
    """HBM bytes of an FP8 grouped GEMM (see above): A with its row scales, the weights with
    their block scales, the bf16 output."""
    a = m * (k_red + fp8_scale_bytes(k_red))
    w = experts * (n_out * k_red + FP8_SCALE_BYTES * math.ceil(n_out / FP8_SCALE_BLOCK)
                   * math.ceil(k_red / FP8_SCALE_BLOCK))
    return sweeps * a + w + FP8_OUT_BYTES * m * n_out


# ----------------------------------------------------------------------------------------------
# Comm
# ----------------------------------------------------------------------------------------------


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
    threads = max(1, math.ceil(shape.T * shape.k / 4096)) * 256
    per_thread = 3 * math.ceil(shape.T * shape.k / threads) * 0.05e-6
    alpha = spec.alpha if shape.nodes == 1 else max(spec.alpha, spec.nic_alpha)
    return (PROLOGUE_LAUNCHES[layer] * KERNEL_GAP_S + PROLOGUE_BARRIERS[layer] * GRID_BARRIER_S
            + 2 * alpha + per_thread)


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


def block_nic_rate(shape: MoEShape, spec: GpuSpec, layer: int) -> float:
    """Bytes/s one comm block moves over the NIC for ``layer``.  Node-first layer0 and layer1:
    spec.block_nic_bw (the sender pushes rows it owns into a mirror with its own layout, or
    partials it has just reduced: no per-tile index round trips).  Flat layer0 (no node-first):
    the destination gets every slot row from its source as it pulls a same-node peer's, so per
    m-tile it first resolves the rows' origins over the NIC (two dependent round trips of
    2 * nic_latency_us), like :func:`block_link_rate`.  The TP group path (:func:`tp_traffic`)
    pushes token rows like node-first dispatch: spec.block_nic_bw."""
    _check_layer(layer)
    rate = spec.block_nic_bw
    if layer == 1 or shape.node_first or (shape.tp_size > 1 and _tp_path(shape) == "group"):
        return rate
    tile_bytes = DEFAULT_TILE[0] * shape.row_bytes
    return tile_bytes / (tile_bytes / rate + 2 * 2 * spec.nic_latency_us * 1e-6)


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


# ----------------------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------------------


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


def _tile_seconds(shape: MoEShape, spec: GpuSpec, layer: int, tile) -> float:
    """One output tile on one SM: the tensor cores' MMAs, plus FP8's promotion on the CUDA cores
    (not overlapped with them; module docstring, "FP8")."""
    tm, tn = _tile(tile)
    _, k_red = gemm_dims(shape, layer)
    mma = 2.0 * tm * tn * k_red / _sm_flops(shape, spec)
    if not fp8_promotion_charged(shape, spec):
        return mma
    return mma + fp8_promotion_seconds(tm, tn, k_red, spec.fma_rate / spec.sm_count)


# Share of the L2 that the operand a band reuses may hold; the rest is for the A rows and output
# tiles streaming through and the comm blocks' reads of C (assumption).
L2_REUSE_FRACTION = 0.5
# Bands whose predicted kernel time is within this fraction of the fastest band's start the comm
# blocks early enough; of those the model takes the one with the fewest sweeps of h (HBM traffic
# the model does not otherwise charge: the comm blocks' share, other kernels), see choose_band.
BAND_SLACK = 0.02


def band_width(band: Optional[int], cols: int) -> int:
    """n-tiles per layer1 band as the kernel runs it: ``band`` <= 0, None or more than ``cols``
    (csrc/include/comet/tile_order.h: layer1_band) means all ``cols`` n-tiles."""
    return cols if band is None or band <= 0 or band > cols else int(band)


def _l2_budget(spec: GpuSpec) -> float:
    return spec.l2_mb * 1e6 * L2_REUSE_FRACTION


def max_band(shape: MoEShape, spec: GpuSpec, tile=DEFAULT_TILE) -> int:
    """The widest layer1 band whose W1 columns stay in L2 while the band's m-tiles stream by.

    A band of ``b`` n-tiles needs, per expert, ``b * tile_n * N1`` elements of W1 (the ``[H, N1]``
    weight's rows for the band's columns).  Inside a band the GEMM blocks walk m-major across the
    experts, and ``n_gemm <= sm_count`` blocks work on ``ceil(sm_count / b)`` consecutive m-tiles
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

    * layer0 visits all n-tiles of an m-tile one after another (tile_order.h: layer0_tile), and
      consecutive tiles run at once on consecutive GEMM blocks, so an m-tile's rows of ``a`` come
      from HBM once and serve its ``ceil(N0 / tile_n)`` tiles from L2: 1 sweep.
    * layer1 in bands of ``b`` n-tiles, m-major inside a band: the band's ``b`` tiles of an m-tile
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
    tests/test_perfmodel.py checks this against)."""
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


# ----------------------------------------------------------------------------------------------
# Pipeline
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Backward (a training step's second half)
# ----------------------------------------------------------------------------------------------
#
# comet.layers.autograd's backward of one op (module doc there) is collective calls of the same fused
# ops plus the weight-gradient GEMM, overlapped as Lancet does:
#
# * layer0's backward (``shape.N = N0``): dx = a moe_layer1-type call (GEMM [M, N0] x [N0, H],
#   reduce, combine home), i.e. :func:`predict` with layer=1 on the same shape; dW0 [E_l, N0, H]
#   = dy0_e^T a_e runs beside it.
# * layer1's backward (``shape.N = N1``): dh = a moe_layer0-type call (dispatch dout, GEMM
#   [M, H] x [H, N1]): :func:`predict` with layer=0; the top-k weights go to the rows in a
#   virtual-token moe_layer0 call and their gradients come home in a virtual-token moe_layer1 call
#   (T k tokens of one slot and 8 elements); dW1 [E_l, H, N1] = (w dout)_e^T h_e runs beside the
#   second one (it needs the first's row weights).
#
# The weight gradient (:func:`weight_grad_time`) is one grouped GEMM on the whole GPU in the
# activation dtype (tensor-core rate, fp32 accumulation): 2 M N H FLOPs per layer, the forward
# GEMM's count (so a third of a step's expert FLOPs), reduced over each expert's M_e rows.  Its
# output tiles are E_l * ceil(P / tile_m) * ceil(Q / tile_n), a tile of expert e costs
# 2 tile_m tile_n M_e / (per-SM rate); roofline with the operands read once (A rows, grad rows)
# and the output written once::
#
#     wgrad = max(max(sum of tile seconds / sm_count, longest tile), unique_bytes / hbm)
#
# Overlap: the side-stream GEMM fills the time the collective waits on its links, but the two
# share the tensor cores, so the pair takes at least the collective's GEMM on the whole GPU plus
# the weight gradient, and at least the collective alone (``overlapped``); without overlap they
# add up (``sequential``)::
#
#     layer0: overlapped = max(dx, dx_gemm_full + dW0)
#     layer1: overlapped = dh + vt_rows + max(vt_home, vt_home_gemm_full + dW1)
#
# ``overlapped`` is optimistic about SM sharing (the persistent fused kernel holds every SM while
# it runs; the side stream's blocks get SMs only as it frees them), ``sequential`` pessimistic.
# Each collective call gets the n_comm :func:`choose_n_comm` picks for it.

__all__ += ["weight_grad_time", "predict_backward"]


def weight_grad_time(shape: MoEShape, spec: GpuSpec, layer: int, tile=DEFAULT_TILE,
                     out_bytes: Optional[int] = None) -> float:
    """Seconds of ``layer``'s weight-gradient grouped GEMM on the whole GPU (see above): dW0
    [E_l, N, H] for layer 0, dW1 [E_l, H, N] for layer 1, operands in ``shape.dtype_bytes`` (the
    tensor-core rate for 16-bit), output in ``out_bytes`` (default: the operands' size)."""
    _check_layer(layer)
    tm, tn = _tile(tile)
    rows = [r for r in expert_rows(shape) if r > 0]
    if not rows:
        return 0.0
    out_rows, out_cols = (shape.N, shape.H) if layer == 0 else (shape.H, shape.N)
    tiles_per_expert = math.ceil(out_rows / tm) * math.ceil(out_cols / tn)
    per_sm = _sm_flops(shape, spec)
    tile_s = [2.0 * tm * tn * r / per_sm for r in rows]
    compute = max(sum(tile_s) * tiles_per_expert / spec.sm_count, max(tile_s))
    out = shape.dtype_bytes if out_bytes is None else int(out_bytes)
    m = sum(rows)
    unique = shape.dtype_bytes * m * (out_rows + out_cols) + out * len(rows) * out_rows * out_cols
    return max(compute, unique / spec.hbm_bw)


def _virtual_token_shape(shape: MoEShape) -> MoEShape:
    """The virtual-token calls' shape: T k tokens of one slot, rows of 8 bf16 (comet.layers.autograd)."""
    return replace(shape, k=1, T=shape.T * shape.k, H=8, N=8, dtype_bytes=2, remote_rows=None,
                   partial_bytes=None, tp_path=None)


def _call(shape: MoEShape, spec: GpuSpec, layer: int, tile, n_blocks) -> Dict[str, float]:
    n = choose_n_comm(shape, spec, layer, n_blocks, tile)
    return predict(shape, spec, n, layer, tile, n_blocks=n_blocks)


def predict_backward(shape: MoEShape, spec: GpuSpec, layer: int, tile=DEFAULT_TILE, *,
                     n_blocks: Optional[int] = None,
                     out_bytes: Optional[int] = None) -> Dict[str, float]:
    """Predicted seconds of the backward of ``layer``'s op (see above; ``shape`` as for the
    forward call: ``N`` = N0 for layer 0, N1 for layer 1). Returns ``collective`` (the fused
    calls backward makes, each with its chosen n_comm, prologues included), ``weight_grad``,
    ``overlapped`` and ``sequential``."""
    _check_layer(layer)
    if shape.is_fp8:  # FP8 forward, bf16 backward (the saved FP8 inputs are dequantised)
        shape = replace(shape, dtype_bytes=2)
    shape = replace(shape, tp_path=None)  # the backward's calls choose their own TP paths
    dw = weight_grad_time(shape, spec, layer, tile, out_bytes)
    if layer == 0:
        dx = _call(shape, spec, 1, tile, n_blocks)  # moe_layer1 over the same rows
        collective = dx["fused"]
        overlapped = max(collective, dx["gemm_full"] + dw)
    else:
        vt = _virtual_token_shape(shape)
        dh = _call(shape, spec, 0, tile, n_blocks)  # moe_layer0: dispatch dout, GEMM with W1^T
        to_rows = _call(vt, spec, 0, tile, n_blocks)
        home = _call(vt, spec, 1, tile, n_blocks)
        collective = dh["fused"] + to_rows["fused"] + home["fused"]
        overlapped = dh["fused"] + to_rows["fused"] + max(home["fused"], home["gemm_full"] + dw)
    overlapped = min(overlapped, collective + dw)
    return {"collective": collective, "weight_grad": dw, "overlapped": overlapped,
            "sequential": collective + dw}
