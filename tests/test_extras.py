"""The optional dependencies: setup.py's extras pin what the Makefile installs, and an example whose
optional package is missing names the extra to install (one line, status 2, no traceback)."""
import ast
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setup_extras() -> dict:
    tree = ast.parse((ROOT / "setup.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "EXTRAS" for t in n.targets))
    return ast.literal_eval(node.value)


def _makefile_deps() -> dict:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = re.search(r"^DEPS\s*:=(.*)$", text, re.M).group(1)
    return {re.split(r"[=<>]", d)[0]: d for d in line.split()}


def test_extras_pin_what_the_makefile_installs():
    extras, deps = _setup_extras(), _makefile_deps()
    assert set(extras) >= {"hf", "megatron", "bench", "test"}
    for name, reqs in extras.items():
        for req in reqs:
            pkg = re.split(r"[=<>]", req)[0]
            assert pkg in deps, f"extra {name}: {req} is not in the Makefile's DEPS"
            assert req == deps[pkg], f"extra {name}: {req} but the Makefile installs {deps[pkg]}"
    assert extras["hf"] == ["transformers==5.23.0"]


def _run_without(module: str, script: str):
    # sys.modules[name] = None makes `import name` raise ImportError, as if it were not installed
    code = (f"import sys, runpy; sys.modules[{module!r}] = None; "
            f"sys.argv = [{script!r}]; runpy.run_path({script!r}, run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=120)


def test_hf_example_without_transformers_names_the_extra():
    p = _run_without("transformers", str(ROOT / "examples" / "hf_moe.py"))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e '.[hf]'" in lines[0] and "comet-moe[hf]" in lines[0]
