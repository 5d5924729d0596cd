"""Forward compatibility of the CUDA build (comet_build.ptx_arch, docs/toolchain.md): every object
embeds the PTX of the lowest portable architecture it is built for, so GPUs newer than the build
compile it on first use; arch-specific targets ("90a") and the -rdc proxy get none.

The rule is checked on the nvcc command lines (no GPU needed); the built extension's fat binary
is read with cuobjdump (when the build has CUDA kernels and cuobjdump is installed)."""
import subprocess

import pytest

import comet._C
import comet_build as b


def test_ptx_of_the_lowest_portable_architecture():
    assert b.ptx_arch(["80", "90a"]) == "80"
    assert b.ptx_arch(["90a", "89", "86"]) == "86"
    assert b.ptx_arch(["89"]) == "89"
    assert b.ptx_arch(["90a"]) is None  # an arch-specific target's PTX runs only there
    flags = b.gencode_flags(["80", "90a"])
    assert flags == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                     "-gencode=arch=compute_80,code=compute_80"]
    assert not any("code=compute" in f for f in b.gencode_flags(["80", "90a"], ptx=False))


def test_sources_get_ptx_except_the_rdc_proxy(monkeypatch):
    monkeypatch.setenv("COMET_CUDA_ARCHS", "80;90a")
    root = str(b.__file__).rsplit("/", 1)[0]
    fused = b.nvcc_command(root, "csrc/cuda/fused_sm80_layer0.cu", b.source_archs(
        "csrc/cuda/fused_sm80_layer0.cu"))
    assert "-gencode=arch=compute_80,code=compute_80" in fused
    fp8 = b.nvcc_command(root, "csrc/cuda/fused_sm89_fp8_layer0.cu", b.source_archs(
        "csrc/cuda/fused_sm89_fp8_layer0.cu"))
    assert "-gencode=arch=compute_89,code=compute_89" in fp8
    proxy = b.nvcc_command(root, "csrc/cuda/proxy.cu", b.source_archs("csrc/cuda/proxy.cu"))
    assert "-rdc=true" in proxy and not any("code=compute" in f for f in proxy)


def _cuobjdump():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import sass_check  # the toolkit's cuobjdump, else the triton wheel's

    return sass_check.cuobjdump()


@pytest.mark.skipif(not getattr(comet._C, "with_cuda", False) or _cuobjdump() is None,
                    reason="needs a build with the CUDA kernels and cuobjdump")
def test_the_built_extension_embeds_portable_ptx():
    out = subprocess.run([_cuobjdump(), "-lptx", comet._C.__file__], capture_output=True,
                         text=True, timeout=300).stdout
    archs = {line.split("sm_")[-1].split(".")[0] for line in out.splitlines() if ".ptx" in line}
    assert "80" in archs, out[:2000]
    assert not any(a.endswith("a") for a in archs)
