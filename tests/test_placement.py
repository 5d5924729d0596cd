"""The ops with an expert placement (placement=, comet/layers/placed.py) on the CPU backend, ranks
simulated as threads (gloo processes for the module's replica gradients and migrate).

Forward: out against a dense fp64 reference over the logical experts (fp32 tight, bf16 ~2e-2),
and BITWISE equal across placements (contiguous, replicated hot experts with uneven E_r, a rank
holding 0 experts), with dropped slots and skewed routing, on one node and on 2 nodes of 2; y0
rows equal up to their order. The default (no placement) is the plain ops' path. Backward: the
gradients of x, topk_weights and each replica's w0 / w1 (the rows it served) against the
reference. Bad input: a clear error on every rank before any kernel. A placement built without
world= completes to the group (its last ranks holding nothing) on the ops, Buffer and the module,
bitwise as the same map given with world=; a given world that is not the group's raises."""
import pytest
import torch

import comet
import comet.nn
from comet.plan import Placement, route_table
from tests.sim_world import run_threads

W, E, H, N = 4, 6, 16, 12
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

PLACEMENTS = {
    # E = 6 is not divisible by W = 4: no contiguous map; 8 experts below for that one
    "uneven": Placement([[0, 1, 2], [1], [2], [3], [3], [0]], world=W),   # E_r = 2, 2, 2, 2 / hot 0, 1
    "zero": Placement([[0], [0, 1], [1], [3], [3], [0, 3]], world=W),     # rank 2 holds nothing
    "all": Placement([[0, 1, 2, 3], [1], [2], [3], [0], [1, 2]], world=W),
}
CONTIG8 = Placement.contiguous(8, W)
PLACEMENTS8 = {
    "contiguous": CONTIG8,
    "replicated": Placement([[0, 1, 2], [0], [1, 3], [1], [2], [2], [3], [3]], world=W),
    "zero": Placement([[0], [0], [1], [1, 0], [3], [3], [3], [1]], world=W),
}


def act(y):
    return torch.tanh(y.float()).to(y.dtype)


def make(num_experts, dtype, tokens=(5, 0, 7, 3), k=2, drop=0.25, skew=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(num_experts, N, H, generator=g) / H ** 0.5).to(dtype)
    w1 = (torch.randn(num_experts, H, N, generator=g) / N ** 0.5).to(dtype)
    b0 = (0.1 * torch.randn(num_experts, N, generator=g)).to(dtype)
    b1 = (0.1 * torch.randn(num_experts, H, generator=g)).to(dtype)
    xs, ids, wts = [], [], []
    for T in tokens:
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        logits = torch.randn(T, num_experts, generator=g)
        if skew:  # Zipf-like: low ids hot
            logits -= 1.5 * torch.arange(num_experts).float().log1p()
        top = torch.topk(logits, k, dim=1).indices
        if drop:
            top = torch.where(torch.rand(T, k, generator=g) < drop, -1, top)
        ids.append(top.to(torch.int32))
        wts.append(torch.rand(T, k, generator=g))
    return xs, w0, w1, b0, b1, ids, wts


def reference(x, w0, w1, b0, b1, ids, wts):
    """Dense fp64: out[t] = sum_j w_j * (act(x W0[e]^T + b0[e]) W1[e]^T + b1[e])."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            y = x[t].double() @ w0[e].double().T + b0[e].double()
            h = torch.tanh(y)
            out[t] += float(wts[t, j]) * (h @ w1[e].double().T + b1[e].double())
    return out


def local(w, placement, r):
    return w[list(placement.local_experts(r))].contiguous()


def _layers(r, buf, leaves, ids_r, num_experts, grad, **layer0_kw):
    """Rank r's layer0 -> tanh -> layer1 on leaves (x, w0, w1, b0, b1, topk_weights) and, with
    grad, the leaves' gradients of a seeded random projection of out: (y0, layout, out, grads)."""
    x, w0r, w1r, b0r, b1r, wt = leaves
    y0, layout = comet.moe_layer0(x, w0r, ids_r, num_experts=num_experts, b0=b0r, buffer=buf,
                                  n_comm=1, tile=(8, 8), **layer0_kw)
    out = comet.moe_layer1(act(y0), w1r, wt, layout, b1=b1r, buffer=buf, n_comm=1, tile=(8, 8))
    grads = None
    if grad:
        seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + r))
        (out * seed.to(out.dtype)).sum().backward()
        grads = [leaf.grad for leaf in leaves]
    return y0.detach(), layout, out.detach(), grads


def run(placement, inputs, *, ranks_per_node=W, grad=False, bufs=None, max_rows=None):
    xs, w0, w1, b0, b1, ids, wts = inputs
    bufs = bufs or comet.Buffer.simulated_world(W, timeout=20, ranks_per_node=ranks_per_node)

    def rank(r, buf):
        if placement is None:
            el = w0.shape[0] // W
            mine = list(range(r * el, (r + 1) * el))
        else:
            mine = list(placement.local_experts(r))
        w0r, w1r, b0r, b1r = (w[mine].contiguous() for w in (w0, w1, b0, b1))
        x, wt = xs[r].clone(), wts[r].clone()
        leaves = [x, w0r, w1r, b0r, b1r, wt]
        if grad:
            for leaf in leaves:
                leaf.requires_grad_(True)
        return _layers(r, buf, leaves, ids[r], w0.shape[0], grad, placement=placement,
                       max_rows=max_rows)

    return run_threads(W, rank, buffers=bufs)


