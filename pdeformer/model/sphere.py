"""Tokens on the sphere |x| = R in R^d (the circle for d = 2): the maps the mesh and
particle models share -- radial projection, the tangential part of a velocity and its
reverse mode, and the order parameter and Fourier amplitudes of a weighted set of
points (docs/sphere.md)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

FOURIER_MODES = 3   # on a circle: |rho_hat_l| for l = 1..3 in the diagnostics


def common_radius(comm, points: np.ndarray) -> float | None:
    """The radius R of the sphere |x| = R about the origin that every rank's points lie
    on (to 1e-8 relative), None if they do not (one collective of two reductions)."""
    r = np.linalg.norm(points, axis=1)
    lo = comm.allreduce(float(r.min()) if r.size else np.inf, op=MPI.MIN)
    hi = comm.allreduce(float(r.max()) if r.size else 0.0, op=MPI.MAX)
    return hi if 0 < lo <= hi and hi - lo <= 1e-8 * hi else None


def on_sphere(x: np.ndarray, radius: float) -> np.ndarray:
    """The radial projections R x / |x| of points x (n, d)."""
    return radius * x / np.linalg.norm(x, axis=1)[:, None]


def tangential(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    """P_x v = v - <v, u> u, u = x / |x|, row by row. P_x is symmetric: this is also
    the reverse mode of v -> P_x v."""
    u = x / np.linalg.norm(x, axis=1)[:, None]
    return v - np.einsum("nd,nd->n", v, u)[:, None] * u


def projection_vjp(x: np.ndarray, radius: float, ybar: np.ndarray) -> np.ndarray:
    """Reverse mode of y = R x / |x|: xbar = R P_x ybar / |x|."""
    return radius * tangential(x, ybar) / np.linalg.norm(x, axis=1)[:, None]


def tangential_position_vjp(x: np.ndarray, v: np.ndarray, radial: np.ndarray,
                            g: np.ndarray) -> np.ndarray:
    """d/dx of <g, P_x w> through P_x alone (w fixed), for v = P_x w and radial = <w, u>:
    -((g . u) v + radial P_x g) / |x|."""
    norm = np.linalg.norm(x, axis=1)[:, None]
    u = x / norm
    return -(np.einsum("nd,nd->n", g, u)[:, None] * v + radial[:, None] * tangential(x, g)) / norm


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
