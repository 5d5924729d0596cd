"""The docs' samples and tables against what the code prints now (`make docs-check` runs this file), so a
sample cannot go stale:

* every figure tools/doc_figures.py makes: the demo's sample output (a fresh run of `make demo`'s
  command prints the same lines as far as the code decides them on every machine: the title, each
  rank's tokens and rows, the verdict; the timing columns are the machine's, and each error column
  is compared with its bound, not digit by digit, since the reference's float32 matmuls round
  differently on different CPUs), the cost model's tables and the symmetric memory table (pure
  Python arithmetic: every cell);
* the CPU benchmark table has one home, bench/README.md; README.md links to it instead of keeping
  a second copy of a different run.
"""
import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCH_README = (ROOT / "bench" / "README.md").read_text()
# README and the guides under docs/: none may keep a copy of the CPU benchmark table.
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md",
                                                                *sorted((ROOT / "docs").glob("*.md"))]}


def _figures():
    """tools/doc_figures.py, the one place that makes every figure of the docs."""
    spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "tools" / "doc_figures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


FIG = _figures()


@pytest.mark.parametrize("name", list(FIG.FIGURES))
def test_docs_figure_is_what_the_code_makes(name):
    """Each figure between its markers (the demo's sample, the model tables, the symmetric memory
    table) equals what tools/doc_figures.py generates now; `make docs` rewrites a stale one."""
    diff = FIG.stale(name)
    assert not diff, ("stale figure; run `python tools/doc_figures.py --only " + name + "`:\n"
                      + "\n".join(diff))


def test_figure_check_notices_a_changed_cell():
    """The check is not vacuous: one changed digit in a table is reported."""
    lines = FIG.FIGURES["model-one-node"].make()
    assert FIG.stale("model-one-node", lines) == []
    bad = lines[:2] + [lines[2].replace("|", "| 9", 2)] + lines[3:]
    assert FIG.stale("model-one-node", bad)


def _demo_row(lines, rank, column, value):
    """lines with rank's row of the demo's sample holding value in column (0: rank, 1: tokens,
    2: rows, 3-4: ms, 5-7: errors)."""
    out = list(lines)
    for i, line in enumerate(out):
        cells = line.split()
        if cells and cells[0] == str(rank):
            cells[column] = value
            out[i] = "  ".join(cells)
            return out
    raise AssertionError(f"no row of rank {rank} in {lines}")


def _demo_verdict(lines, pattern, new):
    """lines with the demo's verdict line's `pattern` (a regex) replaced by new."""
    out = [re.sub(pattern, new, line) if line.startswith("max abs error") else line
           for line in lines]
    assert out != lines, pattern
    return out


def test_demo_figure_check_compares_what_every_machine_computes():
    """README's demo sample against other runs' lines (the check `python tools/doc_figures.py
    --check` and test_docs_figure_is_what_the_code_makes make, without running the demo): another
    machine's timings and error digits within the bound pass (an error may exceed atol where the
    reference is large: the bound is atol + rtol * max |reference|); a changed token or row count,
    a FAILED verdict, another tolerance, an error beyond its bound or no number, a missing rank or
    verdict line are reported."""
    lines = FIG.current("demo")
    assert FIG.stale("demo", lines) == []
    bound = FIG.demo_error_bound(lines)
    assert bound is not None and 0.02 < bound < 1.0, bound
    same = [
        _demo_row(lines, 0, 3, "12345.6"),  # timings
        _demo_row(lines, 3, 4, "0.1"),
        _demo_row(lines, 1, 5, "3.91e-03"),  # another CPU's rounding (an Intel Xeon's rank 1 layer0)
        _demo_row(lines, 3, 5, "1.56e-02"),
        _demo_row(lines, 2, 7, "3.12e-02"),  # two bf16 ulps at |y| in [4, 8): above atol
        _demo_row(lines, 0, 6, "0.00e+00"),
        _demo_verdict(lines, r"max \|reference\| \S+;", "max |reference| 5.12;"),  # BLAS's too
        _demo_verdict(lines, r"max abs error \S+,", "max abs error 3.125e-02,"),
    ]
    for other in same:
        assert FIG.stale("demo", other) == [], "\n".join(other)
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rank"])
    wrong = {
        "tokens": _demo_row(lines, 2, 1, "260"),
        "rows": _demo_row(lines, 1, 2, "528"),
        "verdict": _demo_verdict(lines, r": OK$", ": FAILED"),
        "tolerance": _demo_verdict(lines, r"atol=rtol=0\.02 ", "atol=rtol=0.05 "),
        "largest error beyond the bound": _demo_verdict(lines, r"max abs error \S+,",
                                                        f"max abs error {2 * bound:.3e},"),
        "error beyond the bound": _demo_row(lines, 0, 7, f"{1.5 * bound:.2e}"),
        "error not a number": _demo_row(lines, 3, 6, "nan"),
        "negative error": _demo_row(lines, 3, 6, "-1.00e-03"),
        "a rank missing": lines[:header + 1] + lines[header + 2:],
        "no verdict": [line for line in lines if not line.startswith("max abs error")],
    }
    for what, other in wrong.items():
        assert FIG.stale("demo", other), what


def test_demo_figure_is_make_demos_command():
    assert FIG.FIGURES["demo"].path == "README.md"
    assert FIG.demo_command()[:2] == ["--world", "4"], FIG.demo_command()


def test_the_cpu_benchmark_table_lives_in_bench_readme_only():
    header = re.compile(r"^\|\s*model\s*\|\s*W\s*\|.*Comet W=1", re.M)
    assert len(header.findall(BENCH_README)) == 1
    for name, text in DOCS.items():
        assert not header.findall(text), f"{name} keeps its own copy of the CPU benchmark table"
    assert "## CPU result" in BENCH_README
    assert "(../bench/README.md#cpu-result)" in DOCS["docs/tuning.md"]
