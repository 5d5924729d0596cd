"""HBM read rate against the number of streaming blocks and the bytes each keeps in flight: the
measurement behind two assumptions of comet's cost model.

    python tools/hbm_stream.py                       # GPU: measure; CPU: the model's column only
    python tools/hbm_stream.py --blocks 8,66,132 --loads 2,8 --iters 20 --out ./gpu-check

The model (comet/tune/model/small_tile.py, stream_rate) gives a streaming block, one per SM, the
smaller of its SM's share of HBM (hbm x hbm_eff / sm_count) and its bytes in flight over an HBM
latency of HBM_LATENCY_S (1 us, assumed); so b blocks read at b times that. At decode sizes this
share is what the GEMM blocks lose to the comm blocks (docs/tuning.md, "Decode"): if HBM
saturates with fewer SMs, the fused layer loses less.

On a GPU each row times comet's read kernel (csrc/cuda/hbm_read.cu, torch.ops.comet_cuda
.hbm_read_bench: `blocks` blocks, one per SM, of --threads threads, each thread with --loads
16-byte streaming loads in flight, over --bytes of device memory, larger than L2) with CUDA
events: the median of --iters launches after --warmup. Columns: blocks, loads in flight per
thread, bytes in flight per block, measured GB/s, the model's GB/s, and measured / model.
Without a GPU (or without comet's CUDA kernels) only the model's column is printed, labelled so.

Output: the table on stdout, progress on stderr, <out>/hbm_stream.json (default ./bench-results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from comet.tune.model import hardware, small_tile  # noqa: E402

DEFAULT_BLOCKS = (1, 2, 4, 8, 16, 33, 66, 99, 120, 126, 132)
DEFAULT_LOADS = (1, 2, 4, 8)


def _ints(text: str, name: str):
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"hbm_stream: --{name} {text!r}: expected comma-separated integers")
    if not vals or min(vals) < 1:
        raise SystemExit(f"hbm_stream: --{name} {text!r}: expected positive integers")
    return vals


def model_gbs(spec, blocks: int, in_flight: int) -> float:
    """The cost model's rate of ``blocks`` streaming blocks with ``in_flight`` bytes each, GB/s."""
    return blocks * small_tile.stream_rate(spec, in_flight) / 1e9


def _measurer():
    """hbm_read_bench when this process can run it (a GPU and comet built with its kernels)."""
    if not torch.cuda.is_available():
        return None, "no CUDA GPU"
    try:
        from comet._native import _C  # noqa: F401  (loads the extension and its ops)
    except ImportError as e:
        return None, f"comet's extension does not load ({e})"
    op = getattr(getattr(torch.ops, "comet_cuda", None), "hbm_read_bench", None)
    if op is None:
        return None, "comet was built without its CUDA kernels"
    return op, ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/hbm_stream.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", default=",".join(map(str, DEFAULT_BLOCKS)),
                   help="block counts, comma-separated (capped at the GPU's SMs)")
    p.add_argument("--loads", default=",".join(map(str, DEFAULT_LOADS)),
                   help="16-byte loads in flight per thread: 1, 2, 4 or 8, comma-separated")
    p.add_argument("--threads", type=int, default=256, help="threads per block, a multiple of 32 up to 256 (default 256)")
    p.add_argument("--bytes", type=int, default=1 << 30, help="bytes read per launch (default 1 GiB)")
    p.add_argument("--iters", type=int, default=10, help="timed launches per row (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed launches per row (default 2)")
    p.add_argument("--gpu", default=None,
                   help="the model's GPU without a device (default: this device's, else h200)")
    p.add_argument("--out", default="bench-results",
                   help="directory of hbm_stream.json (default ./bench-results)")
    a = p.parse_args(argv)
    blocks, loads = _ints(a.blocks, "blocks"), _ints(a.loads, "loads")
    if any(v not in DEFAULT_LOADS for v in loads):
        raise SystemExit(f"hbm_stream: --loads {a.loads!r}: each must be 1, 2, 4 or 8")
    if a.threads % 32 or not 32 <= a.threads <= 256:
        raise SystemExit(f"hbm_stream: --threads {a.threads}: expected a multiple of 32 up to 256")

    run, why = _measurer()
    if run is not None:
        name = torch.cuda.get_device_name()
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        spec = hardware.get_spec(name, sms) or hardware.get_spec("h200", sms)
    else:
        spec = hardware.get_spec(a.gpu or "h200")
        if spec is None:
            raise SystemExit(f"hbm_stream: --gpu {a.gpu!r} is not a GPU the model knows")
        name = spec.name
    blocks = tuple(sorted({min(b, spec.sm_count) for b in blocks}))

    src = None
    if run is not None:
        src = torch.randint(-2**31, 2**31 - 1, (a.bytes // 4,), dtype=torch.int32, device="cuda")
    rows = []
    for ld in loads:
        in_flight = a.threads * ld * 16
        for b in blocks:
            row = {"blocks": b, "loads": ld, "threads": a.threads, "in_flight_bytes": in_flight,
                   "model_gbs": model_gbs(spec, b, in_flight), "gbs": None}
            if run is not None:
                print(f"[hbm_stream] {b} blocks, {ld} loads in flight ...", file=sys.stderr,
                      flush=True)
                ms = run(src, b, a.threads, ld, a.warmup + a.iters)[a.warmup:]
                row["ms"] = statistics.median(ms)
                row["gbs"] = src.numel() * 4 / (row["ms"] * 1e-3) / 1e9
            rows.append(row)

    head = ("| blocks | loads in flight / thread | bytes in flight / block | measured GB/s | "
            "model GB/s | measured / model |")
    print(f"HBM read rate on {name} ({spec.sm_count} SMs), {a.threads} threads per block, "
          + (f"{a.bytes / 2**30:.2f} GiB per launch, median of {a.iters}" if run is not None
             else f"no measurement ({why}): the model's column only"))
    print(head)
    print("| --: | --: | --: | --: | --: | --: |")
    for r in rows:
        got = "-" if r["gbs"] is None else f"{r['gbs']:.0f}"
        ratio = "-" if r["gbs"] is None else f"{r['gbs'] / r['model_gbs']:.2f}"
        print(f"| {r['blocks']} | {r['loads']} | {r['in_flight_bytes']} | {got} | "
              f"{r['model_gbs']:.0f} | {ratio} |")

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hbm_stream.json"
    path.write_text(json.dumps({
        "device": name, "measured": run is not None, "why_not": why, "sm_count": spec.sm_count,
        "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join([os.path.relpath(__file__, os.getcwd())] + list(argv or sys.argv[1:])),
        "hbm_latency_s": small_tile.HBM_LATENCY_S, "hbm_bw": spec.hbm_bw, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
