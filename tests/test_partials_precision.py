"""layer1's partial sums travel in the activation dtype (bf16/fp16), not fp32 (comm_layer1.h): half
the bytes on the links. This measures what that costs: the same bf16 values run once with bf16
partials (the op as shipped) and once in fp32 (fp32 partials, output rounded to bf16 once at the
end), both against a float64 reference. The bf16-partial error must stay within the bf16 test
tolerance and within a small factor of the unavoidable final rounding."""
import torch

import comet
from comet import reference as ref
from tests.cases import Case, h_from_y0, make_inputs
from tests.sim_world import run_threads

# 4 ranks, k = 4 distinct experts: most tokens get 3-4 partials from different ranks.
CASE = Case("partials", 4, 8, 4, (96, 80, 64, 72), hidden=64, n0=48, n1=32, seed=21)


def run(xs, w0s, w1s, ids, wts, hs=None):
    bufs = comet.Buffer.simulated_world(CASE.world, timeout=20)

    def rank(r, buf):
        y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=CASE.experts, buffer=buf)
        h = h_from_y0(y0, CASE.n1) if hs is None else hs[r]
        return h, comet.moe_layer1(h, w1s[r], wts[r], layout, buffer=buf)

    return run_threads(CASE.world, rank, buffers=bufs)


def test_bf16_partials_cost_at_most_a_rounding():
    xs, w0s, w1s, ids, wts = make_inputs(CASE, torch.bfloat16)
    bf = run(xs, w0s, w1s, ids, wts)
    hs = [h for h, _ in bf]
    f32 = run([x.float() for x in xs], [w.float() for w in w0s], [w.float() for w in w1s], ids,
              wts, hs=[h.float() for h in hs])
    exact = ref.layer1_sim([h.double() for h in hs], [w.double() for w in w1s],
                           [w.double() for w in wts], ids, CASE.experts)
    err_bf16_partials = max(float((o.double() - e).abs().max()) for (_, o), e in zip(bf, exact))
    err_fp32_partials = max(float((o.bfloat16().double() - e).abs().max())
                            for (_, o), e in zip(f32, exact))
    scale = max(float(e.abs().max()) for e in exact)
    print(f"max |out| {scale:.3f}; max error vs fp64: bf16 partials {err_bf16_partials:.3e}, "
          f"fp32 partials (+ final bf16 rounding) {err_fp32_partials:.3e}")
    assert err_fp32_partials > 0  # the final rounding alone is visible at this size
    assert err_bf16_partials <= 2e-2 * max(scale, 1.0)
    assert err_bf16_partials <= 3 * err_fp32_partials
