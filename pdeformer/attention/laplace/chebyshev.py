r"""Chebyshev-Lobatto grids, the table sizes, and the error estimate from the decay of
Chebyshev coefficients.

A table holds its values on the tensor grid of n Chebyshev-Lobatto points per axis
(n from SIZES; in 3-D from SIZES3, finer steps, since a table costs n^3), and between the
nodes it is their polynomial interpolant, evaluated by the barycentric formula
(:func:`barycentric_weights`) and differentiated by :func:`differentiation_matrix`.

Its error is estimated from its tensor Chebyshev coefficients a_k (the DCT-I along each
axis, :func:`chebyshev_coefficients`): the largest of each shell (the coefficients whose
largest index is k, :func:`shell_maxima`) falls like e^{c + s k} (:func:`decay_fit`);
|f - p_n| <= 2 sum_{k>=n} |a_k| summed geometrically gives :func:`tail_estimate`, and the
fit extrapolated gives the size n at which the estimate meets tol (:func:`predicted_size`).
"""

from __future__ import annotations

import functools

import numpy as np


N_MIN, N_MAX = 17, 257
SIZES = (17, 25, 33, 49, 65, 81, 97, 129, 161, 193, 225, 257, 321, 385, 449, 513, 641,
         769, 897, 1025)  # steps of about 1.25x
N_MAX_FORCED = 1025     # backend "laplace" (not auto) may refine this far before giving up
N3_MAX, N3_MAX_FORCED = 65, 97   # the same in 3-D (n^3 nodes: 97^3 x 5 sums are 36 MB)
SIZES3 = (17, 21, 25, 29, 33, 37, 41, 45, 49, 57, 65, 73, 81, 89, 97)   # 3-D: finer steps
                                 # (a table costs n^3: one step of SIZES would be 2.3-3.3x)


def table_sizes(d: int) -> tuple:
    """The table sizes tried in d dimensions."""
    return SIZES3 if d == 3 else SIZES


