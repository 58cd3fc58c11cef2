r"""The reverse mode of a laplace table towards its sources (:class:`SourceCotangents`,
a part of :class:`~.table.LaplaceTable`).

Table cotangents are the transposed interpolation of the target cotangents
(:meth:`~.table.LaplaceTable.transpose`); the source cotangents follow from
dm/dw_j = e^{<b,y_j>} (y_j - m) / Z and dm/dy_j = w_j e^{<b,y_j>} / Z [I + (y_j - m) b^T]
per grid node, i.e. transposed factorised sums -- the adjoint's nonlocal source term at
the cost of a table. Where the table was built through panel nodes, the grids are taken
to the panel nodes (the transpose of the table's products, divided over ranks the same
way) and interpolated at each source.
"""

from __future__ import annotations

import numpy as np

from ...tools.parallel import allgather_shares
from ..compiled import panel_gather
from .panels import blocks_by_key, panel_triples


class SourceCotangents:
    """The cotangents of a :class:`~.table.LaplaceTable`'s values towards its sources'
    weights and positions (:meth:`source_cotangents`)."""

    def _gathered(self, tile, E, E0, grids: list, factor):
        """G_i = E_1^T (X_i factor) E_2 on this rank's panel nodes (ngrids, window), the
        transpose of :meth:`~.table_sums.TableSums._through` and divided the same way (in
        the tile's ``lead`` orientation): Z_i = E_1^T X_i on each rank's share of the lead
        axis's nodes, all of them gathered (one Allgatherv), then Z E_2 on the blocks this
        rank's sources touch (the rest of G is left unset: no source reads it). Collective;
        None where this rank has no sources in the tile."""
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
            G = None
            if panels is not None and d == 2:      # collective: every rank takes part
                G = self._gathered(tile, E, E0, grids, factor)
            if len(tile.pts) == 0:
                continue
            if panels is not None:
                out[tile.index] = self._panel_source_sums(tile.local_panels, tile.pts, E, G, grids, factor)
            else:
                out[tile.index] = self._grid_source_sums(tile.pts, shifts, grids, factor)
        return out

    def _panel_source_sums(self, local, pts, E, G, grids: list, factor) -> np.ndarray:
        """S[j, i] of one tile whose table was built through panel nodes: the grids X_i
        factor taken to this rank's panel nodes (1-D: E_0^T X_i; 2-D: G from
        :meth:`_gathered`; 3-D: :meth:`_gathered3`), then interpolated at each source by
        its Lagrange weights (the compiled loops where there are, in 2-D)."""
        d, q = self.d, local[0].q
        acc = np.empty((len(pts), len(grids)))
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
        return acc

    def _grid_source_sums(self, pts, shifts, grids: list, factor) -> np.ndarray:
        """S[j, i] = diag(E_1^T (X_i factor) E_2)_j of one tile's sources straight from
        the grid (1-D: E_0^T X_i; 3-D: ((X_i E_2) . E_1 summed) . E_0 summed), a block of
        sources at a time with their exponentials E_a (:meth:`_chunks`)."""
        d = self.d
        acc = np.empty((len(pts), len(grids)))
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
        return acc

    def _gathered3(self, panels, pts, E, grids: list) -> np.ndarray:
        """out[j, i] = the grids X_i (n^3) taken to this rank's panel nodes,
        G_i = E_0^T X_i E_1 E_2 per axis, and interpolated at its sources (one panel
        triple at a time): the transpose of :meth:`~.table_sums.TableSums._spread3` and
        :meth:`~.table_sums.TableSums._through` in 3-D."""
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
