"""The repository is self-contained: no file refers to notes outside it (the sibling "shared"
directory, or design / anchor / toolchain notes kept there), and every relative link of the
Markdown documentation (README.md, docs/, bench/README.md) reaches a file of the repository and,
when it names a section, a heading of that file."""
import pathlib
import re
import subprocess


ROOT = pathlib.Path(__file__).resolve().parents[1]

# Spelled in pieces so that this file does not match itself.
OUTSIDE_NOTES = re.compile("|".join([
    r"\.\./" + "shared",
    r"\b" + "DESIGN" + r"\.md",
    r"\b" + "ANCHORS" + r"\.md",
    r"\b" + "TOOLCHAIN" + r"\.md",
]))


# Outside a git checkout (an unpacked archive): the tree minus what the build and set-up make.
NOT_SOURCE = {".git", ".venv", "build", "cbuild", "cbuild-tsan", "__pycache__", "results",
              ".hypothesis", ".pytest_cache"}


def repo_files():
    """Tracked files plus untracked ones git does not ignore (what a commit would hold); without
    git, every file outside the build and set-up directories."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and p.suffix != ".so"
                and not NOT_SOURCE & set(p.relative_to(ROOT).parts)
                and not any(part.endswith(".egg-info") for part in p.parts)]


def markdown_files():
    return [ROOT / "README.md", ROOT / "bench" / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def test_no_reference_outside_the_repository():
    hits = []
    for path in repo_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_NOTES.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "references to notes outside the repository:\n" + "\n".join(hits)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation other than '-' and '_'
    dropped, spaces turned into '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
    found, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.add(github_anchor(line.lstrip("#")))
    return found


LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose_lines(md):
    """(line number, line) of a markdown file outside its code blocks."""
    in_code = False
    for n, line in enumerate(md.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code:
            yield n, line


def test_markdown_links_resolve():
    assert (ROOT / "docs").is_dir()
    bad = []
    for md in markdown_files():
        for n, line in prose_lines(md):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (md.parent / file_part).resolve() if file_part else md
                where = f"{md.relative_to(ROOT)}:{n}: {target}"
                if ROOT not in dest.parents and dest != ROOT:
                    bad.append(f"{where} (outside the repository)")
                elif not dest.exists():
                    bad.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    bad.append(f"{where} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_github_anchor_rule():
    assert github_anchor("The layer1 reduction order") == "the-layer1-reduction-order"
    assert github_anchor("Megatron-core (optional: `pip install megatron-core==0.16.1`)") == \
        "megatron-core-optional-pip-install-megatron-core0161"


# A file name in prose: name.ext with no path character right before or after it.
FILE_NAME = re.compile(r"(?<![\w./-])([\w.-]+\.(?:py|h|cuh|cu|cpp|md|json|sh|toml|ini|txt))"
                       r"(?![\w/])")


def test_docs_name_files_by_their_path():
    """A file of the repository named in the documentation's prose is named by its path from the
    repository root (`csrc/cuda/proxy.cu`, not `proxy.cu`), so that a reader finds it. Link
    targets (relative to the document) and code blocks (the source map's tree) are left alone."""
    paths = {p.relative_to(ROOT).as_posix() for p in repo_files()}
    by_name = {}
    for p in paths:
        by_name.setdefault(p.rsplit("/", 1)[-1], []).append(p)
    bare = []
    for md in markdown_files():
        for n, line in prose_lines(md):
            for name in FILE_NAME.findall(LINK.sub("]", line)):
                if name in by_name and name not in paths:
                    where = " or ".join(sorted(by_name[name]))
                    bare.append(f"{md.relative_to(ROOT)}:{n}: {name} (say {where})")
    assert not bare, "files named without their path:\n" + "\n".join(bare)


# Spelled in pieces so that this file does not match itself.
ORGANISATION = re.compile("|".join([
    r"\b[Ii]ssue " + r"#?\d",        # an issue number
    r"\bthe " + r"issue'?s?\b",      # the one this work came from
    r"\bthis " + r"session",
    r"\btracker " + r"item",
]))


def test_no_sentence_refers_to_issue_numbers_or_how_the_work_was_organised():
    """The repository speaks to its users: no file refers to issue numbers or to how the work on it
    was organised. docs/peers.md cites other projects' public issue trackers by their numbers;
    those are references, not this repository's bookkeeping."""
    hits = []
    for path in repo_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "docs/peers.md":
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if ORGANISATION.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)