def chebyshev_lobatto(n: int, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """n Chebyshev-Lobatto points on [lo, hi] (increasing) and their barycentric weights."""
    k = np.arange(n)
    x = -np.cos(np.pi * k / (n - 1))
    lam = (-1.0) ** k
    lam[0] *= 0.5
    lam[-1] *= 0.5
    return lo + (hi - lo) * (x + 1) / 2, lam


def barycentric_weights(x: np.ndarray, nodes: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """(P, n) matrix W with p(x_i) = sum_g W[i, g] p_g for the polynomial interpolant
    (barycentric formula; a point on a node gets that node's value)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        W = lam / (x[:, None] - nodes[None, :])
        W /= W.sum(axis=1, keepdims=True)
    idx = np.clip(np.searchsorted(nodes, x), 0, len(nodes) - 1)
    for cand in (idx, np.maximum(idx - 1, 0)):
        hit = nodes[cand] == x
        if np.any(hit):
            W[hit] = 0.0
            W[hit, cand[hit]] = 1.0
    return W


def differentiation_matrix(nodes: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """D with (D p)_g = p'(node_g) for the interpolating polynomial of p (Berrut-Trefethen)."""
    diff = nodes[:, None] - nodes[None, :]
    np.fill_diagonal(diff, 1.0)
    D = (lam[None, :] / lam[:, None]) / diff
    np.fill_diagonal(D, 0.0)
    np.fill_diagonal(D, -D.sum(axis=1))
    return D


@functools.lru_cache(maxsize=16)
def dct_matrix(n: int) -> np.ndarray:
    """D (n x n) with D @ values = the Chebyshev coefficients of the interpolant of values
    on n Lobatto nodes (the DCT-I: the FFT of the even extension, as a matrix, so that rows
    of the coefficients can be computed by themselves)."""
    k = np.arange(n)
    D = np.cos(np.pi * np.outer(k, k) / (n - 1)) * (2.0 / (n - 1))
    D[:, 0] /= 2
    D[:, -1] /= 2
    D.flags.writeable = False
    return D


def chebyshev_coefficients(values: np.ndarray) -> np.ndarray:
    """Tensor Chebyshev coefficients of a table on Lobatto nodes (the DCT-I along each axis)."""
    c = np.asarray(values, float)
    for axis in range(c.ndim):
        c = np.moveaxis(np.tensordot(dct_matrix(c.shape[axis]), c, axes=(1, axis)), 0, axis)
    return c


def shell_maxima(block: np.ndarray, r0: int = 0) -> np.ndarray:
    """Per shell k: the largest entry of ``block`` (rows r0, r0 + 1, ... of an n x n or
    n x n x n array of nonnegative values) among those whose largest index is k; zero
    where it has none.
    The maxima of row blocks combine by max into those of the whole array."""
    rows, n = block.shape[0], block.shape[-1]
    out = np.zeros(n)
    if rows == 0:
        return out
    if block.ndim > 2:                                      # (rows, n, n): the largest of 3
        k = np.arange(r0, r0 + rows).reshape((rows,) + (1,) * (block.ndim - 1))
        for ax in range(1, block.ndim):
            k = np.maximum(k, np.arange(n).reshape((1,) * ax + (n,) + (1,) * (block.ndim - 1 - ax)))
        np.maximum.at(out, np.broadcast_to(k, block.shape).ravel(), block.ravel())
        return out
    i = np.arange(r0, r0 + rows)[:, None]
    lower = np.arange(n)[None, :] <= i                      # larger index: the row
    out[r0:r0 + rows] = np.where(lower, block, 0.0).max(axis=1)
    return np.maximum(out, np.where(lower, 0.0, block).max(axis=0))


def decay_fit(shells: np.ndarray) -> tuple[float, float, float]:
    """From the largest Chebyshev coefficient of each shell (relative to the table's
    size): (largest in the top eighth of shells, log-rate s and intercept c of the fit
    log|coef_k| ~ c + s k over the top half). The fit is to the envelope max_{j >= k-1}:
    coefficients that vanish by symmetry (every other one of an even or odd function, the
    last one included) sit at round-off, which differs with the number of ranks and would
    move the fit."""
    env = np.maximum.accumulate(shells[::-1])[::-1]
    shells = np.maximum(env, np.concatenate([env[:1], env[:-1]]))
    n = len(shells)
    top = float(shells[n - max(2, n // 8):].max())
    ks = np.arange(n // 2, n, dtype=float)
    logs = np.log(np.maximum(shells[n // 2:], 1e-300))
    kc = ks - ks.mean()                                     # least squares line
    slope = float(kc @ (logs - logs.mean()) / (kc @ kc))
    icpt = float(logs.mean() - slope * ks.mean())
    return top, min(slope, -1e-3), icpt


def tail_estimate(top: float, slope: float, n: int) -> float:
    """Interpolation error from the coefficient decay: |f - p_n| <= 2 sum_{k>=n} |a_k|,
    with a_k falling by r = e^slope per mode from the top eighth (r^{n/8} top) and summed
    geometrically (1/(1 - r)), times 3 for safety: 6 top r^{n/8} / (1 - r). Measured on
    smooth, skewed and multi-modal densities against direct summation (n = 65-257):
    0.9-3x above the true error, never below it by more than the sampling of the check."""
    r = np.exp(slope)
    return 6.0 * top * r ** (n / 8) / (1 - r)


def predicted_size(slope: float, icpt: float, tol: float) -> float:
    """The n at which the extrapolated estimate 6 e^{icpt + slope n} / (1 - r) is tol."""
    r = np.exp(slope)
    return (np.log(tol * (1 - r) / 6.0) - icpt) / slope


def largest_size(d: int, forced: bool = False) -> int:
    """The largest table size worth a try in d dimensions (``forced``: backend "laplace",
    which would rather build a big table than stop)."""
    if d == 3:
        return N3_MAX_FORCED if forced else N3_MAX
    return N_MAX_FORCED if forced else N_MAX


def size_index(want: float, sizes: tuple, start: int = 0) -> int:
    """The first index from ``start`` whose size reaches ``want`` (the last if none)."""
    return next((j for j in range(start, len(sizes)) if sizes[j] >= want), len(sizes) - 1)
