"""Run configuration: TOML file -> checked, resolved dictionary.

A run is described by a TOML file (see ``runs/default.toml`` and the README's tour).
:func:`load_config` reads it, applies ``--set section.key=value`` overrides, checks
every key against :data:`SCHEMA`, fills defaults and resolves paths relative to the
config file. The result is a plain nested ``dict`` that is written verbatim into
``summary.json``. Every problem is a :class:`~pdeformer.tools.errors.ConfigError` whose
message starts with the offending key (``mesh.cells: ...``). User strings are data
only: nothing here is evaluated.

Checks that need the mesh (the token dimension d of a mesh file, a prompt's shape)
happen later, where d is known, and name their key the same way.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
import tomllib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .datasets import (check_data, component_range, data_errors, data_set_given, draw_prompts, read_folder,
                       split_prompts, teacher_given)
from .errors import ConfigError

REQUIRED = object()

# ----------------------------------------------------------------------------------
# value checkers: (key, value) -> normalised value, or ConfigError naming key


def _typename(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def integer(lo: int | None = None, hi: int | None = None) -> Callable:
    def check(key, v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(key, f"expected an integer, got {_typename(v)} ({v!r})")
        if lo is not None and v < lo or hi is not None and v > hi:
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise ConfigError(key, f"expected an integer {rng}, got {v}")
        return v
    return check


def number(positive: bool = False, nonnegative: bool = False, hi: float | None = None,
           lo: float | None = None, why: str = "") -> Callable:
    """A finite number (optionally positive, nonnegative, in [lo, hi]); ``why`` is added
    to a range error."""
    def check(key, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(key, f"expected a number, got {_typename(v)} ({v!r})")
        try:
            v = float(v)
        except OverflowError:
            raise ConfigError(key, "number too large") from None
        if not math.isfinite(v):
            raise ConfigError(key, f"expected a finite number, got {v}")
        if positive and v <= 0:
            raise ConfigError(key, f"expected a positive number, got {v}")
        if nonnegative and v < 0:
            raise ConfigError(key, f"expected a non-negative number, got {v}")
        if lo is not None and v < lo or hi is not None and v > hi:
            rng = f">= {lo:g}" if hi is None else f"<= {hi:g}" if lo is None else f"in [{lo:g}, {hi:g}]"
            raise ConfigError(key, f"expected a number {rng}, got {v:g}{why}")
        return v
    return check


def boolean(key, v):
    if not isinstance(v, bool):
        raise ConfigError(key, f"expected true or false, got {_typename(v)} ({v!r})")
    return v


def string(choices=None, pattern: str | None = None) -> Callable:
    """A string, one of ``choices`` (a tuple, or a function giving it when checked) or
    matching ``pattern``."""
    def check(key, v):
        if not isinstance(v, str):
            raise ConfigError(key, f"expected a string, got {_typename(v)} ({v!r})")
        allowed = choices() if callable(choices) else choices
        if allowed is not None and v not in allowed:
            raise ConfigError(key, f"expected one of {', '.join(map(repr, allowed))}, got {v!r}")
        if pattern is not None and not re.fullmatch(pattern, v):
            raise ConfigError(key, f"{v!r} is not allowed (1 to 64 letters, digits, '_' or '-')")
        return v
    return check


def path(key, v):
    if not isinstance(v, str) or not v or "\0" in v:
        raise ConfigError(key, f"expected a file path (string), got {_typename(v)} ({v!r})")
    return v


def number_list(length: tuple[int, int] = (1, 3)) -> Callable:
    """A list of finite numbers whose length lies in ``length``."""
    def check(key, v):
        if not isinstance(v, list) or not length[0] <= len(v) <= length[1]:
            n = f"{length[0]}" if length[0] == length[1] else f"{length[0]} to {length[1]}"
            raise ConfigError(key, f"expected a list of {n} numbers, got {v!r}")
        return [number()(f"{key}[{i}]", x) for i, x in enumerate(v)]
    return check


MAX_CELLS = 10**8


def positive_int_list(key, v):
    if not isinstance(v, list) or not 1 <= len(v) <= 3:
        raise ConfigError(key, f"expected a list of 1 to 3 positive integers, got {v!r}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ConfigError(key, f"expected positive integers, got {v!r}")
    if math.prod(v) > MAX_CELLS:
        raise ConfigError(key, f"{math.prod(v):.3g} cells is more than pdeformer allows ({MAX_CELLS:g})")
    return list(v)


def array(key, v):
    """A nested list of numbers (shape checked later, once d is known)."""
    def walk(x, k):
        if isinstance(x, list):
            if not x:
                raise ConfigError(key, "expected numbers, got an empty list")
            return [walk(y, f"{k}[{i}]") for i, y in enumerate(x)]
        return number()(k, x)
    if not isinstance(v, list):
        raise ConfigError(key, f"expected a list, got {_typename(v)} ({v!r})")
    return walk(v, key)


def array_or_number(key, v):
    return number()(key, v) if not isinstance(v, list) else array(key, v)


def petsc_options(key, v):
    if not isinstance(v, dict):
        raise ConfigError(key, f"expected a table of PETSc options, got {_typename(v)}")
    out = {}
    for k, x in v.items():
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", k):
            raise ConfigError(f"{key}.{k}", "not a PETSc option name")
        if isinstance(x, bool):
            x = "true" if x else "false"
        elif isinstance(x, (int, float, str)):
            x = str(x)
        else:
            raise ConfigError(f"{key}.{k}", f"expected a string, number or boolean, got {_typename(x)}")
        out[k] = x
    return out


@dataclass(frozen=True)
class Key:
    check: Callable
    default: Any = REQUIRED
    doc: str = ""


# The smallest attention.tol: a laplace table's values carry the rounding of its panel
# sums, amplified by the variation e^{2 beta} = e^6 of e^{b y} over a panel: up to
# 400 x 2^-52 = 9e-14 of their size (pdeformer.attention.laplace.PANEL_ROUNDING), which its error
# estimate (the Chebyshev coefficients' tail) does not see. A smaller tol cannot be
# certified; asked for one, 'laplace' stopped with status 3 after tables up to n = 1025
# (estimates bottom out at 1e-14..5e-10 there: the tail of round-off coefficients) and
# 'auto' searched in vain at every evaluation. Exact sums are attention.backend = "direct".
TOL_MIN = 1e-13
TOL_WHY = (" (a laplace table's values carry rounding of about 1e-13 of their size, so no "
           "smaller error can be certified; for exact sums set attention.backend = 'direct')")

# Circle and sphere radii R that run: a sphere's cell areas come from 4th powers of its
# edges (down to R / 300 at 9 refinements), its density is 1/(4 pi R^2) and its moments'
# risks square R^2, all within the doubles' range for R in [1e-50, 1e50] (tested at both
# ends; at 1e-100 the areas underflow to 0, at 1e70 a moments risk overflows).
RADIUS_LIMITS = (1e-50, 1e50)
RADIUS_WHY = (" (a sphere's cell areas, its density 1/(4 pi R^2) and its moments must stay within "
              "double precision; scale the problem to a radius near 1)")

CELLS = {1: ("interval",), 2: ("triangle", "quadrilateral"), 3: ("tetrahedron", "hexahedron")}
SHAPES = ("box", "circle", "sphere")
SCHEMES = ("auto", "euler", "ssprk2", "ssprk3", "ssprk104")
PARTICLE_STEPS_PER_LAYER = 10    # [particles] steps_per_layer where neither section sets it
PROMPT_KINDS = ("gaussian_mixture", "uniform", "file", "points", "von_mises_fisher", "harmonics")
NAME = r"[A-Za-z0-9_-]{1,64}"   # prompt names go into file names: short and portable

SCHEMA: dict[str, dict[str, Key]] = {
    "mesh": {
        "file": Key(path, None, "mesh file (XDMF), instead of a built-in box"),
        "name": Key(string(), "mesh", "name of the mesh grid in the XDMF file"),
        "lower": Key(number_list(), None, "lower corner of the built-in box"),
        "upper": Key(number_list(), None, "upper corner of the built-in box"),
        "cells": Key(positive_int_list, None, "cells per direction of the built-in box"),
        "cell": Key(string(tuple(c for cs in CELLS.values() for c in cs)), None,
                    "cell type of the built-in box (default: simplices)"),
        "shape": Key(string(SHAPES), "box", "built-in domain: a box (lower, upper, cells), a "
                     "circle (cells = [n]) or a sphere (refinements), about the origin"),
        "radius": Key(number(positive=True, lo=RADIUS_LIMITS[0], hi=RADIUS_LIMITS[1], why=RADIUS_WHY), 1.0,
                      "radius of the circle or sphere"),
        "refinements": Key(integer(0, 9), None, "sphere: the icosahedron refined this often "
                           "(20 * 4^r triangles)"),
    },
    "discretisation": {
        "degree": Key(integer(1, 3), 1, "DG degree of the density"),
        "velocity_degree": Key(integer(1, 4), None, "Lagrange degree of the velocity (default: degree)"),
        "scheme": Key(string(SCHEMES), "auto", "SSP Runge-Kutta scheme (auto: order degree+1)"),
        "cfl": Key(number(positive=True), 0.5, "dt = cfl * min_K l_K / ((2k+1) |v|_K)"),
        "steps_per_layer": Key(integer(1, 10**7), None, "fixed steps per layer instead of the CFL step"),
        "limiter": Key(boolean, True, "positivity limiter (keeps cell means)"),
        "quadrature_degree": Key(integer(1, 12), None,
                                 "quadrature of the attention sources (default: degree)"),
        "prompt_quadrature_degree": Key(integer(1, 20), None,
                                        "quadrature projecting prompts (default: 2*degree + 4)"),
        "tail_tolerance": Key(number(nonnegative=True), 1e-6,
                              "warn when more prompt mass than this lies outside the mesh "
                              "(cut off at t = 0, or flowed out later)"),
        "max_outflow": Key(number(positive=True, hi=1.0), 0.5,
                           "a run whose outflow passes this share of the mass is a breakdown: the "
                           "moments of what is left say little (1: never)"),
    },
    "model": {
        "layers": Key(integer(1, 10**5), None, "number of layers L"),
        "heads": Key(integer(1, 10**5), None, "heads per layer H"),
        "key_dim": Key(integer(1, 1024), None, "key dimension k (default: d)"),
        "params": Key(path, None, "head parameters .npz with Q (L,H,k,d), K (L,H,k,d), V (L,H,d,d)"),
        "seed": Key(integer(0, 2**63 - 1), 0, "seed of the random heads"),
        "init_scale": Key(number(positive=True), 1.0, "Q, K, V entries ~ N(0, init_scale^2 / d)"),
        "query_scale": Key(number(nonnegative=True), None,
                           "scale of Q (default init_scale; 0: uniform attention)"),
        "depth": Key(string(("iid", "smooth")), "iid",
                     "random heads independent per layer, or linear in depth per head"),
        "init": Key(string(("random", "teacher")), "random",
                    "the heads at the start: drawn (or model.params), or the data set's teacher's "
                    "plus init_noise (a student near the teacher)"),
        "init_noise": Key(number(nonnegative=True), 0.0,
                          "init = 'teacher': every entry of Q, K, V moves by init_noise N(0, 1)"),
    },
    "attention": {
        "backend": Key(string(lambda: tuple(_backends())), "auto",
                       "direct summation, a log-Laplace table (d <= 3), or auto"),
        "tol": Key(number(positive=True, lo=TOL_MIN, hi=1e-1, why=TOL_WHY), 1e-8,
                   "accuracy of the laplace table (relative to its values' size)"),
        "chunk_mb": Key(number(positive=True, hi=4096), 2.0, "working memory of one kernel chunk (MB)"),
        "beta": Key(number(positive=True), 1.0, "inverse temperature: scores beta <A x, y>"),
        "tape_mb": Key(number(nonnegative=True, hi=1e7), 256.0,
                       "laplace tables a gradient keeps per rank and prompt for its adjoint (MB); "
                       "past it the adjoint builds them again"),
    },
    "output": {
        "dir": Key(path, None, "output folder (default: output/<config name> beside the config)"),
        "fields": Key(boolean, True, "write density (and velocity) fields for ParaView"),
        "velocity": Key(boolean, True, "also write the velocity fields"),
        "format": Key(string(("vtk", "vtx")), "vtk", "field format: vtk (.pvd) or vtx (.bp, dolfinx with ADIOS2)"),
        "frames_per_layer": Key(integer(1, 10**4), 1, "field and diagnostics frames per layer"),
        "plots": Key(boolean, True, "draw the run's pictures (PNG) into the output folder when it "
                     "ends, and write paraview.py; `pdeformer plot DIR` draws them again"),
        "plot_format": Key(string(("png", "svg")), "png", "image format of the pictures"),
        "max_memory_gb": Key(number(positive=True), None,
                             "refuse runs whose memory estimate for the ranks of a node exceeds "
                             "this (default: the node's available memory)"),
    },
    "objective": {
        "kind": Key(string(lambda: tuple(_objectives())), None,
                    "risk per prompt: a registered objective (pdeformer.model.objectives: potential, ...)"),
        "potential": Key(string(("quadratic", "linear", "gaussian")), "quadratic", "named potential U"),
        "center": Key(number_list(), None, "centre of the quadratic/gaussian potential (default 0)"),
        "weight": Key(number(), 1.0, "strength of the quadratic/gaussian potential or of W (interaction)"),
        "direction": Key(number_list(), None, "direction of the linear potential"),
        "width": Key(number(positive=True), 1.0, "width of the gaussian potential or W (interaction)"),
        "interaction": Key(string(("gaussian", "coulomb")), "gaussian",
                           "interaction W: weight exp(-|r|^2/(2 width^2)) or weight/sqrt(|r|^2 + softening^2)"),
        "softening": Key(number(positive=True), 0.1, "softening of the coulomb interaction"),
        "bandwidth": Key(number(positive=True), None, "Gaussian kernel bandwidth of mmd"),
        "quadrature_degree": Key(integer(1, 20), None, "quadrature of rho_1 in the objective"),
    },
    "train": {
        "steps": Key(integer(0, 10**6), None, "training steps (default: 20, or from train.epochs)"),
        "epochs": Key(integer(1, 10**6), None, "train this many passes over the training prompts "
                      "(steps = epochs x batches per epoch; instead of train.steps)"),
        "batch_size": Key(integer(1, 10**6), None, "minibatch SGD: training prompts per step, "
                          "drawn without replacement in an order shuffled every epoch "
                          "(default: all, full-batch)"),
        "seed": Key(integer(0, 2**63 - 1), 0, "seed of the minibatch order and of the Langevin noise"),
        "test_every": Key(integer(1, 10**6), 10, "every n steps (and at the last) the risk on all "
                          "training prompts (with minibatches) and on the held-out prompts"),
        "temperature": Key(number(nonnegative=True), 0.0,
                           "Langevin noise: gd adds sqrt(2 lr temperature) N(0, 1) to every "
                           "head parameter (mean-field Langevin dynamics)"),
        "weight_decay": Key(number(nonnegative=True), 0.0, "L2 penalty (weight_decay / 2) x the mean "
                            "over heads of |Q|^2 + |K|^2 + |V|^2, added to the risk"),
        "lr": Key(number(positive=True), 0.05, "learning rate (gd: particles move by -lr L H dR/dtheta)"),
        "optimizer": Key(string(("gd", "adam")), "gd", "gd (the gradient flow's Euler step) or adam"),
        "beta1": Key(number(nonnegative=True, hi=0.999999), 0.9, "adam: first-moment decay"),
        "beta2": Key(number(nonnegative=True, hi=0.999999999), 0.999, "adam: second-moment decay"),
        "eps": Key(number(positive=True), 1e-8, "adam: denominator floor"),
        "checkpoint_every": Key(integer(1, 10**6), 5, "write a checkpoint every n steps"),
        "output_every": Key(integer(1, 10**6), 1, "write params_XXXX.npz and head points every n steps"),
    },
    "particles": {
        "tokens": Key(integer(1, 10**8), 10000, "tokens N sampled from each prompt"),
        "seed": Key(integer(0, 2**63 - 1), 0, "seed of the token samples"),
        "steps_per_layer": Key(integer(1, 10**7), None,
                               "steps per layer (default: discretisation.steps_per_layer or "
                               f"{PARTICLE_STEPS_PER_LAYER})"),
        "points": Key(boolean, True, "write the tokens at every layer boundary (tokens_<prompt>.pvd)"),
    },
    "ntk": {
        "depth": Key(number(nonnegative=True, hi=1.0), None,
                     "test the densities of a forward run at this depth t (default: the prompts)"),
        "b_range": Key(number(positive=True), 3.0, "LSE test: b sampled in [-b_range, b_range]^d"),
        "b_count": Key(integer(2, 10**6), 256, "LSE test: number of sample points b"),
        "seed": Key(integer(0, 2**63 - 1), 0, "seed of the b sample and of sampled heads"),
        "tol": Key(number(positive=True, hi=1.0), 1e-6,
                   "verdicts: sigma_min/sigma_max > tol, lambda_min/lambda_max > tol^2"),
        "params": Key(string(("A", "V", "all")), "A", "trained parameters in the NTK: A, V or all (Q, K, V)"),
        "heads": Key(string(("sampled", "run")), "sampled", "head measure of the NTK: sampled, or the run's heads"),
        "head_count": Key(integer(1, 10**6), 256, "sampled heads: how many"),
        "head_scale": Key(number(positive=True), 1.0, "sampled heads: Q, K, V entries ~ N(0, scale^2 / d)"),
        "layer": Key(integer(0, 10**5), None, "run heads: the layer (default: the one holding depth, or 0)"),
        "queries": Key(array, None, "query points x_p, d-vectors (default: one, (1,...,1)/sqrt(d))"),
        "pairing": Key(string(("all", "matched")), "all",
                       "data (mu_i, x_p): every prompt with every query, or prompt i with query i"),
        "quadrature_degree": Key(integer(1, 20), None,
                                 "quadrature of mesh densities (default: 2 * degree + 2)"),
    },
    "data": {
        "count": Key(integer(0, 10**6), 0, "draw this many prompts from a seeded family instead of "
                     "[[prompts]] (pdeformer.tools.datasets)"),
        "family": Key(string(("gaussian_mixture", "von_mises_fisher")), "gaussian_mixture",
                      "gaussian_mixture (flat meshes) or von_mises_fisher (circle, sphere)"),
        "components": Key(component_range, [1, 3], "fewest and most mixture components, [min, max]"),
        "mean_range": Key(number_list((2, 2)), [-1.0, 1.0],
                          "gaussian_mixture: every coordinate of a mean uniform in [lo, hi]"),
        "std_range": Key(number_list((2, 2)), [0.3, 0.6],
                         "gaussian_mixture: each component's standard deviation uniform in [lo, hi]"),
        "concentration_range": Key(number_list((2, 2)), [2.0, 10.0],
                                   "von_mises_fisher: each concentration uniform in [lo, hi]"),
        "seed": Key(integer(0, 2**63 - 1), 0, "seed of the data set"),
        "teacher": Key(path, None, "targets from a teacher: its heads (.npz, as model.params); "
                       "each prompt's target is the teacher's output for it"),
        "teacher_seed": Key(integer(0, 2**63 - 1), None,
                            "targets from a random teacher of the model's sizes drawn with this seed"),
        "folder": Key(path, None, "a data set read from files: every .npz or .csv file of this "
                      "folder is a prompt (a density, or a point cloud), in name order; a file of "
                      "the same name in its subfolder targets/ is that prompt's target"),
        "test_fraction": Key(number(nonnegative=True, hi=0.9), 0.0,
                             "hold out the last round(fraction x S) prompts: a test risk, not trained on"),
    },
    "parallel": {
        "prompt_groups": Key(integer(1, 10**6), 1,
                             "split the ranks into this many groups, each with its own mesh "
                             "partition and a block of the prompts (--prompt-groups)"),
    },
    "petsc": {},  # free-form PETSc options for the DG mass solver, see petsc_options
}

PROMPT_KEYS: dict[str, dict[str, Key]] = {
    "common": {
        "name": Key(string(pattern=NAME), None, "prompt name (default: prompt<i>)"),
        "kind": Key(string(PROMPT_KINDS), REQUIRED),
    },
    "gaussian_mixture": {
        "weights": Key(array, None, "mixture weights (positive; normalised)"),
        "means": Key(array, REQUIRED, "component means, one d-vector each"),
        "covs": Key(array, REQUIRED, "component covariances: d x d matrices or variances"),
    },
    "uniform": {
        "lower": Key(array, None, "lower corner of the box (flat meshes; not on a sphere)"),
        "upper": Key(array, None, "upper corner of the box"),
    },
    "von_mises_fisher": {
        "weights": Key(array, None, "mixture weights (positive; normalised)"),
        "means": Key(array, REQUIRED, "mean directions, one d-vector each (normalised)"),
        "concentrations": Key(array, REQUIRED, "concentration kappa >= 0 of each component"),
    },
    "harmonics": {
        "coefficients": Key(array, REQUIRED, "[[l, m, c], ...]: rho = (1 + sum c Y_lm) / |S|"),
    },
    "file": {
        "path": Key(path, REQUIRED, ".npz (points, density) or .csv (x0..,density)"),
    },
    "points": {
        "path": Key(path, None, ".npz (points, weights) or .csv (x0..[,weight]): a point cloud"),
        "points": Key(array, None, "the points, d-vectors (instead of path)"),
        "weights": Key(array, None, "with points: their weights (default equal; normalised)"),
    },
    "moments": {
        "mean": Key(array, REQUIRED, "target mean (a d-vector)"),
        "cov": Key(array_or_number, REQUIRED, "target covariance (d x d, or a variance)"),
    },
}
TARGET_KINDS = PROMPT_KINDS

def _option_field(key: str, spec: Key):
    """A dataclass field for a schema key: its default (copied where mutable), or none."""
    if spec.default is REQUIRED:
        return (key, Any)
    if isinstance(spec.default, (list, dict)):
        return (key, Any, dataclasses.field(default_factory=lambda d=spec.default: copy.deepcopy(d)))
    return (key, Any, dataclasses.field(default=spec.default))


# Each section of a checked config as a frozen dataclass (fields: the schema's keys, with
# the schema's defaults), what solvers take instead of the dict:
# ``options(cfg).discretisation.cfl``; ``SECTIONS["attention"](backend="laplace")`` makes
# one with every other key at its default.
SECTIONS = {name: dataclasses.make_dataclass(name.title().replace("_", "") + "Options",
                                             [_option_field(k, spec) for k, spec in keys.items()],
                                             frozen=True, kw_only=True)
            for name, keys in SCHEMA.items() if name != "petsc"}
MeshOptions, DiscretisationOptions = SECTIONS["mesh"], SECTIONS["discretisation"]
ModelOptions, AttentionOptions = SECTIONS["model"], SECTIONS["attention"]
OutputOptions, ObjectiveOptions = SECTIONS["output"], SECTIONS["objective"]
TrainOptions, ParticlesOptions = SECTIONS["train"], SECTIONS["particles"]
NtkOptions, ParallelOptions = SECTIONS["ntk"], SECTIONS["parallel"]


@dataclasses.dataclass(frozen=True)
class Options:
    """A checked configuration as typed sections: ``opts.mesh.cells``, ``opts.train.lr``.
    ``petsc`` is the free-form PETSc options table, ``prompts`` the checked prompt tables
    (their keys depend on each prompt's kind; read by the prompt and target factories)."""

    mesh: Any
    discretisation: Any
    model: Any
    attention: Any
    output: Any
    objective: Any
    train: Any
    particles: Any
    ntk: Any
    data: Any
    parallel: Any
    petsc: dict
    prompts: tuple


def section(cfg: dict, name: str):
    """The checked ``[name]`` table of ``cfg`` as its frozen dataclass (SECTIONS)."""
    return SECTIONS[name](**cfg[name])


def options(cfg: dict) -> Options:
    """A checked config (:func:`load_config`) as :class:`Options`: made once, where a run
    starts; solvers read it, never the dict (which stays the record of the run)."""
    if isinstance(cfg, Options):
        return cfg
    typed = {name: section(cfg, name) for name in SECTIONS}
    return Options(**typed, petsc=dict(cfg["petsc"]), prompts=tuple(cfg["prompts"]))


PATH_KEYS = (("mesh", "file"), ("model", "params"), ("output", "dir"), ("data", "teacher"),
             ("data", "folder"))


def _unknown(key: str, allowed) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(name, list(allowed), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else f" (allowed: {', '.join(sorted(allowed))})"
    return ConfigError(key, f"unknown key{hint}")


def check_table(prefix: str, table: dict, keys: dict[str, Key]) -> dict:
    """A TOML table checked against its schema ``keys`` (unknown keys refused, defaults
    filled in, errors naming ``prefix.key``)."""
    out = {}
    for k, v in table.items():
        if k not in keys:
            raise _unknown(f"{prefix}.{k}", keys)
    for k, spec in keys.items():
        key = f"{prefix}.{k}"
        if k in table:
            out[k] = spec.check(key, table[k])
        elif spec.default is REQUIRED:
            raise ConfigError(key, "missing (required)")
        else:
            out[k] = copy.deepcopy(spec.default)
    return out


def _check_prompt(i: int, p) -> dict:
    prefix = f"prompts[{i}]"
    if not isinstance(p, dict):
        raise ConfigError(prefix, f"expected a table, got {_typename(p)}")
    if "kind" not in p:
        raise ConfigError(f"{prefix}.kind", f"missing (required: {', '.join(PROMPT_KINDS)})")
    kind = PROMPT_KEYS["common"]["kind"].check(f"{prefix}.kind", p["kind"])
    keys = {**PROMPT_KEYS["common"], **PROMPT_KEYS[kind],
            "target": Key(lambda key, v: _check_target(key, v), None, "the objective's target")}
    out = check_table(prefix, p, keys)
    if kind == "points":
        _check_point_source(prefix, out)
    if out["name"] is None:
        out["name"] = f"prompt{i}"
    return out


def _check_target(key: str, t) -> dict:
    """A prompt's target: {mean, cov} (moments) or a density/point cloud with a kind."""
    if not isinstance(t, dict):
        raise ConfigError(key, f"expected a table, e.g. {{ mean = [...], cov = [...] }}, got {_typename(t)}")
    if "kind" not in t:
        out = check_table(key, t, PROMPT_KEYS["moments"])
        out["kind"] = "moments"
        return out
    kind = string(TARGET_KINDS)(f"{key}.kind", t["kind"])
    out = check_table(key, t, {"kind": Key(string(TARGET_KINDS), REQUIRED), **PROMPT_KEYS[kind]})
    if kind == "points":
        _check_point_source(key, out)
    return out


def _check_point_source(prefix: str, table: dict) -> None:
    """A point cloud comes from a file (path) or inline (points [, weights]), not both."""
    if (table["path"] is None) == (table["points"] is None):
        raise ConfigError(f"{prefix}.path", "give either path (a file) or points (inline), one of them")
    if table["weights"] is not None and table["points"] is None:
        raise ConfigError(f"{prefix}.weights", "inline weights go with inline points")


def check_config(raw: dict, base_dir: str, stem: str = "run") -> dict:
    """Check ``raw`` (parsed TOML) against the schema; fill defaults, resolve paths."""
    allowed = set(SCHEMA) | {"prompts"}
    for section in raw:
        if section not in allowed:
            raise _unknown(section, allowed)
    cfg: dict[str, Any] = {}
    for section, keys in SCHEMA.items():
        table = raw.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a table [{section}], got {_typename(table)}")
        cfg[section] = petsc_options(section, table) if section == "petsc" \
            else check_table(section, table, keys)
    _check_mesh(cfg["mesh"])
    data = cfg["data"]
    check_data(data, cfg["mesh"])
    if data_set_given(data) and "prompts" in raw:
        key = "data.count" if data["count"] else "data.folder"
        raise ConfigError(key, "give either [[prompts]] tables or a data set ([data] count or "
                               "folder), not both")
    if data_set_given(data):
        tables = draw_prompts(data, cfg["mesh"]) if data["count"] else read_folder(data, base_dir, NAME)
        with data_errors(data, tables):     # named by the data.* key that made them
            cfg["prompts"] = _check_prompts(tables)
    else:
        cfg["prompts"] = _check_prompts(raw.get("prompts", REQUIRED))
    _check_model(cfg["model"], data)
    _check_objective(cfg["objective"], cfg["prompts"], cfg["mesh"], data)
    _check_train(cfg["train"], len(split_prompts(data, len(cfg["prompts"]))[0]))
    _fill_discretisation(cfg["discretisation"])
    if cfg["output"]["dir"] is None:
        cfg["output"]["dir"] = os.path.join("output", stem)
    _resolve_paths(cfg, base_dir)
    return cfg


def _check_prompts(prompts) -> list[dict]:
    """The [[prompts]] tables, checked; their names unique."""
    if prompts is REQUIRED:
        raise ConfigError("prompts", "missing: give at least one [[prompts]] table")
    if not isinstance(prompts, list) or not prompts:
        raise ConfigError("prompts", "expected one or more [[prompts]] tables")
    checked = [_check_prompt(i, p) for i, p in enumerate(prompts)]
    seen = set()
    for i, p in enumerate(checked):
        if p["name"] in seen:
            raise ConfigError(f"prompts[{i}].name", f"{p['name']!r} is used twice")
        seen.add(p["name"])
    return checked


def _fill_discretisation(disc: dict) -> None:
    """Defaults that follow the degree k: velocity and quadrature degrees, the scheme."""
    k = disc["degree"]
    if disc["velocity_degree"] is None:
        disc["velocity_degree"] = k
    if disc["quadrature_degree"] is None:
        disc["quadrature_degree"] = k
    if disc["prompt_quadrature_degree"] is None:
        disc["prompt_quadrature_degree"] = 2 * k + 4
    if disc["scheme"] == "auto":
        disc["scheme"] = {1: "ssprk2", 2: "ssprk3", 3: "ssprk104"}[k]


def _resolve_paths(cfg: dict, base_dir: str) -> None:
    """Paths in the config relative to ``base_dir`` (the config file's folder)."""
    for section, key in PATH_KEYS:
        if cfg[section][key] is not None:
            cfg[section][key] = os.path.normpath(os.path.join(base_dir, cfg[section][key]))
    for p in cfg["prompts"]:
        for table in (p, p["target"] or {}):
            if table.get("kind") in ("file", "points") and table["path"] is not None:
                table["path"] = os.path.normpath(os.path.join(base_dir, table["path"]))


def input_files(cfg: dict) -> list[tuple[str, str]]:
    """[(key, path)] of every file a run of a checked config reads: the config itself,
    the pinned costs, the mesh (and its HDF5 data), heads, teacher, prompt and target
    files."""
    out = [("the config file", cfg["config_file"])] if cfg.get("config_file") else []
    if os.environ.get("PDEFORMER_COSTS"):
        out.append(("PDEFORMER_COSTS", os.environ["PDEFORMER_COSTS"]))
    mesh = cfg["mesh"]["file"]
    if mesh is not None:
        out += [("mesh.file", mesh), ("mesh.file", os.path.splitext(mesh)[0] + ".h5")]
    out += [(f"{s}.{k}", cfg[s][k]) for s, k in (("model", "params"), ("data", "teacher"))
            if cfg[s][k] is not None]
    folder = cfg["data"]["folder"] is not None
    for i, p in enumerate(cfg["prompts"]):
        for key, table in ((f"prompts[{i}]", p), (f"prompts[{i}].target", p.get("target") or {})):
            if table.get("path") is not None:
                out.append(("data.folder" if folder else f"{key}.path", table["path"]))
    return out


def _check_mesh(m: dict) -> None:
    box = [k for k in ("lower", "upper", "cells") if m[k] is not None]
    if m["file"] is not None:
        if box or m["cell"] is not None:
            k = box[0] if box else "cell"
            raise ConfigError(f"mesh.{k}", "give either mesh.file or a built-in box, not both")
        if m["shape"] != "box":
            raise ConfigError("mesh.shape", "give either mesh.file or a built-in shape, not both")
        for k in ("radius", "refinements"):
            if m[k] != SCHEMA["mesh"][k].default:
                raise ConfigError(f"mesh.{k}", "not with mesh.file (a sphere's radius is read from it)")
        return
    if m["shape"] != "box":
        _check_manifold(m)
        return
    for k in ("radius", "refinements"):
        if m[k] != SCHEMA["mesh"][k].default:
            raise ConfigError(f"mesh.{k}", "only for shape = \"circle\" or \"sphere\"")
    for k in ("lower", "upper", "cells"):
        if m[k] is None:
            raise ConfigError(f"mesh.{k}", "missing: give mesh.file or mesh.lower, mesh.upper and mesh.cells")
    d = len(m["lower"])
    for k in ("upper", "cells"):
        if len(m[k]) != d:
            raise ConfigError(f"mesh.{k}", f"expected {d} entries like mesh.lower, got {len(m[k])}")
    for i, (a, b) in enumerate(zip(m["lower"], m["upper"])):
        if not b > a:
            raise ConfigError("mesh.upper", f"upper[{i}] = {b} is not above lower[{i}] = {a}")
    if m["cell"] is None:
        m["cell"] = CELLS[d][0]
    elif m["cell"] not in CELLS[d]:
        raise ConfigError("mesh.cell", f"{m['cell']!r} is not a {d}-D cell (use {' or '.join(CELLS[d])})")


def _check_manifold(m: dict) -> None:
    """A circle (cells = [n], n >= 3) or a sphere (refinements): no box keys."""
    shape = m["shape"]
    for k in ("lower", "upper", "cell") + (("cells",) if shape == "sphere" else ()):
        if m[k] is not None:
            raise ConfigError(f"mesh.{k}", f"not for shape = {shape!r} (a {shape} about the origin "
                              "of mesh.radius)")
    if shape == "circle":
        if m["refinements"] is not None:
            raise ConfigError("mesh.refinements", "only for shape = \"sphere\" (a circle takes cells = [n])")
        if m["cells"] is None or len(m["cells"]) != 1 or m["cells"][0] < 3:
            raise ConfigError("mesh.cells", f"a circle takes cells = [n] with n >= 3, got {m['cells']}")
    elif m["refinements"] is None:
        raise ConfigError("mesh.refinements", "missing: a sphere takes refinements = r (20 * 4^r triangles)")


MAX_HEADS_TOTAL = 10**7

def _backends() -> dict:
    """The attention backends' registry (pdeformer.model.velocity), imported when a config is
    checked."""
    from ..model.velocity import BACKENDS
    return BACKENDS


def _objectives() -> dict:
    """The objective registry, imported when a config is checked (it needs mpi4py; reading
    this module must not start MPI)."""
    from ..model.objectives import OBJECTIVES
    return OBJECTIVES


def _check_objective(obj: dict, prompts: list, mesh: dict, data: dict | None = None) -> None:
    """The objective's own options and the prompts' targets (a drawn data set's come from
    its teacher, which gives moments)."""
    kind = obj["kind"]
    if kind is None:
        extra = [k for k in obj if obj[k] != SCHEMA["objective"][k].default and k != "kind"]
        if extra:
            raise ConfigError(f"objective.{extra[0]}", "given, but objective.kind is missing")
        return
    cls = _objectives()[kind]
    cls.check_config(obj, mesh)
    want = cls.targets
    if not want:
        return
    if data is not None and teacher_given(data):
        if "moments" not in want:
            raise ConfigError("objective.kind", f"a teacher gives moment targets; objective.kind = "
                              f"{kind!r} needs {' or '.join(repr(k) for k in want)} targets")
        teacher = f"data.{'teacher' if data['teacher'] is not None else 'teacher_seed'}"
        given = next((i for i, p in enumerate(prompts) if p["target"] is not None), None)
        if given is not None:
            where = ("data.folder", f"{prompts[given]['target']['path']}: a target file") \
                if data["folder"] is not None else (f"prompts[{given}].target", "given")
            raise ConfigError(where[0], f"{where[1]}, but the targets come from the teacher ({teacher})")
        cloud = next((p for p in prompts if p["kind"] == "points"), None)
        if cloud is not None:
            file = f" ({cloud['path']} has no 'density' array or column)" if data["folder"] is not None else ""
            raise ConfigError(teacher, f"prompt {cloud['name']!r} is a point cloud{file}: a teacher's targets "
                              "come from the mesh model, which needs densities")
        return
    if data is not None and data["count"]:
        raise ConfigError("data.teacher", f"missing: objective.kind = {kind!r} needs targets, which "
                          "a drawn data set takes from a teacher (data.teacher or data.teacher_seed)")
    folder = data is not None and data["folder"] is not None
    for i, p in enumerate(prompts):
        t = p["target"]
        if t is None and folder and want == ("moments",):
            raise ConfigError("data.teacher", f"missing: objective.kind = {kind!r} needs moment targets, "
                              "which a folder data set takes from a teacher (data.teacher or data.teacher_seed)")
        if t is None and folder:
            raise ConfigError("data.folder", f"prompt {p['name']!r} has no target file (targets/"
                              f"{os.path.basename(p['path'])}); objective.kind = {kind!r} needs one "
                              "per prompt, or a teacher (data.teacher or data.teacher_seed)")
        if t is not None and folder and t["kind"] not in want:
            raise ConfigError("data.folder", f"{t['path']}: a {t['kind']!r} target does not fit "
                              f"objective.kind = {kind!r}")
        if t is None:
            what = "{ mean = [...], cov = [...] }" if want == ("moments",) else \
                f"a target with kind = {' or '.join(repr(k) for k in want)}"
            raise ConfigError(f"prompts[{i}].target", f"missing: objective.kind = {kind!r} needs {what}")
        if t["kind"] not in want:
            raise ConfigError(f"prompts[{i}].target", f"a {t['kind']!r} target does not fit objective.kind = {kind!r}")


def _check_train(t: dict, train_prompts: int) -> None:
    """Steps from epochs (or the default 20), the batch against the training prompts,
    noise only with gd."""
    if t["epochs"] is not None:
        if t["steps"] is not None:
            raise ConfigError("train.epochs", "give either train.steps or train.epochs, not both")
        t["steps"] = t["epochs"] * batches_per_epoch(t["batch_size"], train_prompts)
    elif t["steps"] is None:
        t["steps"] = 20
    if t["batch_size"] is not None and t["batch_size"] > train_prompts:
        raise ConfigError("train.batch_size", f"{t['batch_size']} is more than the {train_prompts} "
                                              "training prompt(s)")
    if t["optimizer"] == "gd" and t["lr"] * t["weight_decay"] >= 2:
        raise ConfigError("train.weight_decay", f"lr x weight_decay = {t['lr'] * t['weight_decay']:.3g} "
                          "is 2 or more: the decay step theta <- (1 - lr weight_decay) theta then grows "
                          "the heads instead of shrinking them; lower train.weight_decay or train.lr")
    if t["temperature"] > 0 and t["optimizer"] != "gd":
        raise ConfigError("train.temperature", "Langevin noise needs optimizer = 'gd' (the Euler-Maruyama "
                                               "step of the gradient flow)")


def batches_per_epoch(batch_size: int | None, train_prompts: int) -> int:
    """Minibatches of one pass over the training prompts (the last one may be smaller;
    ``batch_size`` None: one, the full batch)."""
    return -(-train_prompts // (batch_size or train_prompts))


def _check_model(m: dict, data: dict | None = None) -> None:
    if m["init"] == "teacher":
        if data is None or not teacher_given(data):
            raise ConfigError("model.init", "'teacher' needs a teacher (data.teacher or data.teacher_seed)")
        if m["params"] is not None:
            raise ConfigError("model.init", "give either model.params or init = 'teacher', not both")
    elif m["init_noise"] != 0.0:
        raise ConfigError("model.init_noise", "given, but model.init is not 'teacher'")
    if m["params"] is None:
        for k in ("layers", "heads"):
            if m[k] is None:
                raise ConfigError(f"model.{k}", "missing: give model.layers and model.heads, or model.params")
        if m["layers"] * m["heads"] > MAX_HEADS_TOTAL:
            raise ConfigError("model.heads", f"layers x heads = {m['layers'] * m['heads']:.3g} is "
                                             f"more than pdeformer allows ({MAX_HEADS_TOTAL:g})")


# ----------------------------------------------------------------------------------
# overrides and loading


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``'section.key=value'`` -> (path, value). The value is read as a TOML value
    (``3``, ``0.5``, ``true``, ``[64, 64]``, ``"a"``); anything else is a bare string."""
    if "=" not in text:
        raise ConfigError("--set", f"expected section.key=value, got {text!r}")
    lhs, rhs = text.split("=", 1)
    parts: list[str | int] = []
    for tok in re.split(r"\.", lhs.strip()):
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?|(\d+)", tok)
        if not m:
            raise ConfigError("--set", f"bad key {lhs.strip()!r}")
        if m.group(3) is not None:
            parts.append(int(m.group(3)))
        else:
            parts.append(m.group(1))
            if m.group(2) is not None:
                parts.append(int(m.group(2)))
    if len(parts) < 2:
        raise ConfigError("--set", f"expected section.key=value, got {text!r}")
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return parts, value


def apply_override(raw: dict, parts: list, value, cwd: str, base_dir: str) -> None:
    """Set ``raw[parts...] = value``. Paths given on the command line are relative to
    the current directory; they are made relative to the config folder here so that
    :func:`check_config` resolves them like the file's own paths."""
    node = raw
    where = ""
    for i, p in enumerate(parts[:-1]):
        where = f"{where}.{p}" if isinstance(p, str) else f"{where}[{p}]"
        if isinstance(p, int):
            if not isinstance(node, list) or p >= len(node):
                raise ConfigError(where.lstrip("."), "no such entry to override")
            node = node[p]
        else:
            if not isinstance(node, dict):
                raise ConfigError(where.lstrip("."), "not a table")
            node = node.setdefault(p, {} if isinstance(parts[i + 1], str) else [])
    last = parts[-1]
    is_path = (tuple(parts) in PATH_KEYS) or (parts[0] == "prompts" and last == "path")
    if is_path and isinstance(value, str):
        value = os.path.relpath(os.path.join(cwd, value), base_dir)
    if isinstance(last, int):
        raise ConfigError("--set", "the last part of a key must be a name")
    if not isinstance(node, dict):
        raise ConfigError(where.lstrip("."), "not a table")
    node[last] = value


def read_toml(filename: str, what: str = "config file") -> dict:
    """The TOML table of ``filename``; ConfigError (one line naming the file) where it is
    missing, not a regular file (read non-blocking: pdeformer.tools.files), larger than
    a config holds, unreadable, not text or not TOML."""
    from .files import TEXT_FILE, FileError, read_bytes
    try:
        data = read_bytes(filename, "", TEXT_FILE)
    except FileError as e:
        reason = e.reason
        if reason == "no such file":
            reason = f"no such {what}"
        elif reason.endswith(", not a file"):
            reason = reason.replace("not a file", f"not a {what}")
        raise ConfigError("", f"{filename}: {reason}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError("", f"{filename}: not a text file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("", f"{filename}: not valid TOML ({e})") from None


def load_config(filename: str, overrides: list[str] = ()) -> dict:
    """Read, override, check and resolve a run configuration."""
    raw = read_toml(filename)
    base_dir = os.path.dirname(os.path.abspath(filename))
    for text in overrides:
        parts, value = parse_override(text)
        apply_override(raw, parts, value, os.getcwd(), base_dir)
    stem = os.path.splitext(os.path.basename(filename))[0]
    cfg = check_config(raw, base_dir, stem)
    cfg["config_file"] = os.path.abspath(filename)
    cfg["overrides"] = list(overrides)
    return cfg
