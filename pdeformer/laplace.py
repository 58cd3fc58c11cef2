r"""Fast attention: the log-Laplace transform of rho tabulated once for all heads.

Every head's velocity is V_h grad Lambda_rho(A_h x) with
Lambda_rho(b) = log int e^{<b,y>} rho(y) dy (design §4). Lambda depends on rho alone, so
its gradient m(b) (and Hessian C(b)) are tabulated on a tensor Chebyshev-Lobatto grid
covering every b = A_h x, and each head and target costs an interpolation:

* table: e^{<b,y>} = prod_a e^{b_a y_a} factorises per coordinate, so for d = 2 the sums
  Z[g1,g2] = sum_j w_j e^{b1_g1 y1_j} e^{b2_g2 y2_j} (and the y-moments) are matrix
  products (n x M)(M x n). With many sources they go through panel nodes (:class:`Panels`):
  the sources are spread onto narrow Chebyshev panels on which e^{b y} is a polynomial to
  1e-14 (a compiled loop where a C compiler is at hand), and the table is E_1 W E_2^T. Each rank sums its own sources; one Allreduce of
  the n^d tables completes them (no source gather).
* log-domain safety: every factor is shifted by its largest exponent over the sources
  (so it is <= 1), and the sources are split into tiles small enough that the product
  of two shifted factors cannot underflow (|b| x tile size bounded); tiles combine by
  log-sum-exp. Moments are ratios, so the shifts cancel.
* interpolation: barycentric in each coordinate, (P x n) weights, P = targets x heads;
  in 2-D through a uniform fine grid and local degree-5 Lagrange polynomials
  (:class:`FineGrid`, a compiled loop where a C compiler is at hand).
* accuracy: the grid size n is one whose error estimate (from the decay of the tables'
  Chebyshev coefficients) meets ``tol``, predicted from a trial table of a subsample
  (:func:`choose_table`); the grid box is rounded outward to a dyadic lattice,
  so box and n stay fixed under small changes of the heads and the interpolated map is
  smooth in them (gradients are exact for it).

Reverse mode: table cotangents are the transposed interpolation of the target cotangents;
the source cotangents follow from dm/dw_j = e^{<b,y_j>} (y_j - m) / Z and
dm/dy_j = w_j e^{<b,y_j>} / Z [I + (y_j - m) b^T] per grid node, i.e. transposed
factorised sums -- the adjoint's nonlocal source term at the cost of a table.

Implemented for d = 1 and 2. In d = 3 an n^3 table with n ~ 33-65 costs more than direct
summation at the sizes pdeformer meshes reach, so ``auto`` uses direct there.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from ._kernels import (KERNEL_DEGREE, PANEL_QMAX, fine_velocity, fine_velocity_vjp, kernels_on,
                       panel_gather, panel_spread)

N_MIN, N_MAX = 17, 257
SIZES = (17, 25, 33, 49, 65, 81, 97, 129, 161, 193, 225, 257, 321, 385, 449, 513, 641,
         769, 897, 1025)  # steps of about 1.25x
N_MAX_FORCED = 1025     # backend "laplace" (not auto) may refine this far before giving up
UNDERFLOW_GAP = 600.0   # keep every shifted exponent above e^-600 (float64 ~ e^-708)
MAX_TILES = 4096


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


def chebyshev_coefficients(values: np.ndarray) -> np.ndarray:
    """Tensor Chebyshev coefficients of a table on Lobatto nodes (FFT of the even
    extension along each axis)."""
    c = np.asarray(values, float)
    for axis in range(c.ndim):
        n = c.shape[axis]
        ext = np.concatenate([c, np.flip(c, axis=axis).take(range(1, n - 1), axis=axis)], axis=axis)
        c = np.fft.rfft(ext, axis=axis).real / (n - 1)
    return c


def _shell_max(c: np.ndarray) -> np.ndarray:
    """max over {(i, j): max(i, j) = k} of c (n, n), per k: the diagonal of the running
    maxima along rows (c[k, :k+1]) and along columns (c[:k+1, k])."""
    rows = np.maximum.accumulate(c, axis=1).diagonal()
    cols = np.maximum.accumulate(c, axis=0).diagonal()
    return np.maximum(rows, cols)


def coefficient_decay(tables) -> tuple[float, float, float]:
    """Decay of the tensor Chebyshev coefficients of tables on Lobatto nodes, relative
    to the tables' size: (largest coefficient in the top eighth of shells, log-rate s and
    intercept c of the fit log|coef_k| ~ c + s k over the top half of the shells), where
    shell k holds the coefficients whose largest index is k."""
    shells = None
    for t in tables:
        c = np.abs(chebyshev_coefficients(t))
        shell = c if c.ndim == 1 else _shell_max(c)
        shells = shell if shells is None else np.maximum(shells, shell)
    shells = shells / max(max(np.abs(t).max() for t in tables), 1e-300)
    n = len(shells)
    top = float(shells[n - max(2, n // 8):].max())
    ks = np.arange(n // 2, n)
    slope, icpt = np.polyfit(ks, np.log(np.maximum(shells[ks], 1e-300)), 1)
    return top, min(float(slope), -1e-3), float(icpt)


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


def grid_box(b_lo: np.ndarray, b_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The b-range rounded outward to a dyadic lattice (about 1/64 of its width) plus one
    lattice step: the same box for small changes of the heads, at most 6% wider."""
    width = np.maximum(b_hi - b_lo, 0.5)
    step = 2.0 ** np.floor(np.log2(width / 64))
    return np.floor(b_lo / step) * step - step, np.ceil(b_hi / step) * step + step


