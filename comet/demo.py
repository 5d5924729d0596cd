"""The main job: a Mixtral-shaped MoE layer (scaled down to fit a CPU) on W ranks through
torch.ops.comet.moe_layer0 -> SwiGLU -> moe_layer1, checked against the pure-torch reference
(torch.distributed all-to-all form), with the error and time per layer printed.

    python -m comet.demo [--world 4] [--tokens 256] [--scale 16] [--dtype bf16] [--iters 3]

Without a GPU it runs the CPU backend: W processes joined by torch.distributed (gloo on
127.0.0.1), tokens exchanged through comet's shared-memory symmetric heap.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

MIXTRAL = dict(hidden=4096, ffn=14336, experts=8, topk=2)  # the Mixtral-8x7B shape of docs/peers.md
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def log(rank, msg):
    if rank == 0:
        print(f"[comet.demo] {msg}", file=sys.stderr, flush=True)


def sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def _rank_main(rank, world, port, args, queue):
    try:
        queue.put((rank, _run(rank, world, port, args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback
        queue.put((rank, {"error": f"{e!r}\n{traceback.format_exc()}"}))


def _run(rank, world, port, args):
    import torch.distributed as dist

    import comet
    from comet import reference as ref

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    dtype = DTYPES[args.dtype]
    H = MIXTRAL["hidden"] // args.scale
    F = MIXTRAL["ffn"] // args.scale
    E, k = MIXTRAL["experts"], MIXTRAL["topk"]
    el = E // world  # validate_args checked that world divides E
    g = torch.Generator().manual_seed(1234 + rank)
    T = args.tokens + (rank * 17) % 31  # uneven token counts, as a real batch would have
    x = torch.randn(T, H, generator=g).to(dtype)
    router = torch.randn(H, E, generator=g) / H ** 0.5
    topk_weights, topk_ids = ref.route(x.float() @ router, k, renormalize=True)
    w0 = (torch.randn(el, 2 * F, H, generator=g) / H ** 0.5).to(dtype)   # gated: [gate; up]
    w1 = (torch.randn(el, H, F, generator=g) / F ** 0.5).to(dtype)
    log(rank, f"{world} ranks, H={H} ffn={F} (Mixtral / {args.scale}), E={E}, topk={k}, "
              f"~{args.tokens} tokens/rank, {args.dtype}")

    # On GPUs (one per rank; untested here: no GPU) the comet ops run on CUDA tensors and the
    # reference stays on the CPU copies.
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # validate_args checked one GPU per rank
    dev = torch.device("cuda" if cuda else "cpu")
    xd, w0d, w1d, idsd = (t.to(dev) for t in (x, w0, w1, topk_ids))
    wd = topk_weights.to(dev)
    buf = None if cuda else comet.buffer_for()
    times0, times1 = [], []
    for it in range(args.iters + 1):  # the first iteration warms up (buffer growth, page faults)
        dist.barrier()
        t0 = time.perf_counter()
        y0, layout = comet.moe_layer0(xd, w0d, idsd, num_experts=E, buffer=buf)
        sync(cuda)
        t1 = time.perf_counter()
        h = ref.swiglu(y0)
        sync(cuda)
        t2 = time.perf_counter()
        out = comet.moe_layer1(h, w1d, wd, layout, buffer=buf)
        sync(cuda)
        t3 = time.perf_counter()
        if it:
            times0.append(t1 - t0)
            times1.append(t3 - t2)
        log(rank, f"iteration {it}/{args.iters}{' (warm-up)' if it == 0 else ''}: "
                  f"layer0 {1e3 * (t1 - t0):.1f} ms, layer1 {1e3 * (t3 - t2):.1f} ms")

    y0, h, out = y0.cpu(), h.cpu(), out.cpu()
    log(rank, "checking against the reference (torch.distributed all_to_all_single)")
    y0_ref = ref.layer0_dist(x, w0, topk_ids, E)
    out_ref = ref.layer1_dist(h, w1, topk_weights, topk_ids, E)
    moe_ref = ref.moe_dist(x, w0, w1, topk_ids, topk_weights, E)
    err = lambda a, b: float((a.float() - b.float()).abs().max()) if a.numel() else 0.0  # noqa: E731
    tol = TOL[dtype]
    close = all(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
                for a, b in ((y0, y0_ref), (out, out_ref), (out, moe_ref)))
    largest = lambda t: float(t.float().abs().max()) if t.numel() else 0.0  # noqa: E731
    return dict(tokens=T, close=close, rows=int(y0.shape[0]), err_layer0=err(y0, y0_ref),
                err_layer1=err(out, out_ref), err_moe=err(out, moe_ref),
                ms_layer0=1e3 * statistics.median(times0), ms_layer1=1e3 * statistics.median(times1),
                scale=largest(out_ref), ref_max=max(map(largest, (y0_ref, out_ref, moe_ref))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m comet.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4,
                   help=f"ranks W, one process each; must divide Mixtral's {MIXTRAL['experts']} "
                        f"experts (1, 2, 4 or 8; default 4)")
    p.add_argument("--tokens", type=int, default=256,
                   help="tokens per rank, uneven around this (rank r adds (17 r) mod 31; "
                        "default 256)")
    p.add_argument("--scale", type=int, default=16,
                   help="divide Mixtral's hidden size 4096 and ffn 14336 by this; must divide 2048 "
                        "(default 16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="element type of x, w0, w1 (default bf16; the CUDA kernels take bf16/fp16)")
    p.add_argument("--iters", type=int, default=3,
                   help="timed iterations after one warm-up; the median is printed (default 3)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when a GPU and comet's CUDA kernels are there (one GPU per "
                        "rank; not run in this project's CI), else the CPU backend")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds for the whole run before the ranks are stopped (default 600)")
    p.add_argument("--json", metavar="PATH", help="also write the arguments and results here")
    return p


def validate_args(p: argparse.ArgumentParser, args) -> None:
    """Every user mistake is refused here, before any process spawns: p.error prints the usage and
    one line and exits with status 2 (no traceback)."""
    E, hidden, ffn = MIXTRAL["experts"], MIXTRAL["hidden"], MIXTRAL["ffn"]
    if args.world < 1 or E % args.world:
        p.error(f"--world {args.world}: the ranks must divide Mixtral's {E} experts evenly "
                f"(choose 1, 2, 4 or 8)")
    if args.tokens < 0:
        p.error(f"--tokens {args.tokens}: must be >= 0")
    if args.scale < 1 or hidden % args.scale or ffn % args.scale:
        p.error(f"--scale {args.scale}: must divide both the hidden size {hidden} and the ffn "
                f"size {ffn} (a divisor of 2048)")
    if args.iters < 1:
        p.error(f"--iters {args.iters}: must be >= 1")
    if not args.timeout > 0:
        p.error(f"--timeout {args.timeout}: must be > 0")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            p.error(f"--json {args.json}: no directory {folder}")
    from comet.buffers import symm_cuda

    if args.device == "auto":
        args.device = "cuda" if symm_cuda.available() and args.dtype != "fp32" else "cpu"
    elif args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: no GPU is visible to torch (torch.cuda.is_available() is "
                    "False); use --device cpu (the CPU backend)")
        if not symm_cuda.available():
            p.error("--device cuda: this build of comet has no CUDA kernels (rebuild with nvcc "
                    "and COMET_CUDA unset); use --device cpu")
        if torch.cuda.device_count() < args.world:
            p.error(f"--device cuda --world {args.world}: one GPU per rank, but only "
                    f"{torch.cuda.device_count()} visible")
        if args.dtype == "fp32":
            p.error("--device cuda --dtype fp32: the CUDA kernels take bf16 or fp16")


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    validate_args(p, args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args, queue), daemon=True)
             for r in range(args.world)]
    for pr in procs:
        pr.start()
    results, deadline = {}, time.monotonic() + args.timeout
    try:
        while len(results) < args.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SystemExit(f"comet.demo: timed out after {args.timeout} s")
            try:
                rank, res = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"comet.demo: rank(s) {dead} died") from None
                continue
            if "error" in res:
                raise SystemExit(f"comet.demo: rank {rank} failed:\n{res['error']}")
            results[rank] = res
    finally:
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()

    tol = TOL[DTYPES[args.dtype]]
    backend = ("CUDA kernels" if args.device == "cuda" else
               "CPU backend" + ("" if torch.cuda.is_available() else " (no GPU here)"))
    print(f"comet.demo: Mixtral-8x7B layer / {args.scale}, {args.world} ranks, {args.dtype}, {backend}")
    print(f"{'rank':>4} {'tokens':>6} {'rows':>5} {'layer0 ms':>10} {'layer1 ms':>10} "
          f"{'err layer0':>11} {'err layer1':>11} {'err moe':>10}")
    for r in range(args.world):
        d = results[r]
        print(f"{r:>4} {d['tokens']:>6} {d['rows']:>5} {d['ms_layer0']:>10.1f} {d['ms_layer1']:>10.1f} "
              f"{d['err_layer0']:>11.2e} {d['err_layer1']:>11.2e} {d['err_moe']:>10.2e}")
    worst = max(max(d["err_layer0"], d["err_layer1"], d["err_moe"]) for d in results.values())
    ref_max = max(d["ref_max"] for d in results.values())
    ok = all(d["close"] for d in results.values())
    # Every element is checked against atol + rtol * |its reference value|, so an error column is
    # at most atol + rtol * max |reference| (tools/doc_figures.py checks README's sample so).
    print(f"max abs error {worst:.3e}, max |reference| {ref_max:.3g}; within atol=rtol={tol:g} for "
          f"{args.dtype} on every rank: {'OK' if ok else 'FAILED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results, max_error=worst, ok=ok), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
