"""tools/mutants.py's mutants still apply: each one's original text occurs exactly once in its
file (a refactor that moves the text would otherwise surface only as a STALE row in the slower
mutation run at the end of `make test`)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import mutants  # noqa: E402

sys.path.pop(0)


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_mutant_original_text_occurs_once(m):
    text = (ROOT / m.file).read_text()
    assert text.count(m.original) == 1, f"{m.name}: its original text occurs " \
        f"{text.count(m.original)} times in {m.file} (update tools/mutants.py)"


def test_docs_count_the_mutants():
    """docs/verified.md says how many mutants `make test` and `make mutants` run."""
    words = {n: w for n, w in enumerate("zero one two three four five six seven eight nine ten "
                                        "eleven twelve thirteen fourteen fifteen sixteen".split())}
    say = lambda n: words.get(n, str(n))  # noqa: E731 - numbers past sixteen in digits
    python = [m for m in mutants.MUTANTS if m.file.endswith(".py")]
    text = " ".join((ROOT / "docs" / "verified.md").read_text().split())
    assert f"runs the {say(len(python))} Python mutants" in text
    assert f"runs all {say(len(mutants.MUTANTS))}" in text
