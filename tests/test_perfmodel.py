"""Tests of comet.tune.perfmodel: the cost model behind the comm/GEMM split."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st


from comet.tune import perfmodel as pm  # noqa: E402

PRESETS = {  # H, ffn, E, k (docs/peers.md), gated FFN: N0 = 2 * ffn, N1 = ffn
    "mixtral": (4096, 14336, 8, 2),
    "qwen2": (2048, 1408, 64, 4),
    "phi3.5": (4096, 6400, 16, 2),
}


def preset_shape(name, layer, W=8, T=4096, nbytes=2):
    H, ffn, E, k = PRESETS[name]
    return pm.MoEShape(W=W, E=E, k=k, H=H, N=2 * ffn if layer == 0 else ffn, T=T, dtype_bytes=nbytes)


CASES = [(m, layer) for m in PRESETS for layer in (0, 1)]
GPU_NAMES = sorted(pm.GPUS)


@st.composite
def shapes(draw):
    W = draw(st.sampled_from([1, 2, 4, 8]))
    el = draw(st.sampled_from([1, 2, 4, 8]))
    E = W * el
    k = draw(st.integers(1, min(E, 8)))
    H = draw(st.sampled_from([128, 512, 1024, 2048, 4096, 7168]))
    N = draw(st.sampled_from([128, 704, 1408, 2816, 6400, 14336]))
    T = draw(st.sampled_from([0, 1, 7, 64, 333, 1024, 4096, 16384]))
    nbytes = draw(st.sampled_from([2, 4]))
    return pm.MoEShape(W=W, E=E, k=k, H=H, N=N, T=T, dtype_bytes=nbytes)


tiles = st.sampled_from([(64, 64), (128, 128), (128, 256), (256, 128)])
specs = st.sampled_from(GPU_NAMES).map(lambda n: pm.GPUS[n])
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------
# Hardware table
# ----------------------------------------------------------------------------------------------


def test_gpu_table_is_complete_and_sane():
    assert set(pm.GPUS) >= {"a100", "h100", "h800", "h200", "h20", "l20"}
    expected_sms = {"a100": 108, "h100": 132, "h800": 132, "h200": 132, "h20": 78, "l20": 92}
    for name, spec in pm.GPUS.items():
        assert spec.name == name
        assert spec.sm_count == expected_sms[name]
        assert spec.blocks_per_sm == 1 and spec.max_blocks == spec.sm_count
        assert spec.bf16_tflops > spec.fp32_tflops > 0
        assert spec.hbm_gbs > spec.link_gbs > 0
        assert spec.link_latency_us > 0 and spec.block_link_bw > 0
        assert 0 < spec.gemm_eff <= 1 and 0 < spec.hbm_eff <= 1 and 0 < spec.link_eff <= 1
        assert spec.source
    # the H800's NVLink is the cut-down one; the L20 has none (PCIe)
    assert pm.GPUS["h800"].link_gbs < pm.GPUS["h100"].link_gbs
    assert pm.GPUS["l20"].link == "pcie"


@pytest.mark.parametrize("device,key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H800", "h800"), ("NVIDIA H200", "h200"),
    ("NVIDIA H20", "h20"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L20", "l20"),
    ("NVIDIA GeForce RTX 4090", None), ("Tesla V100-SXM2-32GB", None),
])
def test_spec_from_device_name(device, key):
    assert pm.spec_from_device_name(device) == key


def test_get_spec_scales_and_aliases():
    h = pm.get_spec("h100", 114)
    assert h.sm_count == 114
    assert h.bf16_tflops == pytest.approx(989.5 * 114 / 132)
    assert h.block_hbm_bw == pytest.approx(pm.GPUS["h100"].block_hbm_bw)
    assert pm.get_spec("H800") is pm.GPUS["h800"]
    assert pm.get_spec("NVIDIA A100-SXM4-80GB") is pm.GPUS["a100"]
    assert pm.get_spec("nonexistent") is None
    assert pm.get_spec("cpu", 6).sm_count == 6


def test_cpu_spec_configurable(monkeypatch):
    s = pm.cpu_spec(threads=4, gflops_per_thread=2.0, mem_gbs=5.0)
    assert s.name == "cpu" and s.sm_count == 4
    assert s.peak_flops(2) == s.peak_flops(4) == pytest.approx(8e9)
    assert s.hbm_gbs == 5.0 and s.link_gbs == 2.5
    monkeypatch.setenv("COMET_CPU_GFLOPS", "3")
    monkeypatch.setenv("COMET_CPU_MEM_GBS", "7")
    s = pm.cpu_spec(threads=1)
    assert s.sm_count == 2  # at least one comm and one GEMM thread
    assert s.peak_flops(2) == pytest.approx(6e9) and s.hbm_gbs == 7.0
    shape = preset_shape("mixtral", 0, T=64)
    n = pm.choose_n_comm(shape, pm.cpu_spec(threads=8), 0)
    assert 0 <= n <= 7


# ----------------------------------------------------------------------------------------------
# Traffic
# ----------------------------------------------------------------------------------------------


def test_traffic_formulas():
    s = pm.MoEShape(W=8, E=8, k=2, H=4096, N=28672, T=4096)
    assert pm.remote_rows(s, 0) == pytest.approx(4096 * 2 * 7 / 8)
    assert pm.local_rows(s, 0) == pytest.approx(4096 * 2 / 8)
    # one expert per rank: a token's k distinct experts are on k distinct ranks
    assert pm.expected_distinct_ranks(8, 8, 2) == pytest.approx(2.0)
    assert pm.remote_rows(s, 1) == pytest.approx(4096 * 2 * 7 / 8)
    # ANCHORS: both layers together move 2 * T * d * H * bytes (d: distinct remote ranks)
    d_remote = 2 * 7 / 8
    total = pm.traffic_bytes(s, 0) + pm.traffic_bytes(s, 1)
    assert total == pytest.approx(2 * 4096 * d_remote * 4096 * 2)
    # measured counts override, W = 1 moves nothing
    assert pm.remote_rows(s, 0, measured=123) == 123
    assert pm.remote_rows(pm.MoEShape(8, 8, 2, 4096, 100, 4096, remote_rows=77), 1) == 77
    one = pm.MoEShape(W=1, E=4, k=2, H=64, N=64, T=100)
    assert pm.remote_rows(one, 0) == pm.remote_rows(one, 1) == 0
    assert pm.comm_time(one, pm.GPUS["h100"], 4, 0) > 0  # the local copy still takes time


def test_expected_distinct_ranks_matches_sampling():
    rng = random.Random(0)
    for W, E, k in [(8, 64, 4), (4, 16, 2), (8, 16, 6), (2, 8, 8)]:
        el = E // W
        n = 20000
        hits = sum(len({e // el for e in rng.sample(range(E), k)}) for _ in range(n)) / n
        assert pm.expected_distinct_ranks(W, E, k) == pytest.approx(hits, rel=0.02)


def test_shape_validation():
    with pytest.raises(ValueError):
        pm.MoEShape(W=3, E=8, k=2, H=8, N=8, T=1)
    with pytest.raises(ValueError):
        pm.MoEShape(W=2, E=8, k=2, H=8, N=8, T=1, expert_rows=(1, 2, 3))
    with pytest.raises(ValueError):
        pm.predict(preset_shape("mixtral", 0), pm.GPUS["h100"], -1, 0)
    with pytest.raises(ValueError):
        pm.predict(preset_shape("mixtral", 0), pm.GPUS["h100"], 132, 0)
    with pytest.raises(ValueError):
        pm.predict(preset_shape("mixtral", 0), pm.GPUS["h100"], 1, 2)


# ----------------------------------------------------------------------------------------------
# Comm
# ----------------------------------------------------------------------------------------------


def _check_comm_curve(shape, spec, layer):
    times = [pm.comm_time(shape, spec, n, layer) for n in range(1, spec.sm_count + 1)]
    sat = pm.comm_saturation_blocks(shape, spec, layer)
    assert 1 <= sat <= spec.sm_count
    for a, b in zip(times, times[1:]):
        assert b <= a * (1 + 1e-12)  # non-increasing
    floor = times[sat - 1]
    for t in times[sat - 1:]:
        assert t == pytest.approx(floor, rel=1e-12)  # flat from saturation on
    if sat > 1:
        assert times[sat - 2] > floor  # and still improving just before it
    return times, sat


@pytest.mark.parametrize("gpu", GPU_NAMES)
@pytest.mark.parametrize("model,layer", CASES)
def test_comm_decreases_until_saturation_then_flat(model, layer, gpu):
    spec = pm.GPUS[gpu]
    shape = preset_shape(model, layer)
    times, sat = _check_comm_curve(shape, spec, layer)
    assert sat > 1
    # below saturation the link term halves when the blocks double
    link_part = lambda n: pm.traffic_bytes(shape, layer) / min(n * spec.block_link_bw, spec.link_bw)
    assert link_part(1) == pytest.approx(2 * link_part(2))
    # saturated comm is bounded by the achievable link bandwidth
    assert times[-1] >= pm.traffic_bytes(shape, layer) / spec.link_bw


@FAST
@given(shape=shapes(), spec=specs, layer=st.sampled_from([0, 1]))
def test_comm_monotone_property(shape, spec, layer):
    _check_comm_curve(shape, spec, layer)


# ----------------------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------------------


@FAST
@given(shape=shapes(), spec=specs, layer=st.sampled_from([0, 1]), tile=tiles)
def test_gemm_more_sms_never_slower(shape, spec, layer, tile):
    times = [pm.gemm_time(shape, spec, n, layer, tile) for n in range(1, spec.sm_count + 1)]
    for a, b in zip(times, times[1:]):
        assert b <= a * (1 + 1e-12)
    if shape.T == 0:
        assert times[0] == 0.0


def test_gemm_wave_quantisation():
    spec = pm.GPUS["h100"]
    # 4096 x 4096 x 4096 in one expert: 32 x 32 = 1024 tiles of 128x128, compute bound
    s = pm.MoEShape(W=1, E=1, k=1, H=4096, N=4096, T=4096)
    assert pm.gemm_tiles(s, 0) == (32, 32)
    t_tile = 2 * 128 * 128 * 4096 / (spec.peak_flops(2) * spec.gemm_eff / spec.sm_count)
    for n in (1, 7, 100, 103, 113, 128, 132):
        assert pm.gemm_time(s, spec, n, 0) == pytest.approx(math.ceil(1024 / n) * t_tile)
    # same number of waves, same time: extra SMs inside a wave do not help
    assert pm.gemm_time(s, spec, 103, 0) == pm.gemm_time(s, spec, 113, 0)
    assert pm.gemm_time(s, spec, 128, 0) == pm.gemm_time(s, spec, 132, 0)
    # padded rows cost like real ones
    assert pm.gemm_tiles(pm.MoEShape(2, 4, 1, 64, 128, 10, expert_rows=(1, 129)), 0) == (3, 1)


def test_gemm_dims_and_dtype():
    s0, s1 = preset_shape("mixtral", 0), preset_shape("mixtral", 1)
    assert pm.gemm_dims(s0, 0) == (28672, 4096)  # [M, H] x [H, N0]
    assert pm.gemm_dims(s1, 1) == (4096, 14336)  # [M, N1] x [N1, H]
    spec = pm.GPUS["h100"]
    fp32 = preset_shape("mixtral", 0, nbytes=4)
    assert pm.gemm_time(fp32, spec, 100, 0) > pm.gemm_time(s0, spec, 100, 0)


# ----------------------------------------------------------------------------------------------
# Pipeline and choice
# ----------------------------------------------------------------------------------------------


@FAST
@given(shape=shapes(), spec=specs, layer=st.sampled_from([0, 1]), tile=tiles, data=st.data())
def test_fused_between_limit_and_sequential(shape, spec, layer, tile, data):
    n = data.draw(st.integers(1, spec.sm_count - 1))
    p = pm.predict(shape, spec, n, layer, tile)
    eps = 1e-12
    assert p["n_comm"] == n and p["n_gemm"] == spec.sm_count - n
    # the pipelined kernel between its bounds; the per-call prologue comes on top
    assert p["limit"] <= p["kernel"] * (1 + eps)
    assert max(p["comm"], p["gemm"]) <= p["kernel"] * (1 + eps)
    assert p["kernel"] <= p["sequential"] * (1 + eps)
    assert p["fused"] == pytest.approx(p["kernel"] + p["prologue"]) and p["prologue"] > 0
    assert p["sequential"] == pytest.approx(p["comm"] + p["gemm"])
    assert p["limit"] == pytest.approx(max(p["comm_full"], p["gemm_full"]))
    assert p["baseline"] == pytest.approx(p["comm_full"] + p["gemm_full"])
    if shape.T == 0:  # nothing moves or multiplies; layer1 still launches its combine kernel
        assert p["kernel"] == pytest.approx(pm.KERNEL_GAP_S if layer == 1 else 0.0)


@pytest.mark.parametrize("model,layer", CASES)
def test_limits_of_the_split(model, layer):
    spec = pm.GPUS["h800"]
    shape = preset_shape(model, layer)
    sm = spec.sm_count
    lo = pm.predict(shape, spec, 1, layer)
    hi = pm.predict(shape, spec, sm - 1, layer)
    assert lo["comm"] > lo["gemm"]  # one comm block: comm dominates
    assert hi["gemm"] > hi["comm"]  # one GEMM block: GEMM dominates
    assert lo["fused"] == pytest.approx(lo["comm"], rel=0.1)
    assert hi["fused"] == pytest.approx(hi["gemm"], rel=0.1)
    # the comm/GEMM ratio falls monotonically as comm blocks are added (at a fixed band: the
    # model's band may change with the split, and with it layer1's sweeps of h)
    ratios = []
    for n in range(1, sm):
        p = pm.predict(shape, spec, n, layer, band=lo["band"])
        ratios.append(p["comm"] / p["gemm"])
    assert all(b <= a * (1 + 1e-12) for a, b in zip(ratios, ratios[1:]))


@pytest.mark.parametrize("gpu", GPU_NAMES)
@pytest.mark.parametrize("model,layer", CASES)
@pytest.mark.parametrize("max_blocks", [None, 2, 3, 17, 64, 1000])
def test_choose_n_comm_is_the_model_argmin(model, layer, gpu, max_blocks):
    spec = pm.GPUS[gpu]
    shape = preset_shape(model, layer)
    total = spec.sm_count if max_blocks is None else min(spec.sm_count, max_blocks)
    n = pm.choose_n_comm(shape, spec, layer, max_blocks=max_blocks)
    assert 0 <= n <= total - 1  # 0: staged
    fused = [pm.predict(shape, spec, m, layer, n_blocks=total)["fused"] for m in range(0, total)]
    best = min(fused)
    assert fused[n] <= best * (1 + 1e-9)  # the minimum (up to float rounding)
    assert all(f > fused[n] for f in fused[:n])  # ties: the smallest n_comm


def test_choose_n_comm_needs_two_blocks():
    with pytest.raises(ValueError):
        pm.choose_n_comm(preset_shape("mixtral", 0), pm.GPUS["h100"], 0, max_blocks=1)


def test_fusion_pays_where_comm_matters():
    # Qwen2-MoE on H800 (slow NVLink, small experts): comm and GEMM are of similar size, so the
    # chosen split beats the unfused sequence clearly (even paying the per-call prologue, which
    # the baseline is not charged) and overlap beats no overlap.
    spec = pm.GPUS["h800"]
    for layer in (0, 1):
        shape = preset_shape("qwen2", layer)
        p = pm.predict(shape, spec, pm.choose_n_comm(shape, spec, layer), layer)
        assert p["fused"] < 0.9 * p["baseline"]
        assert p["kernel"] < 0.8 * p["sequential"]
        assert p["baseline"] / p["fused"] <= 2.0 + 1e-9  # overlap alone gives at most 2x


def test_comm_bound_takes_just_enough_blocks_to_saturate_the_link():
    spec = pm.GPUS["h800"]
    base = preset_shape("qwen2", 0)
    # three times the expected traffic (a skewed routing, measured): comm-bound at any split
    heavy = pm.MoEShape(**{**base.__dict__, "remote_rows": 3 * pm.remote_rows(base, 0)})
    sat = pm.comm_saturation_blocks(heavy, spec, 0)
    assert pm.predict(heavy, spec, sat, 0)["comm"] > pm.predict(heavy, spec, sat, 0)["gemm"]
    assert pm.choose_n_comm(heavy, spec, 0) == sat
    assert pm.predict(heavy, spec, 10, 0)["comm"] > pm.predict(base, spec, 10, 0)["comm"]


def test_predict_is_fast():
    import time

    t0 = time.perf_counter()
    for model, layer in CASES:
        pm.choose_n_comm(preset_shape(model, layer, T=1 << 17), pm.GPUS["h100"], layer)
    assert time.perf_counter() - t0 < 5.0


def test_copy_unroll_is_the_kernels():
    """The model's loads in flight per thread are copy.h's kCopyUnroll (the SASS check verifies
    the compiled kernels keep that many in flight)."""
    import pathlib
    import re

    header = pathlib.Path(__file__).resolve().parents[1] / "csrc/include/comet/copy.h"
    assert int(re.search(r"kCopyUnroll\s*=\s*(\d+)", header.read_text()).group(1)) == pm.COPY_UNROLL
    h800 = pm.GPUS["h800"]
    assert h800.block_link_bw == pytest.approx(384 * pm.COPY_UNROLL * 16 / 2e-6)


def test_partial_bytes_follow_the_op_dtype():
    """layer1's partials travel in the activation dtype (comm_layer1.h): the model's link bytes
    per partial row are H * dtype bytes, half of fp32's for bf16."""
    for nbytes in (2, 4):
        shape = pm.MoEShape(W=8, E=64, k=4, H=2048, N=1408, T=4096, dtype_bytes=nbytes)
        assert pm.traffic_bytes(shape, 1) == pytest.approx(pm.remote_rows(shape, 1) * 2048 * nbytes)
    bf16 = pm.MoEShape(W=8, E=64, k=4, H=2048, N=1408, T=4096, dtype_bytes=2)
    fp32 = pm.MoEShape(W=8, E=64, k=4, H=2048, N=1408, T=4096, dtype_bytes=4)
    assert pm.traffic_bytes(fp32, 1) == pytest.approx(2 * pm.traffic_bytes(bf16, 1))


