"""The README's samples against what the code prints now (`make docs-check` runs this file), so a
sample cannot go stale:

* the demo's sample output: a fresh run of `make demo`'s command prints the same lines, every column
  but the two timing columns (the demo is deterministic: fixed seeds, fixed reduction order);
* the CPU benchmark table has one home, bench/README.md; README.md links to it instead of keeping
  a second copy of a different run.
"""
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCH_README = (ROOT / "bench" / "README.md").read_text()
# README and the guides under docs/: none may keep a copy of the CPU benchmark table.
DOCS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md",
                                                                *sorted((ROOT / "docs").glob("*.md"))]}


def _demo_command() -> list:
    """`make demo`'s arguments to comet.demo, read from the Makefile (the command README documents)."""
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n\t(.*)$", make, re.M).group(1)
    args = shlex.split(recipe)
    assert args[:3] == ["$(PY)", "-m", "comet.demo"], recipe
    return args[3:]


def _readme_demo_sample() -> list:
    block = re.search(r"```\n(comet\.demo: .*?)```", README, re.S)
    assert block, "README.md has no comet.demo sample block"
    return block.group(1).strip().splitlines()


TIMING_COLUMNS = (3, 4)  # layer0 ms, layer1 ms: the machine's, not the code's


def _comparable(lines: list) -> list:
    out = []
    for line in lines:
        cells = line.split()
        if cells and cells[0].isdigit():  # a rank's row
            cells = [c for i, c in enumerate(cells) if i not in TIMING_COLUMNS]
        out.append(" ".join(cells))
    return out


def test_readme_demo_sample_is_what_the_demo_prints():
    args = _demo_command()
    p = subprocess.run([sys.executable, "-m", "comet.demo", *args, "--device", "cpu"],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    printed = [line for line in p.stdout.strip().splitlines() if line]
    sample = _readme_demo_sample()
    assert len(printed) == len(sample), (printed, sample)
    assert _comparable(printed) == _comparable(sample), \
        "README.md's demo sample is stale; the demo now prints:\n" + "\n".join(printed)


def test_the_cpu_benchmark_table_lives_in_bench_readme_only():
    header = re.compile(r"^\|\s*model\s*\|\s*W\s*\|.*Comet W=1", re.M)
    assert len(header.findall(BENCH_README)) == 1
    for name, text in DOCS.items():
        assert not header.findall(text), f"{name} keeps its own copy of the CPU benchmark table"
    assert "## CPU result" in BENCH_README
    assert "(../bench/README.md#cpu-result)" in DOCS["docs/tuning.md"]


def test_tuning_md_skew_table_is_what_comet_plan_report_prints():
    """docs/tuning.md's table of predicted layer times under Zipf routing (contiguous vs
    planned placements) is the output of `python -m comet.plan.report`, character for character."""
    from comet.plan.report import docs_table

    block = re.search(r"<!-- table: python -m comet\.plan\.report -->\n(.*?)\n<!-- end table -->",
                      DOCS["docs/tuning.md"], re.S)
    assert block, "docs/tuning.md has no comet.plan.report table"
    assert block.group(1) == docs_table(), \
        "docs/tuning.md's skew table is stale; python -m comet.plan.report prints:\n" + docs_table()
