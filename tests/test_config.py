"""Configuration: defaults, overrides, and the one-line errors that name the key."""

import os
import re

import numpy as np
import pytest

from pdeformer.model.config import check_config, load_config
from pdeformer.tools.tomlfile import parse_override
from pdeformer.tools.errors import ConfigError, InputError
from pdeformer.model.heads import HeadMeasure
from pdeformer.model.prompts import make_prompt

from conftest import write_config

BASE = """
[mesh]
lower = [-2.0, -2.0]
upper = [2.0, 2.0]
cells = [8, 8]

[model]
layers = 2
heads = 3

[[prompts]]
kind = "gaussian_mixture"
means = [[0.0, 0.0]]
covs = [0.2]
"""


def test_defaults_and_paths(tmp_path):
    cfg = load_config(write_config(tmp_path, BASE))
    disc = cfg["discretisation"]
    assert disc["degree"] == 1 and disc["velocity_degree"] == 1 and disc["scheme"] == "ssprk2"
    assert cfg["mesh"]["cell"] == "triangle"
    assert cfg["output"]["dir"] == os.path.join(str(tmp_path), "output", "run")
    assert cfg["prompts"][0]["name"] == "prompt0"


def test_overrides(tmp_path):
    path = write_config(tmp_path, BASE)
    cfg = load_config(path, ["mesh.cells=[4,5]", "discretisation.degree=3",
                             "prompts[0].name=first", "output.dir=out", "petsc.ksp_type=cg"])
    assert cfg["mesh"]["cells"] == [4, 5]
    assert cfg["discretisation"]["scheme"] == "ssprk104"
    assert cfg["prompts"][0]["name"] == "first"
    assert cfg["output"]["dir"] == os.path.abspath("out")  # --set paths: relative to cwd
    assert cfg["petsc"] == {"ksp_type": "cg"}
    assert parse_override("model.seed=7") == (["model", "seed"], 7)
    assert parse_override("prompts.1.kind=uniform") == (["prompts", 1, "kind"], "uniform")


@pytest.mark.parametrize("override, key, words", [
    ("mesh.cels=[4,4]", "mesh.cels", "did you mean 'cells'"),
    ("mesh.cells=[0,4]", "mesh.cells", "positive integers"),
    ("mesh.cells=[4]", "mesh.cells", "expected 2 entries"),
    ("mesh.cells='many'", "mesh.cells", "positive integers"),
    ("mesh.upper=[-3.0,2.0]", "mesh.upper", "not above"),
    ("mesh.cell=tetrahedron", "mesh.cell", "not a 2-D cell"),
    ("mesh.file=x.xdmf", "mesh.lower", "not both"),
    ("discretisation.degree=4", "discretisation.degree", "in 1..3"),
    ("discretisation.cfl=-1", "discretisation.cfl", "positive"),
    ("discretisation.limiter=1", "discretisation.limiter", "true or false"),
    ("model.heads=0", "model.heads", "in 1.."),
    ("model.layers=2.5", "model.layers", "integer"),
    ("output.format=xdmf", "output.format", "one of"),
    ("prompts[0].kind=normal", "prompts[0].kind", "one of"),
    ("prompts[0].mean=[[0.0,0.0]]", "prompts[0].mean", "did you mean 'means'"),
    ("solver.x=1", "solver", "unknown"),
    ("petsc.ksp_type=[1]", "petsc.ksp_type", "string, number or boolean"),
    ("mesh.cells=[100000,100000]", "mesh.cells", "more than pdeformer allows"),
    ("discretisation.cfl=1" + "0" * 400, "discretisation.cfl", "number too large"),
    ("discretisation.cfl=1e400", "discretisation.cfl", "finite"),
    ("prompts[0].means=[[1" + "0" * 400 + ",0.0]]", "prompts[0].means[0][0]", "number too large"),
    ("model.heads=100001", "model.heads", "in 1..100000"),
    ("attention.chunk_mb=1e300", "attention.chunk_mb", "<= 4096"),
    ("discretisation.steps_per_layer=100000000000", "discretisation.steps_per_layer", "in 1..10000000"),
    ("output.dir='a\u0000b'", "output.dir", "file path"),
    ("ntk.params='Q'", "ntk.params", "one of"),
    ("ntk.depth=1.5", "ntk.depth", "<= 1"),
    ("ntk.b_range=0", "ntk.b_range", "positive"),
    ("ntk.tol=2", "ntk.tol", "<= 1"),
    ("prompts[0].target={kind='points',path='a.csv',points=[[0.0,0.0]]}", "prompts[0].target.path", "either path"),
    ("prompts[0].target={kind='points',weights=[1.0]}", "prompts[0].target.path", "either path"),
    ("prompts[0].name='" + "a" * 65 + "'", "prompts[0].name", "1 to 64 letters, digits"),
    ("prompts[0].name='a/b'", "prompts[0].name", "1 to 64 letters, digits"),
    ("attention.tape_mb=-1", "attention.tape_mb", "non-negative"),
    # a tol no table reaches is bad input (exit 2), not a breakdown (3)
    ("attention.tol=1e-30", "attention.tol", "in [1e-13, 0.1], got 1e-30 (a laplace table's"),
    ("attention.tol=5e-14", "attention.tol", "attention.backend = 'direct'"),
])
def test_config_errors_name_the_key(tmp_path, override, key, words):
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path, BASE), [override])
    msg = str(e.value)
    assert msg.startswith(key + ":") and words in msg, msg
    assert "\n" not in msg


