"""Forward of one expert-parallel MoE layer: sequential (Megatron-style) vs Tutel-style coarse
pipeline (1/2/4/8 chunks, best reported) vs Comet's fused ops, with the measured limit
max(comm alone, GEMM alone) and every method's ratio to it.

    .venv/bin/python bench/moe_layer.py            # full CPU run (W = 2 and 4, a few minutes)
    .venv/bin/python bench/moe_layer.py --smoke    # CI-sized, < 30 s
    .venv/bin/python bench/moe_layer.py --tp 2 --world 4   # EP 2 x TP 2 beside EP 4 (Comet's
                                                   # ops both; bench/tp_compare.py)
    torchrun --nproc-per-node 8 bench/moe_layer.py --world 8 --tokens 4096 --scale 1 --dtype bf16
                                                   # GPU (untested: no GPU where this was written)
    .venv/bin/python bench/moe_layer.py --dtype fp8 --hidden 512   # FP8 (on a GPU: sm_89 / sm_90,
                                                   # the FP8 kernels, untested: no GPU here)

--dtype fp8: Comet runs in FP8 (comet.fp8: bf16 tokens quantised on dispatch, weights quantised
once, the SwiGLU output per row, results in bf16); the torch baselines run in bf16 and Comet's
output is checked against them at FP8's tolerance (relative norm error < 0.1). Each record also
has layer0_bytes: the token-row bytes layer0 moves per call on each rank, with FP8 rows and
with bf16 rows (dispatched rows x row size: what the comm blocks copy), their ratio, and the
bytes the rank's inter-node link carried per call in each mode (nonzero when the group spans
nodes, e.g. COMET_CPU_RANKS_PER_NODE=1). For H a multiple of 512 the row ratio is exactly
(H + 4 H/128) / (2 H).

Shapes: Mixtral-8x7B, Qwen2-MoE and Phi-3.5-MoE from docs/peers.md, H and ffn divided by --scale
(default per model: 32, 16, 32, so H = 128) on the CPU; --tokens per rank. Every rank checks
that the three methods give the same output (and the torch.distributed reference once) before
anything is timed. Timing: --warmup untimed rounds, then --iters rounds, one call of each method
per round after a barrier; a call's time is the max over ranks; the median over rounds is shown.

The limit is measured, not modelled: "comm" = the sequential form's three all-to-alls alone
(counts, dispatch, combine; gloo on the CPU), "GEMM" = its grouped GEMMs + activation alone
(torch matmul); limit = max(comm, GEMM). The cost model's limit (comet.tune.perfmodel, CPU pseudo-spec
measured on this machine) is stored in the JSON, labelled as model.

Output: a table on stdout, <out>/moe_layer.json and <out>/moe_layer.png (--out, default
./bench-results)
(moe_layer_smoke.* with --smoke).
On the CPU this measures comet's CPU backend (OS threads as thread blocks, POSIX shared memory
instead of NVLink, a portable fp32 tile GEMM instead of CUTLASS) against torch + gloo: it is not a
GPU result and must not be quoted as one.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

CHUNKS = (1, 2, 4, 8)


def _body(rank: int, world: int, cfg: dict):
    """Runs on every rank: every shape, validation then timing. Returns rank 0's records."""
    import torch
    import torch.distributed as dist

    from bench import baselines as B
    from comet.layers import ops
    from comet.tune import perfmodel as pm
    from comet import reference as ref
    from comet.tune import tuner as tn

    dev = C.device()
    fp8 = cfg["dtype"] == "fp8"  # Comet in FP8, the baselines in bf16
    dtype = torch.bfloat16 if fp8 else C.DTYPES[cfg["dtype"]]
    # The reference runs on the CPU over gloo (a second group when the main one is NCCL).
    ref_group = dist.new_group(backend="gloo") if dev.type == "cuda" else None
    records = []
    for name in cfg["models"]:
        shape = C.shape_of(name, cfg["scale"], cfg["hidden"], cfg["ffn"])
        T = cfg["tokens"]
        label = f"{shape['title']} W={world} T={T}"
        C.progress(f"{label}: H={shape['H']} ffn={shape['ffn']} E={shape['E']} k={shape['k']} "
                   f"{cfg['dtype']}: checking outputs")
        inp = B.make_inputs(rank, world, shape, T, dtype, dev, seed=cfg["seed"])
        chunks = [c for c in CHUNKS if c <= max(1, T)]

        # -- same output from every method (and the reference) before timing -----------------
        out_seq = B.sequential(inp, world)
        outs = {f"tutel_c{c}": B.pipelined(inp, world, c) for c in chunks}
        q = B.quantized_weights(inp) if fp8 else None
        outs["comet"] = B.comet_forward_fp8(inp, q) if fp8 else B.comet_forward(inp)
        ref_out = ref.moe_dist(inp["x"].cpu(), inp["w0"].cpu(), inp["w1"].cpu(), inp["ids"].cpu(),
                               inp["weights"].cpu(), inp["E"], activation=ref.swiglu,
                               group=ref_group)
        outs["reference"] = ref_out.to(dev)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        errs = {}
        for k, o in outs.items():
            where = f"rank {rank}, {label}: {k} vs sequential"
            if fp8 and k == "comet":
                rel = float((o.float() - out_seq.float()).norm() /
                            out_seq.float().norm().clamp_min(1e-6))
                assert rel < 0.1, f"{where}: FP8 relative error {rel:.3f}"
            else:
                torch.testing.assert_close(o.float(), out_seq.float(), **tol,
                                           msg=lambda m, where=where: f"{where}: {m}")
            errs[k] = float((o.float() - out_seq.float()).abs().max()) if o.numel() else 0.0
        scale_ = float(out_seq.float().abs().max()) if out_seq.numel() else 0.0

        # -- launch configs comet's default path takes (the tuner's choice) --------------------
        launch = {}
        for layer, N in enumerate((shape["N0"], shape["N1"])):
            r = ops.launch_choice(dev.type, dev.index, layer, world, shape["E"], shape["k"],
                                  shape["H"], N, tn.token_bucket(T),
                                  "float8_e4m3fn" if fp8 else str(dtype).replace("torch.", ""))
            launch[f"layer{layer}"] = dict(n_comm=r[0], n_gemm=r[1], tile=[r[2], r[3]],
                                           source=r[4])

        # -- timing ------------------------------------------------------------------------------
        comm_only, gemm_only, rows = B.parts(inp, world)
        fns = {"comm_only": comm_only, "gemm_only": gemm_only,
               "sequential": lambda inp=inp: B.sequential(inp, world)}
        for c in chunks:
            fns[f"tutel_c{c}"] = lambda c=c, inp=inp: B.pipelined(inp, world, c)
        fns["comet"] = (lambda inp=inp, q=q: B.comet_forward_fp8(inp, q)) if fp8 else \
            (lambda inp=inp: B.comet_forward(inp))
        if dev.type == "cpu" and not fp8:
            l0, l1 = (launch[f"layer{i}"] for i in (0, 1))
            fns["comet_local"] = B.comet_local(inp, (l0["n_comm"], l0["n_gemm"], *l0["tile"]),
                                               (l1["n_comm"], l1["n_gemm"], *l1["tile"]))
        C.progress(f"{label}: timing {len(fns)} functions, {cfg['warmup']} + {cfg['iters']} rounds")
        t = C.measure(fns, dev, cfg["warmup"], cfg["iters"], label=label)
        med = {k: v["median"] for k, v in t.items()}
        tutel = {c: med[f"tutel_c{c}"] for c in chunks}
        best_c = min(tutel, key=lambda c: (tutel[c], c))
        limit = max(med["comm_only"], med["gemm_only"])

        # -- the cost model's view (labelled model) -------------------------------------------
        model = None
        if rank == 0:
            try:
                if dev.type == "cpu":
                    spec = pm.cpu_spec(threads=launch["layer0"]["n_comm"] +
                                       launch["layer0"]["n_gemm"], measure=True)
                else:
                    spec = pm.get_spec(*tn.detect_device())
                model = {}
                for layer, N in ((0, shape["N0"]), (1, shape["N1"])):
                    ms_ = pm.MoEShape(W=world, E=shape["E"], k=shape["k"], H=shape["H"], N=N, T=T,
                                      dtype_bytes=1 if fp8 else dtype.itemsize)
                    p = pm.predict(ms_, spec, launch[f"layer{layer}"]["n_comm"], layer,
                                   tuple(launch[f"layer{layer}"]["tile"]))
                    model[f"layer{layer}"] = {k: p[k] for k in ("comm", "gemm", "fused", "baseline",
                                                                "limit") if k in p}
                model["spec"] = dict(name=spec.name, blocks=spec.sm_count,
                                     gflops=spec.peak_flops(4) / 1e9, mem_gbs=spec.hbm_gbs)
                model["limit_both_layers"] = sum(model[f"layer{i}"]["limit"] for i in (0, 1))
            except Exception as e:  # noqa: BLE001 - informative only
                model = dict(error=repr(e))

        gemm_flops = 2.0 * rows * shape["H"] * (shape["N0"] + shape["N1"])
        # (the link counters are the CPU backend's: its links are what it can count)
        layer0_bytes = _layer0_bytes(inp) if fp8 and dev.type == "cpu" else None
        records.append(dict(
            model=name, title=shape["title"], world=world, tokens=T, dtype=cfg["dtype"],
            shape={k: shape[k] for k in ("H", "ffn", "N0", "N1", "E", "k", "scale", "full_H",
                                         "full_ffn")},
            rows_on_rank0=rows, gemm_gflop_rank0=gemm_flops / 1e9,
            times_s={k: v for k, v in t.items()},
            median_ms={k: v * 1e3 for k, v in med.items()},
            tutel_best_chunks=best_c, tutel_best_ms=tutel[best_c] * 1e3,
            limit_ms=limit * 1e3,
            limit_bound="comm" if med["comm_only"] >= med["gemm_only"] else "gemm",
            ratio_to_limit=dict(sequential=med["sequential"] / limit,
                                tutel=tutel[best_c] / limit, comet=med["comet"] / limit),
            comet_speedup_vs_sequential=med["sequential"] / med["comet"],
            comet_speedup_vs_tutel=tutel[best_c] / med["comet"],
            comet_exposed_over_local=(med["comet"] / med["comet_local"]
                                      if "comet_local" in med else None),
            comet_launch=launch,
            max_abs_err_vs_sequential=errs, output_max_abs=scale_,
            perfmodel=model,
            **({"layer0_bytes": layer0_bytes} if layer0_bytes else {}),
        ))
        C.progress(f"{label}: sequential {med['sequential'] * 1e3:.2f} ms, tutel(c={best_c}) "
                   f"{tutel[best_c] * 1e3:.2f} ms, comet {med['comet'] * 1e3:.2f} ms, limit "
                   f"{limit * 1e3:.2f} ms")
        dist.barrier()
    return records if rank == 0 else None


