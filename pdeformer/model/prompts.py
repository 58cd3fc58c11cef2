"""Prompts: token densities rho_0 on R^d, before they meet the mesh.

Four kinds on a flat mesh, each a small object with ``density(x)`` for points ``x`` of
shape (N, d) (those on a circle or sphere are in :mod:`pdeformer.model.sphere_prompts`;
:func:`make_prompt` picks a kind's builder by the tokens' geometry):

* ``gaussian_mixture``: sum_c pi_c N(m_c, Sigma_c);
* ``uniform``: the uniform density on a box [lower, upper];
* ``file``: density values given at points, interpolated linearly (zero outside the
  data's convex hull). Format: ``.npz`` with arrays ``points`` (n, d) and ``density``
  (n,), or ``.csv`` with a header ``x0,...,x{d-1},density`` and one row per point;
* ``points``: a point cloud, its own tokens (:mod:`pdeformer.model.prompt_files`).

The closed-form kinds also give a UFL expression (``ufl_density``) so the projection
onto the mesh integrates the exact function; mixtures also give it in parts of a bounded
number of components (``ufl_parts``), so that any number of them projects with one small
form. Shapes are checked against the token dimension d here, with errors naming the
config key (``prompts[1].covs[0]``).
"""

from __future__ import annotations

import importlib
import math
from typing import Callable, NamedTuple

import numpy as np

from ..tools.errors import ConfigError
from ..tools.keys import REQUIRED, Key, array, path
from .geometry import GEOMETRIES, Flat, Geometry
from .prompt_files import PointCloud, PointDensity, normalised


# A Gaussian whose standard deviation (in its narrowest direction) is below this fraction
# of the mesh's shortest cell edge cannot be projected onto the mesh: the quadrature of the
# projection (degree 2k + 4) misses or multiplies its mass. Measured projected mass errors
# of one Gaussian (DG-1..3; intervals, triangles, quadrilaterals, tetrahedra): 1e-5..5e-3 at
# sigma = h/4, 1e-4..1.5e-2 at h/5, 1.5e-2..0.19 at h/8, 6e-2..0.41 at h/10.
MIN_SIGMA_CELLS = 1.0 / 8


def balanced_sum(terms: list):
    """The sum of ``terms`` (numbers, numpy arrays or UFL expressions), added in pairs
    level by level: an expression tree of depth log2(n) rather than a chain of depth n,
    which UFL walks recursively (a chain of 1000 terms exceeds Python's recursion limit)."""
    terms = list(terms)
    while len(terms) > 1:
        pairs = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)]
        terms = pairs + terms[len(pairs) * 2:]
    return terms[0]


# Components of a mixture in one UFL expression: a mixture of more is projected onto the
# mesh in parts of this many (DensityParts), so that its form, compiled once, stays small
# whatever the number of components (one expression of n terms took 41 s to compile at
# n = 1000, and minutes at 3000).
UFL_CHUNK = 32


class DensityParts(NamedTuple):
    """A density as a sum of parts with one UFL ``expression``: ``load(i)`` sets the
    expression's parameters (dolfinx Constants) to those of part i, i < ``count``."""
    expression: object
    count: int
    load: Callable[[int], None]


