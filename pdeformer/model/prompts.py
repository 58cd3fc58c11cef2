"""Prompts: token densities rho_0 on R^d, before they meet the mesh.

Three kinds, each a small object with ``density(x)`` for points ``x`` of shape (N, d):

* ``gaussian_mixture``: sum_c pi_c N(m_c, Sigma_c);
* ``uniform``: the uniform density on a box [lower, upper];
* ``file``: density values given at points, interpolated linearly (zero outside the
  data's convex hull). Format: ``.npz`` with arrays ``points`` (n, d) and ``density``
  (n,), or ``.csv`` with a header ``x0,...,x{d-1},density`` and one row per point.

The closed-form kinds also give a UFL expression (``ufl_density``) so the projection
onto the mesh integrates the exact function. Shapes are checked against the token
dimension d here, with errors naming the config key (``prompts[1].covs[0]``).
"""

from __future__ import annotations

import csv
import math
import os

import numpy as np

from ..tools.errors import ConfigError, InputError


def normalised(weights) -> np.ndarray:
    """Weights divided by their sum, scaled by their largest first (so that a sum of
    weights near the largest double does not overflow to inf and give zeros)."""
    w = np.asarray(weights, float)
    w = w / np.abs(w).max()
    return w / np.sum(w)


# A Gaussian whose standard deviation (in its narrowest direction) is below this fraction
# of the mesh's shortest cell edge cannot be projected onto the mesh: the quadrature of the
# projection (degree 2k + 4) misses or multiplies its mass. Measured projected mass errors
# of one Gaussian (DG-1..3; intervals, triangles, quadrilaterals, tetrahedra): 1e-5..5e-3 at
# sigma = h/4, 1e-4..1.5e-2 at h/5, 1.5e-2..0.19 at h/8, 6e-2..0.41 at h/10.
MIN_SIGMA_CELLS = 1.0 / 8


class GaussianMixture:
    kind = "gaussian_mixture"

    def __init__(self, weights, means, covs):
        self.weights = normalised(weights)
        self.means = np.asarray(means, float)
        self.covs = np.asarray(covs, float)
        self.precisions = np.linalg.inv(self.covs)
        d = self.means.shape[1]
        self.norms = self.weights / np.sqrt((2 * math.pi) ** d * np.linalg.det(self.covs))

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
        return sum(terms[1:], terms[0])

    def total_mass(self) -> float:
        return 1.0

    def unresolved(self, cell: float, key: str) -> ConfigError | None:
        """The error for a component too narrow for a mesh of shortest cell edge ``cell``
        (standard deviation below MIN_SIGMA_CELLS x cell in its narrowest direction):
        the mesh cannot resolve it, whatever part of its mass the projection shows.
        ``key``: the prompt's (``prompts[0]``); the error names the component's cov."""
        sigma = np.sqrt(np.linalg.eigvalsh(self.covs)[:, 0])
        c = int(np.argmin(sigma))
        if sigma[c] >= MIN_SIGMA_CELLS * cell:
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
        return self.lower + (self.upper - self.lower) * rng.random((n, self.dim))

    def mass_inside(self, lower, upper) -> float:
        """Exact mass of the box [lower, upper] (the overlap of two boxes)."""
        overlap = np.clip(np.minimum(self.upper, upper) - np.maximum(self.lower, lower), 0, None)
        return float(np.prod(overlap) * self.height)

    def mean(self) -> np.ndarray:
        return 0.5 * (self.lower + self.upper)

    def cov(self) -> np.ndarray:
        return np.diag((self.upper - self.lower) ** 2 / 12.0)


class PointCloud:
    """A discrete measure sum_j w_j delta_{y_j} (a prompt of the particle model and of
    the NTK test, a target for mmd): inline, or .npz with ``points`` (n, d) and optional
    ``weights`` (n,), or .csv with header ``x0,...,x{d-1}[,weight]``; weights normalised.
    It has no density, so the mesh solvers do not take it as a prompt."""

    kind = "points"
    ufl_density = None

    def __init__(self, points, weights):
        self.points = np.asarray(points, float)
        self.weights = normalised(weights)

    @property
    def dim(self) -> int:
        return self.points.shape[1]

    def mean(self) -> np.ndarray:
        return self.weights @ self.points

    def cov(self) -> np.ndarray:
        r = self.points - self.mean()
        return np.einsum("j,ja,jb->ab", self.weights, r, r)

    @classmethod
    def read(cls, filename: str, dim: int, key: str) -> "PointCloud":
        try:
            points, weights = _read_point_data(filename, dim, "weights", "weight", required=False)
        except InputError as e:
            raise InputError(f"{key}: {e}") from None
        if weights is None:
            weights = np.ones(points.shape[0])
        if np.any(weights < 0) or not np.any(weights > 0):
            raise InputError(f"{key}: {filename}: weights must be >= 0 with a positive sum")
        return cls(points, weights)