@pytest.mark.parametrize("model", ["mixtral", "qwen2", "phi3.5"])
def test_fused_beats_unfused_on_h800_for_the_paper_shapes(model):
    """With the calibrated per-block rate, the prologue and the combine kernel, the chosen split
    is predicted faster than all-to-all-then-GEMM for both layers (docs/tuning.md's table)."""
    spec = pm.GPUS["h800"]
    for layer in (0, 1):
        shape = preset_shape(model, layer)
        p = pm.predict(shape, spec, pm.choose_n_comm(shape, spec, layer), layer)
        assert p["fused"] < p["baseline"], (model, layer, p)


# ----------------------------------------------------------------------------------------------
# Several nodes (ranks_per_node): intra- and inter-node links
# ----------------------------------------------------------------------------------------------


def _golden_entries(monkeypatch):
    """The golden predictions; while they are compared, a one-block prologue grid's barriers cost
    what the golden model charged every grid barrier (it predates the one-block barrier of
    comet/parallel.h, which only changes the prologue of calls of at most 4096 routing slots)."""
    import json
    import pathlib

    from comet.tune.model import comm
    monkeypatch.setattr(comm, "BLOCK_BARRIER_S", comm.GRID_BARRIER_S)

    path = pathlib.Path(__file__).resolve().parent / "data" / "perfmodel_one_node.json"
    return json.loads(path.read_text())


