"""Comet's fused layers beside plain torch on one device (a world of one), kernel by kernel: the
table a GPU run of this project is judged by.

    python bench/kernels.py                     # GPU: full shapes, bf16; CPU: scaled, fp32
    python bench/kernels.py --smoke             # CI-sized (CPU: a few seconds)
    python -m bench.kernels --variants          # also the old tile order and a fused split
    python bench/kernels.py --models mixtral --tokens 4096,32 --iters 50

Shapes (--models; full size on a GPU, H and F divided by --scale on the CPU, default 32):
  mixtral   Mixtral-8x7B         H 4096, F 14336, E 8,  top-2
  qwen2     Qwen2-57B-A14B       H 3584, F 2560,  E 64, top-8
  deepseek  DeepSeek-V3 per rank H 7168, F 2048,  E 32, top-8 (256 experts over EP8)
each at every --tokens count (default 4096 and 32: a prefill batch and a decode step), gated
experts (w0 [E, 2F, H] = [gate; up], SwiGLU, w1 [E, H, F]), uniform top-k routing.

Rows, all on the same inputs, in one process:
  comet layer0          comet.moe_layer0 with the launch config the ops pick by default
  torch layer0          the dispatched rows gathered (x[token of row]) + torch._grouped_mm
  dense layer0          one dense matmul with layer0's FLOPs ([M, H] x [H, 2F]: cuBLAS on a GPU)
  comet layer           moe_layer0 -> SwiGLU -> moe_layer1
  unfused layer         gather, torch._grouped_mm, SwiGLU, torch._grouped_mm, weighted index_add
  comet layer1 GEMM     (GPU) moe_layer1 in bench mode 'gemm': its GEMM blocks alone
  --variants: comet layer0 / layer at raster group 1 (the tile order before raster groups) and
  with a fused split (n_comm 4 comm blocks beside the GEMM instead of the staged layer).
Columns: median ms over --iters calls after --warmup (CUDA events on a GPU, wall clock on the
CPU), TFLOP/s (2 M N K of the GEMMs), weight GB/s (the experts' weights once / time), and for
comet rows the config it ran: n_comm (0 = staged: comm and GEMM as two launches of the whole
grid), tile, layer1's band, the raster group, and where the config came from (measured, cache,
model, default, explicit). "per SM" is a comet row's TFLOP/s per SM its GEMM blocks held over
torch._grouped_mm's per SM of the device (1.00: the same rate per SM).
Before timing, comet's outputs are checked against the unfused torch layer (relative L2 error;
bf16: < 2e-2, fp32: < 1e-4) and the run stops if they disagree.

Output: the table on stdout, <out>/kernels.json (kernels_smoke.json with --smoke); progress
on stderr. On the CPU this times the CPU backend against torch's CPU kernels: not GPU figures.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

SHAPES = {
    "mixtral": dict(title="Mixtral-8x7B", H=4096, F=14336, E=8, k=2),
    "qwen2": dict(title="Qwen2-57B-A14B", H=3584, F=2560, E=64, k=8),
    "deepseek": dict(title="DeepSeek-V3 per rank", H=7168, F=2048, E=32, k=8),
}
TOL = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-4}


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_fn(fn, dev, warmup: int, iters: int) -> float:
    """Median seconds of fn() (CUDA events on a GPU, each call timed alone)."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    _sync(dev)
    samples = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def make_problem(shape: dict, T: int, dtype, dev, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    H, F, E, k = shape["H"], shape["F"], shape["E"], shape["k"]
    x = torch.randn(T, H, generator=g).to(dev, dtype)
    w0 = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).to(dev, dtype)
    w1 = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(dev, dtype)
    weights, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k)
    return x, w0, w1, ids.to(dev), weights.to(dev, torch.float32)


def dispatch(ids, E: int):
    """The expert-major order of the (token, slot) rows (the dispatch layout of a world of one)
    and the grouped GEMM's offsets."""
    import torch

    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    return order, torch.cumsum(counts, 0).to(torch.int32)


def swiglu(y):
    import torch

    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def torch_layer0(x, w0, order, offs, k):
    import torch

    rows = x.index_select(0, order // k)
    return torch._grouped_mm(rows, w0.transpose(1, 2), offs=offs)


def torch_layer(x, w0, w1, weights, order, offs, k):
    import torch

    y = torch_layer0(x, w0, order, offs, k)
    o = torch._grouped_mm(swiglu(y), w1.transpose(1, 2), offs=offs)
    o = o.float() * weights.reshape(-1)[order, None]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, o)
    return out.to(x.dtype)


