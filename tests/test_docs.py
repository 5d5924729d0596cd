"""The docs' samples and tables against what the code prints now (`make docs-check` runs this file), so a
sample cannot go stale:

* every figure tools/doc_figures.py makes: the demo's sample output (a fresh run of `make demo`'s
  command prints the same lines, every column but the two timing columns: the demo is
  deterministic), the cost model's tables and the symmetric memory table;
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
