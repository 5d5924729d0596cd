"""The CUDA part of comet's build: setup.py imports `cuda_extension` and `build_ext_class` from here
when csrc/cuda/*.cu exists, nvcc is found and torch is a CUDA build. No GPU is needed to build.

What it adds to the CPU extension (docs/toolchain.md says why each flag is there):
  - csrc/cuda/*.cu compiled by nvcc for every architecture of COMET_CUDA_ARCHS (default "80;90a";
    sm_90a is required for the TMA/wgmma path, sm_80 for the mma.sync path). -DNDEBUG and no
    -rdc: ptxas serialises wgmma and ignores setmaxnreg otherwise. The kernels are torch-free.
  - Sources with their own architectures, SOURCE_ARCHS (source_archs()): the sm_89 FP8 fused
    kernels (csrc/cuda/fused_sm89_fp8_layer*.cu) are compiled for sm_89 only. FP8 mma.sync
    (QMMA e4m3) exists from sm_89, so their device code is guarded by __CUDA_ARCH__ == 890 and is
    empty for any other architecture; every other TU needs no sm_89 image (its sm_80 SASS runs on
    Ada), and compiling every TU for sm_89 too would only lengthen the build.
  - RDC_SOURCES (csrc/cuda/proxy.cu, the inter-node transport's proxy kernel, the only device
    code that calls NVSHMEM): compiled with -rdc=true and device-linked on its own with
    libnvshmem_device.a (`nvcc -dlink proxy.o -lnvshmem_device`, no -dlto: there is no libnvvm
    here); both objects, the static library (its host part: nvshmemx_init_attr's device-state
    set-up) and libcudadevrt join the link of comet._C. The other .cu files never see -rdc, so
    the fused kernels are unchanged.
  - Both kinds (separate_sources()) are compiled outside torch's ninja source list, one nvcc
    command per source (compile_object(), rebuilt when older than the source, a header or this
    file), by build_ext_class() before the extension links; their objects join its link.
  - csrc/cuda/*.cpp (the CUDA op kernels and the NVSHMEM host side) compiled by the C++ compiler.
  - CUTLASS/CuTe headers: $COMET_CUTLASS_DIR (a checkout, e.g. third_party/cutlass) or the
    nvidia-cutlass wheel's copy.
  - NVSHMEM: libnvshmem_host.so.3 (there is no unversioned libnvshmem_host.so, so it is linked by
    file name with an rpath) and libnvshmem_device.a (see above).

Also used by tools/check_ptxas.py (the same flags and architectures, so the static check sees what
the build builds): `nvcc_command(root, source, archs, extra)`, which adds `source_flags(source)`,
and `source_archs(source)`.
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


def ptx_arch(arch_list: list[str]) -> str | None:
    """The architecture whose PTX the objects embed beside their SASS: the lowest portable one
    (not an arch-specific "a" target, whose PTX runs only on that architecture). The driver
    compiles it on first use for a GPU no SASS was built for (Blackwell: the mma.sync kernels
    from compute_80, the FP8 ones from compute_89); None when there is none (e.g. "90a" alone)."""
    portable = sorted(a for a in arch_list if not a.endswith("a"))
    return portable[0] if portable else None


def gencode_flags(arch_list: list[str], ptx: bool = True) -> list[str]:
    """SASS for every architecture, plus ptx_arch's PTX unless ptx is false (the -rdc proxy: a
    device link takes SASS only)."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arch_list]
    p = ptx_arch(arch_list) if ptx else None
    return flags + ([f"-gencode=arch=compute_{p},code=compute_{p}"] if p else [])


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

# Sources compiled for their own architectures instead of COMET_CUDA_ARCHS: see the module
# docstring. Relative to the repository root.
SOURCE_ARCHS = {
    "csrc/cuda/fused_sm89_fp8_layer0.cu": ("89",),
    "csrc/cuda/fused_sm89_fp8_layer1.cu": ("89",),
}