def test_too_many_heads(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.heads: layers x heads = 1.01e\+07 is more than"):
        load_config(write_config(tmp_path, BASE), ["model.heads=100000", "model.layers=101"])


def test_file_errors(tmp_path):
    from pdeformer.commands.study import load_study
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        load_config(str(tmp_path))
    with pytest.raises(ConfigError, match="is a folder, not a study file"):
        load_study(str(tmp_path))
    with pytest.raises(ConfigError, match="no such study file"):
        load_study(str(tmp_path / "missing.toml"))
    bad = write_config(tmp_path, "[mesh\n", "bad.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="^prompts: missing"):
        check_config({"mesh": {"lower": [0.0], "upper": [1.0], "cells": [2]},
                      "model": {"layers": 1, "heads": 1}}, str(tmp_path))
    with pytest.raises(ConfigError, match="^model.layers: missing"):
        load_config(write_config(tmp_path, BASE.replace("layers = 2", "")))


def test_inline_point_cloud(tmp_path):
    cfg = load_config(write_config(tmp_path, BASE + "[[prompts]]\nkind = 'points'\n"
                                   "points = [[0.0, 0.0], [1.0, 2.0]]\nweights = [1.0, 3.0]\n"))
    cloud = make_prompt(cfg["prompts"][1], 2, 1)
    assert cloud.kind == "points" and cloud.dim == 2
    np.testing.assert_allclose(cloud.mean(), [0.75, 1.5])
    np.testing.assert_allclose(cloud.cov(), 0.1875 * np.array([[1.0, 2.0], [2.0, 4.0]]))
    for spec, key in (({"points": [[0.0, 0.0], [1.0]]}, "prompts[0].points"),
                      ({"points": [[0.0, 0.0]], "weights": [-1.0]}, "prompts[0].weights"),
                      ({"points": [[0.0, 0.0]], "weights": [1.0, 1.0]}, "prompts[0].weights")):
        with pytest.raises(ConfigError, match="^" + re.escape(key) + ":"):
            make_prompt({"kind": "points", "name": "p", "path": None, "weights": None, **spec}, 2, 0)


@pytest.mark.parametrize("prompt, key, words", [
    ({"means": [[0.0, 0.0]], "covs": [[[1.0, 0.5], [0.4, 1.0]]]}, "prompts[0].covs[0]", "not symmetric"),
    ({"means": [[0.0, 0.0]], "covs": [[[1.0, 2.0], [2.0, 1.0]]]}, "prompts[0].covs[0]", "not positive definite"),
    ({"means": [[0.0, 0.0]], "covs": [-1.0]}, "prompts[0].covs[0]", "positive"),
    ({"means": [[0.0, 0.0, 1.0]], "covs": [1.0]}, "prompts[0].means", "2-vectors"),
    ({"means": [[0.0, 0.0]], "covs": [1.0, 1.0]}, "prompts[0].covs", "expected 1 covariances"),
    ({"means": [[0.0, 0.0]], "covs": [1.0], "weights": [1.0, 2.0]}, "prompts[0].weights", "expected 1"),
    ({"means": [[0.0, 0.0]], "covs": [1.0], "weights": [-1.0]}, "prompts[0].weights", "positive"),
])
def test_prompt_shape_errors(prompt, key, words):
    spec = {"kind": "gaussian_mixture", "name": "p", "weights": None, **prompt}
    with pytest.raises(ConfigError) as e:
        make_prompt(spec, 2, 0)
    assert str(e.value).startswith(key + ":") and words in str(e.value), str(e.value)


def test_params_file_errors(tmp_path):
    f = str(tmp_path / "heads.npz")
    np.savez(f, Q=np.zeros((2, 3, 2, 2)), K=np.zeros((2, 3, 2, 2)), V=np.zeros((2, 3, 2, 2)))
    assert HeadMeasure.load(f, 2).heads == 3
    with pytest.raises(InputError, match=r"^model.params: .*heads.npz: Q has shape \(2, 3, 2, 2\), expected \(4, 3, 2, 2\)"):
        HeadMeasure.load(f, 2, layers=4)
    with pytest.raises(InputError, match="expected"):
        HeadMeasure.load(f, 3)  # d = 3 mesh, d = 2 parameters
    with pytest.raises(InputError, match="no such parameter file"):
        HeadMeasure.load(str(tmp_path / "nope.npz"), 2)
    np.savez(f, Q=np.zeros((2, 3, 2, 2)), K=np.zeros((2, 3, 2, 2)))
    with pytest.raises(InputError, match="'V' missing"):
        HeadMeasure.load(f, 2)


def test_tol_floor_is_the_tables_rounding():
    """attention.tol >= TOL_MIN: a laplace table's values carry its panel sums' rounding,
    up to PANEL_ROUNDING of their size, so no smaller error can be certified."""
    from pdeformer.model.velocity import TOL_MIN
    from pdeformer.attention.laplace import PANEL_ROUNDING
    assert PANEL_ROUNDING <= TOL_MIN < 2 * PANEL_ROUNDING


MMD = BASE.replace("covs = [0.2]", "covs = [0.2]\ntarget = { kind = 'gaussian_mixture', means = [[0.5, 0.0]], covs = [0.3] }") \
    + "\n[objective]\nkind = 'mmd'\nbandwidth = 0.5\n"


@pytest.mark.parametrize("bandwidth, words", [
    ("1e-300", "1e-300 is out of [1e-150, 1e+150]: the Gaussian kernel's 1/bandwidth^2 must be a finite double"),
    ("1e300", "is out of [1e-150, 1e+150]"),
    ("1e-20", "is below 0.013 = (cell size 0.5) / 38.6: the kernel underflows to 0 between points one cell apart"),
    ("0.0129", "is below 0.013"),
    ("4e8", "is above 3.8e+08 = 2^26 x (mesh diameter 5.66): the kernel is 1 to within one rounding unit"),
])
def test_mmd_bandwidth_out_of_range(tmp_path, bandwidth, words):
    """An mmd bandwidth of 1e-300 is refused by the checks (1/bandwidth^2 would raise
    ZeroDivisionError; 1e200: OverflowError); the kernel exp(-|x-y|^2/(2 bw^2)) is
    degenerate in double precision below cell/38.6 (0 between points a cell apart) and
    above 2^26 x the mesh's diameter (1 everywhere). On the 8 x 8 box of [-2, 2]^2: cell
    0.5, diameter 4 sqrt(2)."""
    path = write_config(tmp_path, MMD)
    with pytest.raises(ConfigError) as e:
        load_config(path, [f"objective.bandwidth={bandwidth}"])
    assert str(e.value).startswith("objective.bandwidth: ") and words in str(e.value), str(e.value)
    for ok in ("0.0131", "3.7e8"):     # just inside the range
        assert load_config(path, [f"objective.bandwidth={ok}"])["objective"]["bandwidth"] == float(ok)


def test_mmd_bandwidth_limits_in_double_precision():
    """The limits of check_bandwidth are where the kernel degenerates in float64."""
    import math
    from pdeformer.model.objectives import KERNEL_FLAT, KERNEL_REACH, check_bandwidth
    bw = 0.01
    assert math.exp(-(1.001 * KERNEL_REACH * bw) ** 2 / (2 * bw**2)) == 0.0     # one cell away
    assert math.exp(-(0.99 * KERNEL_REACH * bw) ** 2 / (2 * bw**2)) > 0.0
    assert 1.0 - math.exp(-1.0 / (2 * KERNEL_FLAT**2)) <= 2.0**-53           # diameter 1 apart
    check_bandwidth(0.03, diameter=10.0, cell=1.0)                             # a mesh file's
    with pytest.raises(ConfigError, match="^objective.bandwidth: 0.02 is below 0.0259"):
        check_bandwidth(0.02, diameter=10.0, cell=1.0)


def test_gaussian_too_narrow_for_the_mesh():
    """A Gaussian far narrower than the cells would look as if it lay "outside the mesh"
    (its projection's quadrature misses it: mass 0.036 of 1 for sigma = h/50), or run
    with its mass multiplied (2.9 at h/20, DG-1 triangles). The
    check the mesh solvers make before projecting: sigma (narrowest direction) below h/8
    is bad input naming the component's covariance and the cell size."""
    spec = {"kind": "gaussian_mixture", "name": "p", "weights": None, "means": [[0.0, 0.0], [1.0, 0.0]],
            "covs": [0.2, [[1e-4, 0.0], [0.0, 0.3]]]}
    g = make_prompt(spec, 2, 0)
    err = g.unresolved(0.5, "prompts[0]")
    assert isinstance(err, ConfigError) and str(err) == (
        "prompts[0].covs[1]: standard deviation 0.01 (in its narrowest direction) is below 1/8 of the "
        "mesh's cell size 0.5: the mesh cannot resolve this Gaussian (projected onto it, its mass "
        "comes out wrong by percents or all of it); use cells of at most 0.08 or a wider covariance")
    assert g.unresolved(0.08, "prompts[0]") is None          # sigma = h/8 exactly: resolved
    rotated = make_prompt(dict(spec, covs=[0.2, [[0.5, 0.49], [0.49, 0.5]]]), 2, 0)   # sigma_min = 0.1
    assert rotated.unresolved(0.8, "prompts[0]") is None and rotated.unresolved(0.81, "prompts[0]")


# ---------------------------------------------------------------- typed options
def test_options_are_the_checked_config_as_frozen_sections(tmp_path):
    """options(cfg) has one frozen dataclass per schema section with the checked values;
    a section made directly takes the schema's defaults for the keys not given."""
    import dataclasses

    from pdeformer.model.schema import SCHEMA, SECTIONS, AttentionOptions, Options, options
    cfg = load_config(write_config(tmp_path, BASE))
    opts = options(cfg)
    assert {f.name for f in dataclasses.fields(Options)} == set(SCHEMA) | {"prompts"}
    for name in SECTIONS:
        assert dataclasses.asdict(getattr(opts, name)) == cfg[name], name
    assert opts.mesh.cells == [8, 8] and opts.model.heads == 3 and opts.prompts[0]["name"] == "prompt0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.discretisation.cfl = 2.0
    made = AttentionOptions(backend="laplace")
    assert made.backend == "laplace" and made.tol == SCHEMA["attention"]["tol"].default
    assert options(opts) is opts



def test_every_option_has_a_type():
    """Each section's dataclass field has the type of its key's check (None allowed
    where the default is None), never Any."""
    import dataclasses
    import typing

    from pdeformer.model.schema import SECTIONS, MeshOptions, Options, TrainOptions
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.type is not typing.Any and typing.Any not in typing.get_args(f.type), (name, f.name)
    types = {f.name: f.type for f in dataclasses.fields(TrainOptions)}
    assert types["lr"] is float and types["steps"] == int | None and types["optimizer"] is str
    assert {f.name: f.type for f in dataclasses.fields(MeshOptions)}["cells"] == list[int] | None
    assert {f.name: f.type for f in dataclasses.fields(Options)}["train"] is TrainOptions


# ------------------------------------------------- components declare their options
def test_choices_are_the_registries():
    """A key that names a registered part accepts exactly the registry's names, in its
    order: schemes, backends, objectives, mesh shapes, prompt kinds, data families."""
    from pdeformer.integrator.schemes import SCHEMES, auto_scheme
    from pdeformer.model.geometry import SHAPES
    from pdeformer.model.objectives import OBJECTIVES
    from pdeformer.model.prompts import FLAT_PROMPTS
    from pdeformer.model.schema import PROMPT_COMMON_KEYS, PROMPT_KINDS, SCHEMA
    from pdeformer.model.sphere_prompts import SPHERE_PROMPTS
    from pdeformer.model.velocity import BACKENDS
    from pdeformer.tools.datasets import FAMILIES

    def choices(key, spec):
        with pytest.raises(ConfigError) as e:
            spec.check(key, "?")
        return re.fullmatch(rf"{re.escape(key)}: expected one of (.*), got '\?'", str(e.value)).group(1)

    quoted = lambda names: ", ".join(map(repr, names))   # noqa: E731
    for key, names in (("discretisation.scheme", ("auto", *SCHEMES)), ("attention.backend", BACKENDS),
                       ("objective.kind", OBJECTIVES), ("mesh.shape", SHAPES), ("data.family", FAMILIES)):
        section, name = key.split(".")
        assert choices(key, SCHEMA[section][name]) == quoted(names), key
    assert list(PROMPT_KINDS) == [*FLAT_PROMPTS, *SPHERE_PROMPTS] and set(FAMILIES) <= set(PROMPT_KINDS)
    assert choices("prompts[0].kind", PROMPT_COMMON_KEYS["kind"]) == quoted(PROMPT_KINDS)
    assert [auto_scheme(k) for k in (1, 2, 3)] == ["ssprk2", "ssprk3", "ssprk104"]


def test_a_registered_backend_is_a_choice_at_once():
    """attention.backend reads BACKENDS when it checks: a backend registered later is
    accepted, one removed is refused."""
    from pdeformer.model.velocity import BACKENDS, register_backend

    class Nearest:
        name = "nearest"

    register_backend(Nearest)
    try:
        assert check_config(_raw_base({"attention": {"backend": "nearest"}}), ".")["attention"]["backend"] == "nearest"
    finally:
        del BACKENDS["nearest"]
    with pytest.raises(ConfigError, match="attention.backend: expected one of 'direct', 'laplace', 'auto'"):
        check_config(_raw_base({"attention": {"backend": "nearest"}}), ".")


def _raw_base(extra: dict) -> dict:
    import tomllib
    return {**tomllib.loads(BASE), **extra}


def test_objectives_declare_their_keys_and_targets():
    """[objective] is kind, every objective's own keys (a shared key declared once, as
    one Key) and quadrature_degree; each objective's target kinds come from the sorts
    its class and the prompt kinds declare."""
    from pdeformer.model.objectives import OBJECTIVES, WEIGHT, WIDTH
    from pdeformer.model.schema import SCHEMA, target_kinds
    assert list(SCHEMA["objective"]) == ["kind", "potential", "center", "weight", "direction", "width",
                                         "interaction", "softening", "bandwidth", "quadrature_degree"]
    assert SCHEMA["objective"]["weight"] is WEIGHT and SCHEMA["objective"]["width"] is WIDTH
    for kind, cls in OBJECTIVES.items():
        assert set(cls.keys) <= set(SCHEMA["objective"]), kind
    assert target_kinds(OBJECTIVES["moments"].targets) == ("moments",)
    assert target_kinds(OBJECTIVES["l2"].targets) == ("gaussian_mixture", "uniform", "file")
    assert target_kinds(OBJECTIVES["mmd"].targets) == ("gaussian_mixture", "uniform", "file", "points")
    assert target_kinds(OBJECTIVES["potential"].targets) == ()


def test_merged_keys_keep_each_component_s_order():
    """merge_keys: a shared key once, a component's own keys after the shared key they
    follow; two different declarations of one name are a programming error."""
    from pdeformer.tools.keys import Key, merge_keys, number
    w, a, b, c = (Key(number()) for _ in range(4))
    assert list(merge_keys([{"a": a, "w": w}, {"c": c}, {"w": w, "b": b}])) == ["a", "w", "b", "c"]
    with pytest.raises(ValueError, match="'w' is declared twice"):
        merge_keys([{"w": w}, {"w": Key(number())}])


def test_both_geometries_build_every_prompt_kind():
    """Every declared prompt kind has a builder (or a one-line refusal) on a flat mesh and
    on a sphere, and no builder lacks a declaration."""
    from pdeformer.model.geometry import Flat, Sphere
    from pdeformer.model.prompts import prompt_kinds
    from pdeformer.model.schema import PROMPT_KINDS
    for geometry in (Flat(2), Sphere(3, 1.0)):
        assert set(prompt_kinds(geometry)) == set(PROMPT_KINDS), geometry.name


class _Untouchable(dict):
    def __getitem__(self, key):
        raise AssertionError(f"a solver read the config dict: [{key!r}]")

    def get(self, key, default=None):
        raise AssertionError(f"a solver read the config dict: .get({key!r})")


def test_solvers_read_options_not_the_dict(tmp_path):
    """Once the problem is built, the forward solver, the adjoint and the trainer read
    only its typed options: with the dict made unreadable, a gradient still runs."""
    pytest.importorskip("dolfinx")
    from mpi4py import MPI

    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    from pdeformer.solvers.train import Trainer
    text = BASE + '\n[objective]\nkind = "moments"\n[prompts.target]\nmean = [0.1, 0.0]\ncov = 0.3\n'
    cfg = load_config(write_config(tmp_path, text))
    problem = build_problem(cfg, MPI.COMM_WORLD, differentiable=True)
    problem.cfg = _Untouchable(cfg)
    forward = ForwardSolver(problem)
    adjoint = AdjointSolver(forward, problem.objective, problem.targets)
    g = adjoint.gradient()
    assert np.isfinite(g.risk) and g.risk > 0
    assert Trainer(adjoint, problem.opts, str(tmp_path)).train.steps == cfg["train"]["steps"]
