"""Tests of comet.tune.tuner (keys, cache, choice, measured tuning across ranks) and the comet.tune CLI."""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import subprocess
import sys
import types
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = pathlib.Path(__file__).resolve().parents[1]


from comet.tune import perfmodel as pm  # noqa: E402
from comet.tune import tuner as tn  # noqa: E402
from comet.tune import cli as cli  # noqa: E402

try:  # tests/ as a package or as a plain directory on sys.path
    from tests.dist_utils import run_ranks
except ImportError:  # pragma: no cover - depends on how pytest was invoked
    from dist_utils import run_ranks


def mkkey(tokens=4096, arch="h800", sm=132, layer=0, H=4096, N=28672, dtype="bf16"):
    return tn.TuneKey(arch, sm, dtype, 8, 8, 2, H, N, tokens, layer)


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("COMET_CACHE_DIR", str(d))
    return d


# ----------------------------------------------------------------------------------------------
# Keys and configs
# ----------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 40))
def test_token_bucket_is_the_next_power_of_two(t):
    b = tn.token_bucket(t)
    assert b >= 1 and b & (b - 1) == 0
    assert b >= t
    if t >= 2:
        assert b < 2 * t
    assert tn.token_bucket(b) == b


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 20), st.integers(0, 1 << 20))
def test_token_bucket_monotone_and_keys_share_buckets(a, b):
    if a <= b:
        assert tn.token_bucket(a) <= tn.token_bucket(b)
    same = tn.token_bucket(a) == tn.token_bucket(b)
    assert (mkkey(a) == mkkey(b)) == same
    assert (mkkey(a).id() == mkkey(b).id()) == same


def test_token_bucket_examples():
    assert [tn.token_bucket(t) for t in (0, 1, 2, 3, 4, 5, 4096, 4097, 3000)] == \
        [1, 1, 2, 4, 4, 8, 4096, 8192, 4096]
    with pytest.raises(ValueError):
        tn.token_bucket(-1)


def test_key_normalisation_and_round_trip():
    import torch

    k = tn.TuneKey("H800", 132, torch.bfloat16, 8, 8, 2, 4096, 28672, 3000, 0)
    assert (k.arch, k.dtype, k.tokens) == ("h800", "bf16", 4096)
    assert tn.TuneKey.from_dict(json.loads(json.dumps(k.to_dict()))) == k
    assert tn.normalize_dtype("float16") == tn.normalize_dtype(torch.half) == "fp16"
    assert mkkey(layer=0) != mkkey(layer=1)
    shape = k.shape()
    assert (shape.T, shape.dtype_bytes, shape.N) == (4096, 2, 28672)
    with pytest.raises(ValueError):
        tn.TuneKey("h800", 132, "int8", 8, 8, 2, 4096, 1, 1)
    with pytest.raises(ValueError):
        mkkey(layer=2)
    c = tn.Config(8, 64, 256)
    assert tn.Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert tn.Config.from_dict({"n_comm": 3}) == tn.Config(3, 128, 128)
    assert tn.Config(0).n_comm == 0  # staged: no comm blocks beside the GEMM
    with pytest.raises(ValueError):
        tn.Config(-1)


def test_key_has_ranks_per_node(tmp_path):
    one = tn.TuneKey("h800", 132, "bf16", 16, 64, 4, 2048, 2816, 4096, 0)
    assert one.ranks_per_node == 16 and one.shape().nodes == 1
    # one node keeps the id it had before nodes were modelled (existing caches stay valid)
    assert one.id() == "h800|sm132|bf16|L0|W16|E64|k4|H2048|N2816|T4096"
    assert tn.TuneKey.from_dict({k: v for k, v in one.to_dict().items()
                                 if k != "ranks_per_node"}) == one
    two = tn.TuneKey("h800", 132, "bf16", 16, 64, 4, 2048, 2816, 4096, 0, 8)
    assert two != one and two.id() != one.id() and "|P8|" in two.id()
    assert two.family() != one.family()  # nearest-bucket lookup never mixes node layouts
    assert tn.TuneKey.from_dict(json.loads(json.dumps(two.to_dict()))) == two
    assert two.shape().ranks_per_node == 8 and two.shape().nodes == 2
    shape = pm.MoEShape(W=16, E=64, k=4, H=2048, N=2816, T=4096, ranks_per_node=8)
    assert tn.make_key(shape, 0, "bf16", "h800", 132) == two
    with pytest.raises(ValueError):
        tn.TuneKey("h800", 132, "bf16", 16, 64, 4, 2048, 2816, 4096, 0, 3)
    # a measured entry for one layout is not used for the other; the model answers per layout
    tuner = tn.Tuner(tmp_path / "c")
    tuner.store(one, tn.Config(7))
    assert tuner.choose(one, explain=True) == (tn.Config(7), "cache")
    cfg, src = tuner.choose(two, explain=True)
    assert src == "model"
    assert cfg.n_comm == pm.choose_n_comm(two.shape(), pm.GPUS["h800"], 0)


