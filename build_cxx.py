"""The C++ runtime guard of comet's build: comet._C must use the process's shared libstdc++.

torch, and every other extension in the process, use the shared libstdc++.so.6. A compiler whose
only libstdc++ is the static archive (some vendor and conda toolchains: g++ installed without its
shared runtime) links an extension that carries a private copy of libstdc++ instead; it builds
and imports, and then the first iostream use across the two copies crashes (seen: every op call
segfaulted in an ostream insert while formatting its input checks). So the build

  1. before compiling, links a small probe with the C++ compiler setuptools will use ($CXX, else
     Python's configured one) and reads the probe's dynamic section; if it does not need
     libstdc++.so.6, or defines libstdc++'s own symbols, it tries /usr/bin/g++ and /usr/bin/c++
     and builds with the first that links the shared runtime (saying so), or stops with a message
     naming $CXX and the fix;
  2. after linking, checks comet._C the same way (tests/test_build_guard.py checks the built
     extension too).

The ELF reading is done here (64-bit little-endian, section headers): no binutils needed.
"""
from __future__ import annotations

import os
import shlex
import struct
import subprocess
import sys
import sysconfig
import tempfile

# Symbols only libstdc++ itself defines with global (strong) binding: the std namespace, the C++
# ABI runtime and libstdc++'s extensions. An extension's own instantiations of std templates are
# weak (or GNU-unique) definitions, which the dynamic linker merges with the runtime's.
RUNTIME_PREFIXES = ("_ZNSt", "_ZNKSt", "_ZSt", "_ZTVSt", "_ZTISt", "_ZTSSt", "_ZTVNSt",
                    "_ZTINSt", "_ZTSNSt", "__cxa_", "__gxx_personality", "_ZN9__gnu_cxx",
                    "_ZN10__cxxabiv1")
LIBSTDCXX = "libstdc++.so.6"

_PROBE = r"""
#include <sstream>
#include <string>
extern "C" int comet_probe(int x) {
  std::ostringstream s;
  s << x << ' ' << 1.5;
  return int(s.str().size());
}
"""


class ElfError(ValueError):
    pass


def _sections(data: bytes):
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, _info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        secs.append((typ, off, size, link, entsize))
    return secs


def _string(data: bytes, table_off: int, at: int) -> str:
    end = data.index(b"\0", table_off + at)
    return data[table_off + at:end].decode("utf-8", "replace")


def dynamic_info(path: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(the DT_NEEDED libraries, the defined dynamic symbols as (name, binding)) of an ELF shared
    object; binding: 1 global, 2 weak, 10 GNU unique."""
    with open(path, "rb") as f:
        data = f.read()
    secs = _sections(data)
    needed, defined = [], []
    for typ, off, size, link, _ent in secs:
        if typ == 6:  # SHT_DYNAMIC: (d_tag, d_val) pairs; DT_NEEDED = 1
            strtab = secs[link][1]
            for i in range(0, size, 16):
                tag, val = struct.unpack_from("<qQ", data, off + i)
                if tag == 0:
                    break
                if tag == 1:
                    needed.append(_string(data, strtab, val))
        elif typ == 11:  # SHT_DYNSYM: Elf64_Sym entries of 24 bytes
            strtab = secs[link][1]
            for i in range(0, size, 24):
                name, info, _other, shndx = struct.unpack_from("<IBBH", data, off + i)
                if shndx != 0 and name:  # defined here
                    defined.append((_string(data, strtab, name), info >> 4))
    return needed, defined


def runtime_problem(path: str) -> str | None:
    """Why the shared object at `path` does not use the shared libstdc++, or None when it does."""
    needed, defined = dynamic_info(path)
    own = sorted(n for n, bind in defined if bind == 1 and n.startswith(RUNTIME_PREFIXES))
    if LIBSTDCXX not in needed:
        return (f"it does not load {LIBSTDCXX} (it needs {', '.join(needed) or 'nothing'}): "
                f"libstdc++ was linked into it statically")
    if own:
        return (f"it defines {len(own)} of libstdc++'s own symbols (e.g. {own[0]}): a private "
                f"copy of libstdc++ is linked into it")
    return None


def _cxx_command() -> list[str]:
    """The C++ compiler setuptools links a C++ extension with: $CXX, else Python's configured."""
    return shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")


def probe(cxx: list[str]) -> str | None:
    """Links the probe as a shared object with `cxx`: None if it uses the shared libstdc++, else
    why not ("" when the compiler could not build the probe at all: left to the real build)."""
    with tempfile.TemporaryDirectory() as d:
        src, so = os.path.join(d, "probe.cpp"), os.path.join(d, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE)
        try:
            r = subprocess.run([*cxx, "-shared", "-fPIC", "-O1", src, "-o", so],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        if r.returncode != 0 or not os.path.exists(so):
            return ""
        try:
            return runtime_problem(so)
        except (OSError, ElfError):
            return ""


def fix_text(cxx: str) -> str:
    return (f"build with a C++ compiler that links the shared libstdc++, e.g. "
            f"CXX=/usr/bin/g++ CC=/usr/bin/gcc LDSHARED=\"/usr/bin/g++ -shared\" (the system "
            f"compiler), or install {cxx}'s shared runtime ({LIBSTDCXX})")


def choose_compiler(alternatives=("/usr/bin/g++", "/usr/bin/c++"), log=print) -> None:
    """Step 1 of the module doc: keep the configured C++ compiler if it links the shared
    libstdc++, else switch this build to the first alternative that does (setting CXX, CC and
    LDSHARED), else raise SystemExit naming $CXX and the fix."""
    cxx = _cxx_command()
    why = probe(cxx)
    if not why:
        return  # fine, or no working compiler at all (the build itself will say)
    for alt in alternatives:
        if not (os.path.exists(alt) and probe([alt]) is None):
            continue
        cc = os.path.join(os.path.dirname(alt), "gcc")
        os.environ["CXX"] = alt
        os.environ["LDSHARED"] = f"{alt} -shared"
        if os.path.exists(cc):
            os.environ["CC"] = cc
        log(f"comet: the C++ compiler {' '.join(cxx)} cannot link the shared libstdc++ ({why}); "
            f"building with {alt} instead", file=sys.stderr)
        return
    raise SystemExit(f"comet: the C++ compiler {' '.join(cxx)} (CXX={os.environ.get('CXX', '')!r}) "
                     f"links a private libstdc++ into extensions ({why}); torch and comet would "
                     f"then run with two copies of the C++ runtime and crash. Fix: "
                     f"{fix_text(cxx[0])}.")


def guarded(build_ext_cls):
    """build_ext_cls with step 2 after each extension's link."""

    class GuardedBuildExt(build_ext_cls):
        def build_extension(self, ext):
            super().build_extension(ext)
            check_extension(self.get_ext_fullpath(ext.name))

    return GuardedBuildExt


def check_extension(path: str) -> None:
    """Step 2: raise SystemExit (after removing the file) if the linked extension at `path` does
    not use the shared libstdc++."""
    why = runtime_problem(path)
    if why is None:
        return
    os.remove(path)
    cxx = _cxx_command()
    raise SystemExit(f"comet: the built extension {os.path.basename(path)} was removed: {why}. "
                     f"Linked by {' '.join(cxx)}. Fix: {fix_text(cxx[0])}.")
