"""Skewed routing on the CPU analog: the contiguous map vs lysi_assign vs balance.

    .venv/bin/python -m bench.placement            # Zipf 1.0, 1.2, 1.5; 4 ranks, 1 node and 2 x 2
    .venv/bin/python -m bench.placement --smoke    # Zipf 1.2, 64 tokens per rank, 2 rounds

Every rank routes its tokens by the same Zipf loads (k distinct experts per token, drawn with
probability proportional to the loads, a fixed seed per rank). The planners get those loads and
one spare slot per rank (E / W + 1 slots): lysi_assign (equal FLOPS shares) places each expert
once, balance replicates the hottest. Per placement: the rows each rank's GEMMs receive (max over
ranks / mean), the fused layer's time (moe_layer0 -> tanh -> moe_layer1, median over rounds of
the slowest rank, comet.nn-style timing of bench/common.py) and the planner's own time. Before
timing, out is checked to be bitwise equal across the three placements (docs/placement.md). On
the CPU this measures the CPU backend (threads as blocks, shared memory as NVLink, the link
proxy between nodes): not a GPU result.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `python bench/<name>.py`

from bench import common as C  # noqa: E402

E, H, F = 16, 128, 128


def body(rank: int, world: int, cfg: dict):
    import torch
    import torch.distributed as dist

    import comet
    from comet.plan import Placement, balance, lysi_assign, zipf_loads

    torch.manual_seed(0)
    records = []
    for rpn in cfg["ranks_per_node"]:
        buf = comet.Buffer(dist.group.WORLD, timeout=60, ranks_per_node=rpn)
        g = torch.Generator().manual_seed(1)
        w0 = torch.randn(E, F, H, generator=g) / H ** 0.5
        w1 = torch.randn(E, H, F, generator=g) / F ** 0.5
        for s in cfg["skews"]:
            loads = zipf_loads(E, s, seed=0)
            gr = torch.Generator().manual_seed(100 * rank + 7)
            T, k = cfg["tokens"], 2
            x = torch.randn(T, H, generator=gr)
            ids = torch.multinomial(torch.tensor(loads).expand(T, E), k, generator=gr)
            wts = torch.rand(T, k, generator=gr)
            slots = E // world + 1
            plans, plan_s = {}, {}
            for name, make in (("contiguous", lambda: Placement.contiguous(E, world)),
                               ("lysi_assign", lambda: lysi_assign([1.0] * world, loads, slots)),
                               ("balance", lambda: balance(loads, world, slots,
                                                          ranks_per_node=rpn))):
                t0 = time.perf_counter()
                plans[name] = make()
                plan_s[name] = time.perf_counter() - t0
            runs, outs, rows = {}, {}, {}
            for name, p in plans.items():
                mine = list(p.local_experts(rank))
                w0r, w1r = w0[mine].contiguous(), w1[mine].contiguous()

                def run(p=p, w0r=w0r, w1r=w1r, keep=None):
                    y0, layout = comet.moe_layer0(x, w0r, ids, num_experts=E, buffer=buf,
                                                  placement=p)
                    out = comet.moe_layer1(torch.tanh(y0), w1r, wts, layout, buffer=buf)
                    if keep is not None:
                        keep.append((out, int(layout.recv_counts.sum())))
                    return out

                kept = []
                run(keep=kept)
                outs[name], m = kept[0]
                per_rank = torch.zeros(world, dtype=torch.float64)
                per_rank[rank] = m
                dist.all_reduce(per_rank)
                rows[name] = per_rank.tolist()
                runs[name] = run
            for name in plans:
                if not torch.equal(outs[name], outs["contiguous"]):
                    raise AssertionError(f"rank {rank}: out of {name} differs from contiguous")
            label = f"zipf {s} nodes {world // rpn}x{rpn}"
            med = C.measure(runs, torch.device("cpu"), cfg["warmup"], cfg["iters"], label=label)
            for name in plans:
                r = rows[name]
                records.append(dict(skew=s, nodes=world // rpn, ranks_per_node=rpn, placement=name,
                                    slots=list(plans[name].slots()), rows_per_rank=r,
                                    max_over_mean=max(r) / (sum(r) / len(r)),
                                    layer_ms=med[name]["median"] * 1e3,
                                    planner_ms=plan_s[name] * 1e3))
        buf.close()
        dist.barrier()
    return records if rank == 0 else None


def plot(records, path: Path) -> bool:
    plt = C.pyplot()
    if plt is None:
        print(C.NO_MATPLOTLIB)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["contiguous", "lysi_assign", "balance"]
    groups = sorted({(r["nodes"], r["skew"]) for r in records})
    for ax, key, ylabel in ((axes[0], "max_over_mean", "max rows per rank / mean"),
                            (axes[1], "layer_ms", "layer ms (slowest rank, median)")):
        for i, name in enumerate(names):
            vals = [next(r[key] for r in records if r["placement"] == name and
                         (r["nodes"], r["skew"]) == gk) for gk in groups]
            ax.bar([j + 0.27 * (i - 1) for j in range(len(groups))], vals, width=0.27, label=name)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"zipf {s}\n{n} node{'s' if n > 1 else ''}" for n, s in groups],
                           fontsize=8)
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=8)
    fig.suptitle("placements under skewed routing, CPU analog (4 ranks): not a GPU result",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    p = C.arg_parser("python -m bench.placement", __doc__)
    C.add_output_args(p, "placement", "Zipf 1.2, 64 tokens per rank, 2 rounds")
    p.add_argument("--world", type=int, default=4, help="ranks (even: also 2 nodes; default 4)")
    a = p.parse_args(argv)
    cfg = dict(skews=[1.2] if a.smoke else [1.0, 1.2, 1.5], tokens=64 if a.smoke else 256,
               warmup=1, iters=2 if a.smoke else 5,
               ranks_per_node=[a.world] + ([a.world // 2] if a.world % 2 == 0 else []))
    records = C.launch(body, a.world, cfg)[0]
    rows = [[f"{r['skew']:g}", f"{r['nodes']} x {r['ranks_per_node']}", r["placement"],
             str(r["slots"]), f"{r['max_over_mean']:.2f}", f"{r['layer_ms']:.2f}",
             f"{r['planner_ms']:.2f}"] for r in records]
    print(f"placements under Zipf routing, E={E}, H={H}, F={F}, k=2, {cfg['tokens']} tokens per "
          f"rank, one spare slot per rank; CPU backend ({a.world} ranks): not a GPU result")
    print(C.table(["zipf", "nodes x ranks", "placement", "E_r per rank", "max/mean rows",
                   "layer ms", "planner ms"], rows))
    name = C.result_name("placement", a.smoke)
    path = C.write_json(name, dict(environment=C.environment("cpu"), smoke=a.smoke,
                                   shape=dict(E=E, H=H, F=F, k=2), config=cfg, rows=records),
                        None if a.out is None else Path(a.out))
    print(f"wrote {path}")
    if plot(records, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
