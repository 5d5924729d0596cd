"""The decode regime of the cost model (comet.tune.model.decode, `python -m comet.tune --table
decode`): its counts against arithmetic written here, and the bounds every prediction keeps."""
import itertools
import random

import pytest

from comet.tune import cli
from comet.tune import perfmodel as pm
from comet.tune.model import comm
from comet.tune.model.gemm import SMALL_TILE
from comet.tune.model import decode as dm


def test_active_experts_against_a_sampled_routing():
    """The expected number of local experts hit, against routing drawn here (k distinct experts
    per token, uniform), averaged over many draws."""
    rng = random.Random(7)
    for W, E, k, T in ((4, 16, 8, 1), (8, 256, 8, 1), (2, 32, 8, 2), (16, 256, 8, 3)):
        local = range(E // W)  # rank 0's experts
        draws, hits = 3000, 0
        for _ in range(draws):
            chosen = set()
            for _t in range(W * T):
                chosen.update(rng.sample(range(E), k))
            hits += sum(1 for e in local if e in chosen)
        assert dm.active_experts(W, E, k, T) == pytest.approx(hits / draws, rel=0.04)


def test_weight_bytes_of_deepseek_v3_at_ep8():
    """T = 256 on 8 ranks hits every local expert (the probability of a miss is below 1e-20):
    32 experts of w0 [4096, 7168] and w1 [7168, 2048], FP8 with a float32 per 128 x 128 block."""
    p = dm.DecodePoint(8, 256, "fp8", 8)
    w0 = 32 * (4096 * 7168 + 4 * (4096 // 128) * (7168 // 128))
    w1 = 32 * (7168 * 2048 + 4 * (7168 // 128) * (2048 // 128))
    assert dm.weight_bytes(p, 0) == pytest.approx(w0, rel=1e-12)
    assert dm.weight_bytes(p, 1) == pytest.approx(w1, rel=1e-12)
    bf = dm.DecodePoint(8, 256, "bf16", 8)
    assert dm.weight_bytes(bf, 0) == pytest.approx(32 * 4096 * 7168 * 2, rel=1e-12)


@pytest.mark.parametrize("W,rpn,dtype,T", list(itertools.product(
    (8, 16), (8,), ("fp8", "bf16"), (0, 1, 5, 32, 128, 256))))
def test_bounds(W, rpn, dtype, T):
    """limit <= fused and limit <= unfused (the limit overlaps everything on every SM); the
    folded layer is the fused one less the prologues' launches and grid barriers exactly; no
    layer is faster than its weights at the achievable HBM rate."""
    spec = pm.GPUS["h800"]
    p = dm.DecodePoint(W, T, dtype, rpn)
    f, u, lim = dm.decode_fused(p, spec), dm.decode_unfused(p, spec), dm.decode_limit(p, spec)
    assert lim <= f["folded"] <= f["fused"]
    assert lim <= u["unfused"]
    # the prologue grids: one block per 4096 routing slots; a one-block grid's barriers are
    # its block's own (comet/parallel.h), charged BLOCK_BARRIER_S
    barrier = pm.GRID_BARRIER_S if T * 8 > 4096 else comm.BLOCK_BARRIER_S
    launches = (3 + 3) * pm.KERNEL_GAP_S + (11 + 15) * barrier
    assert f["fused"] - f["folded"] == pytest.approx(launches, rel=1e-9)
    weights = (dm.weight_bytes(p, 0) + dm.weight_bytes(p, 1)) / (spec.hbm_gbs * 1e9 * spec.hbm_eff)
    assert u["gemm0"] + u["gemm1"] >= weights * (1 - 1e-12)
    assert 1 <= f["n_comm0"] < spec.max_blocks and 1 <= f["n_comm1"] < spec.max_blocks


def test_no_tokens_anywhere_reads_no_weights():
    p = dm.DecodePoint(8, 0, "fp8", 8)
    assert dm.weight_bytes(p, 0) == 0 and dm.weight_bytes(p, 1) == 0
    assert dm.decode_gemm(p, pm.GPUS["h800"], 0, 100) == 0.0


def test_more_tokens_never_cost_less():
    spec = pm.GPUS["h800"]
    for dtype in ("fp8", "bf16"):
        prev = None
        for T in dm.DECODE_TOKENS:
            p = dm.DecodePoint(8, T, dtype, 8)
            cur = (dm.decode_unfused(p, spec)["unfused"], dm.decode_limit(p, spec))
            if prev is not None:
                assert cur[0] >= prev[0] and cur[1] >= prev[1]
            prev = cur


def test_cli_table_has_every_point_and_the_anchors():
    text = cli.decode_table()
    rows = [r for r in text.splitlines() if r.startswith("| 1 x 8") or r.startswith("| 2 x 8")]
    assert len(rows) == len(dm.DECODE_GROUPS) * 2 * len(dm.DECODE_TOKENS)
    for _, _, what, d_us, c_us in dm.DECODE_ANCHORS:
        assert f"| {what} | {d_us:g} / {c_us:g} |" in text
    assert cli.main(["--table", "decode"]) == 0


@pytest.mark.parametrize("dtype,T", [("fp8", 0), ("fp8", 128), ("bf16", 1), ("bf16", 256)])
def test_fused_charges_each_stream_operation(monkeypatch, dtype, T):
    """The fused layer counts each op's copies kernel (its source data copies and flag clears,
    csrc/cuda/stream_copies.cu) at STREAM_OP_S, in the folded column too (folding the prologue
    kernels keeps it): priced at 0 it takes exactly that off both columns."""
    from comet.tune.model import comm
    spec = pm.GPUS["h800"]
    p = dm.DecodePoint(8, T, dtype, 8)
    f = dm.decode_fused(p, spec)
    monkeypatch.setattr(comm, "STREAM_OP_S", 0.0)
    g = dm.decode_fused(p, spec)
    ops = sum(comm.PROLOGUE_STREAM_OPS.values())
    assert ops == 2
    assert f["fused"] - g["fused"] == pytest.approx(ops * pm.KERNEL_GAP_S, rel=1e-9)
    assert f["folded"] - g["folded"] == pytest.approx(ops * pm.KERNEL_GAP_S, rel=1e-9)


def _simulated_layer0(m, n_comm, group, comm_s, gemm_s):
    """An event simulation of layer0's two stages over m-tiles, written here: comm block b fills
    m-tiles b, b + n_comm, ... one after another, so m-tile i is ready at the end of round
    i // n_comm (each round comm_s / rounds); the GEMM walks raster groups of ``group`` m-tiles in
    order, a group starting when its m-tiles are ready and the previous group is done, taking
    its share of gemm_s. Returns the end of the last group."""
    rounds = -(-m // n_comm)
    ready = [comm_s * (i // n_comm + 1) / rounds for i in range(m)]
    end = 0.0
    for first in range(0, m, group):
        members = range(first, min(m, first + group))
        end = max(end, max(ready[i] for i in members)) + gemm_s * len(members) / m
    return end


@pytest.mark.parametrize("W,dtype,T", list(itertools.product((8, 16), ("fp8", "bf16"),
                                                             (1, 8, 32, 128, 256))))
def test_layer0_pipeline_against_an_event_simulation(monkeypatch, W, dtype, T):
    """layer0's kernel (no prefetch) is never below the simulation of its two stages and within
    its last raster group's GEMM share above it (the model charges a whole group after the
    dispatch's end, the simulation the group's actual size and ready times)."""
    monkeypatch.setattr(dm, "WEIGHT_STAGE_BYTES", 0)  # no weights before rows: two plain stages
    spec = pm.GPUS["h800"]
    p = dm.DecodePoint(W, T, dtype, 8)
    for tile in dm.CUDA_TILES:
        m = dm._mtiles(p, tile)
        for n_comm in (1, 3, 6, 12, 40):
            n_gemm = spec.max_blocks - n_comm
            comm_s = dm.comm_time(p.shape(0), spec, n_comm, 0)
            gemm_s = dm.decode_gemm(p, spec, 0, n_gemm, 0.0, tile)
            group = min(max(1, int(n_gemm ** 0.5)), m)
            sim = _simulated_layer0(m, n_comm, group, comm_s, gemm_s)
            got = dm._layer0_kernel(p, spec, n_comm, tile)
            assert sim * (1 - 1e-9) <= got <= sim + gemm_s * group / m + 1e-12, (tile, n_comm)


def test_layer0_starts_before_the_dispatch_ends():
    """At 128 tokens on 8 ranks every m-tile holds rows of all 8 sources, yet the GEMM starts
    after the first raster group's rows: the kernel is below dispatch + GEMM by at least half
    the dispatch (arithmetic of the two stages, independent of the constants' values)."""
    spec = pm.GPUS["h800"]
    p = dm.DecodePoint(8, 128, "bf16", 8)
    n_comm = 6
    comm_s = dm.comm_time(p.shape(0), spec, n_comm, 0)
    serial = comm_s + dm.decode_gemm(p, spec, 0, spec.max_blocks - n_comm, 0.0, SMALL_TILE)
    assert dm._layer0_kernel(p, spec, n_comm, SMALL_TILE) <= serial - comm_s / 2
