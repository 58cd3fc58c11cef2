r"""Fast attention: the log-Laplace transform of rho tabulated once for all heads.

Every head's velocity is V_h grad Lambda_rho(A_h x) with
Lambda_rho(b) = log int e^{<b,y>} rho(y) dy (design §4). Lambda depends on rho alone, so
its gradient m(b) is tabulated on a tensor Chebyshev-Lobatto grid covering every
b = A_h x, and each head and target costs an interpolation:

* table: e^{<b,y>} = prod_a e^{b_a y_a} factorises per coordinate, so for d = 2 the sums
  Z[g1,g2] = sum_j w_j e^{b1_g1 y1_j} e^{b2_g2 y2_j} (and the y-moments) are matrix
  products (n x M)(M x n). With many sources they go through panel nodes (:class:`Panels`):
  the sources are spread onto narrow Chebyshev panels on which e^{b y} is a polynomial to
  1e-14 (a compiled loop where a C compiler is at hand), and the table is E_1 W E_2^T.
  Each rank spreads its own sources, onto the panels they touch only (its window), and
  multiplies through that window: the products divide over ranks like the sources. One
  Allreduce of the n^d tables completes them (no source gather).
* signed weights (DG without the limiter dips below zero): Z may change sign in parts of
  the box that no target reaches, so m = S_y / Z has poles there. The table then holds
  mu = S_y / N and zeta = Z / N with N = sum_j |w_j| e^{<b,y_j>} > 0 -- both smooth and
  bounded -- and m = mu / zeta is taken at each point (:attr:`LaplaceTable.signed`).
* log-domain safety: every factor is shifted by its largest exponent over the sources
  (so it is <= 1), and the sources are split into tiles small enough that the product
  of two shifted factors cannot underflow (|b| x tile size bounded); tiles combine by
  log-sum-exp. Moments are ratios, so the shifts cancel.
* interpolation: barycentric in each coordinate, (P x n) weights, P = targets x heads;
  in 2-D and 3-D through a uniform fine grid and local degree-5 Lagrange polynomials
  (:class:`FineGrid`, a compiled loop where a C compiler is at hand; its sampling is
  divided over ranks by rows and all-gathered).
* accuracy: the grid size n is one whose error estimate (from the decay of the tables'
  Chebyshev coefficients, computed by rows divided over ranks) meets ``tol``, predicted
  from a trial table of a subsample (:func:`choose_table`); the grid box is rounded
  outward to a dyadic lattice, so box and n stay fixed under small changes of the heads
  and the interpolated map is smooth in them (gradients are exact for it).
* plans: :class:`TablePlanner` keeps, per key (a prompt's layer), the box, sizes and kind
  of the last table (a :class:`TablePlan`) and builds the next one the same way while the
  heads' b-range stays inside the box and the new table's own estimate meets tol; the
  plan goes on the tape, so the adjoint rebuilds exactly the table the forward pass used.

Reverse mode: table cotangents are the transposed interpolation of the target cotangents;
the source cotangents follow from dm/dw_j = e^{<b,y_j>} (y_j - m) / Z and
dm/dy_j = w_j e^{<b,y_j>} / Z [I + (y_j - m) b^T] per grid node, i.e. transposed
factorised sums -- the adjoint's nonlocal source term at the cost of a table.

Implemented for d = 1, 2 and 3. In 3-D the table has n^3 nodes (sizes SIZES3, at most
N3_MAX_FORCED): its sums are E_0 (x) E_1 per block of sources times E_2^T, or through panel
triples (each source spread onto the q^3 nodes of its panel triple, then three products
on this rank's window, :meth:`LaplaceTable._spread3`); the fine grid has nf^3 nodes of four
values and its own compiled loops (kernels/fine3_loops.h). The table pays where
|b| x the sources' extent is moderate (tokens of unit scale, the sphere): its cost grows
like (|b| extent)^3, direct summation's like targets x heads x sources.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .softmax import Sources, moments_from_sums, partial_sums, value_gain
from ..tools.parallel import (allgather_rows, allreduce_sum, any_rank, reduce_scatter_sum,
                              share_bounds)
from .costs import machine_costs
from .compiled import (KERNEL_DEGREE, PANEL_QMAX, fine_velocity, fine_velocity_vjp, kernels_on,
                       panel_gather, panel_spread)

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
ZETA_MIN = 0.5          # signed weights: pairs (head, target) with |zeta| < ZETA_MIN are summed
                        # exactly (m = mu / zeta would amplify the table's error by 1/|zeta|)
UNDERFLOW_GAP = 600.0   # keep every shifted exponent above e^-600 (float64 ~ e^-708)
MAX_TILES = 4096
TILE_SUMS3_BYTES = 2**27   # 3-D: the per-tile sums (tiles x ncols x n^3 doubles) at most 128 MiB
EVERY_RANK = "every rank"   # lib argument: the compiled loops where every rank has them


# ------------------------------------------------------------------ work divided by rows
def share(count: int, comm) -> slice:
    """This rank's contiguous share [r count / P, (r + 1) count / P) of ``count`` rows."""
    return slice(count * comm.rank // comm.size, count * (comm.rank + 1) // comm.size)


def _share_counts(count: int, comm, width: int) -> tuple[np.ndarray, np.ndarray]:
    bounds = share_bounds(count, comm.size) * width
    return np.diff(bounds), bounds[:-1]


def allgather_shares(comm, local: np.ndarray, count: int) -> np.ndarray:
    """The row shares (:func:`share`) of a (count, ...) array, computed one per rank,
    assembled on every rank (one Allgatherv; the counts are known, none exchanged)."""
    if comm.size == 1:
        return local
    tail = local.shape[1:]
    counts, displs = _share_counts(count, comm, int(np.prod(tail)))
    out = np.empty((count,) + tail)
    comm.Allgatherv(np.ascontiguousarray(local).ravel(), [out, counts, displs, MPI.DOUBLE])
    return out


def reduce_shares(comm, full: np.ndarray) -> np.ndarray:
    """The sum over ranks of (count, ...) arrays, this rank's share of its rows only (one
    reduce-scatter, :func:`reduce_scatter_sum`)."""
    if comm.size == 1:
        return full
    count, tail = full.shape[0], full.shape[1:]
    counts, _ = _share_counts(count, comm, int(np.prod(tail)))
    return reduce_scatter_sum(comm, full, counts).reshape((-1,) + tail)


def any_negative(weights: np.ndarray, comm) -> bool:
    """Whether some rank holds a negative weight (a signed density)."""
    return bool(comm.allreduce(bool(np.any(weights < 0)), op=MPI.LOR))


# ------------------------------------------------------------------ Chebyshev grids
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


def grid_box(b_lo: np.ndarray, b_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The b-range rounded outward to a dyadic lattice (about 1/64 of its width) plus one
    lattice step: the same box for small changes of the heads, at most 6% wider."""
    width = np.maximum(b_hi - b_lo, 0.5)
    step = 2.0 ** np.floor(np.log2(width / 64))
    return np.floor(b_lo / step) * step - step, np.ceil(b_hi / step) * step + step


PANEL3_BYTES = 2**27  # 3-D: panel sums of at most 128 MiB (ncols x K_0 K_1 K_2 doubles; twice
                     # that while they are reordered)
PANEL_BETA = 3.0     # |b|max x panel half-width: e^{b y} varies by at most e^{2 beta} on a panel
PANEL_EPS = 1e-14    # relative accuracy of the per-panel interpolation of e^{b y} (at most)


def panel_eps(tol: float) -> float:
    """The panel accuracy a table for ``tol`` needs: 1e-3 tol, in [PANEL_EPS, 1e-9] (the
    spread costs q^2 per source and column: q = 18 at 1e-9 against 23 at 1e-14)."""
    return float(min(1e-9, max(PANEL_EPS, 1e-3 * tol)))


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

    def index(self, y: np.ndarray) -> np.ndarray:
        """The panel of each point: the last edge at or below it (clamped)."""
        return np.clip(np.searchsorted(self.edges, y, side="right") - 1, 0, self.count - 1)

    def locate(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Panel index (m,) and Lagrange weights (m, q) of the points y (m,)."""
        p = self.index(y)
        a, b = self.edges[p], self.edges[p + 1]
        t = np.clip(2 * (y - a) / np.where(b > a, b - a, 1.0) - 1, -1.0, 1.0)
        return p, barycentric_weights(t, self.std, self.lam)

    def window(self, first: int, last: int) -> "Panels":
        """Panels first..last alone (same edges and nodes): a point of them has the same
        panel, less ``first``, and the same weights."""
        sub = object.__new__(Panels)
        sub.q, sub.std, sub.lam = self.q, self.std, self.lam
        sub.count = last - first + 1
        sub.edges = self.edges[first:last + 2]
        sub.nodes = self.nodes[first * self.q:(last + 1) * self.q]
        return sub


def blocks_by_key(key: np.ndarray):
    """(value, indices) for every distinct value of an integer key."""
    order = np.argsort(key, kind="stable")
    values, starts = np.unique(key[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    for v, i0, i1 in zip(values, starts, ends):
        yield int(v), order[i0:i1]


PANEL3_CHUNK = 4096   # sources whose Lagrange products are formed at once (3-D panel sums)


def panel_triples(panels, loc):
    """The sources of 3-D panels sorted by panel triple, a chunk at a time: (their indices,
    their axis-0 Lagrange weights L0 (m, q), the products L1 (x) L2 (m, q^2), the runs of
    one triple in the chunk as (triple, start, stop)). ``loc``: each axis's
    :meth:`Panels.locate` of the sources."""
    q = panels[0].q
    P1, P2 = panels[1].count, panels[2].count
    key = (loc[0][0] * P1 + loc[1][0]) * P2 + loc[2][0]
    order = np.argsort(key, kind="stable")
    key = key[order]
    for c0 in range(0, len(order), PANEL3_CHUNK):
        idx = order[c0:c0 + PANEL3_CHUNK]
        k = key[c0:c0 + len(idx)]
        L12 = (loc[1][1][idx][:, :, None] * loc[2][1][idx][:, None, :]).reshape(len(idx), q * q)
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(k)) + 1, [len(idx)]])
        yield idx, loc[0][1][idx], L12, [(int(k[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def coordinate_range(points: np.ndarray, comm) -> tuple[np.ndarray, np.ndarray]:
    """Per-axis min and max of the points of all ranks (inf, -inf where there are none):
    one Allreduce of (-min, max)."""
    d = points.shape[1]
    local = np.concatenate([-points.min(axis=0), points.max(axis=0)]) if len(points) \
        else np.full(2 * d, -np.inf)
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return -local[:d], local[d:]


def panel_product_flops(n: int, d: int, ncols: int, nodes: list) -> float:
    """Flops of the products E_1 W (d = 1), E_1 W E_2^T (d = 2) or its 3-D analogue of
    ncols tables from the panel nodes, K_a per axis: 2 ncols n K_1, 2 ncols
    (n K_1 K_2 + n^2 K_2) or 2 ncols (n K_0 K_1 K_2 + n^2 K_1 K_2 + n^3 K_2)."""
    K = nodes
    if d == 3:
        return 2.0 * ncols * (n * K[0] * K[1] * K[2] + n * n * K[1] * K[2] + n**3 * K[2])
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


def dense_seconds(costs, n: int, d: int, ncols: int, sources: int) -> float:
    """A table's ncols sums over the sources directly: the products (table_flops) and
    the work per grid node and source besides them (the per-axis factors' exponentials,
    in 2-D the factor times each column; in 3-D per n^2 nodes: E_0 (x) E_1 times each
    column; n per source in 1-D and 2-D, n^2 in 3-D)."""
    return table_flops(n, d, ncols, sources, None) * costs.flop + n ** max(1, d - 1) * sources * costs.dense_node


SPREAD3_SLOWDOWN = 2.5   # the 3-D spread's small products run this far below costs.flop, and
SPREAD3_NODE = 3.0       # each panel node and column costs 3 dense_node (zeroed, summed into,
                         # reordered): measured with 2.5e4-1e6 sources, K = 18-184


def panel_seconds(costs, n: int, d: int, ncols: int, sources: int, nodes: list, blocks: int,
                  compiled: bool) -> float:
    """The same sums through panel nodes (K_a per axis): the products, and the spread
    -- compiled: per source and column and per call; numpy: its products per source
    and column (2 q^d flops) and a loop step per block of sources (panel pair); in 3-D
    (numpy) also the work per panel node and column."""
    products = panel_product_flops(n, d, ncols, nodes) * costs.flop
    if d == 3:      # numpy, per triple: its small products, and the panel-major sums kept
        spread = 2.0 * ncols * sources * panel_degree() ** 3 * costs.flop * SPREAD3_SLOWDOWN
        return products + spread + SPREAD3_NODE * costs.dense_node * ncols * float(np.prod(nodes)) \
            + costs.numpy_block * min(blocks, sources)
    if compiled:
        return products + costs.spread * ncols * sources + costs.spread_call
    spread = 2.0 * ncols * sources * panel_degree() ** d * costs.flop
    return products + spread + costs.numpy_block * min(blocks, sources)


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


# ------------------------------------------------------------------ interpolants
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


class LaplaceTable(HeadSums):
    """The values of m(b) = grad Lambda(b) on a Chebyshev grid, for this rank's sources
    ``points``/``weights`` summed over ``comm``: m itself (``values``, d tables) for
    nonnegative weights; for ``signed`` ones (any negative weight on any rank; decided
    here if not given) mu = S_y / N and zeta = Z / N (d + 1 tables) with
    N = sum_j |w_j| e^{<b, y_j>}, m = mu / zeta at each point. ``layout``: a
    :class:`SourceLayout` of these points for this box (built if not given, with panels
    accurate to ``eps``)."""

    def __init__(self, points, weights, lo, hi, n: int, comm, signed: bool | None = None,
                 layout: SourceLayout | None = None, lib=EVERY_RANK, eps: float = PANEL_EPS):
        self.d = points.shape[1]
        if self.d > 3:
            raise ValueError("the laplace backend is implemented for d = 1, 2 and 3")
        self.comm, self.n = comm, n
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
            self.lib = kernels_on(comm) if lib is EVERY_RANK else lib
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

    # ------------------------------------------------------------------ tables
    assessment = None     # its errors, where assessed (:func:`assess`)
    _group_scales = None  # group_scales, once found
    SOURCE_CHUNK = 4096  # sources per block: the (n x chunk) factors stay in cache

    def _panels(self, tile: Tile):
        """The tile's panels, or None where summing over its sources directly is cheaper,
        from the sizes over all ranks and this machine's costs (costs.py; every rank
        takes the same path): :func:`dense_seconds` against :func:`panel_seconds`. In 3-D
        not where the spread sums (ncols K_0 K_1 K_2) would take more than PANEL3_BYTES."""
        if tile.count == 0:
            return None
        costs = machine_costs(self.comm)
        K = [len(pa.nodes) for pa in tile.panels]
        if self.d == 3 and self.ncols * np.prod(K, dtype=float) * 8 > PANEL3_BYTES:
            return None
        blocks = int(np.prod([pa.count for pa in tile.panels]))
        via = panel_seconds(costs, self.n, self.d, self.ncols, tile.count, K, blocks, self.lib is not None)
        return tile.panels if via < dense_seconds(costs, self.n, self.d, self.ncols, tile.count) else None

    def _spread(self, panels, pts, cols) -> np.ndarray:
        """W[c, k0, k1] = sum_j cols[j, c] L_k0(y0_j) L_k1(y1_j): the sources on the
        panel nodes (d = 1: W[c, k0])."""
        q = panels[0].q
        if self.lib is not None:
            return panel_spread(self.lib, panels, pts, cols)
        loc = [pa.locate(pts[:, a]) for a, pa in enumerate(panels)]
        if self.d == 3:
            return LaplaceTable._spread3(panels, loc, cols)
        if self.d == 1:
            W = np.zeros((cols.shape[1], len(panels[0].nodes)))
            for p0, idx in blocks_by_key(loc[0][0]):
                W[:, p0 * q:(p0 + 1) * q] += cols[idx].T @ loc[0][1][idx]
            return W
        P1 = panels[1].count
        W = np.zeros((cols.shape[1], len(panels[0].nodes), len(panels[1].nodes)))
        for key, idx in blocks_by_key(loc[0][0] * P1 + loc[1][0]):
            p0, p1 = divmod(key, P1)
            right = (cols[idx][:, :, None] * loc[1][1][idx][:, None, :]).reshape(len(idx), -1)
            blk = (loc[0][1][idx].T @ right).reshape(q, cols.shape[1], q)
            W[:, p0 * q:(p0 + 1) * q, p1 * q:(p1 + 1) * q] += blk.transpose(1, 0, 2)
        return W

    @classmethod
    def _spread3(cls, panels, loc, cols) -> np.ndarray:
        """The 3-D spread W[c, k0, k1, k2]: per panel triple the product (cols (x) L0)^T
        (L1 (x) L2) over its sources (:func:`panel_triples`), into a panel-major array
        (contiguous blocks), reordered once at the end."""
        q, nc = panels[0].q, cols.shape[1]
        P = [pa.count for pa in panels]
        W = np.zeros((P[0] * P[1] * P[2], nc * q, q * q))
        last = -1                  # the block a chunk ended in (the next may add to it)
        for idx, L0, L12, segments in panel_triples(panels, loc):
            left = (cols[idx][:, :, None] * L0[:, None, :]).reshape(len(idx), nc * q)
            for key, a, b in segments:
                if key == last:
                    W[key] += left[a:b].T @ L12[a:b]
                else:
                    np.matmul(left[a:b].T, L12[a:b], out=W[key])
            last = segments[-1][0]
        W = W.reshape(P[0], P[1], P[2], nc, q, q, q).transpose(3, 0, 4, 1, 5, 2, 6)
        return np.ascontiguousarray(W).reshape((nc,) + tuple(p * q for p in P))

    def _through(self, tile, E, E0, W, out: np.ndarray) -> None:
        """This rank's part of the table from its spread W (ncols, window), into ``out``
        (ncols, n, ..): W E_1^T in 1-D; in 2-D E_0 (W E_1^T) in two steps that divide over
        ranks however the mesh is partitioned: Y = W E_1^T over the blocks of W that are
        not zero (rows of panel nodes by columns its sources touch, ``tile.row_cols``),
        the Y of all ranks summed onto each rank's share of the rows (one
        Reduce_scatter), then its rows' part E_0[:, share] Y[share] of the table (axes
        named for ``lead`` = 0; for 1 the same on the transposed W, read in place).
        Collective: every rank calls it for a tile built through panels, with W None where
        it has no sources there. In 3-D E_0 W E_1^T E_2^T on this rank's window only,
        three products (not collective)."""
        n, ncols = self.n, self.ncols
        if self.d == 1:
            out[...] = 0.0 if W is None else W @ E[0].T
            return
        if self.d == 3:         # this rank's window alone (the Allreduce of the tables sums them)
            if W is None:
                out[...] = 0.0
                return
            K0, K1, K2 = W.shape[1:]
            T = np.matmul(E[0], W.reshape(ncols, K0, K1 * K2)).reshape(ncols, n, K1, K2)
            np.matmul(np.matmul(E[1], T), E[2].T, out=out)                # (ncols, n, n, n)
            return
        q, lead = tile.panels[0].q, tile.lead
        Y = np.zeros((len(tile.panels[lead].nodes), ncols, n))      # (lead nodes, ncols, other grid)
        if W is not None:
            r0, E1 = tile.first[lead] * q, tile.oriented(E)[1]
            for r, c0, c1 in tile.row_cols:
                rows, cols = slice(r * q, (r + 1) * q), slice(c0 * q, (c1 + 1) * q)
                block = W[:, rows, cols] if lead == 0 else W[:, cols, rows].transpose(0, 2, 1)
                np.matmul(block, E1[:, cols].T, out=Y[r0 + r * q:r0 + (r + 1) * q].transpose(1, 0, 2))
        mine = reduce_shares(self.comm, Y)                          # (share rows, ncols, n)
        if lead == 0:         # out[c, i, j] = sum_k E_0[i, k] Y[k, c, j]
            np.matmul(E0, mine.transpose(1, 0, 2), out=out)
        else:                 # out[c, j, i] = sum_k Y[k, c, j] E_0[i, k]
            np.matmul(mine.transpose(1, 2, 0), E0.T, out=out)

    def _gathered(self, tile, E, E0, grids: list, factor):
        """G_i = E_1^T (X_i factor) E_2 on this rank's panel nodes (ngrids, window), the
        transpose of :meth:`_through` and divided the same way (in the tile's ``lead``
        orientation): Z_i = E_1^T X_i on each rank's share of the lead axis's nodes, all of
        them gathered (one Allgatherv), then Z E_2 on the blocks this rank's sources touch
        (the rest of G is left unset: no source reads it). Collective; None where this
        rank has no sources in the tile."""
        n, ni, lead = self.n, len(grids), tile.lead
        X = np.empty((ni, n, n))
        for i, grid in enumerate(grids):
            np.multiply(grid, factor, out=X[i])
        if lead:
            X = X.transpose(0, 2, 1)
        mine = np.empty((E0.shape[1], ni, n))                            # (share rows, ni, n)
        np.matmul(E0.T, X, out=mine.transpose(1, 0, 2))
        Z = allgather_shares(self.comm, mine, len(tile.panels[lead].nodes))
        if tile.local_panels is None:
            return None
        q = tile.panels[0].q
        r0, E1 = tile.first[lead] * q, tile.oriented(E)[1]
        G = np.empty((ni,) + tuple(len(pa.nodes) for pa in tile.local_panels))
        for r, c0, c1 in tile.row_cols:
            rows, cols = slice(r * q, (r + 1) * q), slice(c0 * q, (c1 + 1) * q)
            block = G[:, rows, cols] if lead == 0 else G[:, cols, rows].transpose(0, 2, 1)
            np.matmul(Z[r0 + r * q:r0 + (r + 1) * q].transpose(1, 0, 2), E1[:, cols], out=block)
        return G

    def _chunks(self, pts, shifts):
        """(slice, per-axis shifted factors e^{b_g y_j - shift_g} (n, chunk)) by source
        block, in buffers reused from block to block (fresh ones cost page faults)."""
        chunk = self._source_chunk()
        width = min(len(pts), chunk)
        buffers = [np.empty((len(nodes), width)) for nodes, _ in self.axes]
        for j0 in range(0, len(pts), chunk):
            blk = slice(j0, min(len(pts), j0 + chunk))
            E = []
            for a, (nodes, _) in enumerate(self.axes):
                r = buffers[a][:, :blk.stop - j0]
                np.multiply.outer(nodes, pts[blk, a], out=r)
                r -= shifts[a][:, None]
                E.append(np.exp(r, out=r))
            yield blk, E

    def _columns(self) -> np.ndarray:
        """[w, w y_1 .. w y_d (, |w|)] for this rank's sources, (M, ncols)."""
        w, y = self.weights, self.layout.points
        cols = [w, *(w * y[:, a] for a in range(self.d))] + ([np.abs(w)] if self.signed else [])
        return np.column_stack(cols) if len(w) else np.zeros((0, self.ncols))

    def _build(self):
        """The tables: each tile's shifted sums over all ranks (:meth:`_tile_sums`), the
        tiles combined in the log domain, then m = S_y / Z (or mu, zeta for signed weights)."""
        d = self.d
        local = self._tile_sums()
        # combine tiles by log-sum-exp per node on the positive column (Z, or N if signed)
        norm = self.ncols - 1 if self.signed else 0
        self._norms = local[:, norm].copy()   # what the reverse sums need of them (tiles, grid)
        if len(local) == 1:                 # one tile: the shift cancels in every ratio
            S = local[0]
        else:
            scales = self._scales()
            ref = np.max(self._tile_logs(scales), axis=0)
            ref = np.where(np.isfinite(ref), ref, 0.0)
            S = sum(np.exp(ls - ref) * sm for ls, sm in zip(scales, local))
        N = S[norm]
        if np.any(~(N > 0)):
            raise FloatingPointError("laplace table: the partition function vanishes ("
                                     + ("underflowing weights)" if self.signed else
                                        "negative or underflowing weights)"))
        self.values = np.empty((self.ncomp,) + N.shape)     # (ncomp, grid)
        np.divide(S[1:1 + d], N, out=self.values[:d])
        if self.signed:
            np.divide(S[0], N, out=self.values[d])

    def _tile_sums(self) -> np.ndarray:
        """Per tile, its sources' sums [w, w y (, |w|)] e^{<b, y> - shift} on the grid,
        over all ranks (one Allreduce): through the panel nodes where that is cheaper
        (:meth:`_panels`), else summed directly by blocks of sources. Records
        ``tile_data`` (shifts, panels) for the reverse sums."""
        d, n = self.d, self.n
        lay = self.layout
        cols = self._columns()
        factors = lay.factors(self.axes)
        local = np.empty((len(lay.tiles), self.ncols) + (n,) * d)
        self.tile_data = []   # per tile: (shifts, panels or None), for the reverse sums
        for t, (tile, (shifts, E, E0)) in enumerate(zip(lay.tiles, factors)):
            panels = self._panels(tile)
            self.tile_data.append((shifts, panels))
            c = cols[tile.index]
            if panels is not None:          # E_1 W E_2^T through the panel nodes
                W = self._spread(tile.local_panels, tile.pts, c) if len(c) else None
                self._through(tile, E, E0, W, local[t])
                continue
            local[t] = 0.0
            self._dense_sums(tile.pts, shifts, c, local[t])
        allreduce_sum(self.comm, local)
        return local

    def _source_chunk(self) -> int:
        """Sources per block: SOURCE_CHUNK; in 3-D fewer, so that the (ncols, n, n, chunk)
        products of the factors stay near 16 MB."""
        if self.d < 3:
            return self.SOURCE_CHUNK
        return int(min(self.SOURCE_CHUNK, max(64, 2**21 // (self.ncols * self.n**2))))

    def _dense_sums(self, pts, shifts, c, out) -> None:
        """out += sum_j c_j e^{<b, y_j> - shift} on the grid, directly, by blocks of sources."""
        n = self.n
        width = min(len(pts), self._source_chunk())
        work = np.empty((len(out),) + (n,) * (self.d - 1) + (width,)) if self.d > 1 else None
        for blk, Eb in self._chunks(pts, shifts):
            if self.d == 1:
                out += (Eb[0] @ c[blk]).T
                continue
            m = blk.stop - blk.start
            left = work if m == work.shape[-1] else np.empty(work.shape[:-1] + (m,))
            if self.d == 3:        # [E0 (x) E1 c_0; E0 (x) E1 c_1; ...] E2^T
                pair = Eb[0][:, None, :] * Eb[1][None, :, :]
                for k, ck in enumerate(np.ascontiguousarray(c[blk].T)):
                    np.multiply(pair, ck, out=left[k])
                out += (left.reshape(-1, m) @ Eb[2].T).reshape(out.shape)
                continue
            # one product for all columns: [E0 c_0; E0 c_1; ...] E1^T
            for k, ck in enumerate(np.ascontiguousarray(c[blk].T)):   # (strided: 10x slower)
                np.multiply(Eb[0], ck, out=left[k])
            out += (left.reshape(-1, m) @ Eb[1].T).reshape(len(out), n, n)

    def _scales(self) -> list:
        """Per tile, log of its factors' shift on the grid: shift_1 (+ shift_2)."""
        d = self.d
        return [sum(np.reshape(sh[a], (1,) * a + (-1,) + (1,) * (d - 1 - a)) for a in range(d))
                for sh, _ in self.tile_data]

    def _tile_factors(self) -> list:
        """Per tile: e^{shift}/N on the grid, the factor of its shifted sums in the values
        (one tile: 1/N of its shifted sums, the shift cancels)."""
        if len(self._norms) == 1:
            return [1.0 / self._norms[0]]
        scales = self._scales()
        total = np.logaddexp.reduce(self._tile_logs(scales), axis=0)     # log N
        return [np.exp(ls - total) for ls in scales]

    def _tile_logs(self, scales: list) -> list:
        """Per tile, log(e^{shift} N_t) on the grid from its ``scales`` (:meth:`_scales`):
        -inf where its sum underflows, at nodes far from its sources."""
        with np.errstate(divide="ignore"):
            return [ls + np.log(np.maximum(nm, 0.0)) for ls, nm in zip(scales, self._norms)]

    @property
    def log_z(self) -> np.ndarray:
        """log N on the grid (Lambda(b) for nonnegative weights)."""
        return np.logaddexp.reduce(self._tile_logs(self._scales()), axis=0)

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

    # ------------------------------------------------------------------ reverse mode
    def _source_sums(self, grids: list) -> np.ndarray:
        """S[j, i] = sum_g e^{<b_g, y_j>} / N_g X_i[g] for this rank's sources (their
        order) and grid arrays X_i: transposed factorised sums, diag(E_1^T X E_2) per
        source block, in the tiles' shifted scales (through the panel nodes where the
        table was built on them: G = E_1^T X E_2 on this rank's blocks, :meth:`_gathered`,
        then each source's Lagrange weights). Collective where tables use panels."""
        d = self.d
        lay = self.layout
        out = np.zeros((len(lay.points), len(grids)))
        factors = self._tile_factors()
        for tile, (shifts, panels), (_, E, E0), factor in zip(lay.tiles, self.tile_data,
                                                              lay.factors(self.axes), factors):
            pts = tile.pts
            if panels is not None and d == 2:      # collective: every rank takes part
                G = self._gathered(tile, E, E0, grids, factor)
            if len(pts) == 0:
                continue
            acc = np.empty((len(pts), len(grids)))
            if panels is not None:
                local = tile.local_panels
                q = local[0].q
                if d == 3:
                    acc = self._gathered3(local, pts, E, [X * factor for X in grids])
                elif d == 1:
                    loc = local[0].locate(pts[:, 0])
                    G = np.stack([E[0].T @ (X * factor) for X in grids], axis=1)     # (K, i)
                    for p0, j in blocks_by_key(loc[0]):
                        acc[j] = loc[1][j] @ G[p0 * q:(p0 + 1) * q]
                elif self.lib is not None:
                    acc = panel_gather(self.lib, local, pts, G)
                else:
                    loc = [pa.locate(pts[:, a]) for a, pa in enumerate(local)]
                    P1 = local[1].count
                    for key, j in blocks_by_key(loc[0][0] * P1 + loc[1][0]):
                        p0, p1 = divmod(key, P1)
                        g = G[:, p0 * q:(p0 + 1) * q, p1 * q:(p1 + 1) * q]
                        acc[j] = np.einsum("mk,ikl,ml->mi", loc[0][1][j], g, loc[1][1][j])
            else:
                for blk, Eb in self._chunks(pts, shifts):
                    for i, X in enumerate(grids):
                        if d == 1:
                            acc[blk, i] = Eb[0].T @ (X * factor)
                        elif d == 2:
                            acc[blk, i] = np.einsum("jc,cj->j", Eb[0].T @ (X * factor), Eb[1])
                        else:           # ((X E_2) . E_1 summed) . E_0 summed
                            n, m = self.n, blk.stop - blk.start
                            t = ((X * factor).reshape(n * n, n) @ Eb[2]).reshape(n, n, m)
                            acc[blk, i] = np.einsum("gj,gj->j", np.einsum("gcj,cj->gj", t, Eb[1]), Eb[0])
            out[tile.index] = acc
        return out

    def _gathered3(self, panels, pts, E, grids: list) -> np.ndarray:
        """out[j, i] = the grids X_i (n^3) taken to this rank's panel nodes,
        G_i = E_0^T X_i E_1 E_2 per axis, and interpolated at its sources (one panel
        triple at a time): the transpose of :meth:`_spread3` and :meth:`_through` in 3-D."""
        n, ni, q = self.n, len(grids), panels[0].q
        X = np.asarray(grids).reshape(ni, n, n * n)
        G = np.matmul(E[0].T, X).reshape(ni, -1, n, n)
        G = np.matmul(np.matmul(E[1].T, G), E[2])                             # (ni, K0, K1, K2)
        loc = [pa.locate(pts[:, a]) for a, pa in enumerate(panels)]
        P1, P2 = panels[1].count, panels[2].count
        out = np.empty((len(pts), ni))
        for idx, L0, L12, segments in panel_triples(panels, loc):
            for key, a, b in segments:
                p0, rest = divmod(key, P1 * P2)
                p1, p2 = divmod(rest, P2)
                g = G[:, p0 * q:(p0 + 1) * q, p1 * q:(p1 + 1) * q, p2 * q:(p2 + 1) * q].reshape(ni * q, q * q)
                out[idx[a:b]] = np.einsum("iam,ma->mi", (g @ L12[a:b].T).reshape(ni, q, b - a), L0[a:b])
        return out

    def source_cotangents(self, mbar: np.ndarray, positions: bool = False):
        """d<mbar, values>/dw_j and, with ``positions``, d<mbar, values>/dy_j (M, d) for
        this rank's sources (their order), in one pass over them. With the values
        c_k = num_k / N: dc_g/dw_j = e^{<b_g, y_j>} (dnum/dw_j - c_g dN/dw_j) / N_g, where
        num = S_y, N = Z (nonnegative weights: dm/dw_j = e (y_j - m) / Z) or num = (S_y, Z),
        N = sum |w| e (signed: dN/dw_j = sign w_j); for positions (nonnegative weights)
        dm_g/dy_j = w_j e^{<b_g, y_j>} / Z_g [I + (y_j - m_g) b_g^T], i.e.
        ybar_j,c = w_j sum_g e^{<b_g,y_j>}/Z_g [mbar_c + (mbar . (y_j - m_g)) b_g,c]."""
        d = self.d
        y, w = self.layout.points, self.weights
        cc = np.einsum("k...,k...->...", mbar, self.values)
        if self.signed:
            if positions:
                raise ValueError("position cotangents need nonnegative weights (particles)")
            S = self._source_sums([-cc, mbar[d]] + list(mbar[:d]))
            return np.sign(w) * S[:, 0] + S[:, 1] + np.einsum("jk,jk->j", y, S[:, 2:]), None
        grids = [-cc] + list(mbar)
        if positions:
            nodes = [self.axes[0][0]] if d == 1 else np.meshgrid(*(ax[0] for ax in self.axes), indexing="ij")
            grids += [X for c in range(d) for X in [mbar[c] - cc * nodes[c]] + [mbar[k] * nodes[c] for k in range(d)]]
        S = self._source_sums(grids)
        wbar = S[:, 0] + np.einsum("jk,jk->j", y, S[:, 1:1 + d])
        if not positions:
            return wbar, None
        P = S[:, 1 + d:].reshape(len(w), d, 1 + d)
        return wbar, w[:, None] * (P[:, :, 0] + np.einsum("jk,jck->jc", y, P[:, :, 1:]))

    def weights_cotangent(self, mbar: np.ndarray) -> np.ndarray:
        """d<mbar, values>/dw_j (:meth:`source_cotangents`)."""
        return self.source_cotangents(mbar)[0]

    def points_cotangent(self, mbar: np.ndarray) -> np.ndarray:
        """d<mbar, values>/dy_j (:meth:`source_cotangents`)."""
        return self.source_cotangents(mbar, positions=True)[1]

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
    P_LOCAL (P_LOCAL + 1 points per axis). The cost per point no longer grows with n; the
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
        self.lib = kernels_on(table.comm) if lib is EVERY_RANK else lib
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


FINE3_POINT = 6.0     # a 3-D fine-grid point (6^3 nodes of 4 values) against a 2-D one (6^2
FINE3_COMPILED = 6.0  # of 2), numpy and compiled: measured (benchmarks/velocity.py --dim 3)


def fine_from(lib, costs, d: int = 2) -> int:
    """Table size from which the two-level interpolation is faster: every size with the
    compiled loop ``lib``; with numpy, the first where barycentric interpolation from
    the table (2 d n^d flops per point and head, d components) costs more than a point
    of the fine grid's."""
    if lib is not None:
        return N_MIN
    point = costs.numpy_point * (FINE3_POINT if d == 3 else 1.0)
    sizes = table_sizes(d)
    return next((n for n in sizes if 2.0 * d * n**d * costs.flop > point), sizes[-1])


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
        lib = kernels_on(table.comm)                 # one collective call for all candidates
    if nf is not None:
        return FineGrid(table, nf, lib)
    if table.n < fine_from(lib, machine_costs(table.comm), table.d):
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


def largest_size(d: int, forced: bool = False) -> int:
    """The largest table size worth a try in d dimensions (``forced``: backend "laplace",
    which would rather build a big table than stop)."""
    if d == 3:
        return N3_MAX_FORCED if forced else N3_MAX
    return N_MAX_FORCED if forced else N_MAX


def size_index(want: float, sizes: tuple, start: int = 0) -> int:
    """The first index from ``start`` whose size reaches ``want`` (the last if none)."""
    return next((j for j in range(start, len(sizes)) if sizes[j] >= want), len(sizes) - 1)


def choose_table(points, weights, b_lo, b_hi, comm, tol: float, n_max: int = N_MAX,
                 signed: bool | None = None, layout: SourceLayout | None = None, lib=EVERY_RANK,
                 start: int | None = None):
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
    decides)."""
    lo, hi = grid_box(np.asarray(b_lo, float), np.asarray(b_hi, float))
    d = points.shape[1]
    sizes = [n for n in table_sizes(d) if n <= n_max] or [N_MIN]
    if signed is None:
        signed = any_negative(weights, comm)
    if lib is EVERY_RANK:
        lib = kernels_on(comm) if points.shape[1] > 1 else None
    eps = layout.eps if layout is not None else panel_eps(tol)

    def search(pts, w, i, lay, builds=None):
        """Build at sizes[i], then at larger sizes (at least the predicted one) until tol;
        after ``builds`` tables that miss it, the predicted index without building."""
        first = i
        while True:
            table = LaplaceTable(pts, w, lo, hi, sizes[i], comm, signed, lay, lib, eps)
            lay = table.layout
            table.assessment = assess(table)
            est = table.assessment.estimate
            if est <= tol or i + 1 == len(sizes):
                return i, table, est
            # extrapolated from the coarse first table the prediction falls short
            margin = PREDICTION_MARGIN if i == first and start is None and d < 3 else 1.0
            i = size_index(margin * table.assessment.predicted(tol), sizes, i + 1)
            if builds is not None:
                builds -= 1
                if builds == 0:
                    return i, None, None

    opening = 25 if d == 3 else 33
    i = start if start is not None else (sizes.index(opening) if opening in sizes else 0)
    i = min(i, len(sizes) - 1)
    total = comm.allreduce(len(points), op=MPI.SUM)
    if start is None and total > 2 * SUBSAMPLE:
        keep = subsample(points, SUBSAMPLE / total, coordinate_scale(points, comm))
        if comm.allreduce(int(keep.sum()), op=MPI.SUM) >= SUBSAMPLE // 4:   # not degenerate
            try:
                i, _, _ = search(points[keep], weights[keep], i, None, builds=TRIAL_BUILDS)
            except FloatingPointError:   # the subsample's N may vanish
                pass
    _, table, est = search(points, weights, i, layout)
    return table, est


# ------------------------------------------------------------------ pairs summed exactly
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


@dataclass(frozen=True)
class TablePlan:
    """How one velocity was summed through a laplace table: its box, its size n, its fine
    grid (nf, or None for direct interpolation from the table) and whether it holds the
    values of signed weights. The adjoint rebuilds exactly this table (the same map)."""

    lo: tuple
    hi: tuple
    n: int
    nf: int | None
    signed: bool
    eps: float = PANEL_EPS     # accuracy of its panel sums

    def fits(self, lo: np.ndarray, hi: np.ndarray) -> bool:
        """Whether the (rounded) box lo, hi lies inside this plan's box, and the plan's box
        is not much wider (at most 1.5x per axis: a box far too wide costs accuracy)."""
        plo, phi = np.array(self.lo), np.array(self.hi)
        return bool(np.all(lo >= plo) and np.all(hi <= phi)
                    and np.all(phi - plo <= 1.5 * (hi - lo)))


SIGNED_MARGIN = 2.0   # signed weights: the sizes aim below tol by this first (m = mu/zeta
                      # amplifies the values' errors by the conditioning, checked after)
CHECK_POINTS = 400    # attained b where a fine grid is checked (a quarter when reused)
FINE_CHECK_EVERY = 4  # a reused plan's fine grid is checked at every 4th use
RELAX = 8.0           # signed weights: a lowered target rises again (x2) when the bound is
                      # this far below tol
SHRINK_STEPS = 2      # a plan's size shrinks when its decay predicts a size this many
                      # steps of SIZES smaller (hysteresis against growing back)


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


def _vmax(v: np.ndarray) -> float:
    """max_i |v_i| of this rank's targets (0 without any; infinite where v is not finite,
    which the caller reports as a breakdown)."""
    if len(v) == 0:
        return 0.0
    n = np.sqrt(np.einsum("ni,ni->n", v, v))
    return float(n.max()) if np.all(np.isfinite(n)) else math.inf


class TablePlanner:
    """The laplace tables of one velocity field. Per key (a prompt's layer) the last
    :class:`TablePlan` is kept; the next evaluation builds its table on the same box, at
    the same sizes, while the heads' (rounded) b-range stays inside the box, and judges it
    by its own error estimate: kept if it meets tol (and the plan shrinks for the next
    evaluation when the decay shows a size SHRINK_STEPS smaller would do), rebuilt at the
    size its decay predicts if not. A fresh size search only when there is no plan or the
    box no longer fits. Source layouts are cached per box while the sources stay; the
    heads' b-range per key while the heads and targets stay.

    With signed weights m = mu / zeta: after the interpolation the largest 1/|zeta| (kappa)
    and |m| (M) over the targets bound the error of m by kappa (e_mu s_mu + M e_zeta s_zeta)
    (e_g, s_g: relative errors and sizes of the values), which relative to max(M, s_mu)
    must meet tol; if it does not, the sizes aim that much lower (remembered per key) and
    the table is built again."""

    def __init__(self, comm, tol: float):
        self.comm, self.tol = comm, tol
        self.plans: dict = {}
        self.targets: dict = {}      # key -> the tol the sizes aim at (below tol if signed)
        self._ranges: dict = {}      # key -> (A, targets, lo, hi, check points)
        self._target_info = None     # (targets, their count over all ranks, coordinate scale)
        self._layouts: dict = {}
        self._points = None
        self._lib = None
        self.finite = None           # whether the last velocity is finite on every rank, if known
        self.built = None            # (table, interpolant) of the last velocity
        self._uses: dict = {}        # key -> evaluations through its plan so far
        self._fine: dict = {}        # key -> the last measured fine-grid errors
        self.stats = {"searches": 0, "reused": 0, "rebuilt": 0}

    def reset(self) -> None:
        """Forget the plans and targets (not the caches, which depend on their inputs
        alone): the next evaluation of every key searches its table afresh."""
        self.plans.clear()
        self.targets.clear()
        self._uses.clear()
        self._fine.clear()

    # ------------------------------------------------------------------ caches
    def lib(self):
        if self._lib is None:
            self._lib = (kernels_on(self.comm),)      # one collective call, once
        return self._lib[0]

    def layout(self, points, lo, hi, eps: float) -> SourceLayout:
        if points is not self._points:
            self._points, self._layouts = points, {}
        key = (tuple(lo), tuple(hi), eps)
        if key not in self._layouts:
            if len(self._layouts) >= 64:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = SourceLayout(points, lo, hi, self.comm, eps)
        return self._layouts[key]

    def _attained(self, key, x, A):
        """(A, x, b_lo, b_hi, check): the b-range of the heads A at the targets x (all
        ranks) and this rank's check points, b = A_h x for the targets a coordinate hash
        picks (about CHECK_POINTS b over all ranks, the same on any number of ranks):
        the fine grid is judged where it is used. Kept per key while A and x stay."""
        cached = self._ranges.get(key)
        if cached is None or cached[1] is not x or not np.array_equal(cached[0], A):
            lo, hi = b_range(x, A, self.comm)
            count, scale = self._targets(x)
            fraction = CHECK_POINTS / max(count * len(A), 1)
            picked = x[subsample(x, fraction, scale)] if len(x) else x
            check = np.einsum("hij,nj->hni", A, picked).reshape(-1, x.shape[1])
            cached = self._ranges[key] = (A.copy(), x, lo, hi, check)
        return cached

    def _targets(self, x) -> tuple:
        """(count over all ranks, :func:`coordinate_scale`) of the targets x: collective,
        on every rank (also one without targets); kept while x stays."""
        if self._target_info is None or self._target_info[0] is not x:
            self._target_info = (x, self.comm.allreduce(len(x), op=MPI.SUM), coordinate_scale(x, self.comm))
        return self._target_info[1:]

    def b_range(self, key, x, A):
        return self._attained(key, x, A)[2:4]

    # ------------------------------------------------------------------ tables
    def replay(self, points, weights, plan: TablePlan):
        """The table and interpolant of ``plan`` for these sources (the adjoint's)."""
        lo, hi = np.array(plan.lo), np.array(plan.hi)
        lib = self.lib() if points.shape[1] > 1 else None
        table = LaplaceTable(points, weights, lo, hi, plan.n, self.comm, plan.signed,
                             self.layout(points, lo, hi, plan.eps), lib)
        return table, (table if plan.nf is None else FineGrid(table, plan.nf, lib))

    def velocity(self, points, weights, x, A, V, key, n_max: int, signed: bool | None = None):
        """(v, plan, bound) at this rank's targets x for heads A, V, with ``bound`` the
        bound on v's error relative to its largest value (:func:`velocity_bound`), or None
        where no table up to n_max meets tol (the table's estimate then in
        :attr:`last_estimate`);
        FloatingPointError where no table can be built (too sharp, not finite). Signed
        weights: the conditioned bound (:meth:`conditioned`) must meet tol; if it does not,
        the key's sizes aim lower by its excess and the table is searched again.
        :attr:`finite` says, where known, whether v is finite on every rank."""
        _, _, lo_b, hi_b, check = self._attained(key, x, A)
        if not (np.all(np.isfinite(lo_b)) and np.all(np.isfinite(hi_b))):
            raise FloatingPointError("attention matrices are not finite")
        if signed is None:
            signed = any_negative(weights, self.comm)
        last = self.plans.get(key)
        signed = signed or (last is not None and last.signed)  # once signed, a key stays so
        initial = self.tol / SIGNED_MARGIN if signed else self.tol
        self.finite = None
        plan = self.reusable(key, lo_b, hi_b, signed, n_max)
        if plan is not None:
            found = self._reused_velocity(points, weights, x, A, V, key, plan, initial, check)
            if found is not None:
                return found
            self.finite = None
        return self._searched_velocity(points, weights, x, A, V, key, n_max, signed, initial)

    def _searched_velocity(self, points, weights, x, A, V, key, n_max: int, signed: bool, initial: float):
        """(v, plan, bound) from a table searched afresh: up to three searches, each aiming
        lower by the excess of the last signed table's conditioned bound; None where none
        meets tol (the estimate in :attr:`last_estimate`)."""
        est = math.inf
        for _ in range(3):
            found = self.table(points, weights, x, A, key, n_max, signed)
            if found is None:
                est = self.last.estimate
                break
            table, interp, a, plan = found
            v = interp.velocity(x, A, V)
            stats = self._signed_stats(interp, v) if table.signed else None
            est = self.conditioned(table, a, *stats[:2]) if table.signed else a.estimate
            target = self.targets.get(key, initial)
            if est <= self.tol:
                self._relax(key, table, est, target, initial)
                self.built = (table, interp)
                return self._accepted(points, weights, x, A, V, table, interp, a, plan, v, stats)
            if not np.isfinite(est):
                break
            self.targets[key] = target * self.tol / est / 2
            self.plans.pop(key, None)
        self.last_estimate = est
        return None

    def _signed_stats(self, interp, v) -> np.ndarray:
        """For signed weights, over all ranks (one Allreduce): the interpolant's
        conditioning (kappa, M), whether it left pairs out, and max |v|."""
        stats = np.array([*interp.conditioning, float(len(interp.skipped) > 0), _vmax(v)])
        self.comm.Allreduce(MPI.IN_PLACE, stats, op=MPI.MAX)
        return stats

    def _accepted(self, points, weights, x, A, V, table, interp, a, plan, v, stats):
        """(v, plan, bound) of a table that meets tol; for signed weights (``stats`` of
        :meth:`_signed_stats`) with the pairs the interpolant left out summed exactly."""
        if stats is None:
            return v, plan, self._bound(table, a, v, V)
        vmax = stats[3]
        if stats[2]:
            v = v + exact_pair_velocity(points, weights, x, A, V, interp.skipped, self.comm)
            vmax = None
        return v, plan, self._bound(table, a, v, V, vmax, *stats[:2])

    def reusable(self, key, lo_b, hi_b, signed: bool, n_max: int):
        """The key's plan if the evaluation can take it: a table for signed weights where
        they are signed (one for signed weights serves nonnegative ones too: zeta = 1),
        size within n_max, the rounded b-range inside its box, panels accurate enough for
        its target."""
        plan = self.plans.get(key)
        if plan is None:
            return None
        lo, hi = grid_box(lo_b, hi_b)
        target = self.targets.get(key, self.tol / SIGNED_MARGIN if signed else self.tol)
        ok = (plan.signed or not signed) and plan.n <= n_max and plan.fits(lo, hi) \
            and plan.eps <= panel_eps(target)
        return plan if ok else None

    def _reused_velocity(self, points, weights, x, A, V, key, plan, initial, check):
        """The velocity through the key's plan, judged after the interpolation: the
        table's estimate, its fine grid's error (at a quarter of the check points, every
        FINE_CHECK_EVERY uses of the plan; the last measured in between), the conditioning
        of signed weights and whether v is finite, all in one Allreduce. None where any
        misses (the caller grows or searches)."""
        target = self.targets.get(key, initial)
        table, interp = self.replay(points, weights, plan)
        fine = None if interp is table else interp
        uses = self._uses[key] = self._uses.get(key, 0) + 1
        checked = fine is not None and (uses % FINE_CHECK_EVERY == 0 or key not in self._fine)
        v = interp.velocity(x, A, V)
        extra = [0.0 if np.all(np.isfinite(v)) else 1.0, _vmax(v)]
        if plan.signed:
            extra += [*interp.conditioning, float(len(interp.skipped) > 0)]
        a = table.assessment = assess(table, fine if checked else None,
                                      check[:(len(check) + 3) // 4], extra)
        if fine is not None:
            if checked:
                self._fine[key] = a.fine
            a.fine = self._fine[key]
        self.finite = not a.extra[0]
        if a.estimate > target or a.fine_error > target / 4:
            return None
        cond = a.extra[2:4] if plan.signed else ()
        est = self.conditioned(table, a, *cond) if plan.signed else a.estimate
        if not est <= self.tol:
            return None
        vmax = a.extra[1]
        if plan.signed and a.extra[4]:          # pairs left out: summed exactly
            v = v + exact_pair_velocity(points, weights, x, A, V, interp.skipped, self.comm)
            self.finite, vmax = None, None
        self.stats["reused"] += 1
        self._relax(key, table, est, target, initial)
        self.built = (table, interp)
        return v, self._keep(key, table, interp, a, target), self._bound(table, a, v, V, vmax, *cond)

    def _bound(self, table, a: Assessment, v, V, vmax=None, kappa=None, M=None) -> float:
        """:func:`velocity_bound` of this velocity; ``vmax`` (its largest |v_i| over all
        ranks) where already reduced, else one Allreduce here."""
        if vmax is None:
            vmax = self.comm.allreduce(_vmax(v), op=MPI.MAX)
        return velocity_bound(table, a, V, vmax, kappa, M)

    def _relax(self, key, table, est, target, initial) -> None:
        """A lowered target (signed weights) rises again where the bound is far below tol."""
        if table.signed and est * RELAX < self.tol and target < initial:
            self.targets[key] = min(initial, 2 * target)

    def _keep(self, key, table, interp, a: Assessment, target: float) -> TablePlan:
        """The plan of this evaluation's table; the key keeps it for the next, a size
        SHRINK_STEPS smaller if the decay says that would do."""
        used = TablePlan(tuple(table.lo), tuple(table.hi), table.n,
                         None if interp is table else interp.nf, table.signed, table.layout.eps)
        sizes = table_sizes(table.d)
        j = size_index((PREDICTION_MARGIN if table.d < 3 else 1.0) * a.predicted(target), sizes)
        shrink = table.n in sizes and sizes.index(table.n) - j >= SHRINK_STEPS
        self.plans[key] = TablePlan(used.lo, used.hi, sizes[j], used.nf, used.signed, used.eps) \
            if shrink else used
        return used

    def velocity_of(self, points, weights, x, A, V, plan: TablePlan) -> np.ndarray:
        """The velocity exactly as ``plan`` sums it (pairs its table leaves out summed
        exactly), unchecked: what a frozen evaluation replays."""
        table, interp = self.replay(points, weights, plan)
        v = interp.velocity(x, A, V)
        if plan.signed and any_rank(self.comm, len(interp.skipped)):
            v = v + exact_pair_velocity(points, weights, x, A, V, interp.skipped, self.comm)
        self.built = (table, interp)
        return v

    def table(self, points, weights, x, A, key, n_max: int, signed: bool):
        """(table, interpolant, assessment, plan) for this evaluation, or None where no
        size up to n_max meets the key's target (see :attr:`last`: that assessment)."""
        _, _, lo_b, hi_b, check = self._attained(key, x, A)
        lo, hi = grid_box(lo_b, hi_b)
        target = self.targets.get(key, self.tol / SIGNED_MARGIN if signed else self.tol)
        plan = self.reusable(key, lo_b, hi_b, signed, n_max)
        lib = self.lib() if points.shape[1] > 1 else None
        if plan is not None:
            table, interp, a = self._reuse(points, weights, plan, target, n_max, lib, check)
        else:
            self.stats["searches"] += 1
            table, _ = choose_table(points, weights, lo_b, hi_b, self.comm, target, n_max, signed,
                                    self.layout(points, lo, hi, panel_eps(target)), lib)
            table, interp, a = self._with_fine_grid(table, target, lib, check)
        self.last = a
        if a.fine is not None:
            self._fine[key] = a.fine
        if a.estimate > target or a.fine_error > target / 4:
            return None
        return table, interp, a, self._keep(key, table, interp, a, target)

    @staticmethod
    def _with_fine_grid(table, target, lib, check):
        """(table, interpolant, assessment): a fine grid searched for the table (checked
        at this rank's points ``check``), and the errors of both."""
        fine = fine_grid(table, target, lib=lib, check=check)
        if fine is None:
            return table, table, table.assessment
        return table, fine, assess(table, fine, check)

    def _reuse(self, points, weights, plan, target, n_max, lib, check):
        """The plan's table for these weights, judged by its own estimate (its fine grid
        at a quarter of the check points): grown to the size its decay predicts where it
        misses target, its fine grid searched again where that misses target/4."""
        table, interp = self.replay(points, weights, plan)
        a = table.assessment = assess(table, None if interp is table else interp,
                                      check[:(len(check) + 3) // 4])
        if a.estimate > target:
            self.stats["rebuilt"] += 1
            sizes = [n for n in table_sizes(table.d) if n <= n_max]
            i = size_index(a.predicted(target), sizes, sizes.index(plan.n) + 1 if plan.n in sizes else 0)
            table, _ = choose_table(points, weights, table.lo, table.hi, self.comm, target,
                                    n_max, plan.signed, table.layout, lib, start=i)
            return self._with_fine_grid(table, target, lib, check)
        if interp is not table and a.fine_error > target / 4:
            return self._with_fine_grid(table, target, lib, check)
        return table, interp, a

    @staticmethod
    def conditioned(table, a: Assessment, kappa: float, M: float) -> float:
        """The error bound of m = mu / zeta at this evaluation's targets, with kappa the
        largest 1/|zeta| and M the largest |m| there (over all ranks), relative to the
        larger of M and max |mu| (the table's scale, as for nonnegative weights)."""
        e = [est + 2 * (a.fine[i] if a.fine is not None else 0.0) for i, est in enumerate(a.estimates)]
        s = table.group_scales()
        return float(kappa * (e[0] * s[0] + M * e[1] * s[1]) / max(M, s[0], 1e-300))


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


def laplace_seconds(costs, n: int, d: int, sources: int, points: int, compiled: bool = True,
                    panel_nodes: list | None = None) -> float:
    """Cost of an order-1 table (1 + d sums over the sources: directly, or through
    ``panel_nodes`` K_a per axis, whichever is less) and of interpolating it at
    ``points`` (targets x heads): in 1-D barycentric (2 n d flops per point), in 2-D the
    fine grid, compiled or numpy, in 3-D the fine grid or barycentric from the table
    (2 d n^3 flops), whichever is less (for the auto backend)."""
    table = dense_seconds(costs, n, d, 1 + d, sources)
    if panel_nodes is not None and (d < 3 or (1 + d) * np.prod(panel_nodes, dtype=float) * 8 <= PANEL3_BYTES):
        blocks = int(np.prod([max(1, k // panel_degree()) for k in panel_nodes]))
        table = min(table, panel_seconds(costs, n, d, 1 + d, sources, panel_nodes, blocks, compiled))
    if d == 1:
        per_point = 2.0 * n * d * costs.flop
    elif d == 2:
        per_point = costs.fine_point if compiled else costs.numpy_point
    else:      # the fine grid or the table itself, whichever fine_grid would pick
        fine = (costs.fine_point * FINE3_COMPILED) if compiled else costs.numpy_point * FINE3_POINT
        per_point = min(fine, 2.0 * d * n**d * costs.flop)
    return table + points * per_point


def direct_seconds(costs, targets: int, heads: int, sources: int) -> float:
    """Direct summation of every (target, head, source) pair."""
    return costs.pair * targets * heads * sources
