"""The eight CPU benchmarks, one after the other, from one command (what `make bench` runs):
moe_layer (one MoE layer: sequential vs Tutel-style vs Comet), sweep_ncomm (latency vs the
comm/GEMM split), prologue (the per-call planning programs), comm_copy (one comm block's row copy),
multinode (1 node vs 2 nodes of the CPU analog), placement (skewed routing: the contiguous map
vs the planners) and kernels (a world of one: comet's layers beside torch._grouped_mm, the
unfused torch layer and a dense matmul; on a GPU the table the kernels are judged by) and decode
(1-256 tokens per rank: comet's fused ops beside the unfused torch chain).

    .venv/bin/python -m bench            # full CPU run: 9.6 min on 2 busy cores without decode
                                         # (decode: 40 s), see bench/README.md
    .venv/bin/python -m bench --smoke    # CI-sized: 3.1 min on 2 busy cores without decode (38 s)

Each prints a table on stdout (progress on stderr) and writes <out>/<name>.json (and a PNG for
moe_layer, sweep_ncomm and placement when matplotlib, the 'bench' extra, is installed), <out>
being --out, default ./bench-results of the current directory; --smoke writes
<name>_smoke.json/png instead, so it never overwrites a full run's results. The options
below are passed to every script; run a script alone for its other options (e.g.
`python bench/moe_layer.py --help`). On a GPU run each script under torchrun instead (see
bench/README.md).
"""
from __future__ import annotations

import argparse
import sys

SCRIPTS = ("moe_layer", "sweep_ncomm", "prologue", "comm_copy", "multinode", "placement",
           "kernels", "decode")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="CI-sized runs; results go to <name>_smoke.json/png, a full run's stay")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="directory of the JSON/PNG results (default ./bench-results)")
    a = p.parse_args(argv)
    extra = (["--smoke"] if a.smoke else []) + (["--out", a.out] if a.out else [])
    import importlib
    import time

    rc, took = 0, {}
    for i, name in enumerate(SCRIPTS):
        if i:
            print()
        t0 = time.monotonic()
        rc = importlib.import_module(f"bench.{name}").main(extra)
        took[name] = time.monotonic() - t0
        if rc:
            break
    # what each script took, the figures bench/README.md quotes
    print("\n" + ", ".join(f"{name} {s:.0f} s" for name, s in took.items()) +
          f"; all {sum(took.values()) / 60:.1f} min")
    return rc


if __name__ == "__main__":
    sys.exit(main())
