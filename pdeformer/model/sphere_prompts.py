"""Prompts on a circle or sphere (:class:`~pdeformer.model.geometry.Sphere`): densities
with respect to its arc length or area, written through the unit vector u = x / |x|.

* ``uniform``: 1 / |S|;
* ``von_mises_fisher``: a mixture of von Mises-Fisher densities (mean directions and
  concentrations kappa), drawn exactly;
* ``harmonics``: (1 + sum c Y_lm) / |S| with real spherical harmonics (Fourier modes on
  the circle);
* ``file``: density values at points, interpolated linearly on the sphere's own
  triangulation of them;
* ``points``: a point cloud, brought onto the sphere by radial projection.

:data:`SPHERE_PROMPTS` declares the kinds only a circle or sphere has (their keys),
:data:`SPHERE_KINDS` maps each kind to its builder (:func:`pdeformer.model.prompts.make_prompt`
picks it for a sphere); the flat kinds (``gaussian_mixture``) are refused with the kind
that takes their place (docs/sphere.md).
"""

from __future__ import annotations

import math

import numpy as np

from ..tools.errors import ConfigError, InputError
from ..tools.keys import REQUIRED, Key, array
from .geometry import Sphere
from .prompt_files import normalised, read_point_data
from .prompts import (MIN_SIGMA_CELLS, DensityParts, PromptKind, balanced_sum, checked_weights, mixture_parts,
                      narrowest, point_cloud, vector_list)


