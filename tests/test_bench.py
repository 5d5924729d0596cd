"""The benchmarks in smoke mode (subprocesses, CPU backend, 2 gloo ranks) and the wiring they rely
on: the ops take their launch config from the autotuner (cache, else cost model), explicit
arguments override it, the cache written by measured tuning round-trips into the ops' default,
and the profiling hooks are registered and measure the real ops."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

import comet
from comet.layers import ops
from comet import reference as ref
from comet.tune import tuner as tn

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """A private tuning cache and a fixed CPU block budget; the process's tuner forgets its memo
    before and after (so other tests see their own cache)."""
    monkeypatch.setenv(tn.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("COMET_CPU_BLOCKS", "6")
    tn.default_tuner().clear()
    yield tmp_path / "cache"
    ops.set_tuning_tokens(None)
    tn.default_tuner().clear()


def _inputs(T=40, H=16, N0=12, N1=6, E=4, k=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    wts, ids = ref.route(torch.randn(T, E, generator=g), k)
    w0 = torch.randn(E, N0, H, generator=g).to(dtype)
    w1 = torch.randn(E, H, N1, generator=g).to(dtype)
    return x, w0, w1, ids, wts, E


def _cfg(x, w0, ids, E, layer=0, n_comm=None, tile=None, world=1):
    w = w0
    return ops.launch_config(x.device, n_comm, tile, layer=layer, world=world, num_experts=E, x=x,
                             w=w, topk_ids=ids)


# ------------------------------------------------------------------------------------------------
# Launch configuration from the tuner
# ------------------------------------------------------------------------------------------------


def test_default_is_the_cost_model_without_a_cache(tuning):
    x, w0, _w1, ids, _wts, E = _inputs()
    # A world of one: no row crosses a link, so the model runs the layer staged (no comm blocks
    # beside the GEMM, every block for the GEMM).
    assert _cfg(x, w0, ids, E) == (0, 6, *ops.CPU_TILE)
    n_comm, n_gemm, tm, tn_ = _cfg(x, w0, ids, E, world=2)
    key = tn.TuneKey("cpu", 6, "fp32", 2, E, 2, 16, 12, 40, 0)
    _expect, source = tn.Tuner(tuning).choose(key, tile=ops.CPU_TILE, explain=True)
    assert source == "model"
    # The expected split from the cost model's predictions themselves (not tuner.choose, the
    # code under test): the n_comm with the least predicted fused time over all 6 blocks, 0 (the
    # staged layer) included.
    from comet.tune import perfmodel as pm

    spec = pm.get_spec("cpu", 6)
    fused = {n: pm.predict(key.shape(), spec, n, 0, ops.CPU_TILE, n_blocks=6)["fused"]
             for n in range(0, 6)}
    assert fused[n_comm] == min(fused.values()), (n_comm, fused)
    assert (n_gemm, tm, tn_) == (6 - n_comm, *ops.CPU_TILE)


def test_cache_entry_is_used_and_explicit_arguments_override(tuning):
    x, w0, w1, ids, wts, E = _inputs()
    for layer, N in ((0, 12), (1, 6)):
        key = tn.TuneKey("cpu", 6, "fp32", 1, E, 2, 16, N, 40, layer)
        tn.TuneCache(tuning).put(key, tn.Config(4 - layer, 16, 8), seconds=1e-3)
    tn.default_tuner().clear()
    assert _cfg(x, w0, ids, E) == (4, 2, 16, 8)
    assert ops.launch_config(x.device, None, None, layer=1, world=1, num_experts=E, x=x[:, :6],
                             w=w1, topk_ids=ids) == (3, 3, 16, 8)
    assert ops.launch_choice("cpu", None, 0, 1, E, 2, 16, 12, 64, "float32")[4] == "cache"
    assert _cfg(x, w0, ids, E, n_comm=2) == (2, 4, 16, 8)  # tile still tuned
    assert _cfg(x, w0, ids, E, tile=(5, 7)) == (4, 2, 5, 7)  # n_comm still tuned
    assert _cfg(x, w0, ids, E, n_comm=1, tile=(4, 4)) == (1, 5, 4, 4)
    # nearest measured bucket of an otherwise identical key: T=100 (bucket 128) -> the T=40 entry
    xs, idss = x.repeat(3, 1)[:100], ids.repeat(3, 1)[:100]
    assert ops.launch_choice("cpu", None, 0, 1, E, 2, 16, 12, 128, "float32")[4] == "cache-nearest"
    assert _cfg(xs, w0, idss, E) == (4, 2, 16, 8)
    # and the ops run with that config and still match the reference
    buf = comet.Buffer.simulated_world(1)[0]
    y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf)
    out = comet.moe_layer1(ref.swiglu(y0)[:, :6].contiguous(), w1, wts, layout, buffer=buf)
    y0_ref = ref.layer0_sim([x], [w0], [ids], E)[0]
    out_ref = ref.layer1_sim([ref.swiglu(y0_ref)[:, :6]], [w1], [wts], [ids], E)[0]
    torch.testing.assert_close(y0, y0_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=1e-4)


def test_new_measurements_replace_the_memoised_choice(tuning):
    x, w0, _w1, ids, _wts, E = _inputs()
    before = _cfg(x, w0, ids, E)
    key = tn.TuneKey("cpu", 6, "fp32", 1, E, 2, 16, 12, 40, 0)
    tn.default_tuner().store(key, tn.Config(5, 8, 8))  # what tune() does on every rank
    assert _cfg(x, w0, ids, E) == (5, 1, 8, 8) != before
    tn.default_tuner().tune(key, [tn.Config(2, 4, 4), tn.Config(3, 4, 4)],
                            lambda c: float(c.n_comm), progress=False, iters=1, warmup=0)
    assert _cfg(x, w0, ids, E) == (2, 4, 4, 4)


def test_token_bucket_and_rank_independent_tokens(tuning):
    x, w0, _w1, ids, _wts, E = _inputs(T=300)
    for T, n in ((3, 1), (300, 2)):  # buckets 4 and 512
        key = tn.TuneKey("cpu", 6, "fp32", 1, E, 2, 16, 12, T, 0)
        tn.TuneCache(tuning).put(key, tn.Config(n, 32, 64))
    tn.default_tuner().clear()
    assert _cfg(x[:3], w0, ids[:3], E)[0] == 1
    assert _cfg(x, w0, ids, E)[0] == 2
    ops.set_tuning_tokens(512)  # every rank passes the same value: T leaves the key
    assert _cfg(x[:3], w0, ids[:3], E)[0] == _cfg(x, w0, ids, E)[0] == 2
    ops.set_tuning_tokens(None)
    assert _cfg(x[:3], w0, ids[:3], E)[0] == 1


def test_bad_inputs_get_a_fallback_not_an_exception(tuning):
    x, w0, _w1, ids, _wts, E = _inputs()
    assert _cfg(x.double(), w0.double(), ids, E)[:2] == (1, 5)  # float64: no tuner key
    assert _cfg(x, w0, ids, E + 1, world=2)[:2] == (1, 5)  # W does not divide E
    assert _cfg(x[0], w0, ids, E)[:2] == (1, 5)  # 1-D x: the op reports it, not launch_config
    assert ops.launch_choice("cpu", None, 0, 2, 9, 2, 16, 12, 64, "float32")[4] == "fallback"


def test_cpu_block_budget_defaults_to_cores_per_rank(tuning, monkeypatch):
    monkeypatch.delenv("COMET_CPU_BLOCKS")
    tn.default_tuner().clear()
    n_comm, n_gemm, *_ = ops.launch_choice("cpu", None, 0, 2, 8, 2, 16, 12, 64, "float32")
    assert n_comm + n_gemm == max(2, (os.cpu_count() or 2) // 2)


def test_launch_config_is_cheap(tuning):
    x, w0, _w1, ids, _wts, E = _inputs()
    _cfg(x, w0, ids, E)
    t0 = time.perf_counter()
    for _ in range(2000):
        _cfg(x, w0, ids, E)
    assert (time.perf_counter() - t0) / 2000 < 100e-6  # ~4 us here; generous for slow CI


def test_profiling_hooks_measure_the_real_ops_and_round_trip(tuning):
    from comet.tune import profiling

    assert tn.PROFILERS["layer0"] is profiling.layer0_profiler
    assert tn.PROFILERS["layer1"] is profiling.layer1_profiler
    tuner = tn.Tuner(tuning)
    for layer, N in ((0, 24), (1, 12)):
        key = tn.TuneKey("cpu", 6, "fp32", 1, 4, 2, 16, N, 64, layer)
        cfg = tn.profile(key, candidates=[tn.Config(n, 16, 16) for n in (1, 2, 3)], tuner=tuner,
                         warmup=0, iters=1, progress=False)
        assert cfg.n_comm in (1, 2, 3) and cfg.tile == (16, 16)
        tn.default_tuner().clear()
        got = ops.launch_choice("cpu", None, layer, 1, 4, 2, 16, N, 64, "float32")
        assert got == (cfg.n_comm, 6 - cfg.n_comm, 16, 16, "cache", cfg.band_n)
    entries = json.loads((tuning / "cpu.json").read_text())["entries"]
    assert len(entries) == 2 and all(e["source"] == "measured" for e in entries.values())


# ------------------------------------------------------------------------------------------------
# The benchmarks, smoke-sized, as CI runs them
# ------------------------------------------------------------------------------------------------


def _run(script, tmp_path, *extra, timeout=150):
    env = dict(os.environ, **{tn.CACHE_ENV: str(tmp_path / "user-cache")})
    env.pop("COMET_CPU_BLOCKS", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", "--out",
                           str(tmp_path), *extra], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc, elapsed


def _png_ok(path: pathlib.Path, stdout: str):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in stdout
        return
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moe_layer_smoke(tmp_path):
    proc, elapsed = _run("moe_layer.py", tmp_path)
    data = json.loads((tmp_path / "moe_layer_smoke.json").read_text())
    assert data["smoke"] and "not GPU results" in data["label"]
    assert data["environment"]["backend"] == "cpu"
    recs = data["results"]
    assert [r["model"] for r in recs] == ["mixtral", "qwen2", "phi3.5"]
    for r in recs:
        assert r["world"] == 2 and r["backend"] == "cpu"
        m = r["median_ms"]
        for k in ("comm_only", "gemm_only", "sequential", "comet", "comet_local", "tutel_c1",
                  "tutel_c2", "tutel_c4", "tutel_c8"):
            assert m[k] > 0, k
        assert r["limit_ms"] == pytest.approx(max(m["comm_only"], m["gemm_only"]))
        assert r["tutel_best_ms"] == pytest.approx(min(m[f"tutel_c{c}"] for c in (1, 2, 4, 8)))
        assert set(r["ratio_to_limit"]) == {"sequential", "tutel", "comet"}
        assert r["ratio_to_limit"]["comet"] == pytest.approx(m["comet"] / r["limit_ms"])
        errs = r["max_abs_err_vs_sequential"]
        assert set(errs) >= {"comet", "reference", "tutel_c1", "tutel_c8"}
        assert max(errs.values()) < 1e-3
        for layer in ("layer0", "layer1"):
            launch = r["comet_launch"][layer]
            assert launch["n_comm"] >= 0 and launch["source"] == "model"  # 0: staged
    assert "Comet" in proc.stdout and "Mixtral-8x7B" in proc.stdout and "NOT GPU" in proc.stdout
    _png_ok(tmp_path / "moe_layer_smoke.png", proc.stdout)
    assert not (tmp_path / "moe_layer.json").exists()  # a full run's results are kept
    print(f"moe_layer.py --smoke: {elapsed:.1f} s")


def test_moe_layer_tp_smoke(tmp_path):
    """--tp 2: Comet's layer with expert tensor parallelism beside the expert-parallel one,
    each checked against the reference before timing (bench/tp_compare.py)."""
    proc, elapsed = _run("moe_layer.py", tmp_path, "--tp", "2", "--models", "mixtral")
    data = json.loads((tmp_path / "moe_layer_tp_smoke.json").read_text())
    assert data["smoke"] and "not GPU results" in data["label"]
    (r,) = data["results"]
    assert (r["model"], r["world"], r["tp"]) == ("mixtral", 2, 2)
    assert r["median_ms"]["tp2"] > 0 and r["median_ms"]["tp1"] > 0
    assert "EP x TP" in proc.stdout and "NOT GPU" in proc.stdout
    print(f"moe_layer.py --smoke --tp 2: {elapsed:.1f} s")


def test_moe_layer_smoke_fp8(tmp_path):
    """--dtype fp8: Comet in FP8 checked against the bf16 baselines (inside the script), and
    layer0's token-row bytes per call are (H + 4 H/128) / (2 H) of bf16's (H = 512)."""
    proc, elapsed = _run("moe_layer.py", tmp_path, "--dtype", "fp8", "--hidden", "512",
                         "--models", "mixtral")
    (r,) = json.loads((tmp_path / "moe_layer_smoke.json").read_text())["results"]
    assert r["dtype"] == "fp8" and r["median_ms"]["comet"] > 0
    b = r["layer0_bytes"]
    assert b["fp8"] > 0 and b["ratio"] == b["ratio_formula"] == (512 + 4 * 512 / 128) / 1024
    # the table shows it too
    head, _sep, row = [line for line in proc.stdout.splitlines() if line.startswith("|")][:3]
    assert head.split("|")[-2].strip() == "L0 bytes fp8/bf16"
    assert row.split("|")[-2].strip() == f"{b['ratio']:.3f}" == "0.516"
    print(f"moe_layer.py --smoke --dtype fp8: {elapsed:.1f} s")


def test_sweep_ncomm_smoke(tmp_path):
    cache = tmp_path / "tune-cache"
    proc, elapsed = _run("sweep_ncomm.py", tmp_path, "--cache-dir", str(cache))
    data = json.loads((tmp_path / "sweep_ncomm_smoke.json").read_text())
    r = data["result"]
    assert data["smoke"] and "not GPU results" in data["label"]
    assert r["blocks"] == 4 and r["n_values"] == [0, 1, 2, 3]  # 0: the staged layer
    for part in ("layer0", "layer1", "forward"):
        assert set(r["median_s"][part]) == {"0", "1", "2", "3"}
        assert all(v > 0 for v in r["median_s"][part].values())
        assert r["measured_best"][part] in (0, 1, 2, 3)
    # the tuner's measured winners went into the cache and came back as the ops' default
    for layer in ("layer0", "layer1"):
        assert r["tuner_choice"][layer] in (0, 1, 2, 3)
        assert r["ops_default"][layer]["n_comm"] == r["tuner_choice"][layer]
        assert r["ops_default"][layer]["n_gemm"] == 4 - r["tuner_choice"][layer]
        assert r["ops_default"][layer]["source"] == "cache"
        assert r["perfmodel"]["choice"][layer] in (0, 1, 2, 3)
    entries = json.loads((cache / "cpu.json").read_text())["entries"]
    assert sorted(e["config"]["n_comm"] for e in entries.values()) == \
        sorted(r["tuner_choice"].values())
    assert "tuner" in proc.stdout and "NOT GPU" in proc.stdout
    _png_ok(tmp_path / "sweep_ncomm_smoke.png", proc.stdout)
    assert not (tmp_path / "sweep_ncomm.json").exists()
    print(f"sweep_ncomm.py --smoke: {elapsed:.1f} s")


def test_decode_bench_smoke(tmp_path):
    """bench/decode.py --smoke: 4 ranks, every token count of the smoke run timed for both forms
    after they agreed (fp32, 1e-4), each record's max_rows the bound W * T * min(k, E / W), and
    the rows of the table those of the JSON."""
    from bench import decode

    proc, elapsed = _run("decode.py", tmp_path, timeout=300)
    data = json.loads((tmp_path / "decode_smoke.json").read_text())
    assert data["smoke"] and "not GPU results" in data["label"] and data["world"] == 4
    recs = data["results"]
    assert [r["tokens"] for r in recs] == list(decode.SMOKE_TOKENS)
    for r in recs:
        assert r["max_rows"] == 4 * r["tokens"] * min(8, 32 // 4)
        assert r["slots_all_ranks"] == 4 * r["tokens"] * 8
        assert r["max_abs_err"] <= 1e-4 * 10
        assert set(r["median_us"]) == {"comet", "torch"} and all(v > 0 for v in r["median_us"].values())
        assert f"| {r['max_rows']:>8} |" in proc.stdout
        # the tile each layer ran with: the CPU backend's default (the tuner picks among the
        # CUDA tiles only on CUDA)
        assert {k: v["tile"] for k, v in r["launch"].items()} == {"layer0": [32, 64],
                                                                 "layer1": [32, 64]}
    print(f"decode.py --smoke: {elapsed:.1f} s")


def test_prologue_bench_smoke(tmp_path, capsys):
    """bench.prologue --smoke: every program's span within 2x of T*k/P + E*W, and the span shrinks
    as the grid grows (the work is really split)."""
    from bench import prologue

    assert prologue.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "span within 2x of T*k/P + E*W: 8/8 rows" in out
    rows = json.loads((tmp_path / "prologue_smoke.json").read_text())["rows"]
    assert len(rows) == 8 and all(r["within_2x"] for r in rows)
    by_config = {}
    for r in rows:
        by_config.setdefault((r["T"], r["k"], r["E"]), {})[r["P"]] = r
    for cfg, per_p in by_config.items():
        for name in ("send_plan", "pair_list", "reduce_plan"):
            assert per_p[16]["programs"][name]["span"] * 4 < per_p[1]["programs"][name]["span"], \
                (cfg, name)


def test_comm_copy_bench_smoke(tmp_path, capsys):
    """bench.comm_copy --smoke: every unroll copies every row (the C++ side checks the bytes) at
    a positive rate, and the table and JSON come out."""
    from bench import comm_copy

    assert comm_copy.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert "GB/s 4 in flight" in capsys.readouterr().out
    rows = json.loads((tmp_path / "comm_copy_smoke.json").read_text())["rows"]
    assert len(rows) == 4
    assert all(v > 0 for r in rows for v in r["gbs"].values())


def test_multinode_bench_smoke(tmp_path, capsys):
    """bench.multinode --smoke: one node moves nothing over the link, two nodes move data through
    it (node-reduced: layer0's bytes unchanged, layer1's no more), and the table and JSON come
    out."""
    from bench import multinode

    assert multinode.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert "1 node vs 2 nodes" in capsys.readouterr().out
    rows = json.loads((tmp_path / "multinode_smoke.json").read_text())["rows"]
    assert [(r["nodes"], r["node_reduce"]) for r in rows] == [(1, False), (2, False), (2, True)]
    one, two, red = rows
    assert one["link_bytes_layer0"] == 0 and one["link_bytes_layer1"] == 0
    assert two["link_bytes_layer0"] > 0 and two["link_bytes_layer1"] > 0
    assert red["link_bytes_layer0"] == two["link_bytes_layer0"]
    assert 0 < red["link_bytes_layer1"] <= two["link_bytes_layer1"]
    assert all(r["layer0_s"] > 0 and r["layer1_s"] > 0 for r in rows)


def test_kernels_bench_smoke(tmp_path):
    """bench/kernels.py --smoke (CPU backend, a world of one): every row timed, comet checked
    against the unfused torch layer first, every comet row naming the config it ran; a world of
    one runs staged (n_comm 0: no row crosses a link) unless a split is forced."""
    proc, elapsed = _run("kernels.py", tmp_path, "--variants")
    data = json.loads((tmp_path / "kernels_smoke.json").read_text())
    rows = data["records"]
    assert "not GPU figures" in proc.stdout
    methods = {r["method"] for r in rows}
    assert {"comet layer0", "torch layer0", "dense layer0", "comet layer", "unfused layer",
            "comet layer0 [raster 1]"} <= methods
    assert {r["tokens"] for r in rows} == {64, 8}
    assert all(r["ms"] > 0 and r["err_layer"] < 1e-4 and r["err_layer0"] < 1e-4 for r in rows)
    for r in rows:
        if r["method"].startswith("comet"):
            assert r["config"].startswith("n_comm=") and "group=" in r["config"], r
            assert r["config"] in proc.stdout
    default = [r for r in rows if r["method"] == "comet layer0"]
    assert all(r["config"].startswith("n_comm=0 (staged)") for r in default)
    forced = [r for r in rows if r["method"].startswith("comet layer0 [n_comm")]
    assert forced and all("[explicit" in r["config"] and "staged" not in r["config"]
                          for r in forced)
    print(f"kernels.py --smoke --variants: {elapsed:.1f} s")


# ------------------------------------------------------------------------------------------------
# The command lines: every option explained, the whole description shown
# ------------------------------------------------------------------------------------------------


def _parser_of(main, monkeypatch) -> argparse.ArgumentParser:
    """The parser a script's main() builds (caught at parse_args, before anything runs)."""
    got = []

    def grab(self, args=None, namespace=None):
        got.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(SystemExit):
        main([])
    return got[0]


