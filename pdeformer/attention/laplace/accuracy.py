"""The errors of a table and its fine grid, and the bound on a velocity's error.

The table's estimate comes from the decay of its Chebyshev coefficients (computed by rows
divided over ranks, :mod:`.chebyshev`); the fine grid's is its largest difference to the
Chebyshev interpolant at sampled points; both reach every rank in one Allreduce
(:func:`assess`). :func:`velocity_bound` turns them, with the panel sums' error, into a
bound on the velocity's error relative to its largest value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ...tools.parallel import share
from ..softmax import value_gain
from .chebyshev import decay_fit, predicted_size, tail_estimate
from .panels import PANEL_BETA

if TYPE_CHECKING:
    from .fine_grids import FineGrid
    from .table import LaplaceTable


def error_samples(table: "LaplaceTable", samples: int = 400) -> np.ndarray:
    """Fixed pseudo-random points of the box (the same on every rank), where the fine
    grid is compared with the Chebyshev interpolant; each rank takes its share."""
    rng = np.random.default_rng(12345)
    return table.lo + (table.hi - table.lo) * rng.random((samples, table.d))


@dataclass
class Assessment:
    """Errors of a table (per group: the coefficient-tail estimate and the decay fit) and
    of its fine grid (per group, sampled), all relative to the group's largest value."""

    estimates: list
    fits: list            # (top, slope, intercept) per group
    fine: list | None
    extra: list = None    # numbers reduced along (assess's ``extra``)

    @property
    def estimate(self) -> float:
        return max(self.estimates)

    @property
    def fine_error(self) -> float:
        return max(self.fine) if self.fine is not None else 0.0

    def predicted(self, tol: float) -> float:
        """The size at which every group's extrapolated estimate meets tol."""
        return max(predicted_size(s, c, tol) for _, s, c in self.fits)


def own_samples(table: "LaplaceTable") -> np.ndarray:
    """This rank's share of :func:`error_samples`."""
    b = error_samples(table)
    return b[share(len(b), table.comm)]


def assess(table: "LaplaceTable", fine: FineGrid | None = None, check: np.ndarray | None = None,
           extra: list | None = None) -> Assessment:
    """The table's error estimate and, with ``fine``, the fine grid's sampled error at
    ``check``, this rank's check points (default :func:`own_samples`): each rank computes
    its share of coefficient rows and its check points, one Allreduce (MAX), which also
    carries the numbers ``extra`` (their maxima over ranks in ``Assessment.extra``)."""
    groups = len(table.groups)
    parts = [table.local_shells().ravel()]
    if fine is not None:
        parts.append(fine.local_errors(own_samples(table) if check is None else check))
    parts.append(np.asarray(extra or [], float))
    buf = np.concatenate(parts)
    table.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    shells = buf[:groups * table.n].reshape(groups, table.n)
    fits = [decay_fit(s) for s in shells]
    estimates = [tail_estimate(top, slope, table.n) for top, slope, _ in fits]
    end = groups * table.n + (groups if fine is not None else 0)
    return Assessment(estimates, fits, list(buf[groups * table.n:end]) if fine is not None else None,
                      list(buf[end:]))


FINE_SAMPLE_FACTOR = 2.5   # a fine grid's sampled error saw 0.4-0.8 of its largest over the
                           # b where it is used (fine_grid): 1/0.4 bounds the largest
PANEL_ROUNDING = math.exp(2 * PANEL_BETA) * 2.0**-52   # rounding of the panel sums, amplified
                           # by the variation e^{2 beta} of e^{b y} over a panel


def velocity_bound(table: "LaplaceTable", a: Assessment, V: np.ndarray, vmax: float,
                   kappa: float | None = None, M: float | None = None) -> float:
    """A bound on max_i |v_i - v_exact_i| / max_i |v_exact_i| for a velocity through
    ``table`` (its errors ``a``), heads' values V (H, d, d), vmax = max_i |v_i| over all
    ranks' targets; for signed weights kappa = max 1/|zeta| and M = max |m| at the targets.

    The error of m at any b of the box, absolutely: the table's coefficient-tail estimate
    plus FINE_SAMPLE_FACTOR times the fine grid's sampled error (both relative to the
    values' largest size s), plus the panel sums' error, relative per source term
    (the panels' eps and PANEL_ROUNDING): for m = sum w e^{by} y / sum w e^{by} that is at most
    (eps + rounding) x the sources' diameter. Signed weights: the errors of mu and zeta
    (their panel parts relative to N, so eps x max|y| and eps) through m = mu / zeta,
    (e_mu + M e_zeta) / (min |zeta| - e_zeta). Then |dv_i| <= (1/H) sum_h |V_h|_2 |dm| and
    max |v_exact| >= vmax - that. Pairs summed exactly (signed) only lower the error."""
    fine = a.fine if a.fine is not None else [0.0] * len(a.estimates)
    rel = [est + FINE_SAMPLE_FACTOR * f for est, f in zip(a.estimates, fine)]
    scales = table.group_scales()
    tiles = [t for t in table.layout.tiles if t.count]
    lo = np.min([t.lo for t in tiles], axis=0) if tiles else np.zeros(table.d)
    hi = np.max([t.hi for t in tiles], axis=0) if tiles else np.zeros(table.d)
    panel = table.layout.eps + PANEL_ROUNDING
    if not table.signed:
        err = rel[0] * scales[0] + panel * float(np.linalg.norm(hi - lo))
    elif not kappa > 0:      # every pair left out of the table (summed exactly)
        err = 0.0
    else:
        e_mu = rel[0] * scales[0] + panel * float(np.linalg.norm(np.maximum(np.abs(lo), np.abs(hi))))
        e_zeta = rel[1] * scales[1] + panel
        floor = 1.0 / kappa - e_zeta
        err = (e_mu + M * e_zeta) / floor if floor > 0 else math.inf
    dv = value_gain(V) * err
    if dv == 0.0:
        return 0.0
    if not vmax > dv:        # the velocity could be all error
        return math.inf
    return dv / (vmax - dv)
