"""The GPUs of the cost model (comet.tune.perfmodel): per-GPU constants from the datasheets
(:class:`GpuSpec`, :data:`GPUS`), the CPU backend's pseudo-spec (:func:`cpu_spec`, :data:`CPU`) and
the lookup by name (:func:`get_spec`, :func:`spec_from_device_name`).  A comm block's link rate is
derived here from what the kernels keep in flight (:attr:`GpuSpec.block_link_bw`: Little's law).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

# Independent 16-byte loads in flight per thread in layer0's row copy: kCopyUnroll of
# csrc/include/comet/copy.h (tests/test_perfmodel.py checks they agree).
COPY_UNROLL = 4


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
    # (comet.tune.model.fp8).  False for the CPU backend's pseudo-spec (its tile does every
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
