r"""Fast attention: the log-Laplace transform of rho tabulated once for all heads.

Every head's velocity is V_h grad Lambda_rho(A_h x) with
Lambda_rho(b) = log int e^{<b,y>} rho(y) dy (design §4). Lambda depends on rho alone, so
its gradient m(b) (and Hessian C(b)) are tabulated on a tensor Chebyshev-Lobatto grid
covering every b = A_h x, and each head and target costs an interpolation:

* table: e^{<b,y>} = prod_a e^{b_a y_a} factorises per coordinate, so for d = 2 the sums
  Z[g1,g2] = sum_j w_j e^{b1_g1 y1_j} e^{b2_g2 y2_j} (and the y-moments) are matrix
  products (n x M)(M x n). Each rank sums its own sources; one Allreduce of the n^d
  tables completes them (no source gather).
* log-domain safety: every factor is shifted by its largest exponent over the sources
  (so it is <= 1), and the sources are split into tiles small enough that the product
  of two shifted factors cannot underflow (|b| x tile size bounded); tiles combine by
  log-sum-exp. Moments are ratios, so the shifts cancel.
* interpolation: barycentric in each coordinate, (P x n) weights; with the tables it is
  again matrix products, P = targets x heads.
* accuracy: the grid size n is chosen from the b-range and ``tol`` by the decay of the
  tables' Chebyshev coefficients (doubling n until the tail is below tol); the grid box
  is rounded outward to a dyadic lattice, so box and n stay fixed under small changes
  of the heads and the interpolated map is smooth in them (gradients are exact for it).

Reverse mode (:meth:`LaplaceTable.vjp`): table cotangents are the transposed
interpolation of the target cotangents (matrix products again); the source-weight
cotangents follow from dm/dw_j = e^{<b,y_j>} (y_j - m) / Z per grid node, i.e. the
transposed factorised sum -- the adjoint's nonlocal source term at the same cost.

Implemented for d = 1 and 2. In d = 3 an n^3 table with n ~ 33-65 costs more than direct
summation at the sizes pdeformer meshes reach, so ``auto`` uses direct there.
"""

from __future__ import annotations


import numpy as np
from mpi4py import MPI

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


