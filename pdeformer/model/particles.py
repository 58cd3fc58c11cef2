r"""The particle (Lagrangian) counterpart: a finite transformer with N tokens.

Each prompt is replaced by N tokens x_i sampled from it, with weights w_i = 1/N (a
point-cloud prompt, ``kind = "points"``, is its own tokens and weights), and

.. math::

    \frac{d x_i}{dt} = v_t\Big[\sum_j w_j \delta_{x_j}\Big](x_i)
                    = \frac1H \sum_h V_h \frac{\sum_j w_j e^{\langle A_h x_i, x_j\rangle} x_j}
                                              {\sum_j w_j e^{\langle A_h x_i, x_j\rangle}},

the same kernel, heads and SSP scheme as the Eulerian solver, with a fixed number of
steps per layer (``[particles] steps_per_layer``, default
``discretisation.steps_per_layer`` or 10). Tokens are drawn from the seeded stream
(``particles.seed``, TOKEN_STREAM, prompt index), so they are the same for any number of ranks; each
rank moves its own block of tokens (the targets) and sees all of them as sources. With
prompt groups a prompt's tokens are dealt over the ranks of the group that owns it. Tokens
live in R^d: none leave, so ``mass`` is 1 and ``outflow`` 0 in diagnostics.csv, and
``min_rho`` (a density minimum) is not defined (nan).

On a circle or sphere (``[mesh] shape``, or a mesh file of one: docs/sphere.md) the
tokens are drawn on it, the velocity is its tangential part, and every stage of the
scheme is followed by the renormalisation x <- R x / |x| (differentiated in the
adjoint); diagnostics.csv gains the order parameter (and on a circle the Fourier
amplitudes), as for the mesh model.

Gradients (:class:`ParticleAdjoint`) are the exact discrete adjoint of this ODE system
(positions and head cotangents through the reverse mode of the sum each forward stage
made: direct summation, or the laplace table with its plan recorded on the tape).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
from mpi4py import MPI

from ..tools.datasets import chosen_prompts, readdressed
from ..tools.errors import ConfigError, InputError, SolverBreakdown
from ..tools.keys import Key, boolean, integer
from ..integrator.frames import Frame, Tracker, located
from .params import Gradient, leaves, tree_map
from ..integrator.march import FixedSteps, march, sweep_back, tape_nbytes
from .objectives import OBJECTIVES
from ..tools.parallel import Timer, allgather_rows, any_rank, moment_sums, on_root
from ..integrator.schemes import SCHEMES, ssp_step, ssp_step_vjp
from .terms import VelocityField
from .velocity import AttentionVelocity

log = logging.getLogger("pdeformer")

# The tokens' random stream is (particles.seed, TOKEN_STREAM, prompt index). The tag keeps
# it apart from the heads' streams (model.seed, layer, head) and (model.seed, 2^20, head),
# which an untagged (seed, index) would meet where the seeds coincide (numpy pads a seed
# sequence with zeros: (s, 0) and (s, 0, 0) are one stream), e.g. across the members of
# an ensemble that offsets both seeds.
TOKEN_STREAM = 0x746F6B656E     # "token"

PARTICLE_STEPS_PER_LAYER = 10    # [particles] steps_per_layer where neither section sets it

# The [particles] table
PARTICLES_KEYS = {
    "tokens": Key(integer(1, 10**8), 10000, "tokens N sampled from each prompt"),
    "seed": Key(integer(0, 2**63 - 1), 0, "seed of the token samples"),
    "steps_per_layer": Key(integer(1, 10**7), None,
                           "steps per layer (default: discretisation.steps_per_layer or "
                           f"{PARTICLE_STEPS_PER_LAYER})"),
    "points": Key(boolean, True, "write the tokens at every layer boundary (tokens_<prompt>.pvd)"),
}


def weighted_moments(comm, x: np.ndarray, w: np.ndarray, centre: np.ndarray):
    """Total weight, mean and covariance of weighted points (all ranks)."""
    W, m1, m2, _ = moment_sums(comm, w, x - centre)
    first = m1 / W
    return float(W), centre + first, m2 / W - np.outer(first, first)


class ParticleSolver:
    """Moves the tokens of every prompt through the L layers (fixed steps)."""

    def __init__(self, problem, timer: Timer | None = None, backend: str | None = None):
        self.problem = problem
        self.comm = problem.comm
        self.timer = timer or Timer()
        opts = problem.opts
        self.geometry = problem.geometry     # the space the mesh discretises (model/geometry.py)
        self.disc = opts.discretisation
        pc = opts.particles
        self.tokens = pc.tokens
        self.seed = pc.seed
        self.steps_per_layer = pc.steps_per_layer or self.disc.steps_per_layer or PARTICLE_STEPS_PER_LAYER
        self.frames_per_layer = opts.output.frames_per_layer
        if self.steps_per_layer % self.frames_per_layer:
            raise ConfigError("output.frames_per_layer",
                              f"{self.frames_per_layer} does not divide the particle steps per "
                              f"layer ({self.steps_per_layer})")
        self.scheme = SCHEMES[self.disc.scheme]
        attention = dataclasses.replace(opts.attention, **({"backend": backend} if backend else {}))
        self.velocity_field = VelocityField(AttentionVelocity(None, problem.heads, attention, self.comm,
                                                              self.geometry, costs=problem.context.costs),
                                            problem.terms)
        self.stats = {"steps": 0, "velocity_evaluations": 0}
        self.current_prompt, self.evaluations = None, 0   # set per prompt (laplace plan keys)
        self.prompt_info = [{"name": n, "tokens": len(p.points) if p.kind == "points" else self.tokens}
                            for n, p in problem.prompts]

    def describe(self) -> str:
        """The token counts that run (a point cloud is its own points, the others
        [particles] tokens) and the steps."""
        counts = [info["tokens"] for info in self.prompt_info]
        tokens = f"{counts[0]} tokens" if len(set(counts)) == 1 else \
            f"{'/'.join(map(str, counts))} tokens (per prompt)"
        return f"{tokens}, {self.steps_per_layer} steps/layer"

    # ------------------------------------------------------------ tokens
    def initial_tokens(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's block of the N tokens of prompt ``index`` and their weights 1/N.
        All ranks draw the same N tokens (stream (seed, TOKEN_STREAM, index)) and keep their block.
        A point-cloud prompt is its own tokens, with its weights."""
        prompt = self.problem.prompts[index][1]
        if prompt.kind == "points":
            x, w = prompt.points, prompt.weights
        else:
            name, data = self.problem.prompts[index][0], self.problem.opts.data
            try:
                x = prompt.sample(self.tokens, np.random.default_rng([self.seed, TOKEN_STREAM, index]))
            except InputError as e:
                raise readdressed(InputError(f"prompts[{index}]: {e}"), data, self.problem.opts.prompts,
                                  name) from None
            w = np.full(self.tokens, 1.0 / self.tokens)
        x = self.geometry.project(x)    # on the sphere exactly (point clouds too)
        block = np.array_split(np.arange(len(w)), self.comm.size)[self.comm.rank]
        return np.ascontiguousarray(x[block]), np.ascontiguousarray(w[block])

    def velocity(self, x: np.ndarray, w: np.ndarray, layer: int) -> np.ndarray:
        with self.timer.phase("velocity"):
            v = self.velocity_field(x, w, layer, targets=x, key=(self.current_prompt, layer),
                                    step=(self.current_prompt, self.evaluations))
            self.evaluations += 1
        self.stats["velocity_evaluations"] += 1
        if any_rank(self.comm, not np.all(np.isfinite(v))):
            raise SolverBreakdown("the velocity is NaN or overflows")
        return v

    # ------------------------------------------------------------ the loop
    def run(self, trackers=()) -> list[dict]:
        for tr in trackers:
            tr.start(self)
        try:
            for i in self.problem.groups.owned:   # this group's prompts
                self.solve_prompt(i, trackers)
        finally:
            for tr in trackers:
                tr.finish(self)
        return self.prompt_info

    def solve_prompt(self, index: int, trackers=(), tape: list | None = None):
        """Move the tokens of prompt ``index`` from t = 0 to 1; returns (x, w) of this
        rank's tokens. ``tape`` collects (layer, dt, stage positions) for the adjoint."""
        name = self.problem.prompts[index][0]
        self.current_prompt, self.evaluations = index, 0   # keys of the laplace plans
        L, F = self.problem.heads.layers, self.frames_per_layer
        x, w = self.initial_tokens(index)
        dt = 1.0 / (L * self.steps_per_layer)
        steps = FixedSteps(self.steps_per_layer // F, dt)
        taken = 0

        def step(t, dt, layer):
            nonlocal x, taken
            with located(f"prompt {name!r}, layer {layer}, t = {t:.6g}"):
                x = self._step(x, w, dt, layer, tape)
            taken += 1

        def emit(t, layer, boundary):
            frame = Frame(name, index, t, layer, boundary, taken, dt if taken else math.nan, x, 0.0)
            frame.extra["weights"] = w
            with self.timer.phase("output"):
                for tr in trackers:
                    tr.frame(self, frame)

        march(L, F, steps, step, emit)
        self.stats["steps"] += taken
        self.prompt_info[index]["steps"] = taken
        return x, w

    def _step(self, x, w, dt, layer, tape):
        """One step; on the sphere each stage renormalised (the tape keeps, per stage, its
        positions, plan and -- on the sphere -- velocity, radial part of the unprojected
        one and the stage before renormalising)."""
        stages = []

        def rhs(Y, j):
            v = self.velocity(Y[0], w, layer)
            if tape is not None:
                stages.append([Y[0], self.velocity_field.last_plan, v, self.velocity_field.last_radial])
            return [v]

        def renormalise(Y):
            if tape is not None:
                stages[-1].append(Y[0])
            return [self.geometry.project(Y[0])]

        new = ssp_step(self.scheme, [x], dt, rhs, renormalise if self.geometry.projects else None)[0]
        if tape is not None:
            tape.append((layer, dt, stages))
        if any_rank(self.comm, not np.all(np.isfinite(new))):
            raise SolverBreakdown("the token positions are NaN or overflow")
        return new

    # ------------------------------------------------------------ diagnostics
    def diagnostics(self, frame: Frame) -> dict:
        """The forward columns for tokens: weighted moments (mass 1, outflow 0, min_rho nan)."""
        mass, mean, cov = weighted_moments(self.comm, frame.coeffs, frame.extra["weights"],
                                           np.zeros(frame.coeffs.shape[1]))
        extras = self.geometry.order_parameter(frame.coeffs, frame.extra["weights"], self.comm)
        return {"prompt": frame.prompt, "t": frame.t, "mass": mass, "outflow": 0.0,
                "min_rho": math.nan, "mean": mean, "cov": cov, "extras": extras}


class TokenOutput(Tracker):
    """tokens_<prompt>.pvd + tokens_<prompt>_XXXX.vtu: the tokens at every layer boundary
    (rank 0 gathers them), point data ``weight``."""

    def __init__(self, folder: str):
        self.folder = folder
        self.frames: dict[str, list] = {}
        self.files: list[str] = []

    def frame(self, solver, frame):
        if not frame.layer_boundary:
            return
        x = allgather_rows(solver.comm, frame.coeffs)
        w = allgather_rows(solver.comm, frame.extra["weights"])
        on_root(solver.comm, self._write, frame, x, w)   # a failed write ends every rank

    def _write(self, frame, x, w):
        import os
        from ..tools.output import write_points, write_pvd
        k = len(self.frames.setdefault(frame.prompt, []))
        name = f"tokens_{frame.prompt}_{k:04d}.vtu"
        write_points(os.path.join(self.folder, name), x, {"weight": w})
        self.frames[frame.prompt].append((frame.t, name))
        pvd = f"tokens_{frame.prompt}.pvd"
        write_pvd(os.path.join(self.folder, pvd), self.frames[frame.prompt])
        if pvd not in self.files:
            self.files.append(pvd)


class ParticleAdjoint:
    """Risk and its exact gradient for the particle model (either backend)."""

    def __init__(self, solver: ParticleSolver, objective, targets: list):
        self.check(solver, objective)
        self.solver = solver
        self.objective = objective
        self.targets = [self._prepare(t, i) for i, t in enumerate(targets)]
        solver.velocity_field.freeze = True     # one discrete map per gradient evaluation

    @staticmethod
    def check(solver: ParticleSolver, objective) -> None:
        """The objective takes tokens (ConfigError otherwise), and its options fit the mesh."""
        if not hasattr(objective, "particle_value_and_gradient"):
            tokens = [k for k, c in OBJECTIVES.items() if hasattr(c, "particle_value_and_gradient")]
            raise ConfigError("objective.kind", f"{objective.kind!r} needs a density; tokens support "
                              f"{', '.join(tokens)}")
        if objective.checks_mesh:   # e.g. an mmd bandwidth on the scale of the tokens' domain
            solver.problem.check_on_mesh(objective)

    def _prepare(self, target, index):
        """Density targets of mmd become tokens sampled like the prompts' (seeded)."""
        if target is None or target["kind"] in ("moments", "points"):
            return target
        rng = np.random.default_rng([self.solver.seed, 10**6 + index])
        z = target["density"].sample(self.solver.tokens, rng)
        return dict(target, samples=(z, np.full(len(z), 1.0 / len(z))))

    def risk(self, prompts: list[int] | None = None) -> tuple[float, list]:
        """The particle risk over ``prompts`` (default: the training prompts)."""
        groups = self.solver.problem.groups
        chosen = chosen_prompts(self.solver.problem, prompts)
        wanted = set(chosen)   # (a set: data sets have 10^5 prompts)
        local = {}
        with groups.combined():
            for s in groups.owned:
                if s in wanted:
                    x, w = self.solver.solve_prompt(s)
                    local[s] = self._finite(s, self.objective.particle_value_and_gradient(
                        x, w, self.targets[s], self.solver.comm))[0]
        risks = groups.gather_prompts(local)
        risks = [risks[s] for s in chosen]
        return float(np.mean(risks)), risks

    def gradient(self, prompts: list[int] | None = None):
        """The particle risk over ``prompts`` (default: the training prompts) and its
        gradient."""
        sv = self.solver
        groups = sv.problem.groups
        chosen = chosen_prompts(sv.problem, prompts)
        wanted = set(chosen)   # (a set: data sets have 10^5 prompts)
        acc = sv.velocity_field.zero_cotangent()
        local, tape_bytes = {}, 0
        sv.velocity_field.refreeze()
        with groups.combined():
            for s in groups.owned:
                if s not in wanted:
                    continue
                tape = []
                x, w = sv.solve_prompt(s, tape=tape)
                tape_bytes = max(tape_bytes, tape_nbytes(tape))
                F, lam = self._finite(s, self.objective.particle_value_and_gradient(
                    x, w, self.targets[s], sv.comm))
                local[s] = F

                def step_vjp(lam, layer, dt, stages):
                    return self._step_vjp(lam, w, layer, dt, stages, acc)
                sweep_back(tape, lam, step_vjp)
        risks = groups.gather_prompts(local)
        for _, a in leaves(acc):   # every rank's share, summed over all groups
            groups.world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        S = len(chosen)
        grads = sv.velocity_field.parameter_gradient(tree_map(lambda a: a / S, acc))
        return Gradient(float(np.mean([risks[s] for s in chosen])), [risks[s] for s in chosen],
                        grads, tape_bytes, chosen)

    def _finite(self, index: int, value_gradient):
        """(F, dF/dx) of prompt ``index``; a breakdown where F (the same on every rank)
        is not finite."""
        F = value_gradient[0]
        if not np.isfinite(F):
            raise SolverBreakdown(f"the objective {self.objective.kind!r} of prompt "
                                  f"{self.solver.problem.prompts[index][0]!r} at t = 1 is {F}")
        return value_gradient

    def _step_vjp(self, lam, w, layer, dt, stages, acc):
        geometry = self.solver.geometry
        renormalise_vjp = (lambda i, Ybar: geometry.project_vjp(stages[i - 1][4], Ybar)) \
            if geometry.projects else None      # stage i from rhs i-1
        return ssp_step_vjp(self.solver.scheme, lam, dt,
                            lambda j, Lbar: self._rate_vjp(stages[j], w, layer, Lbar, acc),
                            renormalise_vjp)

    def _rate_vjp(self, stage, w, layer, g, acc):
        """Cotangent of the positions for the cotangent g of v(x) (targets and sources
        are the same tokens: both parts add up), through the sum the forward stage made
        (its laplace plan, or direct summation)."""
        x, plan, v, radial = stage[:4]
        sv = self.solver
        with sv.timer.phase("adjoint velocity"):
            ct = sv.velocity_field.vjp(x, w, layer, g, plan, targets=x, positions=True)
        sv.velocity_field.add_cotangent(acc, layer, ct)
        # and through the projection P_x, which moves with the targets (flat: 0)
        return ct.targets + ct.points + sv.geometry.tangential_position_vjp(x, v, radial, g)
