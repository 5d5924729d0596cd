"""Mutation check: plausible one-line bugs, each applied to a copy of the repository, each of which
the test suite must catch (`make mutants`).

Every mutant is (file, the exact original text, its replacement, the tests that must fail). The
copy holds the tracked and untracked-not-ignored files (no .venv, no build dirs). A Python mutant
runs against this repository's built extension (copied in). A C++ mutant recompiles only the
objects of this repository's CPU-only build (`COMET_CUDA=0 setup.py build_ext --inplace`) that
include the mutated source (ninja -t deps), with the compile lines of its build.ninja, and links
them with the other objects: minutes, not a full build. A `cpp:<target>` selection builds that
torch-free C++ test (CMakeLists.txt) in the copy and runs it.

    python tools/mutants.py                 # every mutant; table mutant -> killed by which test
    python tools/mutants.py --python-only   # no recompilation (what `make test` runs)
    python tools/mutants.py --only swiglu   # names containing a substring
Exit status 1 when a mutant survives (or its text is no longer in the file: update the list)."""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]  # pytest file [-k expr], or cpp:<CMake test target>


MUTANTS = [
    Mutant("topk_weights shape check disabled", "csrc/op_checks.cpp",
           "c.value(in.topk_weights.sizes() == in.topk_ids.sizes(),",
           "c.value(true || in.topk_weights.sizes() == in.topk_ids.sizes(),",
           ("tests/test_input_checks.py -k topk_weights",)),
    Mutant("home partial sums added in reverse", "csrc/include/comet/comm_layer1.h",
           "      for (int32_t p = 0; p < parts; ++p) {\n        float v[kColGroup];\n"
           "        load_group_as(recv + (p * pstride",
           "      for (int32_t p = parts - 1; p >= 0; --p) {\n        float v[kColGroup];\n"
           "        load_group_as(recv + (p * pstride",
           ("tests/test_layer1_order.py -k every_case", "cpp:test_fused")),
    Mutant("b1 added by every tp rank", "csrc/include/comet/layout.h",
           "return rank % tp == 0; }", "return rank >= 0 || tp == 0; }",
           ("tests/test_tp.py -k matches_reference",)),
    Mutant("FP8 B block scale ignored", "csrc/cpu/tile_gemm.h",
           "Acc(as ? as[kb] : 1.0f) * Acc(bs ? bs[kb] : 1.0f)", "Acc(as ? as[kb] : 1.0f)",
           ("tests/test_fp8.py -k dequantised_values",)),
    Mutant("swiglu gate and up swapped", "comet/nn.py",
           "gate, up = y.to(acc).chunk(2, dim=-1)", "up, gate = y.to(acc).chunk(2, dim=-1)",
           # the routed experts' SwiGLU is fused into layer0; nn.swiglu is the shared expert's
           ("tests/test_nn.py -k shared_expert_equals_sequential",)),
    Mutant("balance fraction counts / T", "comet/nn.py",
           "f = counts / max(T * k, 1)", "f = counts / max(T, 1)",
           ("tests/test_nn.py -k dense_reference",)),
    Mutant("COMET_NODE_REDUCE ignored", "comet/buffers/symm.py",
           'raw = os.environ.get("COMET_NODE_REDUCE", "")', 'raw = ""',
           ("tests/test_ops_sim.py -k environment_settings_are_read",
            "tests/test_node_reduce_cpu.py -k process_suite and 4-2")),
    Mutant("COMET_CPU_RANKS_PER_NODE ignored", "comet/buffers/symm.py",
           'rpn = _env_number("COMET_CPU_RANKS_PER_NODE", world, int)', "rpn = world",
           ("tests/test_ops_sim.py -k environment_settings_are_read",
            "tests/test_multinode_cpu.py -k full_op_suite and 4-2")),
    Mutant("layout from another buffer accepted", "comet/layers/ops.py",
           "if buf.handle != layout.buffer:", "if False:",
           ("tests/test_input_checks.py -k another_buffer",)),
    Mutant("mixed devices accepted", "comet/layers/ops.py",
           "        if dev != first:\n", "        if False:\n",
           ("tests/test_input_checks.py -k mixed_devices",)),
    Mutant("placement completed one rank past the group", "comet/plan/placement.py",
           "        return Placement(self._ranks, world=W)\n",
           "        return Placement(self._ranks, world=W + 1)\n",
           ("tests/test_placement.py -k trailing_empty_ranks_complete",)),
    Mutant("placement's given world completed like an inferred one", "comet/plan/placement.py",
           "        if self._explicit:\n", "        if False:\n",
           ("tests/test_placement.py -k explicit_world_that_is_not",)),
    # The planners' stated rules, each against an oracle that restates the rule (tests/test_plan.py)
    Mutant("replica rule without the expert's offset", "comet/plan/placement.py",
           "        dest[s] = cands[(i + e) % len(cands)]\n",
           "        dest[s] = cands[i % len(cands)]\n",
           ("tests/test_plan.py -k replica_rule_per_source_and_expert or "
            "replica_rule_on_hand_made",)),
    Mutant("replica rule deals each node's sources apart where no node holds a replica",
           "comet/plan/placement.py",
           "        tier = s // P if s // P in near else None\n"
           "        cands = near[tier] if tier is not None else reps\n",
           "        tier = s // P\n        cands = near[tier] if tier in near else reps\n",
           ("tests/test_plan.py -k replica_rule_per_source_and_expert or "
            "replica_rule_on_hand_made",)),
    Mutant("lysi merges when the union beats either side", "comet/plan/lysi.py",
           "(t_u == math.inf or t_uv < t_u) and (t_v", "(t_u == math.inf or t_uv < t_u) or (t_v",
           ("tests/test_plan.py -k lysi_group_merges_only or lysi_group_decision_on_two",)),
    Mutant("lysi merges on a tie", "comet/plan/lysi.py",
           "t_uv < t_u) and (t_v == math.inf or t_uv < t_v)",
           "t_uv <= t_u) and (t_v == math.inf or t_uv <= t_v)",
           ("tests/test_plan.py -k lysi_group_merges_only or lysi_group_decision_on_two",)),
    Mutant("lysi prices the union with as many groups as before", "comet/plan/lysi.py",
           "t_uv = _objective(members[gu] + members[gv], n - 1, *args)",
           "t_uv = _objective(members[gu] + members[gv], n, *args)",
           ("tests/test_plan.py -k lysi_group_merges_only or lysi_group_decision_on_two",)),
    Mutant("balance's room check counts every free slot for the first experts",
           "comet/plan/balance.py",
           "        if head > sum(min(c, i) for c in free):", "        if head > sum(free):",
           ("tests/test_plan.py -k balance_feasibility_check",)),
    Mutant("balance's room check stops one expert short", "comet/plan/balance.py",
           "    for i in range(1, min(len(d), max(free, default=0)) + 1):",
           "    for i in range(1, min(len(d), max(free, default=0))):",
           ("tests/test_plan.py -k balance_feasibility_check",)),
    # The placement path's reduction by slot and migrate's round trip (tests/test_placement.py)
    Mutant("placement's slot rows summed in reverse slot order", "comet/layers/placed.py",
           "    acc = rows[:, 0].float()\n    for j in range(1, topk):\n",
           "    acc = rows[:, topk - 1].float()\n    for j in range(topk - 2, -1, -1):\n",
           ("tests/test_placement.py -k each_slots_row_summed_in_slot_order",)),
    Mutant("placement's slot rows rounded after every slot", "comet/layers/placed.py",
           "        acc = acc + rows[:, j].float()\n",
           "        acc = (acc + rows[:, j].float()).to(dtype).float()\n",
           ("tests/test_placement.py -k each_slots_row_summed_in_slot_order",)),
    Mutant("migrate sends float64 as float32", "comet/plan/migrate.py",
           "    wire = torch.float64 if any(_wire(t) == torch.float64 for t in tensors) else "
           "torch.float32\n",
           "    wire = torch.float32\n",
           ("tests/test_placement.py -k migrate_there_and_back",)),
    Mutant("migrate unpacks a source's rows in reverse", "comet/plan/migrate.py",
           "    for s in recv_from:\n", "    for s in reversed(recv_from):\n",
           ("tests/test_placement.py -k migrate_there_and_back",)),
    # required_bytes against what calls of every dtype ask for (tests/test_symm_heap.py)
    Mutant("required_bytes counts float64 inputs' weights in 4 bytes", "comet/buffers/symm.py",
           "    acc = 8 if dtype == torch.float64 else 4\n", "    acc = 4\n",
           ("tests/test_symm_heap.py -k every_dtype",)),
    Mutant("required_bytes' FP8 rows without their scales", "comet/buffers/symm.py",
           "return (int(_C.engine.fp8_row_bytes(hidden)), 1) if o == 0 else (hidden, 2)",
           "return (hidden, 1) if o == 0 else (hidden, 2)",
           ("tests/test_symm_heap.py -k fp8_rows",)),
    # The packed FP8 row against docs/api.md's format (tests/test_fp8.py)
    Mutant("FP8 row scales aligned to 8 bytes", "csrc/include/comet/fp8_rows.h",
           "int64_t fp8_row_scales_at(int64_t hidden) { return ceil_div(hidden, 4) * 4; }",
           "int64_t fp8_row_scales_at(int64_t hidden) { return ceil_div(hidden, 8) * 8; }",
           ("tests/test_fp8.py -k documented_layout",)),
]


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