def _golden_shape(e):
    """A golden entry's shape; layer0 with the one row per (token, slot) that model assumed
    (T k (W - 1) / W remote rows: layer0 now pulls a token once per rank, which it priced the
    same way only for k = 1), so every other part of the prediction is still held to its bits."""
    d = dict(e["shape"])
    if "expert_rows" in d:
        d["expert_rows"] = tuple(d["expert_rows"])
    if e["layer"] == 0 and d.get("remote_rows") is None:
        d["remote_rows"] = d["T"] * d["k"] * (d["W"] - 1) / d["W"]
    return d


def test_one_node_is_the_single_node_model_bit_for_bit(monkeypatch):
    """ranks_per_node = W (explicit or the default) reproduces the predictions of the model before
    nodes existed exactly (tests/data/perfmodel_one_node.json, made by
    tests/data/gen_perfmodel_one_node.py from commit 1403adf's perfmodel), once the A sweeps that
    model did not charge are taken out: an L2 that holds h reads it once whatever the band, and
    then the model's band is 1 (the column order that model assumed); and with that model's
    price of a one-block prologue grid's barriers (_golden_entries)."""
    entries = _golden_entries(monkeypatch)
    assert len(entries) > 500
    for e in entries:
        d = _golden_shape(e)
        spec = dataclasses.replace(pm.GPUS[e["gpu"]], l2_mb=math.inf)
        for shape in (pm.MoEShape(**d), pm.MoEShape(**d, ranks_per_node=d["W"]),
                      pm.MoEShape(**d, ranks_per_node=d["W"], node_first=False)):
            assert shape.nodes == 1 and shape.ranks_per_node == shape.W
            if "predict" in e:
                p = pm.predict(shape, spec, e["n_comm"], e["layer"])
                assert {k: p[k] for k in e["predict"]} == e["predict"], e  # exact floats
                assert p["inter"] == 0.0 and p["inter_rows"] == 0.0
            else:
                # that model had no staged layer (n_comm = 0): its choice among the fused splits
                assert pm.choose_n_comm(shape, spec, e["layer"], staged=False) == e["choose"]
                assert pm.comm_saturation_blocks(shape, spec, e["layer"]) == e["saturation"]


def test_nic_constants_are_sourced_and_sane():
    for name, spec in pm.GPUS.items():
        assert 0 < spec.nic_gbs < spec.link_gbs  # the NIC is the slower link on every GPU
        assert 0 < spec.nic_eff <= 1 and spec.nic_latency_us > 0
        assert spec.block_nic_bw <= spec.block_link_bw  # per block too (Little's law)
    assert pm.GPUS["h800"].nic_gbs == 50.0  # DeepEP: CX7 400 Gb/s per H800
    assert pm.GPUS["a100"].nic_gbs == 25.0 and pm.GPUS["a100"].nic_eff == pytest.approx(0.74)
    assert pm.GPUS["h800"].block_nic_bw == pytest.approx(384 * pm.COPY_UNROLL * 16 / 6e-6)
    assert pm.get_spec("h800", 114).nic_gbs == 50.0  # scaling SMs keeps the NIC


