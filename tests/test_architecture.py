"""The layers of docs/architecture.md and the size of the code: what each module may
import, at its top and inside its functions, and how long a module and a function may be."""

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
MAX_LINES = 600      # lines of a module
MAX_BODY = 40        # lines of a function's body, its docstring left out
PACKAGE = os.path.join(ROOT, "pdeformer")

# The known exception. Each entry must still be needed: a test fails on one that no
# longer is, so that the list only shrinks.

FEM_STACK_IN_CORE_FUNCTIONS = {   # (core module, FEM-stack package imported inside a function)
    # by design: the core imports without the stack (as
    # test_the_core_imports_without_the_finite_element_stack checks), and these functions
    # run only for the finite-element layer. A prompt's density as a UFL expression
    # (ufl_density, ufl_parts, the UFL literals and exp):
    ("model.prompts", "ufl"),
    ("model.sphere_prompts", "ufl"),
    # the metered ghost updates of PETSc vectors (ghost_update_add):
    ("tools.parallel.meter", "petsc4py"),
}


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
LAYERED = sorted(m for m, sub in MODULES.items() if sub)


def parse(module: str) -> tuple[ast.Module, list[str]]:
    """The syntax tree and the lines of pdeformer/<module as path>.py."""
    path = os.path.join(PACKAGE, *module.split(".")) + ".py"
    with open(path) as f:
        text = f.read()
    return ast.parse(text), text.splitlines()


def read_import(node, here: list, ours: set, outside: set) -> None:
    """Add what one import statement of a module in package ``here`` reaches: a subpackage
    of pdeformer (relative, or absolute as pdeformer.<sub>) to ``ours``, any other
    top-level package to ``outside``."""
    if isinstance(node, ast.ImportFrom) and node.level >= 1:
        base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
        target = base + (node.module.split(".") if node.module else [])
        if target:
            ours.add(target[0])
        else:   # from . import x at the top of the package
            ours.update(a.name for a in node.names if a.name in LAYERS)
        return
    names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    for name in names:
        parts = name.split(".")
        if parts[0] != "pdeformer":
            outside.add(parts[0])
        elif len(parts) > 1:
            ours.add(parts[1])
        elif isinstance(node, ast.ImportFrom):   # from pdeformer import x
            ours.update(a.name for a in node.names if a.name in LAYERS)


def imports(module: str) -> tuple[tuple[set, set], tuple[set, set]]:
    """(subpackages, outside packages) that pdeformer/<module as path>.py imports at module
    level (its top, and blocks such as ``if`` and ``try`` there), and the same imported
    inside its functions and methods, at any depth: every node of the tree is read."""
    tree, _ = parse(module)
    here = module.split(".")[:-1]
    found = {False: (set(), set()), True: (set(), set())}

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                read_import(child, here, *found[in_function])
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found[False], found[True]


def above(sub: str, ours: set) -> set:
    """The subpackages of ``ours`` in a layer above ``sub``'s."""
    return {m for m in ours if m in LAYERS and LAYERS[m] > LAYERS[sub]}


def function_lengths(module: str) -> dict:
    """{qualified name (Class.method, outer.inner): lines of its body} of every function of
    pdeformer/<module as path>.py: from its first statement after the docstring (a nested
    definition from its first decorator) to the end of its last, comments and blank lines
    in between included."""
    tree, _ = parse(module)
    out = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, prefix)   # a definition inside an if, a try, a with, ...
                continue
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef):
                body = child.body
                if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    body = body[1:]
                if body:
                    first = min([body[0].lineno] + [d.lineno for d in getattr(body[0], "decorator_list", [])])
                    out[name] = body[-1].end_lineno - first + 1
            visit(child, name + ".")

    visit(tree, "")
    return out


def test_every_module_is_in_a_layer():
    """Only the facade (__init__, __main__) sits at the top; every subpackage has a layer."""
    top = {m for m, sub in MODULES.items() if sub is None}
    assert top == {"__init__", "__main__"}, top
    assert {sub for sub in MODULES.values() if sub} == set(LAYERS)


