"""Pairs (head, target) summed exactly, for those a table of signed weights leaves out
(|zeta| < ZETA_MIN, :mod:`.head_sums`): log-domain sums over the sources of all ranks
without gathering them, and their reverse mode."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ...tools.parallel import allgather_rows
from ..softmax import Sources, moments_from_sums, partial_sums
from .layout import coordinate_range


def exact_sums(points, weights, b, comm, order: int = 1):
    """Exact log-domain sums at this rank's points b (P, d) for the density whose sources
    are spread over the ranks (each rank's own points and weights), without gathering the
    sources: the ranks' b are gathered (they are few), each rank sums its own sources
    (:func:`pdeformer.attention.softmax.partial_sums`) about a centre common to all, the shifts
    are agreed (Allreduce MAX) and the rescaled sums added (Allreduce SUM). Returns
    (all ranks' b, shift, sums, centre, this rank's slice of them)."""
    lo, hi = coordinate_range(points, comm)
    centre = np.where(np.isfinite(lo) & np.isfinite(hi), (lo + hi) / 2, 0.0)
    start = comm.exscan(len(b)) or 0
    all_b = allgather_rows(comm, b)
    shift, sums = partial_sums(all_b, Sources.from_arrays(points, weights), centre, order)
    top = shift.copy()
    comm.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
    ok = np.isfinite(shift)
    sums[~ok] = 0.0
    sums[ok] *= np.exp(shift[ok] - top[ok])[:, None]
    comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    return all_b, top, sums, centre, slice(start, start + len(b))


def _pairs(x, A, pairs):
    """Head and target of the pairs h N + i, and b = A_h x_i."""
    h, i = np.divmod(np.asarray(pairs, dtype=np.int64), len(x))
    return h, i, np.einsum("pab,pb->pa", A[h], x[i])


def exact_pair_velocity(points, weights, x, A, V, pairs, comm) -> np.ndarray:
    """(1/H) sum over this rank's pairs (h N + i) of V_h m(A_h x_i), with m summed exactly
    (:func:`exact_sums`): what to add to the velocity for the pairs a table leaves out.
    Collective."""
    h, i, b = _pairs(x, A, pairs)
    _, top, sums, centre, mine = exact_sums(points, weights, b, comm)
    _, m, _ = moments_from_sums(top[mine], sums[mine], centre)
    out = np.zeros_like(x, dtype=float)
    np.add.at(out, i, np.einsum("pab,pb->pa", V[h], m) / len(A))
    return out


PAIR_CHUNK = 1 << 18      # pair x source exponentials per block in exact_pair_vjp


def exact_pair_vjp(points, weights, x, A, V, g, pairs, comm):
    """Cotangents of <g, exact_pair_velocity>: (this rank's source weights (M,), dA, dV of
    this rank's pairs), with u = V_h^T g_i / H: dV_h = (1/H) g_i m^T, dA_h = C u x_i^T
    and wbar_j = sum_p e^{<b_p, y_j>} (u_p . (y_j - m_p)) / Z_p over every rank's pairs p.
    Collective."""
    H, d = len(A), x.shape[1] if x.ndim == 2 else 1
    h, i, b = _pairs(x, A, pairs)
    u = np.einsum("pka,pk->pa", V[h], g[i]) / H
    all_b, top, sums, centre, mine = exact_sums(points, weights, b, comm, order=2)
    _, m_all, C_all = moments_from_sums(top, sums, centre, order=2)
    dV, dA = np.zeros_like(V, dtype=float), np.zeros_like(A, dtype=float)
    np.add.at(dV, h, g[i][:, :, None] * m_all[mine][:, None, :] / H)
    np.add.at(dA, h, np.einsum("pab,pb,pc->pac", C_all[mine], u, x[i]))
    all_u = allgather_rows(comm, u)
    coef = np.column_stack([all_u, -np.einsum("pa,pa->p", all_u, m_all)])
    wbar = np.zeros(len(points))
    rows = max(1, PAIR_CHUNK // max(1, len(points)))
    for p0 in range(0, len(all_b), rows):
        c = slice(p0, p0 + rows)
        E = np.exp(all_b[c] @ points.T - top[c, None]) / sums[c, 0][:, None]
        T = E.T @ coef[c]
        wbar += np.einsum("ja,ja->j", points, T[:, :d]) + T[:, d]
    return wbar, dA, dV
