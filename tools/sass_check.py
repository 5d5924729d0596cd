"""What the comm paths of comet's CUDA kernels compile to, read from the SASS (cuobjdump -sass; no
GPU needed). Used by tools/check_ptxas.py on every object it compiles.

Checks, per kernel and architecture (stubs - the sm_90a path built for another architecture,
a few instructions - are skipped):
  - layer0 fused kernels (fused_kernel<T, 0>): some straight run of at least kCopyUnroll
    (csrc/include/comet/copy.h) 128-bit global/generic loads (LDG.E.128 / LD.E.128; not
    LDGSTS, the GEMM's cp.async) with no 128-bit store between them: the row copy keeps that
    many loads in flight per thread;
  - layer1 fused kernels (fused_kernel<T, 1>): 128-bit loads of C and 128-bit stores of partials;
  - the combine kernel: 128-bit loads of partials and 128-bit stores of the output;
  - the HBM read-rate kernel (hbm_read_kernel<L>, tools/hbm_stream.py): a straight run of L
    128-bit loads with no LOP3 (the XOR that uses them) between: what it measures is L loads in
    flight per thread, and ptxas interleaves uses with loads when it saves registers;
  - the FP8 fused kernels on their tensor-core architecture (FP8_MMA_RULES): fused_sm90_fp8_layer*
    for sm_90a must contain FP8 wgmma (QGMMA.*.E4M3.E4M3), fused_sm89_fp8_layer* for sm_89 FP8
    mma.sync (QMMA.16832.F32.E4M3.E4M3). Without them the GEMM fell back to something that is not
    an FP8 tensor-core instruction (a silent large slowdown); this rule also applies to a kernel
    short enough to look like a stub, and a source with none of its fused kernels at that
    architecture fails too.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD128 = re.compile(r"\b(LDG|LD)\.E(\.\w+)*\.128\b")
STORE128 = re.compile(r"\b(STG|ST)\.E(\.\w+)*\.128\b")
FUNC = re.compile(r"Function : (\S+)")
ARCH = re.compile(r"arch = (sm_\w+)")
STUB_INSTRUCTIONS = 40
# kLayer, the template's last int argument of a void function template ("...Li0EEEv..."), or the
# one before a tile-rows argument and/or bools (sm89::fused_kernel<kLayer, kM, kAct, kHFp8>:
# "...Li0ELi64ELb1ELb0EEEv..."), or followed by a bool first (sm80::fused_kernel<T, kLayer,
# kMnB, kM, kAct, ...>: "...Li0ELb1ELi64ELb0EEEv...").
LAYER_ARG = re.compile(r"Li([01])E(?:Lb[01]E)?(?:Li(?:64|128)E)?(?:Lb[01]E)*EEv")
# hbm_read_kernel<kLoads> (csrc/cuda/hbm_read.cu): its loads in flight per thread.
HBM_READ_ARG = re.compile(r"hbm_read_kernelILi(\d+)E")
USE = re.compile(r"\bLOP3\b")
# (source file name prefix, architecture, the SASS opcode its fused kernels must contain, what).
FP8_MMA_RULES = (
    ("fused_sm90_fp8_layer", "sm_90a", re.compile(r"\bQGMMA\.\S*E4M3\.E4M3\b"),
     "QGMMA.*.E4M3.E4M3 (FP8 wgmma)"),
    ("fused_sm89_fp8_layer", "sm_89", re.compile(r"\bQMMA\.16832\.F32\.E4M3\.E4M3\b"),
     "QMMA.16832.F32.E4M3.E4M3 (FP8 mma.sync)"),
)


def copy_unroll() -> int:
    with open(os.path.join(ROOT, "csrc", "include", "comet", "copy.h")) as f:
        return int(re.search(r"kCopyUnroll\s*=\s*(\d+)", f.read()).group(1))


def cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, else the one the triton wheel (a torch dependency) ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates = [os.path.join(home, "bin", "cuobjdump")]
    import site
    for d in site.getsitepackages():
        candidates += glob.glob(os.path.join(d, "triton", "backends", "nvidia", "bin", "cuobjdump"))
    return next((c for c in candidates if os.path.exists(c)), None)


def functions(sass: str):
    """(arch, mangled name, instruction lines) per function of a cuobjdump -sass listing. A
    function's arch is the one of the ELF section it starts in (an "arch =" line opens the next
    section and ends the function before it)."""
    arch, fn_arch, name, body = None, None, None, []
    for line in sass.splitlines():
        m = ARCH.search(line)
        if m:
            if name:
                yield fn_arch, name, body
                name, body = None, []
            arch = m.group(1)
            continue
        m = FUNC.search(line)
        if m:
            if name:
                yield fn_arch, name, body
            name, fn_arch, body = m.group(1), arch, []
            continue
        if name and "/*" in line and ";" in line:
            body.append(line)
    if name:
        yield fn_arch, name, body


def stats(body: list[str]) -> dict:
    """128-bit loads and stores, the longest run of 128-bit loads without a 128-bit store
    (in_flight), and without a LOP3 either (before_use)."""
    loads = stores = run = best = used_run = before_use = 0
    for line in body:
        if "LDGSTS" in line:
            continue
        if LOAD128.search(line):
            loads += 1
            run += 1
            used_run += 1
            best = max(best, run)
            before_use = max(before_use, used_run)
        elif STORE128.search(line):
            stores += 1
            run = used_run = 0
        elif USE.search(line):
            used_run = 0
    return dict(loads=loads, stores=stores, in_flight=best, before_use=before_use,
                instructions=len(body))


def kind(mangled: str) -> str | None:
    if HBM_READ_ARG.search(mangled):
        return "hbm_read"
    if "fused_kernel" in mangled:
        m = LAYER_ARG.search(mangled)
        return f"layer{m.group(1)}" if m else None
    if "combine_kernel" in mangled:
        return "combine"
    return None


def fp8_mma_rule(source: str, arch: str):
    """(opcode pattern, what) the fused kernels of `source` must contain on `arch`, or None."""
    base = os.path.basename(source)
    return next(((op, what) for prefix, a, op, what in FP8_MMA_RULES
                 if base.startswith(prefix) and a == arch), None)


def check(obj: str, source: str, tool: str, unroll: int):
    """Rows (kernel, arch, kind, stats) and problems of one compiled object. stats["fp8_mma"]: the
    FP8 tensor-core instructions of a kernel under FP8_MMA_RULES, else None."""
    sass = subprocess.run([tool, "-sass", obj], capture_output=True, text=True).stdout
    rows, problems = [], []
    fp8_archs, fp8_checked = set(), set()
    for arch, name, body in functions(sass):
        rule = fp8_mma_rule(source, arch)
        if rule is not None:
            fp8_archs.add(arch)
        k = kind(name)
        if k is None:
            continue
        s = stats(body)
        s["fp8_mma"] = None
        if rule is not None:
            s["fp8_mma"] = sum(1 for line in body if rule[0].search(line))
            fp8_checked.add(arch)
            if s["fp8_mma"] == 0:
                problems.append(f"{source}: {name} ({arch}): no {rule[1]} instruction: the FP8 "
                                "GEMM does not run on the tensor cores")
        if s["instructions"] < STUB_INSTRUCTIONS:
            continue
        rows.append((name, arch, k, s))
        if k == "layer0" and s["in_flight"] < unroll:
            problems.append(f"{source}: {name} ({arch}): at most {s['in_flight']} 128-bit loads "
                            f"in a row in the row copy, want {unroll} (kCopyUnroll)")
        if k == "hbm_read":
            want = int(HBM_READ_ARG.search(name).group(1))
            if s["before_use"] < want:
                problems.append(f"{source}: {name} ({arch}): at most {s['before_use']} 128-bit "
                                f"loads before their first use, want {want}")
        if k in ("layer1", "combine") and (s["loads"] < 1 or s["stores"] < 1):
            problems.append(f"{source}: {name} ({arch}): {s['loads']} 128-bit loads, "
                            f"{s['stores']} 128-bit stores in the {k} comm path, want both")
    for arch in sorted(fp8_archs - fp8_checked):
        problems.append(f"{source}: no fused kernel found in its {arch} SASS (the FP8 tensor-core "
                        "check has nothing to check)")
    return rows, problems
