"""Run with the pre-ranks_per_node comet/tune/perfmodel.py (commit 1403adf) on PYTHONPATH:
   python tests/data/gen_perfmodel_one_node.py tests/data/perfmodel_one_node.json
Golden one-node predictions of comet.tune.perfmodel (generated from the model before ranks_per_node)."""
import json, random, sys
from comet.tune import perfmodel as pm

PRESETS = {"mixtral": (4096, 14336, 8, 2), "qwen2": (2048, 1408, 64, 4), "phi3.5": (4096, 6400, 16, 2)}
out = []
KEYS = ('comm', 'gemm', 'prologue', 'combine', 'kernel', 'fused', 'baseline', 'limit')
def shapes():
    for name, (H, ffn, E, k) in PRESETS.items():
        for W in (1, 8):
            for T in (333, 4096):
                for layer in (0, 1):
                    yield dict(W=W, E=E, k=k, H=H, N=2 * ffn if layer == 0 else ffn, T=T), layer
    rng = random.Random(12)
    for _ in range(20):
        W = rng.choice([1, 2, 4, 8]); el = rng.choice([1, 2, 4]); E = W * el
        k = rng.randint(1, min(E, 8)); layer = rng.randint(0, 1)
        d = dict(W=W, E=E, k=k, H=rng.choice([128, 1024, 7168]), N=rng.choice([704, 2816]),
                 T=rng.choice([0, 7, 1024]), dtype_bytes=rng.choice([2, 4]))
        if rng.random() < 0.3:
            d["remote_rows"] = rng.uniform(0, 5000)
        if rng.random() < 0.3:
            d["expert_rows"] = [rng.randint(0, 900) for _ in range(el)]
        yield d, layer
for d, layer in shapes():
    s = pm.MoEShape(**{**d, "expert_rows": tuple(d["expert_rows"]) if "expert_rows" in d else None})
    for gpu in ("a100", "h800", "l20"):  # the sm80, sm90a and PCIe paths
        spec = pm.GPUS[gpu]
        for n in (1, 8, spec.sm_count - 1):
            p = pm.predict(s, spec, n, layer)
            out.append(dict(shape=d, layer=layer, gpu=gpu, n_comm=n, predict={k: p[k] for k in KEYS}))
        out.append(dict(shape=d, layer=layer, gpu=gpu, choose=pm.choose_n_comm(s, spec, layer),
                        saturation=pm.comm_saturation_blocks(s, spec, layer)))
json.dump(out, open(sys.argv[1], "w"), separators=(",", ":"))
print(len(out))
