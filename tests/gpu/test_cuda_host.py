"""Parts of the CUDA backend that can be checked without a GPU (they run in CPU-only CI too):

  - tools/check_ptxas.py flags spills in GEMM kernels and wgmma serialisation / setmaxnreg
    warnings."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOG = """\
ptxas info    : Compiling entry function '_ZN5comet3gpu4sm9012fused_kernelIN7cutlass6half_tELi0EEEvNS0_10CallParamsENS1_10GemmConfigIT_E6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN5comet3gpu4sm9012fused_kernelIN7cutlass6half_tELi0EEEvNS0_10CallParamsENS1_10GemmConfigIT_E6ParamsE
    128 bytes stack frame, 124 bytes spill stores, 124 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 128 bytes cumulative stack size
ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to wgmma pipeline crossing function boundary at a function call in the function 'f'
ptxas info    : Compiling entry function '_ZN5comet3gpu12_GLOBAL__N_113finish_kernelENS0_10CallParamsE' for 'sm_80'
ptxas info    : Function properties for _ZN5comet3gpu12_GLOBAL__N_113finish_kernelENS0_10CallParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 320 bytes smem, 848 bytes cmem[0]
"""


@pytest.mark.host_only
def test_ptxas_check_flags_spills_and_wgmma_serialisation(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import check_ptxas
    finally:
        sys.path.pop(0)
    rows, problems = check_ptxas.parse(LOG, "x.cu")
    assert [(r["arch"], r["regs"], r["smem"], r["spill_st"]) for r in rows] == [
        ("sm_90a", 168, 0, 124), ("sm_80", 8, 320, 0)]
    assert any("C7510" in p for p in problems)
    log = tmp_path / "ptxas.log"
    log.write_text(LOG)
    assert check_ptxas.main(["--log", str(log)]) == 1
    out = capsys.readouterr()
    assert "spills" in out.err and "sm90::fused_kernel<f16, 0>" in out.out