def _table_key(source: str, table) -> str | None:
    """The entry of `table` (repository-relative paths) that names `source` (relative or absolute)."""
    path = source.replace(os.sep, "/")
    return next((s for s in table if path == s or path.endswith("/" + s)), None)


def is_rdc(source: str) -> bool:
    return _table_key(source, RDC_SOURCES) is not None


def source_archs(source: str) -> list[str]:
    """The architectures `source` is compiled for: its SOURCE_ARCHS entry, else archs()."""
    key = _table_key(source, SOURCE_ARCHS)
    return list(SOURCE_ARCHS[key]) if key is not None else archs()


def is_separate(source: str) -> bool:
    """Whether `source` is compiled outside torch's ninja list (compile_object(), see the module
    docstring): the -rdc sources and those with their own architectures."""
    return is_rdc(source) or _table_key(source, SOURCE_ARCHS) is not None


def source_flags(source: str) -> list[str]:
    """nvcc flags one source needs beyond NVCC_FLAGS: -rdc and NVSHMEM's headers for RDC_SOURCES
    (3012/3013: NVSHMEM's headers use deprecated volatile forms under C++20)."""
    if not is_rdc(source):
        return []
    return ["-rdc=true", f"-I{nvshmem_dirs()[0]}", "-diag-suppress=3012,3013"]


def include_dirs(root: str) -> list[str]:
    return [os.path.join(root, "csrc", "include"), os.path.join(root, "csrc"),
            os.path.join(root, "csrc", "cuda")] + cutlass_include_dirs()


def nvcc_command(root: str, source: str, arch_list: list[str],
                 extra: list[str] | None = None) -> list[str]:
    """The nvcc command line compiling one CUDA source of the build for the given architectures."""
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                "bin", "nvcc")
    cmd = [nvcc] + NVCC_FLAGS + gencode_flags(list(arch_list), ptx=not is_rdc(source))
    cmd += [f"-I{d}" for d in include_dirs(root)] + source_flags(source)
    return cmd + (extra or []) + ["-c", source]


def cuda_sources(root: str) -> list[str]:
    """Every csrc/cuda/*.cu (the separate ones included: check_ptxas compiles them all)."""
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))


def separate_sources(root: str) -> list[str]:
    """The csrc/cuda/*.cu compiled outside torch's ninja list (is_separate)."""
    return [s for s in cuda_sources(root) if is_separate(s)]


def ninja_cuda_sources(root: str) -> list[str]:
    """The csrc/cuda/*.cu that torch's ninja build compiles (for COMET_CUDA_ARCHS)."""
    return [s for s in cuda_sources(root) if not is_separate(s)]


def _newer(target: str, deps: list[str]) -> bool:
    """Whether target is missing or older than any of deps."""
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.getmtime(d) > t for d in deps if os.path.exists(d))


def _header_deps(root: str) -> list[str]:
    """What every separate object is rebuilt after: our headers and this file (its flags)."""
    return glob.glob(os.path.join(root, "csrc", "cuda", "*.h")) + \
        glob.glob(os.path.join(root, "csrc", "cuda", "*.cuh")) + \
        glob.glob(os.path.join(root, "csrc", "include", "comet", "*.h")) + [__file__]


def compile_object(root: str, source: str, build_dir: str, verbose: bool = False) -> str:
    """Compiles one separate source (relative to root) to build_dir/<name>.o for source_archs()
    with source_flags() (-rdc for RDC_SOURCES), unless the object is newer than the source and
    _header_deps(). Returns the object."""
    import subprocess

    os.makedirs(build_dir, exist_ok=True)
    path = os.path.join(root, source)
    obj = os.path.join(build_dir, os.path.basename(source) + ".o")
    if _newer(obj, [path] + _header_deps(root)):
        cmd = nvcc_command(root, path, source_archs(source), ["-Xcompiler=-fPIC", "-o", obj])
        if os.environ.get("COMET_PTXAS_VERBOSE"):
            cmd.append("-Xptxas=-v")
        if verbose:
            print(" ".join(cmd))
        subprocess.run(cmd, check=True)
    return obj


