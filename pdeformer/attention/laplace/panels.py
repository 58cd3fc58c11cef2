r"""Panel nodes: sums over many sources through narrow Chebyshev panels.

e^{<b,y>} = prod_a e^{b_a y_a} factorises per coordinate, so a table's sums over M sources
are products of per-axis factors. With many sources each axis of a tile is cut into
panels so narrow (max|b| x half-width <= PANEL_BETA) that e^{b y} is a polynomial of
degree q - 1 on each to PANEL_EPS relative accuracy (:func:`panel_degree`); the sources
are spread onto the q Chebyshev-Lobatto nodes of their panel with the Lagrange weights
(:class:`Panels`), and the sums run over the panel nodes instead of the sources. In 3-D
the sources are handled one panel triple at a time (:func:`panel_triples`).
"""

from __future__ import annotations

import math

import numpy as np

from .chebyshev import barycentric_weights, chebyshev_lobatto


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