def y0_rows(results, inputs):
    """Every rank's y0 rows keyed by (source, token, slot): placement-independent."""
    rows = {}
    for y0, layout, _, _ in results:
        M = int(layout.recv_counts.sum())
        for i in range(M):
            key = (int(layout.row_source[i]), int(layout.row_token[i]), int(layout.row_slot[i]))
            rows[key] = y0[i]
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rpn", [W, 2])
def test_out_is_bitwise_equal_across_placements(dtype, rpn):
    inputs = make(8, dtype)
    xs, w0, w1, b0, b1, ids, wts = inputs
    base = None
    for name, p in PLACEMENTS8.items():
        res = run(p, inputs, ranks_per_node=rpn)
        for r, (_, _, out, _) in enumerate(res):
            want = reference(xs[r], w0, w1, b0, b1, ids[r], wts[r])
            torch.testing.assert_close(out.double(), want, **TOL[dtype], msg=f"{name} rank {r}")
        outs, rows = [o for _, _, o, _ in res], y0_rows(res, inputs)
        if base is None:
            base = (outs, rows)
            continue
        for r in range(W):
            assert torch.equal(outs[r], base[0][r]), f"{name}: rank {r} out differs bitwise"
        assert rows.keys() == base[1].keys()
        for key, row in rows.items():
            assert torch.equal(row, base[1][key]), f"{name}: y0 row {key} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_is_each_slots_row_summed_in_slot_order(dtype):
    """out[t] = the k weighted slot rows of token t added in fp32 in slot order, rounded once to
    the dtype: the rows come from a call where each (token, slot) is a token of its own (k = 1),
    the sum is written out here. k = 4, so a different order or a rounding per step changes the
    bits."""
    k = 4
    p = PLACEMENTS8["replicated"]
    inputs = make(8, dtype, tokens=(6, 0, 9, 5), k=k, seed=21)
    xs, w0, w1, b0, b1, ids, wts = inputs
    one_slot = ([x.repeat_interleave(k, dim=0) for x in xs], w0, w1, b0, b1,
                [i.reshape(-1, 1) for i in ids], [w.reshape(-1, 1) for w in wts])
    outs = [o for _, _, o, _ in run(p, inputs)]
    rows = [o for _, _, o, _ in run(p, one_slot)]
    for r in range(W):
        slot_rows = rows[r].view(-1, k, H)
        acc = slot_rows[:, 0].float()
        acc = acc + slot_rows[:, 1].float()
        acc = acc + slot_rows[:, 2].float()
        acc = acc + slot_rows[:, 3].float()
        assert torch.equal(outs[r], acc.to(dtype)), f"rank {r}"


def test_rows_go_where_the_route_table_says():
    p = PLACEMENTS["uneven"]
    inputs = make(E, torch.float32, tokens=(6, 4, 5, 3))
    ids = inputs[5]
    res = run(p, inputs)
    table = route_table(p)
    for d, (_, layout, _, _) in enumerate(res):
        M = int(layout.recv_counts.sum())
        assert layout.recv_counts.shape == (W, max(p.slots()))
        for i in range(M):
            s, t, j = (int(layout.row_source[i]), int(layout.row_token[i]),
                       int(layout.row_slot[i]))
            assert table[s][int(ids[s][t, j])] == d
        want = sum(1 for s in range(W) for e in ids[s].flatten().tolist()
                   if e >= 0 and table[s][e] == d)
        assert M == want


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_uneven_placements_match_reference_and_each_other(name):
    inputs = make(E, torch.float32, seed=3)
    xs, w0, w1, b0, b1, ids, wts = inputs
    outs = [o for _, _, o, _ in run(PLACEMENTS[name], inputs)]
    for r in range(W):
        want = reference(xs[r], w0, w1, b0, b1, ids[r], wts[r])
        torch.testing.assert_close(outs[r].double(), want, **TOL[torch.float32])
    other = [o for _, _, o, _ in run(PLACEMENTS["all"], inputs)]
    assert all(torch.equal(a, b) for a, b in zip(outs, other))