def test_ranks_per_node_validation():
    with pytest.raises(ValueError):
        pm.MoEShape(W=8, E=8, k=2, H=8, N=8, T=1, ranks_per_node=3)
    with pytest.raises(ValueError):
        pm.MoEShape(W=8, E=8, k=2, H=8, N=8, T=1, ranks_per_node=0)
    s = pm.MoEShape(W=16, E=64, k=4, H=8, N=8, T=1, ranks_per_node=8)
    assert s.nodes == 2 and s.ranks_per_node == 8


def test_node_traffic_formulas():
    # Qwen2-MoE on 2 x 8: E=64, k=4, 32 experts per node
    T, W, P, E, k = 4096, 16, 8, 64, 4
    s = pm.MoEShape(W=W, E=E, k=k, H=2048, N=2816, T=T, ranks_per_node=P)
    flat = pm.MoEShape(**{**s.__dict__, "node_first": False})
    q = 1 - math.comb(32, 4) / math.comb(64, 4)
    assert pm.expected_distinct_nodes(W, E, k, P) == pytest.approx(2 * q)
    p_hit = pm.hit_probability(W, E, k)
    far = T * (W - P) * p_hit  # (token, remote-node rank) rows: a token once per rank
    tf = pm.node_traffic(flat, 0)
    assert tf.local == pytest.approx(T * k - T * (W - 1) * p_hit)  # M = T k rows, the rest local
    assert tf.same_node == pytest.approx(T * (P - 1) * p_hit)
    assert tf.nic == pytest.approx(far) and tf.fanout_nvlink == tf.fanout_local == 0
    tn_ = pm.node_traffic(s, 0)
    assert tn_.nic == pytest.approx(T * (2 - 1) * q)  # one row per (token, remote node)
    assert tn_.fanout_nvlink == pytest.approx(far * (P - 1) / P)
    assert tn_.fanout_local == pytest.approx(far / P)
    assert tn_.nvlink == pytest.approx(T * (P - 1) * p_hit + far * (P - 1) / P)
    # layer1: one partial row per (token, sending rank), same with or without node-first
    p_hit = pm.hit_probability(W, E, k)
    for shape in (s, flat):
        t1 = pm.node_traffic(shape, 1)
        assert t1.nic == pytest.approx(T * (W - P) * p_hit)
        assert t1.same_node == pytest.approx(T * (P - 1) * p_hit)
    # every remote row is accounted for once
    assert tf.same_node + tf.nic == pytest.approx(pm.remote_rows(s, 0))


