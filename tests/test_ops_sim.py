"""torch.ops.comet.moe_layer0/1 (CPU engine) against the reference, ranks simulated as threads.

Covers the awkward cases for n_comm in {0 (staged), 1, 2, 3} and several tile shapes, fp32 and bf16, bitwise
determinism across runs and n_comm, back-to-back calls with changing routing, and a stress mode
with random delays in every comm and GEMM block."""
import os

import pytest
import torch

import comet
from comet import reference as ref
from tests.cases import E6_ON_3, TOL, Case, cases_for, h_from_y0, make_inputs
from tests.sim_world import run_threads

CASES = [c for w in (1, 2, 3, 4) for c in cases_for(w)] + [E6_ON_3]


def run_layers(case, dtype, n_comm=1, n_gemm=1, tile=(8, 8), buffers=None, inputs=None):
    xs, w0s, w1s, ids, wts = inputs or make_inputs(case, dtype)

    def rank(r, buf):
        y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts,
                                      buffer=buf, n_comm=n_comm, tile=tile)
        h = h_from_y0(y0, case.n1)
        out = comet.moe_layer1(h, w1s[r], wts[r], layout, buffer=buf, n_comm=n_comm, tile=tile)
        return y0, layout, h, out

    return run_threads(case.world, rank, buffers=buffers), (xs, w0s, w1s, ids, wts)


def check_against_reference(case, dtype, results, inputs):
    xs, w0s, w1s, ids, wts = inputs
    y0_ref = ref.layer0_sim(xs, w0s, ids, case.experts)
    hs = [r[2] for r in results]
    out_ref = ref.layer1_sim(hs, w1s, wts, ids, case.experts)
    for r, (y0, layout, _h, out) in enumerate(results):
        rows = ref.dispatch_rows(ids, case.experts, r)
        assert layout.num_rows == len(rows)
        assert layout.row_source.tolist() == [row.source for row in rows]
        assert layout.row_token.tolist() == [row.token for row in rows]
        assert layout.row_slot.tolist() == [row.slot for row in rows]
        torch.testing.assert_close(y0, y0_ref[r], **TOL[dtype])
        torch.testing.assert_close(out, out_ref[r], **TOL[dtype])
        assert out.dtype == dtype and out.shape == (case.tokens[r], case.hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, dtype):
    results, inputs = run_layers(case, dtype)
    check_against_reference(case, dtype, results, inputs)


# Three cases of world 3 and three of world 4 (every routing kind once), and E=6 on 3 ranks.
SPLIT_CASES = [cases_for(3)[i] for i in (0, 3, 5)] + [cases_for(4)[i] for i in (1, 2, 4)] + [E6_ON_3]


def test_split_cases_cover_worlds_three_and_four():
    assert {c.world for c in SPLIT_CASES} == {3, 4}
    assert {c.routing for c in SPLIT_CASES} >= {"uniform", "dropped", "skewed", "one_expert",
                                                "duplicates"}


@pytest.mark.parametrize("n_comm,n_gemm,tile", [(1, 1, (4, 4)), (2, 3, (8, 16)), (3, 2, (5, 7)),
                                                (3, 1, (64, 64)), (0, 3, (8, 4)), (0, 1, (3, 5))])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_counts_and_tiles_bitwise_equal(case, n_comm, n_gemm, tile, dtype):
    """Any split and tile shape gives the same bits as the baseline (fixed reduction order), the
    staged layer (n_comm = 0: comm and GEMM as two launches of the whole grid) included."""
    base, inputs = run_layers(case, dtype, 1, 1, (8, 8))
    other, _ = run_layers(case, dtype, n_comm, n_gemm, tile, inputs=inputs)
    check_against_reference(case, dtype, other, inputs)
    for a, b in zip(base, other):
        assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])


def test_fp16_and_int32_ids():
    case = cases_for(2)[3]
    xs, w0s, w1s, ids, wts = make_inputs(case, torch.float16)
    ids = [i.to(torch.int32) for i in ids]
    wts = [w.to(torch.float16) for w in wts]  # weights in the activation dtype are accepted too
    results, _ = run_layers(case, torch.float16, inputs=(xs, w0s, w1s, ids, wts))
    check_against_reference(case, torch.float16, results, (xs, w0s, w1s, ids, wts))