def test_default_is_the_contiguous_map():
    """Without placement= the ops run today's map (expert e on rank e // (E/W)), not the by-slot
    path: no routes in the layout, each rank's rows those of its own experts in comet.reference's
    dispatch order, out at the reference's tolerance."""
    from comet import reference as ref

    inputs = make(8, torch.bfloat16, seed=5)
    xs, w0, w1, b0, b1, ids, wts = inputs
    for r, (_, layout, out, _) in enumerate(run(None, inputs)):
        assert layout.routes is None and tuple(layout.recv_counts.shape) == (W, 8 // W)
        got = [(int(layout.row_source[i]), int(layout.row_token[i]), int(layout.row_slot[i]))
               for i in range(int(layout.recv_counts.sum()))]
        want = [(row.source, row.token, row.slot)
                for row in ref.dispatch_rows([i.long() for i in ids], 8, r)]
        assert got == want, f"rank {r}"
        torch.testing.assert_close(out.double(), reference(xs[r], w0, w1, b0, b1, ids[r], wts[r]),
                                   **TOL[torch.bfloat16])


def test_backward_matches_reference_per_replica():
    """Each replica's w0 / w1 / b0 / b1 gradient covers the rows it served (the raw ops do not
    sum over replicas); summed over a logical expert's replicas they are the reference's."""
    p = PLACEMENTS8["replicated"]
    inputs = make(8, torch.float32, seed=11)
    xs, w0, w1, b0, b1, ids, wts = inputs
    res = run(p, inputs, grad=True)
    gw = [torch.zeros_like(w, dtype=torch.float64) for w in (w0, w1, b0, b1)]
    refw = [w.double().clone().requires_grad_(True) for w in (w0, w1, b0, b1)]
    for r, (_, _, out, grads) in enumerate(res):
        x = xs[r].double().clone().requires_grad_(True)
        wt = wts[r].double().clone().requires_grad_(True)
        for i, g in enumerate(grads[1:5]):
            gw[i][list(p.local_experts(r))] += g.double()
        if x.shape[0] == 0:
            continue
        want = reference_autograd(x, *refw, ids[r], wt)
        seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + r))
        (want * seed.double()).sum().backward()
        torch.testing.assert_close(grads[0].double(), x.grad, **TOL[torch.float32])
        torch.testing.assert_close(grads[5].double(), wt.grad, **TOL[torch.float32])
    for i in range(4):
        torch.testing.assert_close(gw[i], refw[i].grad, **TOL[torch.float32])
    # a replica that served no rows gets a zero gradient, not its sibling's
    table = route_table(p)
    for r in range(W):
        for slot, e in enumerate(p.local_experts(r)):
            served = any(table[s][v] == r for s in range(W) for v in ids[s].flatten().tolist()
                         if v == e)
            if not served:
                assert torch.count_nonzero(res[r][3][1][slot]) == 0


def reference_autograd(x, w0, w1, b0, b1, ids, wts):
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(H, dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = torch.tanh(x[t] @ w0[e].T + b0[e])
            acc = acc + wts[t, j] * (h @ w1[e].T + b1[e])
        rows.append(acc)
    return torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.float64)


def _errors(fn, world=W):
    """fn(rank, buf) on every rank; the error text each rank raised (None: none)."""
    def body(r, buf):
        try:
            fn(r, buf)
        except (ValueError, RuntimeError) as e:
            return str(e)
        return None
    return run_threads(world, body, buffers=comet.Buffer.simulated_world(world, timeout=10))


def _call(placement_of, w0_of=None, ids_of=None):
    inputs = make(8, torch.float32, tokens=(3, 3, 3, 3), drop=0)
    xs, w0, w1, b0, b1, ids, wts = inputs

    def fn(r, buf):
        p = placement_of(r)
        w = w0_of(r, p, w0) if w0_of else local(w0, p, r)
        comet.moe_layer0(xs[r], w, ids_of(r, ids) if ids_of else ids[r], num_experts=8,
                         buffer=buf, n_comm=1, tile=(8, 8), placement=p)
    return fn


def test_placements_that_differ_across_ranks_fail_on_every_rank():
    other = PLACEMENTS8["zero"]
    msgs = _errors(_call(lambda r: other if r == 2 else CONTIG8,
                         w0_of=lambda r, p, w0: local(w0, p, r)))
    assert all(m and "placement" in m for m in msgs), msgs


def test_weights_that_do_not_match_the_placement_fail_on_every_rank():
    p = PLACEMENTS8["replicated"]   # rank 1 holds 3 slots (experts 0, 2, 3)
    msgs = _errors(_call(lambda r: p, w0_of=lambda r, q, w0: w0[:2] if r == 1 else local(w0, q, r)))
    assert all(m and "E_r=3" in m for m in msgs), msgs


def test_expert_id_out_of_range_and_wrong_world_fail_on_every_rank():
    msgs = _errors(_call(lambda r: CONTIG8, ids_of=lambda r, ids: ids[r] + 8 * (r == 1)))
    assert all(m and "out of range" in m for m in msgs), msgs
    p3 = Placement([[0], [1], [2], [0], [1], [2], [0], [1]], world=3)
    msgs = _errors(_call(lambda r: p3, w0_of=lambda r, p, w0: w0[:2]))
    assert all(m and "world=3" in m for m in msgs), msgs


def test_placement_errors_in_the_plan():
    with pytest.raises(ValueError, match="no replica"):
        Placement([[0], [], [1]], world=2)
    with pytest.raises(ValueError, match="out of range"):
        Placement([[0], [5]], world=4)


# -- gloo: the module's replica gradients and migrate ----------------------------------------------

