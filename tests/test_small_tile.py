"""The small-batch tile: the engine's m-tile plan at tile_m = 64 and 128 (hypothesis, against a
plan written here), and the tuner's and the decode model's choice of tile against the stated rule
(comet/tune/model/small_tile.py, docs/tuning.md "The small-batch tile"): with uniform routing
tile_m = 64 exactly when every local expert has at most 64 rows, else 128."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comet import _C
from comet.tune import perfmodel as pm
from comet.tune import tuner as tn
from comet.tune.model import decode as dm
from comet.tune.model import small_tile as stl

GRIDS = [(1, 1), (3, 1), (2, 4)]  # (blocks, threads per block) of the plan program

def plan(counts, tile_m):
    """The m-tiles of experts with `counts` rows, expert-major: (first row, rows, expert)."""
    out, row = [], 0
    for e, c in enumerate(counts):
        out += [(row + i, min(tile_m, c - i), e) for i in range(0, c, tile_m)]
        row += c
    return out

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=7), st.sampled_from(GRIDS))
def test_tile_plan_at_64_and_128_rows(counts, grid):
    off = [0]
    for c in counts:
        off.append(off[-1] + c)
    tiles = {tm: _C.engine.mtiles(off, tm, *grid) for tm in (64, 128)}
    for tm, got in tiles.items():
        assert [tuple(t) for t in got] == plan(counts, tm), (tm, counts)
    # each 128-row tile is exactly the one or two 64-row tiles that start inside it
    small = {b: (n, e) for b, n, e in tiles[64]}
    for b, n, e in tiles[128]:
        parts = [(b, *small[b])] + ([(b + 64, *small[b + 64])] if n > 64 else [])
        assert sum(p[1] for p in parts) == n and all(p[2] == e for p in parts)

def uniform_shape(W, E, k, T, layer, dtype_bytes=2):
    return pm.MoEShape(W=W, E=E, k=k, H=7168, N=4096 if layer == 0 else 2048, T=T,
                       dtype_bytes=dtype_bytes)

# (W, E, k, T): rows per expert W T k / E from 0.25 to 1024, around the 64-row boundary too.
SHAPES = [(8, 256, 8, 1), (8, 256, 8, 32), (8, 256, 8, 128), (8, 256, 8, 256), (8, 256, 8, 260),
          (8, 256, 8, 512), (4, 16, 8, 16), (4, 16, 8, 32), (4, 16, 8, 33), (2, 32, 8, 2048),
          (16, 256, 8, 128), (16, 256, 8, 256)]

@pytest.mark.parametrize("gpu", ["h800", "a100"])
@pytest.mark.parametrize("dtype_bytes", [1, 2], ids=["fp8", "bf16"])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("W,E,k,T", SHAPES)
def test_model_picks_64_rows_exactly_for_few_rows_per_expert(W, E, k, T, layer, dtype_bytes, gpu):
    spec = pm.GPUS[gpu]
    shape = uniform_shape(W, E, k, T, layer, dtype_bytes)
    rows = W * T * k / E
    want = (64, 128) if rows <= 64 else (128, 128)
    assert stl.choose_tile(shape, spec, layer) == want, rows

def test_tuner_chooses_among_the_cuda_tiles_only_when_asked(tmp_path):
    t = tn.Tuner(tmp_path)
    for T, want in ((128, (64, 128)), (1024, (128, 128))):
        key = tn.TuneKey("h800", 132, "bfloat16", 8, 256, 8, 7168, 4096, T, 0)
        cfg = t.choose(key, tiles=stl.CUDA_TILES)
        assert cfg.tile == want and 0 <= cfg.n_comm < 132
    key = tn.TuneKey("h800", 132, "bfloat16", 8, 256, 8, 7168, 4096, 128, 0)
    assert t.choose(key).tile == pm.DEFAULT_TILE  # no candidates: the given / default tile
    assert t.choose(key, tile=(128, 128), tiles=stl.CUDA_TILES).tile == (128, 128)

def test_a_cached_tile_outside_the_candidates_is_not_used(tmp_path):
    t = tn.Tuner(tmp_path)
    key = tn.TuneKey("h800", 132, "bfloat16", 8, 256, 8, 7168, 4096, 128, 0)
    t.store(key, tn.Config(5, 32, 64))
    assert t.choose(key).tile == (32, 64)
    cfg, source = t.choose(key, tiles=stl.CUDA_TILES, explain=True)  # a CPU-style tile: not run
    assert source == "model" and cfg.tile == (64, 128)

def test_pick_tile_order():
    a, b = (128, 128), (64, 128)
    assert stl.pick_tile([(a, 2.0, 10, 128), (b, 1.0, 10, 64)]) == b  # faster wins
    assert stl.pick_tile([(a, 1.0, 10, 128), (b, 1.0, 20, 64)]) == a  # tie: fewer tiles
    assert stl.pick_tile([(a, 1.0, 10, 128), (b, 1.0, 10, 64)]) == b  # then less padding
    assert stl.pick_tile([(a, 1.0, 10, 64), (b, 1.0, 10, 64)]) == a  # then the larger tile

def test_padding_and_block_rate():
    assert stl.padded_rows([32, 0, 65, 128], 64) == 64 + 128 + 128
    assert stl.padded_rows([32, 0, 65, 128], 128) == 128 * 3
    spec = pm.GPUS["h800"]
    share = spec.hbm_bw / spec.sm_count
    for tm in (64, 128):  # with one block per SM, the stages never limit the stream
        assert stl.block_stream_rate(spec, tm) == pytest.approx(share)
        assert stl.STAGES[tm] * stl.WEIGHT_STAGE_BYTES / stl.HBM_LATENCY_S > share

def test_decode_model_runs_the_small_tile_up_to_64_rows_per_expert():
    spec = pm.GPUS[dm.DECODE_GPU]
    for W, rpn in dm.DECODE_GROUPS:
        for T in dm.DECODE_TOKENS:
            p = dm.DecodePoint(W, T, "fp8", rpn)
            f = dm.decode_fused(p, spec)
            rows = T * p.k / dm.active_experts(W, p.E, p.k, T)
            want = 64 if rows <= 64 + 1e-9 else 128
            assert (f["tile_m0"], f["tile_m1"]) == (want, want), (W, T, rows)
            # the small tile never makes the model's layer slower than the 128-row tile
            for layer, kern in ((0, dm._layer0_kernel), (1, dm._layer1_kernel)):
                big = dm._best_split(kern, p, spec, (128, 128))[1]
                assert f[f"layer{layer}"] <= big * (1 + 1e-12)


@pytest.mark.parametrize("arch,T,want", [("h800", 128, {(128, 128), (64, 128)}),
                                         ("h800", 1024, {(128, 128)}),
                                         ("cpu", 128, {(128, 128)})])
def test_profiling_measures_the_small_tile_where_it_removes_padding(tmp_path, arch, T, want):
    """tn.profile's default candidates: the 64-row tile beside the 128-row one on a GPU when
    every expert has at most 64 rows (8 x 128 x 8 / 256 = 32 here; 256 at 1024 tokens)."""
    seen = set()

    def factory(key, shape, group):
        def run(cfg):
            seen.add(cfg.tile)
            return 1e-3 + 1e-6 * cfg.n_comm + (0 if cfg.tile_m == 64 else 1e-7)
        return run

    key = tn.TuneKey(arch, 132, "bfloat16", 8, 256, 8, 7168, 4096, T, 0)
    cfg = tn.profile(key, profilers={"layer0": factory}, tuner=tn.Tuner(tmp_path),
                     progress=False, iters=1, warmup=0)
    # the fake timing makes the 64-row tile faster: measured, it wins wherever it was a candidate
    assert seen == want and cfg.tile == ((64, 128) if (64, 128) in want else (128, 128))
