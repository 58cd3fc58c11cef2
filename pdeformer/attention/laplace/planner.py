"""Plans: the laplace tables of one velocity field, kept from one evaluation to the next.

:class:`TablePlanner` keeps, per key (a prompt's layer), the box, sizes and kind of the
last table (a :class:`TablePlan`) and builds the next one the same way while the heads'
b-range stays inside the box and the new table's own estimate meets tol; the plan goes
on the tape, so the adjoint rebuilds exactly the table the forward pass used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ...tools.parallel import any_rank
from .. import compiled
from .accuracy import Assessment, assess, velocity_bound
from .box import b_range, grid_box
from .chebyshev import size_index, table_sizes
from .exact_pairs import exact_pair_velocity
from .fine_grids import FineGrid, fine_grid
from .layout import SourceLayout
from .panels import PANEL_EPS, panel_eps
from .search import PREDICTION_MARGIN, choose_table, coordinate_scale, subsample
from .table import LaplaceTable, any_negative


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
    the table is built again. Its tables choose how to sum their tiles and whether to
    take a fine grid by ``costs`` (:class:`~pdeformer.attention.costs.Costs`)."""

    def __init__(self, comm, tol: float, costs):
        self.comm, self.tol, self.costs = comm, tol, costs
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
            self._lib = (compiled.kernels_on(self.comm),)      # one collective call, once
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
                             self.layout(points, lo, hi, plan.eps), lib, costs=self.costs)
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
                                    self.layout(points, lo, hi, panel_eps(target)), lib, costs=self.costs)
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
                                    n_max, plan.signed, table.layout, lib, start=i, costs=self.costs)
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
