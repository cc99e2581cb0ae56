"""Package structure: every module imports alone, no import cycle, no in-package lazy imports, no environment
reads in traced code, and every package is installed.

The cycle check reads the source (ast), so it sees every module-level import whether or not the import
order of a test run happens to hide a cycle. An import at module level of `a.b.c` also runs the
`__init__` of `a.b` (unless the importing module is already inside it), so those are edges too.
"""
import ast
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where each package's files are (the folders are the import paths; top-level convert/ is a script, not a package)
PACKAGE_DIRS = {"dsv4_jax": os.path.join(ROOT, "dsv4_jax")}

# Code that runs inside jit / while_loop bodies, or decides what is traced: no environment variable may
# steer it (static choices are arguments, e.g. config.backends). Environment reads elsewhere are limited to
# ENV_ALLOWED: multi-host start-up (parallel.initialize_distributed) and the CLIs' compile-cache switch.
TRACED = ("dsv4_jax.model", "dsv4_jax.ops", "dsv4_jax.kernels", "dsv4_jax.speculative", "dsv4_jax.drafters",
          "dsv4_jax.model.decode", "dsv4_jax.model.state", "dsv4_jax.backends", "dsv4_jax.bundle", "dsv4_jax.config",
          "dsv4_jax.model.schedule")
ENV_ALLOWED = {"dsv4_jax.parallel.multihost", "dsv4_jax.cli", "dsv4_jax.analysis.libtpu"}


def _modules() -> dict[str, str]:
    """{module name: file} of every module of the package (packages by their __init__.py)."""
    out = {}
    for pkg, base in PACKAGE_DIRS.items():
        for d, dirs, files in os.walk(base):
            dirs[:] = sorted(x for x in dirs if os.path.exists(os.path.join(d, x, "__init__.py")))
            rel = os.path.relpath(d, base)
            prefix = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
            for f in sorted(files):
                if f.endswith(".py"):
                    out[prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"] = os.path.join(d, f)
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, "").endswith("__init__.py")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import ...` in `module` names as X."""
    if not node.level:
        return node.module or ""
    pkg = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        pkg = pkg.rpartition(".")[0]
    return f"{pkg}.{node.module}" if node.module else pkg


def _imported(module: str, node) -> list[str]:
    """Package modules an import statement loads (the named module or `from`-imported submodules)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _resolve(module, node)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return [n for n in names if n in MODULES]


def _top_level_imports(tree: ast.Module):
    """Import statements executed when the module is imported (not those inside functions)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _function_imports(tree: ast.Module):
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield fn, node


def _parse(module: str) -> ast.Module:
    with open(MODULES[module], encoding="utf-8") as f:
        return ast.parse(f.read(), MODULES[module])


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules its import runs first (targets and their not-yet-running __init__s)."""
    graph = {}
    for module in MODULES:
        running = set(_ancestors(module))          # already being imported when `module` runs
        edges = set()
        for node in _top_level_imports(_parse(module)):
            for target in _imported(module, node):
                edges.update(a for a in _ancestors(target) + [target] if a in MODULES and a not in running)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state, path = {}, []

    def visit(n):
        state[n] = "open"
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = "done"
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_cycle_check_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = import_graph()
    # the graph does hold the package's imports (the check is not vacuous)
    assert "dsv4_jax.ops.verification" in graph["dsv4_jax.speculative.round"]
    assert "dsv4_jax.model" in graph["dsv4_jax.drafters.mtp"]          # model/__init__ runs first
    assert "dsv4_jax.model" not in graph["dsv4_jax.model.target"]      # its own package is already running
    assert "dsv4_jax.model.params" in graph["dsv4_jax.io.convert.hf"]


def test_no_module_level_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_cycle_between_layers():
    """Subpackages and top-level modules (dsv4_jax.model, dsv4_jax.speculative, dsv4_jax.model.decode, ...) form a DAG:
    e.g. the drafters never import the speculative loop that calls them (both import ops.sampling)."""
    layer = lambda m: ".".join(m.split(".")[:2])
    layers: dict[str, set[str]] = {}
    for m, targets in import_graph().items():
        layers.setdefault(layer(m), set()).update(layer(t) for t in targets if layer(t) != layer(m))
    assert "dsv4_jax.drafters" in layers["dsv4_jax.speculative"]
    cycle = find_cycle(layers)
    assert cycle is None, "cycle between layers: " + " -> ".join(cycle)


def test_ops_is_a_leaf():
    """dsv4_jax.ops imports nothing else of the package (the model and the kernels import it)."""
    graph = import_graph()
    for m in MODULES:
        if m.startswith("dsv4_jax.ops"):
            assert {t for t in graph[m] if not t.startswith("dsv4_jax.ops")} == set(), m


def test_no_lazy_imports_of_the_package():
    """Imports of package modules belong at module level (a function-level one only hides a cycle or an
    import cost); optional third-party packages (gguf's dequantizers, matplotlib, tokenizers) may be lazy."""
    lazy = [f"{m}:{node.lineno} in {fn.name}()" for m in MODULES for fn, node in _function_imports(_parse(m))
            if (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dsv4_jax")))
            or (isinstance(node, ast.Import) and any(a.name.startswith("dsv4_jax") for a in node.names))]
    assert lazy == []


def _env_reads(module: str) -> list[int]:
    """Lines reading the process environment: os.environ / os.getenv, or environ / getenv imported from os."""
    lines = []
    for node in ast.walk(_parse(module)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                {a.name for a in node.names} & {"environ", "getenv", "environb"}:
            lines.append(node.lineno)
    return lines


def test_env_check_sees_reads():
    assert _env_reads("dsv4_jax.parallel.multihost") and _env_reads("dsv4_jax.cli")


def test_no_environment_reads_in_traced_code():
    traced = [m for m in MODULES if any(m == t or m.startswith(t + ".") for t in TRACED)]
    assert len(traced) > 20
    found = {m: _env_reads(m) for m in traced}
    assert {m: ls for m, ls in found.items() if ls} == {}


def test_environment_reads_only_where_allowed():
    found = {m: _env_reads(m) for m in MODULES}
    assert {m for m, ls in found.items() if ls} <= ENV_ALLOWED


def test_pyproject_installs_every_package():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    assert listed == {m for m in MODULES if _is_package(m)}


IMPORT_EACH = r"""
import importlib, sys, traceback
failed = []
package = set()        # what `import dsv4_jax` alone loads: importing any of these alone runs exactly that import
for name in ["dsv4_jax"] + sys.argv[1:]:
    if name in package:
        continue
    for m in [m for m in sys.modules if m == "dsv4_jax" or m.startswith("dsv4_jax.")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=-3))
    if name == "dsv4_jax" and not failed:
        package = {m for m in sys.modules if m == "dsv4_jax" or m.startswith("dsv4_jax.")}
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    """Each module imported into an interpreter holding no dsv4_jax module (one subprocess; third-party
    modules stay loaded between imports, which only saves time). Importing a module first imports its parent
    packages, so for every module that `import dsv4_jax` itself loads, importing it alone runs exactly
    `import dsv4_jax` (the package's __init__ loads it in its own order): that import is done once, first,
    from an empty sys.modules, and stands for all of them; every other module is imported on its own."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", IMPORT_EACH, *sorted(MODULES)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


@pytest.mark.slow
def test_every_module_imports_in_a_fresh_interpreter():
    """The same, one `python -c "import M"` per module (slow: an interpreter start and a jax import each)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    failed = []
    for m in sorted(MODULES):
        p = subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True, text=True, env=env, cwd=ROOT)
        if p.returncode:
            failed.append(f"{m}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    assert failed == []
