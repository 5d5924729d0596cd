"""Forward progress by construction, proven on the CPU backend: with at most S blocks of a kernel
live at once (Buffer(resident_blocks=S) / $COMET_CPU_RESIDENT_BLOCKS), started in block-index
order as slots free - what a GPU does when another kernel shares its SMs - both fused layers, the
prologue programs and layer1's combine step (per-rank and node-reduced) finish and give the bits of
the unlimited run. The role layout (comet/block_roles.h) makes every wait inside a kernel point to
a lower block index; the grids with grid barriers are sized to what is co-resident.

Sampled corners, not the whole product: grid 5 = n_comm 2 + n_gemm 3 (S = 1, 2 = n_comm,
3 = n_comm + 1, 5 = the whole grid) and grid 4 = n_comm 3 + n_gemm 1 (S = 3 = n_comm,
4 = n_comm + 1 = the whole grid), on 1-4 ranks of one node and on 2 nodes of 2 ranks."""
import pytest
import torch

import comet
from comet import _C
from tests.cases import cases_for, h_from_y0, make_inputs
from tests.sim_world import run_threads


def _layers(case, dtype, bufs, n_comm, inputs):
    """Both layers on every rank: (y0, row_source, row_token, out) per rank."""
    xs, w0s, w1s, ids, wts = inputs

    def rank(r, buf):
        y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=case.experts,
                                      buffer=buf, n_comm=n_comm, tile=(4, 4))
        out = comet.moe_layer1(h_from_y0(y0, case.n1), w1s[r], wts[r], layout, buffer=buf,
                               n_comm=n_comm, tile=(4, 4))
        return y0, layout.row_source, layout.row_token, out

    return run_threads(case.world, rank, buffers=bufs)


