"""The attention velocity on the mesh: sources from rho, targets at the velocity nodes.

v_t[rho](x) = (1/H) sum_h V_h grad Lambda_rho(beta A_h x) (design §1; ``[attention] beta``,
default 1), and on the sphere |x| = R (a circle or sphere mesh) its tangential part
P_x v = v - <v, u> u, u = x / |x|, at the radial projections R u of the velocity nodes
(the mesh's nodes lie on flat cells): the maps of the tokens' geometry
(:mod:`pdeformer.model.geometry`). Sources are rho's
quadrature points on every rank's owned cells; targets are the rank's own nodes of the
Lagrange velocity space. Two ways to sum (``[attention] backend``):

* ``direct``: the sources of all ranks are gathered on every rank and every target meets
  every source (pdeformer.attention.softmax); exact.
* ``laplace``: Lambda_rho's gradient tabulated once on a Chebyshev grid in b, summed over
  each rank's own sources and all-reduced, then interpolated for every head and target
  (pdeformer.attention.laplace); accurate to ``tol``.
* ``auto``: laplace where its error estimate meets ``tol`` and it is cheaper than direct,
  direct otherwise (sharp attention). Every choice is counted in :attr:`stats`;
  ``stats["largest_estimate"]`` is the largest bound on a table velocity's error relative
  to its largest value (:func:`pdeformer.attention.laplace.velocity_bound`), over all evaluations.

Either way the result depends on the partition only through summation order.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from ..attention.softmax import Sources, VelocityCotangent, partial_sums, value_gain
from ..tools.errors import ConfigError, SolverBreakdown
from ..tools.keys import Key, number, string
from .heads import HeadMeasure, query_key_derivatives
from .kernels import KERNELS
from ..attention.laplace import (LaplaceTable, TablePlan, TablePlanner, direct_seconds,
                                exact_pair_vjp, laplace_seconds, largest_size, panel_nodes,
                                source_extent, table_sizes)
from ..attention.costs import Costs, machine_costs
from ..tools.parallel import allgather_rows, any_rank
from .geometry import Flat, Geometry

log = logging.getLogger("pdeformer")


# The largest attention score |beta <A x, y>| (and velocity |V| |y|) a run may reach:
# scores are shifted by their maximum and exponentiated, so their differences, up to
# twice this, must be finite doubles with room for sums.
SCORE_LIMIT = 1e300


def _log10(a: float) -> float:
    return math.log10(a) if 0 < a < math.inf else (-math.inf if a == 0 else math.inf)


def _magnitude(log10: float) -> str:
    return f"~1e{log10:.0f}" if log10 < 308.3 else "past 1e308"


def check_scores(heads: HeadMeasure, beta: float, reach: float, keys: dict) -> None:
    """ConfigError where heads of this size cannot give finite attention on tokens within
    ``reach`` of the origin (the mesh's extent): the scores beta <A_h x, y>, bounded by
    beta d max|A_h| reach^2, or the velocities |V_h y| <= d max|V_h| reach, past
    SCORE_LIMIT. It names whichever of ``keys`` (``{"beta": ..., "heads": ..., "mesh":
    ...}``: the keys that set beta, the heads and the extent) contributes most (in orders
    of magnitude above 1)."""
    d = heads.dim
    with np.errstate(over="ignore", invalid="ignore"):
        A = np.concatenate([heads.attention_matrices(l) for l in range(heads.layers)])
        size_a = float(np.nan_to_num(np.abs(A).max(), nan=np.inf))
        size_v = float(np.nan_to_num(np.abs(heads.V).max(), nan=np.inf))
    shares = {keys["beta"]: _log10(max(beta, 1.0)), keys["heads"]: _log10(max(size_a, size_v, 1.0)),
              keys["mesh"]: 2 * _log10(max(reach, 1.0))}
    score = _log10(beta) + _log10(d * size_a) + 2 * _log10(reach)
    velocity = _log10(d * size_v) + _log10(reach)
    if max(score, velocity) <= math.log10(SCORE_LIMIT):
        return
    key = max(shares, key=shares.get)
    todo = "use smaller heads in that file" if key in ("model.params", "data.teacher") else \
        "use a smaller mesh (or scale the problem down)" if key.startswith("mesh.") else f"lower {key}"
    raise ConfigError(key, f"the attention scores beta <A x, y> reach {_magnitude(score)} and the "
                      f"velocities |V y| {_magnitude(velocity)} on this mesh (beta = {beta:g}, head "
                      f"entries |A| up to {size_a:.3g} and |V| up to {size_v:.3g}, tokens up to |x| = "
                      f"{reach:.3g}): past {SCORE_LIMIT:g} they overflow; {todo}")


class TableSum(NamedTuple):
    """One laplace evaluation kept whole for its adjoint: its plan, its table and its
    interpolant (the table itself, or its fine grid). The reverse sweep then differentiates
    these objects instead of building them again from the plan."""
    plan: TablePlan
    table: LaplaceTable
    interp: object

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + (0 if self.interp is self.table else self.interp.nbytes)


BACKENDS: dict[str, type] = {}


def register_backend(cls):
    """Make a way to sum known by its ``name`` (``[attention] backend``)."""
    BACKENDS[cls.name] = cls
    return cls


# The smallest attention.tol: a laplace table's values carry the rounding of its panel
# sums, amplified by the variation e^{2 beta} = e^6 of e^{b y} over a panel: up to
# 400 x 2^-52 = 9e-14 of their size (pdeformer.attention.laplace.PANEL_ROUNDING), which its error
# estimate (the Chebyshev coefficients' tail) does not see. A smaller tol cannot be
# certified; asked for one, 'laplace' stopped with status 3 after tables up to n = 1025
# (estimates bottom out at 1e-14..5e-10 there: the tail of round-off coefficients) and
# 'auto' searched in vain at every evaluation. Exact sums are attention.backend = "direct".
TOL_MIN = 1e-13
TOL_WHY = (" (a laplace table's values carry rounding of about 1e-13 of their size, so no "
           "smaller error can be certified; for exact sums set attention.backend = 'direct')")

# The [attention] table: the backend (a name in BACKENDS) and the options of the sums.
ATTENTION_KEYS = {
    "backend": Key(string(lambda: tuple(BACKENDS)), "auto",
                   "direct summation, a log-Laplace table (d <= 3), or auto"),
    "tol": Key(number(positive=True, lo=TOL_MIN, hi=1e-1, why=TOL_WHY), 1e-8,
               "accuracy of the laplace table (relative to its values' size)"),
    "chunk_mb": Key(number(positive=True, hi=4096), 2.0, "working memory of one kernel chunk (MB)"),
    "kernel": Key(string(lambda: tuple(KERNELS)), "softmax", "what attention sums (model/kernels.py): "
                  "softmax, e^{beta <A x, y>} normalised over the tokens"),
    "beta": Key(number(positive=True), 1.0, "inverse temperature: scores beta <A x, y>"),
    "tape_mb": Key(number(nonnegative=True, hi=1e7), 256.0,
                   "laplace tables a gradient keeps per rank and prompt for its adjoint (MB); "
                   "past it the adjoint builds them again"),
}


@register_backend
class DirectBackend:
    """Direct summation for every evaluation: every target meets every source; exact."""

    name = "direct"

    def check(self, dim: int, kernel) -> None:
        """ConfigError where this way cannot sum ``kernel`` for tokens of dimension ``dim``."""

    def table_velocity(self, field, points, weights, x, A, V, key, signed):
        """(v, plan, bound) through a table, or None: direct summation does it."""
        return None


@register_backend
class LaplaceBackend:
    """A log-Laplace table for every evaluation, up to largest_size(d, forced=True) points
    per axis; where none meets tol, or none can be built, the run stops (a breakdown)."""

    name = "laplace"

    def check(self, dim: int, kernel) -> None:
        if not kernel.tabulated:
            raise ConfigError("attention.backend", f"'laplace' tabulates log-Laplace transforms; the "
                              f"{kernel.name} kernel is none: use 'direct' or 'auto'")
        if dim > 3:
            raise ConfigError("attention.backend", f"'laplace' is implemented for d = 1, 2 and 3, "
                              f"these tokens have d = {dim}: use 'auto' or 'direct'")

    def n_max(self, field, points, A, x, key) -> int | None:
        return largest_size(points.shape[1], forced=True)

    def table_velocity(self, field, points, weights, x, A, V, key, signed):
        try:
            n_max = self.n_max(field, points, A, x, key)
            found = None if n_max is None else \
                field.planner.velocity(points, weights, x, A, V, key, n_max, signed)
        except FloatingPointError as e:
            return self.cannot_build(e)
        return found if found is not None else self.out_of_reach(field)

    def cannot_build(self, error):
        raise SolverBreakdown(f"attention backend 'laplace': {error}; use 'auto' or 'direct'") from None

    def out_of_reach(self, field):
        est = field.planner.last_estimate
        raise SolverBreakdown(f"attention backend 'laplace' cannot reach tol = {field.tol:g} "
                              f"(estimate {est:.2g} with grids up to "
                              f"{largest_size(field.heads.dim, forced=True)}); use "
                              "'auto' or 'direct', or raise attention.tol")


@register_backend
class AutoBackend(LaplaceBackend):
    """The table where its error estimate meets tol and its flop count is below direct
    summation's (the largest size worth building, kept per key); direct summation
    otherwise (and always for d > 3)."""

    name = "auto"

    def check(self, dim: int, kernel) -> None:
        pass

    def n_max(self, field, points, A, x, key) -> int | None:
        return field.worthwhile_size(points, A, x, key)

    MAX_SKIP = 16   # evaluations of a key summed directly, at most, before a table is tried again

    def table_velocity(self, field, points, weights, x, A, V, key, signed):
        """After a key's table missed tol (or could not be built) the next 1, 3, 7, ...
        (up to MAX_SKIP) evaluations of that key go straight to direct summation: a failed
        search costs about as much as the direct sum it falls back to (in 3-D more)."""
        if points.shape[1] > 3 or not field.kernel.tabulated:
            return None
        skip, streak = field.misses.get(key, (0, 0))
        if skip > 0:
            field.misses[key] = (skip - 1, streak)
            return None
        found = super().table_velocity(field, points, weights, x, A, V, key, signed)
        if found is None:
            field.misses[key] = (min(2 ** (streak + 1) - 1, self.MAX_SKIP), streak + 1)
        else:
            field.misses.pop(key, None)
        return found

    def cannot_build(self, error):
        return None

    def out_of_reach(self, field):
        return None


class AttentionVelocity:
    """The attention velocity of a head measure at this rank's targets: the nodes of a
    velocity space (this rank's own nodes, given once), or points given per call
    (particles)."""

    def __init__(self, targets, heads: HeadMeasure, attention, comm, geometry: Geometry | None = None,
                 kernel=None, costs: Costs | None = None):
        """``attention``: the ``[attention]`` options (schema.SECTIONS["attention"]);
        ``geometry``: the space of the tokens (default flat R^d), on which the targets
        are projected and whose tangent space the velocity is projected onto; ``kernel``:
        what is summed (:mod:`pdeformer.model.kernels`; default the options' kernel),
        which the options' backend sums; ``costs``: the seconds its choices between ways
        of summing are made from (the run's, :class:`~pdeformer.model.context.RunContext`;
        default this machine's, :func:`~pdeformer.attention.costs.machine_costs`,
        collective over ``comm``)."""
        self.geometry = Flat(heads.dim) if geometry is None else geometry
        self.targets = targets if targets is None else self.geometry.project(targets)
        self.kernel = KERNELS[attention.kernel].from_options(attention) if kernel is None else kernel
        self.heads = heads  # read at every call: training updates it in place
        self.backend = attention.backend
        self.summation = BACKENDS[self.backend]()
        self.summation.check(heads.dim, self.kernel)
        self.tol = attention.tol
        self.chunk_mb = attention.chunk_mb
        self.tape_mb = attention.tape_mb   # tables kept for an adjoint (forward.py)
        self.comm = comm
        self.costs = machine_costs(comm) if costs is None else costs
        self.planner = TablePlanner(comm, self.tol, self.costs)
        self._gathered = None  # (points object, all points, slice of this rank)
        self._limits = {}      # key -> (A, points, targets, n_max): the auto cost model
        self.misses = {}       # key -> (evaluations still to sum directly, misses in a row): auto
        self.last_sum = None    # how the last velocity was summed: None (direct) or a TableSum
        self.last_radial = None  # Geometry.radial of the last unprojected velocity (None: flat)
        self.last_finite = None  # whether it is finite on every rank, where already agreed
        # frozen plans (gradients): each evaluation's plan kept by its step and replayed
        # when that step comes again, so forward passes of a gradient evaluation and its
        # risks see one discrete map, a function of the heads alone (:meth:`refreeze`)
        self.freeze = False
        self.frozen: dict = {}
        self.stats = {"direct": 0, "laplace": 0, "largest_estimate": 0.0, "largest_grid": 0,
                      **self.planner.stats}
        self.planner.stats = self.stats   # table searches, plans reused, plans grown

    @property
    def last_plan(self):
        """The plan of the last velocity (None: direct summation)."""
        return None if self.last_sum is None else self.last_sum.plan

    def matrices(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The kernel's matrices of ``layer`` (softmax: beta A_h and V_h)."""
        return self.kernel.matrices(self.heads, layer)

    def tangential(self, x: np.ndarray, v: np.ndarray) -> np.ndarray:
        """P_x v (:meth:`Geometry.tangential <pdeformer.model.geometry.Geometry.tangential>`:
        v on a flat mesh); what it leaves out (on the sphere the radial part <v, u>) kept
        as :attr:`last_radial`, which the reverse mode through moving targets needs."""
        self.last_radial = self.geometry.radial(x, v)
        return self.geometry.tangential(x, v)

    # ------------------------------------------------------------------ helpers
    def _all_points(self, points):
        if self._gathered is None or self._gathered[0] is not points:
            counts = self.comm.allgather(len(points))
            start = sum(counts[:self.comm.rank])
            self._gathered = (points, allgather_rows(self.comm, points),
                              slice(start, start + len(points)))
        return self._gathered[1], self._gathered[2]

    def worthwhile_size(self, points, A, x, key) -> int | None:
        """The largest table size worth building (``auto``): the largest whose cost (table
        and interpolation) is below direct summation's, in the seconds of
        :attr:`costs` (None: none is). Kept per key while heads, sources and
        targets stay."""
        cached = self._limits.get(key)
        if cached is not None and cached[1] is points and cached[2] is x and np.array_equal(cached[0], A):
            return cached[3]
        d = points.shape[1]
        lo, hi = self.planner.b_range(key, x, A)
        M = self.comm.allreduce(len(points), op=MPI.SUM)
        N = self.comm.allreduce(len(x), op=MPI.SUM)
        H = A.shape[0]
        compiled = self.planner.lib() is not None
        extent = source_extent(points, self.comm)
        finite = bool(np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)))
        nodes = [panel_nodes(max(abs(lo[a]), abs(hi[a])), extent[a]) for a in range(d)] if finite else None
        direct = direct_seconds(self.costs, N, H, M)
        cheaper = [n for n in table_sizes(d) if n <= largest_size(d)
                   and laplace_seconds(self.costs, n, d, M, N * H, compiled, nodes) < direct]
        n_max = cheaper[-1] if cheaper else None
        self._limits[key] = (A.copy(), points, x, n_max)
        return n_max

    def _laplace(self, points, weights, x, A, V, key, signed=None):
        """(v, plan) through a laplace table, or None where direct must (or should) do."""
        found = self.summation.table_velocity(self, points, weights, x, A, V, key, signed)
        if found is None:
            return None
        v, plan, bound = found
        # a bound on this velocity's error relative to its largest value (direct sums: exact)
        self.stats["largest_estimate"] = max(self.stats["largest_estimate"], bound)
        self.stats["largest_grid"] = max(self.stats["largest_grid"], plan.n)
        return v, plan

    def refreeze(self) -> None:
        """Forget frozen plans and the planner's history: the next evaluations plan anew."""
        self.frozen.clear()
        self.misses.clear()
        self.planner.reset()

    # ------------------------------------------------------------------ velocity
    def __call__(self, points: np.ndarray, weights: np.ndarray, layer: int,
                 targets: np.ndarray | None = None, key=None, step=None,
                 signed: bool | None = None) -> np.ndarray:
        """Velocity of ``layer`` at this rank's targets, (n, d), for the density given by
        this rank's source points and weights. :attr:`last_plan` records how. ``key``
        names whose table plan to reuse (default: the layer); with :attr:`freeze`,
        ``step`` names the evaluation whose plan is kept and replayed. ``signed``: whether
        any rank has a negative weight, where the caller knows (else found out here)."""
        # overflow (heads grown past what the mesh's scores hold) is reported by the
        # callers' finiteness checks, as one line, not as numpy warnings
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return self._velocity(points, weights, layer, targets, key, step, signed)

    def _velocity(self, points, weights, layer, targets, key, step, signed) -> np.ndarray:
        x = self.targets if targets is None else targets
        A, V = self.matrices(layer)
        replayed = self.freeze and step is not None and step in self.frozen
        if replayed:
            found = self._replayed(points, weights, x, A, V, self.frozen[step])
        else:
            found = self._laplace(points, weights, x, A, V, layer if key is None else key, signed)
            if self.freeze and step is not None:
                self.frozen[step] = None if found is None else found[1]
        self.last_finite = self.planner.finite if found is not None and not replayed else None
        if found is None:
            self.last_sum = None
            self.stats["direct"] += 1
            all_points, _ = self._all_points(points)
            sources = Sources.from_arrays(all_points, allgather_rows(self.comm, weights))
            return self.tangential(x, self.kernel.velocity(x, sources, A, V, self.chunk_mb))
        self.stats["laplace"] += 1
        v, plan = found
        self.last_sum = TableSum(plan, *self.planner.built)
        return self.tangential(x, v)

    def partition_ratio(self, points: np.ndarray, weights: np.ndarray, layer: int,
                        x: np.ndarray) -> np.ndarray:
        """Z_h(x) / Z_h^|w|(x) for every head h at one point x (d,), the same on all ranks:
        the softmax's partition function Z_h(x) = sum_j w_j e^{<A_h x, y_j>} over the same
        sum with |w_j|. 1 for a density >= 0; near 0 or negative where negative weights
        carry the tilted measure, and the velocity is then ill-defined."""
        b = np.einsum("hij,j->hi", self.matrices(layer)[0], x)
        origin = np.zeros(len(x))
        shifts, sums = [], []
        for w in (weights, np.abs(weights)):
            shift, part = partial_sums(b, Sources.from_arrays(points, w), origin)
            shifts.append(shift)
            sums.append(part[:, 0])
        shifts = np.array(shifts)
        top = np.empty_like(shifts)
        self.comm.Allreduce(shifts, top, op=MPI.MAX)   # -inf: no source on any rank
        with np.errstate(invalid="ignore"):
            scaled = np.where(np.isfinite(shifts), np.array(sums) * np.exp(shifts - top), 0.0)
        self.comm.Allreduce(MPI.IN_PLACE, scaled, op=MPI.SUM)
        return scaled[0] / scaled[1]

    def _replayed(self, points, weights, x, A, V, plan):
        """(v, plan) of exactly this plan (None: direct summation)."""
        if plan is None:
            return None
        return self.planner.velocity_of(points, weights, x, A, V, plan), plan

    def vjp(self, points: np.ndarray, weights: np.ndarray, layer: int, g: np.ndarray,
            plan=None, targets: np.ndarray | None = None, positions: bool = False) -> VelocityCotangent:
        """Cotangents of <g, v> (g at this rank's nodes): this rank's source weights,
        and A, V of ``layer`` (this rank's share; the caller sums over ranks); with
        ``positions`` (particles) also the cotangents of this rank's targets and of its
        source points (on the sphere the targets' through the unprojected velocity only:
        the caller adds the part through P_x, :meth:`Geometry.tangential_position_vjp`).
        ``plan`` is the forward evaluation's :attr:`last_plan`: the same sum
        is differentiated; its :attr:`last_sum` (a :class:`TableSum`) differentiates the
        forward evaluation's own table and interpolant, built for the same sources,
        targets and heads, without building them again."""
        x = self.targets if targets is None else targets
        A, V = self.matrices(layer)
        g = self.geometry.tangential_vjp(x, g)     # (the caller adds d/dx through P_x)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):   # checked by the adjoint
            ct = self._vjp(points, weights, x, A, V, g, plan, positions)
        return self.kernel.matrices_vjp(ct)

    # ------------------------------------------------------------------ parameters
    @property
    def params(self) -> dict:
        """The term's block of the parameter tree: {"attention": {"Q", "K", "V"}}."""
        return {self.heads.block: self.heads.params}

    def gain(self, layer: int, params: dict | None = None) -> float:
        """sum_h w_h |V_h|_2 of ``layer`` (w_h = 1/H unweighted): |v(x)| <= gain max_y |y|
        for a density >= 0 (``params``: a parameter tree to bound instead of the heads')."""
        V = self.heads.V if params is None else params[self.heads.block]["V"]
        scale = self.heads.value_scale(layer)
        return value_gain(V[layer] if scale is None else scale[:, None, None] * V[layer])

    def zero_cotangent(self, lead: tuple = ()) -> dict:
        """Accumulators of the cotangents of every layer's A_h and V_h (what :meth:`vjp`
        gives), with ``lead`` axes in front (one per output of a Jacobian)."""
        h = self.heads
        return {h.block: {"A": np.zeros(lead + (h.layers, h.heads, h.dim, h.dim)),
                          "V": np.zeros(lead + h.V.shape)}}

    def add_cotangent(self, acc: dict, layer: int, ct: VelocityCotangent, at: tuple = ()) -> None:
        """acc[at][layer] += the parameter cotangents of one :meth:`vjp` (that of V_h is
        H w_h times that of the values summed, where the heads are weighted)."""
        block = acc[self.heads.block]
        block["A"][at + (layer,)] += ct.A
        scale = self.heads.value_scale(layer)
        block["V"][at + (layer,)] += ct.V if scale is None else scale[:, None, None] * ct.V

    def parameter_gradient(self, acc: dict) -> dict:
        """The cotangents of the parameters from accumulated ones: A = K^T Q, so
        dQ = K dA and dK = Q dA^T (:func:`~pdeformer.model.heads.query_key_derivatives`)."""
        block = acc[self.heads.block]
        dQ, dK = query_key_derivatives(self.heads, block["A"])
        return {self.heads.block: {"Q": dQ, "K": dK, "V": block["V"]}}

    def _vjp(self, points, weights, x, A, V, g, plan, positions) -> VelocityCotangent:
        if plan is None:
            all_points, mine = self._all_points(points)
            ct = self.kernel.velocity_vjp(x, all_points, allgather_rows(self.comm, weights),
                                          A, V, g, self.chunk_mb, positions)
            self.comm.Allreduce(MPI.IN_PLACE, ct.weights, op=MPI.SUM)
            ct.weights = ct.weights[mine].copy()
            if positions:
                self.comm.Allreduce(MPI.IN_PLACE, ct.points, op=MPI.SUM)
                ct.points = ct.points[mine].copy()
            return ct
        kept = isinstance(plan, TableSum)
        if kept:
            plan, table, interp = plan
        else:
            table, interp = self.planner.replay(points, weights, plan)
        mbar, dA, dV, xbar = interp.velocity_vjp(x, A, V, g, positions)
        wbar, ybar = table.source_cotangents(mbar, positions)
        if plan.signed:                 # the pairs the table leaves out, summed exactly
            if not kept:                # (a kept interpolant has them from its velocity)
                interp.velocity(x, A, V)
            if any_rank(self.comm, len(interp.skipped)):
                exact = exact_pair_vjp(points, weights, x, A, V, g, interp.skipped, self.comm)
                wbar, dA, dV = wbar + exact[0], dA + exact[1], dV + exact[2]
        return VelocityCotangent(wbar, dA, dV, xbar, ybar)
