"""The velocity of all heads from an interpolant of the table values,
v(x) = (1/H) sum_h V_h m(A_h x), and its reverse mode (:class:`HeadSums`), shared by the
table (:class:`~.table.LaplaceTable`) and its fine grid (:class:`~.fine_grids.FineGrid`).

Signed weights (DG without the limiter dips below zero): Z may change sign in parts of
the box that no target reaches, so m = S_y / Z has poles there. The table then holds
mu = S_y / N and zeta = Z / N with N = sum_j |w_j| e^{<b,y_j>} > 0 -- both smooth and
bounded -- and m = mu / zeta is taken at each point; pairs (head, target) with
|zeta| < ZETA_MIN are left to exact sums (:mod:`.exact_pairs`).
"""

from __future__ import annotations

import numpy as np


ZETA_MIN = 0.5          # signed weights: pairs (head, target) with |zeta| < ZETA_MIN are summed
                        # exactly (m = mu / zeta would amplify the table's error by 1/|zeta|)


def _ratio(c, Jc, u, d: int, signed: bool):
    """m (and with Jc its Jacobian J[k, a] = dm_k/db_a, with u the cotangent of the table
    values at the points) from the interpolated values c (P, ncomp) and their Jacobians
    Jc (P, ncomp, d): m = c for nonnegative weights; m = mu / zeta for signed ones,
    J = (J_mu - m J_zeta^T) / zeta and the value cotangents (u / zeta, -(u . m) / zeta)."""
    if not signed:
        return c, Jc, u
    z = c[:, d]
    m = c[:, :d] / z[:, None]
    if Jc is None:
        return m, None, None
    J = (Jc[:, :d, :] - m[:, :, None] * Jc[:, d, None, :]) / z[:, None, None]
    cbar = None if u is None else np.column_stack([u / z[:, None], -np.einsum("pk,pk->p", u, m) / z])
    return m, J, cbar


class HeadSums:
    """The velocity of all heads from an interpolant of the table values (numpy; FineGrid
    may override): v(x) = (1/H) sum_h V_h m(A_h x) and its reverse mode. Subclasses give
    :meth:`interpolate` (values and Jacobians at points) and :meth:`transpose` (the
    transposed interpolation of value cotangents, summed over ranks)."""

    d: int
    signed: bool
    conditioning = None   # after a velocity of signed weights: (max 1/|zeta|, max |m|), this rank
    skipped = None        # after a velocity of signed weights: its pairs h N + i with
                          # |zeta| < ZETA_MIN, left out (summed exactly by the caller)

    def means(self, b: np.ndarray) -> np.ndarray:
        """m at points b (P, d)."""
        return _ratio(self.interpolate(b), None, None, self.d, self.signed)[0]

    def jacobians(self, b: np.ndarray) -> np.ndarray:
        """d m_k / d b_a at points b: (P, d, d) [k, a]."""
        return _ratio(*self.interpolate(b, jacobian=True), None, self.d, self.signed)[1]

    def reverse(self, b: np.ndarray, u: np.ndarray):
        """One pass over the points b (P, d) with cotangents u (P, d) of m(b): m (P, d),
        the Jacobians dm/db (P, d, d) [k, a] and the table cotangent (summed over ranks)."""
        m, J, cbar = _ratio(*self.interpolate(b, jacobian=True), u, self.d, self.signed)
        return m, J, self.transpose(b, cbar)

    def _left_out(self, c: np.ndarray) -> np.ndarray | None:
        """Signed weights: the pairs whose |zeta| < ZETA_MIN (the table leaves them out)."""
        return np.abs(c[:, self.d]) < ZETA_MIN if self.signed else None

    def velocity(self, x: np.ndarray, A: np.ndarray, V: np.ndarray) -> np.ndarray:
        """v at this rank's targets x (N, d) for heads A, V (H, d, d); signed weights:
        without the pairs of :attr:`skipped`."""
        H, N, d = A.shape[0], x.shape[0], A.shape[1]
        b = np.einsum("hij,nj->hni", A, x).reshape(-1, d)
        c = self.interpolate(b)
        m = _ratio(c, None, None, d, self.signed)[0]
        out = self._left_out(c)
        if out is not None:
            m[out] = 0.0
            self.skipped = np.flatnonzero(out)
            self.conditioning = np.array([np.max(1 / np.abs(c[~out, d]), initial=0.0),
                                          np.max(np.abs(m), initial=0.0)])
        return np.einsum("hij,hnj->ni", V, m.reshape(H, N, d)) / H

    def velocity_vjp(self, x: np.ndarray, A: np.ndarray, V: np.ndarray, g: np.ndarray,
                     positions: bool = False):
        """Cotangents of <g, v>: (mbar, the table cotangent summed over ranks; dA, dV of
        this rank's targets; with ``positions`` the targets' cotangent xbar, else None),
        with u_h = V_h^T g / H, dV_h = (1/H) sum_i g_i m^T, dA_h = sum_i (dm/db)^T u_h x_i^T
        and xbar_i = sum_h A_h^T (dm/db)^T u_h."""
        H, N, d = A.shape[0], x.shape[0], A.shape[1]
        b = np.einsum("hij,nj->hni", A, x).reshape(-1, d)
        u = np.einsum("nk,hkj->hnj", g, V) / H
        c, Jc = self.interpolate(b, jacobian=True)
        m, J, cbar = _ratio(c, Jc, u.reshape(-1, d), d, self.signed)   # J: dm_k/db_a
        out = self._left_out(c)
        if out is not None:                   # the pairs left out of the velocity
            m[out], J[out], cbar[out] = 0.0, 0.0, 0.0
        mbar = self.transpose(b, cbar)
        m, J = m.reshape(H, N, d), J.reshape(H, N, d, d)
        dV = np.einsum("nk,hnj->hkj", g, m) / H
        dA = np.einsum("hnka,hnk,nc->hac", J, u, x)
        xbar = np.einsum("hnka,hnk,hac->nc", J, u, A) if positions else None
        return mbar, dA, dV, xbar
