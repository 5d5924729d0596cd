"""The CPU backend with every block a team of OS threads (Buffer(threads_per_block=) or
$COMET_CPU_BLOCK_THREADS): the GPU's cooperative semantics (copies and GEMM rows split by thread
rank, thread-0 sections, block barriers, block-wide waits) run for real. Results must be bitwise
equal for 1, 2 and 4 threads per block and match the reference; failures still end in errors."""
import pytest
import torch

import comet
from tests.cases import E6_ON_3, Case, cases_for, make_inputs
from tests.sim_world import run_threads
from tests.test_ops_sim import check_against_reference, run_layers

TEAM_SIZES = (1, 2, 4)
CASES = [cases_for(2)[i] for i in (0, 2, 4)] + [cases_for(3)[i] for i in (1, 3)] + [E6_ON_3]


def run_with_teams(case, dtype, threads, inputs, n_comm=2, n_gemm=2, tile=(5, 7)):
    bufs = comet.Buffer.simulated_world(case.world, timeout=20, threads_per_block=threads)
    results, _ = run_layers(case, dtype, n_comm, n_gemm, tile, buffers=bufs, inputs=inputs)
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_team_sizes_bitwise_equal_and_match_reference(case, dtype):
    inputs = make_inputs(case, dtype)
    runs = {t: run_with_teams(case, dtype, t, inputs) for t in TEAM_SIZES}
    check_against_reference(case, dtype, runs[1], inputs)
    for t in TEAM_SIZES[1:]:
        check_against_reference(case, dtype, runs[t], inputs)
        for a, b in zip(runs[1], runs[t]):
            assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]), f"{t} threads differ"


def test_env_var_sets_team_size_and_stress(monkeypatch):
    """$COMET_CPU_BLOCK_THREADS applies to buffers without their own setting; with random delays
    in every thread (so threads of a block drift apart) back-to-back calls stay exact."""
    monkeypatch.setenv("COMET_CPU_BLOCK_THREADS", "3")
    monkeypatch.setenv("COMET_STRESS", "5")
    bufs = comet.Buffer.simulated_world(3, timeout=20)
    for call in range(6):
        case = Case(f"teams-{call}", 3, 6, 2, tuple((call * 5 + 4 * r) % 13 for r in range(3)),
                    hidden=17, n0=9, n1=5, seed=300 + call)
        results, inputs = run_layers(case, torch.float32, 1 + call % 3, 1 + call % 2,
                                     (3 + call % 4, 4), buffers=bufs)
        check_against_reference(case, torch.float32, results, inputs)


def test_bad_team_size_is_a_clear_error(monkeypatch):
    buf = comet.Buffer.simulated_world(1)[0]
    with pytest.raises(ValueError, match="threads_per_block must be .* got 0"):
        buf.set_threads_per_block(0)
    with pytest.raises(ValueError, match="got 2000"):
        buf.set_threads_per_block(2000)
    monkeypatch.setenv("COMET_CPU_BLOCK_THREADS", "zero")
    case = cases_for(1)[1]
    xs, w0s, _w1s, ids, _wts = make_inputs(case, torch.float32)
    with pytest.raises(ValueError, match="COMET_CPU_BLOCK_THREADS must be in"):
        comet.moe_layer0(xs[0], w0s[0], ids[0], num_experts=case.experts, buffer=buf)


def test_missing_peer_with_teams_times_out_not_hangs():
    """Rank 1 never calls: rank 0's block-wide waits (thread 0 waiting, 3 threads at the barrier)
    end in the timeout error naming the flag."""
    case = cases_for(2)[1]
    xs, w0s, _w1s, ids, _wts = make_inputs(case, torch.float32)
    bufs = comet.Buffer.simulated_world(2, timeout=1.5, threads_per_block=4)

    def rank(r, buf):
        if r == 1:
            return None
        return comet.moe_layer0(xs[0], w0s[0], ids[0], num_experts=case.experts, buffer=buf)

    with pytest.raises(RuntimeError, match="gave up after"):
        run_threads(2, rank, buffers=bufs, timeout=30)


@pytest.mark.parametrize("threads", [2, 4])
def test_gradients_with_teams_match_reference(monkeypatch, threads):
    """The backward (fused ops again, plus virtual tokens) on thread teams of the environment's
    size: gradients as the reference's."""
    from tests.test_autograd import check_grads, comet_grads, cotangents, reference_grads

    monkeypatch.setenv("COMET_CPU_BLOCK_THREADS", str(threads))
    case = E6_ON_3
    inputs = make_inputs(case, torch.float32)
    vs = cotangents(case, torch.float32)
    expect_outs, expect = reference_grads(case, torch.float32, inputs, vs)
    got = comet_grads(case, inputs, vs, n_comm=2, tile=(4, 8))
    check_grads(case, torch.float32, got, expect_outs, expect)