def test_key_has_node_reduce(tmp_path):
    """layer1's node-reduced combine is its own key across nodes (the model picks another split),
    and no key at all on one node."""
    per_rank = tn.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 14336, 4096, 1, 4)
    red = tn.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 14336, 4096, 1, 4, node_reduce=True)
    assert red != per_rank and red.id() == per_rank.id().replace("|P4|", "|P4|R|")
    assert red.family() != per_rank.family()
    assert red.shape().node_reduce and not per_rank.shape().node_reduce
    assert tn.TuneKey.from_dict(json.loads(json.dumps(red.to_dict()))) == red
    assert tn.TuneKey.from_dict({k: v for k, v in per_rank.to_dict().items()
                                 if k != "node_reduce"}) == per_rank  # older caches
    one = tn.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 14336, 4096, 1, node_reduce=True)
    assert not one.node_reduce and one == tn.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 14336,
                                                     4096, 1)
    tuner = tn.Tuner(tmp_path / "c")
    tuner.store(per_rank, tn.Config(8))
    cfg, src = tuner.choose(red, explain=True)
    assert src == "model" and cfg.n_comm == pm.choose_n_comm(red.shape(), pm.GPUS["h800"], 1)


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------


def test_cache_round_trip(cache_env):
    t = tn.Tuner()
    assert t.cache.directory == cache_env
    key = mkkey(3000)
    assert t.lookup(key) is None
    t.store(key, tn.Config(20, 128, 256), seconds=1.5e-3)
    path = cache_env / "h800.json"
    assert path.is_file()
    data = json.loads(path.read_text())
    assert data["format"] == "comet-tune-cache" and data["version"] == 1
    (entry,) = data["entries"].values()
    assert entry["config"] == {"n_comm": 20, "tile_m": 128, "tile_n": 256, "band_n": 1}
    assert entry["key"]["tokens"] == 4096 and entry["seconds"] == 1.5e-3
    # a fresh tuner (a new process) reads it back, from any token count of the bucket
    assert tn.Tuner().lookup(mkkey(2049)) == tn.Config(20, 128, 256)
    assert tn.Tuner().choose(mkkey(4096), explain=True) == (tn.Config(20, 128, 256), "cache")
    # entries merge; no temporary files are left behind
    t.store(mkkey(64), tn.Config(4))
    t.store(mkkey(64, arch="a100", sm=108), tn.Config(5))
    assert len(json.loads(path.read_text())["entries"]) == 2
    assert sorted(p.name for p in cache_env.iterdir() if not p.name.endswith(".lock")) == \
        ["a100.json", "h800.json"]
    # explicit directory wins over the environment
    other = cache_env.parent / "other"
    assert tn.Tuner(other).lookup(key) is None


def test_nearest_bucket_lookup(cache_env):
    t = tn.Tuner()
    t.store(mkkey(1024), tn.Config(10))
    t.store(mkkey(16384), tn.Config(30))
    t.store(mkkey(4096, H=2048), tn.Config(99))  # another family: never a neighbour
    assert t.lookup(mkkey(2048)) == tn.Config(10)
    assert t.lookup(mkkey(512)) == tn.Config(10)
    assert t.lookup(mkkey(8192)) == tn.Config(30)
    assert t.lookup(mkkey(65536)) == tn.Config(30)  # two buckets away: still a neighbour
    assert t.lookup(mkkey(1 << 17)) is None  # three: too far, the cost model decides
    assert t.lookup(mkkey(128)) is None
    assert t.lookup(mkkey(4096)) == tn.Config(30)  # equidistant (log2): the larger bucket
    assert t.lookup(mkkey(2048), nearest=False) is None
    assert t.choose(mkkey(2048), explain=True) == (tn.Config(10), "cache-nearest")
    assert t.lookup(mkkey(4096, layer=1)) is None  # other layer, other dtype, other arch: miss
    assert t.lookup(mkkey(4096, dtype="fp16")) is None
    assert t.lookup(mkkey(4096, arch="h100")) is None
    t.store(mkkey(2048), tn.Config(12))
    assert tn.Tuner().lookup(mkkey(2048)) == tn.Config(12)  # exact beats nearest


