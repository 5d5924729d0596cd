"""Bytes per second of one comm block's row copy (comet/copy.h copy_rows, layer0's gather of token
rows) on the CPU backend, for 1, 2, 4 (kCopyUnroll, what the kernels use) and 8 independent
16-byte loads in flight per thread.

    .venv/bin/python -m bench.comm_copy            # rows of 256 B, 4 KiB, 8 KiB; 1 and 2 threads
    .venv/bin/python -m bench.comm_copy --smoke    # CI-sized

One block (a team of 1 or 2 OS threads) gathers rows from random places of a 256 MiB shared
mapping (larger than the caches, as rows pulled from peers' symmetric buffers) into a contiguous
destination, in batches of 128 rows (one m-tile's row origins at a time, as comm_layer0.h does);
best of 3 repetitions. What it measures is this CPU's memory system: an out-of-order core already
overlaps independent loads of a loop, so the unroll matters less here than on a GPU, where each
thread issues its loads in order and a block's copy rate is (bytes in flight) / (round trip) -
the relation comet/tune/perfmodel.py uses for the GPU. It shows the structure runs and what it does
on a real memory system, not a GPU's rate.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `python bench/<name>.py`

from bench.common import add_output_args, arg_parser, environment, progress, result_name, \
    table, write_json  # noqa: E402

UNROLLS = [1, 2, 4, 8]


def run(row_bytes, threads, rows_per_config, source_bytes, reps):
    from comet import _native  # noqa: F401  (loads comet._C)
    from comet._C import engine

    results = []
    configs = [(b, t) for b in row_bytes for t in threads]
    start = time.time()
    for i, (b, t) in enumerate(configs):
        progress(f"[{i + 1}/{len(configs)}] row {b} B, {t} thread(s)  ({time.time() - start:.0f} s)")
        rows = max(1, rows_per_config // b)
        per = {u: engine.copy_bench(b, rows, threads=t, unroll=u, source_bytes=source_bytes,
                                    reps=reps)["gbs"] for u in UNROLLS}
        results.append(dict(row_bytes=b, threads=t, rows=rows, gbs=per,
                            speedup_4_vs_1=per[4] / per[1]))
    return results


def main(argv=None) -> int:
    p = arg_parser("python -m bench.comm_copy", __doc__)
    add_output_args(p, "comm_copy", "16 MiB source, 4 MiB copied")
    a = p.parse_args(argv)
    if a.smoke:
        res = run([256, 4096], [1, 2], 4 << 20, 16 << 20, 2)
    else:
        res = run([256, 4096, 8192], [1, 2], 64 << 20, 256 << 20, 3)
    headers = ["row bytes", "threads", "rows"] + [f"GB/s {u} in flight" for u in UNROLLS] + \
              ["4 vs 1"]
    body = [[str(r["row_bytes"]), str(r["threads"]), str(r["rows"])] +
            [f"{r['gbs'][u]:.2f}" for u in UNROLLS] + [f"{r['speedup_4_vs_1']:.2f}x"]
            for r in res]
    print("comet comm-block row copy on the CPU backend (one block; random rows of a shared "
          "mapping; this CPU's memory, not a GPU's link)")
    print(table(headers, body))
    path = write_json(result_name("comm_copy", a.smoke),
                      dict(environment=environment("cpu"), rows=res),
                      None if a.out is None else Path(a.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