def test_expected_distinct_nodes_matches_sampling():
    rng = random.Random(1)
    for W, P, E, k in [(16, 8, 64, 4), (16, 4, 16, 2), (8, 2, 32, 6)]:
        per_node = E // (W // P)
        n = 20000
        hits = sum(len({e // per_node for e in rng.sample(range(E), k)}) for _ in range(n)) / n
        assert pm.expected_distinct_nodes(W, E, k, P) == pytest.approx(hits, rel=0.02)


@st.composite
def node_shapes(draw, node_first=None):
    W = draw(st.sampled_from([2, 4, 8, 16, 32]))
    el = draw(st.sampled_from([1, 2, 4, 8]))
    E = W * el
    k = draw(st.integers(1, min(E, 8)))
    P = draw(st.sampled_from([p for p in range(1, W + 1) if W % p == 0]))
    nf = draw(st.booleans()) if node_first is None else node_first
    return pm.MoEShape(W=W, E=E, k=k, H=draw(st.sampled_from([128, 2048, 4096, 7168])),
                       N=draw(st.sampled_from([704, 2816, 14336])),
                       T=draw(st.sampled_from([0, 1, 333, 4096, 16384])),
                       dtype_bytes=draw(st.sampled_from([2, 4])), ranks_per_node=P, node_first=nf)


@FAST
@given(shape=node_shapes(node_first=True))
def test_node_first_never_increases_internode_bytes(shape):
    flat = pm.MoEShape(**{**shape.__dict__, "node_first": False})
    nf, fl = pm.internode_bytes(shape, 0), pm.internode_bytes(flat, 0)
    assert nf <= fl * (1 + 1e-12)
    if shape.nodes > 1 and shape.k >= 2 and shape.ranks_per_node >= 2 and shape.T > 0:
        assert nf < fl * (1 - 1e-9)  # two ranks of a token can share a node: strictly fewer
    # layer1 is not reduced by the hierarchy
    assert pm.internode_bytes(shape, 1) == pm.internode_bytes(flat, 1)


def test_node_first_reduces_internode_bytes_for_the_paper_shapes():
    for model, W, P in (("mixtral", 8, 4), ("qwen2", 16, 8), ("phi3.5", 16, 8)):
        s = preset_shape(model, 0, W=W)
        s = pm.MoEShape(**{**s.__dict__, "ranks_per_node": P})
        flat = pm.MoEShape(**{**s.__dict__, "node_first": False})
        assert pm.internode_bytes(s, 0) < pm.internode_bytes(flat, 0)
    # k = 1: nothing to deduplicate
    s = pm.MoEShape(W=16, E=64, k=1, H=128, N=128, T=1000, ranks_per_node=8)
    flat = pm.MoEShape(**{**s.__dict__, "node_first": False})
    assert pm.internode_bytes(s, 0) == pytest.approx(pm.internode_bytes(flat, 0))


@FAST
@given(shape=node_shapes(), spec=specs, n=st.sampled_from([1, 5, 16, 60]))
def test_node_reduce_never_increases_layer1_nic_rows_and_moves_them_to_the_tail(shape, spec, n):
    """layer1 node-reduced (module doc): T (n - 1) q NIC rows, at most the per-rank F, fewer when
    two of a token's ranks can share a node; the relays' NIC time is in the tail (after the
    kernel). One node: no effect at all."""
    n = min(n, spec.sm_count)
    red = pm.MoEShape(**{**shape.__dict__, "node_reduce": True})
    flat, nic = pm.internode_rows(shape, 1), pm.internode_rows(red, 1)
    assert nic <= flat * (1 + 1e-12)
    el_node = shape.E // shape.nodes
    if shape.nodes > 1 and shape.k >= 2 and el_node >= 2 and shape.ranks_per_node >= 2 \
            and shape.T > 0:
        assert nic < flat * (1 - 1e-9)
    if shape.nodes == 1:
        assert pm.comm_time(red, spec, n, 1) == pm.comm_time(shape, spec, n, 1)
        assert nic == flat == 0
    else:
        parts = pm._comm_parts(red, spec, n, 1)
        assert parts.nic_s == 0 and (parts.relay_s > 0) == (nic > 0)
        assert pm.comm_split(red, spec, n, 1)["inter_rows"] == nic


def test_node_reduce_on_the_paper_shapes():
    """H800 nodes: Qwen2 (k = 4 of 64, 2 x 8) sends 1.97x fewer layer1 NIC rows node-reduced and
    the model predicts its layer1 comm faster; Mixtral (k = 2 of 8, 2 x 4) saves 21% of the rows
    but pays the un-overlapped relay tail: slower. Model outputs, not measurements."""
    spec = pm.GPUS["h800"]
    got = {}
    for model, W, P in (("mixtral", 8, 4), ("qwen2", 16, 8)):
        s = pm.MoEShape(**{**preset_shape(model, 1, W=W).__dict__, "ranks_per_node": P})
        red = pm.MoEShape(**{**s.__dict__, "node_reduce": True})
        got[model] = (pm.internode_rows(s, 1) / pm.internode_rows(red, 1),
                      pm.comm_time(red, spec, 20, 1) / pm.comm_time(s, spec, 20, 1))
    assert got["qwen2"][0] > 1.9 and got["qwen2"][1] < 1, got
    assert 1.2 < got["mixtral"][0] < 1.4 and got["mixtral"][1] > 1, got


def _more_nodes(shape):
    """The same group with every smaller ranks_per_node, from one node to one rank per node."""
    W = shape.W
    return [pm.MoEShape(**{**shape.__dict__, "ranks_per_node": p})
            for p in range(W, 0, -1) if W % p == 0]


@FAST
@given(shape=node_shapes(node_first=False), spec=specs, layer=st.sampled_from([0, 1]),
       n=st.sampled_from([1, 2, 5, 16, 60, 200]))
# the local copies bound one node's stream (top-6 of 8 experts on 2 ranks: 5 of 6 slot rows local)
@example(shape=pm.MoEShape(W=2, E=8, k=6, H=2048, N=704, T=333, ranks_per_node=1),
         spec=pm.GPUS["a100"], layer=0, n=1)
def test_more_nodes_never_lower_comm_flat(shape, spec, layer, n):
    """Flat all-to-all (and layer1 either way): more nodes move rows from NVLink to the slower
    NIC, so at fixed W the predicted comm never drops, at any split -- except where the comm
    blocks' own stream was the bound: a layer0 row on the NIC is moved by the NIC's DMA beside
    the blocks' local copies (max) where on NVLink the blocks pulled it after them (sum). Then
    the comm drops by at most the NVLink pull time that left the blocks, and never below the
    NIC stream."""
    n = min(n, spec.sm_count)
    shapes_ = _more_nodes(shape)
    times = [pm.comm_time(s, spec, n, layer) for s in shapes_]
    splits = [pm.comm_split(s, spec, n, layer) for s in shapes_]
    for i, (a, b) in enumerate(zip(times, times[1:])):
        if b >= a * (1 - 1e-12):
            continue
        assert layer == 0, times
        moved = splits[i]["intra"] - splits[i + 1]["intra"]
        assert a - b <= moved * (1 + 1e-9) and b >= splits[i + 1]["inter"] * (1 - 1e-12), \
            (times, splits)


@FAST
@given(shape=node_shapes(node_first=True), spec=specs, n=st.sampled_from([1, 5, 16, 60, 200]))
def test_more_nodes_never_lower_layer1_comm_nor_node_first_nic_time(shape, spec, n):
    n = min(n, spec.sm_count)
    shapes_ = _more_nodes(shape)
    l1 = [pm.comm_time(s, spec, n, 1) for s in shapes_]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(l1, l1[1:])), l1
    nic = [pm.comm_split(s, spec, n, 0)["inter"] for s in shapes_]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(nic, nic[1:])), nic


@pytest.mark.parametrize("gpu", GPU_NAMES)
@pytest.mark.parametrize("model", ["mixtral", "qwen2", "phi3.5"])
def test_more_nodes_never_lower_comm_for_the_paper_shapes(model, gpu):
    """Node-first layer0 too, for the paper shapes: among multi-node groups at every split, and
    from one node to several with the whole GPU on comm (NVLink GPUs, W <= 16)."""
    spec = pm.GPUS[gpu]
    E = PRESETS[model][2]
    for W in (8, 16, 32):
        if E % W:
            continue
        for layer in (0, 1):
            shapes_ = _more_nodes(preset_shape(model, layer, W=W))
            for n in (1, 2, 8, 32, spec.sm_count):
                t = [pm.comm_time(s, spec, n, layer) for s in shapes_]
                assert all(b >= a * (1 - 1e-12) for a, b in zip(t[1:], t[2:])), (W, layer, n, t)
                if layer == 1 or (n == spec.sm_count and W <= 16 and spec.link == "nvlink"):
                    assert t[1] >= t[0] * (1 - 1e-12), (W, layer, n, t)


def test_node_first_can_beat_one_node_where_the_nic_has_slack():
    """The documented exception (module doc): with node-first dispatch and few comm blocks, the
    relay serves 1/P of a remote node's slot rows from its own memory while the NIC's DMA runs in
    parallel, so 2 x 8 ranks are predicted below a (hypothetical) 16-rank NVLink domain, whose
    path pulls every slot row over NVLink.  Flat, the same split is slower across nodes."""
    spec = pm.GPUS["h800"]
    one = preset_shape("qwen2", 0, W=16)
    two = pm.MoEShape(**{**one.__dict__, "ranks_per_node": 8})
    flat = pm.MoEShape(**{**two.__dict__, "node_first": False})
    assert pm.comm_time(two, spec, 1, 0) < pm.comm_time(one, spec, 1, 0)
    assert pm.comm_time(flat, spec, 1, 0) > pm.comm_time(one, spec, 1, 0)
    assert pm.comm_time(two, spec, spec.sm_count, 0) > pm.comm_time(one, spec, spec.sm_count, 0)


@FAST
@given(shape=node_shapes(), spec=specs, layer=st.sampled_from([0, 1]), tile=tiles, data=st.data())
def test_multi_node_predictions_keep_their_bounds(shape, spec, layer, tile, data):
    n = data.draw(st.integers(1, spec.sm_count - 1))
    p = pm.predict(shape, spec, n, layer, tile)
    eps = 1e-12
    assert max(p["comm"], p["gemm"]) <= p["kernel"] * (1 + eps)
    assert p["kernel"] <= p["sequential"] * (1 + eps)
    # comm overlaps its links: at least each link's part, at most their sum plus the HBM side
    assert p["comm"] >= p["inter"] * (1 - eps)
    if shape.nodes == 1:
        assert p["inter"] == 0.0
    _check_comm_curve(shape, spec, layer)


def test_multi_node_fused_beats_unfused_for_the_paper_shapes():
    spec = pm.GPUS["h800"]
    for model, W, P in (("mixtral", 8, 4), ("qwen2", 16, 8), ("phi3.5", 16, 8)):
        for nf in (True, False):
            for layer in (0, 1):
                s = pm.MoEShape(**{**preset_shape(model, layer, W=W).__dict__,
                                   "ranks_per_node": P, "node_first": nf})
                p = pm.predict(s, spec, pm.choose_n_comm(s, spec, layer), layer)
                assert p["fused"] < p["baseline"], (model, nf, layer, p)


# --------------------------------------------------------------------------------------------------
# Backward: the weight-gradient grouped GEMM counted in the backward's time
# --------------------------------------------------------------------------------------------------


def test_weight_grad_time_is_the_forward_gemm_flops_at_the_tensor_core_rate():
    spec = pm.get_spec("h100")
    for layer, n in ((0, 4096), (1, 2048)):
        s = pm.MoEShape(W=8, E=64, k=8, H=7168, N=n, T=4096)
        m = s.W * s.T * s.k / s.W  # rows on this rank (uniform routing)
        ideal = 2 * m * n * s.H / (spec.peak_flops(2) * spec.gemm_eff)
        t = pm.weight_grad_time(s, spec, layer)
        assert ideal <= t <= 1.05 * ideal  # compute bound: only tile rounding on top
        s32 = pm.MoEShape(**{**s.__dict__, "dtype_bytes": 4})  # fp32 operands: no tensor cores
        ratio = pm.weight_grad_time(s32, spec, layer) / t
        assert ratio == pytest.approx(spec.bf16_tflops / spec.fp32_tflops, rel=0.05)
    empty = pm.MoEShape(W=2, E=4, k=2, H=64, N=64, T=8, expert_rows=(0, 0))
    assert pm.weight_grad_time(empty, spec, 0) == 0.0
    # one expert with all rows: its tiles cannot spread over more SMs than it has tiles
    skew = pm.MoEShape(W=2, E=4, k=2, H=128, N=128, T=4096, expert_rows=(8192, 0))
    per_sm = spec.peak_flops(2) * spec.gemm_eff / spec.sm_count
    assert pm.weight_grad_time(skew, spec, 0) >= 2 * 128 * 128 * 8192 / per_sm


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer=st.sampled_from([0, 1]), W=st.sampled_from([1, 2, 8]), k=st.sampled_from([1, 2, 8]),
       T=st.integers(0, 8192), H=st.sampled_from([512, 4096]), N=st.sampled_from([256, 2048]))
