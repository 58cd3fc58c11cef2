"""The layers of docs/architecture.md: what each module may import at its top."""

from __future__ import annotations

import ast
import os

import pytest

from conftest import ROOT

LAYERS = {   # subpackages by layer; the core (CORE) does not import the finite-element stack
    "tools": 0,
    "integrator": 1, "attention": 1, "model": 2,
    "fem": 3,
    "solvers": 4,
    "api": 5,
    "commands": 6,
}
CORE = ("tools", "integrator", "attention", "model")
FEM_STACK = ("dolfinx", "petsc4py", "ufl", "basix", "ffcx")
SPLIT_BY_CONCERN = ("attention.laplace", "tools.parallel")   # packages of one module per concern
MAX_LINES = 600                                              # ... each at most this long
PACKAGE = os.path.join(ROOT, "pdeformer")


def package_modules() -> dict:
    """{dotted name below pdeformer: subpackage} of every module of the package."""
    out = {}
    for dp, dn, fn in os.walk(PACKAGE):
        dn[:] = [d for d in dn if d != "__pycache__"]
        rel = os.path.relpath(dp, PACKAGE)
        for f in fn:
            if f.endswith(".py"):
                parts = [] if rel == "." else rel.split(os.sep)
                out[".".join(parts + [f[:-3]])] = parts[0] if parts else None
    return out


MODULES = package_modules()


def top_level_imports(module: str) -> tuple[set, set]:
    """(subpackages, outside packages) imported at the top of pdeformer/<module as path>.py."""
    path = os.path.join(PACKAGE, *module.split(".")) + ".py"
    with open(path) as f:
        tree = ast.parse(f.read())
    here = module.split(".")[:-1]
    ours, outside = set(), set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
            target = base + (node.module.split(".") if node.module else [])
            if target:
                ours.add(target[0])
            else:   # from . import x at the top of the package
                ours.update(a.name for a in node.names if a.name in LAYERS)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            outside.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            outside.update(a.name.split(".")[0] for a in node.names)
    return ours, outside


def test_every_module_is_in_a_layer():
    """Only the facade (__init__, __main__) sits at the top; every subpackage has a layer."""
    top = {m for m, sub in MODULES.items() if sub is None}
    assert top == {"__init__", "__main__"}, top
    assert {sub for sub in MODULES.values() if sub} == set(LAYERS)


@pytest.mark.parametrize("module", sorted(m for m, sub in MODULES.items() if sub))
def test_modules_import_only_their_layer_or_lower(module):
    sub = MODULES[module]
    ours, outside = top_level_imports(module)
    above = [m for m in ours if m in LAYERS and LAYERS[m] > LAYERS[sub]]
    assert not above, f"{module} ({sub}, layer {LAYERS[sub]}) imports {above} at its top"
    if sub in CORE:
        assert not outside & set(FEM_STACK), f"{module} is core but imports {outside & set(FEM_STACK)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(tuple(
    p + "." for p in SPLIT_BY_CONCERN))))
def test_packages_split_by_concern_keep_their_modules_short(module):
    path = os.path.join(PACKAGE, *module.split(".")) + ".py"
    with open(path) as f:
        count = sum(1 for _ in f)
    assert count <= MAX_LINES, f"{module} has {count} lines (at most {MAX_LINES}): split it by concern"


def test_the_layer_check_sees_a_violation(tmp_path, monkeypatch):
    """The import reader resolves relative imports: a core module importing the solvers
    at its top is caught."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bad.py").write_text("from ..solvers.forward import ForwardSolver\n"
                                               "from .heads import HeadMeasure\nimport dolfinx\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", str(tmp_path))
    ours, outside = top_level_imports("model.bad")
    assert ours == {"solvers", "model"} and outside == {"dolfinx"}


def test_the_core_imports_without_the_finite_element_stack():
    """Every core module (the particle model included: an ODE) imports with dolfinx,
    PETSc and the FEniCS form stack made unimportable, and none of them gets loaded."""
    import subprocess
    import sys
    core = ["pdeformer"] + [f"pdeformer.{m}" for m, sub in MODULES.items() if sub in CORE]
    code = f"""
import importlib, importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {FEM_STACK!r}:
            raise ImportError(name + " is blocked")
sys.meta_path.insert(0, Blocked())
for m in {core!r}:
    importlib.import_module(m)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {FEM_STACK!r})
assert not loaded, loaded
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
