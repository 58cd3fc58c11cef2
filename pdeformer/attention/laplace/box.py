"""The table's box in b: the range of b = A_h x over the heads and all ranks' targets
(:func:`b_range`, through the targets that can be extreme, :func:`hull_candidates`),
rounded outward to a dyadic lattice (:func:`grid_box`), so that box and table size stay
fixed under small changes of the heads and the interpolated map is smooth in them
(gradients are exact for it)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI


def grid_box(b_lo: np.ndarray, b_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The b-range rounded outward to a dyadic lattice (about 1/64 of its width) plus one
    lattice step: the same box for small changes of the heads, at most 6% wider."""
    width = np.maximum(b_hi - b_lo, 0.5)
    step = 2.0 ** np.floor(np.log2(width / 64))
    return np.floor(b_lo / step) * step - step, np.ceil(b_hi / step) * step + step


B_RANGE_BLOCK = 4096  # targets per product in b_range


def hull_candidates(points: np.ndarray) -> np.ndarray:
    """The points that can be extreme for a linear functional (d = 2): all but those
    strictly inside the polygon of the extreme points in eight directions (Akl-Toussaint).
    A point inside is a convex combination of the polygon's corners, so no functional
    is larger there than at a corner; a margin of 1e-9 relative to the extent keeps
    points near an edge whatever the rounding."""
    if points.shape[1] != 2 or len(points) < 64:
        return points
    ang = np.pi / 4 * np.arange(8)
    proj = np.stack([np.cos(ang), np.sin(ang)], axis=1) @ points.T   # (8, N)
    top = np.argmax(proj, axis=1)
    corners = points[top]                                           # counter-clockwise
    width = proj[np.arange(8), top] + proj[(np.arange(8) + 4) % 8, top[(np.arange(8) + 4) % 8]]
    scale = float(np.max(width))
    if not np.isfinite(scale) or scale == 0.0:
        return points
    edges = np.roll(corners, -1, axis=0) - corners
    keep = np.any(edges != 0, axis=1)                               # repeated corners
    edges, corners = edges[keep], corners[keep]
    if len(edges) < 3:
        return points
    # cross(edge_k, x - corner_k) for all k at once: normals x + offsets
    normals = np.stack([-edges[:, 1], edges[:, 0]], axis=1)         # (K, 2)
    offsets = edges[:, 1] * corners[:, 0] - edges[:, 0] * corners[:, 1]
    margin = 1e-9 * scale * np.hypot(edges[:, 0], edges[:, 1])
    inside = np.logical_and.reduce(normals @ points.T > (margin - offsets)[:, None], axis=0)
    return np.concatenate([points[~inside], corners])


def b_range(targets: np.ndarray, A: np.ndarray, comm) -> tuple[np.ndarray, np.ndarray]:
    """min and max over heads, this rank's targets and all ranks of b = A_h x (over the
    targets that can be extreme, :func:`hull_candidates`)."""
    H, d = A.shape[0], A.shape[1]
    if H * d > 8:                          # the product costs more than the eight directions
        targets = hull_candidates(targets)
    rows = A.reshape(H * d, d).T
    lo, hi = np.full(H * d, np.inf), np.full(H * d, -np.inf)
    for i0 in range(0, targets.shape[0], B_RANGE_BLOCK):   # (block, H d) products in cache
        b = targets[i0:i0 + B_RANGE_BLOCK] @ rows
        np.minimum(lo, b.min(axis=0), out=lo)
        np.maximum(hi, b.max(axis=0), out=hi)
    lo, hi = lo.reshape(H, d).min(axis=0), hi.reshape(H, d).max(axis=0)
    glo, ghi = np.empty(d), np.empty(d)
    comm.Allreduce(lo, glo, op=MPI.MIN)
    comm.Allreduce(hi, ghi, op=MPI.MAX)
    return glo, ghi
