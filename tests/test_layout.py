"""The package layout (issue #36): the folders that hold the layers, a small package root, and experiments that
use the package as a user would — through its public modules, with no `sys.path` edits and no imports of
each other or of the tests."""
import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dsv4_jax")
EXPERIMENTS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))
MAX_ROOT_MODULES = 6        # besides __init__.py: config, backends, bundle, demo, cli (+ one spare)


def test_speculative_replaces_spec():
    assert os.path.isfile(os.path.join(PKG, "speculative", "__init__.py"))
    assert not os.path.exists(os.path.join(PKG, "spec"))


def test_package_root_stays_small():
    modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(PKG, "*.py")))
    assert "__init__.py" in modules and "cli.py" in modules
    assert len(modules) - 1 <= MAX_ROOT_MODULES, modules


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(source: str, siblings: set[str], filename: str = "<experiment>") -> list[str]:
    """What an experiment script does that a user of the package would not: `sys.path` edits, imports of
    other experiment scripts or of the tests, and underscore-prefixed dsv4_jax modules or names (imported,
    or read as an attribute of something imported from dsv4_jax)."""
    tree = ast.parse(source, filename)
    out, from_package = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            out.append(f"line {node.lineno}: sys.path")
        elif isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in siblings or top == "tests":
                    out.append(f"line {node.lineno}: imports {a.name}")
                if top == "dsv4_jax":
                    if any(_private(p) for p in a.name.split(".")):
                        out.append(f"line {node.lineno}: imports {a.name}")
                    from_package.add(a.asname or top)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            top = module.split(".")[0]
            if node.level or top in siblings or top == "tests":
                out.append(f"line {node.lineno}: imports from {'.' * node.level}{module}")
            if top == "dsv4_jax":
                bad = [p for p in module.split(".") if _private(p)] + [a.name for a in node.names if _private(a.name)]
                if bad:
                    out.append(f"line {node.lineno}: imports {module} {bad}")
                from_package.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                and node.value.id in from_package:
            out.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return sorted(out, key=lambda v: int(v.split()[1].rstrip(":")))


def test_the_experiment_check_finds_violations():
    bad = """
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import reduced_flash
import tests.convert_fixtures
from dsv4_jax.analysis import memplan
from dsv4_jax.io.convert.pipeline import _run_job
from dsv4_jax.analysis import _private_module as m
total = memplan._flat_specs(None)
"""
    found = violations(bad, {"bench_decode"})
    assert found == ["line 3: sys.path", "line 4: imports from bench_decode", "line 5: imports tests.convert_fixtures",
                     "line 7: imports dsv4_jax.io.convert.pipeline ['_run_job']",
                     "line 8: imports dsv4_jax.analysis ['_private_module']", "line 9: memplan._flat_specs"]
    ok = "import sys\nfrom dsv4_jax.analysis import memplan\nprint(sys.argv, memplan.plan, memplan.__name__)\n"
    assert violations(ok, {"bench_decode"}) == []


def test_experiments_use_only_public_package_modules():
    assert len(EXPERIMENTS) >= 5     # the glob found the scripts
    siblings = {os.path.basename(p)[:-3] for p in EXPERIMENTS}
    found = {}
    for path in EXPERIMENTS:
        with open(path, encoding="utf-8") as f:
            v = violations(f.read(), siblings, path)
        if v:
            found[os.path.relpath(path, ROOT)] = v
    assert found == {}
