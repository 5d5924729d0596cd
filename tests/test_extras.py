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


def _makefile_var(name: str) -> list:
    """A `NAME := ...` line of the Makefile, its $(VARS) expanded."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = re.search(rf"^{name}\s*:=(.*)$", text, re.M).group(1)
    return [w for word in line.split()
            for w in (_makefile_var(word[2:-1]) if word.startswith("$(") else [word])]


def _makefile_deps() -> dict:
    return {re.split(r"[=<>]", d)[0]: d for d in _makefile_var("DEPS")}


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
    assert len(lines) == 1 and "comet-moe[hf]" in lines[0]
    assert "pip install --no-build-isolation -e '.[hf]'" in lines[0]  # README's pip form


def test_megatron_module_without_megatron_core_names_the_extra():
    code = ("import sys; sys.modules['megatron'] = None\n"
            "try:\n    import comet.megatron\n"
            "except ImportError as e:\n    print(e)\n    sys.exit(3)")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3, p.stdout + p.stderr
    pin = _setup_extras()["megatron"][0].split("==")[1]  # the version setup.py pins
    assert f"comet.megatron needs megatron-core {pin} (the 'megatron' extra)" in p.stdout
    assert "pip install --no-build-isolation -e '.[megatron]'" in p.stdout
    assert "comet-moe[megatron]" in p.stdout


def _readme_pip_lines() -> list:
    """The commands of README's "Installing with pip" block (comments dropped)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Installing with pip"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def _name(req: str) -> str:
    return re.split(r"[=<>\[ ]", req)[0]


def test_readme_pip_lines_install_what_pyproject_builds_with():
    """README's pip lines for a fresh virtualenv: torch first, pinned as setup.py and the Makefile
    pin it; then every other build requirement of pyproject.toml; then comet without build
    isolation (against the torch just installed) - the line the Makefile runs too."""
    import tomllib

    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    lines = _readme_pip_lines()
    installs = [line.split()[2:] for line in lines if line.startswith("pip install")]
    torch_pin = next(r for r in build if _name(r) == "torch")
    assert installs[0] == [torch_pin], installs  # torch before anything is compiled
    tree = ast.parse((ROOT / "setup.py").read_text())
    setup_call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                      and getattr(n.func, "id", "") == "setup")
    requires = next(ast.literal_eval(k.value) for k in setup_call.keywords
                    if k.arg == "install_requires")
    assert torch_pin in requires and torch_pin in _makefile_var("BUILD_DEPS")
    before = {_name(p) for args in installs[:-1] for p in args}
    assert {_name(r) for r in build} <= before, (build, before)
    assert {_name(r) for r in build} <= {_name(d) for d in _makefile_var("BUILD_DEPS")}
    assert installs[-1] == ["--no-build-isolation", "-e", "."]
    make = (ROOT / "Makefile").read_text()
    assert "$(PIP) install -q --no-build-isolation --no-deps -e ." in make


def test_make_demo_installs_only_what_the_demo_needs_and_says_how_long():
    """`make demo` sets up torch and the build tools (and CUTLASS for a CUDA build), none of the
    extras; README and the set-up steps' messages say how long it takes."""
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: build-demo\n\t\$\(PY\) -m comet\.demo", make, re.M)
    assert re.search(r"^build-demo: \$\(VENV\)/\.build-deps$", make, re.M)
    recipe = re.search(r"^\$\(VENV\)/\.build-deps:.*\n((?:\t.*\n)+)", make, re.M).group(1)
    assert "$(DEPS)" not in recipe and "EXTRA_DEPS" not in recipe
    demo_deps = {_name(d) for d in _makefile_var("BUILD_DEPS") + _makefile_var("CUDA_DEPS")}
    extras = {_name(r) for reqs in _setup_extras().values() for r in reqs}
    assert not demo_deps & extras, demo_deps & extras
    assert "How long `make demo` takes" in (ROOT / "README.md").read_text()
    assert "make: installing torch" in recipe and "make: building comet._C" in make