def _module_body(rank, world):
    import torch.distributed as dist
    from comet.nn import MoE, allreduce_gradients

    torch.manual_seed(0)
    old = Placement.contiguous(8, world)
    new = PLACEMENTS8["replicated"]
    buf = comet.Buffer(dist.group.WORLD, timeout=20)
    m = MoE(H, 8, 8, 2, buffer=buf, placement=new, dtype=torch.float32, aux_loss_coeff=0,
            n_comm=1, tile=(8, 8))
    dense = MoE(H, 8, 8, 2, buffer=buf, dtype=torch.float32, aux_loss_coeff=0, n_comm=1,
                tile=(8, 8))
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(rank))
    out, want = m(x), dense(x)
    same = torch.equal(out, want)  # per-expert init: the same model on any placement
    err = float((out - want).abs().max())
    out.square().sum().backward()
    want.square().sum().backward()
    allreduce_gradients(m)
    allreduce_gradients(dense)
    # after the sum every replica holds its logical expert's full gradient = the dense one's
    mine = list(new.local_experts(rank))
    gathered = [torch.zeros(8, *dense.w0.shape[1:]) for _ in range(world)]
    dist.all_gather(gathered, torch.cat([torch.zeros(rank * 2, *dense.w0.shape[1:]),
                                         dense.w0.grad,
                                         torch.zeros((world - rank - 1) * 2,
                                                     *dense.w0.shape[1:])]))
    full_g = sum(gathered)
    g_err = float((m.w0.grad - full_g[mine]).abs().max()) if mine else 0.0
    # migrate: contiguous -> new moves dense's weights (and Adam state) onto new's slots
    opt = torch.optim.Adam(dense.parameters(), lr=1e-3)
    opt.step()
    w0_id = id(dense.w0)
    avg = opt.state[dense.w0]["exp_avg"].clone()
    full_avg = sum(_all_gather_padded(avg, rank, world))
    before = (dense.w0.data.clone(), dense.w1.data.clone())
    dense.migrate(new, optimizer=opt)
    moved_ok = (id(dense.w0) == w0_id and dense.w0.shape[0] == len(mine) and
                torch.equal(opt.state[dense.w0]["exp_avg"], full_avg[mine]))
    back = comet.plan.migrate(new, old, dense.w0.data, dense.w1.data)
    return same, err, g_err, moved_ok, all(torch.equal(b, w) for b, w in zip(back, before))


def _all_gather_padded(t, rank, world):
    import torch.distributed as dist
    full = torch.zeros(8, *t.shape[1:])
    full[rank * 2:(rank + 1) * 2] = t
    out = [torch.zeros_like(full) for _ in range(world)]
    dist.all_gather(out, full)
    return out


def test_module_replica_gradients_and_migrate_on_gloo():
    from tests.dist_utils import run_ranks

    for same, err, g_err, moved_ok, back_ok in run_ranks(_module_body, W, timeout=120):
        assert err < 1e-5 and g_err < 1e-5 and moved_ok and back_ok, (same, err, g_err, moved_ok)


def test_migration_sources_prefer_the_rank_itself():
    from comet.plan import migration_sources

    old, new = CONTIG8, PLACEMENTS8["replicated"]
    for r in range(W):
        for e, s in zip(new.local_experts(r), migration_sources(old, new, r)):
            assert r in old.replicas(e) and s == r or s in old.replicas(e)


def _bits(t):
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def _migrate_there_and_back(rank, world, pairs):
    """For each (old, new): this rank's slices of per-expert tensors of every dtype migrate takes
    (specials among the values: -0.0, infinities, subnormals, values that round in 16 bits), moved
    to new and back; (bitwise equal to the experts' rows under new, back bitwise equal)."""
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(8, 3, 5, generator=g),                        # w0, fp32
            torch.randn(8, 4, generator=g).to(torch.bfloat16),        # w1, bf16
            torch.randn(8, 2, 2, generator=g).to(torch.float16),      # extras: fp16, fp64
            torch.randn(8, 3, generator=g, dtype=torch.float64) * 1e-3 + 1.0]
    specials = torch.tensor([-0.0, float("inf"), -float("inf"), 1e-40, 3e-310, 1 + 2 ** -40])
    for t in full:
        flat = t.view(-1)
        flat[:len(specials)] = specials.to(t.dtype)
    results = []
    for old, new in pairs:
        mine = [t[list(old.local_experts(rank))] for t in full]
        there = comet.plan.migrate(old, new, *mine)
        back = comet.plan.migrate(new, old, *there)
        want = [t[list(new.local_experts(rank))] for t in full]
        results.append((all(a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
                            for a, b in zip(there, want)),
                        all(a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
                            for a, b in zip(back, mine))))
    return results


def test_migrate_there_and_back_is_bitwise_the_original():
    from tests.dist_utils import run_ranks

    pairs = [(CONTIG8, PLACEMENTS8["replicated"]), (PLACEMENTS8["replicated"], PLACEMENTS8["zero"]),
             (PLACEMENTS8["zero"], CONTIG8)]
    for r, res in enumerate(run_ranks(_migrate_there_and_back, W, pairs, timeout=120)):
        for (old, new), (there, back) in zip(pairs, res):
            assert there, f"rank {r}: {old} -> {new} is not the experts' rows under new"
            assert back, f"rank {r}: {old} -> {new} -> {old} is not the original bit for bit"