def test_backward_overlap_lies_between_its_bounds(layer, W, k, T, H, N):
    spec = pm.get_spec("h100")
    s = pm.MoEShape(W=W, E=max(8, k), k=k, H=H, N=N, T=T)
    r = pm.predict_backward(s, spec, layer)
    assert r["weight_grad"] == pm.weight_grad_time(s, spec, layer)
    assert r["sequential"] == pytest.approx(r["collective"] + r["weight_grad"])
    assert max(r["collective"], r["weight_grad"]) <= r["overlapped"] * (1 + 1e-12)
    assert r["overlapped"] <= r["sequential"] * (1 + 1e-12)
    if layer == 0:  # dx is a moe_layer1-type call over the forward's rows
        n = pm.choose_n_comm(s, spec, 1)
        assert r["collective"] == pm.predict(s, spec, n, 1)["fused"]


# ----------------------------------------------------------------------------------------------
# A sweeps and layer1's column bands
# ----------------------------------------------------------------------------------------------


def test_mixtral_layer1_reads_h_at_most_8_times_on_8_h800():
    """Column order reads h once per n-tile (H / 128 = 32 times for Mixtral); the model's band
    brings it to at most 8 with the split it chooses, and layer0 reads its A operand once."""
    spec = pm.GPUS["h800"]
    shape = preset_shape("mixtral", 1)
    n = pm.choose_n_comm(shape, spec, 1)
    p = pm.predict(shape, spec, n, 1)
    assert p["band"] == pm.choose_band(shape, spec, n) and p["band"] >= 4
    assert p["a_sweeps"] <= 8
    assert pm.a_sweeps(shape, spec, 1, band=1) == 32
    column = pm.predict(shape, spec, n, 1, band=1)
    assert column["gemm"] > p["gemm"] and column["kernel"] > p["kernel"]
    s0 = preset_shape("mixtral", 0)
    assert pm.predict(s0, spec, pm.choose_n_comm(s0, spec, 0), 0)["a_sweeps"] == 1


def test_a_sweeps_and_band_width():
    spec = pm.GPUS["h800"]
    shape = preset_shape("mixtral", 1)  # 32 n-tiles, h = 235 MB: never in L2
    for band, sweeps in ((1, 32), (2, 16), (3, 11), (5, 7), (32, 1), (0, 1), (99, 1), (None, 1)):
        assert pm.a_sweeps(shape, spec, 1, band=band) == sweeps, band
    assert pm.band_width(0, 32) == pm.band_width(40, 32) == pm.band_width(None, 32) == 32
    assert all(pm.a_sweeps(preset_shape("mixtral", 0), spec, 0, band=b) == 1 for b in (1, 2, 0))
    # h that fits half the L2 is read once whatever the band
    small = pm.MoEShape(W=8, E=8, k=2, H=4096, N=1024, T=512)
    assert sum(pm.expert_rows(small)) * 1024 * 2 <= spec.l2_mb * 1e6 / 2
    assert pm.a_sweeps(small, spec, 1, band=1) == 1
    assert pm.choose_band(small, spec, 8) == 1


@pytest.mark.parametrize("gpu", ["a100", "h800", "l20"])
@pytest.mark.parametrize("model", ["mixtral", "qwen2", "phi3.5"])
def test_choose_band_fewest_sweeps_within_the_slack(model, gpu):
    """choose_band: a band whose W1 slab fits the L2 share, its kernel within BAND_SLACK of the
    fastest allowed band, and no band that close reads h fewer times."""
    spec = pm.GPUS[gpu]
    shape = preset_shape(model, 1)
    n = pm.choose_n_comm(shape, spec, 1, staged=False)  # (staged runs one band: choose_band 0)
    b = pm.choose_band(shape, spec, n)
    allowed = range(1, pm.max_band(shape, spec) + 1)
    assert b in allowed
    kernel = {c: pm.predict(shape, spec, n, 1, band=c)["kernel"] for c in allowed}
    best = min(kernel.values())
    assert kernel[b] <= best * (1 + pm.BAND_SLACK)
    sweeps = lambda c: pm.a_sweeps(shape, spec, 1, band=c)  # noqa: E731
    assert all(sweeps(c) >= sweeps(b) for c in allowed if kernel[c] <= best * (1 + pm.BAND_SLACK))


def test_max_band_fits_the_l2_share():
    spec = pm.GPUS["h800"]
    shape = preset_shape("mixtral", 1)  # one expert per rank: 128 x 14336 bf16 = 3.7 MB per n-tile
    b = pm.max_band(shape, spec)
    slab = 128 * 14336 * 2
    assert b * slab <= spec.l2_mb * 1e6 * pm.L2_REUSE_FRACTION < (b + 1) * slab
    assert pm.max_band(shape, dataclasses.replace(spec, l2_mb=1.0)) == 1  # nothing fits: b = 1


# --------------------------------------------------------------------------------------------------
# Expert tensor parallelism (tp_size): the direct and group paths, the model's choice
# --------------------------------------------------------------------------------------------------


def test_tp_size_1_is_the_model_without_tp_bit_for_bit(monkeypatch):
    """An explicit tp_size=1 reproduces the golden predictions of the model before TP (a sample of
    tests/data/perfmodel_one_node.json) and reports the direct path."""
    entries = _golden_entries(monkeypatch)
    for e in entries[::7]:
        d = _golden_shape(e)
        spec = dataclasses.replace(pm.GPUS[e["gpu"]], l2_mb=math.inf)
        shape = pm.MoEShape(**d, tp_size=1)
        assert shape.ep_size == shape.W and shape.E_local == shape.E // shape.W
        if "predict" in e:
            p = pm.predict(shape, spec, e["n_comm"], e["layer"])
            assert {k: p[k] for k in e["predict"]} == e["predict"], e
            assert p["tp_path"] == "direct"
        else:
            assert pm.choose_n_comm(shape, spec, e["layer"], staged=False) == e["choose"]


def _tp(W=8, E=32, k=4, t=4, T=1024, H=1024, N=256, P=None, **kw):
    return pm.MoEShape(W=W, E=E, k=k, H=H, N=N, T=T, tp_size=t, ranks_per_node=P, **kw)


def test_tp_traffic_formulas_one_node():
    s = _tp()
    W, t, EP, T, k = 8, 4, 2, 1024, 4
    p = pm.hit_probability(EP, 32, k)
    assert s.ep_size == EP and s.E_local == 16
    assert sum(pm.expert_rows(s)) == pytest.approx(t * T * k)  # every rank of an EP rank: all rows
    d0 = pm.tp_traffic(s, 0, "direct")
    assert d0.local + d0.same_node == pytest.approx(t * T * k) and d0.nic == 0
    assert d0.same_node == pytest.approx(T * p * (W - 1))  # a token once per (source, rank)
    g0 = pm.tp_traffic(s, 0, "group")
    assert g0.same_node == pytest.approx(T * p * (W - 1))  # the same rows, in two hops
    assert g0.same_node == pytest.approx(d0.same_node)
    assert g0.local == pytest.approx(T * p + t * T * k)  # own stage + the expansion into slots
    d1, g1 = pm.tp_traffic(s, 1, "direct"), pm.tp_traffic(s, 1, "group")
    assert d1.same_node == pytest.approx(T * p * (W - 1)) and d1.local == pytest.approx(T * p)
    assert g1.same_node == pytest.approx(T * p * (W - 1 / t))  # the reduce-scatter costs NVLink
    assert g1.local == pytest.approx(T * p / t)
    # EP = 1 (t = W): every token hits the one EP rank; nothing crosses groups
    s8 = _tp(t=8)
    assert pm.tp_traffic(s8, 0, "group").same_node == pytest.approx(7 * 1024)


