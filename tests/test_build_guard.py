"""The build's C++ runtime guard (build_cxx.py): comet._C loads the shared libstdc++ and carries
no copy of its own; a compiler that would give it one is replaced or refused.

Oracles: shared objects built here with g++ in the two ways the rule separates (the shared
runtime, and -static-libstdc++: the toolchain that crashed every op call), a synthetic object that
defines a std:: symbol strongly, and binutils' readelf for the ELF reading."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

import build_cxx
import comet._C

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ is not installed")

SRC = r"""
#include <sstream>
extern "C" int f(int x) { std::ostringstream s; s << x << 2.5; return int(s.str().size()); }
"""


def _build(tmp: Path, name: str, *flags: str, src: str = SRC) -> str:
    cpp, so = tmp / f"{name}.cpp", tmp / f"{name}.so"
    cpp.write_text(src)
    subprocess.run([GXX, "-shared", "-fPIC", "-O1", str(cpp), "-o", str(so), *flags], check=True)
    return str(so)


def test_the_built_extension_uses_the_shared_libstdcxx():
    path = comet._C.__file__
    needed, _ = build_cxx.dynamic_info(path)
    assert build_cxx.LIBSTDCXX in needed, needed
    assert build_cxx.runtime_problem(path) is None


@needs_gxx
def test_the_rule_separates_shared_from_static_runtimes(tmp_path):
    assert build_cxx.runtime_problem(_build(tmp_path, "shared")) is None
    static = build_cxx.runtime_problem(_build(tmp_path, "static", "-static-libstdc++"))
    assert static and "does not load libstdc++.so.6" in static
    # an object that needs libstdc++.so.6 yet defines one of its symbols strongly
    both = _build(tmp_path, "both", "-Wl,--no-as-needed", "-lstdc++",
                  src="namespace std { int comet_probe_own(int x) { return x; } }")
    why = build_cxx.runtime_problem(both)
    assert why and "defines 1 of libstdc++'s own symbols (e.g. _ZSt15comet_probe_owni)" in why


@pytest.mark.skipif(shutil.which("readelf") is None or GXX is None, reason="needs readelf, g++")
def test_the_elf_reader_agrees_with_readelf(tmp_path):
    for so in (comet._C.__file__, _build(tmp_path, "static", "-static-libstdc++")):
        out = subprocess.run(["readelf", "-dW", so], capture_output=True, text=True).stdout
        want = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
        assert build_cxx.dynamic_info(so)[0] == want
        syms = subprocess.run(["readelf", "--dyn-syms", "-W", so], capture_output=True,
                              text=True).stdout
        strong = {f[7].split("@")[0] for f in (line.split() for line in syms.splitlines())
                  if len(f) >= 8 and f[4] == "GLOBAL" and f[6] != "UND"}
        ours = {n for n, bind in build_cxx.dynamic_info(so)[1] if bind == 1}
        assert ours == strong


def _wrapper(tmp: Path, name: str, *extra: str) -> str:
    """A compiler command that is g++ with extra link flags (how a static-only toolchain links)."""
    p = tmp / name
    p.write_text(f"#!/bin/sh\nexec {GXX} \"$@\" {' '.join(extra)}\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


@needs_gxx
def test_a_static_only_compiler_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", _wrapper(tmp_path, "static-g++", "-static-libstdc++"))
    for var in ("CC", "LDSHARED"):
        monkeypatch.delenv(var, raising=False)
    said = []
    build_cxx.choose_compiler(alternatives=("/nonexistent/g++", GXX),
                              log=lambda *a, **k: said.append(a[0]))
    assert os.environ["CXX"] == GXX and os.environ["LDSHARED"] == f"{GXX} -shared"
    assert said and "cannot link the shared libstdc++" in said[0] and "static-g++" in said[0]


@needs_gxx
def test_a_static_only_compiler_without_alternative_stops_the_build(tmp_path, monkeypatch):
    bad = _wrapper(tmp_path, "static-g++", "-static-libstdc++")
    monkeypatch.setenv("CXX", bad)
    with pytest.raises(SystemExit, match=r"static-g\+\+.*private libstdc\+\+.*Fix: build with a C\+\+ "
                                         r"compiler that links the shared libstdc\+\+, e\.g\. "
                                         r"CXX=/usr/bin/g\+\+"):
        build_cxx.choose_compiler(alternatives=(bad,))
    assert os.environ["CXX"] == bad  # nothing switched


@needs_gxx
def test_a_good_compiler_is_kept_and_a_bad_link_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", GXX)
    build_cxx.choose_compiler(alternatives=(), log=lambda *a, **k: pytest.fail("switched"))
    assert os.environ["CXX"] == GXX
    bad = _build(tmp_path, "static", "-static-libstdc++")
    with pytest.raises(SystemExit, match="was removed: it does not load libstdc"):
        build_cxx.check_extension(bad)
    assert not os.path.exists(bad)
