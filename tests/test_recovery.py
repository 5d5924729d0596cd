"""A buffer after a failed call (docs/reliability.md, "After a failure"): on 2 gloo ranks with a
2 s buffer timeout, each failure below is followed by ten good calls on the SAME default buffer
(no buffer= argument), every one equal to the reference; a rank that is gone ends the buffer for
good, with a message saying so.

  max_rows mismatch     the metadata agreement rejects the call on both ranks at once: no
                        timeout, nothing to re-arm
  extra call            one rank calls layer0 once more; it times out, the next call re-arms
  raise in between      one rank raises between layer0 and layer1; its peer's layer1 times out
  recover()             the explicit, collective re-arm
  recover during call   a rank's recover() stops its peer's pending call at once (PeerFlag::Fault)
                        and pairs with that peer's next call, which re-arms
  killed rank           SIGKILL: the survivor's call fails at once, recover() raises for good;
                        survivors that never waited for the dead rank (a peer noticed the
                        death) name the dead rank too
"""
import os
import time

import pytest
import torch

from tests.cases import TOL
from tests.dist_utils import run_ranks

TIMEOUT_S = 2.0  # the buffer's timeout in these tests (COMET_TIMEOUT in the ranks)
ENV = {"COMET_TIMEOUT": str(TIMEOUT_S)}
E, K, T, H, N0 = 4, 2, 6, 16, 32