def predicted_size(table, tol: float) -> int:
    """Table size at which the Chebyshev coefficients of m, decaying geometrically as
    fitted on the upper half of this (smaller) table's modes, fall to tol/4."""
    shells = None
    for t in table.m:
        c = np.abs(chebyshev_coefficients(t))
        k = np.indices(c.shape).max(axis=0)          # the mode's shell: max index
        shell = np.zeros(c.shape[0])
        np.maximum.at(shell, k.ravel(), c.ravel())
        shells = shell if shells is None else np.maximum(shells, shell)
    scale = max(np.abs(table.m).max(), 1e-300)
    ks = np.arange(len(shells))[len(shells) // 2:]
    logs = np.log(np.maximum(shells[ks], 1e-300 * scale) / scale)
    slope, icpt = np.polyfit(ks, logs, 1)
    if slope >= -1e-3:
        return SIZES[-1]
    return int(np.ceil((np.log(tol / 4) - icpt) / slope))


def chebyshev_tail(values: np.ndarray) -> float:
    """Largest |Chebyshev coefficient| in the top eighth of modes along any axis of a
    table on Lobatto nodes (coefficients by an FFT of the even extension)."""
    c = chebyshev_coefficients(values)
    n = c.shape[0]
    cut = n - max(2, n // 8)
    mask = np.zeros(c.shape, bool)
    for axis in range(c.ndim):
        idx = [slice(None)] * c.ndim
        idx[axis] = slice(cut, None)
        mask[tuple(idx)] = True
    return float(np.abs(c[mask]).max())


def grid_box(b_lo: np.ndarray, b_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The b-range rounded outward to a dyadic lattice (1/8 of its width, at least 1/16):
    the same box for small changes of the heads."""
    width = np.maximum(b_hi - b_lo, 0.5)
    step = 2.0 ** np.floor(np.log2(width / 8))
    return np.floor(b_lo / step) * step - step, np.ceil(b_hi / step) * step + step


class LaplaceTable:
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
        self._build()

    # ------------------------------------------------------------------ tables
    def _split(self, points, weights) -> list:
        """Tiles of the sources' bounding box, small enough that no shifted product of
        per-axis factors underflows: max|b| x tile extent <= UNDERFLOW_GAP per axis."""
        lo, hi = np.empty(self.d), np.empty(self.d)
        self.comm.Allreduce(points.min(axis=0) if len(points) else np.full(self.d, np.inf), lo, op=MPI.MIN)
        self.comm.Allreduce(points.max(axis=0) if len(points) else np.full(self.d, -np.inf), hi, op=MPI.MAX)
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

    def _factors(self, pts):
        """Per axis: b_g * y_j (n, M) and its max over the tile's points (global)."""
        raw = [np.outer(nodes, pts[:, a]) for a, (nodes, _) in enumerate(self.axes)]
        shifts = []
        for r in raw:
            local = r.max(axis=1) if r.shape[1] else np.full(self.n, -np.inf)
            s = np.empty(self.n)
            self.comm.Allreduce(local, s, op=MPI.MAX)
            shifts.append(np.where(np.isfinite(s), s, 0.0))
        return raw, shifts

    def _build(self):
        d = self.d
        self.tile_data = []
        sums, logscale = [], []
        for pts, w, _ in self.tiles:
            raw, shifts = self._factors(pts)
            E = [np.exp(r - s[:, None]) for r, s in zip(raw, shifts)]
            cols = self._moment_columns(pts, w)              # (M, ncols)
            if d == 1:
                local = (E[0] @ cols).T                       # (ncols, n)
            else:
                local = np.stack([(E[0] * c) @ E[1].T for c in cols.T])   # (ncols, n, n)
            local = np.ascontiguousarray(local)
            total = np.empty(local.shape)
            self.comm.Allreduce(local, total, op=MPI.SUM)
            scale = shifts[0] if d == 1 else shifts[0][:, None] + shifts[1][None, :]
            self.tile_data.append((pts, w, shifts))
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

    def error_estimate(self) -> float:
        """Interpolation error of m relative to its size: 4 x the largest Chebyshev
        coefficient in the top eighth of modes (measured on smooth and skewed densities:
        the largest coefficient there is 0.3-7 x the true error for n = 17-129, so with
        the factor 4 the estimate is above the error)."""
        scale = max(np.abs(self.m).max(), 1e-300)
        return 4.0 * max(chebyshev_tail(t) for t in self.m) / scale

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

    def weights_cotangent(self, mbar: np.ndarray) -> np.ndarray:
        """d<mbar, m>/dw_j for this rank's sources (in their original order), with
        dm_g/dw_j = e^{<b_g, y_j>} (y_j - m_g) / Z_g on every grid node g."""
        d = self.d
        out = np.zeros(sum(len(t[2]) for t in self.tiles))
        for (pts, w, shifts), (_, _, idx) in zip(self.tile_data, self.tiles):
            if len(pts) == 0:
                continue
            raw = [np.outer(nodes, pts[:, a]) for a, (nodes, _) in enumerate(self.axes)]
            E = [np.exp(r - s[:, None]) for r, s in zip(raw, shifts)]
            scale = shifts[0] if d == 1 else shifts[0][:, None] + shifts[1][None, :]
            factor = np.exp(scale - self.ref) / self.Zhat     # e^{shift}/Z on the grid
            beta = [mbar[k] * factor for k in range(d)]       # coefficient of y_k
            beta0 = -sum(mbar[k] * self.m[k] for k in range(d)) * factor
            if d == 1:
                acc = E[0].T @ beta0 + pts[:, 0] * (E[0].T @ beta[0])
            else:
                def diag(X):
                    return np.einsum("jc,cj->j", E[0].T @ X, E[1])
                acc = diag(beta0) + sum(pts[:, k] * diag(beta[k]) for k in range(d))
            out[idx] = acc
        return out


class FineGrid:
    """Second level for many points (d = 2): the table's Chebyshev interpolant sampled
    on a uniform nf x nf grid (two small matrix products), then interpolated locally by
    tensor Lagrange polynomials of degree P_LOCAL (P_LOCAL + 1 points per axis). The
    cost per point no longer grows with n; the map stays piecewise polynomial, and its
    reverse mode is the exact transpose (scatter-add, then the transposed sampling)."""

    P_LOCAL = 5

    def __init__(self, table: "LaplaceTable", nf: int):
        self.table, self.nf = table, nf
        p = self.P_LOCAL
        self.h = (table.hi - table.lo) / (nf - 1)
        # S_a (nf x n): the Chebyshev interpolant's values at the uniform points of axis a
        self.sample = [barycentric_weights(table.lo[a] + self.h[a] * np.arange(nf), nodes, lam)
                       for a, (nodes, lam) in enumerate(table.axes)]
        self.flat = self._sampled(list(table.m))            # m on the fine grid
        self._den = np.array([np.prod([a - c for c in range(p + 1) if c != a]) for a in range(p + 1)])

    def _sampled(self, tables: list) -> np.ndarray:
        nf = self.nf
        vals = np.stack([self.sample[0] @ t @ self.sample[1].T for t in tables], axis=-1)
        return vals.reshape(nf * nf, len(tables))

    def _locate(self, b: np.ndarray):
        """Stencil start, local Lagrange weights and their t-derivatives per axis: with
        q(t) = prod_c (t - c), L_a = q lam_a / (t - a) and L_a' = L_a sum_{c != a} 1/(t - c);
        points on a stencil node are nudged by 1e-13 cells (below every tolerance)."""
        p, nf = self.P_LOCAL, self.nf
        t = (b - self.table.lo) / self.h                     # grid coordinates
        start = np.clip(np.floor(t).astype(int) - (p - 1) // 2, 0, nf - 1 - p)
        L, dL = [], []
        c = np.arange(p + 1)
        for a in range(2):
            x = (t[:, a] - start[:, a])[:, None] - c          # (P, p+1): t - c
            x[x == 0.0] = 1e-13
            inv = 1.0 / x
            q = np.prod(x, axis=1, keepdims=True)
            La = q * inv / self._den
            L.append(La)
            dL.append(La * (inv.sum(axis=1, keepdims=True) - inv))
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
        local = np.stack([self.sample[0].T @ acc[k].reshape(nf, nf) @ self.sample[1] for k in range(d)])
        mbar = np.empty_like(local)
        self.table.comm.Allreduce(local, mbar, op=MPI.SUM)
        return m, J, mbar

    def error(self, samples: int = 400) -> float:
        """Largest difference to the Chebyshev interpolant at fixed pseudo-random points
        of the box, relative to the size of m (the same points on every rank)."""
        t = self.table
        rng = np.random.default_rng(12345)
        b = t.lo + (t.hi - t.lo) * rng.random((samples, t.d))
        ref = t.means(b)
        return float(np.abs(self.means(b) - ref).max() / max(np.abs(t.m).max(), 1e-300))


FINE_FROM = 129  # table size from which the two-level interpolation is faster (measured)


def fine_grid(table: "LaplaceTable", tol: float, nf: int | None = None):
    """A FineGrid whose local error is below tol/2 (nf = 2n, 4n, 8n), or None when
    interpolating directly from the table is the better choice (or nothing meets it)."""
    if table.d != 2 or (nf is None and table.n < FINE_FROM):
        return None
    if nf is not None:
        return FineGrid(table, nf)
    for factor in (2, 4, 8):
        fg = FineGrid(table, factor * table.n)
        if fg.error() <= tol / 2:
            return fg
    return None


def choose_table(points, weights, b_lo, b_hi, comm, tol: float, order: int = 1,
                 n_max: int = N_MAX, hint: int | None = None):
    """The smallest n in SIZES (up to n_max) whose table meets ``tol`` by its error
    estimate, on the rounded box; returns (table, estimate). ``hint`` (the size chosen
    last time) only shortens the search: it walks down from there while the smaller
    size still meets tol, up while it does not, so the answer is the same as a search
    from the smallest size whenever the estimate falls with n. If no size meets tol, the
    largest is returned with its estimate (the caller decides)."""
    lo, hi = grid_box(np.asarray(b_lo, float), np.asarray(b_hi, float))
    sizes = [n for n in SIZES if n <= n_max] or [N_MIN]
    tiles, built = None, {}

    def build(i):
        nonlocal tiles
        if i not in built:
            table = LaplaceTable(points, weights, lo, hi, sizes[i], comm, order, tiles)
            tiles = table.tiles
            built[i] = (table, table.error_estimate())
        return built[i]

    if hint in sizes:
        i = sizes.index(hint)
    else:  # a small table tells how fast the coefficients fall: start near the answer
        i = sizes.index(33) if 33 in sizes else 0
        if build(i)[1] > tol:
            want = 1.2 * predicted_size(build(i)[0], tol)   # the fit undershoots a little
            i = next((j for j, n in enumerate(sizes) if n >= want), len(sizes) - 1)
    if build(i)[1] <= tol:
        while i > 0 and build(i - 1)[1] <= tol:
            i -= 1
    else:
        while i + 1 < len(sizes) and build(i)[1] > tol:
            i += 1
    return build(i)


def b_range(targets: np.ndarray, A: np.ndarray, comm) -> tuple[np.ndarray, np.ndarray]:
    """min and max over heads, this rank's targets and all ranks of b = A_h x."""
    d = A.shape[1]
    if targets.shape[0]:
        b = np.einsum("hij,nj->hni", A, targets).reshape(-1, d)
        lo, hi = b.min(axis=0), b.max(axis=0)
    else:
        lo, hi = np.full(d, np.inf), np.full(d, -np.inf)
    glo, ghi = np.empty(d), np.empty(d)
    comm.Allreduce(lo, glo, op=MPI.MIN)
    comm.Allreduce(hi, ghi, op=MPI.MAX)
    return glo, ghi


def flops_estimate(n: int, d: int, sources: int, points: int) -> float:
    """Matrix-product flops of an order-1 table (1 + d sums over the sources) and of
    interpolating its d components at ``points`` (for the auto backend)."""
    return 2.0 * n**d * sources * (1 + d) + 2.0 * points * n**d * d


def direct_estimate(targets: int, heads: int, sources: int) -> float:
    """Direct summation in the same units: one exp plus a score and moment product per
    pair costs about 50 matrix-product flops (measured with OpenBLAS: 1.65 ns per pair
    against 0.03 ns per flop)."""
    return 50.0 * targets * heads * sources
