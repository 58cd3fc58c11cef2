"""Where this rank's sources lie for one table box: tiles, their panels and this rank's
window of them, and the shifted per-axis factors at the panel nodes.

Log-domain safety: every factor e^{b_g y - shift_g} is shifted by its largest exponent
over the tile's sources (so it is <= 1), and the sources are split into tiles small
enough that the product of two shifted factors cannot underflow (|b| x tile extent
bounded by UNDERFLOW_GAP); the tables combine the tiles by log-sum-exp. Each rank spreads
its own sources onto the panels they touch only (its window), so the table products
divide over ranks like the sources.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ...tools.parallel import share
from .panels import PANEL_EPS, Panels, panel_degree


UNDERFLOW_GAP = 600.0   # keep every shifted exponent above e^-600 (float64 ~ e^-708)
MAX_TILES = 4096


def coordinate_range(points: np.ndarray, comm) -> tuple[np.ndarray, np.ndarray]:
    """Per-axis min and max of the points of all ranks (inf, -inf where there are none):
    one Allreduce of (-min, max)."""
    d = points.shape[1]
    local = np.concatenate([-points.min(axis=0), points.max(axis=0)]) if len(points) \
        else np.full(2 * d, -np.inf)
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return -local[:d], local[d:]


class Tile:
    """Sources of one tile: this rank's (``index`` into its points, ``pts``), the tile's
    coordinate range and count over all ranks, its panels (None without sources), this
    rank's window of them (``local_panels``: the panels its own sources touch, from
    panel ``first`` on) and, in 2-D, per panel row of the window the range of panel
    columns its sources touch (``row_cols``: (row, first column, last column), relative to
    the window): the blocks of the spread that are not zero. In 2-D the table
    products keep the axis with fewer panel nodes (``lead``, the same on every rank)
    between their two steps, so the sums the ranks exchange are (its nodes) x n; rows of
    ``row_cols`` run along ``lead`` (for ``lead`` = 1 the tile is seen transposed,
    :meth:`oriented`)."""

    def __init__(self, index, pts, lo, hi, count, panels):
        self.index, self.pts, self.lo, self.hi, self.count = index, pts, lo, hi, count
        self.panels = panels
        self.first = self.local_panels = self.row_cols = None
        self.lead = 0
        if panels is not None and len(panels) == 2:
            self.lead = int(len(panels[0].nodes) > len(panels[1].nodes))
        if panels is not None and len(pts):
            p = [pa.index(pts[:, a]) for a, pa in enumerate(panels)]
            self.first = [int(pa.min()) for pa in p]
            self.local_panels = [pa.window(f, int(pi.max())) for pa, f, pi in zip(panels, self.first, p)]
            if len(panels) == 2:
                a, b = self.lead, 1 - self.lead
                r, c = p[a] - self.first[a], p[b] - self.first[b]
                lo, hi = np.full(self.local_panels[a].count, c.max() + 1), np.full(self.local_panels[a].count, -1)
                np.minimum.at(lo, r, c)
                np.maximum.at(hi, r, c)
                self.row_cols = [(i, int(lo[i]), int(hi[i])) for i in np.flatnonzero(hi >= 0)]

    def oriented(self, pair):
        """A pair over the axes (panels, windows, factors) in the order (lead, other)."""
        return pair if pair is None or self.lead == 0 else [pair[1], pair[0]]


class SourceLayout:
    """Where this rank's sources lie for one table box: tiles of the sources' bounding
    box small enough that no shifted product of per-axis factors underflows
    (max|b| x tile extent <= UNDERFLOW_GAP per axis), each with its range and count over
    all ranks and its panels. Depends on the points and the box only, not on n or the
    weights, so one is built per box and reused while the points stay; per table size
    the shifts and the shifted factors at this rank's panel nodes are kept too."""

    FACTOR_SIZES = 3     # table sizes whose factors are kept

    def __init__(self, points: np.ndarray, lo, hi, comm, eps: float = PANEL_EPS):
        self.points, self.comm, self.eps = points, comm, eps
        d = self.d = points.shape[1]
        self.lo, self.hi = np.asarray(lo, float), np.asarray(hi, float)
        bmax = np.maximum(np.abs(self.lo), np.abs(self.hi))
        glo, ghi = coordinate_range(points, comm)
        counts = np.maximum(1, np.ceil(bmax * (ghi - glo) * d / UNDERFLOW_GAP))
        if not np.all(np.isfinite(counts)) or np.prod(counts) > MAX_TILES:
            raise FloatingPointError(f"attention too sharp for a laplace table (|b| up to {bmax.max():.3g})")
        counts = counts.astype(int)
        ntiles = int(np.prod(counts))
        index = np.zeros(len(points), int)
        for a in range(d):
            edges = np.linspace(glo[a], ghi[a], counts[a] + 1)
            i = np.clip(np.searchsorted(edges, points[:, a], side="right") - 1, 0, counts[a] - 1)
            index = index * counts[a] + i
        order = np.argsort(index, kind="stable")
        bounds = np.searchsorted(index[order], np.arange(ntiles + 1))
        mine = [order[bounds[t]:bounds[t + 1]] for t in range(ntiles)]
        # every tile's range and count over all ranks: one Allreduce
        ext = np.full((ntiles, 2 * d + 1), -np.inf)
        for t, i in enumerate(mine):
            if len(i):
                ext[t, :d], ext[t, d:2 * d] = -points[i].min(axis=0), points[i].max(axis=0)
            ext[t, 2 * d] = len(i)
        total = ext[:, 2 * d].copy()
        comm.Allreduce(MPI.IN_PLACE, ext, op=MPI.MAX)       # ranges
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)     # counts
        q = self.q = panel_degree(eps=eps)
        self.tiles = []
        for t, i in enumerate(mine):
            tlo, thi, count = -ext[t, :d], ext[t, d:2 * d], int(total[t])
            panels = [Panels(tlo[a], thi[a], bmax[a], q) for a in range(d)] if count else None
            self.tiles.append(Tile(i, points[i], tlo, thi, count, panels))
        self._factors: dict = {}

    def factors(self, axes: list) -> list:
        """Per tile, for the grid ``axes``: (shifts, E, E0) with shifts_a[g] = max over the
        tile of b_g y_a (so every e^{b_g y_a - shift} <= 1), E_a = e^{b_g yhat_k - shift_a[g]}
        at this rank's panel nodes yhat (n x window; None where it has no sources there)
        and E0 the factor of the tile's ``lead`` axis at this rank's share (:func:`share`)
        of its panel nodes (2-D; the rows of the table products it multiplies)."""
        key = (len(axes[0][0]), axes[0][0][0], axes[0][0][-1])
        if key not in self._factors:
            if len(self._factors) >= self.FACTOR_SIZES:
                self._factors.pop(next(iter(self._factors)))
            out = []
            for tile in self.tiles:
                if tile.count == 0:
                    out.append(([np.zeros(len(nodes)) for nodes, _ in axes], None, None))
                    continue
                shifts = [np.maximum(nodes * tile.lo[a], nodes * tile.hi[a])
                          for a, (nodes, _) in enumerate(axes)]
                E = None
                if tile.local_panels is not None:
                    E = [_factor(nodes, pa.nodes, sh) for (nodes, _), pa, sh in
                         zip(axes, tile.local_panels, shifts)]
                E0 = None
                if self.d == 2:
                    a = tile.lead
                    lead = tile.panels[a].nodes
                    E0 = _factor(axes[a][0], lead[share(len(lead), self.comm)], shifts[a])
                out.append((shifts, E, E0))
            self._factors[key] = out
        return self._factors[key]


def _factor(nodes: np.ndarray, points: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """e^{b_g y_k - shift_g} (len(nodes) x len(points)) for grid nodes b and points y."""
    r = np.multiply.outer(nodes, points)
    r -= shift[:, None]
    return np.exp(r, out=r)
