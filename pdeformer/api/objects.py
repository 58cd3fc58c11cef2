"""The objects of the Python API: meshes, the model, prompts, discretisations, objectives.

Each is a small value object that says what it is; :mod:`pdeformer.api.solve` turns them
into a problem and solves it. Their checks are the run configuration's (the same
one-line errors, naming the configuration key the argument stands for).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..model.geometry import Geometry, geometry_of_config
from mpi4py import MPI

from ..model.heads import ARRAYS, BLOCK, HeadMeasure, draw_heads
from ..model.schema import SCHEMA, SECTIONS
from ..model.terms import build_terms, checked_arrays, term_classes
from ..tools.errors import ConfigError
from ..tools.keys import check_table


def _list(a) -> list:
    """A nested list of floats (numpy arrays and tuples welcome)."""
    return np.asarray(a, dtype=float).tolist()


# ------------------------------------------------------------------ meshes

class Mesh:
    """A token domain; :meth:`section` is its ``[mesh]`` table."""

    def section(self) -> dict:
        raise NotImplementedError

    @property
    def geometry(self) -> Geometry | None:
        """The tokens' space the mesh states (:mod:`pdeformer.model.geometry`: flat R^d,
        a circle or a sphere); None for a mesh file, whose points decide."""
        return geometry_of_config(self.section())


@dataclass(frozen=True)
class BoxMesh(Mesh):
    """The box [lower, upper] of R^d (d = 1, 2, 3) in ``cells`` cells per direction:
    intervals, triangles (default in 2-D) or quadrilaterals, tetrahedra (default in 3-D)
    or hexahedra (``cell``)."""

    lower: list
    upper: list
    cells: list
    cell: str | None = None

    def section(self) -> dict:
        out = {"lower": _list(self.lower), "upper": _list(self.upper), "cells": [int(c) for c in self.cells]}
        return out | ({"cell": self.cell} if self.cell else {})


@dataclass(frozen=True)
class CircleMesh(Mesh):
    """The circle ``|x| = radius`` in R^2, in ``cells`` intervals."""

    cells: int
    radius: float = 1.0

    def section(self) -> dict:
        return {"shape": "circle", "cells": [int(self.cells)], "radius": float(self.radius)}


@dataclass(frozen=True)
class SphereMesh(Mesh):
    """The sphere ``|x| = radius`` in R^3: the icosahedron refined ``refinements`` times
    (20 * 4^r triangles)."""

    refinements: int
    radius: float = 1.0

    def section(self) -> dict:
        return {"shape": "sphere", "refinements": int(self.refinements), "radius": float(self.radius)}


@dataclass(frozen=True)
class MeshFile(Mesh):
    """An XDMF mesh file (its grid ``name``), flat or a circle or sphere."""

    path: str
    name: str = "mesh"

    def section(self) -> dict:
        return {"file": os.path.abspath(self.path), "name": self.name}


# ------------------------------------------------------------------ the model

@dataclass
class Transformer:
    """A model: its parameter tree ``params`` and the softmax's ``beta``.

    ``params["attention"]`` holds the heads, Q (L, H, k, d), K (L, H, k, d) and
    V (L, H, d, d), and optionally their fixed ``weights`` (L, H), >= 0 and summing to 1
    over each layer (default 1/H; kept as :attr:`weights`, not trained); layer l's
    attention velocity is

        v(x) = sum_h w_h V_h grad Lambda_rho(beta A_h x),   A_h = K_h^T Q_h,

    on the depth interval [l/L, (l+1)/L) (docs/model.md). Any other block is a
    registered token-wise term's (pdeformer.model.terms), added to that velocity;
    ``options`` are the ``[model]`` keys of those terms that are not arrays."""

    params: dict
    beta: float = 1.0
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.params, dict) or BLOCK not in self.params:
            raise ConfigError("model.params", f"expected a tree {{{BLOCK!r}: {{{', '.join(map(repr, ARRAYS))}}}, ...}}")
        terms = {cls.block: cls for cls in term_classes()}
        for block in self.params:
            if block != BLOCK and block not in terms:
                raise ConfigError("model.params", f"unknown block {block!r} (known: {', '.join([BLOCK, *terms])})")
        self._heads = HeadMeasure.checked_block(self.params[BLOCK], "model.params")
        tree, opts = {BLOCK: self._heads.params}, self.model_options()
        for block, arrays in self.params.items():
            if block != BLOCK:
                key = f"model.params.{block}"
                arrays = checked_arrays(block, arrays, key, self.layers)
                tree[block] = terms[block].from_arrays(arrays, opts, self.dim).params
        self.params = tree

    @classmethod
    def random(cls, layers: int, heads: int, dim: int, seed: int = 0, key_dim: int | None = None,
               init_scale: float = 1.0, query_scale: float | None = None, depth: str = "iid",
               beta: float = 1.0, **options) -> "Transformer":
        """Heads drawn as ``[model]`` draws them: entries of K, V ~ N(0, init_scale^2 / d),
        of Q ~ N(0, query_scale^2 / d) (plus ``query_mean``, ``key_mean``, ``value_mean``
        where given; ``law="atoms", atoms=FILE``: i.i.d. draws from a file's atoms), head
        (l, h) from its own stream (``depth = "iid"``) or linear in depth (``"smooth"``);
        the same heads on any rank count.
        ``options``: ``[model]`` keys of the token-wise terms; each term the options
        call for is drawn as ``[model]`` draws it (from ``seed``)."""
        drawn = model_options({"layers": layers, "heads": heads, "key_dim": key_dim, "seed": seed,
                               "init_scale": init_scale, "query_scale": query_scale, "depth": depth, **options})
        h = draw_heads(drawn, dim)
        params = {BLOCK: h.params}
        for term in build_terms(drawn, dim, MPI.COMM_SELF):
            params[term.block] = term.params
        return cls(params, beta, options)

    @property
    def weights(self) -> np.ndarray | None:
        """The heads' weights (L, H), None where they are averaged with weight 1/H."""
        return self._heads.weights

    def problem_params(self) -> dict:
        """The parameter tree with the heads' weights in their block, as a problem is
        built from it (copies: solving never changes the model)."""
        tree = {b: {n: np.array(a) for n, a in arrays.items()} for b, arrays in self.params.items()}
        tree[BLOCK].update(self._heads.files())
        return tree

    def model_options(self):
        """The ``[model]`` options of this model (checked: errors name ``model.<key>``)."""
        return model_options({"layers": self.layers, "heads": self.heads, "key_dim": self.key_dim, **self.options})

    @property
    def layers(self) -> int:
        return self._heads.layers

    @property
    def heads(self) -> int:
        return self._heads.heads

    @property
    def key_dim(self) -> int:
        return self._heads.key_dim

    @property
    def dim(self) -> int:
        return self._heads.dim


def model_options(table: dict):
    """A ``[model]`` table as its checked options (model/schema.py's ModelOptions; None
    values: the defaults)."""
    table = {k: v for k, v in table.items() if v is not None}
    return SECTIONS["model"](**check_table("model", table, SCHEMA["model"]))


# ------------------------------------------------------------------ prompts

class Prompt:
    """A token density (or point cloud); :meth:`table` is its ``[[prompts]]`` table."""

    kind = ""
    name: str | None = None

    def table(self) -> dict:
        keys = {k: v for k, v in self._values().items() if v is not None}
        return {"kind": self.kind, **({"name": self.name} if self.name else {}), **keys}

    def _values(self) -> dict:
        raise NotImplementedError


@dataclass
class GaussianMixture(Prompt):
    """sum_k w_k N(means_k, covs_k): covariances as d x d matrices or variances; the
    weights are normalised (default equal)."""

    means: list
    covs: list
    weights: list | None = None
    name: str | None = None
    kind = "gaussian_mixture"

    def _values(self):
        return {"means": _list(self.means), "covs": _list(self.covs),
                "weights": None if self.weights is None else _list(self.weights)}


@dataclass
class Uniform(Prompt):
    """The uniform density on the box [lower, upper] (flat meshes; default: the mesh's
    box) or on a circle or sphere."""

    lower: list | None = None
    upper: list | None = None
    name: str | None = None
    kind = "uniform"

    def _values(self):
        return {"lower": None if self.lower is None else _list(self.lower),
                "upper": None if self.upper is None else _list(self.upper)}


@dataclass
class Points(Prompt):
    """A point cloud: ``points`` (n, d) with ``weights`` (default equal), or a file
    (``path``: .npz with points and weights, or .csv)."""

    points: list | None = None
    weights: list | None = None
    path: str | None = None
    name: str | None = None
    kind = "points"

    def _values(self):
        return {"points": None if self.points is None else _list(self.points),
                "weights": None if self.weights is None else _list(self.weights),
                "path": None if self.path is None else os.path.abspath(self.path)}


@dataclass
class DensityFile(Prompt):
    """Density values at points (.npz with points and density, or .csv), interpolated."""

    path: str
    name: str | None = None
    kind = "file"

    def _values(self):
        return {"path": os.path.abspath(self.path)}


@dataclass
class VonMisesFisher(Prompt):
    """A mixture of von Mises-Fisher densities on a circle or sphere: mean directions
    and concentrations kappa."""

    means: list
    concentrations: list
    weights: list | None = None
    name: str | None = None
    kind = "von_mises_fisher"

    def _values(self):
        return {"means": _list(self.means), "concentrations": _list(self.concentrations),
                "weights": None if self.weights is None else _list(self.weights)}


@dataclass
class Harmonics(Prompt):
    """``rho = (1 + sum c Y_lm) / |S|`` on a circle or sphere: ``coefficients`` [[l, m, c], ...]."""

    coefficients: list
    name: str | None = None
    kind = "harmonics"

    def _values(self):
        return {"coefficients": _list(self.coefficients)}


# ------------------------------------------------------------------ discretisations

@dataclass
class DG:
    """The density on ``mesh`` in discontinuous Galerkin of ``degree`` (1-3), SSP
    Runge-Kutta in depth with CFL steps (``cfl``) or ``steps_per_layer``, the positivity
    ``limiter``; further ``[discretisation]`` keys as keywords (``options``)."""

    mesh: Mesh
    degree: int = 1
    limiter: bool = True
    cfl: float = 0.5
    steps_per_layer: int | None = None
    options: dict = field(default_factory=dict)

    def sections(self) -> dict:
        disc = {"degree": self.degree, "limiter": self.limiter, "cfl": self.cfl, **self.options}
        if self.steps_per_layer is not None:
            disc["steps_per_layer"] = self.steps_per_layer
        return {"mesh": self.mesh.section(), "discretisation": disc}


@dataclass
class Particles:
    """The particle model: ``tokens`` drawn from every prompt (``seed``: the same tokens
    on any rank count), ``steps_per_layer`` SSP steps per layer; on a circle or sphere
    give its ``mesh`` (the tokens live on it), in flat space it may be left out."""

    tokens: int = 10000
    seed: int = 0
    steps_per_layer: int | None = None
    mesh: Mesh | None = None

    def sections(self, prompts) -> dict:
        part = {"tokens": self.tokens, "seed": self.seed, "points": False}
        if self.steps_per_layer is not None:
            part["steps_per_layer"] = self.steps_per_layer
        return {"mesh": (self.mesh or _holding_box(prompts)).section(), "particles": part}


def _holding_box(prompts) -> BoxMesh:
    """A one-cell box holding the prompts (flat particle runs need no mesh; the problem's
    objects are built on one)."""
    points = []
    for p in prompts:
        t = p.table()
        for key in ("means", "points", "lower", "upper"):
            if t.get(key) is not None:
                points.append(np.atleast_2d(np.asarray(t[key], float)))
        if t.get("covs") is not None:
            spread = 8 * np.sqrt(np.max(np.abs(np.asarray(t["covs"], float))))
            points.append(np.atleast_2d(np.asarray(t["means"], float)) + spread)
            points.append(np.atleast_2d(np.asarray(t["means"], float)) - spread)
    if not points:
        raise ConfigError("mesh", "give the particles a mesh (Particles(mesh=...)) for prompts read from files")
    x = np.concatenate(points)
    lo, hi = x.min(axis=0), x.max(axis=0)
    pad = 0.5 * np.maximum(hi - lo, 1.0)
    return BoxMesh(lower=lo - pad, upper=hi + pad, cells=[1] * x.shape[1])


# ------------------------------------------------------------------ objectives

class Objective:
    """A risk F(rho_1) per prompt; :meth:`section` is its ``[objective]`` table and
    :meth:`target` the ``target`` table it gives every prompt."""

    kind = ""

    def section(self) -> dict:
        return {"kind": self.kind}

    def target(self) -> dict | None:
        return None


@dataclass
class Moments(Objective):
    """F = ``1/2 |mean - mean*|^2 + 1/2 |cov - cov*|_F^2`` (cov*: a matrix or a variance)."""

    mean: list
    cov: list | float
    kind = "moments"

    def target(self):
        return {"mean": _list(self.mean), "cov": _list(self.cov)}


@dataclass
class Potential(Objective):
    """F = int U rho_1: U quadratic (``weight |x - center|^2``), linear (``<direction, x>``)
    or gaussian (``weight exp(-|x - center|^2 / (2 width^2))``)."""

    potential: str = "quadratic"
    center: list | None = None
    direction: list | None = None
    weight: float = 1.0
    width: float = 1.0
    kind = "potential"

    def section(self):
        out = {"kind": self.kind, "potential": self.potential, "weight": self.weight, "width": self.width}
        return out | {k: _list(v) for k, v in (("center", self.center), ("direction", self.direction))
                      if v is not None}


@dataclass
class Interaction(Objective):
    """F = 1/2 int int W(x - y) rho_1(x) rho_1(y): W gaussian or coulomb (softened)."""

    interaction: str = "gaussian"
    weight: float = 1.0
    width: float = 1.0
    softening: float = 0.1
    kind = "interaction"

    def section(self):
        return {"kind": self.kind, "interaction": self.interaction, "weight": self.weight,
                "width": self.width, "softening": self.softening}


@dataclass
class L2(Objective):
    """F = 1/2 int (rho_1 - rho*)^2 against a target density (a prompt object)."""

    target_density: Prompt
    kind = "l2"

    def target(self):
        t = self.target_density.table()
        t.pop("name", None)
        return t


@dataclass
class MMD(Objective):
    """F = 1/2 ||rho_1 - rho*||^2 in the Gaussian kernel of ``bandwidth`` against a
    target density or point cloud (a prompt object)."""

    target_density: Prompt
    bandwidth: float
    kind = "mmd"

    def section(self):
        return {"kind": self.kind, "bandwidth": self.bandwidth}

    def target(self):
        t = self.target_density.table()
        t.pop("name", None)
        return t
