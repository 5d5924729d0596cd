"""Command line front end of the autotuner.

    python -m comet.tune --model mixtral --world 8 [--tokens 4096] [--dtype bf16] [--gpu h800]
    python -m comet.tune --model qwen2 --world 16 --ranks-per-node 8 --gpu h800 [--flat] [--node-reduce]
    python -m comet.tune --model custom ... --world 8 --tp 4 [--dtype fp8]   # EP2 x TP4, FP8
    python -m comet.tune --table tp|fp8|dedup|decode   # the TP, FP8, dispatch and decode tables (markdown)

It always prints, for both fused layers, the cost model's split and predicted times (clearly
labelled: model, not measured), with the communication split into its NVLink (intra-node) and
NIC (inter-node) parts when the group spans several nodes.  On a GPU (or with ``--profile`` on the CPU backend) inside a
torch.distributed job of ``--world`` ranks (e.g. ``torchrun --nproc-per-node 8 -m comet.tune ...``;
a single rank needs no launcher) it then profiles candidate configs through the hooks in
``comet.tune.tuner.PROFILERS`` (filled in by the compiled ops), stores the winners in the tuning cache
and prints them; without those hooks it says that profiling needs the compiled ops.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from . import perfmodel as pm
from . import tuner as tn
from .presets import MODEL_ALIASES, MODELS, layer_dims, text_table


def _parse_tile(s: str) -> Tuple[int, int]:
    try:
        m, n = s.lower().split("x")
        return int(m), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tile must look like 128x128, got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m comet.tune",
        description="Choose the comm/GEMM block split of Comet's fused MoE layers: profile on a "
                    "GPU, or show the cost model's choice without one.")
    p.add_argument("--model", default=None,
                   help=f"model preset: {', '.join(MODELS)} (or 'custom' with --hidden/--ffn/"
                        f"--experts/--topk); required unless --table")
    p.add_argument("--world", type=int, default=None,
                   help="ranks W of the group (EP x TP); required unless --table")
    p.add_argument("--tp", type=int, default=1,
                   help="expert tensor-parallel size t (default 1): W / t EP ranks, each expert's "
                        "ffn split over t ranks; must divide --world, the ranks per node and ffn")
    p.add_argument("--table", choices=sorted(TABLES),
                   help="print one of docs/tuning.md's model tables (markdown) and exit: tp "
                        "(flux's four EP x TP configurations on 8 x H100), fp8 (the paper's three "
                        "shapes in FP8 beside bf16 on 8 x H800), decode (a DeepSeek-V3-shaped "
                        "layer at 1-256 tokens per rank on 8 and 16 x H800)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (default: --world, one node); must divide --world")
    p.add_argument("--flat", action="store_true",
                   help="model the flat all-to-all across nodes (every (token, slot) row over the "
                        "NIC) instead of node-first dispatch")
    p.add_argument("--node-reduce", action="store_true",
                   help="model layer1's node-reduced combine (Buffer(node_reduce=True)): one "
                        "partial row per (token, node) over the NIC, sent by the relays after the "
                        "fused kernel")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank T (default 4096)")
    p.add_argument("--dtype", default="bf16",
                   help="bf16 (default), fp16, fp32 or fp8 (FP8 operands with 1x128 / 128x128 "
                        "scales, bf16 output)")
    p.add_argument("--gpu", default=None,
                   help=f"GPU to model: {', '.join(pm.GPUS)}, cpu, or 'all' (default: the local "
                        f"GPU, else h800)")
    p.add_argument("--sm-count", type=int, default=None, help="override the SM count")
    p.add_argument("--max-blocks", type=int, default=None,
                   help="co-residency bound on the whole grid (comm + GEMM blocks)")
    p.add_argument("--tile", type=_parse_tile, default=pm.DEFAULT_TILE,
                   help="GEMM tile MxN for the model (default 128x128)")
    p.add_argument("--hidden", type=int, default=None, help="override H")
    p.add_argument("--ffn", type=int, default=None, help="override the per-expert FFN size")
    p.add_argument("--experts", type=int, default=None, help="override E")
    p.add_argument("--topk", type=int, default=None, help="override k")
    p.add_argument("--not-gated", action="store_true", help="N0 = ffn instead of 2 * ffn")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--profile", dest="profile", action="store_true", default=None,
                   help="measure candidate configs on the real ops and store the winners (default "
                        "on a GPU; on the CPU backend only when given). Progress, the number of "
                        "candidates and an estimate of the time left go to stderr")
    g.add_argument("--no-profile", dest="profile", action="store_false",
                   help="cost model only")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls per candidate when profiling (default 2)")
    p.add_argument("--iters", type=int, default=5,
                   help="timed calls per candidate; the median counts (default 5)")
    p.add_argument("--skew", default=None, metavar="zipf:S",
                   help="also price skewed routing (Zipf over experts with exponent S, e.g. "
                        "zipf:1.2): the slowest rank with the contiguous map, balance and "
                        "lysi_assign (comet.plan; cost model only)")
    p.add_argument("--spare-slots", type=int, default=1,
                   help="with --skew: expert slots per rank beyond E/W for the planners "
                        "(default 1)")
    p.add_argument("--cache-dir", default=None,
                   help=f"tuning cache directory (default ${tn.CACHE_ENV} or ~/.cache/comet)")
    return p


def resolve_model(args) -> Dict[str, object]:
    name = MODEL_ALIASES.get(args.model.lower(), args.model.lower())
    if name == "custom":
        model: Dict[str, object] = dict(H=None, ffn=None, E=None, k=None, gated=True, title="custom")
    elif name in MODELS:
        model = dict(MODELS[name])
    else:
        raise SystemExit(f"unknown --model {args.model!r}; choose from {', '.join(MODELS)} or custom")
    for opt, field in (("hidden", "H"), ("ffn", "ffn"), ("experts", "E"), ("topk", "k")):
        v = getattr(args, opt)
        if v is not None:
            model[field] = v
    if args.not_gated:
        model["gated"] = False
    missing = [f for f in ("H", "ffn", "E", "k") if model[f] is None]
    if missing:
        raise SystemExit(f"--model custom needs --hidden, --ffn, --experts and --topk "
                         f"(missing {missing})")
    model["name"] = name
    return model


def _launch_rank() -> int:
    """This process's rank under torchrun (its RANK variable), before any process group exists:
    only rank 0 prints, so W ranks print one table, not W."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _quiet(*_args, **_kwargs) -> None:
    pass


