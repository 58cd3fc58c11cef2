r"""The forward pass: token densities of every prompt transported through L layers.

Per prompt s, on t in [0, 1] (design §1):

.. math::

    \partial_t \rho + \nabla\cdot(\rho\, v_t[\rho]) = 0, \qquad
    v_t[\rho](x) = \frac1H \sum_h V_h \nabla\Lambda_\rho(A_h x), \qquad \rho(0) = \rho_0^s,

discretised by :class:`~pdeformer.fem.transport.DGTransport` in space and an SSP
Runge-Kutta scheme in depth. The step is either CFL-based (recomputed every step
from the current velocity, then shortened so that steps land exactly on every frame
and layer boundary) or fixed (``steps_per_layer``, so the discrete solution is a
smooth function of the head parameters). :class:`ForwardSolver` owns the loop;
everything that watches it -- progress, diagnostics, fields -- is a tracker.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import ufl
from mpi4py import MPI

from ..tools.errors import ConfigError, InputError, SolverBreakdown
from ..integrator.frames import Frame, Tracker, located  # noqa: F401  (Tracker: the base of the trackers)
from ..integrator.march import march, tape_nbytes
from ..fem.mesh import bounding_box, shortest_edge
from ..tools.datasets import data_errors, prompt_label
from ..tools.parallel import Timer, any_rank
from ..integrator.schemes import SCHEMES, ssp_step
from ..fem.transport import DGTransport
from ..fem import _dolfinx as dfx
from ..model.terms import VelocityField
from ..model.velocity import AttentionVelocity, TableSum
from .problem import Problem

log = logging.getLogger("pdeformer")

MAX_STEPS_PER_LAYER = 200_000
# The exact density stays >= 0, of mass 1 and inside the mesh; a discrete one past these
# bounds has blown up (DG undershoot on meshes that resolve the density stays far below:
# see docs/reliability.md for the values the shipped configs and tests reach).
BLOWUP_NEGATIVE_MASS = 0.25   # int max(0, -rho) (the initial mass is 1)
BLOWUP_MASS_DRIFT = 1e-6      # |mass + outflow - 1| (DG conserves mass to round-off)
# A frozen step plan is made again for the rest of its frame when the velocity has grown
# so that its step exceeds the CFL step by this factor, or the stability limit (cfl 1),
# whichever comes first (see FramePlan).
REPLAN_SLACK = 1.25
# For a density >= 0 the attention average of every head lies in the hull of the sources,
# so |v| <= (1/H) sum_h |V_h| max_y |y|; a velocity this many times above that bound comes
# from a partition function made tiny or negative by negative weights.
HULL_SLACK = 2.0


class FramePlan:
    """The steps of one frame when they are fixed, as segments [planned, taken]:
    ``planned`` uniform steps over what was left of the frame, of which ``taken`` were
    made. A frozen plan (gradient runs) is made as the frame goes: its first segment
    from the CFL step at the frame's start, and a new one (the rest of the frame planned
    again) whenever the velocity grows so that the planned step is more than
    REPLAN_SLACK times the CFL step or past the stability limit -- so no frozen step is
    unstable (unless discretisation.cfl > 1 asks for it). Replaying the
    segments repeats exactly the same steps (the tape, and later risk evaluations)."""

    def __init__(self, segments: list | None = None, deciding: bool = False):
        self.segments = segments if segments is not None else []
        self.deciding = deciding
        self._segment, self._done = 0, 0   # replay cursor

    def plan(self, steps: int) -> None:
        """Plan what is left of the frame in ``steps`` uniform steps (deciding)."""
        self.segments.append([steps, 0])

    def left(self) -> int:
        """Steps left in the current segment, counting the one about to be taken."""
        if self.deciding:
            planned, taken = self.segments[-1]
            return planned - taken
        return self.segments[self._segment][0] - self._done

    def took(self) -> None:
        if self.deciding:
            self.segments[-1][1] += 1
            return
        self._done += 1
        if self._done == self.segments[self._segment][1] and self._segment + 1 < len(self.segments):
            self._segment, self._done = self._segment + 1, 0

    @property
    def steps(self) -> int:
        return sum(taken for _, taken in self.segments)


class PromptMarch:
    """One prompt's march through depth on the mesh (a :class:`~pdeformer.integrator.march.StepController`
    with the step and the frames' output): the state (coefficients, outflow), the
    velocity of the state that the next step's first stage reuses, the step plan of the
    frame (CFL steps chosen every step, fixed, or frozen), and per layer the largest
    step relative to the stability limit (``overshoot``)."""

    def __init__(self, solver: "ForwardSolver", index: int, trackers, tape):
        self.solver, self.index, self.trackers, self.tape = solver, index, trackers, tape
        self.name = solver.problem.prompts[index][0]
        self.want_v = any(tr.needs_velocity for tr in trackers)
        self.state = [solver.initial_coeffs[index].copy(), np.zeros(1)]
        self.steps, self.dt, self.overshoot = 0, math.nan, 0.0
        self.cache = None     # (state, layer, velocity, plan): the next step's first stage reuses it
        self.first = None     # (velocity, plan) of the step about to be taken
        self.plan = None
        self.layer = 0
        self.step_bytes = None   # bytes of a taped step (the largest rank's, after the first step)

    def where(self, t: float, layer: int) -> str:
        return f"prompt {self.name!r}, layer {layer}, t = {t:.6g}"

    # ------------------------------------------------------------ step control
    def start_layer(self, layer: int) -> None:
        self.layer, self.layer_steps, self.warned, self.overshoot = layer, 0, False, 0.0

    def start_frame(self, layer: int, frame: int) -> None:
        self.plan = self.solver._frame_plan(self.index, layer, frame)

    def next_step(self, t: float, t_end: float) -> tuple[float, bool]:
        """The velocity of the state (evaluated, or kept from the frame's output), its CFL
        step, the velocity bound, and the step the plan gives (planned again where the
        velocity outgrew a frozen plan); a warning past the stability limit."""
        sv, layer, plan = self.solver, self.layer, self.plan
        with located(self.where(t, layer)) as where:
            self.first = self._first_stage(layer)
            dt_cfl, vmax = sv.transport.cfl_step(sv.disc.cfl * sv.scheme.cfl_factor)
            sv._check_hull(vmax, self.first[0], layer)
            if plan is None:   # CFL steps, chosen afresh every step
                n_left = sv._cfl_steps(t_end - t, dt_cfl, vmax, self.layer_steps)
            else:              # uniform steps, planned now or replayed
                if plan.deciding and (not plan.segments or (t_end - t) / plan.left()
                                      > sv._replan_factor * dt_cfl):
                    plan.plan(sv._cfl_steps(t_end - t, dt_cfl, vmax, self.layer_steps))
                n_left = plan.left()
            self._check_tape(n_left, vmax)
        dt = (t_end - t) / n_left
        overshoot = dt * sv.disc.cfl / dt_cfl
        self.overshoot = max(self.overshoot, overshoot)
        if overshoot > 1 + 1e-8 and not self.warned:   # fixed or frozen steps past cfl = 1
                                                       # (ceil's 1e-9 slack: not a step past it)
            self.warned = True
            if sv.comm.rank == 0:
                log.warning("warning: %s: %s", where, sv._unstable_step(dt, vmax, overshoot, plan))
        return dt, n_left == 1

    def _first_stage(self, layer: int):
        """(velocity, plan) of the state: the one the last frame's output computed, else
        evaluated now."""
        sv, cache = self.solver, self.cache
        if cache is not None and cache[0] is self.state and cache[1] == layer:
            sv.transport.set_velocity(cache[2])
            return cache[2], cache[3]
        return sv.velocity(self.state[0], layer), sv.velocity_field.last_sum

    def took(self, dt: float) -> None:
        if self.plan is not None:
            self.plan.took()
        self.layer_steps += 1
        self.steps += 1
        self.dt = dt

    # ------------------------------------------------------------ step and frames
    def step(self, t: float, dt: float, layer: int) -> None:
        sv = self.solver
        with located(self.where(t, layer)):
            self.state = sv._step(self.state, dt, layer, self.first, self.tape)
            if any_rank(sv.comm, not np.all(np.isfinite(self.state[0]))):
                raise SolverBreakdown("the density is NaN or overflows after this step")
            if self.tape is not None and self.step_bytes is None:   # the largest rank's, agreed
                self.step_bytes = sv.comm.allreduce(tape_nbytes(self.tape[-1], tables=False), op=MPI.MAX)

    def _check_tape(self, steps: int, vmax: float) -> None:
        """A breakdown where ``steps`` more steps would take the gradient's tape (the
        steps' states, and the tables it keeps: at most ``attention.tape_mb``) past the
        room the memory limit leaves it (ForwardSolver.tape_limit): the velocity is too
        fast for this mesh's CFL step (agreed on every rank: step_bytes is)."""
        room, per = self.solver.tape_limit, self.step_bytes
        if self.tape is None or room is None or per is None:
            return
        need = (len(self.tape) + steps) * per + self.solver.velocity_field.tape_mb * 2**20
        if need > room:
            raise SolverBreakdown(
                f"the velocity |v| = {vmax:.3g} needs {steps} more steps in this frame, and the tape "
                f"the gradient keeps of them ({need / 2**30:.3g} GB per rank) would pass the "
                f"{room / 2**30:.3g} GB the memory limit leaves it (output.max_memory_gb, or the "
                "node's memory): these heads move the tokens too fast for the mesh")

    def emit(self, t: float, layer: int, boundary: bool) -> None:
        """The frame at t: its velocity where a tracker wants it (the heads of the layer
        holding t; at a layer end, of the next layer), diagnostics, the blow-up check and
        the outflow warning, then the trackers; a breakdown found here still records the
        density before it stops the run."""
        sv, L = self.solver, self.solver.problem.heads.layers
        vel, failure = None, None
        if self.want_v:
            at = min(layer + 1, L - 1) if boundary else layer
            try:
                with located(self.where(t, at)):
                    vel = sv.velocity(self.state[0], at)
                self.cache = (self.state, at, vel, sv.velocity_field.last_sum)
            except SolverBreakdown as e:
                failure = e
        frame = Frame(self.name, self.index, t, layer, boundary, self.steps, self.dt,
                      self.state[0], sv._outflow(self.state), vel)
        frame.extra["diagnostics"] = diag = sv.diagnostics(frame)
        where = self.where(t, max(layer, 0))
        if failure is None:
            failure = sv.blowup(diag, self.overshoot, where) or sv.mass_gone(diag, where)
        if failure is None and self.index not in sv.outflow_warned and sv._warn_outflow(diag, where):
            sv.outflow_warned.add(self.index)   # once per prompt and run (not every training step)
        with sv.timer.phase("output"):
            for tr in self.trackers:
                if failure is None or not tr.needs_velocity:
                    tr.frame(sv, frame)
        if failure is not None:
            raise failure


class ForwardSolver:
    def __init__(self, problem: Problem, timer: Timer | None = None):
        self.problem, self.comm = problem, problem.comm
        self.timer = timer or Timer()
        opts = problem.opts
        disc = self.disc = opts.discretisation
        self.frames_per_layer = opts.output.frames_per_layer
        with self.timer.phase("setup"):
            self.transport = DGTransport(problem.mesh, disc.degree, disc.velocity_degree,
                                         disc.quadrature_degree, opts.petsc, comm=self.comm)
            attention = AttentionVelocity(dfx.owned_node_coordinates(self.transport.W), problem.heads,
                                          opts.attention, self.comm, geometry=problem.geometry,
                                          costs=problem.context.costs)
            self.velocity_field = VelocityField(attention, problem.terms)
        self.scheme = SCHEMES[disc.scheme]
        # uniform steps per frame with counts frozen at the frame's start (gradients need
        # a step plan that does not move with the heads); step_counts can be preset
        self.freeze_steps = False
        self.step_counts: dict[tuple[int, int, int], FramePlan] = {}  # (prompt, layer, frame)
        self.box = bounding_box(self.comm, problem.mesh)
        self._reach = None     # max |y| over the attention sources (velocity_bound)
        self.outflow_warned: set[int] = set()   # prompts whose outflow was warned about
        self.cell = shortest_edge(self.comm, problem.mesh)
        self.centre = np.mean(self.box, axis=0)
        self.stats = {"steps": 0, "velocity_evaluations": 0}
        self.current_prompt = None   # the prompt being solved (it keys the laplace plans)
        self.evaluations = 0         # velocity evaluations of it so far (frozen plans)
        self._tape_room = 0          # bytes of tables the current tape may still keep
        self.tape_limit = None       # bytes a tape may take in all (None: no limit; Run sets it)
        for i, (name, prompt) in enumerate(problem.prompts):
            if prompt.kind == "points":
                with data_errors(problem.opts.data, problem.opts.prompts, name):
                    raise ConfigError(f"prompts[{i}].kind", f"{name!r} is a point cloud, which has no "
                                      "density to put on a mesh: use it with particles or ntk")
        # every prompt of this group is projected (and checked) before anything runs or is
        # written; the other groups' prompts are None here (their info: just the name)
        with self.timer.phase("prompts"):
            initial = {i: self._initial(i) for i in problem.groups.owned}
        self.initial_coeffs = [initial[i][0] if i in initial else None
                               for i in range(len(problem.prompts))]
        self.prompt_info = [initial[i][1] if i in initial else {"name": name}
                            for i, (name, _) in enumerate(problem.prompts)]

    def describe(self) -> str:
        return f"DG-{self.disc.degree}"

    @property
    def _refine_key(self) -> str:
        """The key that refines the mesh: mesh.refinements on a built-in sphere."""
        return "mesh.refinements" if self.problem.opts.mesh.shape == "sphere" else "mesh.cells"

    # ------------------------------------------------------------ building blocks
    def _initial(self, index: int) -> tuple[np.ndarray, dict]:
        """:meth:`initial_state`; a prompt that [data] made is named in its errors by the
        data.* key that drew it (a mixture off the mesh: its means, where one lies off
        the mesh's box, else its widths) or by its file."""
        name, prompt = self.problem.prompts[index]
        part = None
        if prompt.kind == "gaussian_mixture":
            lo, hi = self.box
            part = "means" if np.any((prompt.means < lo) | (prompt.means > hi)) else "covs"
        with data_errors(self.problem.opts.data, self.problem.opts.prompts, name, part):
            return self.initial_state(index)

    def initial_state(self, index: int) -> tuple[np.ndarray, dict]:
        """rho_0 projected onto DG-k and normalised to mass 1 on the mesh."""
        name, prompt = self.problem.prompts[index]
        tr = self.transport
        disc = self.disc
        key = f"prompts[{index}]"
        if hasattr(prompt, "unresolved") and (error := prompt.unresolved(self.cell, key)):
            raise error
        x = ufl.SpatialCoordinate(self.problem.mesh)
        if hasattr(prompt, "ufl_parts"):     # a mixture: one small form for any number of components
            rho0 = prompt.ufl_parts(x, tr.constant)
        elif prompt.ufl_density is not None:
            rho0 = prompt.ufl_density(x, tr.constant)
        else:
            rho0 = tr.interpolant(prompt.density, disc.degree + 2)
        coeffs, mass = tr.project(rho0, disc.prompt_quadrature_degree)
        if tr.manifold:
            # a closed curve or surface holds all of a density on it; its mass differs
            # from 1 by the flat cells' area error (O(h^2)), normalised away below
            truncated = 0.0
        elif prompt.kind == "uniform" and self.problem.opts.mesh.file is None:
            # the indicator's quadrature on cut cells is inexact; on a box mesh the
            # truncation is known exactly
            truncated = 1.0 - prompt.mass_inside(*bounding_box(self.comm, self.problem.mesh))
        else:
            truncated = 1.0 - mass / prompt.total_mass()
        if not (mass > 0 and truncated < 0.5):
            raise InputError(f"{key} ({name!r}): the prompt lies outside the mesh "
                             f"(only {max(0.0, 1 - truncated):.3g} of its mass is on it)")
        if truncated > disc.tail_tolerance and self.comm.rank == 0:
            log.warning("warning: %s: %.3g of its mass lies outside the mesh and is cut off",
                        prompt_label(self.problem.opts.data, self.problem.opts.prompts, name, index),
                        truncated)
        coeffs /= mass
        if disc.limiter:
            coeffs = tr.limit(coeffs)
        return coeffs, {"name": name, "mass_on_mesh": mass, "truncated_mass": truncated}

    def freeze_plans(self) -> None:
        """Make every evaluation one discrete map of the heads (gradients): step counts
        frozen per frame (unless steps_per_layer fixes them) and the attention's table
        plans kept per evaluation, both replayed until :meth:`plan_afresh`."""
        if self.disc.steps_per_layer is None:
            self.freeze_steps = True
        self.velocity_field.freeze = True

    def plan_afresh(self) -> None:
        """Forget the frozen plans: the next solve makes them again."""
        self.step_counts.clear()
        self.velocity_field.refreeze()

    def velocity(self, coeffs: np.ndarray, layer: int) -> np.ndarray:
        """Attention velocity of ``layer`` for density ``coeffs``; also set as the
        transport velocity. Returns the owned node values; NaN or overflow is a breakdown.
        Laplace tables are planned per (prompt, layer): each keeps its own sizes."""
        tr = self.transport
        with self.timer.phase("velocity"):
            tr.set_state(coeffs, ghosts=False)
            weights, signed = tr.source_weights()
            vel = self.velocity_field(tr.sources.points, weights, layer, signed=signed,
                                      key=(self.current_prompt, layer),
                                      step=(self.current_prompt, self.evaluations))
            self.evaluations += 1
        self.stats["velocity_evaluations"] += 1
        finite = self.velocity_field.last_finite       # agreed already, or None: not yet known
        if finite is None:
            finite = not any_rank(self.comm, not np.all(np.isfinite(vel)))
        if not finite:
            raise SolverBreakdown("the velocity is NaN or overflows")
        tr.set_velocity(vel)
        return vel

    # ------------------------------------------------------------ the loop
    def run(self, trackers: list[Tracker] = ()) -> list[dict]:
        for tr in trackers:
            tr.start(self)
        try:
            for i in self.problem.groups.owned:   # this group's prompts
                self.solve_prompt(i, trackers)
        finally:  # also after a breakdown: trackers write what they have
            for tr in trackers:
                tr.finish(self)
        return self.prompt_info

    def solve_prompt(self, index: int, trackers=(), tape: list | None = None
                     ) -> tuple[np.ndarray, float]:
        """Transport prompt ``index`` from t = 0 to 1; returns (coefficients, outflow).

        With ``tape`` (a list), every step appends ``(layer, dt, stages, limits)``, stages
        being the (density, velocity, kernel plan, (density ghosts, velocity ghosts)) at
        which the scheme evaluated its right-hand side (the ghost entries as the forms read
        them, DGTransport.ghost_values) and limits what the limiter did to each new stage
        (None without the limiter; see DGTransport.limit): what the adjoint sweep needs."""
        self.current_prompt, self.evaluations = index, 0
        self._tape_room = self.velocity_field.tape_mb * 2 ** 20 if tape is not None else 0
        prompt = PromptMarch(self, index, trackers, tape)
        steps = march(self.problem.heads.layers, self.frames_per_layer, prompt, prompt.step, prompt.emit)
        self.prompt_info[index]["steps"] = steps
        self.stats["steps"] += steps
        return prompt.state[0], self._outflow(prompt.state)

    def velocity_bound(self, layer: int, params: dict | None = None) -> float:
        """The largest |v| a density >= 0 can give in ``layer`` (:meth:`VelocityField.bound
        <pdeformer.model.terms.VelocityField.bound>` at max_y |y| over the sources;
        ``params``: a parameter tree to bound instead of the model's)."""
        if self._reach is None:   # max |y| over the attention sources (collective, once)
            pts = self.transport.sources.points
            local = float(np.max(np.linalg.norm(pts, axis=1))) if len(pts) else 0.0
            self._reach = self.comm.allreduce(local, op=MPI.MAX)
        return self.velocity_field.bound(layer, self._reach, params)

    def steps_bound(self, layer: int, params: dict | None = None) -> float:
        """The most CFL steps a layer can need (with ``params``, default the model's):
        (2k + 1) |v|max / (L cfl l_min), |v|max from :meth:`velocity_bound`."""
        k, L = self.disc.degree, self.problem.heads.layers
        return (2 * k + 1) * self.velocity_bound(layer, params) / (L * self.disc.cfl * self.scheme.cfl_factor * self.cell)

    def _check_hull(self, vmax: float, vel: np.ndarray, layer: int) -> None:
        """A breakdown when the velocity is far above what a density >= 0 can give: the
        softmax's partition function was made tiny or negative by negative weights (the
        density's undershoot where the heads weight its tails). vmax is all-reduced; the
        message gives, at the fastest node, how small Z is against its value for |rho|."""
        bound = self.velocity_bound(layer)
        if not vmax > HULL_SLACK * bound:
            return
        speed = np.linalg.norm(vel, axis=1)
        mine = (float(speed.max()), self.comm.rank) if speed.size else (-1.0, self.comm.rank)
        owner = max(self.comm.allgather(mine))[1]
        x = self.comm.bcast(self.velocity_field.targets[np.argmax(speed)] if self.comm.rank == owner
                            else None, root=owner)
        ratio = self.velocity_field.partition_ratio(self.transport.sources.points,
                                                    self.transport.sources.weights(), layer, x)
        h = int(np.argmin(ratio))
        raise SolverBreakdown(
            f"the velocity reaches |v| = {vmax:.3g} at x = {np.array2string(x, precision=3)}, "
            f"{vmax / bound:.3g} times the most a density >= 0 gives ({bound:.3g}): the attention's "
            f"partition function is tiny or negative there (head {h}: Z = {ratio[h]:.3g} times its "
            "value for |rho|) where the heads weight the density's negative undershoot"
            + ("; set discretisation.limiter = true" if not self.disc.limiter
               else f"; refine {self._refine_key}"))

    @property
    def _replan_factor(self) -> float:
        """A deciding frame plan is made again when its step exceeds this times the CFL
        step: REPLAN_SLACK, or less where that would pass the stability limit (cfl 1)."""
        return max(1.0, min(REPLAN_SLACK, 1.0 / self.disc.cfl))

    def _unstable_step(self, dt: float, vmax: float, overshoot: float, plan) -> str:
        """What made a step past the stability limit, and the setting that fixes it."""
        past = f"the step {dt:.3g} is {overshoot:.3g} times the stability limit (cfl 1 at |v| = {vmax:.3g})"
        if self.disc.steps_per_layer is not None:
            return (f"{past}: raise discretisation.steps_per_layer (now "
                    f"{self.disc.steps_per_layer}) or remove it for CFL steps")
        if plan is not None and not plan.deciding:
            return (f"{past}: this frame replays the step plan that the last gradient evaluation "
                    "froze for other heads (risks then see the gradient's discrete map), and these "
                    "heads move faster; evaluate the gradient again to plan for them")
        return f"{past}: discretisation.cfl = {self.disc.cfl} asks for it; lower it to at most 1"

    def blowup(self, diag: dict, overshoot: float, where: str) -> SolverBreakdown | None:
        """A breakdown if the density at a frame is garbage though finite: negative mass
        beyond BLOWUP_NEGATIVE_MASS (the initial mass is 1), mass + outflow not conserved,
        or, while most of the mass is on the mesh, a mean far outside the mesh's box or a
        negative variance (agreed on every rank: diag is all-reduced). The message says
        whether the steps were past the stability limit, and what to change."""
        mass, neg = diag["mass"], diag["negative_mass"]
        lo, hi = self.box
        width = hi - lo
        var = np.diag(diag["cov"])
        if not neg <= BLOWUP_NEGATIVE_MASS:   # the initial mass is 1
            what = f"its negative part has mass {neg:.3g} (min rho = {diag['min_rho']:.3g})"
        elif not abs(mass + diag["outflow"] - 1) <= BLOWUP_MASS_DRIFT:
            what = f"mass + outflow = {mass + diag['outflow']:.12g} instead of 1"
        elif mass < 0.5:    # most of it has left: the moments of the rest say little
            return None
        elif not np.all((diag["mean"] >= lo - width / 2) & (diag["mean"] <= hi + width / 2)):
            what = f"its mean {np.array2string(np.asarray(diag['mean']), precision=3)} lies far outside the mesh"
        elif not np.all(var >= -1e-12 * width**2):
            what = f"a variance is negative ({var.min():.3g})"
        else:
            return None
        if overshoot > 1 + 1e-8:
            cause = (f"steps up to {overshoot:.3g} times the stability limit were taken in this layer: "
                     + ("raise discretisation.steps_per_layer or remove it for CFL steps"
                        if self.disc.steps_per_layer is not None else
                        "lower discretisation.cfl, or, for a risk that replays a gradient's step "
                        "plan, evaluate the gradient again"))
        else:
            cause = ("the steps kept the CFL limit, so the mesh does not resolve the density these "
                     "heads make or their feedback (the velocity's change with the density) is faster "
                     f"than the step: refine {self._refine_key} or lower discretisation.cfl"
                     + ("" if self.disc.limiter else " (or set discretisation.limiter = true)"))
        return SolverBreakdown(f"{where}: the density blew up: {what}; {cause}")

    def mass_gone(self, diag: dict, where: str) -> SolverBreakdown | None:
        """A breakdown once more of the mass than ``discretisation.max_outflow`` has left
        the mesh: the moments of what is left say little about the model's output (they
        are normalised by the mass left), and a risk fitted to them less."""
        limit = self.disc.max_outflow
        if not diag["outflow"] > limit or limit >= 1:
            return None
        left = max(diag["mass"], 0.0)
        gone = f"all but {left:.3g}" if diag["outflow"] > 0.9995 else f"{diag['outflow']:.4g}"
        return SolverBreakdown(
            f"{where}: {gone} of the mass has left the mesh (more than discretisation.max_outflow = "
            f"{limit:g}); the moments of the {left:.3g} left say little about the model's output: "
            "enlarge the mesh (mesh.lower, mesh.upper)")

    def _warn_outflow(self, diag: dict, where: str) -> bool:
        """Warn when more mass than ``tail_tolerance`` has left the mesh:
        the moments then move by about |x - mean| times the mass lost, more than it
        (docs/verification.md). Whether it warned."""
        tol = self.disc.tail_tolerance
        if not abs(diag["outflow"]) > tol:
            return False
        lo, hi = self.box
        reach = float(np.max(np.maximum(np.abs(lo - diag["mean"]), np.abs(hi - diag["mean"]))))
        if self.comm.rank == 0:
            log.warning("warning: %s: %.3g of the mass has left the mesh (more than "
                        "discretisation.tail_tolerance = %.3g): means and covariances are off by up "
                        "to ~%.2g and ~%.2g; enlarge the mesh (mesh.lower, mesh.upper)", where,
                        abs(diag["outflow"]), tol, reach * abs(diag["outflow"]),
                        reach**2 * abs(diag["outflow"]))
        return True

    def _outflow(self, state) -> float:
        """The mass that has left the mesh: each rank integrates its own boundary's part."""
        return float(self.comm.allreduce(float(state[1][0]), op=MPI.SUM))

    def _frame_plan(self, index: int, layer: int, frame: int) -> "FramePlan | None":
        """The uniform steps of a frame when they are fixed: steps_per_layer, or a frozen
        plan (replayed when this evaluation made it already, else planned as the frame
        goes and kept in step_counts); None for CFL steps chosen every step."""
        spl = self.disc.steps_per_layer
        if spl is not None:
            return FramePlan([[spl // self.frames_per_layer, spl // self.frames_per_layer]])
        if not self.freeze_steps:
            return None
        key = (index, layer, frame)
        if key in self.step_counts:
            return FramePlan(self.step_counts[key].segments)
        plan = self.step_counts[key] = FramePlan(deciding=True)
        return plan

    def _cfl_steps(self, span: float, dt_cfl: float, vmax: float, layer_steps: int) -> int:
        """ceil(span / dt_cfl): steps left so that the last one lands exactly on the end."""
        n = span / dt_cfl if dt_cfl > 0 else math.inf
        if not layer_steps + n <= MAX_STEPS_PER_LAYER:
            raise SolverBreakdown(f"velocity too large (|v| = {vmax:.3g}): the CFL step "
                                  f"{dt_cfl:.3g} would need more than {MAX_STEPS_PER_LAYER} "
                                  "steps in this layer")
        return max(1, math.ceil(n - 1e-9))

    def _taped(self, summed):
        """What the tape keeps of an evaluation: its TableSum while the prompt's tape has
        room (``[attention] tape_mb``; the sizes agree on every rank, so do the choices), else
        its plan."""
        if not isinstance(summed, TableSum):
            return summed
        if summed.nbytes > self._tape_room:
            return summed.plan
        self._tape_room -= summed.nbytes
        return summed

    def _step(self, state, dt, layer, first, tape=None):
        """One SSP step; ``first`` = (velocity, kernel plan) of the first stage, already
        computed for the step size and set as the transport velocity (next_step does both
        just before the step)."""
        tr = self.transport
        limiter = self.disc.limiter
        stages, limits = [], []

        def rhs(Y, j):
            if j > 0:
                vel, plan = self.velocity(Y[0], layer), self.velocity_field.last_sum
            else:       # set as the transport velocity by next_step, just before this step
                vel, plan = first
            with self.timer.phase("transport"):
                tr.set_state(Y[0])
                du, rate = tr.rate()
            if tape is not None:        # with the ghosts the forms read: the adjoint sets them back
                stages.append((Y[0], vel, self._taped(plan), tr.ghost_values()))
            return [du, np.array([rate])]

        def limit(Y):
            if not limiter:
                return Y
            with self.timer.phase("limiter"):
                return [tr.limit(Y[0], limits if tape is not None else None), Y[1]]

        new = ssp_step(self.scheme, state, dt, rhs, limit)
        if tape is not None:
            tape.append((layer, dt, stages, limits if limiter else None))
        return new

    # ------------------------------------------------------------ diagnostics
    def diagnostics(self, frame: Frame) -> dict:
        """mass, outflow, min rho and moments of the normalised density at a frame (and on
        a circle or sphere, ``extras``: its order parameter and Fourier amplitudes)."""
        with self.timer.phase("diagnostics"):
            s = self.transport.summary(frame.coeffs, self.centre)
            return {"prompt": frame.prompt, "t": frame.t, "mass": s["mass"], "outflow": frame.outflow,
                    "min_rho": self.transport.min_value(frame.coeffs), "mean": s["mean"], "cov": s["cov"],
                    "negative_mass": s["negative_mass"],
                    "extras": self.transport.order_parameter(frame.coeffs, self.problem.geometry)}
