"""moe_layer1 with layouts that do not match the peers' routing (recv_counts edited, h resized to
match so every local host check passes), through the raw op on the CPU backend over a simulated
world of 3 ranks (E = 6, dropped slots, an empty rank in the good calls). docs/reliability.md,
"A layout that does not match the routing":

  totals differ   (one rank's layout gains or loses a row) the call metadata's verdict refuses
                  the call on every rank at once, naming the group's routed rows and every
                  rank's layout rows; nothing moved, no re-arm, the next call is good
  totals agree    (a row moved from rank 0's layout to rank 1's) only the reduce plans can
                  tell: a rank whose plan does not match raises the layout error with both row
                  counts, its peers stop at once (not after the timeout), every rank's buffer
                  needs recovery, and after recover() on every rank the next call is good

Good calls are compared with a float64 oracle written here."""
import re
import time

import pytest
import torch

import comet
from tests.cases import TOL
from tests.sim_world import run_threads

W, E, K, H, N = 3, 6, 2, 8, 12
EL = E // W
LAUNCH = (1, 1, 4, 8)  # n_comm, n_gemm, tile_m, tile_n
TIMEOUT_S = 5.0


def _tokens(rank, seed):
    return ((5, 7, 4), (6, 0, 3))[seed % 2][rank]  # seed 2: rank 1 has no tokens


def _inputs(rank, seed):
    g = torch.Generator().manual_seed(100 * seed + rank)
    T = _tokens(rank, seed)
    x = torch.randn(T, H, generator=g)
    w0 = torch.randn(EL, N, H, generator=g) / 4
    w1 = torch.randn(EL, H, N, generator=g) / 4
    ids = torch.randint(0, E, (T, K), generator=g)
    if T > 1:
        ids[1, 1] = -1  # a dropped slot
    if T > 0:  # every rank routes a row to rank 0 and to rank 1: it waits for both
        ids[0, 0], ids[0, 1] = 0, EL
    wts = torch.rand(T, K, generator=g)
    return x, w0, w1, ids, wts


def _oracle(rank, seed):
    """out of `rank`: sum_j wts[t, j] * W1[e] (W0[e] x[t]) over its slots with an expert id,
    float64, expert e's weights from the rank that holds it (e // E_local)."""
    x, _, _, ids, wts = _inputs(rank, seed)
    w0 = [_inputs(r, seed)[1].double() for r in range(W)]
    w1 = [_inputs(r, seed)[2].double() for r in range(W)]
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            if e >= 0:
                y = w0[e // EL][e % EL] @ x[t].double()
                out[t] += float(wts[t, j]) * (w1[e // EL][e % EL] @ y)
    return out.float()


def _edited(rc, y0, delta):
    """The layout with `delta` rows more in its first non-empty cell, and h with as many rows, so
    this rank's own row-count check passes."""
    rc = rc.clone()
    cell = int((rc.flatten() > 0).nonzero()[0])
    rc.view(-1)[cell] += delta
    h = y0[:delta] if delta < 0 else torch.cat([y0, torch.zeros(delta, y0.shape[1])])
    return rc, h


def _good_call(rank, buf, seed):
    x, w0, w1, ids, wts = _inputs(rank, seed)
    y0, layout = comet.moe_layer0(x, w0, ids, num_experts=E, buffer=buf, tile=LAUNCH[2:])
    out = comet.moe_layer1(y0, w1, wts, layout, buffer=buf, tile=LAUNCH[2:])
    torch.testing.assert_close(out, _oracle(rank, seed), **TOL[torch.float32])


def _run(rank, buf, deltas):
    """layer0, then the raw layer1 with this rank's layout edited by deltas[rank]; what it raised
    and how long it took, the recovery state, then a good call (after recover() if needed)."""
    x, w0, w1, ids, wts = _inputs(rank, 1)
    y0, _a, rc, sp, *_ = torch.ops.comet.moe_layer0(x, w0, ids, E, buf.handle, *LAUNCH)
    rows = int(rc.sum())
    h = y0
    if deltas[rank]:
        rc, h = _edited(rc, y0, deltas[rank])
    t0 = time.monotonic()
    try:
        torch.ops.comet.moe_layer1(h, w1, wts, ids, sp, rc, E, buf.handle, *LAUNCH)
        seen = None
    except Exception as e:  # noqa: BLE001 - inspected by the test
        seen = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    needed = buf.needs_recovery
    if needed:
        buf.recover()
    _good_call(rank, buf, 2)
    return {"seen": seen, "took": took, "rows": rows, "routed": int((ids >= 0).sum()),
            "needed": needed, "after": buf.needs_recovery}


@pytest.mark.parametrize("delta", [-1, 2], ids=["row_fewer", "rows_more"])
def test_layout_totals_not_matching_the_routing_are_refused_on_every_rank_at_once(delta):
    deltas = (0, delta, 0)
    res = run_threads(W, lambda r, b: _run(r, b, deltas), timeout=60, comm_timeout=TIMEOUT_S)
    routed = sum(r["routed"] for r in res)
    layouts = [r["rows"] + d for r, d in zip(res, deltas)]
    assert sum(layouts) == routed + delta
    want = (f"the layouts do not match the routing: the group's routing sends {routed} rows but "
            f"its layouts (recv_counts) dispatch {routed + delta} (rank 0: {layouts[0]}, "
            f"rank 1: {layouts[1]}, rank 2: {layouts[2]})")
    for r in res:
        kind, msg = r["seen"]
        assert kind == "ValueError" and want in msg, r
        assert r["took"] < TIMEOUT_S / 2, r
        assert (r["needed"], r["after"]) == (False, False), r  # nothing moved: no re-arm


def test_layout_moved_between_ranks_fails_in_the_reduce_plan_then_recover():
    deltas = (-1, 1, 0)  # the group's totals still agree
    res = run_threads(W, lambda r, b: _run(r, b, deltas), timeout=60, comm_timeout=TIMEOUT_S)
    pattern = re.compile(r"the peers' routing sends rank (\d) (at least )?(\d+) rows but its "
                         r"layout \(recv_counts\) dispatches (\d+)")
    named = []
    for rank, r in enumerate(res):
        assert r["seen"] is not None, f"rank {rank} did not raise"
        kind, msg = r["seen"]
        found = pattern.search(msg)
        if found:
            assert kind == "ValueError" and int(found.group(1)) == rank, r
            sent, layout = int(found.group(3)), int(found.group(4))
            assert layout == r["rows"] + deltas[rank], r
            # the routing's true count, or "at least" the entries counted when they overflowed
            assert sent == r["rows"] if not found.group(2) else layout < sent <= r["rows"], r
            named.append(rank)
        else:  # stopped by the failing rank's fault flag, at once
            assert kind == "RuntimeError" and re.search(r"rank [01] stopped this call", msg), r
            assert r["took"] < TIMEOUT_S / 2, r
    assert named and set(named) <= {0, 1}, res  # only an edited layout fails its plan
    assert [(r["needed"], r["after"]) for r in res] == [(True, False)] * W, res
