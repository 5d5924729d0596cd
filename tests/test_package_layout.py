"""The package's shape: public modules at the top, the parts grouped by role underneath, imports
running one way (integrations -> layers -> tune / buffers / formats), no import circle between
modules, and every public import path users and the docs rely on still working."""
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
GROUPS = {"layers", "buffers", "tune", "plan", "formats"}
# Which groups a group may import from (a group never imports the package's top, except comet._native).
MAY_IMPORT = {
    "formats": {"formats"},                # the data formats: below everything but the core
    "buffers": {"buffers"},
    "tune": {"tune", "buffers", "plan",    # python -m comet.tune --skew prints the planners' table
             "formats"},                   # the profiling hooks quantise FP8 candidates
    "plan": {"plan", "tune"},              # the planners price placements with the cost model
    "layers": {"layers", "buffers", "tune", "formats",  # ops size and dequantise FP8 rows
               "plan"},  # placement= compiles a comet.plan.Placement
}


def test_top_level_holds_only_public_modules_and_groups():
    files = {p.name for p in PKG.glob("*.py")}
    dirs = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert files <= TOP_MODULES | {"fp8.py"}, files - TOP_MODULES
    assert GROUPS <= dirs, GROUPS - dirs


def _comet_imports(path: pathlib.Path, group: str):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside its own group
                yield group
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
    for path in sorted((PKG / group).rglob("*.py")):
        bad = sorted(set(_comet_imports(path, group)) - allowed)
        assert not bad, (f"{path.relative_to(ROOT)} imports {bad} "
                         f"(allowed: {sorted(allowed)})")


# -- No import circle --------------------------------------------------------------------------
#
# The graph: one node per module of the package (a package is its __init__.py), an edge for every
# import statement anywhere in a module -- at the top or inside a function, where a lazy import
# used to hide a circle -- and for importlib.import_module("comet...") with a literal name.
# `from pkg import name` is an edge to the submodule pkg.name where there is one, else to pkg.
# The package a module lives in is not an edge of its own: Python runs a package's __init__
# before its submodules, which is the package's own order, not a dependency the module chose.

COMPILED = {"comet._C"}  # the extension module setup.py builds: a leaf without Python source


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imported(name: str, path: pathlib.Path, modules) -> set:
    """The comet modules `name` (at `path`) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    known = set(modules) | COMPILED
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            out.add(node.args[0].value)
    return {m for m in out if m in known and m != name}


def import_graph():
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _cycle(graph):
    """One import circle of `graph` as a list of modules, or None."""
    state = {}  # module -> 1 while on the path, 2 when done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_import_graph_sees_lazy_and_dynamic_imports():
    """The graph's own check: a circle through a function-local import is found, and the edges the
    package has inside functions and through importlib are in it."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = import_graph()
    assert "comet.fp8" in graph["comet.nn"]  # inside MoE.__init__
    assert "comet.layers.ops" in graph["comet.tune.cli"]  # importlib.import_module
    assert "comet._C" in graph["comet._native"] and "comet" not in graph["comet._native"]


def test_no_import_circle():
    graph = import_graph()
    circle = _cycle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_fp8_format_below_the_ops_and_master_weights_above():
    """comet.formats.fp8 (the format) imports no other part of comet; the ops and their autograd
    use it, never comet.fp8, whose master-weight wrappers use the ops."""
    graph = import_graph()
    assert graph["comet.formats.fp8"] <= {"comet._native", "comet._C"}
    for m in ("comet.layers.ops", "comet.layers.autograd", "comet.tune.profiling"):
        assert "comet.fp8" not in graph[m] and "comet.formats.fp8" in graph[m], m
    assert {"comet.layers.ops", "comet.layers.autograd", "comet.formats.fp8"} <= graph["comet.fp8"]
    import comet.formats.fp8 as fmt
    from comet import fp8
    for name in fmt.__all__:
        assert getattr(fp8, name) is getattr(fmt, name), name


# The cost model's parts (comet/tune/model/), in the order they build on each other.
MODEL_PARTS = ["hardware", "fp8", "shape", "tp", "gemm", "one_node", "nodes", "comm", "pipeline",
               "small_tile", "backward", "activation", "decode"]


def test_cost_model_parts_build_in_order():
    """Each part of the cost model imports only the parts before it in MODEL_PARTS (and no other
    part of comet), and every module of comet/tune/model/ is one of them."""
    graph = import_graph()
    here = {p.stem for p in (PKG / "tune" / "model").glob("*.py")} - {"__init__"}
    assert here == set(MODEL_PARTS), here ^ set(MODEL_PARTS)
    for i, part in enumerate(MODEL_PARTS):
        allowed = {f"comet.tune.model.{p}" for p in MODEL_PARTS[:i]}
        bad = graph[f"comet.tune.model.{part}"] - allowed
        assert not bad, f"comet.tune.model.{part} imports {sorted(bad)}"


def test_perfmodel_is_the_one_face_of_the_cost_model():
    """comet/tune/perfmodel.py holds no code of its own: a docstring, imports from the parts and
    its names; each public name is a part's object, and __all__ keeps its 59 names."""
    tree = ast.parse((PKG / "tune" / "perfmodel.py").read_text())
    for node in tree.body[1:]:
        assert isinstance(node, (ast.ImportFrom, ast.Assign)), ast.dump(node)[:80]
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            assert node.level == 1 and node.module.startswith("model."), node.module
    from comet.tune import perfmodel as pm
    for name in pm.__all__:
        obj = getattr(pm, name)
        if callable(obj) and hasattr(obj, "__module__"):
            assert obj.__module__.startswith("comet.tune.model."), (name, obj.__module__)
    assert len(pm.__all__) == len(set(pm.__all__)) == 59


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