class SpherePrompt:
    """A density on a :class:`~pdeformer.model.geometry.Sphere` |x| = R in R^d (the
    circle for d = 2), with respect to its arc length or area, of total mass 1 on the
    exact sphere; written through the unit vector u = x / |x|, so that it is defined on
    the flat cells of a mesh of the sphere as well (as its radial projection).
    Subclasses give ``_profile(u, ops)``."""

    ufl_density = None   # set per instance (a method)

    def __init__(self, sphere: Sphere):
        self.sphere, self.d = sphere, sphere.dim
        self.area = sphere.area
        self.ufl_density = self._ufl_density

    @property
    def dim(self) -> int:
        return self.d

    def density(self, x: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(x)
        u = x / np.linalg.norm(x, axis=1)[:, None]
        return self._profile(u.T, NUMPY_OPS)

    def _ufl_density(self, x, const=None):
        import ufl
        u = x / ufl.sqrt(ufl.dot(x, x))
        return self._profile([u[a] for a in range(self.d)], UFL_OPS)

    def total_mass(self) -> float:
        return 1.0

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n tokens on the sphere, by rejection from the uniform density (the bound of
        :meth:`_bound`); subclasses with an exact sampler override it. Tokens lie on
        |x| = radius to rounding."""
        top = self._bound()
        out = np.zeros((0, self.d))
        while len(out) < n:
            x = self.sphere.directions(max(64, 2 * (n - len(out))), rng)
            f = self.density(x)
            if np.any(f < 0):
                raise InputError(f"{self.kind}: the density is negative somewhere (min found "
                                 f"{f.min():.3g}): no tokens can be drawn from it")
            keep = rng.random(len(x)) * top < f
            out = np.vstack([out, x[keep]])
        return self.sphere.points(out[:n])


class UniformSphere(SpherePrompt):
    """rho = 1 / |S| on the sphere."""

    kind = "uniform"

    def _profile(self, u, ops):
        return 1.0 / self.area + 0.0 * u[0]

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.sphere.sample_uniform(n, rng)


# Past this concentration the circle's normalisation comes from the asymptotic series
# of I_0(k) e^-k (its next term, 0.227 / k^5, is below 1e-20 there) instead of a
# trapezoid rule on 16 sqrt(k) points (which would grow without bound).
LARGE_KAPPA = 1e4
I0_SERIES = (1.0, 1 / 8, 9 / 128, 225 / 3072, 11025 / 98304)


class VonMisesFisher(SpherePrompt):
    """sum_c pi_c C(kappa_c) e^{kappa_c <mu_c, u>} / radius^{d-1}: on S^2
    C = kappa / (4 pi sinh kappa), on S^1 C = 1 / (2 pi I_0(kappa)); evaluated as
    C e^{kappa} e^{kappa (<mu, u> - 1)}, which neither overflows nor cancels."""

    kind = "von_mises_fisher"

    def __init__(self, sphere: Sphere, weights, means, concentrations):
        super().__init__(sphere)
        self.weights = normalised(weights)
        self.means = np.asarray(means, float) / np.linalg.norm(means, axis=1)[:, None]
        self.kappa = np.asarray(concentrations, float)
        self.scale = np.array([self._scaled_norm(k) for k in self.kappa]) / sphere.radius ** (self.d - 1)

    def _scaled_norm(self, kappa: float) -> float:
        """C(kappa) e^kappa."""
        if self.d == 3:
            return 1 / (4 * math.pi) if kappa == 0 else kappa / (2 * math.pi * -math.expm1(-2 * kappa))
        if kappa > LARGE_KAPPA:   # I_0(k) e^-k = (1 + 1/8k + 9/128k^2 + ...) / sqrt(2 pi k)
            series = sum(c * (1 / kappa) ** n for n, c in enumerate(I0_SERIES))
            return math.sqrt(kappa / (2 * math.pi)) / series
        n = 64 + 16 * math.ceil(math.sqrt(kappa))     # trapezoid rule: geometric convergence
        theta = 2 * math.pi * np.arange(n) / n
        return 1 / (2 * math.pi * float(np.mean(np.exp(kappa * (np.cos(theta) - 1)))))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Exact draws: the component, then on S^1 the angle from numpy's von Mises
        sampler, on S^2 the cosine w to the mean from its inverse distribution function
        w = 1 + log(xi + (1 - xi) e^{-2 kappa}) / kappa and a uniform direction about it."""
        comp = rng.choice(len(self.weights), size=n, p=self.weights)
        out = np.empty((n, self.d))
        for c in range(len(self.weights)):
            idx = np.flatnonzero(comp == c)
            mu, k = self.means[c], self.kappa[c]
            if self.d == 2:
                angle = rng.vonmises(math.atan2(mu[1], mu[0]), k, size=len(idx))
                out[idx] = np.c_[np.cos(angle), np.sin(angle)]
                continue
            xi = rng.random(len(idx))
            w = 2 * xi - 1 if k == 0 else 1 + np.log(xi + (1 - xi) * math.exp(-2 * k)) / k
            w = np.clip(w, -1.0, 1.0)
            e1 = np.cross(mu, [1.0, 0.0, 0.0] if abs(mu[0]) < 0.9 else [0.0, 1.0, 0.0])
            e1 /= np.linalg.norm(e1)
            e2 = np.cross(mu, e1)
            phi = 2 * np.pi * rng.random(len(idx))
            s = np.sqrt(1 - w * w)
            out[idx] = w[:, None] * mu + (s * np.cos(phi))[:, None] * e1 + (s * np.sin(phi))[:, None] * e2
        return self.sphere.points(out)

    def _bound(self) -> float:
        return float(np.sum(self.weights * self.scale))

    def unresolved(self, cell: float, key: str) -> ConfigError | None:
        """The error for a component narrower than the mesh resolves: its width
        radius / sqrt(kappa) (the standard deviation of the angle, times R, for large
        kappa) below MIN_SIGMA_CELLS x the shortest cell edge (as for Gaussians)."""
        radius = self.sphere.radius
        with np.errstate(divide="ignore"):
            sigma = radius / np.sqrt(self.kappa)
        c = narrowest(sigma, cell)
        if c is None:
            return None
        return ConfigError(f"{key}.concentrations", f"component {c}: width radius/sqrt(kappa) = "
                           f"{sigma[c]:.3g} is below 1/{1 / MIN_SIGMA_CELLS:g} of the mesh's cell size "
                           f"{cell:.3g}: the mesh cannot resolve it; refine the mesh or use kappa <= "
                           f"{(radius / (MIN_SIGMA_CELLS * cell)) ** 2:.3g}")

    def _profile(self, u, ops):
        terms = [w * c * ops.exp(k * (sum(m[a] * u[a] for a in range(self.d)) - 1))
                 for w, c, k, m in zip(self.weights, self.scale, self.kappa, self.means)]
        return balanced_sum(terms)

    def ufl_parts(self, x, const) -> DensityParts:
        """The density as :class:`DensityParts` of x (``const``: dolfinx Constants): one
        small form for any number of components, and for every prompt of the kind."""
        import ufl
        u = x / ufl.sqrt(ufl.dot(x, x))

        def term(wc, k, m):
            return wc * ufl.exp(k * (ufl.dot(m, u) - 1))
        return mixture_parts(term, [self.weights * self.scale, self.kappa, self.means], const)

    def mean(self) -> np.ndarray:
        """The mean in R^d: sum_c pi_c A(kappa_c) radius mu_c, A = coth k - 1/k on S^2,
        I_1/I_0 on S^1 (by quadrature)."""
        out = np.zeros(self.d)
        for w, k, m in zip(self.weights, self.kappa, self.means):
            if k == 0:
                a = 0.0
            elif self.d == 3:
                a = (1 + math.exp(-2 * k)) / -math.expm1(-2 * k) - 1 / k
            else:
                theta = 2 * math.pi * np.arange(4096) / 4096
                e = np.exp(k * (np.cos(theta) - 1))
                a = float(np.sum(np.cos(theta) * e) / np.sum(e))
            out += w * a * self.sphere.radius * m
        return out


class SphereHarmonics(SpherePrompt):
    """(1 / |S|) (1 + sum c Y(u)) over ``coefficients`` [[l, m, c], ...]: on S^2 the real
    spherical harmonics, orthonormal on the unit sphere (:func:`real_harmonic`); on S^1
    cos(l theta) for m = l and sin(l theta) for m = -l (theta the angle of u)."""

    kind = "harmonics"

    def __init__(self, sphere: Sphere, coefficients):
        super().__init__(sphere)
        self.coefficients = [(int(l), int(m), float(c)) for l, m, c in coefficients]

    def _bound(self) -> float:
        """(1 + sum |c| max |Y|) / |S|: |Y_lm| <= sqrt((2l+1)/(4 pi)) on S^2 (the
        addition theorem), |cos|, |sin| <= 1 on S^1."""
        top = sum(abs(c) * (math.sqrt((2 * l + 1) / (4 * math.pi)) if self.d == 3 else 1.0)
                  for l, _, c in self.coefficients)
        return (1.0 + top) / self.area

    def _profile(self, u, ops):
        terms = [1.0 + 0.0 * u[0]] + [c * (real_harmonic(l, m, u) if self.d == 3 else fourier_mode(l, m, u))
                                      for l, m, c in self.coefficients]
        return balanced_sum(terms) / self.area


class SphereFile(SpherePrompt):
    """Density values at scattered points on the sphere, interpolated linearly on the
    sphere's own triangulation of them: on S^1 in the angle between neighbours (around
    the circle), on S^2 on the convex hull of the points' directions (its facets are the
    spherical Delaunay triangles), each direction u taking the barycentric combination
    of the facet the ray through u crosses. Normalised to mass 1 by the mesh model; the
    particle model samples it by rejection."""

    kind = "file"

    def __init__(self, sphere: Sphere, points, values, source: str = "<array>"):
        super().__init__(sphere)
        self.ufl_density = None          # projected through its interpolant at the DG nodes
        self.values = np.asarray(values, float)
        self.directions = np.asarray(points, float) / np.linalg.norm(points, axis=1)[:, None]
        self.source = source
        if self.d == 2:
            angle = np.arctan2(self.directions[:, 1], self.directions[:, 0])
            order = np.argsort(angle)
            self._angle, self._ordered = angle[order], self.values[order]
        else:
            self._facets = self._hull()

    def _hull(self):
        try:
            from scipy.spatial import ConvexHull, QhullError, cKDTree
        except ImportError:
            raise InputError(f"{self.source}: density files on a sphere need scipy "
                             "(Debian: apt-get install python3-scipy)") from None
        try:
            hull = ConvexHull(self.directions)
        except QhullError:
            raise InputError(f"{self.source}: the points do not surround the sphere's centre "
                             "(their convex hull is flat)") from None
        corners = self.directions[hull.simplices]                      # (F, 3, 3)
        if np.any(hull.equations[:, 3] >= -1e-12):     # the origin on or outside a facet's plane
            raise InputError(f"{self.source}: the points do not surround the sphere's centre")
        inverse = np.linalg.inv(corners.transpose(0, 2, 1))             # u = C lam -> lam = C^-1 u
        centres = corners.mean(axis=1)
        return hull.simplices, inverse, cKDTree(centres / np.linalg.norm(centres, axis=1)[:, None])

    def _profile(self, u, ops):
        if ops is not NUMPY_OPS:
            raise TypeError("a density file has no UFL expression")
        u = np.asarray(u).T
        if self.d == 2:
            theta = np.arctan2(u[:, 1], u[:, 0])
            a, f = self._angle, self._ordered
            period = 2 * np.pi
            return np.interp(theta, np.r_[a[-1] - period, a, a[0] + period], np.r_[f[-1], f, f[0]])
        simplices, inverse, tree = self._facets
        out = np.full(len(u), np.nan)
        k = min(len(simplices), 8)   # a hull has at least 4 facets
        _, near = tree.query(u, k=k)
        for j in range(k):           # the nearest facet centres, until one contains the ray
            todo = np.isnan(out)
            if not todo.any():
                break
            f = near[todo, j]
            lam = np.einsum("nij,nj->ni", inverse[f], u[todo])
            inside = np.all(lam >= -1e-12, axis=1)
            idx = np.flatnonzero(todo)[inside]
            lam = lam[inside] / lam[inside].sum(axis=1, keepdims=True)
            out[idx] = np.einsum("ni,ni->n", lam, self.values[simplices[f[inside]]])
        if np.any(np.isnan(out)):     # (not met: a ray crosses one of the nearest facets)
            lam = np.einsum("fij,nj->nfi", inverse, u[np.isnan(out)])
            f = np.argmax(lam.min(axis=2), axis=1)
            best = lam[np.arange(len(f)), f]
            out[np.isnan(out)] = np.einsum("ni,ni->n", best / best.sum(axis=1, keepdims=True),
                                           self.values[simplices[f]])
        return out

    def _bound(self) -> float:
        return float(self.values.max())

    def total_mass(self) -> float:
        """The interpolant's integral over the sphere (the values are not normalised), by
        the midpoint rule on the grid of :func:`_direction_grid` (cos(latitude) weights
        on S^2)."""
        u = _direction_grid(self.d)
        f = self.density(self.sphere.points(u))
        if self.d == 2:
            return float(f.mean() * self.area)
        w = np.sqrt(1 - u[:, 2] ** 2)          # cos(latitude)
        return float(f @ w / w.sum() * self.area)


class _Ops:
    def __init__(self, exp):
        self.exp = exp


NUMPY_OPS = _Ops(np.exp)


class _UflOps:
    @property
    def exp(self):
        import ufl
        return ufl.exp


UFL_OPS = _UflOps()


def _powers(m: int, u):
    """Re and Im of (u_0 + i u_1)^m, as polynomials of u (numpy arrays or UFL)."""
    c, s = 1.0 + 0.0 * u[0], 0.0 * u[0]
    for _ in range(m):
        c, s = c * u[0] - s * u[1], s * u[0] + c * u[1]
    return c, s


def fourier_mode(l: int, m: int, u):
    """cos(l theta) (m = l) or sin(l theta) (m = -l) for u = (cos theta, sin theta)."""
    c, s = _powers(l, u)
    return c if m == l else s


def real_harmonic(l: int, m: int, u):
    """The real spherical harmonic Y_lm at unit vectors u (orthonormal on S^2, no
    Condon-Shortley phase): N_lm Q_l^|m|(u_2) Re (u_0 + i u_1)^m (m >= 0) or Im ... (m < 0),
    with Q_l^m = P_l^m / (1 - z^2)^{m/2} the polynomial of the associated Legendre
    recurrence, N_lm = sqrt((2l+1)/(4 pi) (l-|m|)!/(l+|m|)!) (x sqrt 2 for m != 0)."""
    a, z = abs(m), u[2]
    q_prev, q = 0.0 * z, float(np.prod(np.arange(1, 2 * a, 2))) + 0.0 * z   # Q_a^a = (2a-1)!!
    for k in range(a + 1, l + 1):
        q_prev, q = q, ((2 * k - 1) * z * q - (k + a - 1) * q_prev) / (k - a)
    norm = math.sqrt((2 * l + 1) / (4 * math.pi) * math.factorial(l - a) / math.factorial(l + a))
    c, s = _powers(a, u)
    if m == 0:
        return norm * q
    return math.sqrt(2) * norm * q * (c if m > 0 else s)




def _von_mises_fisher(spec: dict, d: int, key: str, sphere: Sphere):
    means = vector_list(f"{key}.means", spec["means"], d)
    n = len(means)
    if np.any(np.linalg.norm(means, axis=1) == 0):
        raise ConfigError(f"{key}.means", "a mean direction is the zero vector")
    kappa = checked_weights(f"{key}.concentrations", spec["concentrations"], n, "mean")
    if np.any(kappa < 0) or not np.all(np.isfinite(kappa)):
        raise ConfigError(f"{key}.concentrations", "concentrations must be >= 0")
    w = checked_weights(f"{key}.weights", spec["weights"], n, "mean")
    if np.any(w <= 0):
        raise ConfigError(f"{key}.weights", "weights must be positive")
    return VonMisesFisher(sphere, w, means, kappa)


def _harmonics(spec: dict, d: int, key: str, sphere: Sphere):
    coefficients = spec["coefficients"]
    if not isinstance(coefficients, list):
        raise ConfigError(f"{key}.coefficients", f"expected [[l, m, c], ...], got {coefficients!r}")
    rows = []
    for i, row in enumerate(coefficients):
        k = f"{key}.coefficients[{i}]"
        if not (isinstance(row, list) and len(row) == 3
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in row)
                and all(float(v).is_integer() for v in row[:2])):
            raise ConfigError(k, f"expected [l, m, c] (integers l, m and a number c), got {row!r}")
        l, m = int(row[0]), int(row[1])
        if not 1 <= l <= 32 or (d == 3 and abs(m) > l) or (d == 2 and abs(m) != l):
            allowed = "-l <= m <= l" if d == 3 else "m = l (cos) or m = -l (sin)"
            raise ConfigError(k, f"l = {l}, m = {m}: need 1 <= l <= 32 and {allowed}")
        rows.append((l, m, float(row[2])))
    prompt = SphereHarmonics(sphere, rows)
    low = float(prompt.density(sphere.points(_direction_grid(d))).min()) * prompt.area
    if low < 0:
        raise ConfigError(f"{key}.coefficients", f"1 + sum c Y_lm is negative somewhere (down to "
                          f"{low:.3g}): a prompt is a probability density; use smaller coefficients")
    return prompt


