"""Span and time of the per-call prologue (comet/prologue.h) on the CPU backend's thread teams.

    .venv/bin/python -m bench.prologue            # T in {1024, 4096, 16384}, k in {2, 8},
                                                  # E in {8, 64}, W = 8, P in {1, 64, 1024}
    .venv/bin/python -m bench.prologue --smoke    # CI-sized

For each row one destination rank of a simulated world of W ranks (uniform top-k routing, k
distinct experts per token) runs every prologue program on a grid of P logical threads (OS
threads: P=1 as 1x1, 64 as 1x64, 1024 as 4x256 blocks x threads, the CUDA prologue's block size):
layer0's send plan, dispatch layout (the begin kernel's step: recv_counts from the sources'
bucket offsets and one scan over the E_local x (W+1) cells) and m-tile plan with its order,
layer1's pair lists, m-tile plan and reduce plan. `span` is the largest number of elements (routing slots, reduce-plan entries, m-tiles,
counters, scan steps) any one thread of a program was assigned, counted by the context
(ctx.work); the bound is T*k/P + E*W, and every program must stay within 2x of it. Times are this
CPU's, with P OS threads on its cores: they show the structure (barrier count, work per thread),
not a GPU's prologue time (see docs/design.md, "The per-call prologue", for the GPU launch shape and the expected cost).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `python bench/<name>.py`

from bench.common import add_output_args, arg_parser, environment, progress, result_name, \
    table, write_json  # noqa: E402

PROGRAMS = ["send_plan", "dispatch_layout", "tile_plan_layer0", "pair_list", "tile_plan_layer1",
            "reduce_plan"]
GRIDS = {1: (1, 1), 64: (1, 64), 1024: (4, 256), 16: (2, 8)}


def run(tokens, ks, experts, world, ps, seed=0):
    from comet import _native  # noqa: F401  (loads comet._C)
    from comet._C import engine

    rows = []
    configs = [(t, k, e, p) for t in tokens for k in ks for e in experts for p in ps]
    start = time.time()
    for i, (t, k, e, p) in enumerate(configs):
        progress(f"[{i + 1}/{len(configs)}] T={t} k={k} E={e} P={p}  ({time.time() - start:.0f} s)")
        blocks, threads = GRIDS[p]
        r = engine.prologue_bench(t, k, e, world, blocks, threads, seed=seed)
        bound = t * k / p + e * world
        span = max(r[name]["span"] for name in PROGRAMS)
        rows.append(dict(T=t, k=k, E=e, W=world, P=p, blocks=blocks, threads=threads,
                         rows=r["rows"], entries=r["entries"], mtiles=r["mtiles"], bound=bound,
                         span=span, ratio=span / bound, within_2x=span <= 2 * bound,
                         programs={name: r[name] for name in PROGRAMS},
                         ms_layer0=1e3 * (r["send_plan"]["seconds"] +
                                          r["dispatch_layout"]["seconds"] +
                                          r["tile_plan_layer0"]["seconds"]),
                         ms_layer1=1e3 * (r["pair_list"]["seconds"] +
                                          r["tile_plan_layer1"]["seconds"] +
                                          r["reduce_plan"]["seconds"])))
    return rows


def main(argv=None) -> int:
    p = arg_parser("python -m bench.prologue", __doc__)
    add_output_args(p, "prologue", "T=256, P in {1, 16}")
    a = p.parse_args(argv)
    if a.smoke:
        rows = run([256], [2, 8], [8, 64], 8, [1, 16])
    else:
        rows = run([1024, 4096, 16384], [2, 8], [8, 64], 8, [1, 64, 1024])
    headers = ["T", "k", "E", "P", "rows", "entries", "bound T*k/P+E*W"] + \
              [f"span {n}" for n in PROGRAMS] + ["max/bound", "ms layer0", "ms layer1"]
    body = [[str(r["T"]), str(r["k"]), str(r["E"]), str(r["P"]), str(r["rows"]), str(r["entries"]),
             f"{r['bound']:.0f}"] + [str(r["programs"][n]["span"]) for n in PROGRAMS] +
            [f"{r['ratio']:.2f}", f"{r['ms_layer0']:.2f}", f"{r['ms_layer1']:.2f}"] for r in rows]
    print("comet prologue on the CPU backend (W=8 simulated ranks, one destination; span = max "
          "elements per thread, counted; times on this CPU, not a GPU)")
    print(table(headers, body))
    bad = [r for r in rows if not r["within_2x"]]
    print(f"span within 2x of T*k/P + E*W: {len(rows) - len(bad)}/{len(rows)} rows")
    path = write_json(result_name("prologue", a.smoke),
                      dict(environment=environment("cpu"), rows=rows),
                      None if a.out is None else Path(a.out))
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
