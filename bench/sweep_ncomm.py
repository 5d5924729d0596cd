"""Latency of Comet's fused layers versus n_comm (the comm/GEMM block split) for one shape, with
the autotuner's choice and the cost model's choice marked: the adaptive assignment figure.

    .venv/bin/python bench/sweep_ncomm.py              # CPU: Mixtral-8x7B scaled, W=2, 8 blocks
    .venv/bin/python bench/sweep_ncomm.py --smoke      # CI-sized, < 30 s
    torchrun --nproc-per-node 8 bench/sweep_ncomm.py --world 8 --tokens 4096 --scale 1 \\
        --dtype bf16                                    # GPU (untested: no GPU here)

For every n_comm in 0..B-1 (0: the staged layer, its comm work and its GEMM each on the whole
grid, one after the other; B = --blocks: threads per rank on the CPU backend; on a GPU the SM
count, swept on a grid) with n_gemm = B - n_comm, it times layer0 alone, layer1 alone and the
forward (layer0 -> SwiGLU -> layer1), round-robin, each call after a barrier, max over ranks,
median over --iters rounds.

Marked choices:
* tuner: comet.tune.tuner.profile on the real ops through the profiling hooks (its own measurements,
  synthetic routing, candidates 0..B-1), stored in the tuning cache (--cache-dir, default
  <out>/tune-cache, out being --out or ./bench-results, so that a benchmark does not change your
  ~/.cache/comet; pass --cache-dir ~/.cache/comet to keep the winners); then the
  ops' default launch config is read back from that cache (shows the round trip);
* model: comet.tune.perfmodel.choose_n_comm with the CPU pseudo-spec measured on this machine
  (a model, not a measurement; its predicted curve is drawn on a second axis).

Output: table on stdout, <out>/sweep_ncomm.json and <out>/sweep_ncomm.png (--out, default
./bench-results; sweep_ncomm_smoke.* with --smoke).
On the CPU, B threads per rank share the machine's cores with the other ranks: the curve is the
CPU backend's, not a GPU's.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

GPU_GRID = (0, 1, 2, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64)


def _body(rank: int, world: int, cfg: dict):
    import torch
    import torch.distributed as dist

    import comet
    from bench import baselines as B
    from comet.layers import ops
    from comet.tune import perfmodel as pm
    from comet.tune import tuner as tn

    dev = C.device()
    dtype = C.DTYPES[cfg["dtype"]]
    dname = str(dtype).replace("torch.", "")
    shape = C.shape_of(cfg["model"], cfg["scale"], cfg["hidden"], cfg["ffn"])
    T, E, k, H = cfg["tokens"], shape["E"], shape["k"], shape["H"]
    if dev.type == "cpu":
        blocks = cfg["blocks"]
        # The ops' default path (and its tuning key) uses this block budget too.
        os.environ["COMET_CPU_BLOCKS"] = str(blocks)
        n_values = list(range(0, blocks))  # 0: staged, as the tuner may choose
        tile = ops.CPU_TILE
        arch = "cpu"
    else:  # untested here (no GPU)
        arch, blocks = tn.detect_device()
        n_values = [n for n in GPU_GRID if n < blocks]
        tile = pm.DEFAULT_TILE
    os.environ[tn.CACHE_ENV] = cfg["cache_dir"]
    tn.default_tuner().clear()
    label = f"{shape['title']} W={world} T={T} blocks={blocks}"
    inp = B.make_inputs(rank, world, shape, T, dtype, dev, seed=cfg["seed"])

    def launch(n):
        return (n, blocks - n if dev.type == "cpu" else 0, *tile)

    # -- tuner: measured autotuning through the profiling hooks, stored in the cache ----------
    tuned = {}
    if cfg["tune"]:
        tuner = tn.Tuner(cfg["cache_dir"])
        for layer, N in ((0, shape["N0"]), (1, shape["N1"])):
            key = tn.TuneKey(arch, blocks, dname, world, E, k, H, N, T, layer)
            C.progress(f"{label}: tuning layer{layer} ({len(n_values)} candidates)")
            cand = [tn.Config(n, *tile) for n in n_values]
            c = tn.profile(key, shape=key.shape(T), candidates=cand, tuner=tuner,
                           warmup=cfg["tune_warmup"], iters=cfg["tune_iters"], progress=False)
            tuned[f"layer{layer}"] = c.n_comm
    # What the ops take by default now (read back from the cache file by the process's tuner).
    tn.default_tuner().clear()
    default = {}
    for layer, N in ((0, shape["N0"]), (1, shape["N1"])):
        r = ops.launch_choice(dev.type, dev.index, layer, world, E, k, H, N, tn.token_bucket(T),
                              dname)
        default[f"layer{layer}"] = dict(n_comm=r[0], n_gemm=r[1], tile=[r[2], r[3]], source=r[4])

    # -- the sweep --------------------------------------------------------------------------------
    buf = comet.buffer_for(None)
    x, w0, w1, ids, wts = inp["x"], inp["w0"], inp["w1"], inp["ids"], inp["weights"]
    y0, _a, rc, sp, *_ = torch.ops.comet.moe_layer0(x, w0, ids, E, buf.handle, *launch(1))
    h = B.swiglu(y0)
    op0, op1 = torch.ops.comet.moe_layer0, torch.ops.comet.moe_layer1

    fns = {}
    for n in n_values:
        fns[f"layer0/{n}"] = lambda n=n: op0(x, w0, ids, E, buf.handle, *launch(n))
        fns[f"layer1/{n}"] = lambda n=n: op1(h, w1, wts, ids, sp, rc, E, buf.handle, *launch(n))

        def forward(n=n):
            y, _a, rc_, sp_, *_ = op0(x, w0, ids, E, buf.handle, *launch(n))
            return op1(B.swiglu(y), w1, wts, ids, sp_, rc_, E, buf.handle, *launch(n))

        fns[f"forward/{n}"] = forward
    C.progress(f"{label}: sweeping n_comm over {n_values} "
               f"({cfg['warmup']} + {cfg['iters']} rounds)")
    t = C.measure(fns, dev, cfg["warmup"], cfg["iters"], label=label)

    # -- the model ------------------------------------------------------------------------------
    model = None
    if rank == 0:
        try:
            spec = pm.cpu_spec(threads=blocks, measure=True) if dev.type == "cpu" \
                else pm.get_spec(arch, blocks)
            model = dict(spec=dict(name=spec.name, blocks=spec.sm_count,
                                   gflops=spec.peak_flops(4) / 1e9, mem_gbs=spec.hbm_gbs),
                         choice={}, fused_s={})
            for layer, N in ((0, shape["N0"]), (1, shape["N1"])):
                ms_ = pm.MoEShape(W=world, E=E, k=k, H=H, N=N, T=T, dtype_bytes=dtype.itemsize)
                model["choice"][f"layer{layer}"] = pm.choose_n_comm(ms_, spec, layer,
                                                                    max_blocks=blocks, tile=tile)
                model["fused_s"][f"layer{layer}"] = {
                    str(n): pm.predict(ms_, spec, n, layer, tile, n_blocks=blocks)["fused"]
                    for n in n_values}
        except Exception as e:  # noqa: BLE001 - informative only
            model = dict(error=repr(e))
    dist.barrier()
    if rank != 0:
        return None
    curves = {part: {str(n): t[f"{part}/{n}"]["median"] for n in n_values}
              for part in ("layer0", "layer1", "forward")}
    best = {part: int(min(c, key=lambda n: (c[n], int(n)))) for part, c in curves.items()}
    return dict(model=cfg["model"], title=shape["title"], world=world, tokens=T,
                dtype=cfg["dtype"], blocks=blocks, tile=list(tile), n_values=n_values,
                shape={k_: shape[k_] for k_ in ("H", "ffn", "N0", "N1", "E", "k", "scale")},
                times_s=t, median_s=curves, measured_best=best, tuner_choice=tuned,
                ops_default=default, perfmodel=model, cache_dir=cfg["cache_dir"])


def render(r) -> str:
    tuned, model = r["tuner_choice"], (r["perfmodel"] or {}).get("choice", {})
    headers = ["n_comm", "n_gemm", "layer0 ms", "layer1 ms", "forward ms", "forward min..max",
               "model layer0 ms", "model layer1 ms", "marks"]
    rows = []
    fused = (r["perfmodel"] or {}).get("fused_s", {})
    for n in r["n_values"]:
        s = str(n)
        marks = []
        for layer in ("layer0", "layer1"):
            if tuned.get(layer) == n:
                marks.append(f"tuner:{layer[-1]}")
            if model.get(layer) == n:
                marks.append(f"model:{layer[-1]}")
        for part in ("layer0", "layer1", "forward"):
            if r["measured_best"][part] == n:
                marks.append(f"best:{part}")
        rows.append([s, str(r["blocks"] - n if r["blocks"] else 0),
                     *(f"{r['median_s'][p][s] * 1e3:.2f}" for p in ("layer0", "layer1", "forward")),
                     (f"{r['times_s'][f'forward/{s}']['min'] * 1e3:.1f}.."
                      f"{r['times_s'][f'forward/{s}']['max'] * 1e3:.1f}"),
                     *(f"{fused[p][s] * 1e3:.2f}" if p in fused else "-"
                       for p in ("layer0", "layer1")),
                     " ".join(marks)])
    return C.table(headers, rows)


def plot(r, path: Path, backend: str) -> str:
    plt = C.pyplot()
    if plt is None:
        return C.NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    ns = r["n_values"]
    model = r["perfmodel"] or {}
    for ax, part in zip(axes, ("layer0", "layer1", "forward")):
        ys = [r["median_s"][part][str(n)] * 1e3 for n in ns]
        ax.plot(ns, ys, "o-", color="#dd8452", label="measured (median, max over ranks)")
        b = r["measured_best"][part]
        ax.plot([b], [r["median_s"][part][str(b)] * 1e3], "*", ms=16, color="#2ca02c",
                label=f"measured best n_comm={b}")
        layers = [part] if part != "forward" else []
        for layer in layers:
            tc = r["tuner_choice"].get(layer)
            if tc is not None:
                ax.axvline(tc, color="#4c72b0", ls="-", lw=1.5, label=f"tuner's choice n_comm={tc}")
            mc = model.get("choice", {}).get(layer)
            if mc is not None:
                ax.axvline(mc, color="k", ls=":", lw=1.5, label=f"model's choice n_comm={mc}")
            fs = model.get("fused_s", {}).get(layer)
            if fs:
                ax2 = ax.twinx()
                ax2.plot(ns, [fs[str(n)] * 1e3 for n in ns], "--", color="#888888")
                ax2.set_ylabel("cost model prediction, ms (not measured)", fontsize=7,
                               color="#666666")
                ax2.tick_params(labelsize=7, colors="#666666")
        if part == "forward":
            ax.set_title("forward (layer0 + SwiGLU + layer1, same n_comm)", fontsize=9)
        else:
            ax.set_title(f"{part}", fontsize=9)
        ax.set_xlabel(f"n_comm (n_gemm = {r['blocks']} - n_comm)" if backend == "cpu"
                      else "n_comm (n_gemm = SMs - n_comm)")
        ax.set_ylabel("latency, ms")
        ax.set_ylim(0, max(ys) * 1.15)
        ax.legend(fontsize=7)
    head = "CPU backend (threads as blocks; not GPU results)" if backend == "cpu" else backend
    fig.suptitle(f"{r['title']} (scaled: H={r['shape']['H']}, ffn={r['shape']['ffn']}), "
                 f"W={r['world']}, T={r['tokens']}/rank, {r['dtype']} -- {head}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def parse(argv=None):
    p = C.arg_parser("bench/sweep_ncomm.py", __doc__)
    C.add_output_args(p, "sweep_ncomm", "64 tokens, H=32, 4 blocks, 3 rounds: < 30 s")
    p.add_argument("--model", default="mixtral", choices=sorted(C.MODELS),
                   help="model shape, scaled on the CPU (default mixtral)")
    p.add_argument("--world", type=int, default=None, help="ranks (default 2; GPU: 8)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 512)")
    p.add_argument("--blocks", type=int, default=None,
                   help="CPU: threads per rank n_comm + n_gemm (default 8)")
    p.add_argument("--scale", type=int, default=None, help="divide H and ffn (default per model)")
    C.add_shape_and_timing_args(p, warmup=2, iters=20)
    p.add_argument("--no-tune", dest="tune", action="store_false",
                   help="do not run the autotuner (the ops then take the cache or the model)")
    p.add_argument("--tune-iters", type=int, default=None,
                   help="timed calls per candidate in the tuner (default 10; smoke: 1)")
    p.add_argument("--cache-dir", default=None,
                   help="tuning cache (default <out>/tune-cache, i.e. "
                        f"./{C.DEFAULT_OUT}/tune-cache without --out)")
    p.add_argument("--seed", type=int, default=0, help="seed of inputs, weights and routing")
    p.add_argument("--name", default=None,
                   help="basename of the JSON/PNG files (default sweep_ncomm; smoke: "
                        "sweep_ncomm_smoke)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds before the ranks are stopped (default 1800; smoke: 120)")
    a = p.parse_args(argv)
    a.name = a.name or C.result_name("sweep_ncomm", a.smoke)
    gpu = C.on_gpu() and C.under_torchrun()
    if a.smoke:
        a.tokens = a.tokens or 64
        a.hidden = a.hidden or 32
        a.ffn = a.ffn or 24
        a.blocks = a.blocks or 4
        a.warmup = 1 if a.warmup is None else a.warmup
        a.iters = a.iters or 3
        a.tune_iters = a.tune_iters or 1
        a.timeout = min(a.timeout, 120.0)
    a.world = a.world or (8 if gpu else 2)
    a.tokens = a.tokens or 512
    a.blocks = a.blocks or 8
    a.dtype = a.dtype or ("bf16" if gpu else "fp32")
    a.warmup = 2 if a.warmup is None else a.warmup
    a.iters = a.iters or 20
    a.tune_iters = a.tune_iters or 10
    a.cache_dir = str(Path(a.cache_dir).expanduser().resolve() if a.cache_dir
                      else C.out_dir(a.out).resolve() / "tune-cache")
    if a.blocks < 2:
        p.error("--blocks must be >= 2 (1 comm + 1 GEMM)")
    if C.MODELS[a.model]["E"] % a.world:
        p.error(f"--world {a.world} does not divide E={C.MODELS[a.model]['E']}")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    backend = "cuda" if (C.on_gpu() and C.under_torchrun()) else "cpu"
    cfg = dict(model=a.model, tokens=a.tokens, scale=a.scale, hidden=a.hidden, ffn=a.ffn,
               dtype=a.dtype, warmup=a.warmup, iters=a.iters, seed=a.seed, blocks=a.blocks,
               tune=a.tune, tune_iters=a.tune_iters, tune_warmup=1, cache_dir=a.cache_dir)
    env = C.environment(backend)  # before the run: the load others put on the machine
    t0 = time.monotonic()
    C.progress(f"sweep_ncomm: {'torchrun' if C.under_torchrun() else 'spawning'} {a.world} ranks "
               f"({backend})")
    r = C.launch(_body, a.world, cfg, timeout=a.timeout)[0]
    if not C.is_main_process():
        return 0
    elapsed = time.monotonic() - t0
    r["backend"] = backend
    data = dict(name=a.name, label=C.CPU_LABEL if backend == "cpu" else
                f"GPU run ({backend}); GPU path untested by its authors", smoke=a.smoke,
                config=cfg, environment=env, elapsed_s=elapsed, result=r)
    out_dir = C.out_dir(a.out)
    jp = C.write_json(a.name, data, out_dir)
    cores = os.cpu_count() or 1
    head = (f"CPU backend -- measured on this CPU, NOT GPU results; {a.blocks} threads per rank x "
            f"{a.world} ranks on {cores} cores" if backend == "cpu" else f"GPU ({backend})")
    print(f"Comet latency vs n_comm: {r['title']} (H={r['shape']['H']}, ffn={r['shape']['ffn']}, "
          f"E={r['shape']['E']}, k={r['shape']['k']}), W={a.world}, T={a.tokens}/rank, {a.dtype}, "
          f"tile {r['tile'][0]}x{r['tile'][1]}; {head}")
    print(render(r))
    tc, mc = r["tuner_choice"], (r["perfmodel"] or {}).get("choice", {})
    d = r["ops_default"]
    print(f"tuner (measured, comet.tune.tuner.profile): {tc or 'not run (--no-tune)'}; "
          f"model (comet.tune.perfmodel, not measured): {mc or '-'}; ops default now: "
          + ", ".join(f"{k} n_comm={v['n_comm']} ({v['source']})" for k, v in d.items()))
    print(f"median over {a.iters} rounds of the max over ranks; times in ms; cache: {a.cache_dir}")
    print(f"json: {jp}")
    print(plot(r, out_dir / f"{a.name}.png", backend))
    print(f"elapsed {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
