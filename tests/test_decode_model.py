"""The decode regime of the cost model (comet.tune.model.decode, `python -m comet.tune --table
decode`): its counts against arithmetic written here, and the bounds every prediction keeps."""
import itertools
import random

import pytest

from comet.tune import cli
from comet.tune import perfmodel as pm
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
    launches = (3 + 3) * pm.KERNEL_GAP_S + (11 + 15) * pm.GRID_BARRIER_S
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