BAD_CALLS = {
    "not a placement": (dict(placement="x"),
                        [": placement must be a comet.plan.Placement, got"]),
    "world": (dict(placement=Placement([[0], [1], [2]] * 2 + [[0], [1]], world=3)),
              [": the placement is for world=", "but the group"]),
    "num_experts": (dict(num_experts=7), [": num_experts=", "but the placement places"]),
    "tp": (dict(tp_size=2), [": tp_size=", "> 1 is not supported with a placement",
                             "(expert tensor parallelism needs the contiguous map)"]),
    "slots": (dict(w0=lambda w: w[:1]), ["experts but the placement gives rank"]),
    "id": (dict(ids=lambda i: i + 8), ["comet.moe_layer0: topk_ids holds expert",
                                       ", out of range for"]),
    "weights": (dict(weights=lambda w: w[:, :1]), ["comet.moe_layer1: topk_weights has shape"]),
    "fp8": (dict(dispatch_fp8=True), [": FP8 (", ") with a placement is not",
                                      "supported (FP8 runs on the contiguous map)"]),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_each_placement_check_raises_on_every_rank(case):
    bad, fragments = BAD_CALLS[case]
    inputs = make(8, torch.float32, tokens=(3, 3, 3, 3), drop=0)
    xs, w0, w1, b0, b1, ids, wts = inputs

    def fn(r, buf):
        p = CONTIG8
        w0r, w1r = local(w0, p, r), local(w1, p, r)
        mod = (lambda key: bad.get(key) if r == 1 else None)
        y0, layout = comet.moe_layer0(
            xs[r], mod("w0")(w0r) if mod("w0") else w0r,
            mod("ids")(ids[r]) if mod("ids") else ids[r],
            num_experts=(mod("num_experts") or 8), buffer=buf, n_comm=1, tile=(8, 8),
            placement=(mod("placement") or p), tp_size=mod("tp_size"),
            dispatch_fp8=bool(mod("dispatch_fp8")))
        wt = mod("weights")(wts[r]) if mod("weights") else wts[r]
        comet.moe_layer1(act(y0), w1r, wt, layout, buffer=buf, n_comm=1, tile=(8, 8))

    msgs = _errors(fn)
    for m in msgs:
        assert m and all(f in m for f in fragments), (case, msgs)


def test_bench_placement_smoke(tmp_path):
    """python -m bench.placement --smoke: out bitwise equal across the three placements (it
    checks), balance with one spare slot within 1.25 of the mean rows under Zipf 1.2."""
    import json

    from bench import placement as bp

    assert bp.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "placement_smoke.json").read_text())["rows"]
    assert {r["placement"] for r in rows} == {"contiguous", "lysi_assign", "balance"}
    for r in rows:
        if r["placement"] == "balance":
            assert r["max_over_mean"] <= 1.25, r


def test_virtual_ids_follow_the_route_table():
    """placed.virtual_ids: slot i of the serving rank, rank-major; -1 stays; ids >= E leave the
    virtual range (what the CUDA path relies on, without a host check)."""
    from comet.layers import placed

    p = PLACEMENTS["zero"]
    S = max(p.slots())
    for s in range(W):
        routes = placed.placed_routes(p, s, None)
        ids = torch.tensor([[0, 1, -1], [5, 4, 6]])
        v = placed.virtual_ids(routes, ids)
        table = route_table(p)
        for e, got in zip(ids.flatten().tolist(), v.flatten().tolist()):
            if e < 0:
                assert got == e
            elif e >= E:
                assert got >= W * S
            else:
                d = table[s][e]
                assert got == d * S + p.local_experts(d).index(e)


def test_buffer_placement_is_the_default():
    """Buffer(placement=p): the ops' default placement= and comet.nn.MoE's."""
    p = PLACEMENTS8["zero"]
    inputs = make(8, torch.float32, seed=2)
    want = [o for _, _, o, _ in run(p, inputs)]
    bufs = comet.Buffer.simulated_world(W, timeout=20, placement=p)
    xs, w0, w1, b0, b1, ids, wts = inputs

    def rank(r, buf):
        mine = list(p.local_experts(r))
        y0, layout = comet.moe_layer0(xs[r], w0[mine], ids[r], num_experts=8, b0=b0[mine],
                                      buffer=buf, n_comm=1, tile=(8, 8))
        out = comet.moe_layer1(act(y0), w1[mine], wts[r], layout, b1=b1[mine], buffer=buf,
                               n_comm=1, tile=(8, 8))
        moe = comet.nn.MoE(H, 8, 8, 2, buffer=buf)
        return out, layout.routes.placement, moe.placement, moe.w0.shape[0], moe.local_experts

    for r, (out, lp, mp, er, le) in enumerate(run_threads(W, rank, buffers=bufs)):
        assert torch.equal(out, want[r]) and lp == p and mp == p
        assert er == len(p.local_experts(r)) and le == p.local_experts(r)


