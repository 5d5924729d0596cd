"""The package's shape: public modules at the top, the parts grouped by role underneath, imports
running one way (integrations -> layers -> tune / buffers), and every public import path users
and the docs rely on still working."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "comet"

# The top of the package is its public surface; everything else lives in a group below it.
TOP_MODULES = {"__init__.py", "_native.py", "demo.py", "reference.py", "nn.py", "hf.py",
               "megatron.py"}
GROUPS = {"layers", "buffers", "tune", "plan"}
# Which groups a group may import from (a group never imports the package's top, except comet._native).
MAY_IMPORT = {
    "buffers": {"buffers"},
    "tune": {"tune", "buffers", "plan",    # python -m comet.tune --skew prints the planners' table
             "fp8"},                       # the profiling hooks quantise FP8 candidates
    "plan": {"plan", "tune"},              # the planners price placements with the cost model
    "layers": {"layers", "buffers", "tune", "fp8",  # comet.fp8 defines the FP8 row/block format
               "plan"},  # placement= compiles a comet.plan.Placement
}


def test_top_level_holds_only_public_modules_and_groups():
    files = {p.name for p in PKG.glob("*.py")}
    dirs = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert files <= TOP_MODULES | {"fp8.py"}, files - TOP_MODULES
    assert GROUPS <= dirs, GROUPS - dirs


def _comet_imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside its own group
                yield path.parent.name
            elif node.module and node.module.split(".")[0] == "comet":
                parts = node.module.split(".")
                if len(parts) > 1:
                    yield parts[1]
                else:
                    yield from (a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "comet":
                    yield parts[1] if len(parts) > 1 else "comet"


@pytest.mark.parametrize("group", sorted(MAY_IMPORT))
def test_imports_run_one_way(group):
    allowed = MAY_IMPORT[group] | {"_native", "_C"}
    for path in sorted((PKG / group).glob("*.py")):
        bad = sorted(set(_comet_imports(path)) - allowed)
        assert not bad, f"comet/{group}/{path.name} imports {bad} (allowed: {sorted(allowed)})"


def test_public_import_paths():
    import comet
    import comet.nn
    import comet.reference
    from comet import (Buffer, Layout, buffer_for, defer_weight_grads, moe_layer0,  # noqa: F401
                       moe_layer1, required_bytes)
    from comet.nn import MoE  # noqa: F401
    from comet.tune import main, perfmodel, tuner  # noqa: F401
    assert comet.layers.autograd.defer_weight_grads is defer_weight_grads
    assert set(tuner.PROFILERS) == {"layer0", "layer1"}  # installed by `import comet`


@pytest.mark.parametrize("module", ["comet.tune", "comet.demo"])
def test_runnable_modules(module):
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage:" in p.stdout, p.stdout + p.stderr
