"""The size search: a table on the rounded box whose error estimate meets tol
(:func:`choose_table`).

The grid size n is one whose error estimate meets tol, predicted from a trial table of a
subsample of the sources (:func:`subsample`: the same points whichever rank holds them,
so the search gives the same table on any number of ranks) and the fitted decay of its
Chebyshev coefficients; the table of all sources is then built at that size, and at
larger ones only while its own estimate misses tol.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .. import compiled
from .accuracy import assess
from .box import grid_box
from .chebyshev import N_MIN, N_MAX, size_index, table_sizes
from .layout import SourceLayout
from .panels import panel_eps
from .table import EVERY_RANK, LaplaceTable, any_negative


SUBSAMPLE = 4096  # sources the trial tables are built from
TRIAL_BUILDS = 1          # trial tables per search: the size follows from the first
PREDICTION_MARGIN = 1.25   # from the n = 33 table the fitted decay predicts 0.82-0.93 of
                           # the size needed (benchmark densities, 1-64 heads, tol 1e-8
                           # and 1e-5); a table that still misses tol is replaced by one
                           # of the size its own (resolved) decay predicts


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 values (wrapping arithmetic): a bijection whose
    every output bit depends on every input bit."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def coordinate_scale(points: np.ndarray, comm) -> float:
    """The power of two at or above the largest |coordinate| of all ranks' points, less
    a 2^-20 margin (1 where there are none or all are 0): :func:`subsample`'s scale, the
    same on every rank. The margin keeps a mesh's corner at 4 computed as 4(1 + 2^-52)
    on some partition from doubling the scale."""
    local = float(np.max(np.abs(points))) if points.size else 0.0
    largest = comm.allreduce(local if np.isfinite(local) else 0.0, op=MPI.MAX)
    return float(2.0 ** np.ceil(np.log2(largest * (1.0 - 2.0 ** -20)))) if largest > 0 else 1.0


QUANTUM_BITS = 24   # subsample's grid: 2^-24 of the coordinates' scale


def subsample(points: np.ndarray, fraction: float, scale: float) -> np.ndarray:
    """Mask of about ``fraction`` of the points, the same points whichever rank holds
    them: a point is kept where the hash of its coordinates (mix64, coordinate by
    coordinate) is below fraction 2^64, as a uniform draw would be. The coordinates
    are hashed as integers on a grid of 2^-QUANTUM_BITS ``scale`` (a power of two
    that all ranks share, :func:`coordinate_scale`): the same node computed on another
    partition (its cell's vertices in another order) differs in the last bits of a
    double, or is 1e-17 where it is 0 on another, and must be picked alike."""
    if fraction >= 1.0:
        return np.ones(len(points), bool)
    grid = np.rint(np.asarray(points, dtype=np.float64) * (2.0 ** QUANTUM_BITS / scale))
    bits = np.ascontiguousarray(grid.astype(np.int64)).view(np.uint64)
    h = np.zeros(len(points), np.uint64)
    for a in range(bits.shape[1]):
        h = mix64(h ^ bits[:, a])
    return h < np.uint64(int(fraction * 2.0 ** 64))


def choose_table(points, weights, b_lo, b_hi, comm, tol: float, n_max: int = N_MAX,
                 signed: bool | None = None, layout: SourceLayout | None = None, lib=EVERY_RANK,
                 start: int | None = None, costs=None):
    """A table on the rounded box whose error estimate meets ``tol``; returns (table,
    estimate); ``table.assessment`` holds the errors per group. Sizes come from SIZES (up
    to n_max). Without ``start`` (an index into the sizes) the size is searched on trial
    tables of a subsample of the sources (about SUBSAMPLE of them; all when there are
    fewer), starting at 33 (3-D: 25, sizes from SIZES3) and jumping to PREDICTION_MARGIN
    times (3-D: once, where a step costs n^3) the size where the
    fitted coefficient decay predicts tol (TRIAL_BUILDS trial tables; the last prediction
    is taken without building); the table of all sources is then built at that size, and
    larger ones only while its own estimate misses tol. The search depends on the
    sources and the box alone, so the same inputs give the same table on any number of
    ranks. If no size meets tol, the largest is returned with its estimate (the caller
    decides). ``costs``: the tables' (:class:`~.table.LaplaceTable`)."""
    lo, hi = grid_box(np.asarray(b_lo, float), np.asarray(b_hi, float))
    d = points.shape[1]
    sizes = [n for n in table_sizes(d) if n <= n_max] or [N_MIN]
    if signed is None:
        signed = any_negative(weights, comm)
    if lib is EVERY_RANK:
        lib = compiled.kernels_on(comm) if points.shape[1] > 1 else None
    eps = layout.eps if layout is not None else panel_eps(tol)
    # extrapolated from the coarse first table the prediction falls short
    search = _SizeSearch(lo, hi, sizes, comm, tol, signed, lib, eps,
                         first_margin=PREDICTION_MARGIN if start is None and d < 3 else 1.0, costs=costs)
    opening = 25 if d == 3 else 33
    i = start if start is not None else (sizes.index(opening) if opening in sizes else 0)
    i = min(i, len(sizes) - 1)
    total = comm.allreduce(len(points), op=MPI.SUM)
    if start is None and total > 2 * SUBSAMPLE:
        i = search.predicted_on_subsample(points, weights, i, total)
    _, table, est = search.run(points, weights, i, layout)
    return table, est


class _SizeSearch:
    """Tables of given sources on the box [lo, hi] at growing sizes (indices into
    ``sizes``) until the error estimate meets ``tol``: after each table that misses it,
    the size its fitted coefficient decay predicts (times ``first_margin`` after the first
    table), at least the next one."""

    def __init__(self, lo, hi, sizes: list, comm, tol: float, signed: bool, lib, eps,
                 first_margin: float, costs=None):
        self.lo, self.hi, self.sizes, self.comm, self.tol = lo, hi, sizes, comm, tol
        self.signed, self.lib, self.eps, self.first_margin = signed, lib, eps, first_margin
        self.costs = costs

    def run(self, pts, w, i: int, lay, builds: int | None = None):
        """(index, table, estimate): build at sizes[i], then at larger sizes (at least the
        predicted one) until tol or the largest size; after ``builds`` tables that miss
        it, (the predicted index, None, None) without building."""
        sizes, tol, first = self.sizes, self.tol, i
        while True:
            table = LaplaceTable(pts, w, self.lo, self.hi, sizes[i], self.comm, self.signed, lay, self.lib,
                                 self.eps, self.costs)
            lay = table.layout
            table.assessment = assess(table)
            est = table.assessment.estimate
            if est <= tol or i + 1 == len(sizes):
                return i, table, est
            margin = self.first_margin if i == first else 1.0
            i = size_index(margin * table.assessment.predicted(tol), sizes, i + 1)
            if builds is not None:
                builds -= 1
                if builds == 0:
                    return i, None, None

    def predicted_on_subsample(self, points, weights, i: int, total: int) -> int:
        """The size index that trial tables of about SUBSAMPLE of the ``total`` sources
        (:func:`subsample`), starting at index i, predict (TRIAL_BUILDS of them); i where
        the subsample is degenerate (under SUBSAMPLE / 4 points, or a vanishing N)."""
        comm = self.comm
        keep = subsample(points, SUBSAMPLE / total, coordinate_scale(points, comm))
        if comm.allreduce(int(keep.sum()), op=MPI.SUM) >= SUBSAMPLE // 4:   # not degenerate
            try:
                i, _, _ = self.run(points[keep], weights[keep], i, None, builds=TRIAL_BUILDS)
            except FloatingPointError:   # the subsample's N may vanish
                pass
        return i
