"""The benchmarks (moe_layer, sweep_ncomm, prologue, comm_copy, multinode), one after the other, from one command:

    .venv/bin/python -m bench            # full CPU run (~1-2 min on 2 cores)
    .venv/bin/python -m bench --smoke    # CI-sized (< 30 s each)

Options given here (--smoke, --out DIR) are passed to every script; run bench/moe_layer.py or
bench/sweep_ncomm.py directly for their other options. On a GPU run each script under torchrun
instead (see bench/README.md).
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    extra = (["--smoke"] if a.smoke else []) + (["--out", a.out] if a.out else [])
    from bench import comm_copy, moe_layer, multinode, prologue, sweep_ncomm

    rc = moe_layer.main(extra)
    print()
    rc = rc or sweep_ncomm.main(extra)
    print()
    rc = rc or prologue.main(extra)
    print()
    rc = rc or comm_copy.main(extra)
    print()
    return rc or multinode.main(extra)


if __name__ == "__main__":
    sys.exit(main())
