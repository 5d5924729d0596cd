"""layer0 moves each (source token, destination rank) pair across the link once (comm_layer0.h:
the token's primary row is pulled, its other slot rows on that rank are local copies of it).

Two kinds of check, ranks simulated as threads on the CPU backend:
- the same bits as the engine with the dedup switched off ($COMET_LAYER0_DEDUP=0, which pulls one
  row per slot): y0, the dispatched rows, each row's origin and out, for fp32, bf16 and FP8 rows,
  expert parallelism, EP x TP, placements with replicas, two nodes, thread teams, residency limits
  and random delays (COMET_STRESS);
- Buffer.traffic() against a count written here from the routing: the distinct (token,
  destination) pairs with destination != source, on awkward routing (skewed, a token with all k
  slots on one rank, the same expert twice in a token's top-k, dropped slots, empty ranks);
  across nodes also the node-reduced layer1, whose relays count the node-summed rows they
  forward (one per (token, node) with a slot there) as sent."""
import pytest
import torch

import comet
from comet import fp8
from comet.plan import Placement
from tests.sim_world import run_threads


def routing(tokens, E, k, seed, *, drop=0.2, skew=False):
    """Random ids [T, k] per rank, with the awkward cases in the first tokens: token 0's k slots
    on one rank's experts, token 1 naming the same expert twice, token 2 with every slot
    dropped; then `drop` of the slots dropped at random (-1)."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for T in tokens:
        t = torch.randint(0, E, (T, k), generator=g)
        if skew:  # half the slots on expert 0
            t = torch.where(torch.rand(T, k, generator=g) < 0.5, 0, t)
        if drop:
            t = torch.where(torch.rand(T, k, generator=g) < drop, -1, t)
        if T > 0:
            t[0] = torch.arange(k) % 2 + (E - 2)     # the last rank's experts only (E_local >= 2)
        if T > 1 and k > 1:
            t[1, 1] = t[1, 0] = int(torch.randint(0, E, (1,), generator=g))
        if T > 2:
            t[2] = -1
        ids.append(t.to(torch.int32))
    return ids


def distinct_remote_pairs(ids, rank, ep_rank_of_expert, ep_rank_of_rank):
    """The (source, token) pairs rank `rank` receives a row for from another rank: a source
    token counts once if any of its valid slots' experts lives on rank's EP rank."""
    mine = ep_rank_of_rank(rank)
    n = 0
    for s, t_ids in enumerate(ids):
        if s == rank:
            continue
        for row in t_ids.tolist():
            n += any(e >= 0 and ep_rank_of_expert(e) == mine for e in row)
    return n


def run(world, ids, E, *, dtype=torch.float32, H=32, N=24, tp=1, rpn=None, threads=None,
        resident=None, placement=None, fp8_rows=False, n_comm=2, dedup=True, node_reduce=None,
        monkeypatch=None):
    """layer0 -> tanh -> layer1 on every rank: (y0, a, row origins, out, traffic) per rank."""
    if monkeypatch is not None:
        monkeypatch.setenv("COMET_LAYER0_DEDUP", "1" if dedup else "0")
    g = torch.Generator().manual_seed(11)
    el = E // (world // tp) if placement is None else None
    w0 = torch.randn(E, N, H, generator=g) / H ** 0.5
    w1 = torch.randn(E, H, N, generator=g) / N ** 0.5
    xs = [torch.randn(len(t), H, generator=g).to(dtype) for t in ids]
    wts = [torch.rand(len(t), t.shape[1], generator=g) for t in ids]
    bufs = comet.Buffer.simulated_world(world, timeout=30, tp_size=tp,
                                        ranks_per_node=rpn or world, threads_per_block=threads,
                                        resident_blocks=resident, node_reduce=node_reduce)

    def rank(r, buf):
        if placement is not None:
            mine = list(placement.local_experts(r))
            w0r, w1r = w0[mine].contiguous(), w1[mine].contiguous()
        else:
            q, t = r // tp, r % tp
            w0r = w0[q * el:(q + 1) * el, t * N // tp:(t + 1) * N // tp].contiguous()
            w1r = w1[q * el:(q + 1) * el, :, t * N // tp:(t + 1) * N // tp].contiguous()
        kw = {} if placement is None else dict(placement=placement)
        if fp8_rows:
            w0q, w0s = fp8.quantize_blocks(w0r)
            y0, layout = comet.moe_layer0(xs[r], w0q, ids[r], num_experts=E, buffer=buf,
                                          n_comm=n_comm, tile=(8, 8), w0_scale=w0s,
                                          dispatch_fp8=True)
            return y0, layout, None, buf.traffic()
        y0, layout = comet.moe_layer0(xs[r], w0r.to(dtype), ids[r], num_experts=E, buffer=buf,
                                      n_comm=n_comm, tile=(8, 8), **kw)
        l0 = buf.traffic()
        out = comet.moe_layer1(torch.tanh(y0.float()).to(dtype), w1r.to(dtype), wts[r], layout,
                               buffer=buf, n_comm=n_comm, tile=(8, 8))
        l1 = buf.traffic()
        assert l1[:2] == l0[:2]  # layer1 leaves layer0's counts alone
        return y0, layout, out, l1

    return run_threads(world, rank, buffers=bufs)


def bits(t):
    return t.contiguous().view(torch.uint8)


def assert_same_bits(a, b):
    for (y0a, la, outa, _), (y0b, lb, outb, _) in zip(a, b):
        assert y0a.dtype == y0b.dtype and torch.equal(bits(y0a), bits(y0b))
        for f in ("row_source", "row_token", "row_slot", "recv_counts", "send_pos"):
            assert torch.equal(getattr(la, f), getattr(lb, f)), f
        if outa is not None:
            assert torch.equal(bits(outa), bits(outb))


def both(monkeypatch, *args, **kw):
    on = run(*args, dedup=True, monkeypatch=monkeypatch, **kw)
    off = run(*args, dedup=False, monkeypatch=monkeypatch, **kw)
    assert_same_bits(on, off)
    return on, off


CONFIGS = {
    "ep4-k4-fp32": dict(world=4, E=8, k=4, tokens=(9, 0, 13, 5)),
    "ep4-k8-bf16-skew": dict(world=4, E=12, k=8, tokens=(7, 11, 3, 0), dtype=torch.bfloat16,
                             skew=True),
    "ep3-E6-odd": dict(world=3, E=6, k=3, tokens=(4, 9, 2), H=20),
    "ep1tp4": dict(world=4, E=4, k=4, tokens=(6, 5, 0, 7), tp=4),
    "ep2tp2": dict(world=4, E=6, k=3, tokens=(5, 0, 8, 3), tp=2, dtype=torch.bfloat16),
    "two-nodes": dict(world=4, E=8, k=4, tokens=(8, 6, 0, 9), rpn=2),
    "threads4-resident1": dict(world=2, E=4, k=4, tokens=(12, 10), threads=4, resident=1,
                               n_comm=3),
    "threads2": dict(world=3, E=6, k=4, tokens=(10, 3, 6), threads=2),
}


def _split(cfg):
    cfg = dict(cfg)
    world, E, k, tokens = cfg.pop("world"), cfg.pop("E"), cfg.pop("k"), cfg.pop("tokens")
    skew = cfg.pop("skew", False)
    return world, E, routing(tokens, E, k, seed=world * 100 + E, skew=skew), cfg


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_bits_as_one_row_per_slot_and_traffic_is_distinct_pairs(name, monkeypatch):
    world, E, ids, kw = _split(CONFIGS[name])
    on, off = both(monkeypatch, world, ids, E, **kw)
    tp = kw.get("tp", 1)
    el = E // (world // tp)
    elem = kw.get("dtype", torch.float32).itemsize
    H = kw.get("H", 32)
    for r in range(world):
        pairs = distinct_remote_pairs(ids, r, lambda e: e // el, lambda d: d // tp)
        slots = sum(int(((t >= 0) & (t // el == r // tp)).sum()) for s, t in enumerate(ids)
                    if s != r)
        assert on[r][3] == comet.Traffic(pairs, pairs * H * elem, pairs, pairs * H * elem), r
        # without the dedup every slot's row crosses (what the switch is there to compare with)
        assert off[r][3].layer0_rows == slots
        assert off[r][3].layer1_rows == pairs
    # the routing has tokens with several slots on one remote rank, so the dedup saved rows
    assert sum(o[3].layer0_rows for o in on) < sum(o[3].layer0_rows for o in off)


def test_stress_delays(monkeypatch):
    monkeypatch.setenv("COMET_STRESS", "5")
    world, E, ids, kw = _split(CONFIGS["ep4-k4-fp32"])
    both(monkeypatch, world, ids, E, **kw)


def test_fp8_rows(monkeypatch):
    """FP8 rows travel packed with their scales: traffic counts the packed bytes."""
    world, E, ids, kw = _split(dict(world=2, E=4, k=4, tokens=(9, 7)))
    on, _ = both(monkeypatch, world, ids, E, fp8_rows=True, H=256, N=128)
    rb = fp8.row_bytes(256)
    for r in range(world):
        pairs = distinct_remote_pairs(ids, r, lambda e: e // 2, lambda d: d)
        assert on[r][3][:2] == (pairs, pairs * rb)


def test_placement_with_replicas(monkeypatch):
    """Replicas of one expert on one rank and several experts of a token on a rank: the token
    still crosses once per rank. The count comes from each row's origin in the layout (which
    test_placement checks against the route table)."""
    W = 4
    p = Placement([[0, 1, 2], [0], [1, 3], [1], [2], [2], [3], [3]], world=W)
    ids = routing((8, 5, 0, 9), 8, 4, seed=3)
    on, _ = both(monkeypatch, W, ids, 8, placement=p)
    for r, (_, layout, _, tr) in enumerate(on):
        src, tok = layout.row_source.tolist(), layout.row_token.tolist()
        pairs = {(s, t) for s, t in zip(src, tok) if s != r}
        assert tr.layer0_rows == len(pairs), r


@pytest.mark.parametrize("W,E,k,tp", [(8, 32, 4, 1), (8, 256, 8, 1), (8, 32, 4, 4), (8, 32, 4, 8)])
def test_cost_model_rows_are_the_distinct_pairs(W, E, k, tp):
    """The cost model's layer0 rows (comet.tune: one per (token, remote rank)) against the same
    count as traffic() is held to, on sampled uniform routing (k distinct experts per token)."""
    from comet.tune import perfmodel as pm

    T = 4000
    g = torch.Generator().manual_seed(W * E + k + tp)
    ids = [torch.rand(T, E, generator=g).topk(k, dim=1).indices for _ in range(W)]
    el = E // (W // tp)
    count = sum(distinct_remote_pairs(ids, r, lambda e: e // el, lambda d: d // tp)
                for r in range(W)) / W
    shape = pm.MoEShape(W=W, E=E, k=k, H=128, N=128, T=T, tp_size=tp,
                        tp_path=pm.BUILT_TP_PATH if tp > 1 else None)
    assert pm.remote_rows(shape, 0) == pytest.approx(count, rel=0.02)


def layer1_sent_node_reduced(ids, r, el, rpn):
    """Rows rank r sends in a node-reduced layer1, counted here from the routing alone, as
    (partials, forwarded): per (home h != r, token) with a slot on r, one partial row to h when h
    is on r's node, else to h's relay on r's node (the rank there with h's local index), which is
    another rank unless that relay is r; and, as relay, one node-summed row per (token of h, r's
    node) for every home h on another node with r's local index whose token has a slot on r's
    node."""
    node = lambda x: x // rpn
    partials = forwarded = 0
    for h, t_ids in enumerate(ids):
        for row in t_ids.tolist():
            ranks = {e // el for e in row if e >= 0}
            if h != r and r in ranks:
                to = h if node(h) == node(r) else node(r) * rpn + h % rpn
                partials += to != r
            if node(h) != node(r) and h % rpn == r % rpn:
                forwarded += any(node(d) == node(r) for d in ranks)
    return partials, forwarded


@pytest.mark.parametrize("node_reduce", [False, True], ids=["flat", "node-reduced"])
@pytest.mark.parametrize("world,rpn", [(4, 2), (6, 3)], ids=["2x2", "2x3"])
def test_traffic_across_nodes(world, rpn, node_reduce):
    """Two nodes, bf16, skewed routing with dropped slots and an empty rank: layer0 counts the
    distinct (token, rank) reads at each destination; layer1 counts every rank's partial rows to
    other ranks, and node-reduced also the relays' forwarded node-summed rows."""
    E, k, H = {4: 8, 6: 6}[world], 4, 32  # 2x3: E_local = 1, E = 6 not a power of two
    tokens = (7, 0, 11, 5, 9, 3)[:world]
    ids = routing(tokens, E, k, seed=77 + world, skew=True)
    res = run(world, ids, E, dtype=torch.bfloat16, rpn=rpn, node_reduce=node_reduce, H=H)
    el = E // world
    relayed = 0
    for r in range(world):
        pairs = distinct_remote_pairs(ids, r, lambda e: e // el, lambda d: d)
        sent = pairs
        if node_reduce:
            partials, forwarded = layer1_sent_node_reduced(ids, r, el, rpn)
            sent, relayed = partials + forwarded, relayed + forwarded
        assert res[r][3] == comet.Traffic(pairs, pairs * H * 2, sent, sent * H * 2), r
    assert relayed > 0 or not node_reduce  # the routing makes the relays forward rows


def test_traffic_across_nodes_fp8_rows():
    """FP8 rows across two nodes: the destinations' reads count their packed bytes."""
    world, E, k = 4, 8, 4
    ids = routing((9, 0, 7, 6), E, k, seed=5, skew=True)
    res = run(world, ids, E, fp8_rows=True, H=256, N=128, rpn=2)
    rb = fp8.row_bytes(256)
    for r in range(world):
        pairs = distinct_remote_pairs(ids, r, lambda e: e // 2, lambda d: d)
        assert res[r][3][:2] == (pairs, pairs * rb), r
