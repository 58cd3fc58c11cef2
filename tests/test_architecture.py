"""The layers of docs/architecture.md: what each module may import at its top."""

from __future__ import annotations

import ast
import os

import pytest

from conftest import ROOT

LAYERS = {
    "core": ["__init__", "errors", "attention", "laplace", "_kernels", "velocity", "heads", "prompts",
             "objectives", "exact", "timestepping", "march", "frames", "particles", "config",
             "parallel", "budget", "output", "outdir"],
    "finite elements": ["_dolfinx", "mesh", "transport"],
    "solvers": ["forward", "adjoint", "trackers", "train"],
    "application": ["run", "cli", "converge", "ntk", "__main__"],
}
RANK = {m: i for i, (_, mods) in enumerate(LAYERS.items()) for m in mods}
FEM_STACK = ("dolfinx", "petsc4py", "ufl", "basix", "ffcx")
PACKAGE = os.path.join(ROOT, "pdeformer")


def top_level_imports(module: str) -> tuple[set, set]:
    """(package modules, outside packages) imported at the top of pdeformer/<module>.py."""
    with open(os.path.join(PACKAGE, module + ".py")) as f:
        tree = ast.parse(f.read())
    ours, outside = set(), set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            ours.update([node.module] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            outside.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            outside.update(a.name.split(".")[0] for a in node.names)
    return ours, outside


def test_every_module_has_a_layer():
    modules = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
    assert modules == set(RANK), (modules ^ set(RANK))


@pytest.mark.parametrize("module", sorted(RANK))
def test_modules_import_only_their_layer_or_lower(module):
    ours, outside = top_level_imports(module)
    above = [m for m in ours if m in RANK and RANK[m] > RANK[module]]
    assert not above, f"{module} ({list(LAYERS)[RANK[module]]}) imports {above} at its top"
    if RANK[module] == 0:
        assert not outside & set(FEM_STACK), f"{module} is core but imports {outside & set(FEM_STACK)}"


def test_the_core_imports_without_the_finite_element_stack():
    """Every core module (the particle model included: an ODE) imports with dolfinx,
    PETSc and the FEniCS form stack made unimportable, and none of them gets loaded."""
    import subprocess
    import sys
    core = [f"pdeformer.{m}" if m != "__init__" else "pdeformer" for m in LAYERS["core"]]
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