def mixture_parts(term: Callable, params: list, const) -> DensityParts:
    """sum_c term(*params_c) over the components c (the leading axis of every array of
    ``params``) as :class:`DensityParts` of up to UFL_CHUNK components. ``const`` makes a
    terminal of a value (a dolfinx Constant, whose value ``load`` sets; with literals
    the sum must fit one part). The last part is padded with components whose parameters
    are all 0, so ``term`` must vanish there (its first parameter a weight)."""
    n = len(params[0])
    size = min(n, UFL_CHUNK)
    count = -(-n // size)
    padded = [np.concatenate([p, np.zeros((count * size - n,) + p.shape[1:])]) for p in params]
    terminals = [[const(p[c]) for p in padded] for c in range(size)]

    def load(i: int) -> None:
        for c, row in enumerate(terminals):
            for t, p in zip(row, padded):
                t.value = p[i * size + c]
    return DensityParts(balanced_sum([term(*row) for row in terminals]), count, load)


def narrowest(widths: np.ndarray, cell: float) -> int | None:
    """The narrowest component if its width is below MIN_SIGMA_CELLS x ``cell``, else None."""
    c = int(np.argmin(widths))
    return c if widths[c] < MIN_SIGMA_CELLS * cell else None


class GaussianMixture:
    kind = "gaussian_mixture"

    def __init__(self, weights, means, covs):
        self.weights = normalised(weights)
        self.means = np.asarray(means, float)
        self.covs = np.asarray(covs, float)
        self.precisions = np.linalg.inv(self.covs)
        d = self.means.shape[1]
        # through log det: a determinant beyond the doubles' range gives norms 0 or inf
        # quietly (such a component is refused where it meets the mesh: unresolved)
        log_det = np.linalg.slogdet(self.covs)[1]
        with np.errstate(over="ignore"):
            self.norms = self.weights * np.exp(-0.5 * (d * math.log(2 * math.pi) + log_det))

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    def density(self, x: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(x)
        out = np.zeros(x.shape[0])
        for c, P, m in zip(self.norms, self.precisions, self.means):
            r = x - m
            out += c * np.exp(-0.5 * np.einsum("ni,ij,nj->n", r, P, r))
        return out

    def ufl_density(self, x, const=None):
        """The density as a UFL expression of x. ``const`` turns parameter arrays into
        UFL terminals (e.g. dolfinx Constants, so one compiled form serves all values);
        by default they become literals."""
        import ufl
        const = const or _literal
        terms = []
        for c, P, m in zip(self.norms, self.precisions, self.means):
            r = x - const(m)
            terms.append(const(c) * ufl.exp(-0.5 * ufl.dot(r, const(P) * r)))
        return balanced_sum(terms)

    def ufl_parts(self, x, const) -> DensityParts:
        """The density as :class:`DensityParts` of x (``const``: dolfinx Constants), for
        projecting a mixture of any number of components with one small form."""
        import ufl

        def term(c, m, P):
            r = x - m
            return c * ufl.exp(-0.5 * ufl.dot(r, P * r))
        return mixture_parts(term, [self.norms, self.means, self.precisions], const)

    def total_mass(self) -> float:
        return 1.0

    def unresolved(self, cell: float, key: str) -> ConfigError | None:
        """The error for a component too narrow for a mesh of shortest cell edge ``cell``
        (standard deviation below MIN_SIGMA_CELLS x cell in its narrowest direction):
        the mesh cannot resolve it, whatever part of its mass the projection shows.
        ``key``: the prompt's (``prompts[0]``); the error names the component's cov."""
        sigma = np.sqrt(np.linalg.eigvalsh(self.covs)[:, 0])
        c = narrowest(sigma, cell)
        if c is None:
            return None
        return ConfigError(f"{key}.covs[{c}]", f"standard deviation {sigma[c]:.3g} (in its narrowest "
                           f"direction) is below 1/{1 / MIN_SIGMA_CELLS:g} of the mesh's cell size "
                           f"{cell:.3g}: the mesh cannot resolve this Gaussian (projected onto it, "
                           "its mass comes out wrong by percents or all of it); use cells of at "
                           f"most {sigma[c] / MIN_SIGMA_CELLS:.3g} or a wider covariance")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n tokens drawn from the mixture."""
        comp = rng.choice(len(self.weights), size=n, p=self.weights)
        z = rng.standard_normal((n, self.dim))
        chol = np.linalg.cholesky(self.covs)
        return self.means[comp] + np.einsum("nij,nj->ni", chol[comp], z)

    def mean(self) -> np.ndarray:
        return self.weights @ self.means

    def cov(self) -> np.ndarray:
        m = self.mean()
        second = np.einsum("c,cij->ij", self.weights, self.covs) \
            + np.einsum("c,ci,cj->ij", self.weights, self.means, self.means)
        return second - np.outer(m, m)


class UniformBox:
    kind = "uniform"

    def __init__(self, lower, upper):
        self.lower = np.asarray(lower, float)
        self.upper = np.asarray(upper, float)
        self.height = 1.0 / float(np.prod(self.upper - self.lower))

    @property
    def dim(self) -> int:
        return self.lower.shape[0]

    def density(self, x: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(x)
        inside = np.all((x >= self.lower) & (x <= self.upper), axis=1)
        return np.where(inside, self.height, 0.0)

    def ufl_density(self, x, const=None):
        import ufl
        const = const or _literal
        lo, hi = const(self.lower), const(self.upper)
        cond = None
        for a in range(self.dim):
            c = ufl.And(ufl.ge(x[a], lo[a]), ufl.le(x[a], hi[a]))
            cond = c if cond is None else ufl.And(cond, c)
        return ufl.conditional(cond, const(self.height), 0.0)

    def total_mass(self) -> float:
        return 1.0

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.lower + (self.upper - self.lower) * Flat(self.dim).sample_uniform(n, rng)

    def mass_inside(self, lower, upper) -> float:
        """Exact mass of the box [lower, upper] (the overlap of two boxes)."""
        overlap = np.clip(np.minimum(self.upper, upper) - np.maximum(self.lower, lower), 0, None)
        return float(np.prod(overlap) * self.height)

    def mean(self) -> np.ndarray:
        return 0.5 * (self.lower + self.upper)

    def cov(self) -> np.ndarray:
        return np.diag((self.upper - self.lower) ** 2 / 12.0)


def _literal(a):
    """numpy scalar/vector/matrix -> UFL literal."""
    import ufl
    a = np.asarray(a, float)
    if a.ndim == 0:
        return float(a)
    if a.ndim == 1:
        return ufl.as_vector([float(v) for v in a])
    return ufl.as_matrix([[float(v) for v in row] for row in a])


# ----------------------------------------------------------------------------------
# from a checked [[prompts]] table


def vector_list(key: str, value, d: int) -> np.ndarray:
    """A config value as an (n, d) array of vectors (1-D: numbers); ConfigError naming key."""
    a = np.asarray(value, float) if is_rectangular(value) else None
    if a is not None and d == 1 and a.ndim == 1:
        a = a[:, None]
    if a is None or a.ndim != 2 or a.shape[1] != d:
        raise ConfigError(key, f"expected a list of {d}-vectors (d = {d}), got {value!r}")
    return a


def is_rectangular(value) -> bool:
    """Whether a config value (nested lists) makes a numeric array."""
    try:
        np.asarray(value, float)
        return True
    except ValueError:
        return False


def spd_matrix(key: str, value, d: int) -> np.ndarray:
    """A covariance from a config value: a variance (times I) or a symmetric positive
    definite d x d matrix; ConfigError naming key."""
    if isinstance(value, float):
        if value <= 0:
            raise ConfigError(key, f"a variance must be positive, got {value}")
        return value * np.eye(d)
    a = np.asarray(value, float) if is_rectangular(value) else None
    if a is None or a.shape != (d, d):
        raise ConfigError(key, f"expected a {d}x{d} matrix or a variance, got {value!r}")
    if not np.allclose(a, a.T, rtol=1e-12, atol=1e-14 * np.abs(a).max()):
        raise ConfigError(key, "covariance is not symmetric")
    try:
        np.linalg.cholesky(a)
    except np.linalg.LinAlgError:
        raise ConfigError(key, "covariance is not positive definite") from None
    return a


def checked_weights(key: str, given, n: int, what: str) -> np.ndarray:
    """The weights of n parts (default equal), checked: ConfigError naming ``key``."""
    w = np.ones(n) if given is None else (np.asarray(given, float) if is_rectangular(given) else None)
    if w is None or w.shape != (n,):
        raise ConfigError(key, f"expected {n} numbers (one per {what}), got {given!r}")
    return w


def _foreign_kind(kind: str, hint: str):
    """The builder of another geometry's kind: a ConfigError saying where it belongs."""
    def refuse(spec: dict, d: int, key: str, geometry):
        raise ConfigError(f"{key}.kind", f"{kind!r} is a density on {hint}")
    return refuse


def _gaussian_mixture(spec: dict, d: int, key: str, geometry):
    means = vector_list(f"{key}.means", spec["means"], d)
    n = means.shape[0]
    covs = spec["covs"]
    if len(covs) != n:
        raise ConfigError(f"{key}.covs", f"expected {n} covariances (one per mean), got {len(covs)}")
    covs = np.array([spd_matrix(f"{key}.covs[{c}]", v, d) for c, v in enumerate(covs)])
    w = checked_weights(f"{key}.weights", spec["weights"], n, "mean")
    if np.any(w <= 0):
        raise ConfigError(f"{key}.weights", "weights must be positive")
    return GaussianMixture(w, means, covs)


def _uniform(spec: dict, d: int, key: str, geometry):
    for name in ("lower", "upper"):
        if spec[name] is None:
            raise ConfigError(f"{key}.{name}", "missing (required on a flat mesh)")
    lo = np.asarray(spec["lower"], float) if is_rectangular(spec["lower"]) else None
    hi = np.asarray(spec["upper"], float) if is_rectangular(spec["upper"]) else None
    for name, a in (("lower", lo), ("upper", hi)):
        if a is None or a.shape != (d,):
            raise ConfigError(f"{key}.{name}", f"expected {d} numbers (d = {d}), got {spec[name]!r}")
    for a in range(d):
        if not hi[a] > lo[a]:
            raise ConfigError(f"{key}.upper", f"upper[{a}] = {hi[a]} is not above lower[{a}] = {lo[a]}")
    return UniformBox(lo, hi)


def _file(spec: dict, d: int, key: str, geometry):
    return PointDensity.read(spec["path"], d, f"{key}.path")


def _points(spec: dict, d: int, key: str, geometry):
    return point_cloud(spec, d, key)


def point_cloud(spec: dict, d: int, key: str) -> "PointCloud":
    """A ``points`` table's cloud: its file, or its points and weights, checked."""
    if spec["path"] is not None:
        return PointCloud.read(spec["path"], d, f"{key}.path")
    points = vector_list(f"{key}.points", spec["points"], d)
    w = checked_weights(f"{key}.weights", spec["weights"], len(points), "point")
    if np.any(w < 0) or not np.any(w > 0):
        raise ConfigError(f"{key}.weights", "weights must be >= 0 with a positive sum")
    if not (np.all(np.isfinite(points)) and np.all(np.isfinite(w))):
        raise ConfigError(f"{key}.points", "non-finite values")
    return PointCloud(points, w)


class PromptKind(NamedTuple):
    """A prompt kind as the configuration knows it: the keys of its ``[[prompts]]``
    table (or of a target of the kind) beside ``kind``, ``name`` and ``target``, and the
    sort of target it is to an objective (:attr:`pdeformer.model.objectives.Objective.targets`):
    "density", "points", or None where it fits no objective."""

    keys: dict[str, Key]
    target: str | None = None


# The prompt kinds of R^d, in the order the configuration lists kinds (those of a
# circle or sphere: pdeformer.model.sphere_prompts.SPHERE_PROMPTS). A new kind is its
# keys here or there and a builder in the tables of prompt_kinds.
FLAT_PROMPTS = {
    "gaussian_mixture": PromptKind({
        "weights": Key(array, None, "mixture weights (positive; normalised)"),
        "means": Key(array, REQUIRED, "component means, one d-vector each"),
        "covs": Key(array, REQUIRED, "component covariances: d x d matrices or variances"),
    }, target="density"),
    "uniform": PromptKind({
        "lower": Key(array, None, "lower corner of the box (flat meshes; not on a sphere)"),
        "upper": Key(array, None, "upper corner of the box"),
    }, target="density"),
    "file": PromptKind({
        "path": Key(path, REQUIRED, ".npz (points, density) or .csv (x0..,density)"),
    }, target="density"),
    "points": PromptKind({
        "path": Key(path, None, ".npz (points, weights) or .csv (x0..[,weight]): a point cloud"),
        "points": Key(array, None, "the points, d-vectors (instead of path)"),
        "weights": Key(array, None, "with points: their weights (default equal; normalised)"),
    }, target="points"),
}

# prompt kind -> its builder (spec, d, key, geometry) on a flat mesh; a sphere's are
# pdeformer.model.sphere_prompts.SPHERE_KINDS, and the kinds only a sphere has are
# refused here (prompt_kinds).
FLAT_KINDS = {"gaussian_mixture": _gaussian_mixture, "uniform": _uniform, "file": _file, "points": _points}
KINDS, PROMPTS = FLAT_KINDS, FLAT_PROMPTS   # this family's (Geometry.prompt_module)


def family_kinds(space: type) -> tuple[dict, dict]:
    """(builders, declared keys) of the prompt kinds of a geometry class's family: the
    ``KINDS`` and ``PROMPTS`` of its ``prompt_module``."""
    module = importlib.import_module(f"{__package__}.{space.prompt_module}")
    return module.KINDS, module.PROMPTS


def prompt_kinds(geometry: Geometry) -> dict:
    """The builders of the prompt kinds on the geometry: its family's, and for another
    family's kinds that it lacks, a ConfigError saying where they belong."""
    kinds = dict(family_kinds(type(geometry))[0])
    for space in GEOMETRIES:
        if space.family != geometry.family and space.kinds_hint is not None:
            for k in family_kinds(space)[0]:
                kinds.setdefault(k, _foreign_kind(k, space.kinds_hint))
    return kinds


def make_prompt(spec: dict, d: int, index: int, key: str | None = None, geometry: Geometry | None = None):
    """Build the density object of a checked ``[[prompts]]`` table (or of a density
    target, whose errors name ``key``) for dimension d; ``geometry``: the tokens' space
    (:mod:`pdeformer.model.geometry`; default flat R^d)."""
    key = key or f"prompts[{index}]"
    geometry = Flat(d) if geometry is None else geometry
    kinds = prompt_kinds(geometry)
    if spec["kind"] not in kinds:
        raise ConfigError(f"{key}.kind", f"unknown kind {spec['kind']!r}")
    return kinds[spec["kind"]](spec, d, key, geometry)
