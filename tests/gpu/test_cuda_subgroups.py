"""CUDA buffers over expert-parallel subgroups of the NVSHMEM world (run with an even number of
GPUs >= 4: torchrun --nproc-per-node 4 -m pytest tests/gpu/test_cuda_subgroups.py -q -s): two
disjoint groups of W/2 run the fused ops at the same time, each matching the reference over its
own group; a subgroup buffer that would need to grow inside a call raises with the bytes it needs
on every rank of the group, and works after reserve(). Skips without a GPU (conftest.py)."""
import pytest
import torch
import torch.distributed as dist

import comet
from comet import reference as ref
from comet.buffers import symm_cuda
from tests.cases import TOL, cases_for, h_from_y0, make_inputs


def _groups(world):
    rank, w = world
    if w < 4 or w % 2:
        pytest.skip("needs an even world of at least 4 GPUs")
    half = w // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, w)))]
    return rank, w, half, groups[rank // half]


def test_two_expert_parallel_groups_at_once(world):
    rank, _w, half, mine = _groups(world)
    buf = symm_cuda.Buffer(mine)  # every process of the world at once, each for its own group
    assert buf.subgroup and (buf.rank, buf.world) == (rank % half, half)
    dev = torch.device("cuda", torch.cuda.current_device())
    r = rank % half
    for case in cases_for(half):
        xs, w0s, w1s, ids, wts = make_inputs(case, torch.bfloat16)
        buf.reserve(tokens=max(case.tokens) + 1, hidden=case.hidden, topk=case.topk,
                    num_experts=case.experts)
        y0, layout = comet.moe_layer0(xs[r].to(dev), w0s[r].to(dev), ids[r].to(dev),
                                      num_experts=case.experts, group=mine, buffer=buf)
        h = h_from_y0(y0, case.n1)
        out = comet.moe_layer1(h, w1s[r].to(dev), wts[r].to(dev), layout, group=mine, buffer=buf)
        y0_ref = ref.layer0_dist(xs[r], w0s[r], ids[r], case.experts, group=mine)
        out_ref = ref.layer1_dist(h.cpu(), w1s[r], wts[r], ids[r], case.experts, group=mine)
        torch.testing.assert_close(y0.cpu(), y0_ref, **TOL[torch.bfloat16])
        torch.testing.assert_close(out.cpu(), out_ref, **TOL[torch.bfloat16])
    buf.close()


def test_subgroup_buffer_does_not_grow_inside_a_call(world):
    rank, _w, half, mine = _groups(world)
    buf = symm_cuda.Buffer(mine, capacity_bytes=1 << 20)
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, N0, k, T = 2 * half, 4096, 256, 2, 2048  # x alone is 16 MiB per rank in bf16
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w0 = torch.randn(E // half, N0, H, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, k), device=dev)
    with pytest.raises(ValueError, match="cannot grow during a call"):
        comet.moe_layer0(x, w0, ids, num_experts=E, group=mine, buffer=buf)
    buf.reserve(tokens=T, hidden=H, topk=k, num_experts=E)
    y0, _layout = comet.moe_layer0(x, w0, ids, num_experts=E, group=mine, buffer=buf)
    torch.cuda.synchronize()
    assert y0.shape[1] == N0
    buf.close()
