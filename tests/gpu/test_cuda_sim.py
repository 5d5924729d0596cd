"""The CUDA kernels' multi-rank protocol on ONE GPU: W = 2 and 4 ranks as threads of this process
(comet.Buffer.simulated_world(W, device="cuda"), tests/gpu/sim.py), the same kernels, flags, peer
copies and top-k reduce/combine across ranks as W GPUs, checked against comet.reference: the
awkward routing cases, a shape on the tensor-core path that grows the symmetric memory, changing
routing call after call, tensor parallelism, placements, a token sent once per destination rank
(bf16 and FP8 rows), an error raised on every rank, both layers beside a busy side stream, the
SM share rule and recovery after a timed-out call. `make test-gpu-sim` runs it (plain pytest, no torchrun); skips
without a GPU. Written, not run on a GPU here (no machine of this project has one)."""
import dataclasses
import os

import pytest
import torch

import comet
from comet import reference as ref
from tests.cases import cases_for, h_from_y0, make_inputs
from tests.gpu.conftest import require_fp8
from tests.gpu.sim import WORLDS, rank_errors, run_ranks, sim_world
from tests.gpu.test_cuda_ops import check_against_reference

BF16 = torch.bfloat16
WORLD_IDS = [f"W{w}" for w in WORLDS]

# One process holds the whole simulated group: under torchrun every process would build its own
# on one GPU at once.
pytestmark = pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1,
                                reason="a simulated world runs in one process (make test-gpu-sim)")


def _layers(case, inputs, n_comm=None):
    """The rank body: layer0 -> h_from_y0 -> layer1 on the rank's buffer; CPU results."""
    xs, w0s, w1s, ids, wts = inputs

    def body(rank, buf):
        dev = buf.device
        y0, layout = comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev),
                                      num_experts=case.experts, n_comm=n_comm, buffer=buf)
        h = h_from_y0(y0, case.n1)
        out = comet.moe_layer1(h, w1s[rank].to(dev), wts[rank].to(dev), layout, n_comm=n_comm,
                               buffer=buf)
        return y0.cpu(), layout, h.cpu(), out.cpu()

    return body


def _run_and_check(bufs, case, dtype, n_comm=None):
    inputs = make_inputs(case, dtype)
    results = run_ranks(bufs, _layers(case, inputs, n_comm))
    hs = [h for _, _, h, _ in results]  # layer1 is checked on the h every rank produced
    for rank, (y0, layout, h, out) in enumerate(results):
        check_against_reference(case, dtype, rank, case.world, y0, layout, h, out, inputs, hs=hs)


@pytest.mark.parametrize("n_comm", [1, None], ids=["n_comm1", "tuned"])
@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
@pytest.mark.parametrize("which", range(len(cases_for(2))),
                         ids=[c.name.rsplit("-", 1)[0] for c in cases_for(2)])
