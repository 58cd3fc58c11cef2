"""The fine grid: a second level of interpolation for many points (d = 2, 3).

The table's Chebyshev interpolant is sampled on a uniform nf^d grid (its rows divided
over ranks and all-gathered) and interpolated locally by degree-5 Lagrange polynomials
(:class:`FineGrid`; a compiled loop where a C compiler is at hand, kernels/fine_loops.h
and kernels/fine3_loops.h), so the cost per point does not grow with n. Its size is
chosen so that its error against the Chebyshev interpolant meets tol (:func:`fine_grid`).
"""

from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI

from ...tools.parallel import allgather_shares, allreduce_sum, reduce_shares, share
from .. import compiled
from ..compiled import KERNEL_DEGREE, fine_velocity, fine_velocity_vjp
from .accuracy import own_samples
from .chebyshev import barycentric_weights, chebyshev_lobatto
from .cost_model import fine_from
from .head_sums import ZETA_MIN, HeadSums
from .table import EVERY_RANK, LaplaceTable


@functools.lru_cache(maxsize=64)
def sampling_matrix(lo: float, hi: float, n: int, nf: int) -> np.ndarray:
    """S (nf x n): the values at nf uniform points of [lo, hi] of the polynomial through n
    Chebyshev-Lobatto values (kept: a plan's fine grid is built at every evaluation)."""
    nodes, lam = chebyshev_lobatto(n, lo, hi)
    S = barycentric_weights(lo + (hi - lo) / (nf - 1) * np.arange(nf), nodes, lam)
    S.flags.writeable = False
    return S


