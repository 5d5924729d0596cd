#!/usr/bin/env python3
"""Static check of comet's CUDA kernels from ptxas's resource report (no GPU needed).

Compiles every csrc/cuda/*.cu with the build's own nvcc flags (comet_build.py: per source, so the
NVSHMEM proxy, comet_build.RDC_SOURCES, is compiled with -rdc=true as the build does) for its
architectures, comet_build.source_archs (every architecture of COMET_CUDA_ARCHS, default "80;90a";
the sm_89 FP8 kernels' sources for sm_89 only), with `-Xptxas -v`, or parses an existing log
(--log, e.g. a build run with COMET_PTXAS_VERBOSE=1), and prints one row per kernel and
architecture: registers, static and dynamic shared memory, stack frame, spill stores / loads.

Also reads each object's SASS (tools/sass_check.py): layer0's row copy must keep kCopyUnroll
128-bit loads in flight per thread, layer1's comm path and the combine kernel must use 128-bit
loads and stores, and the FP8 fused kernels must contain FP8 tensor-core instructions (sm_90a
QGMMA e4m3, sm_89 QMMA.16832 e4m3).

Fails (exit code 1) when
  - a GEMM kernel (the fused kernels, FP8 ones included: comm + GEMM blocks) spills registers;
  - a device function of ours spills (NVSHMEM's own out-of-line functions, emitted by the -rdc
    proxy, are listed apart: not our code, and only the proxy kernel calls them);
  - ptxas reports C7509 / C7510 ("wgmma.mma_async instructions are serialized": every wgmma
    waits for the previous one) or C7504 ("setmaxnreg ignored"): silent large slowdowns;
  - the SASS checks (tools/sass_check.py) fail;
  - a source does not compile, or no kernel at all was found.
Exit code 2: bad usage / no nvcc.

    python tools/check_ptxas.py [--jobs 2] [--log build.log] [--archs "80;90a"]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import comet_build  # noqa: E402  (the build's flags)
import sass_check  # noqa: E402  (tools/sass_check.py: the comm paths' SASS)

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
PROPS = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
BAD_CODES = {"C7509": "wgmma serialized", "C7510": "wgmma serialized", "C7504": "setmaxnreg ignored"}
BAD_TEXT = ("wgmma.mma_async instructions are serialized", "setmaxnreg ignored")
GEMM_KERNEL = re.compile(r"fused_kernel")
# Out-of-line NVSHMEM device functions (mangled or not) that an -rdc compile emits from its headers.
NVSHMEM_FUNCTION = re.compile(r"nvshmem")

# Dynamic shared memory is not in ptxas's report: a host-only probe prints the kernels' constants,
# one line per kernel family (kernel_family()).
SMEM_PROBE = r"""
#include <cstdio>
#include "fused_sm80.cuh"
#include "fused_sm89_fp8.cuh"
#include "fused_sm90.cuh"
template <int kM>
void rows(const char* tag) {
  using namespace comet::gpu;
  std::printf("sm80%s %d %d\n", tag, sm80::TileGemm<cutlass::bfloat16_t, false, kM>::kSmemBytes,
              sm80::TileGemm<cutlass::bfloat16_t, false, kM>::kThreads);
  std::printf("sm90%s %d %d\n", tag, sm90::GemmConfig<cutlass::bfloat16_t, sm90::KMajorB, kM>::kSmemBytes,
              sm90::GemmConfig<cutlass::bfloat16_t, sm90::KMajorB, kM>::kThreads);
  std::printf("sm90_fp8%s %d %d\n", tag, sm90::Fp8GemmConfig<kM>::kSmemBytes,
              sm90::Fp8GemmConfig<kM>::kThreads);
  std::printf("sm89_fp8%s %d %d\n", tag, sm89::Fp8TileGemm<kM>::kSmemBytes,
              sm89::Fp8TileGemm<kM>::kThreads);
  // The fused activation's epilogue pairs accumulator halves (epilogue.cuh, store_tile_act).
  using B16 = sm80::TileGemm<cutlass::bfloat16_t, false, kM>;
  using F16 = sm80::TileGemm<cutlass::half_t, false, kM>;
  std::printf("pairs:sm80%s %d 0\n", tag,
              int(fragment_halves_pair<typename B16::TiledMma, B16::kBM, B16::kBN>() &&
                  fragment_halves_pair<typename F16::TiledMma, F16::kBM, F16::kBN>()));
  using F8 = sm89::Fp8TileGemm<kM>;
  std::printf("pairs:sm89_fp8%s %d 0\n", tag,
              int(fragment_halves_pair<typename F8::TiledMma, F8::kBM, F8::kBN>()));
  // layer0's FP8-h kernels (h_fp8_epilogue.cuh): their shared memory, and the row layout their
  // amax relies on (a "pairs:" line: 1 when it holds).
  std::printf("sm80_hfp8%s %d %d\n", tag, sm80::kKernelSmem<cutlass::bfloat16_t, false, kM, true>,
              B16::kThreads);
  std::printf("sm89_fp8_hfp8%s %d %d\n", tag, sm89::kKernelSmem<kM, true>, F8::kThreads);
  std::printf("pairs:hfp8_rows_sm80%s %d 0\n", tag,
              int(h_fp8_rows_in_quads<typename B16::TiledMma, B16::kBM, B16::kBN>() &&
                  h_fp8_rows_in_quads<typename F16::TiledMma, F16::kBM, F16::kBN>()));
  std::printf("pairs:hfp8_rows_sm89_fp8%s %d 0\n", tag,
              int(h_fp8_rows_in_quads<typename F8::TiledMma, F8::kBM, F8::kBN>()));
  // sm_90a: the wgmma TiledMma of each tile height (128 rows: two MMA warpgroups, 64: one), of
  // every instantiation the fused activation runs (both dtypes, both B layouts).
  using S0 = sm90::GemmConfig<cutlass::bfloat16_t, sm90::KMajorB, kM>;
  using S1 = sm90::GemmConfig<cutlass::bfloat16_t, sm90::MnMajorB, kM>;
  using S2 = sm90::GemmConfig<cutlass::half_t, sm90::KMajorB, kM>;
  using S3 = sm90::GemmConfig<cutlass::half_t, sm90::MnMajorB, kM>;
  std::printf("pairs:sm90%s %d 0\n", tag,
              int(fragment_halves_pair<typename S0::TiledMma, S0::kTileM, S0::kTileN>() &&
                  fragment_halves_pair<typename S1::TiledMma, S1::kTileM, S1::kTileN>() &&
                  fragment_halves_pair<typename S2::TiledMma, S2::kTileM, S2::kTileN>() &&
                  fragment_halves_pair<typename S3::TiledMma, S3::kTileM, S3::kTileN>()));
}
int main() {
  rows<128>("");
  rows<64>("_64");
  return 0;
}
"""


def unstatic(name: str) -> str:
    """An -rdc compile prefixes internal-linkage kernels with __nv_static_<n>__<hash>_: drop it."""
    if name.startswith("__nv_static_") and "_Z" in name:
        return name[name.index("_Z"):]
    return name


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(unstatic(n) for n in names),
                         capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def short(name: str) -> str:
    """comet::gpu::sm90::fused_kernel<cutlass::bfloat16_t, 0>(...) -> sm90::fused_kernel<bf16, 0>"""
    n = name.replace("(anonymous namespace)::", "")
    depth, cut = 0, len(n)
    for i in range(len(n) - 1, -1, -1):  # drop the trailing parameter list
        depth += {")": 1, "(": -1}.get(n[i], 0)
        if depth == 0 and n[i] == "(":
            cut = i
            break
    n = n[:cut]
    n = n.removeprefix("void ").replace("comet::gpu::", "").replace("cutlass::bfloat16_t", "bf16")
    return n.replace("cutlass::half_t", "f16")


def parse(text: str, source: str, notes: list[str] | None = None):
    """Rows {kernel, arch, regs, smem, stack, spill_st, spill_ld, source} and problems; `notes`
    receives what is reported but not a failure (NVSHMEM's own functions' spills)."""
    rows, problems = [], []
    notes = [] if notes is None else notes
    entry = None   # row of the entry function being compiled
    target = None  # function the next "N bytes stack frame" line belongs to
    for line in text.splitlines():
        m = ENTRY.search(line)
        if m:
            entry = dict(kernel=m.group(1), arch=m.group(2), regs=None, smem=0, stack=0,
                         spill_st=0, spill_ld=0, source=source)
            rows.append(entry)
            continue
        m = PROPS.search(line)
        if m:
            target = m.group(1)
            continue
        m = FRAME.search(line)
        if m:
            if entry is not None and target == entry["kernel"]:
                entry["stack"], entry["spill_st"], entry["spill_ld"] = map(int, m.groups())
            elif int(m.group(2)) or int(m.group(3)):
                what = f"{source}: device function {target} spills: {line.strip()}"
                (notes if target and NVSHMEM_FUNCTION.search(target) else problems).append(what)
            continue
        m = USED.search(line)
        if m and entry is not None and entry["regs"] is None:
            entry["regs"] = int(m.group(1))
            entry["smem"] = int(m.group(2) or 0)
            continue
        if any(f"({c})" in line for c in BAD_CODES) or any(t in line for t in BAD_TEXT):
            problems.append(f"{source}: {line.strip()}")
    return rows, problems


# Kernel family (the probe's key) -> the architecture its device code is built for; on any other
# it is an empty, never-launched stub.
FAMILY_ARCH = {"sm80": None, "sm90": "sm_90a", "sm90_fp8": "sm_90a", "sm89_fp8": "sm_89"}
FAMILY_ARCH.update({"sm80_hfp8": None, "sm89_fp8_hfp8": "sm_89"})
FAMILY_ARCH.update({f + "_64": a for f, a in FAMILY_ARCH.items()})


# A fused kernel's tile rows are its last template argument (sm80 / sm89: fused_kernel<..., 64>;
# sm90: GemmConfig<..., 64> / Fp8GemmConfig<64>); the 64-row kernels' probe keys end in "_64".
ROWS_64 = re.compile(r"[<,] ?64>")
HFP8 = re.compile(r", (64|128), true, true>$")


def kernel_family(name: str) -> str | None:
    """The SMEM_PROBE key of a kernel's short name, None for kernels without dynamic smem."""
    tag = "_64" if ROWS_64.search(name) else ""
    hfp8 = HFP8.search(name)  # layer0's FP8-h kernels (more shared memory)
    if hfp8 and ("sm80::" in name or "sm89::" in name):
        return ("sm89_fp8" if "sm89::" in name else "sm80") + "_hfp8" + (
            "_64" if hfp8.group(1) == "64" else "")
    if "sm90::" in name:
        return ("sm90_fp8" if "Fp8GemmConfig" in name else "sm90") + tag
    if "sm89::" in name:
        return "sm89_fp8" + tag
    return "sm80" + tag if "sm80::" in name else None