def make_copy(dest: Path) -> None:
    for f in repo_files():
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    for so in glob.glob(str(ROOT / "comet" / "_C*.so")):
        shutil.copy2(so, dest / "comet")


def build_dir() -> Path:
    found = sorted(ROOT.glob("build/temp*/build.ninja"))
    if not found:
        raise SystemExit("C++ mutants need this repository's CPU-only build: "
                         "COMET_CUDA=0 python setup.py build_ext --inplace")
    return found[0].parent


NINJA = shutil.which("ninja") or str(Path(sys.executable).with_name("ninja"))  # the venv's


def rebuild_cpp(copy: Path, mutated: str) -> None:
    """Recompile the objects that depend on `mutated` from the copy's sources; relink _C."""
    bdir = build_dir()
    ninja = (bdir / "build.ninja").read_text()
    if ".cu" in ninja and "cuda_compile" in ninja:
        raise SystemExit("C++ mutants need a CPU-only build (COMET_CUDA=0): this one has CUDA "
                         "objects")
    var = dict(re.findall(r"^(\w+) = (.*)$", ninja, re.M))
    objs = re.findall(r"^build (\S+\.o): compile (\S+)$", ninja, re.M)
    root = str(ROOT)
    new_objs = []
    target = str(ROOT / mutated)
    for obj, src in objs:
        # ninja keeps the headers each object includes in .ninja_deps (deps = gcc)
        deps = subprocess.run([NINJA, "-C", str(bdir), "-t", "deps", obj], capture_output=True,
                              text=True).stdout
        if target in deps or src == target:
            out = copy / "mutant_objs" / Path(obj).name
            out.parent.mkdir(exist_ok=True)
            # Only the repository's sources move to the copy: the include paths of a venv
            # inside the repository (.venv/.../torch/include) stay where they are.
            cflags = var["cflags"].replace(f"{root}/csrc", f"{copy}/csrc")
            cmd = (f"{var['cxx']} {cflags} -c {src.replace(root, str(copy))} -o {out} "
                   f"{var['post_cflags']}")
            subprocess.run(cmd, shell=True, check=True, cwd=copy, capture_output=True)
            new_objs.append(str(out))
        else:
            new_objs.append(obj)
    import torch.utils.cpp_extension as ce

    libdirs = " ".join(f"-L{d}" for d in ce.library_paths())
    so = next(iter(glob.glob(str(copy / "comet" / "_C*.so"))))
    os.remove(so)
    subprocess.run(f"{var['cxx']} -shared -pthread {' '.join(new_objs)} {libdirs} -lc10 -ltorch "
                   f"-ltorch_cpu -ltorch_python -lrt -o {so}", shell=True, check=True,
                   capture_output=True)