class FineGrid(HeadSums):
    """Second level for many points (d = 2, 3): the table's Chebyshev interpolant sampled
    on a uniform nf^d grid (d small matrix products, rows divided over ranks and
    all-gathered), then interpolated locally by tensor Lagrange polynomials of degree
    P_LOCAL (P_LOCAL + 1 points per axis). The cost per point does not grow with n; the
    map stays piecewise polynomial, and its reverse mode is the exact transpose
    (scatter-add, then the transposed sampling). Each node holds the table's values
    interleaved: in 2-D (m_0, m_1), or (mu_0, mu_1, zeta, 0) for signed weights; in 3-D
    (m_0, m_1, m_2, 0) or (mu_0, mu_1, mu_2, zeta) (one vector of four)."""

    P_LOCAL = 5

    def __init__(self, table: "LaplaceTable", nf: int, lib=EVERY_RANK):
        p = self.P_LOCAL
        if nf < p + 1:
            raise ValueError(f"FineGrid: nf = {nf} points per axis, the stencil needs {p + 1}")
        self.table, self.nf, self.d, self.signed = table, nf, table.d, table.signed
        self.width = 4 if table.signed or table.d == 3 else 2   # values per node (the compiled layouts)
        self.h = (table.hi - table.lo) / (nf - 1)
        # S_a (nf x n): the Chebyshev interpolant's values at the uniform points of axis a
        self.sample = [sampling_matrix(lo, hi, table.n, nf) for lo, hi in zip(table.lo, table.hi)]
        self.flat = self._sampled()
        self._den = np.array([np.prod([a - c for c in range(p + 1) if c != a]) for a in range(p + 1)])
        # the compiled loop, if every rank has it (a collective call unless given)
        self.lib = compiled.kernels_on(table.comm) if lib is EVERY_RANK else lib
        if p != KERNEL_DEGREE:
            self.lib = None

    @property
    def nbytes(self) -> int:
        """Bytes of its values (its table's not counted)."""
        return self.flat.nbytes

    def _sampled(self) -> np.ndarray:
        """The values on the fine grid, (nf^d, width): this rank's rows, then all."""
        nf, n, comm, S = self.nf, self.table.n, self.table.comm, self.sample
        rows = share(nf, comm)
        V = self.table.values
        if self.d == 2:
            values = np.matmul(np.matmul(S[0][rows], V), S[1].T)          # (nc, rows, nf)
        else:
            values = np.matmul(S[0][rows], V.reshape(len(V), n, n * n)).reshape(len(V), -1, n, n)
            values = np.matmul(S[1], np.matmul(values, S[2].T))            # (nc, rows, nf, nf)
        values = np.moveaxis(values, 0, -1)
        values = allgather_shares(comm, np.ascontiguousarray(values), nf)
        values = values.reshape(nf ** self.d, -1)
        if values.shape[1] == self.width:
            return values
        flat = np.zeros((nf ** self.d, self.width))
        flat[:, :values.shape[1]] = values
        return flat

    def _locate(self, b: np.ndarray):
        """Flat indices of the stencils' nodes (P, p+1, ..., p+1), local Lagrange weights and
        their t-derivatives per axis: L_a = prod_{c != a} (t - c) / den_a through prefix
        and suffix products, and L_a' by the product rule on both (products only, so exact
        on the nodes too; the compiled loop does the same)."""
        p, nf, d = self.P_LOCAL, self.nf, self.d
        t = (b - self.table.lo) / self.h                     # grid coordinates
        start = np.clip(np.floor(t).astype(int) - (p - 1) // 2, 0, nf - 1 - p)
        L, dL = [], []
        c = np.arange(p + 1)
        idx = np.zeros((len(b),) + (1,) * d, dtype=np.int64)
        for a in range(d):
            x = (t[:, a] - start[:, a])[:, None] - c          # (P, p+1): t - c
            pre, dpre = np.ones_like(x), np.zeros_like(x)     # prod_{c < k}, its derivative
            suf, dsuf = np.ones_like(x), np.zeros_like(x)     # prod_{c > k}
            for k in range(1, p + 1):
                pre[:, k] = pre[:, k - 1] * x[:, k - 1]
                dpre[:, k] = dpre[:, k - 1] * x[:, k - 1] + pre[:, k - 1]
                j = p - k
                suf[:, j] = suf[:, j + 1] * x[:, j + 1]
                dsuf[:, j] = dsuf[:, j + 1] * x[:, j + 1] + suf[:, j + 1]
            L.append(pre * suf / self._den)
            dL.append((dpre * suf + pre * dsuf) / self._den)
            shape = (len(b),) + (1,) * a + (p + 1,) + (1,) * (d - 1 - a)
            idx = idx * nf + (start[:, a][:, None] + c).reshape(shape)
        return idx, L, dL

    def interpolate(self, b: np.ndarray, jacobian: bool = False):
        """As LaplaceTable.interpolate, for this two-level interpolant (numpy)."""
        nc, P, d = self.table.ncomp, b.shape[0], self.d
        c = np.empty((P, nc))
        Jc = np.empty((P, nc, d)) if jacobian else None
        for blk in self.table._blocks(P):
            idx, L, dL = self._locate(b[blk])
            g = self.flat[idx][..., :nc]                      # (P, p+1, .., p+1, nc)
            if d == 2:
                g2 = np.einsum("pack,pc->pak", g, L[1])
                c[blk] = np.einsum("pak,pa->pk", g2, L[0])
                if jacobian:
                    Jc[blk, :, 0] = np.einsum("pak,pa->pk", g2, dL[0]) / self.h[0]
                    Jc[blk, :, 1] = np.einsum("pack,pc,pa->pk", g, dL[1], L[0]) / self.h[1]
                continue
            g2 = np.einsum("pabck,pc->pabk", g, L[2])
            g1 = np.einsum("pabk,pb->pak", g2, L[1])
            c[blk] = np.einsum("pak,pa->pk", g1, L[0])
            if jacobian:
                Jc[blk, :, 0] = np.einsum("pak,pa->pk", g1, dL[0]) / self.h[0]
                Jc[blk, :, 1] = np.einsum("pabk,pb,pa->pk", g2, dL[1], L[0]) / self.h[1]
                Jc[blk, :, 2] = np.einsum("pabck,pc,pb,pa->pk", g, dL[2], L[1], L[0]) / self.h[2]
        return c if not jacobian else (c, Jc)

    def transpose(self, b: np.ndarray, cbar: np.ndarray) -> np.ndarray:
        """As LaplaceTable.transpose: scatter-add onto the fine grid, then the transposed
        sampling."""
        size = self.nf ** self.d
        acc = np.zeros((size, self.width))
        for blk in self.table._blocks(b.shape[0]):
            idx, L, _ = self._locate(b[blk])
            w = L[0]
            for La in L[1:]:
                w = (w[..., None] * La.reshape((len(La),) + (1,) * (w.ndim - 1) + (-1,)))
            w = w.reshape(len(idx), -1)
            for k in range(self.table.ncomp):
                acc[:, k] += np.bincount(idx.reshape(len(idx), -1).ravel(),
                                      (w * cbar[blk, k:k + 1]).ravel(), minlength=size)
        return self._table_cotangent(acc)

    def velocity(self, x, A, V):
        lib = self.lib
        if lib is None:
            return super().velocity(x, A, V)
        if not self.signed:
            return fine_velocity(lib, self.flat, self.nf, self.table.lo, self.h, self.P_LOCAL, x, A, V,
                                 signed=False)
        self.conditioning = np.zeros(2)
        v, self.skipped = fine_velocity(lib, self.flat, self.nf, self.table.lo, self.h, self.P_LOCAL,
                                        x, A, V, self.conditioning, ZETA_MIN, signed=True)
        return v

    def velocity_vjp(self, x, A, V, g, positions: bool = False):
        lib = self.lib
        if lib is None:
            return super().velocity_vjp(x, A, V, g, positions)
        acc, dA, dV, xbar = fine_velocity_vjp(lib, self.flat, self.nf, self.table.lo, self.h,
                                              self.P_LOCAL, x, A, V, g, positions, ZETA_MIN, self.signed)
        return self._table_cotangent(acc), dA, dV, xbar

    def _table_cotangent(self, acc: np.ndarray) -> np.ndarray:
        """Fine-grid cotangents (nf^d, width) of this rank's targets, node by node, to table
        cotangents (ncomp, n, ..), summed over ranks: the fine-grid sums are reduced onto
        each rank's share of rows (Reduce_scatter; rows are contiguous, so where a node
        holds ncomp values it is sent as it is), which it samples back (S_0^T (X S_1), and
        S_2 in 3-D: both products on its rows only), then one Allreduce of the tables."""
        nf, nc, comm, S, d = self.nf, self.table.ncomp, self.table.comm, self.sample, self.d
        X = reduce_shares(comm, acc.reshape(nf, nf ** (d - 1), -1)[..., :nc])      # (rows, nf^(d-1), nc)
        X = np.ascontiguousarray(np.moveaxis(X, -1, 0)).reshape((nc, len(X)) + (nf,) * (d - 1))
        S0 = self.sample[0][share(nf, comm)]
        if d == 2:
            local = np.matmul(S0.T, np.matmul(X, S[1]))
        else:
            n = self.table.n
            Y = np.matmul(S[1].T, np.matmul(X, S[2]))                            # (nc, rows, n, n)
            local = np.matmul(S0.T, Y.reshape(nc, len(S0), n * n)).reshape(nc, n, n, n)
        allreduce_sum(comm, local)
        return local

    def local_errors(self, b: np.ndarray) -> np.ndarray:
        """Per group (LaplaceTable.groups): the largest difference to the Chebyshev
        interpolant at the points b, relative to the group's largest table value."""
        t = self.table
        out = np.zeros(len(t.groups))
        if len(b) == 0:
            return out
        diff = np.abs(self.interpolate(b) - t.interpolate(b))
        for i, (grp, scale) in enumerate(zip(t.groups, t.group_scales())):
            out[i] = diff[:, grp].max() / scale
        return out

    def error(self, check: np.ndarray | None = None) -> float:
        """The largest relative difference to the Chebyshev interpolant over all ranks'
        check points (this rank's: ``check``, default :func:`own_samples`) and the groups;
        one Allreduce."""
        local = self.local_errors(own_samples(self.table) if check is None else check)
        self.table.comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
        return float(local.max())


FINE_MAX = 8       # the fine grid has at most FINE_MAX n points per axis
FINE3_BYTES = 2**27   # and in 3-D at most 128 MiB of values (nf <= 161)


def fine_limit(table: "LaplaceTable") -> int:
    """The most points per axis of a fine grid for this table."""
    if table.d < 3:
        return FINE_MAX * table.n
    return min(FINE_MAX * table.n, int((FINE3_BYTES / 32) ** (1 / 3)))


def fine_grid(table: "LaplaceTable", tol: float, nf: int | None = None, lib=EVERY_RANK,
              check: np.ndarray | None = None):
    """A FineGrid whose local error is below tol/2 (its sampled estimate below tol/4), or
    None when interpolating directly from the table is the better choice (or nothing up
    to :func:`fine_limit` meets it). The size: the error of local degree-p interpolation falls
    like h^(p+1), so from the error e_1 of the grid with n points per axis the grid with
    n (4 e_1 / tol)^(1/(p+1)) points should meet tol/4 (measured e_1/e_2 = 55-66 against
    64 for p = 5); it is built with 10% to spare, checked, and enlarged by 1.25 while it
    misses. With ``nf``: that grid, unchecked. ``check``: this rank's check points
    (default :func:`own_samples`)."""
    if table.d == 1:
        return None
    if lib is EVERY_RANK:
        lib = compiled.kernels_on(table.comm)      # one collective call for all candidates
    if nf is not None:
        return FineGrid(table, nf, lib)
    if table.n < fine_from(lib, table.costs, table.d):
        return None
    # the local error is to stay below tol/2; its sampled estimate saw 0.4-0.8 of the
    # largest error over all b of the benchmark's targets, so the samples must show tol/4
    goal = tol / 4
    size = table.n
    while size <= fine_limit(table):
        fg = FineGrid(table, int(np.ceil(size)), lib)
        err = fg.error(check)
        if err <= goal:
            return fg
        if size == table.n:
            p1 = FineGrid.P_LOCAL + 1
            size = table.n * 1.1 * (err / goal) ** (1.0 / p1) if np.isfinite(err) else np.inf
        else:
            size *= 1.25
    return None
