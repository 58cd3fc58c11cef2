r"""The forward pass: token densities of every prompt transported through L layers.

Per prompt s, on t in [0, 1] (design §1):

.. math::

    \partial_t \rho + \nabla\cdot(\rho\, v_t[\rho]) = 0, \qquad
    v_t[\rho](x) = \frac1H \sum_h V_h \nabla\Lambda_\rho(A_h x), \qquad \rho(0) = \rho_0^s,

discretised by :class:`~pdeformer.transport.DGTransport` in space and an SSP
Runge-Kutta scheme in depth. The step is either CFL-based (recomputed every step
from the current velocity, then shortened so that steps land exactly on every frame
and layer boundary) or fixed (``steps_per_layer``, so the discrete solution is a
smooth function of the head parameters). :class:`ForwardSolver` owns the loop;
everything that watches it -- progress, diagnostics, fields -- is a tracker.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import ufl
from mpi4py import MPI

from .errors import ConfigError, InputError, SolverBreakdown
from .heads import HeadMeasure
from .mesh import bounding_box, make_mesh
from .parallel import PromptGroups, Timer, any_rank, on_root
from .objectives import make_objective, make_target
from .prompts import make_prompt
from .timestepping import SCHEMES, ssp_step
from .transport import DGTransport
from .velocity import AttentionVelocity, TableSum

log = logging.getLogger("pdeformer")

MAX_STEPS_PER_LAYER = 200_000


@contextmanager
def located(where: str):
    """Prefix a breakdown raised inside with where it happened (prompt, layer, t)."""
    try:
        yield where
    except SolverBreakdown as e:
        raise SolverBreakdown(f"{where}: {e}") from None


@dataclass
class Problem:
    """What is solved: mesh, heads and prompts of a checked configuration.

    ``comm`` is the communicator of this rank's prompt group (the world without prompt
    groups): the mesh is partitioned over it and every collective of the group's work
    uses it. ``groups`` (:class:`~pdeformer.parallel.PromptGroups`) says which prompts
    this group solves (``groups.owned``) and combines results over the world."""

    comm: object
    cfg: dict
    mesh: object
    heads: HeadMeasure
    prompts: list  # [(name, density object)]
    objective: object = None   # pdeformer.objectives.* or None
    targets: list = None       # per prompt (None where the objective needs none)
    groups: PromptGroups = None  # default: one group of all ranks of comm

    def __post_init__(self):
        if self.groups is None:
            self.groups = PromptGroups.single(self.comm, [n for n, _ in self.prompts])

    @property
    def dim(self) -> int:
        return self.mesh.topology.dim


def build_heads(comm, model: dict, d: int) -> HeadMeasure:
    if model["params"] is not None:
        heads = on_root(comm, HeadMeasure.load, model["params"], d, model["layers"],
                        model["heads"], model["key_dim"])
        model.update(layers=heads.layers, heads=heads.heads, key_dim=heads.key_dim)
        return heads
    if model["key_dim"] is None:
        model["key_dim"] = d
    return HeadMeasure.random(model["layers"], model["heads"], model["key_dim"], d,
                              seed=model["seed"], scale=model["init_scale"],
                              query_scale=model["query_scale"], depth=model["depth"])


def build_problem(cfg: dict, comm, differentiable: bool = False,
                  groups: PromptGroups | None = None) -> Problem:
    """Mesh, heads, prompts (and objective, targets) of a checked configuration.
    ``differentiable``: the run takes gradients (gradient, train), so the discrete
    forward map must be smooth in the heads. With ``groups`` the mesh is built on this
    rank's group communicator (``groups.comm``) and ``comm`` is not used."""
    if groups is not None:
        comm = groups.comm
    disc, out = cfg["discretisation"], cfg["output"]
    objective = make_objective(cfg["objective"])
    if differentiable:
        if objective is None:
            raise ConfigError("objective.kind", "missing: gradient and train need an [objective]")
        if disc["limiter"]:
            raise ConfigError("discretisation.limiter", "the limiter is not differentiable: set it "
                              "false for gradient and train runs")
    mesh = make_mesh(comm, cfg["mesh"])
    d = mesh.topology.dim
    heads = build_heads(comm, cfg["model"], d)
    prompts = on_root(comm, lambda: [(p["name"], make_prompt(p, d, i))
                                     for i, p in enumerate(cfg["prompts"])])
    targets = on_root(comm, lambda: [make_target(p["target"], d, i)
                                     for i, p in enumerate(cfg["prompts"])])
    obj_cfg = cfg["objective"]
    for key in ("center", "direction"):
        if obj_cfg[key] is not None and len(obj_cfg[key]) != d:
            raise ConfigError(f"objective.{key}", f"expected {d} numbers (d = {d}), got {obj_cfg[key]}")
    if objective is not None and objective.kind == "potential" and obj_cfg["center"] is None:
        objective.center = np.zeros(d)
    spl = disc["steps_per_layer"]
    if spl is not None and spl % out["frames_per_layer"]:
        raise ConfigError("output.frames_per_layer",
                          f"{out['frames_per_layer']} does not divide discretisation.steps_per_layer = {spl}")
    return Problem(comm, cfg, mesh, heads, prompts, objective, targets, groups)