def _inputs(rank, world, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(T, H, generator=g)
    w0 = torch.randn(E // world, N0, H, generator=g) / 4
    w1 = torch.randn(E // world, H, N0 // 2, generator=g) / 4
    ids = torch.randint(0, E, (T, K), generator=g)
    wts = torch.rand(T, K, generator=g)
    return x, w0, w1, ids, wts


def _good_calls(rank, world, n=10):
    """n layer0 + layer1 pairs on the default buffer, each compared with the reference."""
    import comet
    from comet import reference as ref

    for i in range(n):
        x, w0, w1, ids, wts = _inputs(rank, world, i)
        y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E)
        h = ref.swiglu(y0)
        out = comet.moe_layer1(h, w1, wts, layout)
        torch.testing.assert_close(y0, ref.layer0_dist(x, w0, ids, E), **TOL[torch.float32])
        torch.testing.assert_close(out, ref.layer1_dist(h, w1, wts, ids, E),
                                   **TOL[torch.float32])


def _raises(fn):
    """(exception type name, message, seconds) of fn(), which must raise."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return type(e).__name__, str(e), time.monotonic() - t0
    raise AssertionError("expected the call to raise")


def _failure(rank, world, name):
    """Makes the failure `name` happen; returns what this rank's failing call raised (or None)."""
    import comet
    from comet import reference as ref

    x, w0, w1, ids, wts = _inputs(rank, world, 99)
    if name == "max_rows":
        rows = 3 if rank == 0 else None
        return _raises(lambda: comet.moe_layer0(x, w0, ids, num_experts=E, max_rows=rows))
    if name in ("extra_call", "recover"):
        if rank == world - 1:
            return _raises(lambda: comet.moe_layer0(x, w0, ids, num_experts=E))
        return None
    if name == "recover_during_call":
        if rank == 0:  # waits for rank 1's metadata; rank 1's recover() stops it at once
            return _raises(lambda: comet.moe_layer0(x, w0, ids, num_experts=E))
        time.sleep(0.3)
        comet.buffer_for().recover()  # pairs with rank 0's next call, which re-arms
        return None
    assert name == "raise_between"
    y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E)
    if rank == 0:
        return _raises(lambda: comet.moe_layer1(ref.swiglu(y0), w1, wts, layout))
    return None  # rank 1 "raised" here: it never makes the layer1 call


SCENARIOS = ("max_rows", "extra_call", "raise_between", "recover", "recover_during_call")


def _scenarios(rank, world):
    """Every scenario in turn on one group (one start-up for all): the failure, then ten good
    calls on the default buffer. Per scenario: what the failing call raised, and the buffer's
    (needs_recovery, recoveries) once every rank is past the failure and after the good calls."""
    import torch.distributed as dist

    import comet

    _good_calls(rank, world, 2)
    buf = comet.buffer_for()
    out = {}
    for name in SCENARIOS:
        seen = _failure(rank, world, name)
        if name != "recover_during_call":  # (there rank 1's recover() waits for rank 0's call)
            dist.barrier()  # every rank is past the failure
        before = (buf.needs_recovery, buf.recoveries)
        if name == "recover":
            buf.recover()
        _good_calls(rank, world, 10)
        assert comet.buffer_for() is buf
        out[name] = {"seen": seen, "before": before,
                     "after": (buf.needs_recovery, buf.recoveries)}
    return out


@pytest.fixture(scope="module")
def scenarios():
    res = run_ranks(_scenarios, 2, env=ENV, timeout=120)
    return {name: [r[name] for r in res] for name in SCENARIOS}


def test_max_rows_mismatch_raises_on_every_rank_at_once_and_the_buffer_serves_on(scenarios):
    for r, got in enumerate(scenarios["max_rows"]):
        kind, msg, took = got["seen"]
        assert kind == "ValueError", got
        assert "ranks disagree on max_rows" in msg and "rank 0 has 3, rank 1 has -1" in msg, msg
        assert took < TIMEOUT_S / 2, f"rank {r} waited {took:.1f} s: not a metadata verdict"
        assert got["before"] == (False, 0) and got["after"] == (False, 0), got


def test_extra_call_on_one_rank_times_out_then_next_call_rearms(scenarios):
    res = scenarios["extra_call"]
    kind, msg, took = res[1]["seen"]
    assert kind == "RuntimeError" and "gave up" in msg and "peer call metadata" in msg, msg
    assert TIMEOUT_S <= took < 4 * TIMEOUT_S, took
    assert res[0]["seen"] is None
    assert res[1]["before"] == (True, 0)  # this rank failed
    assert res[0]["before"] == (True, 0)  # its peer learnt of it (PeerFlag::Fault)
    assert [got["after"] for got in res] == [(False, 1)] * 2, res


def test_rank_raising_between_layer0_and_layer1_then_next_call_rearms(scenarios):
    res = scenarios["raise_between"]
    kind, msg, took = res[0]["seen"]
    assert kind == "RuntimeError" and "gave up" in msg, msg
    assert [got["before"] for got in res] == [(True, 1)] * 2, res
    assert [got["after"] for got in res] == [(False, 2)] * 2, res


def test_explicit_recover_is_collective_and_counts_one_rearm(scenarios):
    res = scenarios["recover"]
    assert res[1]["seen"][0] == "RuntimeError"
    assert [got["before"] for got in res] == [(True, 2)] * 2, res
    assert [got["after"] for got in res] == [(False, 3)] * 2, res


def _killed(rank, world):
    import signal

    import torch.distributed as dist

    import comet

    _good_calls(rank, world, 2)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    x, w0, _, ids, _ = _inputs(rank, world, 7)
    call = lambda: comet.moe_layer0(x, w0, ids, num_experts=E)  # noqa: E731
    first = _raises(call)
    buf = comet.buffer_for()
    again = _raises(buf.recover)
    later = _raises(call)
    return {"first": first, "recover": again, "later": later}


def test_killed_rank_ends_the_buffer_for_good_with_a_clear_message():
    res = run_ranks(_killed, 2, env=ENV, timeout=60, may_die={1})
    assert res[1] == -9, res[1]
    first, again, later = res[0]["first"], res[0]["recover"], res[0]["later"]
    assert first[0] == "RuntimeError" and "has exited" in first[1], first
    assert first[2] < TIMEOUT_S, f"the death took {first[2]:.1f} s to notice"
    for kind, msg, _ in (again, later):
        assert kind == "RuntimeError", msg
        assert "cannot be used again: rank 1" in msg and "has exited" in msg, msg


def _killed_seen_through_a_peer(rank, world):
    """Rank 3 of 4 is killed between calls. Ranks 0 and 2 then call and wait for rank 1's
    metadata (before they would wait for rank 3's); rank 1 does not call but recover()s, notices
    the death and stops their calls. Returns what each survivor raised; the survivors stay alive
    until all three have it (else rank 1's exit could be what the others notice)."""
    import signal

    import torch.distributed as dist

    import comet

    survivors = dist.new_group([0, 1, 2])  # collective: before rank 3 goes
    _good_calls(rank, world, 2)
    dist.barrier()
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank != 1:
        x, w0, _, ids, _ = _inputs(rank, world, 7)
        seen = _raises(lambda: comet.moe_layer0(x, w0, ids, num_experts=E))
    else:
        time.sleep(0.5)  # rank 3 is gone, ranks 0 and 2 wait in their calls
        seen = _raises(comet.buffer_for().recover)
    dist.barrier(group=survivors)
    return seen


def test_rank_that_noticed_a_death_stops_its_peers_naming_the_dead_rank():
    """Whichever rank notices a peer's exit first, every survivor's error names the dead rank:
    the calls of ranks 0 and 2 stop at once (not after their timeout) with rank 3's exit as the
    reason, never as "rank 1 stopped this call". Usually rank 1's re-arm notices first and stops
    them; on a loaded machine rank 0's own wait may notice first and stop rank 2 (which rank
    noticed is timing; tests/cpp/test_protocol.cpp pins the propagation through a peer)."""
    res = run_ranks(_killed_seen_through_a_peer, 4, env=ENV, timeout=60, may_die={3})
    assert res[3] == -9, res[3]
    kind, msg, _ = res[1]
    assert kind == "RuntimeError" and "cannot be used again: rank 3 (pid" in msg, msg
    for r in (0, 2):
        kind, msg, took = res[r]
        assert kind == "RuntimeError" and "rank 3 (pid" in msg and "has exited" in msg, (r, msg)
        assert "rank 1 stopped this call" not in msg, (r, msg)
        assert took < TIMEOUT_S, f"rank {r} needed {took:.1f} s (its timeout is {TIMEOUT_S})"


def test_recover_stops_a_peer_waiting_in_a_call_at_once_and_pairs_with_its_next_call(scenarios):
    res = scenarios["recover_during_call"]
    kind, msg, took = res[0]["seen"]
    assert kind == "RuntimeError" and "rank 1 stopped this call" in msg, msg
    assert took < TIMEOUT_S, f"rank 0 needed {took:.1f} s to notice (its timeout is {TIMEOUT_S})"
    assert [got["after"] for got in res] == [(False, 4)] * 2, res


def test_rearm_across_simulated_nodes_goes_through_the_link():
    """4 ranks on 2 CPU nodes (threads of this process): the Fault and Rearm flags to the other
    node travel by put-with-signal through the link proxy. Rank 3 makes an extra call; every
    rank's next call re-arms; three good calls match the reference (float64)."""
    import threading

    import comet
    from comet import reference as ref
    from tests.sim_world import run_threads

    world = 4
    inputs = [_inputs(r, world, 5) for r in range(world)]
    xs, w0s, w1s, ids, wts = ([t[i].double() if t[i].is_floating_point() else t[i]
                               for t in inputs] for i in range(5))
    y0_ref = ref.layer0_sim(xs, w0s, ids, E)
    hs = [ref.swiglu(y) for y in y0_ref]
    out_ref = ref.layer1_sim(hs, w1s, wts, ids, E)
    bufs = comet.Buffer.simulated_world(world, timeout=1.0, ranks_per_node=2)
    step = threading.Barrier(world)

    def body(r, buf):
        if r == 3:
            seen = _raises(lambda: comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=E,
                                                    buffer=buf))
            assert "gave up" in seen[1], seen
        step.wait(timeout=20)
        for _ in range(3):
            y0, layout = comet.moe_layer0(xs[r], w0s[r], ids[r], num_experts=E, buffer=buf)
            out = comet.moe_layer1(hs[r], w1s[r], wts[r], layout, buffer=buf)
            torch.testing.assert_close(y0, y0_ref[r], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out, out_ref[r], rtol=1e-12, atol=1e-12)
        return buf.recoveries, buf.link_stats()[0]

    res = run_threads(world, body, buffers=bufs, timeout=60)
    assert [rec for rec, _ in res] == [1] * world, res
    assert all(puts > 0 for _, puts in res), res
