"""Property tests of the portable engine's planning code (the same C++ the CPU backend runs and the
CUDA kernels compile): send plan, dispatch layout, m-tiles, tile orders and partial slots, for
random worlds W in 1..8, expert counts, topk, token counts (including 0) and tile shapes."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comet import _C
from comet import reference as ref

eng = _C.engine


# CPU grids (blocks, threads per block) the planning programs run on: results must not depend on it.
GRIDS = [(1, 1), (3, 1), (5, 1), (1, 4), (2, 4), (3, 2)]  # (blocks, threads per block)


@st.composite
def worlds(draw):
    W = draw(st.integers(1, 8))
    el = draw(st.integers(1, 3))
    E = W * el
    k = draw(st.integers(1, 4))
    ids = []
    for _ in range(W):
        T = draw(st.integers(0, 9))
        flat = draw(st.lists(st.integers(-1, E - 1), min_size=T * k, max_size=T * k))
        ids.append(torch.tensor(flat, dtype=torch.int64).reshape(T, k))
    grid = draw(st.sampled_from(GRIDS))
    return W, E, k, ids, grid


def plans(W, E, k, ids, grid):
    return [eng.send_plan(t.reshape(-1).int().tolist(), t.shape[0], k, E, *grid) for t in ids]


def recv_counts_for(plan_list, dest, W, el):
    counts = []
    for s in range(W):
        bo = plan_list[s][0]
        counts += [bo[dest * el + e + 1] - bo[dest * el + e] for e in range(el)]
    return counts


@settings(max_examples=150, deadline=None)
@given(worlds())
def test_send_plan_buckets_every_valid_slot_once_in_order(world):
    W, E, k, ids, grid = world
    for t_ids, (bucket_off, send_slot, send_pos) in zip(ids, plans(W, E, k, ids, grid)):
        flat = t_ids.reshape(-1).tolist()
        valid = [i for i, e in enumerate(flat) if e >= 0]
        assert sorted(send_slot) == valid  # a permutation of the valid slots
        for e in range(E):
            bucket = send_slot[bucket_off[e]:bucket_off[e + 1]]
            assert bucket == sorted(i for i in valid if flat[i] == e)  # (token, slot) order
            for pos, i in enumerate(bucket):
                assert send_pos[i] == pos
        assert all(send_pos[i] == -1 for i, e in enumerate(flat) if e < 0)


@settings(max_examples=150, deadline=None)
@given(worlds())
def test_dispatch_rows_match_the_reference_order(world):
    W, E, k, ids, grid = world
    el = E // W
    pl = plans(W, E, k, ids, grid)
    for d in range(W):
        # The begin kernel's program on the drawn grid: recv_counts gathered from the sources'
        # bucket offsets and the layout, equal to the layout of the given counts on one thread.
        counts, expert_off, seg_off = eng.gather_dispatch_layout([p[0] for p in pl], d, el, *grid)
        assert counts == recv_counts_for(pl, d, W, el)
        assert (expert_off, seg_off) == eng.dispatch_layout(counts, d, W, el)
        rows = ref.dispatch_rows(ids, E, d)
        assert expert_off[-1] == len(rows)
        position = {}
        for s in range(W):
            flat = ids[s].reshape(-1).tolist()
            for i, e in enumerate(flat):
                if e >= 0 and e // el == d:
                    row = eng.dispatch_row(seg_off, W, d, s, e % el, pl[s][2][i])
                    position[(s, i // k, i % k)] = row
        assert sorted(position.values()) == list(range(len(rows)))  # every row exactly once
        for r, row in enumerate(rows):
            assert position[(row.source, row.token, row.slot)] == r


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.sampled_from(GRIDS), st.data())
def test_dispatch_layout_refuses_a_negative_count(W, el, grid, data):
    counts = data.draw(st.lists(st.integers(0, 5), min_size=W * el, max_size=W * el))
    counts[data.draw(st.integers(0, W * el - 1))] = -1
    d = data.draw(st.integers(0, W - 1))
    try:
        eng.dispatch_layout(counts, d, W, el, *grid)
    except ValueError as e:
        assert "negative" in str(e)
    else:
        raise AssertionError("a negative recv_count was accepted")


@settings(max_examples=150, deadline=None)
@given(worlds(), st.integers(1, 6), st.integers(1, 4))
def test_tile_orders(world, tile_m, num_ntiles):
    W, E, k, ids, grid = world
    el = E // W
    pl = plans(W, E, k, ids, grid)
    for d in range(W):
        expert_off, seg_off = eng.dispatch_layout(recv_counts_for(pl, d, W, el), d, W, el)
        mtiles = eng.mtiles(expert_off, tile_m, *grid)
        # m-tiles cover each expert's rows exactly, never straddling experts
        covered = [r for (b, n, _e) in mtiles for r in range(b, b + n)]
        assert covered == list(range(expert_off[-1]))
        assert all(expert_off[e] <= b and b + n <= expert_off[e + 1] and 0 < n <= tile_m
                   for (b, n, e) in mtiles)
        all_tiles = sorted((m, n) for m in range(len(mtiles)) for n in range(num_ntiles))
        # layer0: a permutation; ring distance never decreases, so local-only tiles come first
        o0 = eng.tile_order(0, expert_off, seg_off, W, tile_m, num_ntiles, *grid)
        assert sorted(o0) == all_tiles
        dist = [eng.mtile_ring_distance(expert_off, seg_off, W, tile_m, m) for m, _ in o0]
        assert dist == sorted(dist)
        for m, _ in o0:  # the ring distance is the farthest source among the tile's rows
            b, n, e = mtiles[m]
            rows_src = [next(p for p in range(W) if seg_off[e * (W + 1) + p] <= r < seg_off[e * (W + 1) + p + 1])
                        for r in range(b, b + n)]
            assert max(rows_src) == eng.mtile_ring_distance(expert_off, seg_off, W, tile_m, m)
        # layer1: column-major across every expert
        o1 = eng.tile_order(1, expert_off, seg_off, W, tile_m, num_ntiles, *grid)
        assert o1 == [(m, n) for n in range(num_ntiles) for m in range(len(mtiles))]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3), st.data())
def test_partial_slot_is_the_rank_ordinal_among_distinct_destinations(W, el, data):
    k = data.draw(st.integers(1, 5))
    ids = data.draw(st.lists(st.integers(-1, W * el - 1), min_size=k, max_size=k))
    dests = sorted({e // el for e in ids if e >= 0})
    for d in dests:
        count, ordinal = eng.partial_slot(ids, el, d)
        assert count == len(dests) <= min(k, W)
        assert ordinal == dests.index(d)