@pytest.mark.parametrize("content", [
    "{not json", "", "[]", '{"format": "something-else"}',
    '{"format": "comet-tune-cache", "version": 99, "entries": {}}',
    '{"format": "comet-tune-cache", "version": 1, "entries": []}',
])
def test_corrupt_cache_is_ignored_with_a_warning(cache_env, content):
    cache_env.mkdir(parents=True)
    (cache_env / "h800.json").write_text(content)
    t = tn.Tuner()
    with pytest.warns(RuntimeWarning, match="corrupt"):
        cfg, src = t.choose(mkkey(), explain=True)
    assert src == "model"
    # storing replaces the corrupt file with a valid one
    t.store(mkkey(), tn.Config(7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tn.Tuner().lookup(mkkey()) == tn.Config(7)


def test_bad_entry_is_skipped(cache_env):
    t = tn.Tuner()
    t.store(mkkey(1024), tn.Config(10))
    path = cache_env / "h800.json"
    data = json.loads(path.read_text())
    data["entries"]["junk"] = {"key": {"arch": "h800"}, "config": {}}
    path.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match="bad entry"):
        assert tn.Tuner().lookup(mkkey(1024)) == tn.Config(10)


# ----------------------------------------------------------------------------------------------
# Choice without measurements
# ----------------------------------------------------------------------------------------------


def test_choose_falls_back_to_the_model_then_a_default(cache_env):
    t = tn.Tuner()
    key = mkkey()
    cfg, src = t.choose(key, explain=True)
    assert src == "model"
    assert cfg == tn.Config(pm.choose_n_comm(key.shape(), pm.GPUS["h800"], 0), 128, 128)
    # a bound on co-resident blocks is honoured
    cfg = t.choose(key, max_blocks=8)
    assert 0 <= cfg.n_comm <= 7
    # explicit shape (measured rows) and spec are used
    heavy = pm.MoEShape(**{**key.shape().__dict__, "remote_rows": 50000})
    assert t.choose(key, shape=heavy).n_comm == pm.choose_n_comm(heavy, pm.GPUS["h800"], 0)
    # a different SM count scales the spec
    assert 0 <= t.choose(mkkey(arch="h100", sm=114)).n_comm <= 113
    # CPU backend: the CPU pseudo-spec
    cfg, src = t.choose(mkkey(64, arch="cpu", sm=4), explain=True)
    assert src == "model" and 0 <= cfg.n_comm <= 3
    # unknown GPU: a generic default within bounds
    cfg, src = t.choose(mkkey(arch="mystery-gpu", sm=100), explain=True)
    assert src == "default" and cfg == tn.default_config(100)
    assert 1 <= tn.default_config(2).n_comm == 1
    # a cached entry that does not fit the co-residency bound is not used
    t.store(key, tn.Config(100))
    assert t.choose(key, explain=True) == (tn.Config(100), "cache")
    assert t.choose(key, max_blocks=16, explain=True)[1] == "model"


def test_candidate_configs():
    c = tn.candidate_configs(132, tiles=[(128, 128), (128, 256)], around=37)
    ns = sorted({x.n_comm for x in c})
    assert ns[0] == 0 and ns[-1] <= 131 and {35, 36, 37, 38, 39} <= set(ns)  # 0: staged
    assert len(c) == 2 * len(ns) and c == sorted(c, key=tn.Config.sort_key)
    assert {x.n_comm for x in tn.candidate_configs(132, max_blocks=10)} <= set(range(0, 10))


# ----------------------------------------------------------------------------------------------
# Measured tuning
# ----------------------------------------------------------------------------------------------


class FakeRun:
    """run_fn with a fixed time per n_comm; counts calls; optionally fails for some configs."""

    def __init__(self, times, fail=()):
        self.times, self.fail, self.calls = times, set(fail), []

    def __call__(self, cfg):
        self.calls.append(cfg.n_comm)
        if cfg.n_comm in self.fail:
            raise RuntimeError("launch failed")
        return self.times[cfg.n_comm]


def test_tune_picks_the_fastest_and_stores_it(cache_env, capsys):
    t = tn.Tuner()
    key = mkkey()
    run = FakeRun({4: 3e-3, 8: 1e-3, 16: 2e-3, 32: 5e-3})
    cands = [tn.Config(n) for n in (4, 8, 16, 32)]
    cfg = tn.tune(key, cands, run, warmup=2, iters=3, tuner=t)
    assert cfg == tn.Config(8)
    assert len(run.calls) == 4 * (2 + 3)
    assert tn.Tuner().choose(key, explain=True) == (tn.Config(8), "cache")
    assert t.choose(key, explain=True) == (tn.Config(8), "measured")
    ent = json.loads((cache_env / "h800.json").read_text())["entries"][key.id()]
    assert ent["seconds"] == pytest.approx(1e-3) and ent["source"] == "measured"
    err = capsys.readouterr().err
    assert "[comet tune]" in err and "4/4" in err and "chose n_comm=8" in err


def test_tune_ties_go_to_the_smallest_n_comm(cache_env, capsys):
    run = FakeRun({4: 2e-3, 8: 1e-3, 16: 1e-3, 2: 1e-3})
    for order in ([16, 8, 2, 4], [2, 4, 8, 16], [8, 16, 4, 2]):
        cfg = tn.Tuner().tune(mkkey(), [tn.Config(n) for n in order], run, progress=False)
        assert cfg == tn.Config(2)
    # same n_comm: the smaller tile
    cands = [tn.Config(4, 128, 256), tn.Config(4, 128, 128), tn.Config(4, 64, 128)]
    assert tn.Tuner().tune(mkkey(), cands, lambda c: 1.0, progress=False) == tn.Config(4, 64, 128)
    assert capsys.readouterr().err == ""


def test_tune_uses_the_median_and_survives_failures(cache_env):
    noisy = {4: iter([9.0, 1.0, 1.0, 1.0]), 8: iter([0.0, 1.5, 1.5, 0.1])}
    run = lambda c: next(noisy[c.n_comm])  # noqa: E731 - warmup 1, then median of 3
    assert tn.Tuner().tune(mkkey(), [tn.Config(4), tn.Config(8)], run, progress=False) == tn.Config(4)
    run = FakeRun({4: 1e-3, 8: 2e-3}, fail={4})
    with pytest.warns(RuntimeWarning, match="failed"):
        cfg = tn.Tuner().tune(mkkey(), [tn.Config(4), tn.Config(8)], run, progress=False)
    assert cfg == tn.Config(8)
    bad = FakeRun({4: float("nan"), 8: -1.0})
    with pytest.raises(RuntimeError, match="every one"):
        tn.Tuner().tune(mkkey(), [tn.Config(4), tn.Config(8)], bad, progress=False)
    with pytest.raises(ValueError):
        tn.Tuner().tune(mkkey(), [], bad)


def test_progress_line_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    bar = tn._Progress(2, "layer0", True, stream=out)
    bar.update(1, tn.Config(3), 1e-3)
    bar.update(2, tn.Config(4), math.inf)
    bar.close(tn.Config(3), 1e-3)
    text = out.getvalue()
    assert text.startswith("\r[comet tune] layer0 [") and "failed" in text
    assert text.endswith("chose n_comm=3 tile=128x128 (1.000 ms, max over ranks)\n")


def test_profile_through_hooks(cache_env):
    seen = {}

    def factory(key, shape, group):
        seen.update(key=key, shape=shape, group=group)
        return lambda cfg: abs(cfg.n_comm - 20) * 1e-4 + 1e-3

    key = mkkey(layer=1, N=14336)
    cfg = tn.profile(key, profilers={"layer1": factory}, progress=False, iters=1, warmup=0)
    assert cfg.n_comm == 20  # in the default grid
    assert seen["key"] == key and seen["shape"] == key.shape() and seen["group"] is None
    assert tn.Tuner().lookup(key) == cfg
    with pytest.raises(tn.ProfilerUnavailable, match="compiled ops"):
        tn.profile(mkkey(), profilers={"layer1": factory})


# Two gloo ranks: run_fn timings differ per rank, the max over ranks decides.
RANK_TIMES = {
    0: {2: 1.0, 4: 3.0, 8: 2.0, 16: 4.0},  # rank 0 alone would pick 2
    1: {2: 5.0, 4: 1.0, 8: 2.5, 16: 0.5},  # rank 1 alone would pick 16
}  # max over ranks: 2 -> 5.0, 4 -> 3.0, 8 -> 2.5, 16 -> 4.0: n_comm = 8
TIE_TIMES = {0: {2: 3.0, 4: 2.0, 8: 1.0}, 1: {2: 1.0, 4: 2.0, 8: 2.0}}  # max: 3, 2, 2 -> 4


def _rank_tune(rank, world, cache_root):
    os.environ["COMET_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")  # read at each use
    tuner_mod = tn
    t = tuner_mod.Tuner()
    key = tuner_mod.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 28672, 4096, 0)
    cands = [tuner_mod.Config(n) for n in (16, 8, 4, 2)]
    a = t.tune(key, cands, lambda c: RANK_TIMES[rank][c.n_comm], progress=False)
    key1 = tuner_mod.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 14336, 4096, 1)
    b = t.tune(key1, cands[1:], lambda c: TIE_TIMES[rank][c.n_comm], progress=False)
    fresh = tuner_mod.Tuner()  # what a later process on this rank reads from its cache
    return a.to_dict(), b.to_dict(), fresh.choose(key).to_dict(), t.choose(key1).to_dict()


