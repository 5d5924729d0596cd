"""The GEMM tile orders' raster groups (csrc/include/comet/tile_order.h) and the staged layer
(n_comm = 0, comet/block_roles.h), against orders written out here from their stated rules and
against the reference.

- raster_group(n) is the largest g with g * g <= n: brute force, and the cost model's copy.
- layer0 with group g: the group-1 order's m-tile sequence (checked against the ring-distance rule
  by tests/test_engine_layout.py) cut into runs of g, each run walked n-major.
- layer1 with band b and group g: bands of b n-tiles in order; inside a band runs of g m-tiles
  in m-tile order, each walked n-major over the band's n-tiles.
- the ops under $COMET_RASTER_GROUP give the same bits for every group (order never changes a
  sum), and a bad value is refused before any kernel runs."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comet
from comet import _C
from comet.tune import perfmodel as pm
from tests.cases import cases_for, make_inputs
from tests.test_ops_sim import check_against_reference, run_layers

eng = _C.engine


def test_raster_group_is_the_integer_square_root():
    for n in range(0, 400):
        brute = max([g for g in range(1, 21) if g * g <= n] or [1])
        assert eng.raster_group(n) == brute
        assert pm.raster_group(n) == brute
    assert eng.raster_group(132) == 11 and eng.raster_group(108) == 10


def _layout(rows, world=1):
    expert_off = [0]
    for r in rows:
        expert_off.append(expert_off[-1] + r)
    seg_off = []
    for e, r in enumerate(rows):  # every row from the local rank (world 1)
        seg_off += [expert_off[e], expert_off[e + 1]]
    return expert_off, seg_off


def _groups(seq, g):
    return [seq[i:i + g] for i in range(0, len(seq), g)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 13), min_size=1, max_size=4), st.integers(1, 4),
       st.integers(1, 7), st.integers(1, 6))
def test_layer0_raster_groups(rows, tile_m, num_ntiles, group):
    expert_off, seg_off = _layout(rows)
    base = eng.tile_order(0, expert_off, seg_off, 1, tile_m, num_ntiles, group=1)
    mseq = [m for i, (m, _n) in enumerate(base) if i % num_ntiles == 0]
    want = [(m, n) for run in _groups(mseq, group) for n in range(num_ntiles) for m in run]
    assert eng.tile_order(0, expert_off, seg_off, 1, tile_m, num_ntiles, group=group) == want
    # group 0: the automatic group of the GEMM blocks
    auto = eng.tile_order(0, expert_off, seg_off, 1, tile_m, num_ntiles, group=0, gemm_blocks=17)
    assert auto == eng.tile_order(0, expert_off, seg_off, 1, tile_m, num_ntiles, group=4)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 13), min_size=1, max_size=4), st.integers(1, 4),
       st.integers(1, 7), st.integers(0, 8), st.integers(1, 6))
def test_layer1_raster_groups_inside_bands(rows, tile_m, num_ntiles, band, group):
    expert_off, seg_off = _layout(rows)
    mt = len(eng.mtiles(expert_off, tile_m))
    b = num_ntiles if band == 0 or band > num_ntiles else band
    want = []
    for first in range(0, num_ntiles, b):
        cols = range(first, min(first + b, num_ntiles))
        for run in _groups(list(range(mt)), group):
            want += [(m, n) for n in cols for m in run]
    got = eng.tile_order(1, expert_off, seg_off, 1, tile_m, num_ntiles, band_n=band, group=group)
    assert got == want


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(0, 7), st.integers(1, 4),
       st.integers(1, 2), st.integers(1, 5))
def test_grouped_bands_publish_only_after_all_their_tiles(num_mtiles, num_ntiles, band, blocks,
                                                          threads, group):
    """The real layer1_gemm on a CPU grid with raster groups: every tile once, no tile of a band
    after any of its band's flags went up, every flag up and every counter reset at the end."""
    seen, flags, counts = eng.layer1_schedule(num_mtiles, num_ntiles, band, blocks, threads, group)
    assert sorted((m, n) for m, n, _ in seen) == sorted(
        (m, n) for m in range(num_mtiles) for n in range(num_ntiles))
    assert all(published == 0 for _, _, published in seen)
    assert flags == [1] * num_ntiles and counts == [0] * num_ntiles


