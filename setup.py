"""Builds comet._C: the CPU backend always, the CUDA kernels when nvcc and a CUDA build of torch are
present (COMET_CUDA=0 skips them, COMET_CUDA_ARCHS picks the targets, default "80;90a").
No GPU is needed to build. docs/toolchain.md says why each flag is here.
Install it after torch with `pip install --no-build-isolation -e .` (README.md, "Installing with
pip": it compiles against the torch already installed; pyproject.toml lists what the build needs)."""
import glob
import os
import shutil
import sys
import sysconfig

from setuptools import find_packages, setup

# torch.utils.cpp_extension reads CUDA_HOME when imported; without it, it may settle on /usr/local and
# then find no cuda_runtime.h (docs/toolchain.md). Default to the toolkit nvcc lives in.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)  # the build's helpers sit beside this file (not on sys.path under pip)

import build_cxx  # noqa: E402

# A C++ compiler that links libstdc++ only statically gives comet._C a private copy of the C++
# runtime beside torch's, which crashes at the first op call: use one that links the shared one
# (build_cxx.py), and check the linked extension too.
build_cxx.choose_compiler()


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def want_cuda():
    import torch

    if os.environ.get("COMET_CUDA", "1") == "0":
        return False
    if torch.version.cuda is None or not rel("csrc/cuda/*.cu"):
        return False
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") is not None or os.path.exists(
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))


cxx_flags = ["-O3", "-std=c++20", "-DNDEBUG", "-Wall", "-Wno-unused-function"]
include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
sources = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp")

if want_cuda():
    # build logic for the CUDA part lives beside this file
    from comet_build import build_ext_class, cuda_extension

    ext = cuda_extension(ROOT, sources, include_dirs, cxx_flags)
    build_ext = build_ext_class()  # also builds the -rdc proxy and the per-arch (sm_89) sources
else:
    ext = cpp_extension.CppExtension(
        "comet._C", sources, include_dirs=include_dirs, extra_compile_args=cxx_flags,
        libraries=["rt"])
    build_ext = cpp_extension.BuildExtension.with_options(use_ninja=True)
build_ext = build_cxx.guarded(build_ext)


def incremental(build_ext_cls):
    """build_ext_cls keeping its objects in build/ under pip's editable install too. setuptools
    builds an editable wheel in a fresh temporary directory, so every `pip install
    --no-build-isolation -e .` (each `make build`) would compile every source again (minutes; the
    CUDA kernels many more); in build/temp.* ninja compiles only what changed, the objects
    `setup.py build_ext --inplace` uses too."""

    class IncrementalBuildExt(build_ext_cls):
        def finalize_options(self):
            super().finalize_options()
            if getattr(self, "editable_mode", False):
                self.build_temp = os.path.join(
                    ROOT, "build", f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")

    return IncrementalBuildExt


build_ext = incremental(build_ext)

# Optional parts, pinned as in the Makefile's DEPS: `pip install --no-build-isolation -e '.[hf]'`
# etc. (comet.hf and examples/hf_moe.py need hf, comet.megatron needs megatron, the bench plots
# need bench).
EXTRAS = {
    "hf": ["transformers==5.23.0"],
    "megatron": ["megatron-core==0.16.1"],
    "bench": ["matplotlib"],
    "test": ["pytest", "pytest-timeout", "hypothesis"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="comet-moe",
    version="0.1.0",
    description="Fine-grained computation-communication overlapping for MoE layers",
    packages=find_packages(include=["comet", "comet.*"]),
    python_requires=">=3.11",
    install_requires=["torch==2.14.1", "numpy"],
    extras_require=EXTRAS,
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
)