def _direction_grid(d: int, n: int = 128) -> np.ndarray:
    """Unit vectors on a grid of the circle (4n angles) or the sphere (n latitudes x 2n
    longitudes, cell centres): fine enough to see the sign of harmonics up to l = 32."""
    if d == 2:
        theta = 2 * np.pi * np.arange(4 * n) / (4 * n)
        return np.c_[np.cos(theta), np.sin(theta)]
    lat = np.pi * (np.arange(n) + 0.5) / n - np.pi / 2
    lon = np.pi * (np.arange(2 * n) + 0.5) / n
    LA, LO = np.meshgrid(lat, lon, indexing="ij")
    return np.stack([np.cos(LA) * np.cos(LO), np.cos(LA) * np.sin(LO), np.sin(LA)], -1).reshape(-1, 3)



def _flat_kind(kind: str, instead: str):
    """The builder of a flat kind on a sphere: a ConfigError naming ``instead``."""
    def refuse(spec: dict, d: int, key: str, sphere: Sphere):
        raise ConfigError(f"{key}.kind", f"{kind!r} is a density on R^d, not on a circle or sphere: "
                          f"use {instead}")
    return refuse


def _uniform(spec: dict, d: int, key: str, sphere: Sphere):
    for name in ("lower", "upper"):
        if spec[name] is not None:
            raise ConfigError(f"{key}.{name}", "not on a circle or sphere (uniform on all of it)")
    return UniformSphere(sphere)


