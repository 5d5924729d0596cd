"""Lists the ops' input checks and fails if one has no test.

A check is a message: every string literal of the checks in csrc/op_checks.cpp (from Checker's
methods to check_layer1) and every fail_call message in comet/layers/ops.py. A check counts as tested
when its literal text appears in an expected message of the tests (tests/*.py, regex escapes
removed); tests/test_input_checks.py triggers each one on a group of ranks. The few that cannot be
triggered from a test are listed in UNREACHABLE with the reason.

    python tools/check_coverage.py        # table of checks -> test file; exit 1 if one is untested
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# literal -> why no test triggers it
UNREACHABLE = {
    "is undefined": "an undefined tensor cannot be passed from Python (the schema takes Tensor)",
    "; this call needs tensors on": "the wrapper's mixed-device check (ops.py) fires first; a raw "
                                    "torch.ops call with a meta tensor dispatches to the fake kernel",
    "topk_ids is too large for int32 row indices": "needs 2^31 routing slots (16 GiB of ids)",
    ": inputs are on": "needs a CUDA tensor on a build without CUDA kernels",
    "but this build of comet has": "needs a CUDA tensor on a build without CUDA kernels",
    "no CUDA kernels (rebuild with nvcc available and COMET_CUDA unset)":
        "needs a CUDA tensor on a build without CUDA kernels",
}

LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')


def op_check_literals() -> list[str]:
    src = (ROOT / "csrc" / "op_checks.cpp").read_text()
    body = src[src.index("bool Checker::tensor"):src.index("ScalarKind scalar_kind")]
    return [m.group(1) for m in LITERAL.finditer(body)]


def ops_py_literals() -> list[str]:
    src = (ROOT / "comet" / "layers" / "ops.py").read_text()
    out = []
    # fail_call(op, "message" ...) or fail_call(op, "message" ..., TypeError)
    for call in re.finditer(r"fail_call\(\s*\w+,\s*((?:f?\"[^\"]*\"\s*)+)(?:,\s*\w+)?\)", src):
        for lit in re.finditer(r'f?"([^"]*)"', call.group(1)):
            # the constant pieces of an f-string, between its {fields}
            out += [p for p in re.split(r"\{[^}]*\}", lit.group(1))]
    return out


def significant(lit: str) -> bool:
    """A literal that says something (not an argument name like "x" or a bare separator)."""
    return len(re.findall(r"[A-Za-z0-9]", lit)) >= 4 and not re.fullmatch(r"[\w.]+", lit)


def tests_text() -> dict[str, str]:
    texts = {}
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        t = p.read_text()
        # a message split over lines ("...and "\n    r"float64...") read as one string
        t = re.sub(r'"\s*\n\s*[rf]*"', "", t)
        texts[p.name] = t.replace("\\", "")
    return texts


def main() -> int:
    checks = [("csrc/op_checks.cpp", lit) for lit in op_check_literals()] + \
             [("comet/layers/ops.py", lit) for lit in ops_py_literals()]
    texts = tests_text()
    missing = 0
    seen = set()
    print(f"{'check message fragment':78} tested in")
    for where, lit in checks:
        lit = lit.replace('\\"', '"')
        if not significant(lit) or lit in seen:
            continue
        seen.add(lit)
        probe = lit.strip()
        hits = [name for name, t in texts.items() if probe in t]
        if hits:
            status = ", ".join(hits[:2])
        elif probe in UNREACHABLE:
            status = f"(unreachable: {UNREACHABLE[probe]})"
        else:
            status = "NO TEST"
            missing += 1
        print(f"{where + ': ' + repr(probe):78.78} {status}")
    print(f"{len(seen)} checks, {missing} without a test")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