# The CPU backend's portable fixed-order tile GEMM, per GEMM thread, as measured by bench/moe_layer
# ("Comet W=1") on the 2-core development machine: 10-12 GFLOP/s. Only a rough estimate of how long
# profiling takes; other CPUs differ (the tuner re-estimates from the first measured call).
CPU_TILE_GEMM_FLOPS = 10e9


def call_estimate(key: tn.TuneKey, shape: pm.MoEShape, max_blocks: Optional[int] = None) -> float:
    """Rough seconds of one profiled op call: the cost model's fused time on a GPU; on the CPU the
    GEMM's FLOPs per rank at CPU_TILE_GEMM_FLOPS per GEMM thread (the cost model's CPU pseudo-spec
    counts torch's matmul, several times faster than the CPU backend's tile GEMM)."""
    spec = pm.get_spec(key.arch, key.sm_count)
    if key.arch != "cpu" and spec is not None:
        n = pm.choose_n_comm(shape, spec, key.layer, max_blocks=max_blocks)
        return pm.predict(shape, spec, n, key.layer, n_blocks=max_blocks)["fused"]
    n_out, k_red = pm.gemm_dims(shape, key.layer)
    flops = 2.0 * sum(pm.expert_rows(shape)) * n_out * k_red
    threads = max(1, min(key.sm_count - 1, (os.cpu_count() or 1) // max(1, key.W)))
    return flops / (CPU_TILE_GEMM_FLOPS * threads)


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}"


def model_table(model, spec: pm.GpuSpec, world: int, tokens: int, dtype: str,
                max_blocks: Optional[int], tile, tuner: Optional[tn.Tuner] = None,
                ranks_per_node: Optional[int] = None, node_first: bool = True,
                node_reduce: bool = False, tp_size: int = 1) -> str:
    """The cost model's choice and predicted times for both layers, as printable text."""
    n0, n1 = layer_dims(model)
    nbytes = pm.DTYPE_BYTES[dtype]
    t = int(tp_size)
    H, E, k = int(model["H"]), int(model["E"]), int(model["k"])
    rpn = world if ranks_per_node is None else int(ranks_per_node)
    rows: List[List[str]] = []
    notes: List[str] = []
    for layer, N in ((0, n0 // t), (1, n1 // t)):
        shape = pm.MoEShape(W=world, E=E, k=k, H=H, N=N, T=tokens, dtype_bytes=nbytes,
                            ranks_per_node=rpn, node_first=node_first, node_reduce=node_reduce,
                            tp_size=t)
        n = pm.choose_n_comm(shape, spec, layer, max_blocks=max_blocks, tile=tile)
        p = pm.predict(shape, spec, n, layer, tile, n_blocks=max_blocks)
        if t > 1:
            notes.append(_tp_note(shape, spec, layer, p["tp_path"]))
        m = sum(pm.expert_rows(shape))
        n_out, k_red = pm.gemm_dims(shape, layer)
        rows.append([
            f"layer{layer}", f"{m:.0f}x{n_out}x{k_red}", str(p["n_comm"]), str(p["n_gemm"]),
            f"{tile[0]}x{tile[1]}", f"{p['intra_rows']:.0f}", f"{p['inter_rows']:.0f}",
            _ms(p["intra"]), _ms(p["inter"]),
            _ms(p["comm"]), _ms(p["gemm"]), _ms(p["prologue"]),
            _ms(p["combine"]) if layer == 1 else "-", _ms(p["fused"]), _ms(p["baseline"]),
            _ms(p["limit"]),
            f"{p['baseline'] / p['fused']:.2f}x" if p["fused"] > 0 else "-",
            str(p["band"]) if layer == 1 else "-", f"{p['a_sweeps']:.0f}",
        ])
        if tuner is not None:
            key = tn.TuneKey(spec.name, spec.sm_count, dtype, world, E, k, H, N, tokens, layer, rpn,
                             node_reduce=node_reduce and layer == 1, tp_size=t)
            cached = tuner.cache.get(key)
            if cached is not None:
                cfg, k2 = cached
                band = f" band={cfg.band_n}" if layer == 1 else ""
                notes.append(f"  layer{layer}: tuning cache has n_comm={cfg.n_comm} tile="
                             f"{cfg.tile_m}x{cfg.tile_n}{band} (measured, bucket T<={k2.tokens})")
    d = pm.expected_distinct_ranks(world // t, E, k)
    nodes = world // rpn
    head = (f"Cost model, not measured -- {spec.name} ({spec.sm_count} SMs, "
            f"{spec.peak_flops(nbytes) / 1e12:.4g} TFLOP/s {dtype}, HBM {spec.hbm_gbs:.0f} GB/s, "
            f"{spec.link} {spec.link_gbs:.0f} GB/s per direction")
    if nodes > 1:
        head += f", NIC {spec.nic_gbs:g} GB/s per GPU per direction"
    if t > 1:
        head += (f")\n{model['title']}: W={world} = EP {world // t} x TP {t}, E={E} "
                 f"(E/EP={E // (world // t)}) k={k} H={H} N0={n0} N1={n1} (shards N0/{t}="
                 f"{n0 // t}, N1/{t}={n1 // t}) T={tokens} tokens/rank, {dtype}; expected distinct "
                 f"EP ranks per token {pm.expected_distinct_ranks(world // t, E, k):.2f}")
    else:
        head += (f")\n{model['title']}: W={world} E={E} (E/W={E // world}) k={k} H={H} N0={n0} "
                 f"N1={n1} T={tokens} tokens/rank, {dtype}; expected distinct ranks per token "
                 f"{d:.2f}")
    if dtype == "fp8":
        head += (f"\nFP8: {spec.peak_flops(1) / 1e12:.4g} TFLOP/s"
                 f"{'' if spec.fp8_tflops else ' (no FP8 tensor cores: the bf16 rate)'}; layer0 "
                 f"rows {H + pm.fp8_scale_bytes(H)} B on the links (H + 4 H/128 scale bytes), "
                 f"layer1 partials in bf16 ({2 * H} B)")
    if nodes > 1:
        dn = pm.expected_distinct_nodes(world, E, k, rpn)
        head += (f"\n{nodes} nodes x {rpn} ranks; "
                 f"{'node-first dispatch' if node_first else 'flat all-to-all (no node-first)'}; "
                 f"layer1 partials {'node-reduced' if node_reduce else 'per rank'}; "
                 f"expected distinct nodes per token {dn:.2f}")
    headers = ["layer", "GEMM MxNxK", "n_comm", "n_gemm", "tile", "NVLink rows", "NIC rows",
               "NVLink ms", "NIC ms", "comm ms", "gemm ms", "prologue ms", "combine ms",
               "fused ms", "unfused ms", "limit ms", "speedup", "band", "A sweeps"]
    foot = ("band: layer1's n-tiles per column band of its GEMM (the model's choice); A sweeps: how "
            "often the GEMM reads its A operand (layer0 a, layer1 h) from HBM, charged in gemm "
            f"({spec.l2_mb:g} MB L2). "
            "NVLink / NIC: rows this rank moves over each link (layer0 node-first: the NVLink rows "
            "include the reads of relays' mirrors) and each link's part alone with this split "
            "(comm overlaps them); comm/gemm: each part alone with this split (layer1's comm "
            "includes the combine kernel); prologue: the per-call planning kernels (estimate); "
            "fused: prologue + the pipelined kernel; unfused: comm then GEMM, each on the whole "
            "GPU, charged no prologue; limit: max of the two on the whole GPU. Comm rate per "
            f"block: {spec.block_link_bw / 1e9:.1f} GB/s ({spec.comm_threads} threads x "
            f"{pm.COPY_UNROLL} x 16 B in flight / {spec.remote_load_us:g} us, Little's law)")
    if nodes > 1:
        foot += (f", NIC {spec.block_nic_bw / 1e9:.1f} GB/s (the same bytes in flight / "
                 f"{2 * spec.nic_latency_us:g} us round trip)")
    foot += "."
    return "\n".join([head, text_table(headers, rows), foot, *notes])


def _profile(args, model, arch: str, sm_count: int, tuner: tn.Tuner, say=print) -> int:
    """Measure both layers through comet.tune.tuner.PROFILERS; returns an exit code. ``say`` prints
    (a no-op on ranks other than 0)."""
    missing = [f"layer{l}" for l in (0, 1) if f"layer{l}" not in tn.PROFILERS]
    if missing:
        try:  # the ops module registers the hooks when it is imported with its extension built
            import importlib

            importlib.import_module("comet.layers.ops")
        except Exception as e:  # noqa: BLE001
            say(f"profiling needs the compiled ops: importing comet.layers.ops failed ({e!r}); "
                f"showing the cost model only.")
            return 1
        missing = [f"layer{l}" for l in (0, 1) if f"layer{l}" not in tn.PROFILERS]
        if missing:
            say(f"profiling needs the compiled ops: no profiler registered for {missing} "
                f"in comet.tune.tuner.PROFILERS; showing the cost model only.")
            return 1
    import torch.distributed as dist

    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            dist.init_process_group("nccl" if _cuda_available() else "gloo")
        elif args.world != 1:
            say(f"profiling needs {args.world} ranks: launch with torchrun --nproc-per-node "
                f"{args.world} -m comet.tune ...; showing the cost model only.")
            return 1
    if dist.is_initialized() and dist.get_world_size() != args.world:
        say(f"--world {args.world} but the process group has {dist.get_world_size()} ranks")
        return 2
    n0, n1 = layer_dims(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for layer, N in ((0, n0 // args.tp), (1, n1 // args.tp)):
        key = tn.TuneKey(arch, sm_count, args.dtype, args.world, int(model["E"]), int(model["k"]),
                         int(model["H"]), N, args.tokens, layer, args.ranks_per_node,
                         node_reduce=args.node_reduce and layer == 1, tp_size=args.tp)
        shape = key.shape(args.tokens)
        cfg = tn.profile(key, shape=shape, tuner=tuner, max_blocks=args.max_blocks,
                         warmup=args.warmup, iters=args.iters,
                         estimate_call_s=call_estimate(key, shape, args.max_blocks))
        if rank == 0:
            band = f" band={cfg.band_n}" if layer == 1 else ""
            say(f"layer{layer}: measured best n_comm={cfg.n_comm} tile={cfg.tile_m}x{cfg.tile_n}"
                f"{band} (stored in {tuner.cache.path(arch)})")
    return 0


def _tp_note(shape: pm.MoEShape, spec: pm.GpuSpec, layer: int, path: str) -> str:
    """One line: the model's TP path for ``layer`` and both paths' rows per link."""
    alt = pm.tp_alternatives(shape, spec, layer)
    what = ("direct = a token once to each TP rank of each EP rank it hits; group = once per "
            "(token, EP rank), "
            "then an all-gather in the TP group" if layer == 0 else
            "direct = t partial rows home; group = reduce-scatter over H in the TP group, then H/t "
            "columns home")
    rows = "; ".join(f"{p}: NVLink {a['nvlink_rows']:.0f} NIC {a['nic_rows']:.0f} rows, comm "
                     f"alone {_ms(a['comm_full'])} ms" for p, a in alt.items())
    return f"  layer{layer} TP path (model's choice): {path} ({what}). {rows}"


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    """A markdown table; ``align`` one character per column: l (left) or r (right)."""
    sep = ["---" if a == "l" else "--:" for a in align]
    return "\n".join("| " + " | ".join(r) + " |" for r in [headers, sep, *rows])


# flux's four MoE configurations (bytedance/flux, docs/performance.md, "MoE MLP"): 8 x H100 over
# NVLink, M = 8192 tokens (1024 per GPU, sequence-parallel: its test_moe_ag.py all-gathers
# them over the world), K = 8192 hidden, N = 8192 ffn per expert (no gate: one weight), its
# default dtype bfloat16; its measured layer0 / layer1 ms on H100.
FLUX_CONFIGS = (  # (E, topk, TP, EP, flux layer0 ms, flux layer1 ms)
    (32, 4, 8, 1, 1.146, 1.863),
    (32, 4, 4, 2, 1.335, 1.685),
    (8, 2, 8, 1, 0.657, 1.019),
    (8, 2, 4, 2, 0.955, 0.981),
)
FLUX_WORLD, FLUX_TOKENS, FLUX_HIDDEN, FLUX_FFN = 8, 8192, 8192, 8192


def _best(shape: pm.MoEShape, spec: pm.GpuSpec, layer: int) -> Dict[str, object]:
    return pm.predict(shape, spec, pm.choose_n_comm(shape, spec, layer), layer)


def _per_slot_rows(shape: pm.MoEShape) -> float:
    """layer0's rows over the links if every slot's row crossed (one per (token, slot) per
    destination rank), the dispatch before it sent a token once per destination rank."""
    ep = shape.W // shape.tp_size
    return shape.T * shape.k * (shape.W - 1) / ep


def tp_table() -> str:
    """docs/tuning.md's expert-tensor-parallel table: for flux's four configurations, the model's
    layer0 / layer1 prediction for the path the kernels implement (a token once to each tp rank
    of each EP rank it reaches, t partial rows home), beside flux's published measurement, and
    the EP-only alternative (t = 1) on the same 8 ranks. layer0's NVLink rows are shown as they
    were with one row per slot and as built."""
    spec = pm.GPUS["h100"]
    T = FLUX_TOKENS // FLUX_WORLD
    rows = []
    for E, k, t, ep, f0, f1 in FLUX_CONFIGS:
        for layer, flux_ms in ((0, f0), (1, f1)):
            tp = pm.MoEShape(W=FLUX_WORLD, E=E, k=k, H=FLUX_HIDDEN, N=FLUX_FFN // t, T=T,
                             tp_size=t)
            ep_only = pm.MoEShape(W=FLUX_WORLD, E=E, k=k, H=FLUX_HIDDEN, N=FLUX_FFN, T=T)
            shape = dataclasses.replace(tp, tp_path=pm.BUILT_TP_PATH)
            built = _best(shape, spec, layer)
            q = _best(ep_only, spec, layer)
            nvlink = pm.tp_traffic(shape, layer).same_node
            before = f"{_per_slot_rows(shape):.0f} / " if layer == 0 else ""
            rows.append([f"E{E} top{k}", f"EP{ep} x TP{t}", f"layer{layer}",
                         f"{before}{nvlink:.0f}",
                         str(built["n_comm"]), _ms(built["comm"]), _ms(built["gemm"]),
                         _ms(built["fused"]), f"{flux_ms:.3f}", _ms(q["fused"])])
    return _md_table(["experts", "ranks", "layer", "NVLink rows (one per slot / built)", "n_comm",
                      "comm ms", "GEMM ms", "model fused ms", "flux measured ms",
                      "EP8 only, model ms"], rows, "llllrrrrrr")


# A DeepSeek-V3-shaped layer (E = 256, top-8, H = 7168, expert FFN 2048, gated) with 4096 tokens
# per rank on H800s, EP8 on one node and EP16 on two nodes of 8.
DEDUP_SHAPE = dict(E=256, k=8, H=7168, ffn=2048, T=4096, gpu="h800")
DEDUP_LAYOUTS = ((8, 8), (16, 8))


def dedup_table() -> str:
    """README's dispatch table: layer0's rows over the links with one row per (token, slot) and
    as built (one per (token, destination rank): d / k of them, d the expected distinct ranks
    per token), for the DeepSeek-V3-shaped layer."""
    c = DEDUP_SHAPE
    spec = pm.GPUS[c["gpu"]]
    rows = []
    for W, rpn in DEDUP_LAYOUTS:
        s = pm.MoEShape(W=W, E=c["E"], k=c["k"], H=c["H"], N=2 * c["ffn"], T=c["T"],
                        ranks_per_node=rpn, node_first=W > rpn)
        d = pm.expected_distinct_ranks(W, c["E"], c["k"])
        built = pm.remote_rows(s, 0)
        p = _best(s, spec, 0)
        nic = pm.internode_rows(s, 0)
        rows.append([f"E{c['E']} top{c['k']} H{c['H']}", f"EP{W} ({W // rpn} x {rpn})",
                     f"{_per_slot_rows(s):.0f}", f"{built:.0f}", f"{d:.2f}",
                     f"{built / _per_slot_rows(s):.3f}", f"{nic:.0f}", str(p["n_comm"]),
                     _ms(p["comm"]), _ms(p["gemm"]), _ms(p["fused"])])
    return _md_table(["shape", "ranks", "layer0 rows, one per slot", "layer0 rows, built", "d",
                      "built / per slot", "NIC rows (node-first)", "n_comm", "comm ms", "GEMM ms",
                      "model fused ms"], rows, "llrrrrrrrrr")


FP8_WORLD, FP8_TOKENS, FP8_GPU = 8, 4096, "h800"


def fp8_table() -> str:
    """docs/tuning.md's FP8 table: the paper's three shapes on 8 x H800 (4096 tokens per rank),
    the model's split, link bytes per row and fused / unfused / limit times, bf16 / fp8."""
    spec = pm.GPUS[FP8_GPU]
    rows = []
    for name in MODELS:
        m = MODELS[name]
        H, E, k = int(m["H"]), int(m["E"]), int(m["k"])
        for layer, N in zip((0, 1), layer_dims(m)):
            r = {}
            for dt in ("bf16", "fp8"):
                s = pm.MoEShape(W=FP8_WORLD, E=E, k=k, H=H, N=N, T=FP8_TOKENS,
                                dtype_bytes=pm.DTYPE_BYTES[dt])
                r[dt] = _best(s, spec, layer)
                r[dt]["row_bytes"] = pm.traffic_bytes(s, layer) / max(pm.remote_rows(s, layer), 1)
            pair = lambda key, f: f"{f(r['bf16'][key])} / {f(r['fp8'][key])}"  # noqa: E731
            rows.append([str(m["title"]), f"layer{layer}", pair("row_bytes", lambda x: f"{x:.0f}"),
                         pair("n_comm", str), pair("comm", _ms), pair("gemm", _ms),
                         pair("fused", _ms), pair("baseline", _ms), pair("limit", _ms)])
    return _md_table(["model", "layer", "link bytes per row", "n_comm", "comm ms", "GEMM ms",
                      "fused ms", "unfused ms", "limit ms"], rows, "llrrrrrrr")


def decode_table() -> str:
    """The decode table (docs/tuning.md, "Decode"): a DeepSeek-V3-shaped MoE layer (layer0,
    activation, layer1) on 8 and 16 x H800 at 1-256 tokens per rank, FP8 and bf16: the fused layer
    as built, the same with its prologues folded into the fused kernels (not built), the unfused
    low-latency chain and the limit (comet.tune.model.decode); then the published low-latency
    dispatch / combine figures of other implementations at 128 tokens beside the model's."""
    from .model import decode as dm

    spec = pm.GPUS[dm.DECODE_GPU]
    us = lambda s: f"{s * 1e6:.1f}"  # noqa: E731
    rows = []
    for W, rpn in dm.DECODE_GROUPS:
        for dt in ("fp8", "bf16"):
            for T in dm.DECODE_TOKENS:
                p = dm.DecodePoint(W, T, dt, rpn)
                f, u, lim = dm.decode_fused(p, spec), dm.decode_unfused(p, spec), dm.decode_limit(p, spec)
                wmb = (dm.weight_bytes(p, 0) + dm.weight_bytes(p, 1)) / 1e6
                rows.append([f"{W // rpn} x {rpn}", dt, str(T),
                             f"{dm.active_experts(W, p.E, p.k, T):.1f}", f"{wmb:.0f}",
                             f"{f['n_comm0']} / {f['n_comm1']}",
                             f"{f['tile_m0']} / {f['tile_m1']}", us(f["fused"]), us(f["folded"]),
                             us(u["unfused"]), us(lim), f"{f['fused'] / lim:.2f}"])
    table = _md_table(["nodes x ranks", "dtype", "tokens", "active experts", "weight MB",
                       "n_comm", "tile_m", "fused us", "fused, prologues folded (not built) us",
                       "unfused us", "limit us", "fused / limit"], rows, "lllrrrrrrrrr")
    anchors = []
    for W, gpu, what, d_us, c_us in dm.DECODE_ANCHORS:
        rpn = dict(dm.DECODE_GROUPS)[W]
        u = dm.decode_unfused(dm.DecodePoint(W, 128, "fp8", rpn), pm.GPUS[gpu])
        anchors.append([what, f"{d_us:g} / {c_us:g}",
                        f"{u['dispatch'] * 1e6:.1f} / {u['combine'] * 1e6:.1f}"])
    return table + "\n\n" + _md_table(
        ["128 tokens per rank, H 7168, top-8", "published dispatch / combine us (measured, another "
         "implementation)", "model, same GPUs: unfused chain's dispatch / combine us (FP8 rows)"],
        anchors, "lrr")


TABLES = {"tp": tp_table, "fp8": fp8_table, "dedup": dedup_table, "decode": decode_table}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.table:
        print(TABLES[args.table]())
        return 0
    if args.model is None or args.world is None:
        parser.error("--model and --world are required (unless --table)")
    # a user mistake: one line and status 2 (parser.error), no traceback
    try:
        args.dtype = tn.normalize_dtype(args.dtype)
    except ValueError as e:
        parser.error(str(e))
    if args.world < 1 or args.tokens < 0:
        parser.error(f"--world must be >= 1 and --tokens >= 0 (got {args.world}, {args.tokens})")
    try:
        model = resolve_model(args)
    except SystemExit as e:
        parser.error(str(e.code))
    if args.tp < 1 or args.world % args.tp:
        parser.error(f"--tp {args.tp} must be >= 1 and divide --world {args.world}")
    if args.tp == 1 and int(model["E"]) % args.world:
        parser.error(f"--world {args.world} must divide the expert count E={model['E']}")
    if int(model["E"]) % (args.world // args.tp):
        parser.error(f"--world {args.world} / --tp {args.tp} = {args.world // args.tp} EP ranks "
                     f"must divide the expert count E={model['E']}")
    if args.tp > 1 and any(n % args.tp for n in layer_dims(model)):
        parser.error(f"--tp {args.tp} must divide N0, N1 = {layer_dims(model)} (the shards)")
    if args.tp > 1 and args.ranks_per_node is not None and args.ranks_per_node % args.tp:
        parser.error(f"--tp {args.tp} must divide --ranks-per-node {args.ranks_per_node} (a TP "
                     f"group inside a node)")
    if args.tp > 1 and args.node_reduce:
        parser.error("--node-reduce with --tp > 1 is not modelled")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1
                                            or args.world % args.ranks_per_node):
        parser.error(f"--ranks-per-node {args.ranks_per_node} must divide --world {args.world}")
    if args.skew is not None:
        from comet.plan import parse_skew

        try:
            args.skew = parse_skew(args.skew)
        except ValueError as e:
            parser.error(str(e))
        if args.spare_slots < 0:
            parser.error(f"--spare-slots must be >= 0, got {args.spare_slots}")
    if args.warmup < 0 or args.iters < 1:
        parser.error(f"--warmup must be >= 0 and --iters >= 1 (got {args.warmup}, {args.iters})")
    say = print if _launch_rank() == 0 else _quiet  # under torchrun, rank 0 alone prints
    tuner = tn.Tuner(args.cache_dir)

    has_gpu = _cuda_available()
    local_arch, local_sms = tn.detect_device()  # ("cpu", threads) without a GPU
    if args.gpu is None:
        if has_gpu and pm.get_spec(local_arch) is not None:
            gpus = [local_arch]
        else:
            if has_gpu:
                say(f"(local GPU {local_arch!r} is not in the model's table; modelling h800)")
            else:
                say("(no GPU here; modelling h800 -- choose another with --gpu)")
            gpus = ["h800"]
    elif args.gpu.lower() == "all":
        gpus = list(pm.GPUS)
    else:
        gpus = [args.gpu]

    specs = []
    for g in gpus:
        sms = args.sm_count if args.sm_count else (local_sms if has_gpu and g == local_arch else None)
        specs.append(pm.get_spec(g, sms))
        if specs[-1] is None:
            parser.error(f"unknown --gpu {g!r}; choose from {', '.join(pm.GPUS)}, cpu, all")
    for i, spec in enumerate(specs):
        if i:
            say()
        say(model_table(model, spec, args.world, args.tokens, args.dtype, args.max_blocks,
                        args.tile, tuner, ranks_per_node=args.ranks_per_node,
                        node_first=not args.flat, node_reduce=args.node_reduce,
                        tp_size=args.tp))
        if args.skew is not None:
            from comet.plan.report import skew_text

            say()
            say(skew_text(model, spec, args.world, args.tokens, pm.DTYPE_BYTES[args.dtype],
                          args.skew, args.spare_slots, args.ranks_per_node))

    # Profile by default on a GPU; on the CPU backend only when asked (--profile).
    profile = args.profile if args.profile is not None else has_gpu
    if profile:
        say()
        rc = _profile(args, model, local_arch, args.sm_count or local_sms, tuner, say=say)
        # failing to profile is an error only when profiling was asked for explicitly
        return rc if args.profile else 0
    return 0

