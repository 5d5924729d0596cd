"""The fused MoE layer on one node vs two nodes, on the CPU analog of a multi-node group (ranks of
the other node reached only through the per-rank link proxy, comet/topology.h):

    .venv/bin/python -m bench.multinode            # 4 ranks: 1 x 4 vs 2 x 2, two model shapes
    .venv/bin/python -m bench.multinode --smoke    # CI-sized

Per model shape and topology (1 node, 2 nodes, 2 nodes with layer1's node-reduced combine,
Buffer(node_reduce=True)): median time of moe_layer0 and moe_layer1 (slowest rank per call),
and per rank and call the bytes the link delivered and the puts it issued, next to what a flat
dispatch (one row per (token, slot) bound to the other node, no node-first dedup) would have sent
for the same routing. --threads-per-block sets the CPU blocks' team size (layer0's row puts are
one per run of tokens inside a block's range, node_push.h, whatever the team size).
The link's latency and bandwidth are settings (--latency-us, --gbps), not a NIC's: on this CPU
the numbers show the structure works and what node-first saves in bytes, not GPU or network
speed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `python bench/<name>.py`

import torch  # noqa: E402

from bench.common import CPU_LABEL, add_output_args, arg_parser, environment, launch, measure, ms, \
    progress, result_name, shape_of, table, write_json  # noqa: E402

MODELS = ["mixtral", "qwen2"]


def _body(rank, world, shape, tokens, rpn, reduce, latency_us, gbps, threads, warmup, iters):
    import torch.distributed as dist

    import comet

    torch.manual_seed(1234 + rank)
    torch.set_num_threads(1)
    buf = comet.Buffer(ranks_per_node=rpn, link_latency_us=latency_us, link_gbps=gbps,
                       node_reduce=reduce, threads_per_block=threads)
    E, k, H = shape["E"], shape["k"], shape["H"]
    el = E // world
    x = torch.randn(tokens, H, dtype=torch.bfloat16)
    w0 = torch.randn(el, shape["N0"], H, dtype=torch.bfloat16) * H ** -0.5
    w1 = torch.randn(el, H, shape["N1"], dtype=torch.bfloat16) * shape["N1"] ** -0.5
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(tokens)])
    wts = torch.softmax(torch.randn(tokens, k), dim=-1)
    y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf)
    h = y0[:, : shape["N1"]].contiguous()

    def layer0():
        return comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf)

    def layer1():
        return comet.moe_layer1(h, w1, wts, layout, buffer=buf)

    times = measure({"layer0": layer0, "layer1": layer1}, torch.device("cpu"), warmup, iters,
                    label=f"{shape['model']} {world // rpn} node(s)"
                          f"{' node-reduced' if reduce else ''}")
    before = buf.link_stats()
    layer0()
    after = buf.link_stats()
    puts0, link0 = after[0] - before[0], after[1] - before[1]
    layer1()
    before, after = after, buf.link_stats()
    puts1, link1 = after[0] - before[0], after[1] - before[1]
    # What crosses nodes without node-first dedup: every (token, slot) row bound to another node.
    node = rank // rpn
    other = (ids // (el * rpn)) != node
    flat0 = int(other.sum()) * H * 2
    dist.barrier()
    return dict(times=times, link0=link0, link1=link1, flat0=flat0, puts0=puts0,
                puts1=puts1)


def run(models, world, tokens, scale, latency_us, gbps, warmup, iters, threads=None):
    rows = []
    start = time.time()
    configs = [(m, rpn, red) for m in models
               for rpn, red in ((world, False), (world // 2, False), (world // 2, True))]
    for i, (m, rpn, red) in enumerate(configs):
        shape = shape_of(m, scale)
        progress(f"[{i + 1}/{len(configs)}] {shape['title']} on {world // rpn} node(s)"
                 f"{', node-reduced' if red else ''} ({time.time() - start:.0f} s)")
        res = launch(_body, world, shape, tokens, rpn, red, latency_us, gbps, threads, warmup,
                     iters, timeout=600)
        t = res[0]["times"]
        rows.append(dict(model=m, title=shape["title"], H=shape["H"], E=shape["E"], k=shape["k"],
                         world=world, nodes=world // rpn, ranks_per_node=rpn, node_reduce=red,
                         tokens=tokens,
                         layer0_s=t["layer0"]["median"], layer1_s=t["layer1"]["median"],
                         link_bytes_layer0=sum(r["link0"] for r in res) / world,
                         link_bytes_layer1=sum(r["link1"] for r in res) / world,
                         flat_row_bytes_layer0=sum(r["flat0"] for r in res) / world,
                         puts_layer0=sum(r["puts0"] for r in res) / world,
                         puts_layer1=sum(r["puts1"] for r in res) / world))
    return rows


def main(argv=None) -> int:
    p = arg_parser("python -m bench.multinode", __doc__)
    add_output_args(p, "multinode", "Mixtral only, 64 tokens per rank, 3 rounds")
    p.add_argument("--world", type=int, default=4,
                   help="ranks, split into 1 node and into 2 nodes (even; default 4)")
    p.add_argument("--latency-us", type=float, default=10.0,
                   help="the link proxy's latency per put, microseconds (default 10)")
    p.add_argument("--gbps", type=float, default=0.0, help="link GB/s (0: memcpy speed)")
    p.add_argument("--threads-per-block", type=int, default=None,
                   help="threads per CPU block (default: the buffer's, $COMET_CPU_BLOCK_THREADS)")
    a = p.parse_args(argv)
    if a.world < 2 or a.world % 2:
        p.error(f"--world must be even and >= 2 (two nodes), got {a.world}")
    if a.smoke:
        rows = run(["mixtral"], a.world, 64, 128, a.latency_us, a.gbps, 1, 3,
                   a.threads_per_block)
    else:
        rows = run(MODELS, a.world, 512, None, a.latency_us, a.gbps, 2, 8, a.threads_per_block)
    headers = ["model (scaled)", "nodes x ranks", "layer0 ms", "layer1 ms", "link KB/call L0",
               "flat L0 rows KB", "link KB/call L1", "puts/call L0", "puts/call L1"]
    body = [[r["title"], f"{r['nodes']} x {r['ranks_per_node']}"
             f"{' node-reduced' if r['node_reduce'] else ''}", ms(r["layer0_s"]),
             ms(r["layer1_s"]), f"{r['link_bytes_layer0'] / 1e3:.1f}",
             f"{r['flat_row_bytes_layer0'] / 1e3:.1f}" if r["nodes"] > 1 else "-",
             f"{r['link_bytes_layer1'] / 1e3:.1f}", f"{r['puts_layer0']:.1f}",
             f"{r['puts_layer1']:.1f}"] for r in rows]
    label = (f"{CPU_LABEL}; other node through the link proxy ({a.latency_us:g} us, "
             f"{'memcpy speed' if a.gbps == 0 else f'{a.gbps:g} GB/s'})"
             f"{'' if a.threads_per_block is None else f'; {a.threads_per_block} threads per block'}")
    print(f"comet fused layer, 1 node vs 2 nodes: {label}")
    print(table(headers, body))
    print("link KB/call: bytes this rank's link delivered per call (rows, send plan, routing, "
          "metadata); flat L0 rows: the rows a flat dispatch would send for the same routing; "
          "node-reduced: layer1 sends one partial row per (token, node); puts/call: requests this "
          "rank's link proxy issued per call (row runs, send plan, routing, metadata and flags)")
    path = write_json(result_name("multinode", a.smoke),
                      dict(environment=environment("cpu"), label=label, smoke=a.smoke,
                           latency_us=a.latency_us, gbps=a.gbps,
                           threads_per_block=a.threads_per_block, rows=rows),
                      None if a.out is None else Path(a.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