def _read_point_data(filename, dim, npz_name, csv_name, required=True):
    """points (n, d) and values (n,) (or None when optional and absent) from .npz/.csv."""
    if not os.path.isfile(filename):
        raise InputError(f"{filename}: no such file")
    try:
        if filename.endswith(".npz"):
            with np.load(filename, allow_pickle=False) as f:
                if "points" not in f.files or (required and npz_name not in f.files):
                    raise InputError(f"{filename}: needs arrays 'points' (n,d)"
                                     + (f" and '{npz_name}' (n,)" if required else ""))
                points = np.array(f["points"], float)
                values = np.array(f[npz_name], float) if npz_name in f.files else None
        elif filename.endswith(".csv"):
            with open(filename, newline="") as f:
                rows = list(csv.reader(f))
            header = [h.strip() for h in rows[0]] if rows else []
            coords = [f"x{a}" for a in range(dim)]
            if header not in (coords + [csv_name],) + (() if required else (coords,)):
                want = ",".join(coords + [csv_name])
                raise InputError(f"{filename}: header must be {want}, got {','.join(header)}")
            data = np.array([[float(v) for v in r] for r in rows[1:] if r], float).reshape(-1, len(header))
            points = data[:, :dim]
            values = data[:, dim] if len(header) > dim else None
        else:
            raise InputError(f"{filename}: unknown file type (use .npz or .csv)")
    except InputError:
        raise
    except Exception as e:  # a damaged file can fail in zipfile, zlib, numpy, csv, ...
        raise InputError(f"{filename}: cannot read ({type(e).__name__}: {e})") from None
    if points.ndim == 1 and dim == 1:
        points = points[:, None]
    if points.ndim != 2 or points.shape[1] != dim or (values is not None and values.shape != (points.shape[0],)):
        raise InputError(f"{filename}: points {points.shape} do not match d = {dim} "
                         f"(need points (n,{dim}){'' if values is None else ' and values (n,)'})")
    if points.shape[0] == 0:
        raise InputError(f"{filename}: no points")
    if not (np.all(np.isfinite(points)) and (values is None or np.all(np.isfinite(values)))):
        raise InputError(f"{filename}: non-finite values")
    return points, values