def launch_text(dev, layer: int, shape: dict, T: int, dname: str, blocks: int,
                n_comm=None, tile=None) -> tuple[str, int]:
    """(what the ops will launch, GEMM blocks): n_comm, tile, band, raster group and the
    config's source, as comet.layers.ops.launch_choice decides them for this call."""
    from comet.layers import ops
    from comet.tune import perfmodel as pm
    from comet.tune import tuner as tn

    H, F, E, k = shape["H"], shape["F"], shape["E"], shape["k"]
    N = 2 * F if layer == 0 else F
    n, _ng, tm, tn_, source, band = ops.launch_choice(
        dev.type, dev.index, layer, 1, E, k, H, N, tn.token_bucket(T), dname, n_comm, tile)
    gemm_blocks = blocks if n == 0 else blocks - n
    env = os.environ.get("COMET_RASTER_GROUP", "")
    group = int(env) if env.isdigit() and int(env) > 0 else pm.raster_group(gemm_blocks)
    band_txt = f" band={band}" if layer == 1 else ""
    return (f"n_comm={n}{' (staged)' if n == 0 else ''} tile={tm}x{tn_}{band_txt} "
            f"group={group} [{source}]", gemm_blocks)


def run_shape(name: str, shape: dict, T: int, cfg: dict, dev, blocks: int) -> list[dict]:
    import torch

    import comet

    dtype = C.DTYPES[cfg["dtype"]]
    x, w0, w1, ids, weights = make_problem(shape, T, dtype, dev)
    H, F, E, k = shape["H"], shape["F"], shape["E"], shape["k"]
    M = T * k
    order, offs = dispatch(ids, E)
    eb = x.element_size()
    f0, f1 = 2.0 * M * 2 * F * H, 2.0 * M * H * F
    w0_bytes, w1_bytes = E * 2 * F * H * eb, E * H * F * eb
    label = f"{shape['title']} T={T}"

    def comet_layer0(**kw):
        return comet.moe_layer0(x, w0, ids, num_experts=E, **kw)

    def comet_layer(**kw):
        y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E, **kw)
        return comet.moe_layer1(swiglu(y0), w1, weights, layout, **kw)

    # -- correctness first --------------------------------------------------------------------
    C.progress(f"{label}: H={H} F={F} E={E} k={k} {cfg['dtype']}: checking comet against torch")
    want = torch_layer(x, w0, w1, weights, order, offs, k).float()
    got = comet_layer().float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    y_want = torch_layer0(x, w0, order, offs, k).float()
    y_got, _ = comet_layer0()
    err0 = float((y_got.float() - y_want).norm() / y_want.norm().clamp_min(1e-30))
    tol = TOL[cfg["dtype"]]
    if not (err < tol and err0 < tol):
        raise SystemExit(f"{label}: comet disagrees with torch (relative L2 error layer0 {err0:.2e}, "
                         f"layer {err:.2e}, bound {tol:g}); nothing timed")

    rows = []
    dname = cfg["dtype_name"]
    cfg0, g0 = launch_text(dev, 0, shape, T, dname, blocks)
    cfg1, g1 = launch_text(dev, 1, shape, T, dname, blocks)

    def add(method, fn, flops, wbytes, config="", gemm_blocks=None):
        C.progress(f"{label}: timing {method}")
        s = time_fn(fn, dev, cfg["warmup"], cfg["iters"])
        rows.append(dict(model=name, tokens=T, method=method, ms=s * 1e3,
                         tflops=flops / s / 1e12, weight_gbs=wbytes / s / 1e9, config=config,
                         gemm_blocks=gemm_blocks))

    add("comet layer0", comet_layer0, f0, w0_bytes, cfg0, g0)
    add("torch layer0", lambda: torch_layer0(x, w0, order, offs, k), f0, w0_bytes,
        gemm_blocks=blocks)
    rows_x = x.index_select(0, order // k)
    dense_w = w0.reshape(-1, H)[: 2 * F].t().contiguous()
    add("dense layer0", lambda: rows_x @ dense_w, f0, 2 * F * H * eb, gemm_blocks=blocks)
    add("comet layer", comet_layer, f0 + f1, w0_bytes + w1_bytes, f"{cfg0}; {cfg1}")
    add("unfused layer", lambda: torch_layer(x, w0, w1, weights, order, offs, k), f0 + f1,
        w0_bytes + w1_bytes)
    if dev.type == "cuda":  # the CUDA buffer's bench mode: the GEMM blocks alone
        from comet.layers import ops

        y0, layout = comet_layer0()
        h = swiglu(y0)
        with ops.layer1_buffer(None, None, h, layout).bench_mode("gemm"):
            add("comet layer1 GEMM", lambda: comet.moe_layer1(h, w1, weights, layout), f1,
                w1_bytes, cfg1, g1)
    if cfg["variants"]:
        old = os.environ.get("COMET_RASTER_GROUP")
        os.environ["COMET_RASTER_GROUP"] = "1"
        try:
            c0, _ = launch_text(dev, 0, shape, T, dname, blocks)
            add("comet layer0 [raster 1]", comet_layer0, f0, w0_bytes, c0, g0)
            add("comet layer [raster 1]", comet_layer, f0 + f1, w0_bytes + w1_bytes, c0)
        finally:
            if old is None:
                os.environ.pop("COMET_RASTER_GROUP", None)
            else:
                os.environ["COMET_RASTER_GROUP"] = old
        nc = min(4, blocks - 1)
        tile = (128, 128) if dev.type == "cuda" else None
        c0, gf = launch_text(dev, 0, shape, T, dname, blocks, nc, tile)
        add(f"comet layer0 [n_comm {nc}]", lambda: comet_layer0(n_comm=nc, tile=tile), f0,
            w0_bytes, c0, gf)
        add(f"comet layer [n_comm {nc}]", lambda: comet_layer(n_comm=nc, tile=tile), f0 + f1,
            w0_bytes + w1_bytes, c0)
    torch_rate = rows[1]["tflops"] / blocks
    for r in rows:
        r.update(err_layer0=err0, err_layer=err)
        if r["method"].startswith("comet") and r["gemm_blocks"]:
            r["per_sm_vs_torch"] = r["tflops"] / r["gemm_blocks"] / torch_rate
    return rows


def main(argv=None) -> int:
    p = C.arg_parser("bench/kernels.py", __doc__)
    C.add_output_args(p, "kernels", "CPU: one scaled shape at 64 and 8 tokens, 1 + 3 calls")
    p.add_argument("--models", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--tokens", default="4096,32", help="comma-separated token counts")
    p.add_argument("--scale", type=int, default=None,
                   help="divide H and F by this (default 1 on a GPU, 32 on the CPU)")
    p.add_argument("--dtype", default=None, choices=sorted(C.DTYPES),
                   help="default bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5; smoke 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 20; smoke 3)")
    p.add_argument("--variants", action="store_true",
                   help="also raster group 1 and a fused split (n_comm 4), for comparison")
    a = p.parse_args(argv)

    import torch

    from comet.tune import perfmodel as pm

    dev = torch.device("cuda", torch.cuda.current_device()) if C.on_gpu() else torch.device("cpu")
    gpu = dev.type == "cuda"
    dtype = a.dtype or ("bf16" if gpu else "fp32")
    scale = a.scale or (1 if gpu else 32)
    models = [m for m in a.models.split(",") if m]
    tokens = [int(t) for t in a.tokens.split(",") if t]
    if a.smoke:
        models, tokens, scale = models[:1], [64, 8], max(scale, 32 if not gpu else 1)
    for m in models:
        if m not in SHAPES:
            raise SystemExit(f"unknown model {m!r}: one of {', '.join(SHAPES)}")
    if gpu:
        blocks = torch.cuda.get_device_properties(dev).multi_processor_count
    else:
        env = os.environ.get("COMET_CPU_BLOCKS", "")
        blocks = int(env) if env.isdigit() and int(env) >= 2 else max(2, os.cpu_count() or 2)
    cfg = dict(dtype=dtype, dtype_name=str(C.DTYPES[dtype]).replace("torch.", ""),
               warmup=a.warmup if a.warmup is not None else (1 if a.smoke else 5),
               iters=a.iters if a.iters is not None else (3 if a.smoke else 20),
               variants=a.variants)
    records = []
    for m in models:
        shape = dict(SHAPES[m])
        shape["H"], shape["F"] = max(16, shape["H"] // scale), max(8, shape["F"] // scale)
        for T in tokens:
            records += run_shape(m, shape, T, cfg, dev, blocks)

    head = ["model", "T", "method", "ms", "TFLOP/s", "weight GB/s", "per SM", "config"]
    body = [[r["model"], str(r["tokens"]), r["method"], f"{r['ms']:.3g}", f"{r['tflops']:.3g}",
             f"{r['weight_gbs']:.3g}",
             f"{r['per_sm_vs_torch']:.2f}" if "per_sm_vs_torch" in r else "",
             r["config"]] for r in records]
    where = (f"{torch.cuda.get_device_name(dev)}, {blocks} SMs" if gpu else
             f"CPU backend, {blocks} blocks (threads) per rank: not GPU figures")
    print(f"bench/kernels.py: world of one, {dtype}, scale 1/{scale}, {where}, torch "
          f"{torch.__version__}")
    print(C.table(head, body))
    spec = pm.spec_from_device_name(torch.cuda.get_device_name(dev)) if gpu else None
    out = C.write_json(C.result_name("kernels", a.smoke),
                       dict(environment=C.environment(dev.type), dtype=dtype, scale=scale,
                            blocks=blocks, model_spec=spec, records=records),
                       Path(a.out) if a.out else None)
    C.progress(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