@pytest.mark.parametrize("case", [cases_for(1)[2], cases_for(3)[4]], ids=str)
@pytest.mark.parametrize("n_comm", [0, 2])
def test_ops_bitwise_equal_for_every_raster_group(monkeypatch, case, n_comm):
    monkeypatch.setenv("COMET_CPU_BLOCKS", "6")
    inputs = make_inputs(case, torch.float32)
    base, _ = run_layers(case, torch.float32, 1, 1, (4, 4), inputs=inputs)
    for group in ("1", "2", "3", "0"):
        monkeypatch.setenv("COMET_RASTER_GROUP", group)
        got, _ = run_layers(case, torch.float32, n_comm, 6 - n_comm, (4, 4), inputs=inputs)
        check_against_reference(case, torch.float32, got, inputs)
        for a, b in zip(base, got):
            assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]), group


def test_a_bad_raster_group_setting_is_refused(monkeypatch):
    case = cases_for(1)[0]
    monkeypatch.setenv("COMET_RASTER_GROUP", "two")
    with pytest.raises(RuntimeError, match=r"\$COMET_RASTER_GROUP must be an integer >= 0 \(m-tiles per "
                                           r"raster group; 0 or unset: automatic\), got 'two'"):
        run_layers(case, torch.float32, 1, 1, (4, 4))


def test_the_model_stages_a_world_of_one_and_charges_its_second_launch():
    """Rule: where no row crosses a link the model picks no comm blocks (n_comm = 0); a staged
    layer costs its comm on the whole grid, then its GEMM on the whole grid (layer1: one band),
    plus one launch."""
    spec = pm.GPUS["h200"]
    for layer, n in ((0, 2 * 14336), (1, 14336)):
        one = pm.MoEShape(W=1, E=8, k=2, H=4096, N=n, T=4096)
        assert pm.choose_n_comm(one, spec, layer) == 0
        p = pm.predict(one, spec, 0, layer)
        comm = pm.comm_time(one, spec, spec.max_blocks, layer)
        gemm = pm.gemm_time(one, spec, spec.max_blocks, layer, band=0 if layer else 1)
        assert p["kernel"] == pytest.approx(comm + gemm + pm.KERNEL_GAP_S, rel=1e-12)
        assert p["n_gemm"] == spec.max_blocks and p["band"] == (1 if layer == 0 else 32)
    eight = pm.MoEShape(W=8, E=8, k=2, H=4096, N=2 * 14336, T=4096)
    assert pm.choose_n_comm(eight, pm.GPUS["h800"], 0) > 0  # rows cross NVLink: overlap pays


def test_the_model_charges_weight_rereads_per_raster_group():
    """An expert's weights are read once per raster group of its m-tiles (ceil(m-tiles / g))
    when they do not fit the L2 share, once when they do, once in the baseline's raster."""
    spec = pm.GPUS["h200"]
    one = pm.MoEShape(W=1, E=8, k=2, H=4096, N=2 * 14336, T=4096)  # 1024 rows: 8 m-tiles each
    assert pm.weight_reads(one, spec, 0, 132, band=1) == 8 * math.ceil(8 / 11)
    assert pm.weight_reads(one, spec, 0, 4, band=1) == 8 * math.ceil(8 / 2)
    assert pm.weight_reads(one, spec, 0, 4, band=None) == 8
    small = pm.MoEShape(W=1, E=8, k=2, H=256, N=512, T=4096)  # 256 KiB of weights per expert
    assert pm.weight_reads(small, spec, 0, 4, band=1) == 8
