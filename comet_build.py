"""The CUDA part of comet's build: setup.py imports `cuda_extension` and `build_ext_class` from here
when csrc/cuda/*.cu exists, nvcc is found and torch is a CUDA build. No GPU is needed to build.

What it adds to the CPU extension (docs/toolchain.md says why each flag is there):
  - csrc/cuda/*.cu compiled by nvcc for every architecture of COMET_CUDA_ARCHS (default "80;90a";
    sm_90a is required for the TMA/wgmma path, sm_80 for the mma.sync path). -DNDEBUG and no
    -rdc: ptxas serialises wgmma and ignores setmaxnreg otherwise. The kernels are torch-free.
  - ONE exception, RDC_SOURCES (csrc/cuda/proxy.cu, the inter-node transport's proxy kernel, the
    only device code that calls NVSHMEM): compiled with -rdc=true and device-linked on its own
    with libnvshmem_device.a (`nvcc -dlink proxy.o -lnvshmem_device`, no -dlto: there is no
    libnvvm here), by build_ext_class() before the extension links; both objects, the static
    library (its host part: nvshmemx_init_attr's device-state set-up) and libcudadevrt join the
    link of comet._C. The other .cu files never see -rdc, so the fused kernels are unchanged.
  - csrc/cuda/*.cpp (the CUDA op kernels and the NVSHMEM host side) compiled by the C++ compiler.
  - CUTLASS/CuTe headers: $COMET_CUTLASS_DIR (a checkout, e.g. third_party/cutlass) or the
    nvidia-cutlass wheel's copy.
  - NVSHMEM: libnvshmem_host.so.3 (there is no unversioned libnvshmem_host.so, so it is linked by
    file name with an rpath) and libnvshmem_device.a (see above).

Also used by tools/check_ptxas.py (the same flags, so the static check sees what the build
builds): `nvcc_command(root, source, arch, extra)`, which adds `source_flags(source)`.
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


# Sources compiled with relocatable device code (they call NVSHMEM on the device): see the module
# docstring. Relative to the repository root.
RDC_SOURCES = ("csrc/cuda/proxy.cu",)


def is_rdc(source: str) -> bool:
    return any(source.replace(os.sep, "/").endswith(s) for s in RDC_SOURCES)


def source_flags(source: str) -> list[str]:
    """nvcc flags one source needs beyond NVCC_FLAGS: -rdc and NVSHMEM's headers for RDC_SOURCES
    (3012/3013: NVSHMEM's headers use deprecated volatile forms under C++20)."""
    if not is_rdc(source):
        return []
    return ["-rdc=true", f"-I{nvshmem_dirs()[0]}", "-diag-suppress=3012,3013"]


def include_dirs(root: str) -> list[str]:
    return [os.path.join(root, "csrc", "include"), os.path.join(root, "csrc"),
            os.path.join(root, "csrc", "cuda")] + cutlass_include_dirs()


def nvcc_command(root: str, source: str, arch: str, extra: list[str] | None = None) -> list[str]:
    """The nvcc command line compiling one CUDA source of the build for one architecture."""
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                "bin", "nvcc")
    cmd = [nvcc] + NVCC_FLAGS + gencode_flags([arch])
    cmd += [f"-I{d}" for d in include_dirs(root)] + source_flags(source)
    return cmd + (extra or []) + ["-c", source]


def cuda_sources(root: str) -> list[str]:
    """Every csrc/cuda/*.cu (RDC_SOURCES included: check_ptxas compiles them all)."""
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))


def _newer(target: str, deps: list[str]) -> bool:
    """Whether target is missing or older than any of deps."""
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.getmtime(d) > t for d in deps if os.path.exists(d))


def build_rdc_objects(root: str, build_dir: str, verbose: bool = False) -> list[str]:
    """Compiles RDC_SOURCES with -rdc=true and device-links them with libnvshmem_device.a alone.
    Returns the objects for the host link: each source's object, then the device-link object."""
    import subprocess

    os.makedirs(build_dir, exist_ok=True)
    _, nv_lib = nvshmem_dirs()
    gencodes = gencode_flags(archs())
    objs = []
    deps = glob.glob(os.path.join(root, "csrc", "cuda", "*.h")) + \
        glob.glob(os.path.join(root, "csrc", "cuda", "*.cuh")) + \
        glob.glob(os.path.join(root, "csrc", "include", "comet", "*.h"))
    for src in RDC_SOURCES:
        path = os.path.join(root, src)
        obj = os.path.join(build_dir, os.path.basename(src) + ".o")
        if _newer(obj, [path, __file__] + deps):
            cmd = nvcc_command(root, path, archs()[0], ["-Xcompiler=-fPIC", "-o", obj])
            cmd[1:1] = gencodes[1:]
            if os.environ.get("COMET_PTXAS_VERBOSE"):
                cmd.append("-Xptxas=-v")
            if verbose:
                print(" ".join(cmd))
            subprocess.run(cmd, check=True)
        objs.append(obj)
    nvcc = nvcc_command(root, RDC_SOURCES[0], archs()[0])[0]
    dlink = os.path.join(build_dir, "rdc_dlink.o")
    if _newer(dlink, objs):
        cmd = [nvcc, "-dlink", "-Xcompiler=-fPIC"] + gencodes + objs + \
            [f"-L{nv_lib}", "-lnvshmem_device", "-o", dlink]
        if verbose:
            print(" ".join(cmd))
        subprocess.run(cmd, check=True)
    return objs + [dlink]


def build_ext_class():
    """torch's BuildExtension (ninja) that first builds the rdc objects of an extension marked by
    cuda_extension (attribute comet_rdc_root) and adds them to its link."""
    from torch.utils import cpp_extension

    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class CometBuildExt(base):
        def build_extension(self, ext):
            root = getattr(ext, "comet_rdc_root", None)
            if root is not None:
                objs = build_rdc_objects(root, os.path.join(self.build_temp, "comet_rdc"),
                                         verbose=bool(self.verbose))
                ext.extra_objects = [o for o in (ext.extra_objects or []) if o not in objs] + objs
            super().build_extension(ext)

    return CometBuildExt


def cuda_extension(root: str, sources: list[str], include_dirs_: list[str], cxx_flags: list[str]):
    """comet._C with the CPU backend plus the CUDA kernels, op registrations and NVSHMEM side."""
    from torch.utils import cpp_extension

    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    cuda_cpp = sorted(os.path.relpath(p, root)
                      for p in glob.glob(os.path.join(root, "csrc", "cuda", "*.cpp")))
    nv_inc, nv_lib = nvshmem_dirs()
    cu13 = _nvidia_dir("cu13", "include")  # headers /usr/local/cuda lacks (docs/toolchain.md)
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
    cuda_lib = os.path.join(os.environ["CUDA_HOME"], "lib64")
    ext = cpp_extension.CUDAExtension(
        "comet._C",
        list(sources) + cuda_cpp + [s for s in cuda_sources(root) if not is_rdc(s)],
        include_dirs=incs,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        # After the rdc objects (extra_objects): the device library's host part, then cudadevrt
        # (what nvcc would add when linking relocatable device code).
        extra_link_args=[os.path.join(nv_lib, "libnvshmem_device.a"), f"-L{nv_lib}",
                         "-l:libnvshmem_host.so.3", f"-Wl,-rpath,{nv_lib}", f"-L{cuda_lib}",
                         "-lcudadevrt"],
        libraries=["rt"],
    )
    ext.comet_rdc_root = root  # build_ext_class() builds and links RDC_SOURCES
    return ext