def _layer0_bytes(inp):
    """The token-row bytes one layer0 call moves on this rank with FP8 rows and with bf16 rows
    (rows dispatched to it x the row size), and its inter-node link bytes per call in each mode."""
    import comet
    from comet import fp8
    from comet.layers import ops

    buf = ops._buffer_for(None, None, inp["x"])
    w0q, s0 = fp8.quantize_blocks(inp["w0"])
    got = {}
    for mode in ("bf16", "fp8"):
        before = buf.link_stats()[1]
        if mode == "fp8":
            _y0, layout = comet.moe_layer0(inp["x"], w0q, inp["ids"], num_experts=inp["E"],
                                           w0_scale=s0, dispatch_fp8=True)
            row = fp8.row_bytes(inp["H"])
        else:
            _y0, layout = comet.moe_layer0(inp["x"], inp["w0"], inp["ids"], num_experts=inp["E"])
            row = 2 * inp["H"]
        got[mode] = layout.num_rows * row
        got[f"link_{mode}"] = buf.link_stats()[1] - before
    got["ratio"] = got["fp8"] / got["bf16"] if got["bf16"] else None
    got["ratio_formula"] = (inp["H"] + 4 * inp["H"] / 128) / (2 * inp["H"])
    return got


def render(records) -> str:
    headers = ["model", "W", "T/rank", "comm", "GEMM", "limit", "sequential", "Tutel (best c)",
               "Comet (n_comm+n_gemm)", "seq/lim", "Tutel/lim", "Comet/lim", "Comet vs seq",
               "Comet W=1", "max err"]
    # --dtype fp8: layer0's row bytes with FP8 rows over bf16 rows (the JSON's layer0_bytes)
    fp8 = any("layer0_bytes" in r for r in records)
    if fp8:
        headers.append("L0 bytes fp8/bf16")
    rows = []
    for r in records:
        m = r["median_ms"]
        l0 = r["comet_launch"]["layer0"]
        err = max(v for k, v in r["max_abs_err_vs_sequential"].items())
        ratio = (r.get("layer0_bytes") or {}).get("ratio")
        rows.append([
            r["title"], str(r["world"]), str(r["tokens"]), f"{m['comm_only']:.2f}",
            f"{m['gemm_only']:.2f}", f"{r['limit_ms']:.2f}", f"{m['sequential']:.2f}",
            f"{r['tutel_best_ms']:.2f} (c={r['tutel_best_chunks']})",
            f"{m['comet']:.2f} ({l0['n_comm']}+{l0['n_gemm']})",
            f"{r['ratio_to_limit']['sequential']:.2f}", f"{r['ratio_to_limit']['tutel']:.2f}",
            f"{r['ratio_to_limit']['comet']:.2f}", f"{r['comet_speedup_vs_sequential']:.2f}x",
            f"{m['comet_local']:.2f}" if "comet_local" in m else "-", f"{err:.1e}",
        ] + ([f"{ratio:.3f}" if ratio is not None else "-"] if fp8 else []))
    return C.table(headers, rows)