PANEL_BETA = 3.0     # |b|max x panel half-width: e^{b y} varies by at most e^{2 beta} on a panel
PANEL_EPS = 1e-14    # relative accuracy of the per-panel interpolation of e^{b y}


def panel_degree(beta: float = PANEL_BETA, eps: float = PANEL_EPS) -> int:
    """Chebyshev-Lobatto nodes per panel: the interpolation error of e^{beta t} on [-1, 1]
    is at most 4 (beta/2)^q / q! (its Chebyshev coefficients are 2 I_k(beta)); relative
    to the smallest value on the panel it is e^{2 beta} times that. The smallest q with
    this below eps (q = 23 for beta = 3, eps = 1e-14)."""
    for q in range(2, 80):
        if 4.0 * (beta / 2) ** q / math.factorial(q) * math.exp(2 * beta) <= eps:
            return q
    raise ValueError("panel interpolation cannot reach eps")


class Panels:
    """One axis of a tile cut into P panels of q Chebyshev-Lobatto nodes each, so narrow
    (max|b| x half-width <= PANEL_BETA) that e^{b y} is a degree-(q-1) polynomial on each
    to PANEL_EPS relative accuracy for every b of the table. Sources are spread onto the
    nodes of their panel with the Lagrange weights: sums over M sources become sums over
    P q nodes, exact up to PANEL_EPS plus rounding amplified by at most e^{2 beta} (about
    1e-13 measured; positive weights: the error of every term is relative to the term)."""

    def __init__(self, lo: float, hi: float, bmax: float, q: int):
        self.q = q
        self.count = max(1, int(np.ceil((hi - lo) * bmax / (2 * PANEL_BETA))))
        self.edges = np.linspace(lo, hi, self.count + 1)
        self.std, self.lam = chebyshev_lobatto(q, -1.0, 1.0)
        a, b = self.edges[:-1, None], self.edges[1:, None]
        self.nodes = (a + (b - a) * (self.std[None, :] + 1) / 2).ravel()    # (P q,)

    def locate(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Panel index (m,) and Lagrange weights (m, q) of the points y (m,)."""
        p = np.clip(np.searchsorted(self.edges, y, side="right") - 1, 0, self.count - 1)
        a, b = self.edges[p], self.edges[p + 1]
        t = np.clip(2 * (y - a) / np.where(b > a, b - a, 1.0) - 1, -1.0, 1.0)
        return p, barycentric_weights(t, self.std, self.lam)


def blocks_by_key(key: np.ndarray):
    """(value, indices) for every distinct value of an integer key."""
    order = np.argsort(key, kind="stable")
    values, starts = np.unique(key[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    for v, i0, i1 in zip(values, starts, ends):
        yield int(v), order[i0:i1]


def coordinate_range(points: np.ndarray, comm) -> tuple[np.ndarray, np.ndarray]:
    """Per-axis min and max of the points of all ranks (inf, -inf where there are none)."""
    d = points.shape[1]
    lo, hi = np.empty(d), np.empty(d)
    comm.Allreduce(points.min(axis=0) if len(points) else np.full(d, np.inf), lo, op=MPI.MIN)
    comm.Allreduce(points.max(axis=0) if len(points) else np.full(d, -np.inf), hi, op=MPI.MAX)
    return lo, hi


def panel_product_flops(n: int, d: int, ncols: int, nodes: list) -> float:
    """Flops of the products E_1 W (d = 1) or E_1 W E_2^T (d = 2) of ncols tables from
    the panel nodes, K_a per axis: 2 ncols n K_1 or 2 ncols (n K_1 K_2 + n^2 K_2)."""
    K = nodes
    return 2.0 * ncols * (n * K[0] if d == 1 else n * K[0] * K[1] + n * n * K[1])


def table_flops(n: int, d: int, ncols: int, sources: int, nodes: list | None) -> float:
    """Matrix-product flops of the ncols sums of a table: over the sources,
    2 ncols n^d M, or through ``nodes`` K_a panel nodes per axis (q per panel), the
    products plus the spread 2 ncols M q^d, whichever is less."""
    direct = 2.0 * ncols * n**d * sources
    if nodes is None:
        return direct
    spread = 2.0 * ncols * sources * panel_degree() ** d
    return min(direct, panel_product_flops(n, d, ncols, nodes) + spread)


class HeadSums:
    """The velocity of all heads from an interpolant of m (numpy; FineGrid may override):
    v(x) = (1/H) sum_h V_h m(A_h x) and its reverse mode."""

    def velocity(self, x: np.ndarray, A: np.ndarray, V: np.ndarray) -> np.ndarray:
        """v at this rank's targets x (N, d) for heads A, V (H, d, d)."""
        H, N, d = A.shape[0], x.shape[0], A.shape[1]
        b = np.einsum("hij,nj->hni", A, x).reshape(-1, d)
        return np.einsum("hij,hnj->ni", V, self.means(b).reshape(H, N, d)) / H

    def velocity_vjp(self, x: np.ndarray, A: np.ndarray, V: np.ndarray, g: np.ndarray,
                     positions: bool = False):
        """Cotangents of <g, v>: (mbar, the table cotangent summed over ranks; dA, dV of
        this rank's targets; with ``positions`` the targets' cotangent xbar, else None),
        with u_h = V_h^T g / H, dV_h = (1/H) sum_i g_i m^T, dA_h = sum_i (dm/db)^T u_h x_i^T
        and xbar_i = sum_h A_h^T (dm/db)^T u_h."""
        H, N, d = A.shape[0], x.shape[0], A.shape[1]
        b = np.einsum("hij,nj->hni", A, x).reshape(-1, d)
        u = np.einsum("nk,hkj->hnj", g, V) / H
        m, J, mbar = self.reverse(b, u.reshape(-1, d))       # J: dm_k/db_a
        m, J = m.reshape(H, N, d), J.reshape(H, N, d, d)
        dV = np.einsum("nk,hnj->hkj", g, m) / H
        dA = np.einsum("hnka,hnk,nc->hac", J, u, x)
        xbar = np.einsum("hnka,hnk,hac->nc", J, u, A) if positions else None
        return mbar, dA, dV, xbar


class LaplaceTable(HeadSums):
    """m(b) = grad Lambda (and C(b) = Hess Lambda if ``order`` is 2) on a Chebyshev grid.

    ``points``/``weights`` are this rank's sources; tables are summed over ``comm``."""

    def __init__(self, points, weights, lo, hi, n: int, comm, order: int = 1, tiles=None):
        self.d = points.shape[1]
        if self.d > 2:
            raise ValueError("the laplace backend is implemented for d = 1 and 2")
        self.comm, self.n, self.order = comm, n, order
        self.lo, self.hi = np.asarray(lo, float), np.asarray(hi, float)
        self.axes = [chebyshev_lobatto(n, a, b) for a, b in zip(self.lo, self.hi)]
        self.ncols = 1 + self.d + (self.d * (self.d + 1) // 2 if order >= 2 else 0)
        self.tiles = tiles if tiles is not None else self._split(points, weights)
        # the compiled panel loops (d = 2), if every rank has them (a collective call)
        self.lib = kernels_on(comm) if self.d == 2 and panel_degree() <= PANEL_QMAX else None
        self._build()

    # ------------------------------------------------------------------ tables
    def _split(self, points, weights) -> list:
        """Tiles of the sources' bounding box, small enough that no shifted product of
        per-axis factors underflows: max|b| x tile extent <= UNDERFLOW_GAP per axis."""
        lo, hi = coordinate_range(points, self.comm)
        bmax = np.maximum(np.abs(self.lo), np.abs(self.hi))
        counts = np.maximum(1, np.ceil(bmax * (hi - lo) * self.d / UNDERFLOW_GAP))
        if not np.all(np.isfinite(counts)) or np.prod(counts) > MAX_TILES:
            raise FloatingPointError(f"attention too sharp for a laplace table (|b| up to {bmax.max():.3g})")
        counts = counts.astype(int)
        edges = [np.linspace(a, b, k + 1) for a, b, k in zip(lo, hi, counts)]
        index = np.zeros(len(points), int)
        for a in range(self.d):
            i = np.clip(np.searchsorted(edges[a], points[:, a], side="right") - 1, 0, counts[a] - 1)
            index = index * counts[a] + i
        order = [np.flatnonzero(index == t) for t in range(int(np.prod(counts)))]
        return [(points[i], weights[i], i) for i in order]

    SOURCE_CHUNK = 4096  # sources per block: the (n x chunk) factors stay in cache

    def _shifts(self, lo, hi) -> list:
        """Per axis: max over the tile's points of b_g y_a, i.e. max(b_g lo_a, b_g hi_a)
        with the tile's coordinate range."""
        if not np.all(np.isfinite(lo)):       # an empty tile
            return [np.zeros(self.n) for _ in range(self.d)]
        return [np.maximum(nodes * lo[a], nodes * hi[a]) for a, (nodes, _) in enumerate(self.axes)]

    # costs in matrix-product flops (about 40 Gflop/s with OpenBLAS, one core): the
    # exponentials of the dense sums, about 10 ns per node and source; the compiled
    # spread, about 0.07 us per source and column plus 0.5 ms (measured, M = 2e3-1e5,
    # n = 33-257, K = 92-460 panel nodes per axis)
    DENSE_EXP_FLOPS = 400.0
    SPREAD_FLOPS = 3000.0
    SPREAD_FIXED = 2e7

    def _panels(self, lo, hi, count: int):
        """Panels per axis for a tile of ``count`` sources (all ranks), or None where
        summing over the sources directly is cheaper. With the compiled spread: the
        products through the panel nodes plus SPREAD_FLOPS per source and column against
        the dense products plus their exponentials; with numpy: the flop counts, the
        panel loop costed at 1e6 flops per block of sources."""
        if count == 0 or not np.all(np.isfinite(lo)):
            return None
        bmax = [np.abs(nodes).max() for nodes, _ in self.axes]
        panels = [Panels(lo[a], hi[a], bmax[a], panel_degree()) for a in range(self.d)]
        blocks = int(np.prod([pa.count for pa in panels]))
        dense = table_flops(self.n, self.d, self.ncols, count, None)
        K = [len(pa.nodes) for pa in panels]
        if self.lib is not None:
            via = (panel_product_flops(self.n, self.d, self.ncols, K)
                   + self.SPREAD_FLOPS * self.ncols * count + self.SPREAD_FIXED)
            return panels if via < dense + self.DENSE_EXP_FLOPS * self.n * count else None
        via = table_flops(self.n, self.d, self.ncols, count, K)
        return panels if via + 1e6 * min(blocks, count) < 0.5 * dense else None

    def _panel_factors(self, panels, shifts) -> list:
        """Per axis: e^{b_g yhat_k - shift_g} (n, P q) at the panel nodes."""
        out = []
        for (nodes, _), pa, sh in zip(self.axes, panels, shifts):
            r = np.multiply.outer(nodes, pa.nodes)
            r -= sh[:, None]
            out.append(np.exp(r, out=r))
        return out

    def _spread(self, panels, pts, cols) -> np.ndarray:
        """W[c, k0, k1] = sum_j cols[j, c] L_k0(y0_j) L_k1(y1_j): the sources on the
        panel nodes (d = 1: W[c, k0])."""
        q = panels[0].q
        if self.lib is not None:
            return panel_spread(self.lib, panels, pts, cols)
        loc = [pa.locate(pts[:, a]) for a, pa in enumerate(panels)]
        if self.d == 1:
            W = np.zeros((self.ncols, len(panels[0].nodes)))
            for p0, idx in blocks_by_key(loc[0][0]):
                W[:, p0 * q:(p0 + 1) * q] += cols[idx].T @ loc[0][1][idx]
            return W
        P1 = panels[1].count
        W = np.zeros((self.ncols, len(panels[0].nodes), len(panels[1].nodes)))
        for key, idx in blocks_by_key(loc[0][0] * P1 + loc[1][0]):
            p0, p1 = divmod(key, P1)
            right = (cols[idx][:, :, None] * loc[1][1][idx][:, None, :]).reshape(len(idx), -1)
            blk = (loc[0][1][idx].T @ right).reshape(q, self.ncols, q)
            W[:, p0 * q:(p0 + 1) * q, p1 * q:(p1 + 1) * q] += blk.transpose(1, 0, 2)
        return W

    def _chunks(self, pts, shifts):
        """(slice, per-axis shifted factors e^{b_g y_j - shift_g} (n, chunk)) by source block."""
        for j0 in range(0, len(pts), self.SOURCE_CHUNK):
            blk = slice(j0, min(len(pts), j0 + self.SOURCE_CHUNK))
            E = []
            for a, (nodes, _) in enumerate(self.axes):
                r = np.multiply.outer(nodes, pts[blk, a])
                r -= shifts[a][:, None]
                E.append(np.exp(r, out=r))
            yield blk, E

    def _build(self):
        d, n = self.d, self.n
        self.tile_data = []   # per tile: (shifts, panels or None), for the reverse sums
        sums, logscale = [], []
        for pts, w, _ in self.tiles:
            lo, hi = coordinate_range(pts, self.comm)
            shifts = self._shifts(lo, hi)
            panels = self._panels(lo, hi, self.comm.allreduce(len(pts), op=MPI.SUM))
            cols = self._moment_columns(pts, w)              # (M, ncols)
            local = np.zeros((self.ncols,) + (n,) * d)
            if panels is not None:                           # E_1 W E_2^T over the panel nodes
                E = self._panel_factors(panels, shifts)
                W = self._spread(panels, pts, cols)
                if d == 1:
                    local += W @ E[0].T
                else:
                    local += np.stack([E[0] @ Wc @ E[1].T for Wc in W])
            else:
                for blk, E in self._chunks(pts, shifts):
                    if d == 1:
                        local += (E[0] @ cols[blk]).T
                    else:   # one product for all columns: [E0 c_0; E0 c_1; ...] E1^T
                        left = (E[0][None, :, :] * cols[blk].T[:, None, :]).reshape(-1, E[0].shape[1])
                        local += (left @ E[1].T).reshape(self.ncols, n, n)
            total = np.empty(local.shape)
            self.comm.Allreduce(local, total, op=MPI.SUM)
            scale = shifts[0] if d == 1 else shifts[0][:, None] + shifts[1][None, :]
            self.tile_data.append((shifts, panels))
            sums.append(total)
            logscale.append(scale)
        # combine tiles by log-sum-exp per node: ref = max_t (scale_t + log Z_t)
        with np.errstate(divide="ignore"):
            logs = [ls + np.log(np.maximum(sm[0], 0.0)) for ls, sm in zip(logscale, sums)]
        ref = np.max(logs, axis=0)
        ref = np.where(np.isfinite(ref), ref, 0.0)
        S = sum(np.exp(ls - ref) * sm for ls, sm in zip(logscale, sums))
        Z = S[0]
        if np.any(~(Z > 0)):
            raise FloatingPointError("laplace table: the partition function vanishes "
                                     "(negative or underflowing weights)")
        self.log_z = np.log(Z) + ref
        self.Zhat = Z
        self.ref = ref
        self.m = S[1:1 + d] / Z                              # (d, grid)
        if self.order >= 2:
            C = np.empty((d, d) + Z.shape)
            c = 1 + d
            for a in range(d):
                for b in range(a, d):
                    C[a, b] = S[c] / Z - self.m[a] * self.m[b]
                    C[b, a] = C[a, b]
                    c += 1
            self.C = C

    def _moment_columns(self, pts, w):
        d = self.d
        cols = [w, *(w * pts[:, a] for a in range(d))]
        if self.order >= 2:
            cols += [w * pts[:, a] * pts[:, b] for a in range(d) for b in range(a, d)]
        return np.array(cols).T if len(cols[0]) else np.zeros((0, self.ncols))

    # ------------------------------------------------------------------ evaluation
    CHUNK = 2048  # points per block: the (chunk x n) weights stay in cache

    def _blocks(self, P: int):
        for i0 in range(0, P, self.CHUNK):
            yield slice(i0, min(P, i0 + self.CHUNK))

    def _weights(self, b: np.ndarray) -> list:
        return [barycentric_weights(b[:, a], nodes, lam) for a, (nodes, lam) in enumerate(self.axes)]

    def _stack(self, tables: list) -> np.ndarray:
        """Tables side by side so that one matrix product interpolates them all."""
        return np.stack(tables, axis=-1) if self.d == 1 else np.concatenate(tables, axis=1)

    def _apply(self, W: list, stacked: np.ndarray, count: int) -> np.ndarray:
        """Values (chunk, count) of ``count`` stacked tables at the points of W."""
        if self.d == 1:
            return W[0] @ stacked
        R = (W[0] @ stacked).reshape(W[0].shape[0], count, self.n)
        return np.einsum("pkg,pg->pk", R, W[1])

    def evaluate(self, b: np.ndarray, tables: list) -> np.ndarray:
        """Interpolated values of tabulated functions at points b (P, d) -> (P, len(tables))."""
        stacked = self._stack(tables)
        out = np.empty((b.shape[0], len(tables)))
        for blk in self._blocks(b.shape[0]):
            out[blk] = self._apply(self._weights(b[blk]), stacked, len(tables))
        return out

    def means(self, b: np.ndarray) -> np.ndarray:
        """m(b) of the interpolant at points b (P, d) -> (P, d)."""
        return self.evaluate(b, list(self.m))

    def covariances(self, b: np.ndarray) -> np.ndarray:
        """C(b) (P, d, d) interpolated from the order-2 table."""
        d = self.d
        pairs = [(a, c) for a in range(d) for c in range(a, d)]
        vals = self.evaluate(b, [self.C[a, c] for a, c in pairs])
        out = np.empty((b.shape[0], d, d))
        for i, (a, c) in enumerate(pairs):
            out[:, a, c] = out[:, c, a] = vals[:, i]
        return out

    def derivative_tables(self) -> list:
        """d m_k / d b_a of the interpolant on the grid, [a][k] (differentiation matrices)."""
        out = []
        for a, (nodes, lam) in enumerate(self.axes):
            D = differentiation_matrix(nodes, lam)
            out.append([np.moveaxis(np.tensordot(D, self.m[k], axes=(1, a)), 0, a)
                        for k in range(self.d)])
        return out

    def jacobians(self, b: np.ndarray) -> np.ndarray:
        """d m_k / d b_a of the interpolant at b: (P, d, d) [k, a]."""
        d = self.d
        vals = self.evaluate(b, [t for per_axis in self.derivative_tables() for t in per_axis])
        return vals.reshape(-1, d, d).transpose(0, 2, 1)

    # ------------------------------------------------------------------ reverse mode
    def reverse(self, b: np.ndarray, u: np.ndarray):
        """One pass over the points b (P, d) with cotangents u (P, d) of m(b): returns
        m (P, d), the Jacobians dm/db (P, d, d) [k, a] and the table cotangent
        mbar[k] = sum_p u[p, k] W(b_p) (summed over ranks)."""
        d, P = self.d, b.shape[0]
        tables = list(self.m) + [t for per_axis in self.derivative_tables() for t in per_axis]
        stacked = self._stack(tables)
        vals = np.empty((P, len(tables)))
        local = np.zeros((d,) + self.m.shape[1:])
        for blk in self._blocks(P):
            W = self._weights(b[blk])
            vals[blk] = self._apply(W, stacked, len(tables))
            for k in range(d):
                if d == 1:
                    local[k] += W[0].T @ u[blk, k]
                else:
                    local[k] += (W[0] * u[blk, k:k + 1]).T @ W[1]
        mbar = np.empty_like(local)
        self.comm.Allreduce(local, mbar, op=MPI.SUM)
        J = vals[:, d:].reshape(P, d, d).transpose(0, 2, 1)
        return vals[:, :d], J, mbar

    def _source_sums(self, grids: list) -> np.ndarray:
        """S[j, i] = sum_g e^{<b_g, y_j>} / Z_g X_i[g] for this rank's sources (original
        order) and grid arrays X_i: transposed factorised sums, diag(E_1^T X E_2) per
        source block, in the tiles' shifted scales (through the panel nodes where the
        table was built on them: G = E_1^T X E_2 there, then each source's Lagrange
        weights)."""
        d = self.d
        out = np.zeros((sum(len(t[2]) for t in self.tiles), len(grids)))
        for (shifts, panels), (pts, _, idx) in zip(self.tile_data, self.tiles):
            if len(pts) == 0:
                continue
            scale = shifts[0] if d == 1 else shifts[0][:, None] + shifts[1][None, :]
            factor = np.exp(scale - self.ref) / self.Zhat     # e^{shift}/Z on the grid
            acc = np.empty((len(pts), len(grids)))
            if panels is not None:
                E = self._panel_factors(panels, shifts)
                q = panels[0].q
                if d == 1:
                    loc = [pa.locate(pts[:, a]) for a, pa in enumerate(panels)]
                    G = np.stack([E[0].T @ (X * factor) for X in grids], axis=1)     # (K, i)
                    for p0, j in blocks_by_key(loc[0][0]):
                        acc[j] = loc[0][1][j] @ G[p0 * q:(p0 + 1) * q]
                else:
                    G = np.stack([E[0].T @ (X * factor) @ E[1] for X in grids])      # (i, K0, K1)
                    if self.lib is not None:
                        acc = panel_gather(self.lib, panels, pts, G)
                    else:
                        loc = [pa.locate(pts[:, a]) for a, pa in enumerate(panels)]
                        P1 = panels[1].count
                        for key, j in blocks_by_key(loc[0][0] * P1 + loc[1][0]):
                            p0, p1 = divmod(key, P1)
                            g = G[:, p0 * q:(p0 + 1) * q, p1 * q:(p1 + 1) * q]
                            acc[j] = np.einsum("mk,ikl,ml->mi", loc[0][1][j], g, loc[1][1][j])
            else:
                for blk, E in self._chunks(pts, shifts):
                    for i, X in enumerate(grids):
                        if d == 1:
                            acc[blk, i] = E[0].T @ (X * factor)
                        else:
                            acc[blk, i] = np.einsum("jc,cj->j", E[0].T @ (X * factor), E[1])
            out[idx] = acc
        return out

    def _own_sources(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's source points and weights in their original order."""
        M = sum(len(t[2]) for t in self.tiles)
        y, w = np.empty((M, self.d)), np.empty(M)
        for pts, wt, idx in self.tiles:
            y[idx], w[idx] = pts, wt
        return y, w

    def source_cotangents(self, mbar: np.ndarray, positions: bool = False):
        """d<mbar, m>/dw_j and, with ``positions``, d<mbar, m>/dy_j (M, d) for this rank's
        sources (original order), in one pass over them, with
        dm_g/dw_j = e^{<b_g, y_j>} (y_j - m_g) / Z_g and
        dm_g/dy_j = w_j e^{<b_g, y_j>} / Z_g [I + (y_j - m_g) b_g^T], i.e.
        ybar_j,c = w_j sum_g e^{<b_g,y_j>}/Z_g [mbar_c + (mbar . (y_j - m_g)) b_g,c]."""
        d = self.d
        y, w = self._own_sources()
        mm = sum(mbar[k] * self.m[k] for k in range(d))
        grids = [-mm] + list(mbar)
        if positions:
            nodes = [self.axes[0][0]] if d == 1 else np.meshgrid(self.axes[0][0], self.axes[1][0], indexing="ij")
            grids += [X for c in range(d) for X in [mbar[c] - mm * nodes[c]] + [mbar[k] * nodes[c] for k in range(d)]]
        S = self._source_sums(grids)
        wbar = S[:, 0] + np.einsum("jk,jk->j", y, S[:, 1:1 + d])
        if not positions:
            return wbar, None
        P = S[:, 1 + d:].reshape(len(w), d, 1 + d)
        return wbar, w[:, None] * (P[:, :, 0] + np.einsum("jk,jck->jc", y, P[:, :, 1:]))

    def weights_cotangent(self, mbar: np.ndarray) -> np.ndarray:
        """d<mbar, m>/dw_j (:meth:`source_cotangents`)."""
        return self.source_cotangents(mbar)[0]

    def points_cotangent(self, mbar: np.ndarray) -> np.ndarray:
        """d<mbar, m>/dy_j (:meth:`source_cotangents`)."""
        return self.source_cotangents(mbar, positions=True)[1]


class FineGrid(HeadSums):
    """Second level for many points (d = 2): the table's Chebyshev interpolant sampled
    on a uniform nf x nf grid (two small matrix products), then interpolated locally by
    tensor Lagrange polynomials of degree P_LOCAL (P_LOCAL + 1 points per axis). The
    cost per point no longer grows with n; the map stays piecewise polynomial, and its
    reverse mode is the exact transpose (scatter-add, then the transposed sampling)."""

    P_LOCAL = 5

    def __init__(self, table: "LaplaceTable", nf: int, lib="every rank"):
        p = self.P_LOCAL
        if nf < p + 1:
            raise ValueError(f"FineGrid: nf = {nf} points per axis, the stencil needs {p + 1}")
        self.table, self.nf = table, nf
        self.h = (table.hi - table.lo) / (nf - 1)
        # S_a (nf x n): the Chebyshev interpolant's values at the uniform points of axis a
        self.sample = [barycentric_weights(table.lo[a] + self.h[a] * np.arange(nf), nodes, lam)
                       for a, (nodes, lam) in enumerate(table.axes)]
        self.flat = self._sampled(list(table.m))            # m on the fine grid
        self._den = np.array([np.prod([a - c for c in range(p + 1) if c != a]) for a in range(p + 1)])
        # the compiled loop, if every rank has it (a collective call unless given)
        self.lib = kernels_on(table.comm) if lib == "every rank" else lib
        if p != KERNEL_DEGREE:
            self.lib = None

    def _sampled(self, tables: list) -> np.ndarray:
        nf = self.nf
        vals = np.stack([self.sample[0] @ t @ self.sample[1].T for t in tables], axis=-1)
        return vals.reshape(nf * nf, len(tables))

    def _locate(self, b: np.ndarray):
        """Stencil start, local Lagrange weights and their t-derivatives per axis:
        L_a = prod_{c != a} (t - c) / den_a and L_a' = sum_{e != a} prod_{c != a, e} (t - c) / den_a
        (products only, so exact on the nodes too; the compiled loop does the same)."""
        p, nf = self.P_LOCAL, self.nf
        t = (b - self.table.lo) / self.h                     # grid coordinates
        start = np.clip(np.floor(t).astype(int) - (p - 1) // 2, 0, nf - 1 - p)
        L, dL = [], []
        c = np.arange(p + 1)
        for a in range(2):
            x = (t[:, a] - start[:, a])[:, None] - c          # (P, p+1): t - c
            La, dLa = np.empty_like(x), np.zeros_like(x)
            for k in range(p + 1):
                others = [j for j in range(p + 1) if j != k]
                La[:, k] = np.prod(x[:, others], axis=1)
                for e in others:
                    dLa[:, k] += np.prod(x[:, [j for j in others if j != e]], axis=1)
            L.append(La / self._den)
            dL.append(dLa / self._den)
        idx = ((start[:, 0][:, None, None] + c[None, :, None]) * nf
               + start[:, 1][:, None, None] + c[None, None, :])
        return idx, L, dL

    def means(self, b: np.ndarray) -> np.ndarray:
        """m at points b (P, d) from the sampled tables."""
        out = np.empty((b.shape[0], self.table.d))
        for blk in self.table._blocks(b.shape[0]):
            idx, L, _ = self._locate(b[blk])
            g = self.flat[idx]                               # (P, p+1, p+1, d)
            out[blk] = np.einsum("pak,pa->pk", np.einsum("pack,pc->pak", g, L[1]), L[0])
        return out

    def reverse(self, b: np.ndarray, u: np.ndarray):
        """As LaplaceTable.reverse, for this two-level interpolant."""
        d, nf, P = self.table.d, self.nf, b.shape[0]
        m = np.empty((P, d))
        J = np.empty((P, d, d))
        acc = np.zeros((d, nf * nf))
        for blk in self.table._blocks(P):
            idx, L, dL = self._locate(b[blk])
            g = self.flat[idx]                               # (n, p+1, p+1, d)
            g2 = np.einsum("pack,pc->pak", g, L[1])
            m[blk] = np.einsum("pak,pa->pk", g2, L[0])
            J[blk, :, 0] = np.einsum("pak,pa->pk", g2, dL[0]) / self.h[0]
            J[blk, :, 1] = np.einsum("pack,pc,pa->pk", g, dL[1], L[0]) / self.h[1]
            w = (L[0][:, :, None] * L[1][:, None, :]).reshape(len(idx), -1)
            for k in range(d):
                acc[k] += np.bincount(idx.reshape(len(idx), -1).ravel(),
                                      (w * u[blk, k:k + 1]).ravel(), minlength=nf * nf)
        return m, J, self._table_cotangent(acc)

    def velocity(self, x, A, V):
        lib = self.lib
        if lib is None:
            return super().velocity(x, A, V)
        return fine_velocity(lib, self.flat, self.nf, self.table.lo, self.h, self.P_LOCAL, x, A, V)

    def velocity_vjp(self, x, A, V, g, positions: bool = False):
        lib = self.lib
        if lib is None:
            return super().velocity_vjp(x, A, V, g, positions)
        acc, dA, dV, xbar = fine_velocity_vjp(lib, self.flat, self.nf, self.table.lo, self.h,
                                              self.P_LOCAL, x, A, V, g, positions)
        return self._table_cotangent(acc), dA, dV, xbar

    def _table_cotangent(self, acc: np.ndarray) -> np.ndarray:
        """Fine-grid cotangents (d, nf*nf) to table cotangents, summed over ranks."""
        nf = self.nf
        local = np.stack([self.sample[0].T @ a.reshape(nf, nf) @ self.sample[1] for a in acc])
        mbar = np.empty_like(local)
        self.table.comm.Allreduce(local, mbar, op=MPI.SUM)
        return mbar

    def error(self, check: tuple | None = None) -> float:
        """Largest difference to the Chebyshev interpolant at the points of ``check``
        (default :func:`error_samples`), relative to the size of m."""
        t = self.table
        b, ref = check if check is not None else error_samples(t)
        if self.lib is not None:     # m(b) as the velocity of one head with A = V = I
            eye = np.eye(t.d)[None]
            mine = self.velocity(b, eye, eye)
        else:
            mine = self.means(b)
        return float(np.abs(mine - ref).max() / max(np.abs(t.m).max(), 1e-300))


def error_samples(table: "LaplaceTable", samples: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """(b, m(b)) of the Chebyshev interpolant at fixed pseudo-random points of the box
    (the same points on every rank): what FineGrid.error compares with."""
    rng = np.random.default_rng(12345)
    b = table.lo + (table.hi - table.lo) * rng.random((samples, table.d))
    return b, table.means(b)


def fine_from(lib) -> int:
    """Table size from which the two-level interpolation is faster (measured: from the
    smallest size with the compiled loop ``lib``, from 129 with numpy)."""
    return N_MIN if lib is not None else 129


FINE_MAX = 8       # the fine grid has at most FINE_MAX n points per axis


def fine_grid(table: "LaplaceTable", tol: float, nf: int | None = None):
    """A FineGrid whose local error is below tol/2 (its sampled estimate below tol/4), or
    None when interpolating directly from the table is the better choice (or nothing up
    to FINE_MAX n meets it). The size: the error of local degree-p interpolation falls
    like h^(p+1), so from the error e_1 of the grid with n points per axis the grid with
    n (4 e_1 / tol)^(1/(p+1)) points should meet tol/4 (measured e_1/e_2 = 55-66 against
    64 for p = 5); it is built with 10% to spare, checked, and enlarged by 1.25 while it
    misses."""
    if table.d != 2:
        return None
    lib = kernels_on(table.comm)                 # one collective call for all candidates
    if nf is not None:
        return FineGrid(table, nf, lib)
    if table.n < fine_from(lib):
        return None
    # the local error is to stay below tol/2; its sampled estimate saw 0.4-0.8 of the
    # largest error over all b of the benchmark's targets, so the samples must show tol/4
    goal = tol / 4

    check = error_samples(table)          # one reference for every candidate grid

    def error(fg):            # the largest over ranks: every rank takes the same grid
        return table.comm.allreduce(fg.error(check), op=MPI.MAX)

    fg = FineGrid(table, table.n, lib)
    err = error(fg)
    if err <= goal:
        return fg
    p1 = FineGrid.P_LOCAL + 1
    size = table.n * 1.1 * (err / goal) ** (1.0 / p1) if np.isfinite(err) else np.inf
    while size <= FINE_MAX * table.n:
        fg = FineGrid(table, int(np.ceil(size)), lib)
        if error(fg) <= goal:
            return fg
        size *= 1.25
    return None


SUBSAMPLE = 4096  # sources the trial tables are built from
TRIAL_BUILDS = 1          # trial tables per search: the size follows from the first
PREDICTION_MARGIN = 1.25   # from the n = 33 table the fitted decay predicts 0.82-0.93 of
                           # the size needed (benchmark densities, 1-64 heads, tol 1e-8
                           # and 1e-5); a table that still misses tol is replaced by one
                           # of the size its own (resolved) decay predicts


def subsample(points: np.ndarray, fraction: float) -> np.ndarray:
    """Mask of about ``fraction`` of the points, chosen by a hash of their coordinates:
    the same points whichever rank holds them."""
    c = np.array([12.9898, 78.233, 37.719])[:points.shape[1]]
    return np.modf(np.abs(points @ c) * 43758.5453)[0] < fraction


def choose_table(points, weights, b_lo, b_hi, comm, tol: float, order: int = 1,
                 n_max: int = N_MAX):
    """A table on the rounded box whose error estimate meets ``tol``; returns (table,
    estimate). Sizes come from SIZES (up to n_max). The size is searched on trial tables
    of a subsample of the sources (about SUBSAMPLE of them; all when there are fewer),
    starting at 33 and jumping to PREDICTION_MARGIN times the size where the fitted
    coefficient decay predicts tol (TRIAL_BUILDS trial tables; the last prediction is
    taken without building); the table of all sources is then built at that size, and
    larger ones only while its own estimate misses tol. The search depends on the
    sources and the box alone, so the same inputs give the same table on any number of
    ranks. If no size meets tol, the largest is returned with its estimate (the caller
    decides)."""
    lo, hi = grid_box(np.asarray(b_lo, float), np.asarray(b_hi, float))
    sizes = [n for n in SIZES if n <= n_max] or [N_MIN]
    total = comm.allreduce(len(points), op=MPI.SUM)

    def search(pts, w, i, builds=None, tiles=None):
        """Build at sizes[i], then at larger sizes (at least the predicted one) until tol;
        after ``builds`` tables that miss it, the predicted index without building."""
        while True:
            table = LaplaceTable(pts, w, lo, hi, sizes[i], comm, order, tiles)
            tiles = table.tiles
            top, slope, icpt = coefficient_decay(list(table.m))
            est = tail_estimate(top, slope, table.n)
            if est <= tol or i + 1 == len(sizes):
                return i, table, est
            # extrapolated from the coarse first table the prediction falls short
            margin = PREDICTION_MARGIN if i == first else 1.0
            want = margin * predicted_size(slope, icpt, tol)
            i = next((j for j in range(i + 1, len(sizes)) if sizes[j] >= want), len(sizes) - 1)
            if builds is not None:
                builds -= 1
                if builds == 0:
                    return i, None, None

    first = start = sizes.index(33) if 33 in sizes else 0
    if total > 2 * SUBSAMPLE:
        keep = subsample(points, SUBSAMPLE / total)
        if comm.allreduce(int(keep.sum()), op=MPI.SUM) >= SUBSAMPLE // 4:   # not degenerate
            try:
                start, _, _ = search(points[keep], weights[keep], start, builds=TRIAL_BUILDS)
            except FloatingPointError:   # signed weights: the subsample's Z may vanish
                pass
    _, table, est = search(points, weights, start)
    return table, est


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


def source_extent(points: np.ndarray, comm) -> np.ndarray:
    """Width of the sources' bounding box per axis (all ranks)."""
    lo, hi = coordinate_range(points, comm)
    return np.where(np.isfinite(hi - lo), hi - lo, 0.0)


def panel_nodes(bmax: float, extent: float) -> int:
    """Panel nodes on one axis for |b| <= bmax and sources spanning ``extent`` (capped:
    beyond MAX_TILES panels the table is not built anyway)."""
    panels = min(extent * bmax / (2 * PANEL_BETA), float(MAX_TILES))
    return max(1, int(np.ceil(panels))) * panel_degree()


def flops_estimate(n: int, d: int, sources: int, points: int, compiled: bool = True,
                   panel_nodes: list | None = None) -> float:
    """Cost of an order-1 table (1 + d sums over the sources) and of interpolating its d
    components at ``points``, in matrix-product flops (for the auto backend). The table:
    2 n^d M (1 + d) summed over the sources, or through ``panel_nodes`` K_a per axis
    2 (1 + d) (n K_1 K_2 + n^2 K_2 + M q^2) (d = 2), whichever is less. Interpolation:
    the ``compiled`` fine-grid loop costs about 10 ns = 400 flops per point (d = 2), numpy
    about 1.4 us; 1-D barycentric interpolation 2 n flops per component."""
    table = table_flops(n, d, 1 + d, sources, panel_nodes)
    per_point = 2.0 * n * d if d == 1 else (400.0 if compiled else 45000.0)
    return table + points * per_point


def direct_estimate(targets: int, heads: int, sources: int) -> float:
    """Direct summation in the same units: one exp plus a score and moment product per
    pair costs about 50 matrix-product flops (measured with OpenBLAS: 1.65 ns per pair
    against 0.03 ns per flop)."""
    return 50.0 * targets * heads * sources