def test_row_bound_gives_the_same_out():
    """max_rows (the sync-free path's static shapes) with a placement: the same out bitwise."""
    p = PLACEMENTS8["replicated"]
    inputs = make(8, torch.bfloat16, seed=4)
    free = [o for _, _, o, _ in run(p, inputs)]
    bound = run(p, inputs, max_rows=40)
    for r, (y0, layout, out, _) in enumerate(bound):
        assert y0.shape[0] == 40 and layout.num_rows == 40
        assert torch.equal(out, free[r])


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def placements(draw):
    """Any placement of 4..9 experts on W ranks: 1..W replicas each, ranks holding 0 allowed."""
    E_ = draw(st.integers(4, 9))
    reps = [draw(st.lists(st.integers(0, W - 1), min_size=1, max_size=W, unique=True))
            for _ in range(E_)]
    return Placement(reps, world=W)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(p=placements(), seed=st.integers(0, 1000))
def test_any_placement_gives_the_reference_bitwise_alike(p, seed):
    """Hypothesis: out of any placement equals a one-replica-per-expert placement's bitwise and
    the reference at fp32 tolerance."""
    E_ = p.num_experts
    single = Placement([[e % W] for e in range(E_)], world=W)
    inputs = make(E_, torch.float32, tokens=(4, 2, 0, 5), seed=seed)
    xs, w0, w1, b0, b1, ids, wts = inputs
    got = [o for _, _, o, _ in run(p, inputs)]
    base = [o for _, _, o, _ in run(single, inputs)]
    for r in range(W):
        assert torch.equal(got[r], base[r])
        torch.testing.assert_close(got[r].double(), reference(xs[r], w0, w1, b0, b1, ids[r],
                                                              wts[r]), **TOL[torch.float32])


# -- a placement built without world= completes to the group (Placement.for_world) ---------------

# (expert -> ranks map, group size): the map names fewer ranks than the group has, so the
# group's last rank (or last two) holds no expert; built without world= it completes to the group.
TRAILING = {
    "3 ranks, last empty": ([[0], [1, 0], [0], [1], [1]], 3),
    "3 ranks, last two empty": ([[0], [0], [0], [0]], 3),
    "4 ranks, last empty": ([[0, 1], [1], [2], [0], [2, 1]], 4),
    "4 ranks, last two empty": ([[0], [1], [0, 1], [1], [0]], 4),
    "4 ranks, middle and last empty": ([[0], [2], [0, 2], [2], [0]], 4),
}


def _holds(expert_ranks, r):
    """Rank r's slots straight from the expert -> ranks map (the oracle, not Placement's)."""
    return [e for e, ranks in enumerate(expert_ranks) if r in ranks]


def _run_group(placement, expert_ranks, inputs, world, *, bufs=None, grad=True):
    """The ops on `world` simulated ranks with `placement` (None: the buffers' own); per rank
    (layout, out, grads of x, w0, w1, b0, b1, topk_weights)."""
    xs, w0, w1, b0, b1, ids, wts = inputs
    bufs = bufs or comet.Buffer.simulated_world(world, timeout=20)

    def rank(r, buf):
        mine = _holds(expert_ranks, r)
        leaves = [xs[r].clone()] + [w[mine].contiguous() for w in (w0, w1, b0, b1)] + \
            [wts[r].clone()]
        for leaf in leaves:
            leaf.requires_grad_(grad)
        kw = {} if placement is None else dict(placement=placement)
        return _layers(r, buf, leaves, ids[r], w0.shape[0], grad, **kw)[1:]

    return run_threads(world, rank, buffers=bufs, timeout=60)


@pytest.mark.parametrize("case", list(TRAILING))
def test_trailing_empty_ranks_complete_to_the_group(case):
    """Forward and backward against the fp64 reference, and bitwise equal to the same map given
    with world= (out and every gradient)."""
    expert_ranks, world = TRAILING[case]
    E_ = len(expert_ranks)
    implicit = Placement(expert_ranks)
    assert implicit.world < world and not implicit.explicit_world
    explicit = Placement(expert_ranks, world=world)
    tokens = (5, 0, 7, 3)[:world]
    inputs = make(E_, torch.float32, tokens=tokens, seed=13)
    xs, w0, w1, b0, b1, ids, wts = inputs
    got = _run_group(implicit, expert_ranks, inputs, world)
    want = _run_group(explicit, expert_ranks, inputs, world)
    gw = [torch.zeros_like(w, dtype=torch.float64) for w in (w0, w1, b0, b1)]
    refw = [w.double().clone().requires_grad_(True) for w in (w0, w1, b0, b1)]
    for r, ((layout, out, grads), (_, out_x, grads_x)) in enumerate(zip(got, want)):
        assert layout.routes.placement == explicit and layout.routes.placement.world == world
        assert torch.equal(out, out_x), f"{case}: rank {r} out differs from world={world}'s"
        for i, (g, gx) in enumerate(zip(grads, grads_x)):
            assert torch.equal(g, gx), f"{case}: rank {r} gradient {i} differs bitwise"
        mine = _holds(expert_ranks, r)
        assert grads[1].shape[0] == len(mine)  # a trailing rank's w0 is [0, N, H]
        for i, g in enumerate(grads[1:5]):
            gw[i][mine] += g.double()
        torch.testing.assert_close(out.double(), reference(xs[r], w0, w1, b0, b1, ids[r], wts[r]),
                                   **TOL[torch.float32])
        if xs[r].shape[0] == 0:
            continue
        x = xs[r].double().clone().requires_grad_(True)
        wt = wts[r].double().clone().requires_grad_(True)
        ref = reference_autograd(x, *refw, ids[r], wt)
        seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + r))
        (ref * seed.double()).sum().backward()
        torch.testing.assert_close(grads[0].double(), x.grad, **TOL[torch.float32])
        torch.testing.assert_close(grads[5].double(), wt.grad, **TOL[torch.float32])
    for i in range(4):  # summed over each expert's replicas: the reference's weight gradients
        torch.testing.assert_close(gw[i], refw[i].grad, **TOL[torch.float32])


