"""The build's sources compile to distinct object files: the extension build names an object by
its source's directory and stem, so two sources of one directory with one stem (x.cu beside
x.cpp) make ninja stop with "multiple rules generate x.o" - on a CUDA build only, so a CPU-only
CI would not see it without this check."""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import comet_build  # noqa: E402


def test_no_two_sources_share_a_directory_and_stem():
    seen = {}
    for pattern in ("csrc/*.cpp", "csrc/cpu/*.cpp", "csrc/cuda/*.cpp", "csrc/cuda/*.cu"):
        for path in ROOT.glob(pattern):
            key = (path.parent, path.stem)
            assert key not in seen, f"{seen[key].name} and {path.name} in {path.parent}"
            seen[key] = path


def test_the_build_refuses_sources_that_would_share_an_object():
    got = comet_build.object_clashes(["csrc/cuda/a.cu", "csrc/cuda/b.cpp", "csrc/cuda/a.cpp",
                                      "csrc/cpu/a.cpp", "csrc/cuda/./b.cu"])
    assert got == [("csrc/cuda/a.cu", "csrc/cuda/a.cpp"), ("csrc/cuda/b.cpp", "csrc/cuda/./b.cu")]
    assert comet_build.object_clashes(["csrc/x.cpp", "csrc/cpu/x.cpp", "csrc/cuda/x.cu"]) == []