def test_back_to_back_calls_changing_routing_with_stress(monkeypatch):
    """50 consecutive calls on one buffer, routing and token counts changing every call, random
    delays in every block: no hang, no mismatch (epoch flags + the reuse handshake)."""
    monkeypatch.setenv("COMET_STRESS", "7")
    world, E = 3, 6
    bufs = comet.Buffer.simulated_world(world, timeout=20)
    for call in range(50):
        case = Case(
            f"b2b-{call}", world, E, 2, tuple((call * 7 + 3 * r) % 11 for r in range(world)),
            seed=100 + call)
        results, inputs = run_layers(case, torch.float32, n_comm=1 + call % 3, n_gemm=1 + call % 2,
                                     tile=(4 + call % 5, 8), buffers=bufs)
        check_against_reference(case, torch.float32, results, inputs)


def random_case(i, g):
    def pick(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    w = pick(1, 5)
    routing = ["uniform", "dropped", "duplicates", "skewed", "one_expert"][i % 5]
    n0 = pick(1, 20)
    return Case(f"stress-{i}", w, w * pick(1, 4), pick(2, 4) if routing == "duplicates" else pick(1, 4),
                tuple(pick(0, 9) for _ in range(w)), hidden=pick(1, 20), n0=n0, n1=pick(1, n0 + 1),
                routing=routing, seed=i)


def test_stress_randomized(monkeypatch):
    """COMET_STRESS_RUNS (default 200) randomized shapes, routing, splits and tiles with injected
    delays in every block; every result checked against the reference."""
    runs = int(os.environ.get("COMET_STRESS_RUNS", "200"))
    monkeypatch.setenv("COMET_STRESS", "11")
    g = torch.Generator().manual_seed(5)
    buffers = {w: comet.Buffer.simulated_world(w, timeout=20) for w in (1, 2, 3, 4)}
    for i in range(runs):
        case = random_case(i, g)
        split = (int(torch.randint(0, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g)))
        tile = (int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
        results, inputs = run_layers(case, torch.float32, *split, tile, buffers=buffers[case.world])
        check_against_reference(case, torch.float32, results, inputs)


def test_float64_on_cpu_accumulates_in_double():
    """float64 (CPU backend only) exists for exact gradient checks: it must match a float64
    reference far below fp32 rounding."""
    case = cases_for(3)[3]
    inputs = make_inputs(case, torch.float64)
    inputs = (*inputs[:4], [w.double() for w in inputs[4]])
    results, _ = run_layers(case, torch.float64, inputs=inputs)
    xs, w0s, w1s, ids, wts = inputs
    y0_ref = ref.layer0_sim(xs, w0s, ids, case.experts)
    out_ref = ref.layer1_sim([r[2] for r in results], w1s, wts, ids, case.experts)
    for r, res in enumerate(results):
        torch.testing.assert_close(res[0], y0_ref[r], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(res[3], out_ref[r], atol=1e-12, rtol=1e-12)


def test_environment_settings_take_effect():
    """The suites rerun under COMET_CPU_RANKS_PER_NODE / COMET_NODE_REDUCE (make test-py-nodes):
    the buffers must report what the environment asks for, and with several nodes the calls must
    cross the link proxy, or those runs would silently test one node."""
    rpn_env = os.environ.get("COMET_CPU_RANKS_PER_NODE")
    reduce_env = os.environ.get("COMET_NODE_REDUCE", "0") == "1"
    case = cases_for(4)[0]
    bufs = comet.Buffer.simulated_world(4, timeout=20)
    rpn = int(rpn_env) if rpn_env else 4
    assert [b.ranks_per_node for b in bufs] == [rpn] * 4
    assert [b.node_reduce for b in bufs] == [reduce_env and rpn < 4] * 4
    results, inputs = run_layers(case, torch.float32, buffers=bufs)
    check_against_reference(case, torch.float32, results, inputs)
    puts = sum(b.link_stats()[0] for b in bufs)
    assert (puts > 0) == (rpn < 4), f"{puts} puts over the link with {rpn} ranks per node"


@pytest.mark.parametrize("rpn,node_reduce", [(1, "0"), (2, "1"), (2, "0")])
def test_environment_settings_are_read(monkeypatch, rpn, node_reduce):
    monkeypatch.setenv("COMET_CPU_RANKS_PER_NODE", str(rpn))
    monkeypatch.setenv("COMET_NODE_REDUCE", node_reduce)
    test_environment_settings_take_effect()