def run_cpp_test(copy: Path, target: str, timeout: float) -> tuple[bool, str]:
    """A torch-free C++ test (CMakeLists.txt target) built in the copy and run."""
    build = copy / "cbuild-mutant"
    subprocess.run(["cmake", "-S", str(copy), "-B", str(build), "-G", "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", os.environ.get("MAX_JOBS", "2"),
                    "--target", target], check=True, capture_output=True)
    try:
        r = subprocess.run([str(build / target)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, f"{target} (timed out: counts as killed)"
    first = next((l for l in r.stderr.splitlines() if "CHECK failed" in l), "")
    return r.returncode != 0, f"{target} ({first.split('/')[-1][:60]})"


def run_tests(copy: Path, selection: str, timeout: float) -> tuple[bool, str]:
    """Whether the selection fails (the mutant is killed), and the first failing test."""
    if selection.startswith("cpp:"):
        return run_cpp_test(copy, selection[4:], timeout)
    parts = shlex.split(selection)
    args = [parts[0]] + (["-k", " ".join(parts[2:])] if len(parts) > 2 and parts[1] == "-k" else [])
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p",
           "no:randomly", *args]
    env = {k: v for k, v in os.environ.items()
           if k not in ("COMET_CPU_RANKS_PER_NODE", "COMET_NODE_REDUCE")}
    try:
        r = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return True, f"{selection} (timed out: counts as killed)"
    failed = re.findall(r"^FAILED (\S+)", r.stdout, re.M)
    if r.returncode == 5:
        return False, f"NO TEST SELECTED by {selection!r}"
    return r.returncode != 0, failed[0] if failed else r.stdout.strip().splitlines()[-1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python-only", action="store_true", help="skip mutants that need a rebuild")
    ap.add_argument("--only", default="", help="mutants whose name contains this")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per test selection")
    ap.add_argument("--every-test", action="store_true",
                    help="run every selection of a mutant (default: stop at the first that fails)")
    a = ap.parse_args()
    chosen = [m for m in MUTANTS if a.only in m.name
              and not (a.python_only and not m.file.endswith(".py"))]
    rows, survived = [], 0
    for m in chosen:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="comet-mutant-") as tmp:
            copy = Path(tmp)
            make_copy(copy)
            path = copy / m.file
            text = path.read_text()
            if text.count(m.original) != 1:
                rows.append((m.name, "STALE: original text not found once", 0.0))
                survived += 1
                continue
            path.write_text(text.replace(m.original, m.replacement))
            if not m.file.endswith(".py") and any(not t.startswith("cpp:") for t in m.tests):
                rebuild_cpp(copy, m.file)
            killers = []
            for sel in m.tests:  # the first selection that fails kills it: the rest are spared
                killed, test = run_tests(copy, sel, a.timeout)
                if killed:
                    killers.append(str(test))
                    if not a.every_test:
                        break
            verdict = "killed by " + "; ".join(killers) if killers else "SURVIVED"
            survived += not killers
            rows.append((m.name, verdict, time.monotonic() - t0))
            print(f"{m.name}: {verdict} ({rows[-1][2]:.0f} s)", flush=True)
    print("\n| mutant | file | result | s |\n|---|---|---|--:|")
    for (name, verdict, secs), m in zip(rows, chosen):
        print(f"| {name} | {m.file} | {verdict} | {secs:.0f} |")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
