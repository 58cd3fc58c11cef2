r"""The sums that build a laplace table (:class:`TableSums`, a part of
:class:`~.table.LaplaceTable`).

e^{<b,y>} = prod_a e^{b_a y_a} factorises per coordinate, so for d = 2 the sums
Z[g1,g2] = sum_j w_j e^{b1_g1 y1_j} e^{b2_g2 y2_j} (and the y-moments) are matrix
products (n x M)(M x n). With many sources they go through panel nodes
(:mod:`.panels`): the sources are spread onto the panels (a compiled loop where a C
compiler is at hand), and the table is E_1 W E_2^T. Each rank spreads its own sources,
onto the panels they touch only (its window), and multiplies through that window: the
products divide over ranks like the sources. One Allreduce of the n^d tables completes
them (no source gather). In 3-D the sums are E_0 (x) E_1 per block of sources times
E_2^T, or through panel triples (each source spread onto the q^3 nodes of its panel
triple, then three products on this rank's window, :meth:`TableSums._spread3`). Per node
the tiles combine by log-sum-exp; moments are ratios, so the shifts cancel.
"""

from __future__ import annotations

import numpy as np

from ...tools.parallel import allreduce_sum, reduce_shares
from ..compiled import panel_spread
from .cost_model import dense_seconds, panel_seconds
from .layout import Tile
from .panels import PANEL3_BYTES, blocks_by_key, panel_triples


class TableSums:
    """The sums of a :class:`~.table.LaplaceTable` over its sources and their combination
    into its values (:meth:`_build`): per tile directly or through the panel nodes,
    whichever costs less (:meth:`_panels`), then over the tiles in the log domain."""

    SOURCE_CHUNK = 4096  # sources per block: the (n x chunk) factors stay in cache

    def _panels(self, tile: Tile):
        """The tile's panels, or None where summing over its sources directly is cheaper,
        from the sizes over all ranks and the table's ``costs`` (the same on every rank:
        every rank takes the same path): :func:`dense_seconds` against
        :func:`panel_seconds`. In 3-D not where the spread sums (ncols K_0 K_1 K_2) would
        take more than PANEL3_BYTES."""
        if tile.count == 0:
            return None
        costs = self.costs
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
            return self._spread3(panels, loc, cols)
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
