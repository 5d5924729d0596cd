"""bench/moe_layer.py --tp T: one MoE layer forward with expert tensor parallelism (EP = W / T x
TP = T) beside the expert-parallel layer (EP = W, tp_size 1) on the same W ranks, the same tokens
and the same full experts. Both are Comet's fused ops (the sequential / Tutel baselines of
moe_layer.py are expert-parallel only); each is checked against comet.reference.moe_tp_sim before
anything is timed. On the CPU this measures the CPU backend (threads as blocks, shared memory as
NVLink): not a GPU result.
"""
from __future__ import annotations

from bench import common as C


def body(rank: int, world: int, cfg: dict):
    """Runs on every rank: per model, check then time EP x TP and EP-only. Rank 0's records."""
    import torch
    import torch.distributed as dist

    import comet
    from comet import reference as ref
    from comet.nn import swiglu

    dev = C.device()
    dtype = C.DTYPES[cfg["dtype"]]
    tp = cfg["tp"]
    records = []
    for name in cfg["models"]:
        shape = C.shape_of(name, cfg["scale"], cfg["hidden"], cfg["ffn"])
        E, k, H, F, T = shape["E"], shape["k"], shape["H"], shape["N1"], cfg["tokens"]
        g = torch.Generator().manual_seed(cfg["seed"])  # the same full experts on every rank
        w0 = torch.randn(E, 2 * F, H, generator=g) / H ** 0.5
        w1 = torch.randn(E, H, F, generator=g) / F ** 0.5
        xs, ids, wts = [], [], []
        for r in range(world):  # every rank's tokens (the reference needs them all)
            gr = torch.Generator().manual_seed(cfg["seed"] * 1000 + 1 + r)
            xs.append(torch.randn(T, H, generator=gr).to(dtype))
            w, i = ref.route(torch.randn(T, E, generator=gr), k, renormalize=True)
            ids.append(i)
            wts.append(w)
        want = ref.moe_tp_sim(xs, w0.to(dtype), w1.to(dtype), ids, wts, ref.swiglu)[rank]
        runs = {}
        for t in (tp, 1):
            el, q, r, f = E // (world // t), rank // t, rank % t, F // t
            mine0, mine1 = w0[q * el:(q + 1) * el], w1[q * el:(q + 1) * el]
            gate, up = mine0.chunk(2, dim=1)
            w0r = torch.cat([gate[:, r * f:(r + 1) * f], up[:, r * f:(r + 1) * f]], dim=1)
            w1r = mine1[:, :, r * f:(r + 1) * f]
            to = dict(device=dev, dtype=dtype)
            inp = dict(x=xs[rank].to(dev), ids=ids[rank].to(dev), w=wts[rank].to(dev),
                       w0=w0r.contiguous().to(**to), w1=w1r.contiguous().to(**to))

            def run(inp=inp, t=t):
                y0, layout = comet.moe_layer0(inp["x"], inp["w0"], inp["ids"], num_experts=E,
                                              tp_size=t)
                return comet.moe_layer1(swiglu(y0), inp["w1"], inp["w"], layout)

            tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else \
                dict(atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(run().cpu().float(), want.float(), **tol,
                                       msg=lambda m, t=t: f"rank {rank}, {name}, tp {t}: {m}")
            runs[f"tp{t}"] = run
        label = f"{shape['title']} W={world} tp={tp}"
        C.progress(f"{label}: checked against the reference; timing")
        med = {n: v["median"] for n, v in
               C.measure(runs, dev, cfg["warmup"], cfg["iters"], label=label).items()}
        records.append(dict(model=name, title=shape["title"], world=world, tp=tp, tokens=T,
                            dtype=cfg["dtype"], shape=dict(H=H, F=F, E=E, k=k),
                            median_ms={n: v * 1e3 for n, v in med.items()}))
        dist.barrier()
    return records if rank == 0 else None


def render(records) -> str:
    rows = [[r["title"], str(r["world"]), f"{r['world'] // r['tp']} x {r['tp']}",
             C.ms(r["median_ms"][f"tp{r['tp']}"] / 1e3), C.ms(r["median_ms"]["tp1"] / 1e3)]
            for r in records]
    return C.table(["model", "W", "EP x TP", "EP x TP ms", "EP only ms"], rows)
