"""Decode-sized calls (1-256 tokens per rank): latency per MoE layer call, Comet's fused ops beside
the unfused torch chain, in one run.

    .venv/bin/python -m bench.decode             # CPU analog: 4 ranks, T in {1, 2, 4, ..., 256}
    .venv/bin/python -m bench.decode --smoke     # CI-sized: T in {1, 8, 32}
    torchrun --nproc-per-node 8 bench/decode.py --world 8 --scale 1 --dtype bf16
                                                 # GPU (untested: no GPU where this was written)

Shape: a DeepSeek-V3-like layer (top-8, gated FFN), E = 32 experts with H and ffn divided by
--scale (default 56 and 32: H = 128, ffn = 64) on the CPU; --scale 1 --experts 256 is the full
layer (H = 7168, ffn = 2048). Every rank holds T tokens.

Per call, both forms compute one MoE layer forward:
* comet: ``comet.moe_layer0(..., max_rows=R)`` -> SwiGLU -> ``comet.moe_layer1``, R the bound
  W * T * min(k, E / W) on the rows any rank can receive, fixed per T (what a decode step passes
  so that the call needs no host synchronisation and can be captured in a CUDA graph);
* torch: the unfused chain (all_to_all of the counts, all_to_all of the rows, one matmul per
  local expert, SwiGLU, one matmul per local expert, all_to_all back, weighted top-k sum).
Both are checked against each other on every rank before anything is timed (fp32: 1e-4; bf16:
3e-2). Timing as the other benchmarks (bench/common.py): warm-up rounds, then rounds of one call
of each form after a barrier; a call's time is its slowest rank's; the median is shown.

Output: a table on stdout, <out>/decode.json (decode_smoke.json with --smoke; --out, default
./bench-results). On the CPU this measures comet's CPU backend (OS threads as blocks, POSIX
shared memory, a portable tile GEMM) against torch + gloo: not a GPU result. The cost model's
view of the full-size layer on H800s is `python -m comet.tune --table decode`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `python bench/<name>.py`

from bench import common as C  # noqa: E402

# DeepSeek-V3's MoE layer (hidden, expert ffn, top-k); E defaults to 32 so that 4 ranks hold 8.
FULL_H, FULL_FFN, TOPK = 7168, 2048, 8
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SMOKE_TOKENS = (1, 8, 32)


def max_rows_bound(world: int, tokens: int, k: int, experts_local: int) -> int:
    """Rows any rank can receive: every token of every rank, each with at most min(k, E_local)
    of its distinct experts on that rank (at least 1, so an empty step keeps a valid bound)."""
    return max(1, world * tokens * min(k, experts_local))


def _body(rank: int, world: int, cfg: dict):
    import torch
    import torch.distributed as dist

    from bench import baselines as B
    from comet import reference as ref

    import comet
    from comet.layers import ops as O

    dev = C.device()
    dtype = C.DTYPES[cfg["dtype"]]
    shape = dict(E=cfg["experts"], k=TOPK, H=cfg["H"], N0=2 * cfg["ffn"], N1=cfg["ffn"])
    El = shape["E"] // world
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    records = []
    for T in cfg["tokens"]:
        label = f"W={world} T={T}"
        inp = B.make_inputs(rank, world, shape, T, dtype, dev, seed=cfg["seed"])
        R = max_rows_bound(world, T, TOPK, El)

        def fused(inp=inp, R=R):
            y0, layout = comet.moe_layer0(inp["x"], inp["w0"], inp["ids"], num_experts=inp["E"],
                                          max_rows=R)
            return comet.moe_layer1(ref.swiglu(y0), inp["w1"], inp["weights"], layout)

        def unfused(inp=inp):
            return B.sequential(inp, world)

        got, want = fused(), unfused()
        torch.testing.assert_close(got.float(), want.float(), **tol,
                                   msg=lambda m, label=label: f"rank {rank}, {label}: comet vs "
                                                              f"torch: {m}")
        err = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
        # the launch each layer ran with (the tuner's: on CUDA the 64-row tile at decode sizes)
        h_like = torch.empty(R, shape["N1"], dtype=dtype, device=dev)
        cfgs = [O.launch_config(dev, None, None, layer=layer, world=world, num_experts=inp["E"],
                                x=x, w=w, topk_ids=inp["ids"])
                for layer, x, w in ((0, inp["x"], inp["w0"]), (1, h_like, inp["w1"]))]
        launch = {f"layer{i}": dict(n_comm=c[0], tile=[c[2], c[3]]) for i, c in enumerate(cfgs)}
        C.progress(f"{label}: timing ({cfg['warmup']} + {cfg['iters']} rounds)")
        t = C.measure({"comet": fused, "torch": unfused}, dev, cfg["warmup"], cfg["iters"],
                      label=label)
        rows = torch.tensor([float(inp["ids"].numel())], device=dev)
        dist.all_reduce(rows)
        records.append(dict(tokens=T, max_rows=R, slots_all_ranks=int(rows.item()),
                            times_s=t, median_us={k: v["median"] * 1e6 for k, v in t.items()},
                            max_abs_err=err, launch=launch))
        dist.barrier()
    return records if rank == 0 else None


def render(records, backend: str) -> str:
    body = [[str(r["tokens"]), str(r["max_rows"]),
             " / ".join("x".join(map(str, r["launch"][f"layer{i}"]["tile"])) for i in (0, 1)),
             f"{r['median_us']['comet']:.0f}",
             f"{r['median_us']['torch']:.0f}",
             f"{r['median_us']['torch'] / r['median_us']['comet']:.2f}x", f"{r['max_abs_err']:.1e}"]
            for r in records]
    return C.table(["tokens/rank", "max_rows", "tile layer0 / layer1", "comet us",
                    "torch chain us", "torch / comet", "max err"], body)


def parse(argv=None):
    p = C.arg_parser("python -m bench.decode", __doc__)
    C.add_output_args(p, "decode", f"T in {set(SMOKE_TOKENS)}, 4 ranks")
    p.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--tokens", default=None,
                   help=f"comma-separated tokens per rank (default {','.join(map(str, TOKENS))})")
    p.add_argument("--experts", type=int, default=32, help="experts E (default 32)")
    p.add_argument("--scale", type=int, default=None,
                   help="divide H by 56 and ffn by 32 on the CPU (default); 1 = full size")
    p.add_argument("--dtype", default=None, choices=sorted(C.DTYPES),
                   help="default fp32 on the CPU, bf16 on a GPU")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 2; smoke 1)")
    p.add_argument("--iters", type=int, default=None, help="timed rounds (default 10; smoke 3)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    backend = "cuda" if C.on_gpu() else "cpu"
    if a.world < 1 or a.experts % a.world:
        raise SystemExit(f"--world {a.world} must be >= 1 and divide --experts {a.experts}")
    if a.tokens is not None:
        tokens = tuple(int(t) for t in a.tokens.split(","))
    else:
        tokens = SMOKE_TOKENS if a.smoke else TOKENS
    if any(t < 0 for t in tokens):
        raise SystemExit(f"--tokens must be >= 0, got {tokens}")
    if a.scale is None:
        H, ffn = (FULL_H // 56, FULL_FFN // 32) if backend == "cpu" else (FULL_H, FULL_FFN)
    else:
        H, ffn = max(8, FULL_H // a.scale), max(4, FULL_FFN // a.scale)
    cfg = dict(tokens=tokens, experts=a.experts, H=H, ffn=ffn, seed=a.seed,
               dtype=a.dtype or ("fp32" if backend == "cpu" else "bf16"),
               warmup=a.warmup if a.warmup is not None else (1 if a.smoke else 2),
               iters=a.iters if a.iters is not None else (3 if a.smoke else 10))
    t0 = time.monotonic()
    records = [r for r in C.launch(_body, a.world, cfg) if r is not None][0]
    label = C.CPU_LABEL if backend == "cpu" else "GPU: comet's CUDA kernels vs torch + NCCL"
    if C.is_main_process():
        print(f"decode: W={a.world} E={a.experts} top-{TOPK} H={H} ffn={ffn} {cfg['dtype']}; "
              f"{label}")
        print(render(records, backend))
        path = C.write_json(C.result_name("decode", a.smoke),
                            dict(environment=C.environment(backend), label=label, smoke=a.smoke,
                                 config=cfg, world=a.world, results=records,
                                 seconds=time.monotonic() - t0),
                            None if a.out is None else Path(a.out))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