def test_layers_match_reference(world, which, n_comm):
    """Uniform, an empty rank, one expert for every slot, dropped slots, duplicate experts, skewed
    routing with odd sizes and E = 3W (bf16)."""
    _run_and_check(sim_world(world), cases_for(world)[which], BF16, n_comm)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_float16(world):
    _run_and_check(sim_world(world), cases_for(world)[3], torch.float16, n_comm=2)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_tensor_core_shape_grows_the_symmetric_memory(world):
    """H, N multiples of 8 (TMA + wgmma on sm_90a), several tiles per expert, from the smallest
    data segment: the call grows every rank's segment together (one allocation for the group)."""
    bufs = sim_world(world, fresh=True, capacity_bytes=1 << 20)
    case = dataclasses.replace(cases_for(world)[0], name="aligned", hidden=256, n0=384, n1=192,
                               tokens=tuple(900 + 17 * r for r in range(world)),
                               experts=3 * world, seed=9)
    _run_and_check(bufs, case, BF16, n_comm=4)
    caps = {b.capacity_bytes for b in bufs}
    assert len(caps) == 1 and caps.pop() > 1 << 20


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_back_to_back_calls_changing_routing(world):
    """Consecutive calls on one group: routing, token counts and splits change every call (the
    epoch flags and the buffer-reuse handshake across ranks)."""
    base = cases_for(world)
    for i in range(6):
        case = dataclasses.replace(base[i % len(base)], seed=100 + i,
                                   tokens=tuple(3 + (5 * i + 7 * r) % 29 for r in range(world)))
        _run_and_check(sim_world(world), case, BF16, n_comm=1 + i % 5)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_expert_tensor_parallelism(world):
    """tp_size 2: each EP rank's experts sharded over its 2 ranks, out summed over the shards,
    against comet.reference.moe_tp_sim."""
    from tests.test_tp import TpCase, act, make_inputs as tp_inputs, shards

    tp = 2
    case = TpCase(f"sim-t{tp}", world, tp, 3 * (world // tp),
                  tuple(40 + 13 * r for r in range(world)), topk=2, hidden=64, n0=16 * tp,
                  drop=0.2, seed=tp)
    inputs = tp_inputs(case, BF16)
    xs, w0, w1, b0, b1, ids, wts = inputs

    def body(rank, buf):
        dev = buf.device
        w0r, w1r, b0r, b1r = (t.to(dev) for t in shards(case, rank, w0, w1, b0, b1))
        y0, layout = comet.moe_layer0(xs[rank].to(dev), w0r, ids[rank].to(dev),
                                      num_experts=case.experts, b0=b0r, tp_size=tp, buffer=buf)
        out = comet.moe_layer1(act(y0), w1r, wts[rank].to(dev), layout, b1=b1r, buffer=buf)
        return out.cpu(), layout.row_source.cpu()

    got = run_ranks(sim_world(world), body)
    want = ref.moe_tp_sim(xs, w0, w1, ids, wts, act, b0, b1)
    for rank, (out, sources) in enumerate(got):
        torch.testing.assert_close(out, want[rank], atol=2e-2, rtol=2e-2)
        rows = ref.tp_dispatch_rows(ids, case.experts, rank, tp)
        assert sources.tolist() == [r.source for r in rows]


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_bad_expert_id_raises_on_every_rank(world):
    case = cases_for(world)[0]
    xs, w0s, w1s, ids, wts = make_inputs(case, BF16)
    ids[0][0, 0] = case.experts  # out of range on rank 0
    errors = rank_errors(sim_world(world), _layers(case, (xs, w0s, w1s, ids, wts)))
    for rank, e in enumerate(errors):
        assert isinstance(e, ValueError), (rank, e)
        assert ("is not an expert id" if rank == 0 else "rank 0") in str(e), (rank, e)
    _run_and_check(sim_world(world), case, BF16)  # the group stays usable


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_grids_keep_to_the_ranks_share_of_the_sms(world):
    """Each rank's fused grid fits floor(SMs / W) - sm_margin SMs (one block each), so the W
    ranks' grids are co-resident: a split that needs one block more is refused on every rank,
    naming the share; one that fits runs."""
    bufs = sim_world(world)
    sms = torch.cuda.get_device_properties(bufs[0].device).multi_processor_count
    fits = sms // world - bufs[0].sm_margin
    case = cases_for(world)[0]
    inputs = make_inputs(case, BF16)
    errors = rank_errors(bufs, _layers(case, inputs, n_comm=fits))  # + >= 1 GEMM block
    for rank, e in enumerate(errors):
        assert isinstance(e, ValueError) and "share of this GPU's SMs" in str(e), (rank, e)
    _run_and_check(bufs, case, BF16, n_comm=fits - 1)  # every block of the share


def test_default_stream_is_refused():
    """Every rank needs a stream of its own: a call on the legacy default stream would serialise
    with the other ranks' work."""
    bufs = sim_world(2, fresh=True)
    case = cases_for(2)[0]
    xs, w0s, _, ids, _ = make_inputs(case, BF16)
    dev = bufs[0].device
    with pytest.raises(ValueError, match="default CUDA stream"):
        with torch.cuda.stream(torch.cuda.default_stream(dev)):
            comet.moe_layer0(xs[0].to(dev), w0s[0].to(dev), ids[0].to(dev),
                             num_experts=case.experts, buffer=bufs[0])


def test_recover_after_a_timed_out_call():
    """The last rank makes one call more than its peers: its wait times out (recorded, the
    context survives); every rank re-arms with recover() and the group serves calls equal to the
    reference again."""
    import threading

    world = 2
    bufs = sim_world(world, fresh=True, timeout=2.0)
    case = cases_for(world)[0]
    inputs = make_inputs(case, BF16)
    xs, w0s, _, ids, _ = inputs
    layers = _layers(case, inputs)
    met = threading.Barrier(world, timeout=60)

    def body(rank, buf):
        layers(rank, buf)
        if rank == world - 1:
            dev = buf.device
            with pytest.raises(RuntimeError, match="gave up"):
                comet.moe_layer0(xs[rank].to(dev), w0s[rank].to(dev), ids[rank].to(dev),
                                 num_experts=case.experts, buffer=buf)
                torch.cuda.current_stream().synchronize()
            assert buf.needs_recovery
        met.wait()
        before = buf.recoveries
        buf.recover()
        assert buf.recoveries == before + 1 and not buf.needs_recovery

    run_ranks(bufs, body)
    for _ in range(3):
        _run_and_check(bufs, case, BF16)


@pytest.mark.parametrize("fp8_rows", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_a_token_crosses_once_per_destination_rank(world, fp8_rows, monkeypatch):
    """layer0 sends a token once per destination rank (bf16 rows, and packed FP8 rows on
    sm_89 / sm_90): the same bits as one row per slot ($COMET_LAYER0_DEDUP=0), and every rank's
    Buffer.traffic() equal to the distinct (token, rank) pairs counted here from the routing."""
    from comet import fp8
    from tests.gpu.test_cuda_dedup import _routing

    if fp8_rows:
        require_fp8()
    E, k, T, H, N = 4 * world, 4, 37, 256, 256
    el = E // world
    ids = _routing(world, E, k, T, seed=world)

    def body(rank, buf):
        dev = buf.device
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(T, H, generator=g).to(BF16).to(dev)
        w0 = (torch.randn(el, N, H, generator=g) / H ** 0.5).to(BF16).to(dev)
        w1 = (torch.randn(el, H, N, generator=g) / N ** 0.5).to(BF16).to(dev)
        wt = torch.rand(ids[rank].shape, generator=g).to(dev)
        tid = ids[rank].to(dev)
        if fp8_rows:
            w0q, w0s = fp8.quantize_blocks(w0)
            y0, layout = comet.moe_layer0(x, w0q, tid, num_experts=E, n_comm=2, w0_scale=w0s,
                                          dispatch_fp8=True, buffer=buf)
            return y0.cpu(), None, buf.traffic()
        y0, layout = comet.moe_layer0(x, w0, tid, num_experts=E, n_comm=2, buffer=buf)
        out = comet.moe_layer1(torch.tanh(y0.float()).to(BF16), w1, wt, layout, n_comm=2,
                               buffer=buf)
        return y0.cpu(), out.cpu(), buf.traffic()

    bufs = sim_world(world)
    monkeypatch.setenv("COMET_LAYER0_DEDUP", "1")
    on = run_ranks(bufs, body)
    monkeypatch.setenv("COMET_LAYER0_DEDUP", "0")
    off = run_ranks(bufs, body)
    row_bytes = fp8.row_bytes(H) if fp8_rows else H * 2
    for rank in range(world):
        for a, b in zip(on[rank][:2], off[rank][:2]):
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        pairs = sum(any(e >= 0 and e // el == rank for e in row)
                    for s in range(world) if s != rank for row in ids[s].tolist())
        assert on[rank][2][:2] == (pairs, pairs * row_bytes)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_placements_bitwise_equal_and_a_disagreement_raises_everywhere(world):
    """placement=: the contiguous map against a float64 reference, a replicated placement and one
    with a rank holding no expert bitwise equal to it; ranks that disagree raise on every rank."""
    from tests.gpu import test_cuda_placement as tp

    bufs = sim_world(world)
    ps = tp.placements(world)
    outs = {name: run_ranks(bufs, lambda r, b, p=p: tp.run(r, p, b)) for name, p in ps.items()}
    for rank in range(world):
        want = tp.reference(*tp.inputs(rank, world))
        torch.testing.assert_close(outs["contiguous"][rank].double(), want, atol=2e-2, rtol=2e-2)
        for name, out in outs.items():
            assert torch.equal(out[rank], outs["contiguous"][rank]), (name, rank)
    errors = rank_errors(bufs, lambda r, b: tp.run(r, ps["replicated"] if r == 1
                                                   else ps["contiguous"], b))
    for rank, e in enumerate(errors):
        assert isinstance(e, (ValueError, RuntimeError)) and "placement" in str(e), (rank, e)


@pytest.mark.parametrize("world", WORLDS, ids=WORLD_IDS)
def test_layers_finish_beside_a_busy_side_stream(world):
    """Every rank's layers while large matmuls on another stream hold most SMs (fewer of the
    ranks' blocks resident than their shares promise, for a while): they finish, equal to the
    reference (tests/gpu/test_forward_progress.py's case, with W ranks on one GPU)."""
    from tests.gpu.test_forward_progress import _busy_side_stream

    bufs = sim_world(world)
    _side, _done, _keep = _busy_side_stream()
    _run_and_check(bufs, cases_for(world)[0], BF16, n_comm=2)