def test_tune_agrees_across_two_gloo_ranks(tmp_path):
    res = run_ranks(_rank_tune, 2, str(tmp_path), timeout=120)
    a0, b0, c0, d0 = res[0]
    assert res[0] == res[1]
    assert a0 == {"n_comm": 8, "tile_m": 128, "tile_n": 128, "band_n": 1}
    assert b0["n_comm"] == 4
    assert c0 == a0 and d0 == b0


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

# Runs comet.tune as __main__ with a stand-in package when comet/__init__ cannot import (no build).


def _run_cli(args, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COMET_CACHE_DIR"] = str(tmp_path / "cli-cache")
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "comet.tune", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    return p


def test_cli_prints_the_model_table(tmp_path):
    p = _run_cli(["--model", "mixtral", "--world", "8"], tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "not measured" in out and "h800" in out and "Mixtral-8x7B" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("layer0", "layer1")}
    assert set(rows) == {"layer0", "layer1"}
    assert any(line.split()[:3] == ["layer", "GEMM", "MxNxK"] for line in out.splitlines())
    shape0 = pm.MoEShape(W=8, E=8, k=2, H=4096, N=28672, T=4096)
    shape1 = pm.MoEShape(W=8, E=8, k=2, H=4096, N=14336, T=4096)
    assert rows["layer0"][1] == "8192x28672x4096" and rows["layer1"][1] == "8192x4096x14336"
    assert int(rows["layer0"][2]) == pm.choose_n_comm(shape0, pm.GPUS["h800"], 0)
    assert int(rows["layer1"][2]) == pm.choose_n_comm(shape1, pm.GPUS["h800"], 1)
    assert int(rows["layer0"][2]) + int(rows["layer0"][3]) == 132


def test_cli_in_process_variants(capsys, cache_env):
    assert cli.main(["--model", "qwen2", "--world", "8", "--gpu", "all", "--tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert out.count("not measured") == len(pm.GPUS) and "T=1000" in out
    assert cli.main(["--model", "phi3.5", "--world", "4", "--gpu", "l20", "--dtype", "fp16",
                     "--max-blocks", "16", "--tile", "128x256"]) == 0
    out = capsys.readouterr().out
    assert "Phi-3.5-MoE" in out and "128x256" in out
    assert cli.main(["--model", "custom", "--hidden", "1024", "--ffn", "512", "--experts", "4",
                     "--topk", "1", "--world", "2", "--gpu", "cpu", "--sm-count", "8"]) == 0
    assert "cpu (8 SMs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--model", "mixtral", "--world", "3"])  # 3 does not divide 8 experts
    with pytest.raises(SystemExit):
        cli.main(["--model", "nope", "--world", "8"])
    with pytest.raises(SystemExit):
        cli.main(["--model", "custom", "--world", "8"])


def test_cli_across_nodes(tmp_path, capsys, cache_env):
    p = _run_cli(["--model", "qwen2", "--world", "16", "--ranks-per-node", "8", "--gpu", "h800"],
                 tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "not measured" in out and "2 nodes x 8 ranks" in out and "node-first" in out
    lines = [line.split() for line in out.splitlines() if line.split()]
    header = next(line for line in lines if line[:3] == ["layer", "GEMM", "MxNxK"])
    assert "NVLink" in header and "NIC" in header and "gemm" in header and "prologue" in header
    rows = {line[0]: line for line in lines if line[0] in ("layer0", "layer1")}
    assert set(rows) == {"layer0", "layer1"}
    for layer, N in ((0, 2816), (1, 1408)):
        shape = pm.MoEShape(W=16, E=64, k=4, H=2048, N=N, T=4096, ranks_per_node=8)
        n = pm.choose_n_comm(shape, pm.GPUS["h800"], layer)
        pr = pm.predict(shape, pm.GPUS["h800"], n, layer)
        r = rows[f"layer{layer}"]
        assert int(r[2]) == n
        # columns: NVLink rows, NIC rows, NVLink ms, NIC ms, comm ms, gemm ms, prologue ms
        assert float(r[5]) == pytest.approx(pr["intra_rows"], abs=0.5)
        assert float(r[6]) == pytest.approx(pr["inter_rows"], abs=0.5)
        assert float(r[7]) == pytest.approx(pr["intra"] * 1e3, abs=1e-3)
        assert float(r[8]) == pytest.approx(pr["inter"] * 1e3, abs=1e-3)
        assert float(r[8]) > 0
    # flat all-to-all: more rows over the NIC for layer0, the same for layer1
    assert cli.main(["--model", "qwen2", "--world", "16", "--ranks-per-node", "8", "--gpu",
                     "h800", "--flat"]) == 0
    out = capsys.readouterr().out
    assert "flat all-to-all" in out
    flat = {l.split()[0]: l.split() for l in out.splitlines() if l.split()[:1] in (["layer0"], ["layer1"])}
    assert float(flat["layer0"][6]) > float(rows["layer0"][6])
    assert float(flat["layer1"][6]) == float(rows["layer1"][6])
    with pytest.raises(SystemExit):
        cli.main(["--model", "qwen2", "--world", "16", "--ranks-per-node", "3"])
    # one node: no NIC traffic, same split as without the option
    assert cli.main(["--model", "mixtral", "--world", "8", "--ranks-per-node", "8",
                     "--gpu", "h800"]) == 0
    out = capsys.readouterr().out
    assert "nodes x" not in out
    r0 = next(l.split() for l in out.splitlines() if l.startswith("layer0"))
    assert r0[6] == "0" and r0[8] == "0.000"


def test_cli_profiling_path(capsys, cache_env, monkeypatch):
    # no hooks: says so, keeps the model table
    monkeypatch.setattr(tn, "PROFILERS", {})
    monkeypatch.setitem(sys.modules, "comet.layers.ops", types.ModuleType("comet.layers.ops"))
    assert cli.main(["--model", "mixtral", "--world", "1", "--gpu", "cpu", "--profile"]) == 1
    assert "profiling needs the compiled ops" in capsys.readouterr().out
    # fake hooks (what comet.layers.ops registers): measured winners are stored under the local arch
    calls = []

    def factory(key, shape, group):
        return lambda cfg: calls.append(key.layer) or abs(cfg.n_comm - 3 - key.layer) + 1.0

    monkeypatch.setattr(tn, "PROFILERS", {"layer0": factory, "layer1": factory})
    assert cli.main(["--model", "mixtral", "--world", "1", "--gpu", "cpu", "--profile",
                     "--sm-count", "8", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "layer0: measured best n_comm=3" in out and "layer1: measured best n_comm=4" in out
    assert set(calls) == {0, 1}
    entries = json.loads((cache_env / "cpu.json").read_text())["entries"]
    assert sorted(e["config"]["n_comm"] for e in entries.values()) == [3, 4]


def test_cli_under_torchrun_prints_on_rank_0_only(tmp_path):
    """torchrun starts W copies; the model table comes once (rank 0), not W times."""
    args = ["--model", "mixtral", "--world", "2", "--gpu", "h800"]
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_RANK="1", RANK="1")
    other = subprocess.run([sys.executable, "-m", "comet.tune", *args], capture_output=True,
                           text=True, cwd=ROOT, timeout=120,
                           env=dict(env, COMET_CACHE_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES=""))
    assert other.returncode == 0, other.stderr
    assert other.stdout == "" and other.stderr == ""
    first = subprocess.run([sys.executable, "-m", "comet.tune", *args], capture_output=True,
                           text=True, cwd=ROOT, timeout=120,
                           env=dict(env, RANK="0", LOCAL_RANK="0", COMET_CACHE_DIR=str(tmp_path),
                                    CUDA_VISIBLE_DEVICES=""))
    assert first.returncode == 0 and first.stdout.count("Cost model, not measured") == 1


@pytest.mark.parametrize("argv,message", [
    (["--model", "mixtral", "--world", "3"], "--world 3 must divide the expert count E=8"),
    (["--model", "mixtral", "--world", "0"], "--world must be >= 1"),
    (["--model", "nope", "--world", "8"], "unknown --model 'nope'"),
    (["--model", "custom", "--world", "8"], "--model custom needs"),
    (["--model", "mixtral", "--world", "8", "--gpu", "x100"], "unknown --gpu 'x100'"),
    (["--model", "mixtral", "--world", "8", "--iters", "0"], "--iters >= 1"),
    (["--model", "mixtral", "--world", "8", "--dtype", "int3"], "int3"),
    (["--model", "mixtral", "--world", "8", "--tp", "3"], "--tp 3 must be >= 1 and divide --world 8"),
    (["--model", "mixtral", "--world", "16", "--tp", "1"], "--world 16 must divide the expert count"),
    (["--model", "qwen2", "--world", "8", "--tp", "8", "--ranks-per-node", "4"],
     "--tp 8 must divide --ranks-per-node 4"),
    (["--model", "custom", "--hidden", "64", "--ffn", "6", "--experts", "4", "--topk", "1",
      "--world", "4", "--tp", "4", "--not-gated"], "--tp 4 must divide N0, N1"),
    (["--world", "8"], "--model and --world are required"),
])
def test_cli_user_mistakes_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    out = capsys.readouterr()
    assert message in out.err and out.out == ""


def test_cli_profile_reports_candidates_estimate_and_time_left(capsys, cache_env):
    """--profile on the CPU backend at a tiny shape (seconds): before measuring, the number of
    candidates and calls with a rough total; after the first call, the time left; then a line per
    candidate with the time left; on stderr, the tables and results on stdout."""
    assert cli.main(["--model", "custom", "--hidden", "32", "--ffn", "24", "--experts", "4",
                     "--topk", "2", "--tokens", "32", "--dtype", "fp32", "--gpu", "cpu",
                     "--world", "1", "--sm-count", "4", "--profile", "--warmup", "1",
                     "--iters", "1"]) == 0
    out = capsys.readouterr()
    assert "layer0: measured best" in out.out and "layer1: measured best" in out.out
    err = out.err.splitlines()
    for layer in (0, 1):
        mine = [line for line in err if line.startswith(f"[comet tune] layer{layer} ")]
        head = mine[0]
        n = int(head.split(": ")[1].split(" candidates")[0])
        assert " calls (1 warm-up + 1 timed); roughly " in head and "in all" in head, head
        assert "first call" in mine[1] and "left" in mine[1], mine[1]
        steps = [line for line in mine if f"/{n} n_comm=" in line]
        assert len(steps) == n and all("left)" in line for line in steps)
        assert steps[-1].endswith("~0 s left)")


def test_call_estimate_is_rough_but_scales_with_the_work():
    key = tn.TuneKey("cpu", 2, "fp32", 1, 8, 2, 4096, 28672, 4096, 0)
    full = cli.call_estimate(key, key.shape())
    # full Mixtral on 2 CPU threads: 2 * 8192 * 28672 * 4096 FLOP at ~10 GFLOP/s: minutes a call
    assert 60 < full < 600
    small = tn.TuneKey("cpu", 2, "fp32", 1, 8, 2, 128, 896, 512, 0)
    assert cli.call_estimate(small, small.shape()) < full / 1000
    gpu = tn.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 28672, 4096, 0)
    assert 0 < cli.call_estimate(gpu, gpu.shape()) < 0.1  # the cost model's fused time


# ----------------------------------------------------------------------------------------------
# layer1's band width in the config
# ----------------------------------------------------------------------------------------------


def test_config_band_round_trips_and_old_entries_read_as_column_order(tmp_path):
    c = tn.Config(5, 128, 128, 6)
    assert tn.Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert tn.Config.from_dict({"n_comm": 3, "tile_m": 64, "tile_n": 64}).band_n == 1
    assert tn.Config(3, band_n=0).band_n == 0  # 0 = all n-tiles
    with pytest.raises(ValueError, match="band_n must be >= 0"):
        tn.Config(3, band_n=-1)
    # a cache file written before bands existed: the cache reads its entries as b = 1 (the tuner
    # then runs the model's band: the next test)
    key = _cache_from_before_bands(tmp_path, tn.Config(9))
    cfg, _ = tn.TuneCache(tmp_path).get(key)
    assert cfg == tn.Config(9, 128, 128, 1)
    assert not tn.TuneCache(tmp_path).has_band(key)


def _cache_from_before_bands(directory, config):
    """A tuning cache in `directory` holding `config` for a Mixtral layer1 key on H800, written
    as before bands existed (no band_n in the entry); returns the key."""
    key = tn.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 14336, 4096, 1)
    cache = tn.TuneCache(directory)
    cache.put(key, config, seconds=1e-3)
    data = json.loads(cache.path("h800").read_text())
    for entry in data["entries"].values():
        del entry["config"]["band_n"]
    cache.path("h800").write_text(json.dumps(data))
    return key


def test_old_cache_entries_and_explicit_splits_run_the_models_band(tmp_path, monkeypatch):
    """A config without a measured band runs the cost model's band for its split, not column
    order: a cache entry from before bands, and n_comm / tile given explicitly to the ops."""
    spec = pm.GPUS["h800"]
    key = _cache_from_before_bands(tmp_path, tn.Config(9))
    want = pm.choose_band(key.shape(), spec, 9)
    assert want > 1  # Mixtral's h does not fit the L2: the model bands it
    cfg, src = tn.Tuner(tmp_path).choose(key, explain=True)
    assert src == "cache" and cfg == tn.Config(9, 128, 128, want)
    t = tn.Tuner(tmp_path)
    t.store(key, tn.Config(9, 128, 128, 3))  # a recorded band is kept
    assert t.choose(key).band_n == 3
    # explicit n_comm and tile (the ops' launch_choice, CUDA keys: every call passes the tile)
    from comet.layers import ops

    monkeypatch.setenv(tn.CACHE_ENV, str(tmp_path / "empty"))
    tn.default_tuner().clear()
    monkeypatch.setitem(ops._cuda_arch, 0, ("h800", 132))
    got = ops.launch_choice("cuda", 0, 1, 8, 8, 2, 4096, 14336, 4096, "bf16", 9, (128, 128))
    assert got[4] == "explicit" and got[5] == pm.choose_band(key.shape(), spec, 9, (128, 128))
    # CUDA without a tile: the tuner picks one of the compiled tiles (comet.tune.model.small_tile:
    # 128 rows here, 8192 rows per expert), and the model's band for it
    got = ops.launch_choice("cuda", 0, 1, 8, 8, 2, 4096, 14336, 4096, "bf16", 9, None)
    assert got[4] == "explicit n_comm" and got[2:4] == (128, 128) and got[5] > 1
    # decode: 32 rows per expert (8 ranks x 128 tokens x top-8 over 256 experts): 64-row tiles
    got = ops.launch_choice("cuda", 0, 0, 8, 256, 8, 7168, 4096, 128, "bf16", None, None)
    assert got[4] == "model" and got[2:4] == (64, 128)
    tn.default_tuner().clear()


def test_model_choice_carries_the_models_band(tmp_path):
    spec = pm.GPUS["h800"]
    key = tn.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 14336, 4096, 1)
    cfg, src = tn.Tuner(tmp_path).choose(key, explain=True)
    shape = key.shape()
    assert src == "model" and cfg.n_comm == pm.choose_n_comm(shape, spec, 1)
    assert cfg.band_n == pm.choose_band(shape, spec, cfg.n_comm) > 1
    key0 = tn.TuneKey("h800", 132, "bf16", 8, 8, 2, 4096, 28672, 4096, 0)
    assert tn.Tuner(tmp_path).choose(key0).band_n == 1  # layer0 has no bands
    # measured candidates of layer1: column order and the model's band
    c = tn.candidate_configs(132, around=10, bands=(1, 6))
    assert {x.band_n for x in c if x.n_comm > 0} == {1, 6}
    assert [x.band_n for x in c if x.n_comm == 0] == [0]  # staged: one band, measured once
    assert c == sorted(c, key=tn.Config.sort_key)


