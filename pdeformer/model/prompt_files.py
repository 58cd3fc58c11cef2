"""Prompts read from data: point clouds (tokens with weights) and density values at
scattered points, interpolated. Files are ``.npz`` (arrays ``points`` and ``weights`` or
``density``) or ``.csv`` (a header ``x0,...,x{d-1}[,weight|density]``, a row per point),
read through pdeformer.tools.files (never blocking, size-checked), every failure one
line naming the file."""

from __future__ import annotations

import csv
import io
import math

import numpy as np

from ..tools.errors import InputError


def normalised(weights) -> np.ndarray:
    """Weights divided by their sum, scaled by their largest first (so that a sum of
    weights near the largest double does not overflow to inf and give zeros)."""
    w = np.asarray(weights, float)
    w = w / np.abs(w).max()
    return w / np.sum(w)


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
            points, weights = read_point_data(filename, dim, "weights", "weight", required=False)
        except InputError as e:
            raise InputError(f"{key}: {e}") from None
        if weights is None:
            weights = np.ones(points.shape[0])
        if np.any(weights < 0) or not np.any(weights > 0):
            raise InputError(f"{key}: {filename}: weights must be >= 0 with a positive sum")
        return cls(points, weights)


FILE_ERROR = "prompt file"    # the 'what' of pdeformer.tools.files errors, replaced by the caller's key


def read_point_data(filename, dim, npz_name, csv_name, required=True):
    """points (n, d) and values (n,) (or None when optional and absent) from .npz/.csv,
    read through pdeformer.tools.files (a regular file, size-checked; its errors name
    the file, the caller adds the key)."""
    from ..tools.files import TEXT_FILE, load_npz, read_text
    try:
        if filename.endswith(".npz"):
            f = load_npz(filename, FILE_ERROR, (npz_name, "points"))
            if "points" not in f or (required and npz_name not in f):
                raise InputError(f"{filename}: needs arrays 'points' (n,d)"
                                 + (f" and '{npz_name}' (n,)" if required else ""))
            points = np.array(f["points"], float)
            values = np.array(f[npz_name], float) if npz_name in f else None
        elif filename.endswith(".csv"):
            rows = list(csv.reader(io.StringIO(read_text(filename, FILE_ERROR, TEXT_FILE), newline="")))
            header = [h.strip() for h in rows[0]] if rows else []
            coords = [f"x{a}" for a in range(dim)]
            if header not in (coords + [csv_name],) + (() if required else (coords,)):
                want = ",".join(coords + [csv_name])
                got = f"got {','.join(header)}" if header else "the file is empty"
                raise InputError(f"{filename}: header must be {want}, {got}")
            data = np.array([[float(v) for v in r] for r in rows[1:] if r], float).reshape(-1, len(header))
            points = data[:, :dim]
            values = data[:, dim] if len(header) > dim else None
        else:
            raise InputError(f"{filename}: unknown file type (use .npz or .csv)")
    except InputError as e:
        raise InputError(str(e).removeprefix(f"{FILE_ERROR}: ")) from None
    except Exception as e:  # a damaged file can fail in zipfile, zlib, numpy, csv, ...
        raise InputError(f"{filename}: cannot read ({type(e).__name__}: {e})") from None
    if points.ndim == 1 and dim == 1:
        points = points[:, None]
    if points.ndim != 2 or points.shape[1] != dim or (values is not None and values.shape != (points.shape[0],)):
        raise InputError(f"{filename}: points {points.shape} do not match d = {dim} "
                         f"(need points (n,{dim}){'' if values is None else ' and values (n,)'})")
    if points.shape[0] == 0:
        raise InputError(f"{filename}: no points (a header and no rows, or empty arrays)")
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
        points, values = read_point_data(filename, dim, "density", "density")
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