def test_trailing_empty_rank_through_buffer_and_module():
    """Buffer(placement=) and comet.nn.MoE complete it too: buffer.placement and moe.placement
    are the group's, the last rank's module holds no expert, and out is bitwise that of the
    same map given with world= (and of another placement of the same experts)."""
    expert_ranks, world = TRAILING["3 ranks, last empty"]
    E_ = len(expert_ranks)
    implicit, explicit = Placement(expert_ranks), Placement(expert_ranks, world=world)
    inputs = make(E_, torch.float32, tokens=(4, 6, 3), seed=17)
    bufs = comet.Buffer.simulated_world(world, timeout=20, placement=implicit)
    assert all(b.placement == explicit and b.placement.world == world for b in bufs)
    got = _run_group(None, expert_ranks, inputs, world, bufs=bufs, grad=False)
    want = _run_group(explicit, expert_ranks, inputs, world, grad=False)
    for (_, out, _), (_, out_x, _) in zip(got, want):
        assert torch.equal(out, out_x)

    other = Placement([[0], [1], [2], [0], [2]], world=world)
    x_all = torch.randn(world, 5, H, generator=torch.Generator().manual_seed(3))

    def module(r, buf):
        outs = []
        for kw in (dict(buffer=buf), dict(buffer=buf, placement=implicit),
                   dict(buffer=buf, placement=other)):
            moe = comet.nn.MoE(H, 8, E_, 2, dtype=torch.float32, aux_loss_coeff=0, n_comm=1,
                               tile=(8, 8), **kw)
            outs.append((moe.placement, moe.w0.shape[0], moe.local_experts, moe(x_all[r])))
        return outs

    for r, outs in enumerate(run_threads(world, module, buffers=bufs, timeout=60)):
        for mp, er, le, _ in outs[:2]:
            assert mp == explicit and mp.world == world
            assert er == len(_holds(expert_ranks, r)) and list(le) == _holds(expert_ranks, r)
        if r == world - 1:
            assert outs[0][1] == 0  # the last rank holds no expert
        base = outs[2][3]
        assert torch.equal(outs[0][3], base) and torch.equal(outs[1][3], base)


@pytest.mark.parametrize("world", [3, 4])
def test_an_explicit_world_that_is_not_the_groups_raises_on_every_rank(world):
    """world= given and not the group's: the ops (placement= and the Buffer's default) raise on
    every rank, each with the placement's world and the group's size; so does a map naming a
    rank past the group (built without world=)."""
    expert_ranks = [[0], [1], [0], [1]]
    inputs = make(4, torch.float32, tokens=(3,) * world, drop=0)
    xs, w0, w1, b0, b1, ids, wts = inputs

    def call(p, buf_p=None):
        def fn(r, buf):
            kw = {} if buf_p else dict(placement=p)
            mine = _holds(expert_ranks, r)
            comet.moe_layer0(xs[r], w0[mine], ids[r], num_experts=4, buffer=buf, n_comm=1,
                             tile=(8, 8), **kw)
        bufs = comet.Buffer.simulated_world(world, timeout=10, placement=buf_p)
        return run_threads(world, lambda r, buf: _catch(fn, r, buf), buffers=bufs, timeout=60)

    for wrong in sorted({2, world - 1, world + 1}):
        p = Placement(expert_ranks, world=wrong)
        for msgs in (call(p), call(None, buf_p=p)):
            assert len(msgs) == world
            for m in msgs:
                assert m and f"the placement is for world={wrong} but the group has {world} " \
                    "ranks" in m, (wrong, msgs)
    past = Placement([[0], [1], [world], [1]])  # names rank `world`: no group rank
    for m in call(past):
        assert m and f"world={world + 1} (expert 2 is on rank {world}) but the group has " \
            f"{world} ranks" in m, m
    # the module raises with the same message, at construction, on every rank
    for m in run_threads(world, lambda r, buf: _catch(
            lambda r_, b: comet.nn.MoE(H, 8, 4, 2, buffer=b, placement=Placement(
                expert_ranks, world=2)), r, buf),
            buffers=comet.Buffer.simulated_world(world, timeout=10), timeout=60):
        assert m and "comet.nn.MoE: the placement is for world=2 but the group has" in m, m