@dataclass
class Frame:
    """The state of one prompt at an output time (t = 0 or the end of a frame)."""

    prompt: str
    prompt_index: int
    t: float
    layer: int            # layer in which the frame ends (-1 at t = 0)
    layer_boundary: bool
    steps: int            # steps taken so far for this prompt
    dt: float             # last step size (nan at t = 0)
    coeffs: np.ndarray
    outflow: float
    velocity: np.ndarray | None = None  # owned velocity nodes; heads of the layer holding t
                                        # (at a layer boundary: the layer starting there)
    extra: dict = field(default_factory=dict)


class Tracker:
    """Watches a forward run: ``start`` once, ``frame`` at t = 0 and every frame end,
    ``finish`` once. Set ``needs_velocity`` to get the velocity in every frame."""

    needs_velocity = False

    def start(self, solver: "ForwardSolver") -> None:
        pass

    def frame(self, solver: "ForwardSolver", frame: Frame) -> None:
        pass

    def finish(self, solver: "ForwardSolver") -> None:
        pass


class ForwardSolver:
    def __init__(self, problem: Problem, timer: Timer | None = None):
        self.problem = problem
        self.comm = problem.comm
        self.timer = timer or Timer()
        cfg = problem.cfg
        disc = cfg["discretisation"]
        self.disc = disc
        self.frames_per_layer = cfg["output"]["frames_per_layer"]
        with self.timer.phase("setup"):
            self.transport = DGTransport(problem.mesh, disc["degree"], disc["velocity_degree"],
                                         disc["quadrature_degree"], cfg["petsc"], comm=self.comm)
            self.velocity_field = AttentionVelocity.on_space(self.transport.W, problem.heads,
                                                             cfg["attention"], self.comm)
        self.scheme = SCHEMES[disc["scheme"]]
        # uniform steps per frame with counts frozen at the frame's start (gradients need
        # a step plan that does not move with the heads); step_counts can be preset
        self.freeze_steps = False
        self.step_counts: dict[tuple[int, int, int], int] = {}  # (prompt, layer, frame) -> n
        self.centre = np.mean(bounding_box(self.comm, problem.mesh), axis=0)
        self.stats = {"steps": 0, "velocity_evaluations": 0}
        self.current_prompt = None   # the prompt being solved (it keys the laplace plans)
        self.evaluations = 0         # velocity evaluations of it so far (frozen plans)
        self._tape_room = 0          # bytes of tables the current tape may still keep
        for i, (name, prompt) in enumerate(problem.prompts):
            if prompt.kind == "points":
                raise ConfigError(f"prompts[{i}].kind", f"{name!r} is a point cloud, which has no "
                                  "density to put on a mesh: use it with particles or ntk")
        # every prompt of this group is projected (and checked) before anything runs or is
        # written; the other groups' prompts are None here (their info: just the name)
        with self.timer.phase("prompts"):
            initial = {i: self.initial_state(i) for i in problem.groups.owned}
        self.initial_coeffs = [initial[i][0] if i in initial else None
                               for i in range(len(problem.prompts))]
        self.prompt_info = [initial[i][1] if i in initial else {"name": name}
                            for i, (name, _) in enumerate(problem.prompts)]

    def describe(self) -> str:
        return f"DG-{self.disc['degree']}"

    # ------------------------------------------------------------ building blocks
    def initial_state(self, index: int) -> tuple[np.ndarray, dict]:
        """rho_0 projected onto DG-k and normalised to mass 1 on the mesh."""
        name, prompt = self.problem.prompts[index]
        tr = self.transport
        disc = self.disc
        x = ufl.SpatialCoordinate(self.problem.mesh)
        if prompt.ufl_density is not None:
            rho0 = prompt.ufl_density(x, tr.constant)
        else:
            rho0 = tr.interpolant(prompt.density, disc["degree"] + 2)
        coeffs, mass = tr.project(rho0, disc["prompt_quadrature_degree"])
        key = f"prompts[{index}]"
        if prompt.kind == "uniform" and self.problem.cfg["mesh"]["file"] is None:
            # the indicator's quadrature on cut cells is inexact; on a box mesh the
            # truncation is known exactly
            truncated = 1.0 - prompt.mass_inside(*bounding_box(self.comm, self.problem.mesh))
        else:
            truncated = 1.0 - mass / prompt.total_mass()
        if not (mass > 0 and truncated < 0.5):
            raise InputError(f"{key} ({name!r}): the prompt lies outside the mesh "
                             f"(only {max(0.0, 1 - truncated):.3g} of its mass is on it)")
        if truncated > disc["tail_tolerance"] and self.comm.rank == 0:
            log.warning("warning: %s (%r): %.3g of its mass lies outside the mesh and is cut off",
                        key, name, truncated)
        coeffs /= mass
        if disc["limiter"]:
            coeffs = tr.limit(coeffs)
        return coeffs, {"name": name, "mass_on_mesh": mass, "truncated_mass": truncated}

    def velocity(self, coeffs: np.ndarray, layer: int) -> np.ndarray:
        """Attention velocity of ``layer`` for density ``coeffs``; also set as the
        transport velocity. Returns the owned node values; NaN or overflow is a breakdown.
        Laplace tables are planned per (prompt, layer): each keeps its own sizes."""
        tr = self.transport
        with self.timer.phase("velocity"):
            tr.set_state(coeffs)
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

        With ``tape`` (a list), every step appends ``(layer, dt, stages)``, stages being
        the (density, velocity) pairs at which the scheme evaluated its right-hand side:
        what the adjoint sweep needs."""
        name = self.problem.prompts[index][0]
        self.current_prompt, self.evaluations = index, 0
        self._tape_room = self.velocity_field.tape_mb * 2 ** 20 if tape is not None else 0
        L, F = self.problem.heads.layers, self.frames_per_layer
        want_v = any(tr.needs_velocity for tr in trackers)
        state = [self.initial_coeffs[index].copy(), np.zeros(1)]
        march = {"steps": 0, "dt": math.nan}
        cache = None  # (state, layer, velocity, plan): the next step's first stage reuses it

        def emit(t, layer, boundary):
            nonlocal cache
            vel, failure = None, None
            if want_v:  # heads of the layer holding t (at a layer end: the next layer)
                at = min(layer + 1, L - 1) if boundary else layer
                try:
                    with located(f"prompt {name!r}, layer {at}, t = {t:.6g}"):
                        vel = self.velocity(state[0], at)
                    cache = (state, at, vel, self.velocity_field.last_sum)
                except SolverBreakdown as e:  # still record the density, then stop
                    failure = e
            frame = Frame(name, index, t, layer, boundary, march["steps"], march["dt"],
                          state[0], self._outflow(state), vel)
            with self.timer.phase("output"):
                for tr in trackers:
                    if failure is None or not tr.needs_velocity:
                        tr.frame(self, frame)
            if failure is not None:
                raise failure

        emit(0.0, -1, True)
        t = 0.0
        for layer in range(L):
            layer_steps, warned = 0, False
            for f in range(1, F + 1):
                t_end = (layer + f / F) / L
                frame_steps = 0
                n_frame = self._fixed_frame_steps(index, layer, f)
                while t < t_end:
                    with located(f"prompt {name!r}, layer {layer}, t = {t:.6g}") as where:
                        if cache is not None and cache[0] is state and cache[1] == layer:
                            vel0, plan0 = cache[2], cache[3]
                            self.transport.set_velocity(vel0)
                        else:
                            vel0 = self.velocity(state[0], layer)
                            plan0 = self.velocity_field.last_sum
                        dt_cfl, vmax = self.transport.cfl_step(self.disc["cfl"] * self.scheme.cfl_factor)
                        if n_frame is None and self.freeze_steps:  # uniform steps, count frozen now
                            n_frame = self._cfl_steps(t_end - t, dt_cfl, vmax, layer_steps)
                            self.step_counts[(index, layer, f)] = n_frame
                        n_left = (n_frame - frame_steps if n_frame is not None
                                  else self._cfl_steps(t_end - t, dt_cfl, vmax, layer_steps))
                        dt = (t_end - t) / n_left
                        # fixed or frozen steps: warn past cfl = 1, about the stability limit
                        if dt * self.disc["cfl"] > dt_cfl and not warned:
                            warned = True
                            if self.comm.rank == 0:
                                log.warning("warning: %s: the fixed step %.3g is past the stability "
                                            "limit (cfl 1 at |v| = %.3g); raise steps_per_layer",
                                            where, dt, vmax)
                        state = self._step(state, dt, layer, (vel0, plan0), tape)
                        if any_rank(self.comm, not np.all(np.isfinite(state[0]))):
                            raise SolverBreakdown("the density is NaN or overflows after this step")
                    frame_steps += 1
                    layer_steps += 1
                    march["steps"] += 1
                    march["dt"] = dt
                    t = t_end if n_left == 1 else t + dt
                emit(t, layer, f == F)
        self.prompt_info[index]["steps"] = march["steps"]
        self.stats["steps"] += march["steps"]
        return state[0], self._outflow(state)

    def _outflow(self, state) -> float:
        """The mass that has left the mesh: each rank integrates its own boundary's part."""
        return float(self.comm.allreduce(float(state[1][0]), op=MPI.SUM))

    def _fixed_frame_steps(self, index: int, layer: int, frame: int) -> int | None:
        """Steps of a frame when they are fixed: steps_per_layer, or a frozen plan."""
        spl = self.disc["steps_per_layer"]
        if spl is not None:
            return spl // self.frames_per_layer
        if self.freeze_steps:
            return self.step_counts.get((index, layer, frame))
        return None

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
        computed for the step size."""
        tr = self.transport
        limiter = self.disc["limiter"]
        stages = []

        def rhs(Y, j):
            if j > 0:
                vel, plan = self.velocity(Y[0], layer), self.velocity_field.last_sum
            else:
                vel, plan = first
                tr.set_velocity(vel)
            if tape is not None:
                stages.append((Y[0], vel, self._taped(plan)))
            with self.timer.phase("transport"):
                tr.set_state(Y[0])
                du, rate = tr.rate()
            return [du, np.array([rate])]

        def limit(Y):
            if not limiter:
                return Y
            with self.timer.phase("limiter"):
                return [tr.limit(Y[0]), Y[1]]

        new = ssp_step(self.scheme, state, dt, rhs, limit)
        if tape is not None:
            tape.append((layer, dt, stages))
        return new

    # ------------------------------------------------------------ diagnostics
    def diagnostics(self, frame: Frame) -> dict:
        """mass, outflow, min rho and moments of the normalised density at a frame."""
        with self.timer.phase("diagnostics"):
            mass, mean, cov = self.transport.moments(frame.coeffs, self.centre)
            return {"prompt": frame.prompt, "t": frame.t, "mass": mass, "outflow": frame.outflow,
                    "min_rho": self.transport.min_value(frame.coeffs), "mean": mean, "cov": cov}