def build_rdc_objects(root: str, build_dir: str, verbose: bool = False) -> list[str]:
    """Compiles RDC_SOURCES with -rdc=true and device-links them with libnvshmem_device.a alone.
    Returns the objects for the host link: each source's object, then the device-link object."""
    import subprocess

    _, nv_lib = nvshmem_dirs()
    objs = [compile_object(root, src, build_dir, verbose) for src in RDC_SOURCES]
    nvcc = nvcc_command(root, RDC_SOURCES[0], archs())[0]
    dlink = os.path.join(build_dir, "rdc_dlink.o")
    if _newer(dlink, objs):
        cmd = [nvcc, "-dlink", "-Xcompiler=-fPIC"] + gencode_flags(archs(), ptx=False) + objs + \
            [f"-L{nv_lib}", "-lnvshmem_device", "-o", dlink]
        if verbose:
            print(" ".join(cmd))
        subprocess.run(cmd, check=True)
    return objs + [dlink]


def build_own_arch_objects(root: str, build_dir: str, verbose: bool = False) -> list[str]:
    """Compiles the SOURCE_ARCHS sources (whole-program, no -rdc: no device link) for their own
    architectures. Returns their objects for the host link."""
    return [compile_object(root, src, build_dir, verbose)
            for src in separate_sources(root) if not is_rdc(src)]


def build_ext_class():
    """torch's BuildExtension (ninja) that first builds the separate objects (the rdc ones and
    those with their own architectures) of an extension marked by cuda_extension (attribute
    comet_root) and adds them to its link."""
    from torch.utils import cpp_extension

    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class CometBuildExt(base):
        def build_extension(self, ext):
            root = getattr(ext, "comet_root", None)
            if root is not None:
                objs = build_rdc_objects(root, os.path.join(self.build_temp, "comet_rdc"),
                                         verbose=bool(self.verbose)) + \
                    build_own_arch_objects(root, os.path.join(self.build_temp, "comet_arch"),
                                           verbose=bool(self.verbose))
                ext.extra_objects = [o for o in (ext.extra_objects or []) if o not in objs] + objs
            super().build_extension(ext)

    return CometBuildExt


def object_clashes(sources: list[str]) -> list[tuple[str, str]]:
    """Pairs of sources that would compile to the same object file: the build names an object by
    its source's directory and stem, so x.cu and x.cpp of one directory collide (ninja stops with
    "multiple rules generate x.o")."""
    seen: dict[str, str] = {}
    clashes = []
    for src in sources:
        key = os.path.splitext(os.path.normpath(src))[0]
        if key in seen:
            clashes.append((seen[key], src))
        else:
            seen[key] = src
    return clashes


def cuda_extension(root: str, sources: list[str], include_dirs_: list[str], cxx_flags: list[str]):
    """comet._C with the CPU backend plus the CUDA kernels, op registrations and NVSHMEM side."""
    from torch.utils import cpp_extension

    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    cuda_cpp = sorted(os.path.relpath(p, root)
                      for p in glob.glob(os.path.join(root, "csrc", "cuda", "*.cpp")))
    for a, b in object_clashes(list(sources) + cuda_cpp + cuda_sources(root)):
        raise RuntimeError(f"comet build: {a} and {b} would compile to the same object file; "
                           "rename one")
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
        list(sources) + cuda_cpp + ninja_cuda_sources(root),
        include_dirs=incs,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        # After the rdc objects (extra_objects): the device library's host part, then cudadevrt
        # (what nvcc would add when linking relocatable device code).
        extra_link_args=[os.path.join(nv_lib, "libnvshmem_device.a"), f"-L{nv_lib}",
                         "-l:libnvshmem_host.so.3", f"-Wl,-rpath,{nv_lib}", f"-L{cuda_lib}",
                         "-lcudadevrt"],
        libraries=["rt"],
    )
    ext.comet_root = root  # build_ext_class() builds and links separate_sources()
    return ext