def test_tp_group_paths_cut_the_nic_rows():
    """Across nodes (2 x 8, t = 4): layer0's group path moves 1/t of direct's NIC rows (a token
    once per EP rank, not once per tp rank), layer1's 1/t; and the model picks the group path
    for layer1 there."""
    s = _tp(W=16, E=64, k=4, t=4, P=8, H=4096, N=512)
    EP, k, t = 4, 4, 4
    p = pm.hit_probability(EP, 64, k)
    n0 = {path: pm.tp_traffic(s, 0, path).nic for path in pm.TP_PATHS}
    n1 = {path: pm.tp_traffic(s, 1, path).nic for path in pm.TP_PATHS}
    assert n0["group"] == pytest.approx(n0["direct"] / t)
    assert n0["direct"] == pytest.approx((16 - 8) * 1024 * p)
    assert n1["group"] == pytest.approx(n1["direct"] / t)
    spec = pm.GPUS["h800"]
    assert pm.choose_tp_path(s, spec, 1) == "group"
    assert pm.predict(s, spec, 20, 1)["tp_path"] == "group"
    assert s.node_first is False  # no node-first relay with TP


def test_tp_choice_is_the_shorter_comm_and_explicit_paths_are_honoured():
    spec = pm.GPUS["h100"]
    for s in (_tp(), _tp(t=8), _tp(E=8, k=2, t=4), _tp(W=16, E=64, t=4, P=8)):
        for layer in (0, 1):
            alt = pm.tp_alternatives(s, spec, layer)
            chosen = pm.choose_tp_path(s, spec, layer)
            group_wins = alt["group"]["comm_full"] < alt["direct"]["comm_full"] * (1 - pm.TP_PATH_SLACK)
            assert chosen == ("group" if group_wins else "direct")
            assert pm.resolve_tp_path(s, spec, layer).tp_path == chosen
            for path in pm.TP_PATHS:
                fixed = dataclasses.replace(s, tp_path=path)
                assert pm.predict(fixed, spec, 10, layer)["tp_path"] == path
                assert pm.comm_time(fixed, spec, spec.max_blocks, layer) == alt[path]["comm_full"]
    # E32 top4 over EP1 x TP8: the built path already sends a token once per rank, so the
    # group path's second hop buys nothing on one node
    assert pm.choose_tp_path(_tp(t=8, H=8192, N=1024), spec, 0) == "direct"


@FAST
@given(W=st.sampled_from([2, 4, 8]), t=st.sampled_from([2, 4, 8]), el=st.sampled_from([1, 2, 4]),
       k=st.integers(1, 4), T=st.sampled_from([0, 7, 256, 2048]), layer=st.sampled_from([0, 1]),
       path=st.sampled_from(list(pm.TP_PATHS) + [None]), fp8=st.booleans(), spec=specs)