def plot(records, path: Path) -> str:
    plt = C.pyplot()
    if plt is None:
        return C.NO_MATPLOTLIB
    groups = sorted({r["world"] for r in records})
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, W in zip(axes[0], groups):
        rs = [r for r in records if r["world"] == W]
        xs = range(len(rs))
        width = 0.26
        series = [("sequential", [r["median_ms"]["sequential"] for r in rs], "#999999"),
                  ("Tutel-style (best c)", [r["tutel_best_ms"] for r in rs], "#4c72b0"),
                  ("Comet fused", [r["median_ms"]["comet"] for r in rs], "#dd8452")]
        for i, (lab, vals, col) in enumerate(series):
            ax.bar([x + (i - 1) * width for x in xs], vals, width, label=lab, color=col)
        for x, r in zip(xs, rs):
            ax.hlines(r["limit_ms"], x - 1.5 * width, x + 1.5 * width, colors="k",
                      linestyles="--", label="limit max(comm, GEMM), measured" if x == 0 else None)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["title"] for r in rs], fontsize=8)
        ax.set_ylabel("forward latency, ms (median, max over ranks)")
        ax.set_title(f"W={W}, T={rs[0]['tokens']}/rank, {rs[0]['dtype']}", fontsize=9)
        ax.legend(fontsize=7)
    backend = records[0].get("backend", "cpu")
    fig.suptitle("One MoE layer forward -- " + ("CPU backend, scaled shapes (not GPU results)"
                                               if backend == "cpu" else f"GPU ({backend})"),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def parse(argv=None):
    p = C.arg_parser("bench/moe_layer.py", __doc__)
    C.add_output_args(p, "moe_layer", "W=2, 64 tokens, H=32, 3 rounds: < 30 s")
    p.add_argument("--models", default="mixtral,qwen2,phi3.5",
                   help="comma-separated: " + ", ".join(C.MODELS))
    p.add_argument("--world", default=None,
                   help="ranks, comma-separated for several runs (default CPU: 2,4; smoke: 2)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 512)")
    p.add_argument("--scale", type=int, default=None,
                   help="divide H and ffn by this (default per model on the CPU: 32/16/32; "
                        "use 1 on a GPU)")
    C.add_shape_and_timing_args(p, warmup=3, iters=25)
    for act in p._actions:  # this benchmark also runs Comet in FP8 (the module docstring)
        if act.dest == "dtype":
            act.choices = sorted(C.DTYPES) + ["fp8"]
            act.help += "; fp8: Comet in FP8, the baselines in bf16"
    p.add_argument("--seed", type=int, default=0, help="seed of inputs, weights and routing")
    p.add_argument("--name", default=None,
                   help="basename of the JSON/PNG files (default moe_layer; smoke: "
                        "moe_layer_smoke)")
    p.add_argument("--tp", type=int, default=1,
                   help="tp_size > 1: Comet's layer with expert tensor parallelism (EP = W / tp) "
                        "beside the expert-parallel one on the same ranks (bench/tp_compare.py)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds per world size before the ranks are stopped (default 1800; "
                        "smoke: 120)")
    a = p.parse_args(argv)
    a.name = a.name or C.result_name("moe_layer", a.smoke)
    gpu = C.on_gpu() and C.under_torchrun()
    if a.smoke:
        a.world = a.world or "2"
        a.tokens = a.tokens or 64
        a.hidden = a.hidden or 32
        a.ffn = a.ffn or 24
        a.warmup = 1 if a.warmup is None else a.warmup
        a.iters = a.iters or 3
        a.timeout = min(a.timeout, 120.0)
    a.world = [int(w) for w in (a.world or ("2,4" if not gpu else "8")).split(",")]
    a.tokens = a.tokens or 512
    a.dtype = a.dtype or ("bf16" if gpu else "fp32")
    a.warmup = 3 if a.warmup is None else a.warmup
    a.iters = a.iters or 25
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in a.models:
        if m not in C.MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(C.MODELS)}")
    for W in a.world:
        bad = [m for m in a.models if C.MODELS[m]["E"] % W]
        if bad:
            p.error(f"--world {W} does not divide the expert count of {bad}")
        if a.tp < 1 or W % a.tp:
            p.error(f"--tp {a.tp} does not divide --world {W}")
    if a.tp > 1:
        a.name = a.name.replace("moe_layer", "moe_layer_tp")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    backend = "cuda" if (C.on_gpu() and C.under_torchrun()) else "cpu"
    cfg = dict(models=a.models, tokens=a.tokens, scale=a.scale, hidden=a.hidden, ffn=a.ffn,
               dtype=a.dtype, warmup=a.warmup, iters=a.iters, seed=a.seed)
    env = C.environment(backend)  # before the run: the load others put on the machine
    t0 = time.monotonic()
    records = []
    if a.tp > 1:
        return _main_tp(a, backend, cfg, env, t0)
    for W in a.world:
        C.progress(f"moe_layer: {'torchrun' if C.under_torchrun() else 'spawning'} {W} ranks "
                   f"({backend})")
        res = C.launch(_body, W, cfg, timeout=a.timeout)
        for r in res[0]:
            r["backend"] = backend
        records.extend(res[0])
    if not C.is_main_process():
        return 0
    elapsed = time.monotonic() - t0
    data = dict(
        name=a.name, label=C.CPU_LABEL if backend == "cpu" else
        f"GPU run ({backend}); GPU path untested by its authors", smoke=a.smoke,
        config=dict(cfg, world=a.world, chunks=list(CHUNKS)),
        environment=env, elapsed_s=elapsed,
        columns=dict(
            comm="median ms of the sequential form's three all-to-alls alone (counts, dispatch, "
                 "combine)",
            gemm="median ms of its grouped GEMMs + activation alone",
            comet_local="median ms of Comet's ops on a world of one (all experts local, same rows "
                        "and launch config): the CPU backend's compute floor",
            limit="max(comm, gemm): measured, perfect-overlap bound for torch's parts",
            ratio_to_limit="method / limit"),
        results=records)
    out_dir = C.out_dir(a.out)
    jp = C.write_json(a.name, data, out_dir)
    head = ("CPU backend, scaled shapes -- measured on this CPU, NOT GPU results"
            if backend == "cpu" else f"GPU ({backend})")
    print(f"One MoE layer forward, {head}; times in ms (median over {a.iters} rounds of the max "
          f"over ranks), {a.dtype}, {a.tokens} tokens/rank")
    print(render(records))
    print("comm, GEMM: the sequential form's all-to-alls (gloo) and its grouped GEMMs + activation "
          "(torch matmul), each measured alone; limit = max(comm, GEMM).\n"
          "Comet: n_comm+n_gemm = comm+GEMM threads per rank (the tuner's choice). Comet W=1: the "
          "same ops on a world of one (all experts local, same rows and split, no peer traffic):\n"
          "the CPU backend's compute floor, set by its portable fp32 tile GEMM (not torch's "
          "matmul). max err: largest |out - sequential| over Tutel, Comet and the reference." +
          ("\nL0 bytes fp8/bf16: the token-row bytes layer0 moves with FP8 rows (values and "
           "scales) over bf16 rows." if any("layer0_bytes" in r for r in records) else ""))
    print("The JSON also holds every Tutel degree's time, each time's min and max, both layers' "
          "launch configs and the cost model's prediction.")
    print(f"json: {jp}")
    print(plot(records, out_dir / f"{a.name}.png"))
    print(f"elapsed {elapsed:.1f} s")
    return 0


def _main_tp(a, backend, cfg, env, t0) -> int:
    from bench import tp_compare

    cfg = dict(cfg, tp=a.tp)
    records = []
    for W in a.world:
        C.progress(f"moe_layer --tp {a.tp}: {W} ranks ({backend})")
        records.extend(C.launch(tp_compare.body, W, cfg, timeout=a.timeout)[0])
    if not C.is_main_process():
        return 0
    data = dict(name=a.name, label=C.CPU_LABEL if backend == "cpu" else f"GPU run ({backend})",
                smoke=a.smoke, config=dict(cfg, world=a.world), environment=env,
                elapsed_s=time.monotonic() - t0, results=records)
    jp = C.write_json(a.name, data, C.out_dir(a.out))
    print(f"One MoE layer forward, EP x TP vs EP only on the same ranks ({backend}"
          f"{', NOT GPU results' if backend == 'cpu' else ''}); median ms over {a.iters} rounds "
          f"of the max over ranks, {a.dtype}, {a.tokens} tokens/rank")
    print(tp_compare.render(records))
    print(f"json: {jp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
