r"""The adjoint sweep: exact gradient of the discrete risk with respect to every head.

The forward map of one prompt is the composition of SSP stages
Y_i = sum_j alpha_ij Y_j + dt beta_ij L(Y_j), L(Y) = M^{-1} R(Y, v(Y)), where
v(Y) = attention velocity of the quadrature weights w = B Y. The adjoint runs these
steps backwards in depth (design §2): for a stage cotangent Lbar, with z = M^{-1} Lbar,

* transport:   Ybar += (dR/dY)^T z                  -- the adjoint transport (downwind) operator,
* velocity:    vbar  = (dR/dv)^T z                  -- then through the kernel:
* source term: Ybar += B^T (omega * wbar(vbar))     -- the nonlocal term S_t: each token is
                                                      a key and a value for all others,
* heads:       Abar_h, Vbar_h += (dv/dA_h, dv/dV_h)^T vbar,

which is the transposed chain rule of the discrete forward map: the gradient is that of
the computed risk to round-off (a Taylor test falls as eps^2), not an approximation of
the continuous one. The step plan is frozen (steps_per_layer, or counts fixed at the
start of the evaluation), so the discrete risk is a smooth function of the heads.

Memory: every step stores the density and velocity at each stage, with their ghost
entries (so that the adjoint sets them without communication), and the limiter's record
of the cells it limited: steps x stages x (DG dofs + d values per velocity node + up to
4 + 2 x dofs per cell for the limiter) doubles per prompt, and the tables up to
``[attention] tape_mb`` (measured: :func:`~pdeformer.integrator.march.tape_nbytes`;
estimated: :func:`~pdeformer.solvers.budget.dg_tape_bytes`).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..tools.datasets import chosen_prompts
from ..tools.errors import SolverBreakdown
from .forward import ForwardSolver, located
from ..model.params import Gradient, flatten, leaves, tree_map
from ..integrator.march import sweep_back, tape_nbytes
from ..model.objectives import default_quadrature_degree
from ..tools.parallel import any_rank
from ..integrator.schemes import ssp_step_vjp
from ..fem.transport import CellQuadrature


HUGE_COSTATE = 1e150   # an adjoint starting this large overflows from its own size


def adjoint_cause(start: float, objective) -> str:
    """Why an adjoint sweep overflowed, from the size ``start`` of the costate it
    started from (the largest |dF/drho| at t = 1, over all ranks)."""
    if start > HUGE_COSTATE:
        knob = objective.adjoint_knob
        return (f"it starts at t = 1 from dF/drho up to {start:.3g}, the objective's own scale, "
                f"which the sweep multiplies further: lower {knob}")
    return (f"it starts at t = 1 from dF/drho up to {start:.3g} and grows through the layers: the "
            "attention is too sharp (lower model.init_scale) or the steps too long")


class AdjointSolver:
    """Risk and its gradient for the heads of a :class:`ForwardSolver`'s problem."""

    def __init__(self, forward: ForwardSolver, objective, targets: list, quadrature_degree=None):
        self.forward = forward
        self.objective = objective
        self.targets = targets
        tr = forward.transport
        degree = quadrature_degree or default_quadrature_degree(objective.kind, tr.degree)
        forward.problem.check_on_mesh(objective)
        self.rule = CellQuadrature(tr.mesh, degree, tr.u)
        forward.freeze_plans()
        self.start = 0.0   # the largest |dF/drho| at t = 1 of the prompt being swept (all ranks)

    # ------------------------------------------------------------ risk
    def objective_at(self, index: int, coeffs: np.ndarray) -> tuple[float, np.ndarray]:
        """F_s(rho) and dF_s/dc (owned DG coefficients) for density coefficients c."""
        tr = self.forward.transport
        tr.set_state(coeffs)
        F, dF = self.objective.value_and_gradient(self.rule.points, self.rule.measure,
                                                  self.rule.values(), self.targets[index],
                                                  tr.comm)
        if not np.isfinite(F):    # F is all-reduced: the same on every rank
            raise SolverBreakdown(f"the objective {self.objective.kind!r} of prompt "
                                  f"{self.forward.problem.prompts[index][0]!r} at t = 1 is {F}")
        self._dF = dF / np.where(self.rule.measure > 0, self.rule.measure, 1.0)   # dF/drho
        return F, self.rule.transpose(dF, tr.cell_dofs, tr.n_owned)

    def risk(self, prompts: list[int] | None = None) -> tuple[float, list[float]]:
        """R = (1/|P|) sum_{s in P} F_s(rho_1^s) over the prompts P (default: the training
        prompts), forward only (same frozen step plan); every group solves its prompts of
        P, the risks are combined over the groups. Returns R and the F_s in P's order."""
        groups = self.forward.problem.groups
        chosen = chosen_prompts(self.forward.problem, prompts)
        wanted = set(chosen)   # (a set: data sets have 10^5 prompts)
        local = {}
        with groups.combined():
            for s in groups.owned:
                if s in wanted:
                    coeffs, _ = self.forward.solve_prompt(s)
                    local[s] = self.objective_at(s, coeffs)[0]
        risks = groups.gather_prompts(local)
        risks = [risks[s] for s in chosen]
        return float(np.mean(risks)), risks

    # ------------------------------------------------------------ gradient
    def gradient(self, refreeze: bool = True, prompts: list[int] | None = None) -> Gradient:
        """Risk and dR/dtheta (a tree like the model's parameters), R the mean of F_s over ``prompts`` (default: the
        training prompts; a minibatch in SGD). Without steps_per_layer the step counts are
        frozen during this evaluation's forward passes (``refreeze``) and kept for
        later :meth:`risk` calls, which then see the same discrete map; so are the
        attention's table plans (planned afresh here: the map depends on the heads alone,
        so a restarted training repeats the uninterrupted one).

        With prompt groups every group sweeps its own prompts on its communicator; the
        groups then agree on failure, and one Allreduce over the world sums every rank's
        share of the parameters' cotangents (the same on every rank, so all ranks hold identical gradients)."""
        fw = self.forward
        if refreeze:
            fw.plan_afresh()
        groups = fw.problem.groups
        chosen = chosen_prompts(fw.problem, prompts)
        wanted = set(chosen)   # (a set: data sets have 10^5 prompts)
        acc = fw.velocity_field.zero_cotangent()
        local, tape_bytes = {}, 0
        with groups.combined():
            for s in groups.owned:
                if s not in wanted:
                    continue
                tape = []
                coeffs, _ = fw.solve_prompt(s, tape=tape)
                tape_bytes = max(tape_bytes, tape_nbytes(tape))
                F, lam = self.objective_at(s, coeffs)
                local[s] = F
                self.start = fw.comm.allreduce(float(np.abs(self._dF).max(initial=0.0)), op=MPI.MAX)
                name = fw.problem.prompts[s][0]

                def step_vjp(lam, layer, dt, stages, limits):
                    with located(f"adjoint of prompt {name!r}, layer {layer}"):
                        return self._step_vjp(lam, layer, dt, stages, limits, acc)
                sweep_back(tape, lam, step_vjp)
        risks = groups.gather_prompts(local)
        for _, a in leaves(acc):
            groups.world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        S = len(chosen)
        grads = fw.velocity_field.parameter_gradient(tree_map(lambda a: a / S, acc))
        return Gradient(float(np.mean([risks[s] for s in chosen])), [risks[s] for s in chosen],
                        grads, tape_bytes, chosen)

    def output_jacobian(self, prompts: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The model's outputs y_s (the objective's ``outputs``: the moments of rho_1^s)
        for ``prompts`` (default: the training prompts), their targets y*_s and the
        Jacobian dy/dtheta, theta every parameter flattened in the tree's order: one
        forward pass per prompt and one backward sweep of its tape per output. Returns
        (y, y*, J) stacked prompt by prompt: shapes (N,), (N,), (N, P), the same on every
        rank. Prompt groups sweep their own prompts; one Allreduce combines."""
        fw = self.forward
        fw.plan_afresh()
        groups = fw.problem.groups
        chosen = chosen_prompts(fw.problem, prompts)
        owned = set(groups.owned)   # (a set: data sets have 10^5 prompts)
        m = len(self.objective.output_names(fw.problem.dim))
        y = np.zeros((len(chosen), m))
        ystar = np.array([self.objective.target_outputs(self.targets[s]) for s in chosen])
        acc = fw.velocity_field.zero_cotangent((len(chosen), m))
        with groups.combined():
            for row, s in enumerate(chosen):
                if s in owned:
                    y[row] = self._output_rows(s, row, m, acc)
        for a in (y, *(a for _, a in leaves(acc))):
            groups.world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        J = flatten(fw.velocity_field.parameter_gradient(acc), lead=2).reshape(len(chosen) * m, -1)
        return y.ravel(), ystar.ravel(), J

    def _output_rows(self, s: int, row: int, m: int, acc: dict) -> np.ndarray:
        """The outputs of prompt s (on a group's lead rank, zeros elsewhere: summed over
        the world) and, into ``acc[row, j]``, the cotangents of each output j."""
        fw, tr = self.forward, self.forward.transport
        tape = []
        coeffs, _ = fw.solve_prompt(s, tape=tape)
        tr.set_state(coeffs)
        values, dy = self.objective.outputs(self.rule.points, self.rule.measure, self.rule.values(), tr.comm)
        per_rho = dy / np.where(self.rule.measure > 0, self.rule.measure, 1.0)   # as _dF
        self.start = fw.comm.allreduce(float(np.abs(per_rho).max(initial=0.0)), op=MPI.MAX)
        name = fw.problem.prompts[s][0]
        for j in range(m):
            lam = self.rule.transpose(dy[j], tr.cell_dofs, tr.n_owned)

            def step_vjp(lam, layer, dt, stages, limits, j=j):
                with located(f"adjoint of output {j} of prompt {name!r}, layer {layer}"):
                    return self._step_vjp(lam, layer, dt, stages, limits, acc, (row, j))
            sweep_back(tape, lam, step_vjp)
        return values if fw.problem.groups.lead else np.zeros(m)

    def _step_vjp(self, lam, layer, dt, stages, limits, acc, at=()) -> np.ndarray:
        """Cotangent of a step's start from that of its end (Shu-Osher form reversed,
        through the limiter's Jacobian at every limited stage)."""
        tr = self.forward.transport
        limit_vjp = (lambda i, bar: tr.limit_vjp(limits[i - 1], bar)) if limits else None
        return ssp_step_vjp(self.forward.scheme, lam, dt,
                            lambda j, Lbar: self._rate_vjp(*stages[j], layer, Lbar, acc, at), limit_vjp)

    def _rate_vjp(self, Y, vel, plan, ghosts, layer, Lbar, acc, at) -> np.ndarray:
        fw = self.forward
        tr = fw.transport
        tr.set_state(Y, ghosts=ghosts[0])        # the ghost copies the forward pass read:
        tr.set_velocity(vel, ghosts=ghosts[1])   # no communication
        # an overflow is found and reported (one line) just below, without numpy's warnings
        with fw.timer.phase("adjoint transport"), np.errstate(over="ignore", invalid="ignore"):
            Ybar, vbar = tr.rate_vjp(Lbar)
        with fw.timer.phase("adjoint velocity"), np.errstate(over="ignore", invalid="ignore"):
            ct = fw.velocity_field.vjp(tr.sources.points, tr.sources.weights(), layer, vbar, plan)
        wbar = ct.weights
        if any_rank(tr.comm, not (np.all(np.isfinite(wbar)) and np.all(np.isfinite(Ybar)))):
            raise SolverBreakdown(f"the adjoint is NaN or overflows: {adjoint_cause(self.start, self.objective)}")
        fw.velocity_field.add_cotangent(acc, layer, ct, at)
        return Ybar + tr.sources.transpose(wbar * tr.sources.measure, tr.cell_dofs, tr.n_owned)
