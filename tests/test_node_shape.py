"""comet.buffers.node_shape: the nodes of a CUDA buffer's group, inferred from who reaches whom by pointer
(every rank's nvshmem_ptr row, gathered by comet.buffers.symm_cuda.Buffer). Pure Python: no GPU needed.
Also the host-side pieces of the inter-node transport's build and static check that need no GPU:
the proxy is the only -rdc source, and check_ptxas keeps NVSHMEM's own functions' spills apart."""
import os
import sys

import pytest

from comet.buffers.node_shape import ranks_per_node

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nodes_matrix(world, n):
    """What NVSHMEM reports for nodes of n consecutive ranks."""
    return [[r // n == s // n for s in range(world)] for r in range(world)]


@pytest.mark.parametrize("world,n", [(1, 1), (2, 2), (8, 8), (8, 4), (8, 2), (8, 1), (6, 3),
                                     (12, 4)])
def test_whole_nodes_of_consecutive_ranks(world, n):
    assert ranks_per_node(nodes_matrix(world, n)) == n


def test_interleaved_nodes_are_refused_naming_the_ranks():
    # Ranks 0, 2 on one node and 1, 3 on the other: not consecutive.
    m = [[(r % 2) == (s % 2) for s in range(4)] for r in range(4)]
    with pytest.raises(ValueError, match=r"rank 0 reaches ranks 0, 2 by pointer"):
        ranks_per_node(m)


def test_a_rank_that_misses_a_node_mate_is_named():
    m = nodes_matrix(8, 4)
    m[5][6] = False  # no P2P between GPUs 5 and 6
    m[6][5] = False
    with pytest.raises(ValueError, match=r"rank 5 reaches 4, 5, 7 \(not 6 of its node\); "
                                         r"rank 6 reaches 4, 6, 7 \(not 5 of its node\)"):
        ranks_per_node(m)


def test_a_rank_reaching_another_node_is_named():
    m = nodes_matrix(8, 4)
    m[2][4] = True  # asymmetric: 2 reaches 4, 4 does not reach 2
    with pytest.raises(ValueError, match=r"rank 2 reaches 0..4 \(also 4 of another node\)"):
        ranks_per_node(m)


def test_node_size_must_divide_the_group():
    m = [[(r < 4) == (s < 4) for s in range(6)] for r in range(6)]  # nodes of 4 and 2
    with pytest.raises(ValueError, match="n dividing the group of 6"):
        ranks_per_node(m)


def test_bad_rows():
    with pytest.raises(ValueError, match="empty group"):
        ranks_per_node([])
    with pytest.raises(ValueError, match="rank 1 reported reachability for 1 ranks"):
        ranks_per_node([[True, True], [True]])
    with pytest.raises(ValueError, match="rank 1 cannot reach its own"):
        ranks_per_node([[True, False], [False, False]])


def test_only_the_proxy_is_relocatable_device_code():
    sys.path.insert(0, ROOT)
    try:
        import comet_build
    finally:
        sys.path.pop(0)
    sources = comet_build.cuda_sources(ROOT)
    rdc = [s for s in sources if comet_build.is_rdc(s)]
    assert rdc == [os.path.join("csrc", "cuda", "proxy.cu")]
    for s in sources:  # the fused kernels' TUs stay non-rdc (ptxas would serialise wgmma)
        assert ("-rdc=true" in comet_build.source_flags(s)) == comet_build.is_rdc(s)
    assert "-rdc=true" not in comet_build.NVCC_FLAGS


def test_sm89_fp8_sources_are_built_for_sm89_only():
    """The sm_89 FP8 kernels (FP8 mma.sync exists from sm_89) are compiled for sm_89 alone, outside
    the ninja list; every other CUDA source is in the ninja list, for the build's architectures."""
    sys.path.insert(0, ROOT)
    try:
        import comet_build
    finally:
        sys.path.pop(0)
    sources = comet_build.cuda_sources(ROOT)
    own = sorted(s for s in sources if "fused_sm89_fp8" in s)
    assert own == [os.path.join("csrc", "cuda", f"fused_sm89_fp8_layer{i}.cu") for i in (0, 1)]
    for s in own:
        assert list(comet_build.source_archs(s)) == ["89"]
    ninja = comet_build.ninja_cuda_sources(ROOT)
    assert sorted(ninja + own + [os.path.join("csrc", "cuda", "proxy.cu")]) == sorted(sources)
    for s in ninja:
        assert list(comet_build.source_archs(s)) == comet_build.archs()


LOG = """\
ptxas info    : Compiling entry function '__nv_static_29__c1eff56a_8_proxy_cu_73416e4b__ZN5comet3gpu40_GLOBAL__N__c1eff56a_8_proxy_cu_73416e4b12proxy_kernelENS0_11ProxyParamsE' for 'sm_90a'
ptxas info    : Function properties for __nv_static_29__c1eff56a_8_proxy_cu_73416e4b__ZN5comet3gpu40_GLOBAL__N__c1eff56a_8_proxy_cu_73416e4b12proxy_kernelENS0_11ProxyParamsE
    48 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 47 registers, used 0 barriers
ptxas info    : Function properties for _Z14nvshmemi_quietIL13threadgroup_t0EEvv
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Function properties for _Z9our_helperv
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
"""


def test_ptxas_check_keeps_nvshmem_spills_apart():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import check_ptxas
    finally:
        sys.path.pop(0)
    notes = []
    rows, problems = check_ptxas.parse(LOG, "csrc/cuda/proxy.cu", notes)
    assert [(r["arch"], r["regs"], r["spill_st"]) for r in rows] == [("sm_90a", 47, 0)]
    assert len(notes) == 1 and "nvshmemi_quiet" in notes[0]
    assert len(problems) == 1 and "our_helper" in problems[0]
    assert check_ptxas.unstatic(rows[0]["kernel"]).startswith("_ZN5comet3gpu")