def test_tp_predictions_keep_the_bounds(W, t, el, k, T, layer, path, fp8, spec):
    if W % t:
        t = W
    E = (W // t) * el
    if k > E:
        k = E
    s = pm.MoEShape(W=W, E=E, k=k, H=512, N=256, T=T, tp_size=t, tp_path=path,
                    dtype_bytes=1 if fp8 else 2)
    n = max(1, spec.max_blocks // 4)
    p = pm.predict(s, spec, n, layer)
    eps = 1e-12
    assert p["limit"] <= p["kernel"] * (1 + eps)
    assert max(p["comm"], p["gemm"]) <= p["kernel"] * (1 + eps) <= p["sequential"] * (1 + 2 * eps)
    assert p["tp_path"] in pm.TP_PATHS and (path is None or p["tp_path"] == path)
    c = [pm.comm_time(s, spec, m, layer) for m in (1, 2, 8, spec.max_blocks)]
    assert all(a >= b * (1 - eps) for a, b in zip(c, c[1:]))  # more comm blocks never slower


def test_tp_validation():
    with pytest.raises(ValueError, match="tp_size=3"):
        _tp(t=3)
    with pytest.raises(ValueError, match="must divide E=6"):
        pm.MoEShape(W=8, E=6, k=2, H=8, N=8, T=1, tp_size=2)  # EP = 4 does not divide 6
    with pytest.raises(ValueError, match="ranks_per_node=2"):
        _tp(W=16, E=64, t=4, P=2)
    with pytest.raises(ValueError, match="node_reduce"):
        _tp(W=16, E=64, t=4, P=8, node_reduce=True)
    with pytest.raises(ValueError, match="remote_rows"):
        _tp(remote_rows=100.0)
    with pytest.raises(ValueError, match="tp_path"):
        _tp(tp_path="ring")
    with pytest.raises(ValueError, match="needs tp_path"):
        pm.remote_rows(_tp(), 0)  # no spec, no choice
    assert pm.remote_rows(_tp(tp_path="direct"), 0) > 0
    assert pm.MoEShape(W=8, E=4, k=2, H=8, N=8, T=1, tp_size=2).E_local == 1  # EP 4 divides E 4


def test_flux_configurations_table_inputs():
    """The TP table's configurations: 8 ranks, 1024 tokens each, shard N / t, and the EP-only
    alternative has the same GEMM work per rank (E/8 whole experts)."""
    from comet.tune import cli as cli

    spec = pm.GPUS["h100"]
    for E, k, t, ep, _, _ in cli.FLUX_CONFIGS:
        assert ep * t == cli.FLUX_WORLD
        s = pm.MoEShape(W=8, E=E, k=k, H=8192, N=8192 // t, T=1024, tp_size=t)
        e = pm.MoEShape(W=8, E=E, k=k, H=8192, N=8192, T=1024)
        flops = lambda x: sum(pm.expert_rows(x)) * x.N  # noqa: E731
        assert flops(s) == pytest.approx(flops(e))
        for layer in (0, 1):
            p = pm.predict(s, spec, pm.choose_n_comm(s, spec, layer), layer)
            assert p["fused"] > 0 and p["tp_path"] in pm.TP_PATHS


def test_docs_tp_table_says_what_it_compares():
    """The TP table sets a model of our design beside another implementation's measurement
    (the table itself is checked by tests/test_docs.py through tools/doc_figures.py)."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "flux measured ms" in text and "a model of our design" in text
    assert "measurement of another implementation" in text


# --------------------------------------------------------------------------------------------------
# FP8 (dtype_bytes = 1)
# --------------------------------------------------------------------------------------------------


def test_fp8_rates_come_from_the_datasheets():
    for name in ("h100", "h800", "h200"):
        spec = pm.GPUS[name]
        assert spec.fp8_tflops == 1979.0 and spec.peak_flops(1) == 2 * spec.peak_flops(2)
    assert pm.GPUS["h20"].fp8_tflops == 296.0 and pm.GPUS["l20"].fp8_tflops == 239.0
    assert pm.GPUS["a100"].fp8_tflops is None  # no FP8 tensor cores: charged the bf16 rate
    assert pm.GPUS["a100"].peak_flops(1) == pm.GPUS["a100"].peak_flops(2)
    assert pm.get_spec("h800", 66).peak_flops(1) == pytest.approx(pm.GPUS["h800"].peak_flops(1) / 2)


@pytest.mark.parametrize("H", [128, 4096, 7168, 100, 2050])
def test_fp8_link_bytes(H):
    """layer0 with FP8 tokens moves (H + 4 ceil(H/128)) / (2 H) of bf16's bytes (the scales
    travel with the row); layer1's partials stay bf16."""
    bf = pm.MoEShape(W=8, E=64, k=4, H=H, N=256, T=4096)
    f8 = dataclasses.replace(bf, dtype_bytes=1)
    assert f8.is_fp8 and f8.row_bytes == H + 4 * math.ceil(H / 128)
    ratio = pm.traffic_bytes(f8, 0) / pm.traffic_bytes(bf, 0)
    assert ratio == pytest.approx((H + 4 * math.ceil(H / 128)) / (2 * H))
    if H % 128 == 0:
        assert ratio == pytest.approx((H + 4 * H / 128) / (2 * H))
    assert pm.traffic_bytes(f8, 1) == pytest.approx(pm.traffic_bytes(bf, 1))
    assert pm.dtype_bytes("float8_e4m3fn") == pm.dtype_bytes("torch.float8_e5m2") == 1
    assert pm.dtype_name("e4m3") == "fp8"


def test_fp8_gemm_runs_at_twice_the_rate_plus_the_promotion_and_backward_is_bf16():
    """A tile's MMAs take half of bf16's time at the FP8 rate; the promotion (one FMA per
    output element and 128-wide K block at fp32_tflops / 2, on the tile's SM) comes on top."""
    spec = pm.GPUS["h800"]
    for model in PRESETS:
        for layer in (0, 1):
            bf = preset_shape(model, layer)
            f8 = dataclasses.replace(bf, dtype_bytes=1)
            k_red = pm.gemm_dims(f8, layer)[1]
            promotion = 128 * 128 * math.ceil(k_red / 128) / (67e12 / 2 / 132)
            tile = pm._tile_seconds(f8, spec, layer, pm.DEFAULT_TILE)
            assert tile == pytest.approx(pm._tile_seconds(bf, spec, layer, pm.DEFAULT_TILE) / 2
                                         + promotion)
            assert pm.gemm_time(f8, spec, 100, layer) < pm.gemm_time(bf, spec, 100, layer)
            pf = pm.predict(f8, spec, pm.choose_n_comm(f8, spec, layer), layer)
            pb = pm.predict(bf, spec, pm.choose_n_comm(bf, spec, layer), layer)
            assert pf["fused"] < pb["fused"] and pf["fused"] < pf["baseline"]
            assert pm.predict_backward(f8, spec, layer) == pm.predict_backward(bf, spec, layer)


def test_fp8_promotion_is_charged_on_fp8_tensor_cores_only():
    """An FP8 GEMM [M, N, K] costs its tensor-core time 2 M N K / (fp8_rate * gemm_eff) plus
    M N ceil(K / 128) / fma_rate (the accumulator promotion, not overlapped); nothing extra on
    the CPU backend's spec or on a GPU without FP8 tensor cores."""
    # One local expert of M = 11 m-tiles and N = 12 n-tiles: 132 tiles, one wave on 132 SMs, so
    # the wave time is the whole GEMM's; K = 8256 = 64.5 scale blocks (ceil: 65).
    M, N, K = 1408, 1536, 8256
    f8 = pm.MoEShape(W=8, E=8, k=2, H=K, N=N, T=4096, dtype_bytes=1, expert_rows=(M,))
    spec = pm.GPUS["h800"]
    assert spec.fma_rate == 67e12 / 2 and pm.fp8_promotion_charged(f8, spec)
    tensor_cores = 2 * M * N * K / (spec.peak_flops(1) * spec.gemm_eff)
    promotion = M * N * 65 / spec.fma_rate
    assert pm.fp8_promotion_seconds(M, N, K, spec.fma_rate) == pytest.approx(promotion)
    assert pm.gemm_time(f8, spec, 132, 0) == pytest.approx(tensor_cores + promotion)
    assert pm.gemm_time(f8, dataclasses.replace(spec, fp8_promotion=False), 132, 0) == \
        pytest.approx(tensor_cores)
    bf = dataclasses.replace(f8, dtype_bytes=2)
    assert not pm.fp8_promotion_charged(bf, spec)
    # The CPU backend: same fp32 units for everything, no promotion term (compute-bound here).
    cpu = pm.cpu_spec(threads=4, gflops_per_thread=8.0, mem_gbs=1e6)
    assert not cpu.fp8_promotion and not pm.fp8_promotion_charged(f8, cpu)
    assert pm.gemm_time(f8, cpu, 4, 0) == pytest.approx(2 * M * N * K / cpu.peak_flops(1))
    # No FP8 tensor cores (A100): the bf16 rate, no promotion.
    a100 = pm.GPUS["a100"]
    assert not pm.fp8_promotion_charged(f8, a100)
    assert pm._tile_seconds(f8, a100, 0, pm.DEFAULT_TILE) == \
        pytest.approx(pm._tile_seconds(bf, a100, 0, pm.DEFAULT_TILE))


@pytest.mark.parametrize("gpu, share", [("h100", 0.23), ("h800", 0.23), ("h20", 0.053),
                                        ("l20", 0.031)])
def test_fp8_promotion_share_of_a_k_tile(gpu, share):
    """The module docstring's figures: the promotion of a 128 x 128 tile's k-tile against the
    k-tile's 2 * 128^3 FP8 tensor-core FLOPs, both at peak."""
    spec = pm.GPUS[gpu]
    promote = 128 * 128 / spec.fma_rate
    mma = 2 * 128 ** 3 / spec.peak_flops(1)
    assert promote / mma == pytest.approx(share, abs=0.002)


# -- The activation between the ops, separate or fused into layer0 (model/activation.py) ----------

def test_activation_kernel_is_a_launch_plus_y0_read_and_h_written():
    spec = pm.GPUS["h800"]
    s = pm.MoEShape(W=8, E=8, k=2, H=4096, N=28672, T=4096, dtype_bytes=2)
    rows = 8 * 4096 * 2 / 8  # uniform routing: W T k / E rows per local expert, one expert
    want = 3e-6 + 2 * rows * (28672 + 14336) / (3350e9 * spec.hbm_eff)
    assert math.isclose(pm.activation_kernel_time(s, spec), want, rel_tol=1e-12)
    plain = 3e-6 + 2 * rows * (2 * 28672) / (3350e9 * spec.hbm_eff)
    assert math.isclose(pm.activation_kernel_time(s, spec, gated=False), plain, rel_tol=1e-12)


def test_fused_activation_removes_the_kernel_and_y0s_bytes():
    spec = pm.GPUS["h800"]
    # Mixtral's layer0: tensor-core bound, so fused = layer0 and unfused = layer0 + the kernel
    s = pm.MoEShape(W=8, E=8, k=2, H=4096, N=28672, T=4096, dtype_bytes=2)
    p = pm.predict_activation(s, spec, pm.choose_n_comm(s, spec, 0))
    assert p["fused"] == p["layer0"]
    assert math.isclose(p["unfused"], p["layer0"] + pm.activation_kernel_time(s, spec))
    assert p["saved_bytes"] == 2 * 2 * 8192 * 28672  # y0 written and read back, bf16
    # a bytes-bound layer0 (H = 128): writing h instead of y0 shortens the GEMM itself too
    small = pm.MoEShape(W=8, E=8, k=2, H=128, N=8192, T=4096, dtype_bytes=2)
    q = pm.predict_activation(small, spec, pm.choose_n_comm(small, spec, 0))
    assert q["fused"] < q["layer0"] < q["unfused"]