def compile_one(source: str, outdir: str, objdump: str | None):
    """Compiles `source` for comet_build.source_archs(source), as the build does."""
    obj = os.path.join(outdir, os.path.basename(source) + ".o")
    cmd = comet_build.nvcc_command(ROOT, os.path.join(ROOT, source),
                                   comet_build.source_archs(source), ["-Xptxas=-v", "-o", obj])
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.time() - start
    sass = ([], [])
    if proc.returncode == 0 and objdump:
        sass = sass_check.check(obj, source, objdump, sass_check.copy_unroll())
    return source, proc.returncode, proc.stdout + proc.stderr, secs, sass


def dynamic_smem(archs: list[str]) -> dict[str, tuple[int, int]] | None:
    """{family: (bytes, threads)} from a host-only probe (None when it does not build or run);
    also {"pairs:<family>": (1 or 0, 0)}, the fused activation's pairing check."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cu")
        exe = os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(SMEM_PROBE)
        cmd = comet_build.nvcc_command(ROOT, src, ["90a" if "90a" in archs else archs[0]])
        cmd = [c for c in cmd if c != "-c"] + ["-o", exe]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode != 0:
            print("check_ptxas: the host probe does not build:\n" + built.stderr[-3000:],
                  file=sys.stderr)
            return None
        ran = subprocess.run([exe], capture_output=True, text=True)
        if ran.returncode != 0:
            return None
        out = ran.stdout
    res = {}
    for line in out.splitlines():
        key, smem, threads = line.split()
        res[key] = (int(smem), int(threads))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2, help="parallel nvcc jobs (default 2)")
    ap.add_argument("--archs", default=os.environ.get("COMET_CUDA_ARCHS", comet_build.DEFAULT_ARCHS))
    ap.add_argument("--log", help="parse this ptxas -v log instead of compiling")
    ap.add_argument("--no-smem-probe", action="store_true",
                    help="skip the host probe that reports dynamic shared memory")
    ap.add_argument("--only", default="",
                    help="comma-separated substrings: compile only the csrc/cuda/*.cu whose path "
                         "contains one (e.g. --only prologue,combine); default every source")
    args = ap.parse_args(argv)
    os.environ["COMET_CUDA_ARCHS"] = args.archs
    archs = comet_build.archs()

    rows, problems, failures, sass_rows, notes = [], [], [], [], []
    if args.log:
        with open(args.log) as f:
            r, p = parse(f.read(), os.path.basename(args.log), notes)
        rows += r
        problems += p
    else:
        if shutil.which("nvcc") is None and not os.path.exists(
                os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
            print("check_ptxas: nvcc not found", file=sys.stderr)
            return 2
        sources = comet_build.cuda_sources(ROOT)
        if args.only:
            keys = [k for k in args.only.split(",") if k]
            sources = [s for s in sources if any(k in s for k in keys)]
        if not sources:
            print("check_ptxas: no csrc/cuda/*.cu", file=sys.stderr)
            return 2
        t0 = time.time()
        objdump = sass_check.cuobjdump()
        if objdump is None:
            print("check_ptxas: no cuobjdump (CUDA toolkit or triton wheel): SASS checks skipped")
        with tempfile.TemporaryDirectory() as tmp, \
                cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for source, rc, out, secs, (srows, sprobs) in pool.map(
                    lambda s: compile_one(s, tmp, objdump), sources):
                sass_rows += srows
                problems += sprobs
                rdc = " (-rdc=true)" if comet_build.is_rdc(source) else ""
                built = comet_build.source_archs(source)
                print(f"compiled {source}{rdc} for {','.join('sm_' + a for a in built)} in "
                      f"{secs:.0f} s" + ("" if rc == 0 else "  FAILED"))
                if rc != 0:
                    failures.append(f"{source}: nvcc exit {rc}\n{out[-4000:]}")
                r, p = parse(out, source, notes)
                rows += r
                problems += p
        print(f"total compile time {time.time() - t0:.0f} s with {args.jobs} job(s)")

    smem = {} if args.no_smem_probe or args.log else dynamic_smem(archs)
    if smem is None:  # no probe: neither the dynamic shared memory nor the pairing is known
        problems.append("the host probe (dynamic shared memory, the fused activation's "
                        "accumulator pairing) did not build or run")
        smem = {}
    # The probe's "pairs:<family> <ok> 0" lines: the fused activation's accumulator pairing.
    pairs = {k: v[0] for k, v in smem.items() if k.startswith("pairs:")}
    smem = {k: v for k, v in smem.items() if not k.startswith("pairs:")}
    for k, ok in sorted(pairs.items()):
        rows_check = k.startswith("pairs:hfp8_rows")
        print(f"fused activation: {k[6:]} " + ("rows by slot and quad (h_fp8's amax): "
              if rows_check else "accumulator halves pair in one thread: ") +
              ("yes" if ok else "NO"))
        if not ok:
            what = "h_fp8_epilogue.cuh's row layout" if rows_check else "store_tile_act's pairing"
            problems.append(f"{k[6:]}: {what} does not hold for its TiledMma")
    names = demangle(sorted({r["kernel"] for r in rows}))
    header = ("kernel", "arch", "regs", "smem static", "smem dynamic", "stack", "spill st",
              "spill ld", "source")
    table = []
    for r in sorted(rows, key=lambda r: (r["source"], names[r["kernel"]], r["arch"])):
        name = short(names[r["kernel"]])
        family = kernel_family(name)
        dyn = smem.get(family, (None,))[0] if family else 0
        stub = FAMILY_ARCH.get(family) not in (None, r["arch"])
        if stub:  # e.g. the sm_90a path built for sm_80: an empty, never-launched stub
            name += " (stub)"
        table.append((name, r["arch"], str(r["regs"]), str(r["smem"]),
                      "-" if stub else "?" if dyn is None else str(dyn), str(r["stack"]),
                      str(r["spill_st"]), str(r["spill_ld"]),
                      r["source"] + (" (rdc)" if comet_build.is_rdc(r["source"]) else "")))
        if GEMM_KERNEL.search(name) and (r["spill_st"] or r["spill_ld"]):
            problems.append(f"{r['source']}: GEMM kernel {name} for {r['arch']} spills "
                            f"({r['spill_st']} bytes stored, {r['spill_ld']} loaded)")
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h)
              for i, h in enumerate(header)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths)))
    if smem:
        print("\n(smem dynamic: the fused kernels' dynamic shared memory per block; "
              "threads per block: " + ", ".join(f"{k} {v[1]}" for k, v in sorted(smem.items()))
              + "; stack frames of the fused kernels are the timeout path's printf buffer and, "
              "where a tile calls the readiness wait, the registers saved around that call)")
    if sass_rows:
        sass_names = demangle(sorted({r[0] for r in sass_rows}))
        print("\nSASS of the comm paths (128-bit global/generic loads and stores; 'in flight': "
              "longest run of 128-bit loads with no 128-bit store between them) and the FP8 "
              "kernels' tensor-core instructions ('fp8 mma': QGMMA e4m3 on sm_90a, QMMA.16832 "
              "e4m3 on sm_89)")
        print(f"{'kernel':44s}  {'arch':7s}  {'path':7s}  {'ld.128':>6s}  {'st.128':>6s}  "
              f"{'in flight':>9s}  {'fp8 mma':>7s}")
        for name, arch, k, st in sorted(sass_rows, key=lambda r: (sass_names[r[0]], r[1])):
            mma = "-" if st.get("fp8_mma") is None else str(st["fp8_mma"])
            print(f"{short(sass_names[name]):44s}  {arch:7s}  {k:7s}  {st['loads']:6d}  "
                  f"{st['stores']:6d}  {st['in_flight']:9d}  {mma:>7s}")
    if notes:
        print("\nNot ours (NVSHMEM's out-of-line device functions in the -rdc proxy; not a failure):")
        for n in sorted(set(notes)):
            print(f"  {n}")
    if not rows and not failures:
        failures.append("no kernel found in the ptxas output (was -Xptxas -v passed?)")
    for f in failures:
        print(f"\nFAIL {f}", file=sys.stderr)
    for p in sorted(set(problems)):
        print(f"FAIL {p}", file=sys.stderr)
    ok = not failures and not problems
    print("\nptxas check " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
