r"""The log-Laplace table: m(b) = grad Lambda_rho(b) on a Chebyshev grid
(:class:`LaplaceTable`), for the sources of all ranks.

Lambda_rho(b) = log int e^{<b,y>} rho(y) dy depends on rho alone, so its gradient m(b) is
tabulated once on a tensor Chebyshev-Lobatto grid covering every b = A_h x, and each head
and target costs an interpolation: barycentric in each coordinate, (P x n) weights,
P = targets x heads. The sums that build it are :mod:`.table_sums`, its reverse mode
towards the sources :mod:`.table_reverse`; :meth:`LaplaceTable.local_shells` gives the
Chebyshev coefficients its error estimate is read from (:mod:`.accuracy`).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ...tools.parallel import allreduce_sum, share
from .. import compiled
from ..compiled import PANEL_QMAX
from ..costs import Costs, machine_costs
from .chebyshev import (barycentric_weights, chebyshev_lobatto, dct_matrix, differentiation_matrix,
                        shell_maxima)
from .head_sums import HeadSums
from .layout import SourceLayout
from .panels import PANEL_EPS
from .table_reverse import SourceCotangents
from .table_sums import TableSums


TILE_SUMS3_BYTES = 2**27   # 3-D: the per-tile sums (tiles x ncols x n^3 doubles) at most 128 MiB
EVERY_RANK = "every rank"   # lib argument: the compiled loops where every rank has them


def any_negative(weights: np.ndarray, comm) -> bool:
    """Whether some rank holds a negative weight (a signed density)."""
    return bool(comm.allreduce(bool(np.any(weights < 0)), op=MPI.LOR))


class LaplaceTable(TableSums, SourceCotangents, HeadSums):
    """The values of m(b) = grad Lambda(b) on a Chebyshev grid, for this rank's sources
    ``points``/``weights`` summed over ``comm``: m itself (``values``, d tables) for
    nonnegative weights; for ``signed`` ones (any negative weight on any rank; decided
    here if not given) mu = S_y / N and zeta = Z / N (d + 1 tables) with
    N = sum_j |w_j| e^{<b, y_j>}, m = mu / zeta at each point. ``layout``: a
    :class:`SourceLayout` of these points for this box (built if not given, with panels
    accurate to ``eps``). ``costs``: the seconds by which its tiles are summed directly
    or through panels and its fine grid is chosen (:mod:`pdeformer.attention.costs`: a
    run's are its context's; default this machine's, collective over ``comm``)."""

    assessment = None     # its errors, where assessed (:func:`~.accuracy.assess`)
    _group_scales = None  # group_scales, once found

    def __init__(self, points, weights, lo, hi, n: int, comm, signed: bool | None = None,
                 layout: SourceLayout | None = None, lib=EVERY_RANK, eps: float = PANEL_EPS,
                 costs: Costs | None = None):
        self.d = points.shape[1]
        if self.d > 3:
            raise ValueError("the laplace backend is implemented for d = 1, 2 and 3")
        self.comm, self.n = comm, n
        self.costs = machine_costs(comm) if costs is None else costs
        self.lo, self.hi = np.asarray(lo, float), np.asarray(hi, float)
        self.axes = [chebyshev_lobatto(n, a, b) for a, b in zip(self.lo, self.hi)]
        self.signed = any_negative(weights, comm) if signed is None else bool(signed)
        self.ncols = 2 + self.d if self.signed else 1 + self.d      # [w, w y, (|w|)]
        self.ncomp = self.d + 1 if self.signed else self.d           # [m] or [mu, zeta]
        self.layout = layout if layout is not None else SourceLayout(points, self.lo, self.hi, comm, eps)
        self.weights = weights
        tiles = len(self.layout.tiles)
        if self.d == 3 and tiles * self.ncols * n**3 * 8 > TILE_SUMS3_BYTES:   # the same on every rank
            raise FloatingPointError(f"attention too sharp for a 3-D laplace table ({tiles} tiles of "
                                     f"{n}^3 nodes)")
        # the compiled panel loops (d = 2), if every rank has them (a collective call unless given)
        if self.d != 2 or self.layout.q > PANEL_QMAX:
            self.lib = None
        else:
            self.lib = compiled.kernels_on(comm) if lib is EVERY_RANK else lib
        self._build()

    @property
    def nbytes(self) -> int:
        """Bytes of its own arrays (the layout, shared between tables, not counted)."""
        return self.values.nbytes + self._norms.nbytes

    @property
    def m(self) -> np.ndarray:
        """m on the grid nodes (d, grid): the values themselves for nonnegative weights
        (the same array), mu / zeta for signed ones."""
        return self.values if not self.signed else self.values[:self.d] / self.values[self.d]

    def group_scales(self) -> list:
        """The largest |value| of each group (the size errors are relative to); found
        once per table."""
        if self._group_scales is None:
            self._group_scales = [max(float(np.abs(self.values[g]).max()), 1e-300) for g in self.groups]
        return self._group_scales

    @property
    def groups(self) -> list:
        """Index ranges of the values whose errors are judged together: m; or mu, zeta."""
        d = self.d
        return [slice(0, d)] if not self.signed else [slice(0, d), slice(d, d + 1)]

    # ------------------------------------------------------------------ evaluation
    CHUNK = 2048  # points per block: the (chunk x n) weights stay in cache

    def _blocks(self, P: int, per_point: int = 0):
        """Slices of CHUNK points; fewer where each point takes ``per_point`` doubles of
        work arrays (3-D: tables x n^2), so that those stay near 16 MB."""
        chunk = self.CHUNK if per_point == 0 else max(16, min(self.CHUNK, 2**21 // per_point))
        for i0 in range(0, P, chunk):
            yield slice(i0, min(P, i0 + chunk))

    def _weights(self, b: np.ndarray) -> list:
        return [barycentric_weights(b[:, a], nodes, lam) for a, (nodes, lam) in enumerate(self.axes)]

    def evaluate(self, b: np.ndarray, tables) -> np.ndarray:
        """Interpolated values of tabulated functions (count, *grid) at points b (P, d) ->
        (P, count): W_1 T_k (W_2 row-wise), the tables read in place."""
        tables = np.asarray(tables)
        out = np.empty((b.shape[0], len(tables)))
        for blk in self._blocks(b.shape[0], len(tables) * self.n**2 if self.d == 3 else 0):
            W = self._weights(b[blk])
            if self.d == 1:
                out[blk] = W[0] @ tables.T
            elif self.d == 2:
                out[blk] = np.einsum("kpg,pg->pk", np.matmul(W[0], tables), W[1])
            else:                   # W_0 T_k as one product, then W_1, W_2 row-wise
                n = self.n
                R = np.matmul(W[0], tables.reshape(len(tables), n, n * n)).reshape(len(tables), -1, n, n)
                out[blk] = np.einsum("kpj,pj->pk", np.einsum("kpij,pi->kpj", R, W[1]), W[2])
        return out

    def derivative_tables(self) -> list:
        """d value_k / d b_a of the interpolant on the grid, [a][k] (differentiation matrices)."""
        out = []
        for a, (nodes, lam) in enumerate(self.axes):
            D = differentiation_matrix(nodes, lam)
            out.append([np.moveaxis(np.tensordot(D, v, axes=(1, a)), 0, a) for v in self.values])
        return out

    def interpolate(self, b: np.ndarray, jacobian: bool = False):
        """The table values at points b (P, d) -> (P, ncomp); with ``jacobian`` also their
        derivatives (P, ncomp, d) [k, a]."""
        nc, d, P = self.ncomp, self.d, b.shape[0]
        if not jacobian:
            return self.evaluate(b, self.values)
        tables = list(self.values) + [t for per_axis in self.derivative_tables() for t in per_axis]
        vals = self.evaluate(b, tables)
        return vals[:, :nc], vals[:, nc:].reshape(P, d, nc).transpose(0, 2, 1)

    def transpose(self, b: np.ndarray, cbar: np.ndarray) -> np.ndarray:
        """sum_p cbar[p, k] W(b_p) (the transposed interpolation), summed over ranks."""
        local = np.zeros(self.values.shape)
        for blk in self._blocks(b.shape[0], self.n**2 if self.d == 3 else 0):
            W = self._weights(b[blk])
            if self.d == 3:                      # (W_1 (x) W_2 row-wise) once for all k
                W12 = (W[1][:, :, None] * W[2][:, None, :]).reshape(len(W[1]), -1)
            for k in range(self.ncomp):
                if self.d == 1:
                    local[k] += W[0].T @ cbar[blk, k]
                elif self.d == 2:
                    local[k] += (W[0] * cbar[blk, k:k + 1]).T @ W[1]
                else:
                    local[k] += ((W[0] * cbar[blk, k:k + 1]).T @ W12).reshape(local[k].shape)
        allreduce_sum(self.comm, local)
        return local

    # ------------------------------------------------------------------ accuracy
    def local_shells(self) -> np.ndarray:
        """Per group (:attr:`groups`): the largest Chebyshev coefficient of each shell,
        relative to the group's largest value, over this rank's share of coefficient
        rows (d = 2, 3; max over ranks gives all of them). In 1-D every rank does it all."""
        n, D = self.n, dct_matrix(self.n)
        if self.d == 1:
            coef = np.abs(self.values @ D.T)                          # (ncomp, n)
        elif self.d == 2:
            rows = share(n, self.comm)
            coef = np.abs(np.matmul(np.matmul(D[rows], self.values), D.T))   # (ncomp, rows, n)
        else:
            rows = share(n, self.comm)
            c = np.matmul(D[rows], self.values.reshape(len(self.values), n, n * n))
            c = np.matmul(D, c.reshape(len(c), -1, n, n))             # axis 1
            coef = np.abs(np.matmul(c, D.T))                          # (ncomp, rows, n, n)
        out = np.zeros((len(self.groups), n))
        for i, (grp, scale) in enumerate(zip(self.groups, self.group_scales())):
            c = coef[grp].max(axis=0)
            out[i] = (c if self.d == 1 else shell_maxima(c, rows.start)) / scale
        return out