@pytest.mark.parametrize("module", LAYERED)
def test_modules_import_only_their_layer_or_lower(module):
    """Nothing above the module's layer, at module level or inside a function. The core
    imports the finite-element stack nowhere but inside the functions of
    FEM_STACK_IN_CORE_FUNCTIONS."""
    sub = MODULES[module]
    (top, top_outside), (inner, inner_outside) = imports(module)
    where = f"{module} ({sub}, layer {LAYERS[sub]})"
    assert not above(sub, top), f"{where} imports {sorted(above(sub, top))} at module level"
    assert not above(sub, inner), f"{where} imports {sorted(above(sub, inner))} inside a function"
    if sub in CORE:
        assert not top_outside & set(FEM_STACK), f"{module} is core but imports {top_outside & set(FEM_STACK)}"
        allowed = {p for m, p in FEM_STACK_IN_CORE_FUNCTIONS if m == module}
        stack = inner_outside & set(FEM_STACK) - allowed
        assert not stack, f"{module} is core but imports {sorted(stack)} inside a function"


@pytest.mark.parametrize("module, package", sorted(FEM_STACK_IN_CORE_FUNCTIONS))
def test_each_known_core_use_of_the_stack_is_still_there(module, package):
    assert module in MODULES and MODULES[module] in CORE, f"{module} is not a core module"
    assert package in imports(module)[1][1], \
        f"{module} no longer imports {package} inside a function: remove it from FEM_STACK_IN_CORE_FUNCTIONS"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_short(module):
    count = len(parse(module)[1])
    assert count <= MAX_LINES, \
        f"{module} has {count} lines (at most {MAX_LINES}): split it by concern"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_are_short(module):
    long = {f: n for f, n in function_lengths(module).items() if n > MAX_BODY}
    assert not long, f"{module}: bodies of {long} lines (at most {MAX_BODY}): split them into helpers"


def test_the_layer_check_sees_a_violation(tmp_path, monkeypatch):
    """The import reader resolves relative imports: a core module importing the solvers
    at its top is caught."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bad.py").write_text("from ..solvers.forward import ForwardSolver\n"
                                               "from .heads import HeadMeasure\nimport dolfinx\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", str(tmp_path))
    (ours, outside), inner = imports("model.bad")
    assert ours == {"solvers", "model"} and outside == {"dolfinx"}
    assert inner == (set(), set())


def test_the_layer_check_sees_a_violation_inside_a_function(tmp_path, monkeypatch):
    """Imports inside functions, methods and nested functions are read apart from those at
    module level (an ``if`` block there included), absolute ones of pdeformer too."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bad.py").write_text(
        "from .heads import HeadMeasure\n"
        "if True:\n    import numpy\n"
        "def velocity():\n    from ..fem._dolfinx import owned_node_coordinates\n"
        "class Velocity:\n    def on_space(self):\n        def nodes():\n"
        "            import dolfinx.fem\n            from pdeformer.solvers import forward\n"
        "        return nodes\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", str(tmp_path))
    top, (ours, outside) = imports("model.bad")
    assert top == ({"model"}, {"numpy"})
    assert ours == {"fem", "solvers"} and outside == {"dolfinx"}
    assert above("model", ours) == {"fem", "solvers"}


def test_the_length_check_counts_bodies_without_docstrings(tmp_path, monkeypatch):
    """A function's body is counted from its first statement after the docstring to the
    end of its last, methods and nested functions each on their own too."""
    (tmp_path / "tools").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_BODY + 1))
    (tmp_path / "tools" / "long.py").write_text(
        f'def long():\n    """Docstring,\n    two lines."""\n{body}\n'
        "class A:\n    def short(self):\n        def inner():\n            return 1\n"
        "        # a comment\n        return inner\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", str(tmp_path))
    assert function_lengths("tools.long") == {"long": MAX_BODY + 1, "A.short": 4, "A.short.inner": 1}


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