def _file(spec: dict, d: int, key: str, sphere: Sphere):
    try:
        points, values = read_point_data(spec["path"], d, "density", "density")
        if len(points) < d + 1 or np.any(np.linalg.norm(points, axis=1) == 0):
            raise InputError(f"{spec['path']}: needs at least {d + 1} points, none at the origin")
        if np.any(values < 0) or not np.any(values > 0):
            raise InputError(f"{spec['path']}: density values must be >= 0, not all zero")
        return SphereFile(sphere, points, values, spec["path"])
    except InputError as e:
        raise InputError(f"{key}.path: {e}") from None


def _points(spec: dict, d: int, key: str, sphere: Sphere):
    """The point cloud's radial projections onto the sphere."""
    cloud = point_cloud(spec, d, key)
    norms = np.linalg.norm(cloud.points, axis=1)
    if np.any(norms == 0):
        which = f"{key}.path" if spec["path"] is not None else f"{key}.points"
        raise ConfigError(which, f"point {int(np.argmin(norms))} is the origin, which has no "
                          "direction on the sphere")
    cloud.points = sphere.project(cloud.points)
    return cloud


# prompt kind -> its builder (spec, d, key, sphere) on a circle or sphere
SPHERE_KINDS = {"gaussian_mixture": _flat_kind("gaussian_mixture", "von_mises_fisher (its spherical counterpart)"),
                "uniform": _uniform, "file": _file, "points": _points,
                "von_mises_fisher": _von_mises_fisher, "harmonics": _harmonics}


# The prompt kinds only a circle or sphere has (pdeformer.model.prompts.PromptKind; the
# kinds both have are declared in pdeformer.model.prompts.FLAT_PROMPTS).
SPHERE_PROMPTS = {
    "von_mises_fisher": PromptKind({
        "weights": Key(array, None, "mixture weights (positive; normalised)"),
        "means": Key(array, REQUIRED, "mean directions, one d-vector each (normalised)"),
        "concentrations": Key(array, REQUIRED, "concentration kappa >= 0 of each component"),
    }),
    "harmonics": PromptKind({
        "coefficients": Key(array, REQUIRED, "[[l, m, c], ...]: rho = (1 + sum c Y_lm) / |S|"),
    }),
}

KINDS, PROMPTS = SPHERE_KINDS, SPHERE_PROMPTS   # this family's (Geometry.prompt_module)
