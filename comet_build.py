"""The CUDA part of comet's build: setup.py imports `cuda_extension` from here when csrc/cuda/*.cu
exists, nvcc is found and torch is a CUDA build. No GPU is needed to build.

What it adds to the CPU extension (see ../shared/TOOLCHAIN.md for why each flag is there):
  - csrc/cuda/*.cu compiled by nvcc for every architecture of COMET_CUDA_ARCHS (default "80;90a";
    sm_90a is required for the TMA/wgmma path, sm_80 for the mma.sync path). -DNDEBUG and no
    -rdc: ptxas serialises wgmma and ignores setmaxnreg otherwise. The kernels are torch-free.
  - csrc/cuda/*.cpp (the CUDA op kernels and the NVSHMEM host side) compiled by the C++ compiler.
  - CUTLASS/CuTe headers: $COMET_CUTLASS_DIR (a checkout, e.g. third_party/cutlass) or the
    nvidia-cutlass wheel's copy.
  - NVSHMEM host library only (nvshmemx_hostlib_init_attr, nvshmem_malloc, nvshmem_ptr): there
    is no unversioned libnvshmem_host.so, so it is linked by file name with an rpath; no
    libnvshmem_device.a and no device link, because no kernel calls NVSHMEM.

Also used by tools/check_ptxas.py (the same flags, so the static check sees what the build
builds): `nvcc_command(root, source, arch, extra)`.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil

DEFAULT_ARCHS = "80;90a"


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return os.path.dirname(spec.origin) if spec.origin else None


def cutlass_include_dirs() -> list[str]:
    """CUTLASS/CuTe include directories: $COMET_CUTLASS_DIR, else the nvidia-cutlass wheel."""
    root = os.environ.get("COMET_CUTLASS_DIR")
    if root:
        dirs = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    else:
        pkg = _package_dir("cutlass_library")
        if pkg is None:
            raise RuntimeError(
                "comet: CUTLASS headers not found: `pip install nvidia-cutlass==4.2.0.0` or set "
                "COMET_CUTLASS_DIR to a CUTLASS checkout (COMET_CUDA=0 builds the CPU backend only)")
        src = os.path.join(pkg, "source")
        dirs = [os.path.join(src, "include"), os.path.join(src, "tools", "util", "include")]
    if not os.path.exists(os.path.join(dirs[0], "cute", "tensor.hpp")):
        raise RuntimeError(f"comet: no CUTLASS headers under {dirs[0]}")
    return dirs


def _nvidia_dir(*parts: str) -> str | None:
    pkg = _package_dir("nvidia")
    if pkg is None:
        return None
    path = os.path.join(pkg, *parts)
    return path if os.path.exists(path) else None


def nvshmem_dirs() -> tuple[str, str]:
    """(include, lib) of the nvidia-nvshmem-cu13 wheel torch depends on."""
    inc, lib = _nvidia_dir("nvshmem", "include"), _nvidia_dir("nvshmem", "lib")
    if inc is None or lib is None or not os.path.exists(os.path.join(lib, "libnvshmem_host.so.3")):
        raise RuntimeError("comet: NVSHMEM (nvidia-nvshmem-cu13, a torch dependency) not found")
    return inc, lib


def archs() -> list[str]:
    raw = os.environ.get("COMET_CUDA_ARCHS", DEFAULT_ARCHS)
    out = [a.strip().replace(".", "").replace("sm_", "") for a in raw.replace(",", ";").split(";")]
    out = [a for a in out if a]
    for a in out:
        if a not in ("80", "86", "89", "90a"):
            raise RuntimeError(f"comet: COMET_CUDA_ARCHS entry {a!r}: supported are 80, 86, 89, "
                               "90a (the kernels need sm_80+ features; the TMA path sm_90a)")
    return out


def gencode_flags(arch_list: list[str]) -> list[str]:
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arch_list]


# nvcc flags of every CUDA translation unit (torch adds its -D__CUDA_NO_HALF* family, undone here
# for the CUTLASS/NVSHMEM headers, and --expt-relaxed-constexpr).
NVCC_FLAGS = [
    "-O3", "-std=c++20", "-DNDEBUG", "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "-diag-suppress=2908",  # CUTLASS sm100 headers: implicit capture of this (not our code)
]


def include_dirs(root: str) -> list[str]:
    return [os.path.join(root, "csrc", "include"), os.path.join(root, "csrc"),
            os.path.join(root, "csrc", "cuda")] + cutlass_include_dirs()


def nvcc_command(root: str, source: str, arch: str, extra: list[str] | None = None) -> list[str]:
    """The nvcc command line compiling one CUDA source of the build for one architecture."""
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                "bin", "nvcc")
    cmd = [nvcc] + NVCC_FLAGS + gencode_flags([arch])
    cmd += [f"-I{d}" for d in include_dirs(root)]
    return cmd + (extra or []) + ["-c", source]


def cuda_sources(root: str) -> list[str]:
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))


def cuda_extension(root: str, sources: list[str], include_dirs_: list[str], cxx_flags: list[str]):
    """comet._C with the CPU backend plus the CUDA kernels, op registrations and NVSHMEM side."""
    from torch.utils import cpp_extension

    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    cuda_cpp = sorted(os.path.relpath(p, root)
                      for p in glob.glob(os.path.join(root, "csrc", "cuda", "*.cpp")))
    nv_inc, nv_lib = nvshmem_dirs()
    cu13 = _nvidia_dir("cu13", "include")  # headers /usr/local/cuda lacks (TOOLCHAIN.md)
    incs = list(include_dirs_) + [os.path.join(root, "csrc", "cuda")] + cutlass_include_dirs()
    cxx = list(cxx_flags) + ["-DCOMET_WITH_CUDA", f"-I{nv_inc}"]
    cccl = os.path.join(os.environ["CUDA_HOME"], "include", "cccl")  # cuda/std/*, NVSHMEM needs it
    if os.path.isdir(cccl):
        cxx.append(f"-I{cccl}")
    if cu13:
        cxx += ["-idirafter", cu13]
    nvcc = NVCC_FLAGS + gencode_flags(archs())
    if os.environ.get("COMET_PTXAS_VERBOSE"):
        nvcc.append("-Xptxas=-v")
    return cpp_extension.CUDAExtension(
        "comet._C",
        list(sources) + cuda_cpp + cuda_sources(root),
        include_dirs=incs,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=[f"-L{nv_lib}", "-l:libnvshmem_host.so.3", f"-Wl,-rpath,{nv_lib}"],
        libraries=["rt"],
    )