def _catch(fn, r, buf):
    try:
        fn(r, buf)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def test_planner_placements_keep_their_world():
    """balance and lysi_assign know their world: their placements keep it (a trailing worker
    with no memory stays in the placement), run on that group and raise on another."""
    from comet.plan import balance, lysi_assign

    loads = [5.0, 3.0, 2.0, 1.0, 1.0]
    q = balance(loads, world=3, slots_per_rank=2)
    assert q.explicit_world and q.world == 3 and q.for_world(3) is q
    lysi = lysi_assign([1.0, 1.0, 1.0], loads, slots=[3, 3, 0])  # worker 2 holds nothing
    assert lysi.explicit_world and lysi.world == 3 and lysi.slots()[2] == 0
    assert Placement(lysi.expert_ranks).world == 2  # what the map alone would infer
    for p in (q, lysi):
        for wrong in (2, 4):
            with pytest.raises(ValueError, match=f"for world=3 but the group has {wrong} ranks"):
                p.for_world(wrong)
    inputs = make(5, torch.float32, tokens=(4, 3, 5), seed=19)
    xs, w0, w1, b0, b1, ids, wts = inputs
    for p in (q, lysi):
        ranks = [list(r) for r in p.expert_ranks]
        for r, (layout, out, _) in enumerate(_run_group(p, ranks, inputs, 3, grad=False)):
            assert layout.routes.placement == p
            torch.testing.assert_close(out.double(), reference(xs[r], w0, w1, b0, b1, ids[r],
                                                               wts[r]), **TOL[torch.float32])
    xs4 = make(5, torch.float32, tokens=(3,) * 4, drop=0)

    def fn(r, buf):
        comet.moe_layer0(xs4[0][r], w0[:0], xs4[5][r], num_experts=5, buffer=buf, n_comm=1,
                         tile=(8, 8), placement=lysi)
    msgs = run_threads(4, lambda r, buf: _catch(fn, r, buf),
                       buffers=comet.Buffer.simulated_world(4, timeout=10), timeout=60)
    assert all(m and "the placement is for world=3 but the group has 4 ranks" in m
               for m in msgs), msgs


def _trailing_module_body(rank, world):
    """comet.nn.MoE on gloo with a map that leaves the last rank empty, built without world=:
    the module, its replica gradient sum and migrate complete it to the group."""
    import torch.distributed as dist
    from comet.nn import MoE, allreduce_gradients

    buf = comet.Buffer(dist.group.WORLD, timeout=20)
    implicit = Placement([[0], [0, 1], [1], [1]])       # expert 1 on ranks 0 and 1; rank 2: none
    single = Placement([[0], [1], [2], [0]], world=world)
    kw = dict(buffer=buf, dtype=torch.float32, aux_loss_coeff=0, n_comm=1, tile=(8, 8))
    m, ref = MoE(H, 8, 4, 2, placement=implicit, **kw), MoE(H, 8, 4, 2, placement=single, **kw)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(rank))
    out, want = m(x), ref(x)
    same = torch.equal(out, want)
    slots = m.w0.shape[0]
    out.square().sum().backward()
    want.square().sum().backward()
    allreduce_gradients(m)
    allreduce_gradients(ref)

    def dense(mod, w):  # [E, ...] of every expert's summed gradient (one replica per expert)
        d = torch.zeros(4, *w.shape[1:])
        d[list(mod.local_experts)] = w.grad
        dist.all_reduce(d)
        return d

    full0, full1 = dense(ref, ref.w0), dense(ref, ref.w1)
    mine = list(m.local_experts)
    g_err = max(float((m.w0.grad - full0[mine]).abs().max()),
                float((m.w1.grad - full1[mine]).abs().max())) if mine else 0.0
    # migrate to another map without world= (rank 2 still empty), then forward again
    before = (m.w0.data.clone(), m.w1.data.clone())
    m.migrate(Placement([[1], [0], [1], [0]]))
    moved = (m.placement.world == world and m.placement == Placement([[1], [0], [1], [0]],
                                                                      world=world)
             and m.w0.shape[0] == len(m.placement.local_experts(rank)))
    with torch.no_grad():
        again = torch.equal(m(x), ref(x))
    back = comet.plan.migrate(Placement([[1], [0], [1], [0]]), implicit, m.w0.data, m.w1.data)
    back_ok = all(torch.equal(b, w) for b, w in zip(back, before))  # replicas are equal
    try:
        comet.plan.migrate(Placement([[1], [0], [1], [0]], world=2), implicit, m.w0.data,
                           m.w1.data)
        wrong = None
    except ValueError as e:
        wrong = str(e)
    return (same, g_err, slots, moved, again, back_ok, wrong)


def test_trailing_empty_rank_module_and_migrate_on_gloo():
    from tests.dist_utils import run_ranks

    for r, (same, g_err, er, moved, again, back_ok, wrong) in enumerate(
            run_ranks(_trailing_module_body, 3, timeout=120)):
        assert same and g_err < 1e-5 and moved and again and back_ok, (r, same, g_err, moved)
        assert er == (2, 3, 0)[r]  # E_r of [[0], [0, 1], [1], [1]] on 3 ranks
        assert wrong and "migrate: the placement is for world=2 but the group has 3 ranks" in wrong