@pytest.mark.parametrize("name", ["__main__", "moe_layer", "sweep_ncomm", "prologue", "comm_copy",
                                  "multinode", "kernels"])
def test_every_bench_option_has_help_and_the_description_is_whole(name, monkeypatch):
    module = importlib.import_module(f"bench.{name}")
    parser = _parser_of(module.main, monkeypatch)
    assert not [a.dest for a in parser._actions if not a.help]
    assert parser.description == module.__doc__  # usage lines included, nothing cut
    assert isinstance(parser.formatter_class("x"), argparse.RawDescriptionHelpFormatter)
    if name != "__main__":
        smoke = next(a for a in parser._actions if a.dest == "smoke")
        assert "_smoke.json" in smoke.help


def _clean_env():
    """The environment without PYTHONPATH: a script must find comet and bench by itself."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize("name", ["__main__", "moe_layer", "sweep_ncomm", "prologue", "comm_copy",
                                  "multinode", "placement", "kernels"])
def test_every_script_runs_as_a_module_and_as_a_file(name, tmp_path):
    """`python -m bench.<name>` from the repository root and `python bench/<name>.py` from any
    directory (here an empty one) both start (--help), and name the default results directory."""
    forms = [([sys.executable, "-m", "bench" if name == "__main__" else f"bench.{name}"], ROOT)]
    if name != "__main__":  # `python -m bench` is the one way to run them all
        forms.append(([sys.executable, str(ROOT / "bench" / f"{name}.py")], tmp_path))
    for cmd, cwd in forms:
        p = subprocess.run(cmd + ["--help"], cwd=str(cwd), env=_clean_env(), capture_output=True,
                           text=True, timeout=120, check=False)
        assert p.returncode == 0, f"{' '.join(cmd)} in {cwd}:\n{p.stdout}\n{p.stderr}"
        assert "--out" in p.stdout and "./bench-results" in "".join(p.stdout.split()), p.stdout


def test_results_go_to_bench_results_of_the_current_directory(tmp_path):
    """Without --out a script writes under ./bench-results of the directory it runs from (as a
    file from anywhere), not into the source tree."""
    before = set((ROOT / "bench").rglob("*"))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "comm_copy.py"), "--smoke"],
                       cwd=str(tmp_path), env=_clean_env(), capture_output=True, text=True,
                       timeout=150, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    out = tmp_path / "bench-results" / "comm_copy_smoke.json"
    assert out.exists() and f"wrote {out}" in p.stdout
    assert set((ROOT / "bench").rglob("*")) - before <= {
        q for q in (ROOT / "bench").rglob("*") if "__pycache__" in q.parts}


def test_bench_runs_every_script_and_the_docs_count_them():
    from bench import __main__ as bench_main

    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__", "__main__", "common",
                                                                 "baselines", "tp_compare"}
    assert set(bench_main.SCRIPTS) == scripts
    count = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}[len(scripts)]
    assert f"The {count} CPU benchmarks" in bench_main.__doc__
    readme = (ROOT / "bench" / "README.md").read_text()
    assert f"{count.capitalize()} scripts" in readme and f"all {count}" in readme
    assert all(f"bench/{s}.py" in readme for s in scripts)
    # how long each takes, from a run of `python -m bench` (which prints these times)
    took = " ".join(readme[readme.index("How long they take"):].split("\n\n")[0].split())
    for s in scripts:
        assert re.search(rf"\b{s} (\d+ s|about \d+ s|under \d+ s)", took) or \
            re.search(rf"\b{s} and \w+ about \d+ s", took), s
    assert re.search(r"full size [\d.]+ min", took) and re.search(r"`--smoke` [\d.]+ min", took)