class PointDensity:
    """Density values at scattered points, linearly interpolated, zero outside."""

    kind = "file"

    def __init__(self, points, values, source: str = "<array>"):
        self.points = np.asarray(points, float)
        self.values = np.asarray(values, float)
        self.source = source
        self._interp = None

    @property
    def dim(self) -> int:
        return self.points.shape[1]

    def density(self, x: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(x)
        if self.dim == 1:
            order = np.argsort(self.points[:, 0])
            xp, fp = self.points[order, 0], self.values[order]
            return np.interp(x[:, 0], xp, fp, left=0.0, right=0.0)
        return np.maximum(self._interpolator()(x), 0.0)

    def _interpolator(self):
        if self._interp is None:
            try:
                from scipy.interpolate import LinearNDInterpolator
                from scipy.spatial import QhullError
            except ImportError:
                raise InputError(f"{self.source}: reading density files in d >= 2 needs scipy "
                                 "(Debian: apt-get install python3-scipy)") from None
            try:
                self._interp = LinearNDInterpolator(self.points, self.values, fill_value=0.0)
            except QhullError:
                raise InputError(f"{self.source}: the points are degenerate (they span no "
                                 f"{self.dim}-D volume)") from None
        return self._interp

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n tokens from the linear interpolant. 1-D: a segment by its mass, then the exact
        inverse of the linear density in it. d >= 2: a simplex by volume x largest vertex
        value, a uniform point in it, accepted with probability density / that value."""
        if self.dim == 1:
            order = np.argsort(self.points[:, 0])
            x, f = self.points[order, 0], self.values[order]
            mass = 0.5 * (f[1:] + f[:-1]) * np.diff(x)
            seg = rng.choice(len(mass), size=n, p=mass / mass.sum())
            a, b, h = f[seg], f[seg + 1], np.diff(x)[seg]
            u = rng.random(n) * 0.5 * (a + b)          # inverse of a s + (b - a) s^2 / 2
            with np.errstate(divide="ignore", invalid="ignore"):
                s = np.where(np.abs(b - a) > 1e-14 * np.maximum(a, b),
                             (-a + np.sqrt(a * a + 2 * (b - a) * u)) / (b - a), u / np.maximum(a, 1e-300))
            return (x[seg] + h * np.clip(s, 0, 1))[:, None]
        tri = self._interpolator().tri
        corners = self.points[tri.simplices]
        vals = self.values[tri.simplices]
        vol = np.abs(np.linalg.det(corners[:, 1:] - corners[:, :1]))
        envelope = vol * vals.max(axis=1)   # proposal: uniform under each simplex's max
        out = np.empty((0, self.dim))
        while len(out) < n:
            m = 2 * (n - len(out)) + 16
            k = rng.choice(len(envelope), size=m, p=envelope / envelope.sum())
            lam = rng.dirichlet(np.ones(self.dim + 1), size=m)
            dens = np.einsum("mi,mi->m", lam, vals[k])
            keep = rng.random(m) * vals[k].max(axis=1) <= dens
            out = np.vstack([out, np.einsum("mi,mia->ma", lam[keep], corners[k[keep]])])
        return out[:n]

    def total_mass(self) -> float:
        """Integral of the linear interpolant over the data's convex hull."""
        if self.dim == 1:
            order = np.argsort(self.points[:, 0])
            x, f = self.points[order, 0], self.values[order]
            return float(np.sum(0.5 * (f[1:] + f[:-1]) * np.diff(x)))
        tri = self._interpolator().tri
        corners = self.points[tri.simplices]                 # (n, d+1, d)
        edges = corners[:, 1:] - corners[:, :1]
        volume = np.abs(np.linalg.det(edges)) / math.factorial(self.dim)
        return float(np.sum(volume * self.values[tri.simplices].mean(axis=1)))

    ufl_density = None

    @classmethod
    def read(cls, filename: str, dim: int, key: str) -> "PointDensity":
        try:
            return cls._read(filename, dim)
        except InputError as e:
            raise InputError(f"{key}: {e}") from None

    @classmethod
    def _read(cls, filename: str, dim: int) -> "PointDensity":
        points, values = _read_point_data(filename, dim, "density", "density")
        if points.shape[0] < dim + 1:
            raise InputError(f"{filename}: needs at least {dim + 1} points")
        if np.any(values < 0):
            raise InputError(f"{filename}: density values must be >= 0")
        if not np.any(values > 0):
            raise InputError(f"{filename}: density is zero everywhere")
        prompt = cls(points, values, filename)
        if not prompt.total_mass() > 0:
            raise InputError(f"{filename}: the density has no mass (points degenerate?)")
        return prompt


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


def _weights(key: str, given, n: int, what: str) -> np.ndarray:
    """The weights of n parts (default equal), checked: ConfigError naming ``key``."""
    w = np.ones(n) if given is None else (np.asarray(given, float) if is_rectangular(given) else None)
    if w is None or w.shape != (n,):
        raise ConfigError(key, f"expected {n} numbers (one per {what}), got {given!r}")
    return w


def _gaussian_mixture(spec: dict, d: int, key: str):
    means = vector_list(f"{key}.means", spec["means"], d)
    n = means.shape[0]
    covs = spec["covs"]
    if len(covs) != n:
        raise ConfigError(f"{key}.covs", f"expected {n} covariances (one per mean), got {len(covs)}")
    covs = np.array([spd_matrix(f"{key}.covs[{c}]", v, d) for c, v in enumerate(covs)])
    w = _weights(f"{key}.weights", spec["weights"], n, "mean")
    if np.any(w <= 0):
        raise ConfigError(f"{key}.weights", "weights must be positive")
    return GaussianMixture(w, means, covs)


def _uniform(spec: dict, d: int, key: str):
    lo = np.asarray(spec["lower"], float) if is_rectangular(spec["lower"]) else None
    hi = np.asarray(spec["upper"], float) if is_rectangular(spec["upper"]) else None
    for name, a in (("lower", lo), ("upper", hi)):
        if a is None or a.shape != (d,):
            raise ConfigError(f"{key}.{name}", f"expected {d} numbers (d = {d}), got {spec[name]!r}")
    for a in range(d):
        if not hi[a] > lo[a]:
            raise ConfigError(f"{key}.upper", f"upper[{a}] = {hi[a]} is not above lower[{a}] = {lo[a]}")
    return UniformBox(lo, hi)


def _file(spec: dict, d: int, key: str):
    return PointDensity.read(spec["path"], d, f"{key}.path")


def _points(spec: dict, d: int, key: str):
    if spec["path"] is not None:
        return PointCloud.read(spec["path"], d, f"{key}.path")
    points = vector_list(f"{key}.points", spec["points"], d)
    w = _weights(f"{key}.weights", spec["weights"], len(points), "point")
    if np.any(w < 0) or not np.any(w > 0):
        raise ConfigError(f"{key}.weights", "weights must be >= 0 with a positive sum")
    if not (np.all(np.isfinite(points)) and np.all(np.isfinite(w))):
        raise ConfigError(f"{key}.points", "non-finite values")
    return PointCloud(points, w)


# prompt kind -> its builder (spec, d, key): a new kind is a builder here and its keys in
# the config schema
PROMPT_KINDS = {"gaussian_mixture": _gaussian_mixture, "uniform": _uniform, "file": _file,
                "points": _points}


def make_prompt(spec: dict, d: int, index: int, key: str | None = None):
    """Build the density object of a checked ``[[prompts]]`` table (or of a density
    target, whose errors name ``key``) for dimension d."""
    key = key or f"prompts[{index}]"
    if spec["kind"] not in PROMPT_KINDS:
        raise ConfigError(f"{key}.kind", f"unknown kind {spec['kind']!r}")
    return PROMPT_KINDS[spec["kind"]](spec, d, key)