def test_cli_prints_a_sweeps_and_the_band(tmp_path):
    p = _run_cli(["--model", "mixtral", "--world", "8"], tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    header = next(line for line in lines if line.split()[:3] == ["layer", "GEMM", "MxNxK"])
    assert header.rstrip().endswith("band  A sweeps")
    rows = {line.split()[0]: line.split() for line in lines
            if line.split() and line.split()[0] in ("layer0", "layer1")}
    shape1 = pm.MoEShape(W=8, E=8, k=2, H=4096, N=14336, T=4096)
    n = pm.choose_n_comm(shape1, pm.GPUS["h800"], 1)
    assert rows["layer1"][-2] == str(pm.choose_band(shape1, pm.GPUS["h800"], n))
    assert int(rows["layer1"][-1]) <= 8  # h read at most 8 times (32 in column order)
    assert rows["layer0"][-2:] == ["-", "1"]


# ----------------------------------------------------------------------------------------------
# Expert tensor parallelism and FP8 in the key and the CLI
# ----------------------------------------------------------------------------------------------


def test_key_has_tp_size(tmp_path):
    """tp_size is its own key (ids without TP unchanged); the model answers with the TP shape."""
    ep = tn.TuneKey("h100", 132, "bf16", 8, 32, 4, 8192, 2048, 1024, 0)
    tp = tn.TuneKey("h100", 132, "bf16", 8, 32, 4, 8192, 2048, 1024, 0, tp_size=4)
    assert ep.tp_size == 1 and "|TP" not in ep.id()
    assert tp.id() == ep.id().replace("|W8|", "|W8|TP4|") and tp.family() != ep.family()
    assert tn.TuneKey.from_dict(json.loads(json.dumps(tp.to_dict()))) == tp
    assert tn.TuneKey.from_dict({k: v for k, v in ep.to_dict().items() if k != "tp_size"}) == ep
    assert tp.shape().tp_size == 4 and tp.shape().ep_size == 2
    shape = pm.MoEShape(W=8, E=32, k=4, H=8192, N=2048, T=1024, tp_size=4)
    assert tn.make_key(shape, 0, "bf16", "h100", 132) == tp
    with pytest.raises(ValueError, match="tp_size=3"):
        tn.TuneKey("h100", 132, "bf16", 8, 32, 4, 8192, 2048, 1024, 0, tp_size=3)
    with pytest.raises(ValueError, match="tp_size=2"):
        tn.TuneKey("h100", 132, "bf16", 8, 6, 2, 8192, 2048, 1024, 0, tp_size=2)  # EP 4 vs E 6
    tuner = tn.Tuner(tmp_path / "c")
    tuner.store(ep, tn.Config(9))
    cfg, src = tuner.choose(tp, explain=True)
    assert src == "model" and cfg.n_comm == pm.choose_n_comm(shape, pm.GPUS["h100"], 0)


def test_key_accepts_fp8():
    for name in ("fp8", "float8_e4m3fn", "torch.float8_e5m2", "e4m3"):
        key = tn.TuneKey("h800", 132, name, 8, 8, 2, 4096, 28672, 4096, 0)
        assert key.dtype == "fp8" and key.shape().dtype_bytes == 1 and "|fp8|" in key.id()
    assert tn.normalize_dtype("bfloat16") == "bf16"
    with pytest.raises(ValueError, match="fp8"):
        tn.normalize_dtype("int4")
    tuner = tn.Tuner()
    key = tn.TuneKey("h800", 132, "fp8", 8, 8, 2, 4096, 28672, 4096, 0)
    assert tuner.choose(key, explain=True)[1] in ("model", "cache", "cache-nearest")


def test_cli_tp_and_fp8(capsys, cache_env):
    assert cli.main(["--model", "custom", "--hidden", "8192", "--ffn", "8192", "--experts", "32",
                     "--topk", "4", "--not-gated", "--world", "8", "--tp", "4", "--tokens",
                     "1024", "--gpu", "h100", "--no-profile"]) == 0
    out = capsys.readouterr().out
    assert "EP 2 x TP 4" in out and "N0/4=2048" in out
    assert "16384x2048x8192" in out  # t T k rows per rank, the N shard
    lines = [line for line in out.splitlines() if "TP path (model's choice)" in line]
    assert len(lines) == 2
    shape = pm.MoEShape(W=8, E=32, k=4, H=8192, N=2048, T=1024, tp_size=4)
    for layer, line in enumerate(lines):
        assert f"layer{layer} TP path (model's choice): " \
               f"{pm.choose_tp_path(shape, pm.GPUS['h100'], layer)} " in line
        assert "direct: NVLink" in line and "group: NVLink" in line
    assert cli.main(["--model", "mixtral", "--world", "8", "--dtype", "float8_e4m3fn",
                     "--gpu", "h800", "--no-profile"]) == 0
    out = capsys.readouterr().out
    assert "1979 TFLOP/s fp8" in out and "layer0 rows 4224 B" in out
    assert cli.main(["--model", "mixtral", "--world", "8", "--dtype", "fp8", "--gpu", "a100",
                     "--no-profile"]) == 0
    assert "no FP8 tensor cores" in capsys.readouterr().out


def test_cli_prints_the_docs_tables(capsys):
    for name, make in cli.TABLES.items():
        assert cli.main(["--table", name]) == 0
        assert capsys.readouterr().out.strip() == make()
