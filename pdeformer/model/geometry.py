"""The space tokens live in: flat R^d (:class:`Flat`) or the sphere |x| = R about the
origin (:class:`Sphere`: the circle for d = 2, S^2 for d = 3), behind one interface
(:class:`Geometry`) that the mesh, the velocity, the particles, the prompts and the
output share (docs/sphere.md).

Each geometry says how a point of R^d comes onto it (:meth:`~Geometry.project`), which
part of a velocity moves along it (:meth:`~Geometry.tangential`), the reverse modes of
both, the chart the pictures draw it in, uniform draws and its order parameter. The
solvers call these rather than test which class they hold; a mesh's geometry comes
from its points (:func:`geometry_of_points`), a built-in mesh's also from its
``[mesh]`` table (:func:`geometry_of_config`). A new geometry (e.g. a torus) is one
class here, registered in :data:`MANIFOLDS` (recognised from a mesh's points) and, for a
built-in mesh, in :data:`SHAPES` (docs/architecture.md), whose names the ``[mesh]``
table (:data:`MESH_KEYS`, checked by :func:`check_mesh_table`) takes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..tools.charts import CHART_BOX, chart
from ..tools.errors import ConfigError
from ..tools.keys import Key, integer, number, number_list, path, positive_int_list, string

FOURIER_MODES = 3   # on a circle: |rho_hat_l| for l = 1..3 in the diagnostics


class Geometry:
    """The interface; :class:`Flat` and :class:`Sphere` implement it.

    ``name`` ("flat", "circle", "sphere"); ``family``: the prompt kinds written for it
    ("flat" or "sphere", :func:`pdeformer.model.prompts.prompt_kinds`), declared in the
    module ``prompt_module`` of this package (its ``KINDS``: builders, ``PROMPTS``: the
    keys of the kinds it adds), and ``kinds_hint``: where its own kinds belong, for the
    error another geometry's mesh gives them (None: no such error); ``projects``:
    whether a step in R^d leaves the space (a scheme's stages are then projected back
    onto it); ``chart_name``: fields.npz's ``chart`` ("": pictures draw R^d itself);
    ``radius``: the sphere's, None on a flat space (for what prints or writes it)."""

    name: str
    family: str
    prompt_module: str
    kinds_hint: str | None = None
    projects: bool
    chart_name: str
    radius = None
    dim: int

    def project(self, x: np.ndarray) -> np.ndarray:
        """The points x (n, d) brought onto the space."""
        raise NotImplementedError

    def project_vjp(self, x: np.ndarray, ybar: np.ndarray) -> np.ndarray:
        """Reverse mode of y = project(x): xbar for the cotangent ybar."""
        raise NotImplementedError

    def tangential(self, x: np.ndarray, v: np.ndarray) -> np.ndarray:
        """P_x v: the part of velocities v (n, d) at x along the space."""
        raise NotImplementedError

    def tangential_vjp(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Reverse mode of v -> P_x v (x fixed) for the cotangent g."""
        raise NotImplementedError

    def radial(self, x: np.ndarray, v: np.ndarray) -> np.ndarray | None:
        """What :meth:`tangential` leaves out of v and its reverse mode in x needs
        (:meth:`tangential_position_vjp`): None where P_x does not depend on x."""
        raise NotImplementedError

    def tangential_position_vjp(self, x: np.ndarray, v: np.ndarray, radial, g: np.ndarray):
        """d/dx of <g, P_x w> through P_x alone (w fixed), for v = P_x w and radial =
        :meth:`radial` (x, w)."""
        raise NotImplementedError

    def chart(self, x: np.ndarray) -> np.ndarray:
        """Chart coordinates for pictures of points (cells, nodes, d): (cells, nodes, k)."""
        raise NotImplementedError

    def chart_box(self, points: np.ndarray) -> np.ndarray:
        """The (2, k) box the pictures show, given the charted points (m, k)."""
        raise NotImplementedError

    def sample_uniform(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n points drawn from the space's uniform distribution."""
        raise NotImplementedError

    def order_parameter(self, points: np.ndarray, weights: np.ndarray, comm) -> dict:
        """The diagnostics of a weighted set of points (this rank's share) that the space
        adds to the moments: {column: value}, the same on every rank."""
        raise NotImplementedError


@dataclass(frozen=True)
class Flat(Geometry):
    """R^d: every map the identity, uniform draws in the unit cube, no order parameter."""

    dim: int
    name = "flat"
    family = "flat"
    prompt_module = "prompts"
    projects = False
    chart_name = ""

    def project(self, x):
        return x

    def project_vjp(self, x, ybar):
        return ybar

    def tangential(self, x, v):
        return v

    def tangential_vjp(self, x, g):
        return g

    def radial(self, x, v):
        return None

    def tangential_position_vjp(self, x, v, radial, g):
        return 0.0

    def chart(self, x):
        return x

    def chart_box(self, points):
        return np.stack([points.min(axis=0), points.max(axis=0)])

    def sample_uniform(self, n, rng):
        """n points uniform in the unit cube [0, 1)^d (a box prompt scales them)."""
        return rng.random((n, self.dim))

    def order_parameter(self, points, weights, comm):
        return {}


@dataclass(frozen=True)
class Sphere(Geometry):
    """The sphere |x| = radius about the origin in R^d (d = 2: the circle)."""

    dim: int
    radius: float
    family = "sphere"
    prompt_module = "sphere_prompts"
    kinds_hint = ('a circle or sphere: use it with mesh.shape = "circle" or "sphere" '
                  '(or a manifold mesh file)')
    projects = True

    @property
    def name(self) -> str:
        return "circle" if self.dim == 2 else "sphere"

    @property
    def chart_name(self) -> str:
        return self.name

    @property
    def area(self) -> float:
        """|S|: the circle's length 2 pi R, the sphere's area 4 pi R^2."""
        return (2 * math.pi * self.radius) if self.dim == 2 else 4 * math.pi * self.radius ** 2

    @classmethod
    def about(cls, comm, points: np.ndarray) -> Sphere | None:
        """The sphere about the origin that every rank's points (n, d) lie on (to 1e-8
        relative), None if they do not (one collective of two reductions)."""
        r = np.linalg.norm(points, axis=1)
        lo = comm.allreduce(float(r.min()) if r.size else np.inf, op=MPI.MIN)
        hi = comm.allreduce(float(r.max()) if r.size else 0.0, op=MPI.MAX)
        return cls(points.shape[1], hi) if 0 < lo <= hi and hi - lo <= 1e-8 * hi else None

    def project(self, x):
        """The radial projections R x / |x|."""
        return self.radius * x / np.linalg.norm(x, axis=1)[:, None]

    def project_vjp(self, x, ybar):
        """Reverse mode of y = R x / |x|: xbar = R P_x ybar / |x|."""
        return self.radius * tangential(x, ybar) / np.linalg.norm(x, axis=1)[:, None]

    def tangential(self, x, v):
        return tangential(x, v)

    def tangential_vjp(self, x, g):
        """P_x is symmetric: its reverse mode is P_x."""
        return tangential(x, g)

    def radial(self, x, v):
        """<v, u>, u = x / |x|."""
        return np.einsum("nd,nd->n", v, x) / np.linalg.norm(x, axis=1)

    def tangential_position_vjp(self, x, v, radial, g):
        """-((g . u) v + radial P_x g) / |x|."""
        norm = np.linalg.norm(x, axis=1)[:, None]
        u = x / norm
        return -(np.einsum("nd,nd->n", g, u)[:, None] * v + radial[:, None] * tangential(x, g)) / norm

    def chart(self, x):
        """The angle theta (circle) or longitude and latitude in degrees (sphere):
        :func:`pdeformer.tools.charts.chart`."""
        return chart(x, self.name)

    def chart_box(self, points):
        return CHART_BOX[self.name]

    def directions(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n unit vectors uniform on S^{d-1} (normalised Gaussians)."""
        z = rng.standard_normal((n, self.dim))
        return z / np.linalg.norm(z, axis=1)[:, None]

    def points(self, u: np.ndarray) -> np.ndarray:
        """R u: the sphere's points in the unit directions u."""
        return self.radius * u

    def sample_uniform(self, n, rng):
        return self.points(self.directions(n, rng))

    def order_parameter(self, points, weights, comm):
        """:func:`sphere_moments` of the points."""
        return sphere_moments(points, weights, comm)


def tangential(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    """P_x v = v - <v, u> u, u = x / |x|, row by row."""
    u = x / np.linalg.norm(x, axis=1)[:, None]
    return v - np.einsum("nd,nd->n", v, u)[:, None] * u


def sphere_moments(points: np.ndarray, weights: np.ndarray, comm) -> dict:
    """For the measure sum_j w_j delta_{y_j} normalised to mass 1 (this rank's points;
    one Allreduce): the order parameter |sum_j w_j u_j| (u = y / |y|: 1 for one point
    mass, 0 for the uniform density) and, on a circle (d = 2), the Fourier amplitudes
    |sum_j w_j e^{-i l theta_j}| for l = 1..FOURIER_MODES (theta the angle of y)."""
    d = points.shape[1]
    u = points / np.linalg.norm(points, axis=1)[:, None] if len(points) else points
    parts = [weights.sum(), *(weights @ u)]
    if d == 2:
        theta = np.arctan2(points[:, 1], points[:, 0])
        for l in range(1, FOURIER_MODES + 1):
            parts += [weights @ np.cos(l * theta), weights @ np.sin(l * theta)]
    total = np.array(parts, float)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    total /= total[0]
    out = {"order": float(np.linalg.norm(total[1:1 + d]))}
    for l in range(1, FOURIER_MODES + 1 if d == 2 else 1):
        re, im = total[1 + d + 2 * (l - 1)], total[2 + d + 2 * (l - 1)]
        out[f"fourier_{l}"] = float(np.hypot(re, im))
    return out


# The curved spaces a mesh's points are tested for, in order (a class with ``about``).
MANIFOLDS = (Sphere,)
# Every geometry, flat first: their families' prompt kinds make the [[prompts]] kinds.
GEOMETRIES = (Flat, *MANIFOLDS)

# A built-in mesh's shape ([mesh] shape) -> its geometry from the [mesh] table.
SHAPES = {
    "box": lambda mesh: Flat(len(mesh["lower"])),
    "circle": lambda mesh: Sphere(2, float(mesh["radius"])),
    "sphere": lambda mesh: Sphere(3, float(mesh["radius"])),
}


def geometry_of_points(comm, points: np.ndarray, manifold: bool) -> Geometry | None:
    """The geometry of a mesh whose vertices are ``points`` (this rank's, (n, d)): flat
    unless ``manifold`` (cells of one dimension less than d), else the first of
    :data:`MANIFOLDS` that every rank's points lie on, None if none (collective)."""
    if not manifold:
        return Flat(points.shape[1])
    for space in MANIFOLDS:
        found = space.about(comm, points)
        if found is not None:
            return found
    return None


def geometry_of_config(mesh: dict) -> Geometry | None:
    """The geometry a ``[mesh]`` table states (None for a mesh file: its points decide,
    :func:`geometry_of_points`)."""
    if mesh.get("file") is not None:
        return None
    return SHAPES[mesh.get("shape") or "box"](mesh)


# ----------------------------------------------------------------------------------
# the [mesh] table: a mesh file, or a built-in mesh of a shape in SHAPES

CELLS = {1: ("interval",), 2: ("triangle", "quadrilateral"), 3: ("tetrahedron", "hexahedron")}

# Circle and sphere radii R that run: a sphere's cell areas come from 4th powers of its
# edges (down to R / 300 at 9 refinements), its density is 1/(4 pi R^2) and its moments'
# risks square R^2, all within the doubles' range for R in [1e-50, 1e50] (tested at both
# ends; at 1e-100 the areas underflow to 0, at 1e70 a moments risk overflows).
RADIUS_LIMITS = (1e-50, 1e50)
RADIUS_WHY = (" (a sphere's cell areas, its density 1/(4 pi R^2) and its moments must stay within "
              "double precision; scale the problem to a radius near 1)")

MESH_KEYS = {
    "file": Key(path, None, "mesh file (XDMF), instead of a built-in box"),
    "name": Key(string(), "mesh", "name of the mesh grid in the XDMF file"),
    "lower": Key(number_list(), None, "lower corner of the built-in box"),
    "upper": Key(number_list(), None, "upper corner of the built-in box"),
    "cells": Key(positive_int_list, None, "cells per direction of the built-in box"),
    "cell": Key(string(tuple(c for cs in CELLS.values() for c in cs)), None,
                "cell type of the built-in box (default: simplices)"),
    "shape": Key(string(tuple(SHAPES)), "box", "built-in domain: a box (lower, upper, cells), a "
                 "circle (cells = [n]) or a sphere (refinements), about the origin"),
    "radius": Key(number(positive=True, lo=RADIUS_LIMITS[0], hi=RADIUS_LIMITS[1], why=RADIUS_WHY), 1.0,
                  "radius of the circle or sphere"),
    "refinements": Key(integer(0, 9), None, "sphere: the icosahedron refined this often "
                       "(20 * 4^r triangles)"),
}


def check_mesh_table(m: dict) -> None:
    """The checked ``[mesh]`` table's keys together: a file or a built-in shape and the
    keys of that shape alone; a box's cell type filled in (simplices)."""
    if m["file"] is not None:
        _check_mesh_file(m)
    elif m["shape"] != "box":
        _check_manifold(m)
    else:
        _check_box(m)


def _check_mesh_file(m: dict) -> None:
    """A mesh file: no built-in box or shape."""
    box = [k for k in ("lower", "upper", "cells") if m[k] is not None]
    if box or m["cell"] is not None:
        k = box[0] if box else "cell"
        raise ConfigError(f"mesh.{k}", "give either mesh.file or a built-in box, not both")
    if m["shape"] != "box":
        raise ConfigError("mesh.shape", "give either mesh.file or a built-in shape, not both")
    for k in ("radius", "refinements"):
        if m[k] != MESH_KEYS[k].default:
            raise ConfigError(f"mesh.{k}", "not with mesh.file (a sphere's radius is read from it)")


def _check_box(m: dict) -> None:
    """A box: lower, upper and cells of one dimension d, upper above lower, a d-D cell."""
    for k in ("radius", "refinements"):
        if m[k] != MESH_KEYS[k].default:
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
