"""The attention velocity on the mesh: sources from rho, targets at the velocity nodes.

v_t[rho](x) = (1/H) sum_h V_h grad Lambda_rho(A_h x) (design §1). Sources are rho's
quadrature points on every rank's owned cells; targets are the rank's own nodes of the
Lagrange velocity space. Two ways to sum (``[attention] backend``):

* ``direct``: the sources of all ranks are gathered on every rank and every target meets
  every source (pdeformer.attention); exact.
* ``laplace``: Lambda_rho's gradient tabulated once on a Chebyshev grid in b, summed over
  each rank's own sources and all-reduced, then interpolated for every head and target
  (pdeformer.laplace); accurate to ``tol``.
* ``auto``: laplace where its error estimate meets ``tol`` and it is cheaper than direct,
  direct otherwise (sharp attention, d = 3). Every choice is counted in :attr:`stats`.

Either way the result depends on the partition only through summation order.
"""

from __future__ import annotations

import logging

import numpy as np
from mpi4py import MPI

from ._dolfinx import owned_node_coordinates
from .attention import Sources, VelocityCotangent, attention_velocity, attention_velocity_vjp
from .errors import SolverBreakdown
from ._kernels import kernels_on
from .heads import HeadMeasure
from .laplace import (N_MAX, N_MAX_FORCED, SIZES, LaplaceTable, b_range, choose_table, direct_estimate,
                      fine_grid, flops_estimate, panel_nodes, source_extent)
from .parallel import allgather_rows

log = logging.getLogger("pdeformer")


class AttentionVelocity:
    """The attention velocity of a head measure at this rank's targets: the nodes of a
    velocity space (:meth:`on_space`), or points given per call (particles)."""

    def __init__(self, targets, heads: HeadMeasure, attention: dict | None, comm):
        attention = attention or {}
        self.targets = targets
        self.heads = heads  # read at every call: training updates it in place
        self.backend = attention.get("backend", "direct")
        self.tol = attention.get("tol", 1e-8)
        self.chunk_mb = attention.get("chunk_mb", 2.0)
        self.comm = comm
        self._gathered = None  # (points object, all points, slice of this rank)
        self.last_plan = None   # how the last velocity was summed: None (direct) or (lo, hi, n)
        self.stats = {"direct": 0, "laplace": 0, "largest_estimate": 0.0, "largest_grid": 0}

    @classmethod
    def on_space(cls, W, heads: HeadMeasure, attention: dict | None = None, comm=None):
        return cls(owned_node_coordinates(W), heads, attention, comm or W.mesh.comm)

    # ------------------------------------------------------------------ helpers
    def _all_points(self, points):
        if self._gathered is None or self._gathered[0] is not points:
            counts = self.comm.allgather(len(points))
            start = sum(counts[:self.comm.rank])
            self._gathered = (points, allgather_rows(self.comm, points),
                              slice(start, start + len(points)))
        return self._gathered[1], self._gathered[2]

    def _table(self, points, weights, A, x):
        """A laplace table for this evaluation, or None where direct must (or should) do."""
        d = points.shape[1]
        if self.backend == "direct" or (d > 2 and self.backend == "auto"):
            return None
        if d > 2:
            raise ValueError("backend 'laplace' is implemented for d = 1 and 2")
        lo, hi = b_range(x, A, self.comm)
        finite = bool(np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)))
        n_max = N_MAX_FORCED
        if self.backend == "auto":
            M = self.comm.allreduce(len(points), op=MPI.SUM)
            N = self.comm.allreduce(len(x), op=MPI.SUM)
            H = A.shape[0]
            compiled = kernels_on(self.comm) is not None
            extent = source_extent(points, self.comm)
            nodes = [panel_nodes(max(abs(lo[a]), abs(hi[a])), extent[a]) for a in range(d)] if finite else None
            cheaper = [n for n in SIZES if n <= N_MAX
                       and flops_estimate(n, d, M, N * H, compiled, nodes) < direct_estimate(N, H, M)]
            if not cheaper:
                return None
            n_max = cheaper[-1]
        try:
            if not finite:
                raise FloatingPointError("attention matrices are not finite")
            table, est = choose_table(points, weights, lo, hi, self.comm, self.tol, n_max=n_max)
        except FloatingPointError as e:
            if self.backend == "laplace":
                raise SolverBreakdown(f"attention backend 'laplace': {e}; use 'auto' or 'direct'") from None
            return None
        self.stats["largest_estimate"] = max(self.stats["largest_estimate"], est)
        if est > self.tol:
            if self.backend == "auto":
                return None
            raise SolverBreakdown(f"attention backend 'laplace' cannot reach tol = {self.tol:g} "
                                  f"(estimate {est:.2g} with a {table.n}-point grid); use 'auto' "
                                  "or 'direct', or raise attention.tol")
        self.stats["largest_grid"] = max(self.stats["largest_grid"], table.n)
        return table

    # ------------------------------------------------------------------ velocity
    def __call__(self, points: np.ndarray, weights: np.ndarray, layer: int,
                 targets: np.ndarray | None = None) -> np.ndarray:
        """Velocity of ``layer`` at this rank's targets, (n, d), for the density given by
        this rank's source points and weights. :attr:`last_plan` records how."""
        x = self.targets if targets is None else targets
        A, V = self.heads.attention_matrices(layer), self.heads.values(layer)
        table = self._table(points, weights, A, x)
        interp = None if table is None else (fine_grid(table, self.tol) or table)
        self.last_plan = None if table is None else \
            (table.lo, table.hi, table.n, interp.nf if interp is not table else None)
        if table is None:
            self.stats["direct"] += 1
            all_points, _ = self._all_points(points)
            sources = Sources.from_arrays(all_points, allgather_rows(self.comm, weights))
            return attention_velocity(x, sources, A, V, chunk_mb=self.chunk_mb)
        self.stats["laplace"] += 1
        return interp.velocity(x, A, V)

    def vjp(self, points: np.ndarray, weights: np.ndarray, layer: int, g: np.ndarray,
            plan=None, targets: np.ndarray | None = None, positions: bool = False) -> VelocityCotangent:
        """Cotangents of <g, v> (g at this rank's nodes): this rank's source weights,
        and A, V of ``layer`` (this rank's share; the caller sums over ranks); with
        ``positions`` (particles) also the cotangents of this rank's targets and of its
        source points. ``plan`` is the forward evaluation's :attr:`last_plan`: the same sum
        is differentiated."""
        x = self.targets if targets is None else targets
        A, V = self.heads.attention_matrices(layer), self.heads.values(layer)
        table = interp = None
        if plan is not None:
            lo, hi, n, nf = plan
            table = LaplaceTable(points, weights, lo, hi, n, self.comm)
            interp = table if nf is None else fine_grid(table, self.tol, nf)
        if table is None:
            all_points, mine = self._all_points(points)
            ct = attention_velocity_vjp(x, all_points, allgather_rows(self.comm, weights),
                                        A, V, g, chunk_mb=self.chunk_mb, positions=positions)
            self.comm.Allreduce(MPI.IN_PLACE, ct.weights, op=MPI.SUM)
            ct.weights = ct.weights[mine].copy()
            if positions:
                self.comm.Allreduce(MPI.IN_PLACE, ct.points, op=MPI.SUM)
                ct.points = ct.points[mine].copy()
            return ct
        mbar, dA, dV, xbar = interp.velocity_vjp(x, A, V, g, positions)
        wbar, ybar = table.source_cotangents(mbar, positions)
        return VelocityCotangent(wbar, dA, dV, xbar, ybar)
