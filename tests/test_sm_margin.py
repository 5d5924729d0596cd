"""The SM margin (docs/gpu.md, "SM margin") on the CPU backend's device model: every kernel of
every stream of a rank takes its blocks from the rank's one pool of resident-block slots
(Buffer(resident_blocks=S)), and a call's kernels take at most S - sm_margin of them.

Two groups of work in flight at once on two ranks, issued in opposite orders: a comet call and a
collective whose blocks wait across ranks (block b of each rank for block b of the other, as a
collective's channel blocks do). Rank 1's collective fills its device first, so its half of the
comet call cannot start; rank 0's comet kernel fills its device waiting for rank 1's data, so
rank 0's half of the collective cannot start either. Without a margin that ends in the comet
call's timeout error; with one, rank 0's collective runs on the slots the call leaves, and
everything completes."""

import itertools
import re
import threading
import time

import pytest
import torch

import comet
from comet import reference as ref
from comet._native import _C
from tests.cases import TOL

S = 4                      # resident-block slots of each rank's device
E, K, T, H, N0 = 4, 2, 6, 16, 8
COMET_TIMEOUT = 2.0        # the comet buffer's
COLLECTIVE_TIMEOUT = 15.0  # the collective's: it outlives the comet call's timeout
_tags = itertools.count(int(time.time()) * 1000)


def _inputs(rank):
    g = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(T, H, generator=g)
    w0 = torch.randn(E // 2, N0, H, generator=g) / 4
    ids = torch.randint(0, E, (T, K), generator=g)
    return x, w0, ids


def _run(margin, monkeypatch):
    """Per rank: (the comet call's y0 or the exception it raised, the collective's exception or
    None)."""
    monkeypatch.setenv("COMET_CPU_BLOCKS", str(S))  # the call's grid fills the device: 1 + 3
    bufs = comet.Buffer.simulated_world(2, timeout=COMET_TIMEOUT, resident_blocks=S,
                                        sm_margin=margin)
    tag = next(_tags)
    results = {}

    def comet_call(r):
        x, w0, ids = _inputs(r)
        try:
            results[("comet", r)] = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=bufs[r],
                                                     n_comm=1, tile=(8, 8))[0]
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            results[("comet", r)] = e

    def collective(r):
        try:
            _C.heap_device_collective(bufs[r].handle, S, tag, COLLECTIVE_TIMEOUT)
            results[("coll", r)] = None
        except Exception as e:  # noqa: BLE001
            results[("coll", r)] = e

    # Rank 1: the collective, filling its device; then both ranks' comet call; rank 0's
    # collective once rank 0's comet kernel holds its slots (S - margin of them), waiting for
    # rank 1's data. Each step starts when the slots say the one before it is in place.
    threads = []

    def start(fn, r):
        t = threading.Thread(target=fn, args=(r,), daemon=True)
        t.start()
        threads.append(t)

    def until(rank, slots, steady=0.3):
        """Until rank's device has had >= slots slots in use for `steady` seconds (a kernel
        waiting, not a prologue passing by)."""
        deadline, since = time.monotonic() + 10, None
        while True:
            now = time.monotonic()
            if _C.heap_slots_in_use(bufs[rank].handle) >= slots:
                since = now if since is None else since
                if now - since >= steady:
                    return
            else:
                since = None
            assert now < deadline, f"rank {rank} never held {slots} slots"
            time.sleep(0.005)

    try:
        start(collective, 1)
        until(1, S)
        start(comet_call, 0)
        start(comet_call, 1)
        until(0, S - margin)
        start(collective, 0)
        for t in threads:
            t.join(timeout=COLLECTIVE_TIMEOUT + 20)
            assert not t.is_alive(), "a group of calls hung"
    finally:
        for b in bufs:
            b.close()
    return [(results[("comet", r)], results[("coll", r)]) for r in range(2)]


def test_without_a_margin_the_opposite_orders_end_in_the_timeout_error(monkeypatch):
    got = _run(0, monkeypatch)
    errors = [c for c, _ in got if isinstance(c, Exception)]
    assert errors, "the comet call completed although its kernel held every slot"
    assert any("gave up after" in str(e) for e in errors), [str(e) for e in errors]


def test_with_a_margin_both_groups_complete(monkeypatch):
    got = _run(1, monkeypatch)
    xs, w0s, ids = zip(*(_inputs(r) for r in range(2)))
    y0_ref = ref.layer0_sim(list(xs), list(w0s), list(ids), E)
    for r, (y0, coll) in enumerate(got):
        assert coll is None, coll
        assert isinstance(y0, torch.Tensor), y0
        torch.testing.assert_close(y0, y0_ref[r], **TOL[torch.float32])


def test_a_margin_that_leaves_no_slot_fails_on_every_rank(monkeypatch):
    monkeypatch.setenv("COMET_CPU_BLOCKS", str(S))
    bufs = comet.Buffer.simulated_world(2, timeout=20, resident_blocks=S)
    errors = {}

    def call(r):
        x, w0, ids = _inputs(r)
        margin = S if r == 1 else None  # only rank 1's call is bad
        try:
            comet.moe_layer0(x, w0, ids, num_experts=E, buffer=bufs[r], sm_margin=margin)
        except ValueError as e:
            errors[r] = str(e)

    try:
        ts = [threading.Thread(target=call, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
    finally:
        for b in bufs:
            b.close()
    assert f"sm_margin={S} leaves none of this rank's {S} resident blocks" in errors[1]
    assert "rank 1" in errors[0]


@pytest.mark.parametrize("bad", [-2, 1.5, True])
def test_sm_margin_must_be_a_count(bad):
    with pytest.raises(ValueError, match="sm_margin"):
        comet.Buffer(sm_margin=bad)


def test_buffer_and_call_margins(monkeypatch):
    """The buffer's margin is the calls' default; a call's own overrides it (results equal)."""
    buf = comet.Buffer(sm_margin=1, resident_blocks=3, timeout=20)
    try:
        assert buf.sm_margin == 1
        x, w0, ids = _inputs(0)
        w0 = torch.cat([w0, w0])  # a world of one holds every expert
        a = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf)[0]
        b = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf, sm_margin=2)[0]
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        with pytest.raises(ValueError, match="sm_margin=3 leaves none"):
            comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf, sm_margin=3)
        with pytest.raises(ValueError, match=re.escape(
                "sm_margin (SMs left free for other kernels; -1: the buffer's) must be >= 0, "
                "got -2")):
            comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf, sm_margin=-2)
        with pytest.raises(TypeError, match=re.escape(
                ": sm_margin must be an int >= 0 (SMs left free for other kernels), got 0.5")):
            comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf, sm_margin=0.5)
    finally:
        buf.close()


def test_cuda_default_margin_only_where_peers_exist():
    """The stated rule (docs/gpu.md, "SM margin"): the margin guards against a deadlock across
    ranks, so a CUDA buffer created without one leaves 2 SMs free in a group of several ranks and
    none in a world of one."""
    from comet.buffers import symm_cuda

    assert [symm_cuda.default_sm_margin(w) for w in (1, 2, 3, 8, 16)] == [0, 2, 2, 2, 2]
