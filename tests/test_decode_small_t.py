"""Decode-sized calls across processes (gloo on 127.0.0.1, 2 and 4 ranks): 0, 1, 2 or 5 tokens
per rank mixed across ranks and steps, every rank empty, top-8 over E = 16 and 32 experts, dropped
slots, fp32, bf16 and FP8, all at one fixed max_rows on one buffer (the CUDA-graph pattern: new
routing and values every step, static shapes).

Every step is checked against an oracle written here in float64 from the op's contract
(docs/api.md): the dispatch layout (rows by local expert, then source rank in ring order from
the destination, then token, then slot), y0 = x @ w0^T in it with zero rows past M, and out_s[t] =
sum_j w[t, j] h[row(s, t, j)] @ w1[e_j]^T. FP8 inputs enter the oracle dequantised here
(q * the scale of its block). Then each step's inputs run once more on a fresh buffer: the
results must be bitwise equal to those of the reused buffer."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks

TOPK = 8
# Not multiples of 128 (FP8's last scale block is partial); H and N1 multiples of 16 (the CUDA FP8
# kernels' K), so tests/gpu/test_cuda_decode.py runs the same steps.
H, N0, N1 = 48, 40, 32
MAX_T = 5
SIZES = (0, 1, 2, 5)
DTYPES = ("fp32", "bf16", "fp8")


def steps_for(world):
    """Tokens per rank, one tuple per step: {0, 1, 2, 5} rotated across the ranks (empty ranks,
    odd sizes, each rank a different size), then every rank empty, then one token each."""
    rot = [tuple(SIZES[(step + r) % len(SIZES)] for r in range(world)) for step in range(len(SIZES))]
    return rot + [(0,) * world, (1,) * world]
TOL = {"fp32": dict(atol=2e-5, rtol=2e-5), "bf16": dict(atol=3e-2, rtol=3e-2),
       "fp8": dict(atol=3e-2, rtol=3e-2)}


def _step_inputs(world, E, tokens, seed):
    """Every rank's inputs of one step, the same on every rank: x, top-8 distinct experts per
    token (about 1 in 6 slots dropped, id -1), weights, w0 / w1 per rank (float32)."""
    g = torch.Generator().manual_seed(seed)
    el = E // world
    xs, ids, wts = [], [], []
    for T in tokens:
        xs.append(torch.randn(T, H, generator=g))
        t_ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]) if T \
            else torch.empty(0, TOPK, dtype=torch.int64)
        t_ids[torch.rand(T, TOPK, generator=g) < 0.17] = -1
        ids.append(t_ids)
        wts.append(torch.rand(T, TOPK, generator=g))
    w0s = [torch.randn(el, N0, H, generator=g) / H ** 0.5 for _ in range(world)]
    w1s = [torch.randn(el, H, N1, generator=g) / N1 ** 0.5 for _ in range(world)]
    return xs, ids, wts, w0s, w1s


def _blocks(scale, shape):
    """A per-block scale expanded to every value: 128 values per block along each dimension where
    the scale has fewer entries than the values (rows: the columns; weights: N and K)."""
    for dim, n in enumerate(shape):
        if scale.shape[dim] != n:
            scale = scale.repeat_interleave(128, dim=dim).narrow(dim, 0, n)
    return scale


def _oracle_rows(world, E, ids, d):
    """The dispatch layout on destination d: (source, token, slot, local expert) per row."""
    el = E // world
    rows = []
    for e in range(el):
        for i in range(world):
            s = (d + i) % world
            for t in range(ids[s].shape[0]):
                for j in range(TOPK):
                    if int(ids[s][t, j]) == d * el + e:
                        rows.append((s, t, j, e))
    return rows


def one_step(rank, world, E, dtype, inp, R, buffer, dev, tile=None, ids_dtype=None,
             dispatch_fp8=False):
    """layer0 -> tanh -> layer1 on this rank's inputs on `dev` (FP8: quantised here, or with
    dispatch_fp8 by the op on the sending rank, the same bits) with `tile` (None: the tuner's) and
    the ids as `ids_dtype` (None: as made); returns y0 and out (on the CPU), h and the inputs as
    the op saw them (float64, FP8 dequantised)."""
    import comet
    from comet import fp8

    xs, ids, wts, w0s, w1s = inp
    x, w0, w1 = xs[rank].to(dev), w0s[rank].to(dev), w1s[rank].to(dev)
    ids_r, wts_r = ids[rank].to(dev, ids_dtype or ids[rank].dtype), wts[rank].to(dev)
    if dtype == "fp8":
        xq, xs_ = fp8.quantize_rows(x)
        w0q, w0s_ = fp8.quantize_blocks(w0)
        w1q, w1s_ = fp8.quantize_blocks(w1)
        sent = dict(dispatch_fp8=True) if dispatch_fp8 else dict(x_scale=xs_)
        y0, layout = comet.moe_layer0(x if dispatch_fp8 else xq, w0q, ids_r, num_experts=E,
                                      w0_scale=w0s_, max_rows=R, buffer=buffer, tile=tile, **sent)
        hq, hs = fp8.quantize_rows(torch.tanh(y0.float()[:, :N1]))
        out = comet.moe_layer1(hq, w1q, wts_r, layout, h_scale=hs, w1_scale=w1s_,
                               buffer=buffer, tile=tile)
        h_val = hq.double() * _blocks(hs.double(), hq.shape)
        used = dict(x=xq.double() * _blocks(xs_.double(), xq.shape),
                    w0=w0q.double() * _blocks(w0s_.double(), w0q.shape),
                    w1=w1q.double() * _blocks(w1s_.double(), w1q.shape))
    else:
        dt = torch.float32 if dtype == "fp32" else torch.bfloat16
        y0, layout = comet.moe_layer0(x.to(dt), w0.to(dt), ids_r, num_experts=E, max_rows=R,
                                      buffer=buffer, tile=tile)
        h = torch.tanh(y0.float()[:, :N1]).to(dt)
        out = comet.moe_layer1(h, w1.to(dt), wts_r, layout, buffer=buffer, tile=tile)
        h_val = h.double()
        used = dict(x=x.to(dt).double(), w0=w0.to(dt).double(), w1=w1.to(dt).double())
    used = {k: v.cpu() for k, v in used.items()}
    return y0.cpu(), out.cpu(), h_val.cpu(), used


def check_against_oracle(rank, world, E, dtype, inp, y0, out, h_val, used, label, gather,
                         zero_past_m=True):
    """y0 and out against the float64 oracle; gather(obj) -> every rank's obj, by rank; with
    zero_past_m, y0's rows past M must be zeros (the CPU backend's promise; unspecified on CUDA).
    Returns M."""
    xs, ids, wts, _, _ = inp
    # every rank's values as the op saw them (FP8: dequantised) and every rank's h
    gathered = {name: gather(used[name]) for name in ("x", "w0", "w1")}
    hs = gather(h_val)
    rows = _oracle_rows(world, E, ids, rank)
    M = len(rows)
    assert y0.shape == (h_val.shape[0], N0), (label, y0.shape)
    want = torch.zeros(y0.shape[0], N0, dtype=torch.float64)
    for r, (s, t, j, e) in enumerate(rows):
        want[r] = gathered["x"][s][t] @ gathered["w0"][rank][e].t()
    torch.testing.assert_close(y0[:M].double(), want[:M], **TOL[dtype],
                               msg=lambda m: f"rank {rank}, {label}: y0: {m}")
    assert not zero_past_m or not y0[M:].any(), \
        f"rank {rank}, {label}: rows past M = {M} are not zero"
    T = ids[rank].shape[0]
    want_out = torch.zeros(T, H, dtype=torch.float64)
    for d in range(world):
        for r, (s, t, j, e) in enumerate(_oracle_rows(world, E, ids, d)):
            if s == rank:
                want_out[t] += float(wts[rank][t, j]) * (hs[d][r] @ gathered["w1"][d][e].t())
    assert out.shape == (T, H), (label, out.shape)
    torch.testing.assert_close(out.double(), want_out, **TOL[dtype],
                               msg=lambda m: f"rank {rank}, {label}: out: {m}")
    return M


def run_steps(rank, world, experts, dtypes, dev, gather, fresh_buffer, tiles=(None,)):
    """Every step of steps_for(world) in every dtype on the group's buffer at one max_rows with
    tiles[0], checked against the oracle, then again on fresh_buffer() (closed after): bitwise
    equal (y0's first M rows, and out); then with each other tile of `tiles` on the group's
    buffer: bitwise equal to tiles[0]'s (the CUDA kernels' 64- and 128-row tiles run the same MMA
    instructions on each row in the same k order; the CPU backend's tile GEMM sums each output in
    k order whatever the tile).
    Returns (dtype, step, y0 rows, out shape) per call."""
    results = []
    R = world * MAX_T * min(TOPK, experts // world)  # the bound, fixed for every step
    for dtype in dtypes:
        for step, tokens in enumerate(steps_for(world)):
            inp = _step_inputs(world, experts, tokens, seed=100 * experts + step)
            label = f"E={experts} {dtype} step {step} tokens {tokens}"
            y0, out, h_val, used = one_step(rank, world, experts, dtype, inp, R, None, dev,
                                            tiles[0])
            M = check_against_oracle(rank, world, experts, dtype, inp, y0, out, h_val, used,
                                     label, gather, zero_past_m=dev.type == "cpu")
            fresh = fresh_buffer()
            try:
                y0_f, out_f, _, _ = one_step(rank, world, experts, dtype, inp, R, fresh, dev,
                                             tiles[0])
            finally:
                fresh.close()
            assert torch.equal(y0[:M], y0_f[:M]) and torch.equal(out, out_f), \
                f"rank {rank}, {label}: the reused buffer's result differs from a fresh buffer's"
            for tile in tiles[1:]:
                y0_t, out_t, _, _ = one_step(rank, world, experts, dtype, inp, R, None, dev, tile)
                assert torch.equal(y0[:M], y0_t[:M]) and torch.equal(out, out_t), \
                    f"rank {rank}, {label}: tile {tile} differs from tile {tiles[0]}"
            results.append((dtype, step, int(y0.shape[0]), tuple(out.shape)))
    return results


def check_results(results, world, experts, dtypes):
    for rank, res in enumerate(results):
        assert len(res) == len(dtypes) * len(steps_for(world)), rank
        # static shapes: every step's y0 has max_rows rows, whatever the step's tokens
        assert {r[2] for r in res} == {world * MAX_T * min(TOPK, experts // world)}, rank
        assert [r[3][0] for r in res] == [steps_for(world)[s][rank] for _, s, _, _ in res], rank


def _all_gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _run(rank, world, experts, tiles=(None,)):
    import comet

    return run_steps(rank, world, experts, DTYPES, torch.device("cpu"), _all_gather,
                     lambda: comet.Buffer(None), tiles)


@pytest.mark.parametrize("world,experts", [(2, 16), (2, 32), (4, 16), (4, 32)])
def test_small_batches_match_the_oracle_at_a_fixed_max_rows(world, experts):
    check_results(run_ranks(_run, world, experts, timeout=600), world, experts, DTYPES)


def test_the_cuda_tiles_give_the_same_bits():
    """The CUDA kernels' two tiles, 128 x 128 (checked against the oracle) and 64 x 128, on every
    step (tests/gpu/test_cuda_decode.py runs the same on a GPU)."""
    tiles = ((128, 128), (64, 128))
    check_results(run_ranks(_run, 2, 16, tiles, timeout=600), 2, 16, DTYPES)