def _check_limits(monkeypatch, case, dtype, limits, grid=5, n_comm=2, **buffer_kw):
    """The layers under each residency limit equal the unlimited run, bit for bit."""
    monkeypatch.setenv("COMET_CPU_BLOCKS", str(grid))  # n_gemm = grid - n_comm
    inputs = make_inputs(case, dtype)
    base = _layers(case, dtype, comet.Buffer.simulated_world(case.world, timeout=20, **buffer_kw),
                   n_comm, inputs)
    for s in limits:
        bufs = comet.Buffer.simulated_world(case.world, timeout=20, resident_blocks=s,
                                            **buffer_kw)
        assert all(b.resident_blocks == s for b in bufs)
        got = _layers(case, dtype, bufs, n_comm, inputs)
        for r, (a, b) in enumerate(zip(base, got)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"S={s}, rank {r}"


# (case, dtype, limits): every S of the module doc appears on several world sizes.
ONE_NODE = [
    (cases_for(1)[0], torch.float32, (1, 5)),
    (cases_for(2)[3], torch.bfloat16, (2, 3)),
    (cases_for(3)[5], torch.float32, (1, 3)),
    (cases_for(4)[1], torch.bfloat16, (1, 2, 5)),
]


@pytest.mark.parametrize("case,dtype,limits", ONE_NODE, ids=lambda v: str(v))
def test_layers_under_residency_limits_are_bitwise_the_unlimited_run(monkeypatch, case, dtype,
                                                                       limits):
    _check_limits(monkeypatch, case, dtype, limits)


def test_more_comm_than_gemm_blocks_with_teams_and_delays(monkeypatch):
    """n_comm 3 + n_gemm 1: S = n_comm and n_comm + 1 (the whole grid), teams of 2 threads and
    random delays in every thread."""
    monkeypatch.setenv("COMET_STRESS", "11")
    _check_limits(monkeypatch, cases_for(3)[0], torch.float32, (3, 4), grid=4, n_comm=3,
                  threads_per_block=2)


@pytest.mark.parametrize("case", [cases_for(1)[0], cases_for(3)[5]], ids=str)
def test_staged_layers_under_residency_limits(monkeypatch, case):
    """n_comm 0 (staged: all comm blocks, then all GEMM blocks, or the reverse, as two launches
    of the 5-block grid) with one block live at a time and random delays: each launch waits only
    on what an earlier launch or a peer published, so it finishes, with the unlimited run's bits."""
    monkeypatch.setenv("COMET_STRESS", "5")
    _check_limits(monkeypatch, case, torch.float32, (1, 2), grid=5, n_comm=0)


@pytest.mark.parametrize("node_reduce,limits", [(False, (1, 3)), (True, (1, 2))],
                         ids=["per-rank", "node-reduced"])
def test_two_nodes_under_residency_limits(monkeypatch, node_reduce, limits):
    """2 nodes x 2 ranks of the CPU analog: the node-first mirrors, the staged partial puts and,
    node-reduced, the combine's relays (a grid that waits on the other nodes' combine grids, so
    sized to what is co-resident)."""
    _check_limits(monkeypatch, cases_for(4)[0], torch.bfloat16, limits, ranks_per_node=2,
                  node_reduce=node_reduce)


@pytest.mark.parametrize("resident", [1, 2, 3, 5])
def test_prologue_programs_under_residency_limits(resident):
    """The prologue programs' grid barriers on a grid of 5 blocks x 2 threads: the grid shrinks to
    the co-resident blocks and the results do not change."""
    g = torch.Generator().manual_seed(resident)
    E, k, T, world, tile_m = 6, 2, 23, 3, 3
    ids = torch.randint(-1, E, (T * k,), generator=g).tolist()
    grid = dict(blocks=5, threads=2)
    assert (_C.engine.send_plan(ids, T, k, E, **grid, resident_blocks=resident)
            == _C.engine.send_plan(ids, T, k, E, **grid))
    counts = torch.randint(0, 9, (world * 2,), generator=g).tolist()
    expert_off, seg_off = _C.engine.dispatch_layout(counts, 1, world, 2)
    assert (_C.engine.mtiles(expert_off, tile_m, **grid, resident_blocks=resident)
            == _C.engine.mtiles(expert_off, tile_m, **grid))
    for layer in (0, 1):
        assert (_C.engine.tile_order(layer, expert_off, seg_off, world, tile_m, 3, **grid,
                                     resident_blocks=resident)
                == _C.engine.tile_order(layer, expert_off, seg_off, world, tile_m, 3, **grid))


def test_buffer_reports_its_residency_and_honours_the_environment(monkeypatch):
    monkeypatch.delenv("COMET_CPU_RESIDENT_BLOCKS", raising=False)
    buf = comet.Buffer.simulated_world(1)[0]
    assert buf.resident_blocks == 0  # no limit
    monkeypatch.setenv("COMET_CPU_RESIDENT_BLOCKS", "2")
    assert buf.resident_blocks == 2  # read per call, like $COMET_CPU_BLOCK_THREADS
    buf.set_resident_blocks(3)
    assert buf.resident_blocks == 3  # the buffer's own setting wins
    buf.set_resident_blocks(0)
    assert buf.resident_blocks == 0
    assert comet.Buffer.simulated_world(1, resident_blocks=4)[0].resident_blocks == 4


def test_environment_limit_runs_the_layers_bitwise(monkeypatch):
    """$COMET_CPU_RESIDENT_BLOCKS=1 on buffers without their own setting: one block at a time."""
    case = cases_for(2)[0]
    monkeypatch.setenv("COMET_CPU_BLOCKS", "4")
    inputs = make_inputs(case, torch.float32)
    base = _layers(case, torch.float32, comet.Buffer.simulated_world(2, timeout=20), 1, inputs)
    monkeypatch.setenv("COMET_CPU_RESIDENT_BLOCKS", "1")
    bufs = comet.Buffer.simulated_world(2, timeout=20)
    assert [b.resident_blocks for b in bufs] == [1, 1]
    got = _layers(case, torch.float32, bufs, 1, inputs)
    for a, b in zip(base, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_bad_residency_is_a_clear_error(monkeypatch):
    buf = comet.Buffer.simulated_world(1)[0]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"resident_blocks must be an int >= 0 .*got"):
            buf.set_resident_blocks(bad)
    monkeypatch.setenv("COMET_CPU_RESIDENT_BLOCKS", "two")
    with pytest.raises(ValueError, match="COMET_CPU_RESIDENT_BLOCKS must be an integer .* got two"):
        buf.resident_blocks
    case = cases_for(1)[0]
    xs, w0s, _w1s, ids, _wts = make_inputs(case, torch.float32)
    with pytest.raises(ValueError, match="COMET_CPU_RESIDENT_BLOCKS must be an integer .* got two"):
        comet.moe_layer0(xs[0], w0s[0], ids[0], num_experts=case.experts, buffer=buf)
