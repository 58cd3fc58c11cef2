"""solve and value_and_grad: the API's two functions, and the Solution they return.

Both build the problem from the API's objects (:mod:`pdeformer.api.objects`) through the
run configuration's checks, and run under ``mpirun`` unchanged: the mesh is partitioned
over ``comm`` (default MPI.COMM_WORLD), and every result is the same on every rank.
``solve`` takes the steps a gradient takes (a step plan frozen per frame, decided by
the CFL condition at its start), so that a solved prompt and ``value_and_grad`` see one
discrete map of the heads.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from ..model.particles import ParticleAdjoint, ParticleSolver, TokenOutput
from ..solvers.adjoint import AdjointSolver
from ..solvers.forward import ForwardSolver, Tracker
from ..solvers.problem import build_problem
from ..solvers.snapshots import FieldSnapshots, MeshCells, TokenSnapshots
from ..solvers.trackers import FieldOutput, frame_diagnostics
from ..model.config import check_config
from .objects import DG, Objective, Particles, Prompt, Transformer


def _prompt_list(prompts) -> tuple[list, bool]:
    """(prompts as a list, whether one was given)."""
    if isinstance(prompts, Prompt):
        return [prompts], True
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, Prompt) for p in prompts):
        from ..tools.errors import ConfigError
        raise ConfigError("prompts", "expected a prompt object (pf.GaussianMixture, ...) or a list of them")
    return prompts, False


def problem_config(model: Transformer, prompts: list, disc, objective: Objective | None = None, *,
                   frames_per_layer: int = 1, backend: str = "auto", tol: float = 1e-8,
                   attention: dict | None = None, train: dict | None = None) -> dict:
    """The checked run configuration the objects stand for (its errors name the
    configuration key an argument stands for: prompts[i].covs, discretisation.degree)."""
    tables = []
    for p in prompts:
        t = p.table()
        if objective is not None and objective.target() is not None:
            t["target"] = objective.target()
        tables.append(t)
    sections = disc.sections(prompts) if isinstance(disc, Particles) else disc.sections()
    raw = {**sections,
           "model": {"layers": model.layers, "heads": model.heads, "key_dim": model.key_dim, **model.options},
           "attention": {"backend": backend, "tol": tol, "beta": model.beta, **(attention or {})},
           "output": {"fields": False, "plots": False, "frames_per_layer": frames_per_layer},
           "prompts": tables}
    if objective is not None:
        raw["objective"] = objective.section()
    if train is not None:
        raw["train"] = train
    return check_config(raw, os.getcwd(), "api")


def _solver(model, prompts, disc, objective, comm, differentiable, **options):
    """(problem, solver) of the objects on ``comm``."""
    if not isinstance(disc, (DG, Particles)):
        from ..tools.errors import ConfigError
        raise ConfigError("discretisation", "expected pf.DG(mesh, ...) or pf.Particles(...)")
    cfg = problem_config(model, prompts, disc, objective, **options)
    particles = isinstance(disc, Particles)
    problem = build_problem(cfg, comm or MPI.COMM_WORLD, differentiable and not particles,
                            params=model.problem_params())
    solver = ParticleSolver(problem) if particles else ForwardSolver(problem)
    return problem, solver


class _Frames(Tracker):
    """Keeps the diagnostics of every frame of every prompt and a copy of its state:
    of every frame (``every``), else of the last (t = 1) only."""

    def __init__(self, every: bool = True):
        self.every = every
        self.frames: dict[int, list] = {}
        self.rows: dict[int, list] = {}

    def frame(self, solver, frame):
        row = frame_diagnostics(solver, frame)    # every rank takes part
        self.rows.setdefault(frame.prompt_index, []).append(row)
        if self.every or (frame.layer_boundary and frame.t == 1.0):
            frame.coeffs = np.array(frame.coeffs)
            self.frames.setdefault(frame.prompt_index, []).append(frame)


def solve(model: Transformer, prompt, disc, *, frames_per_layer: int = 1, backend: str = "auto",
          tol: float = 1e-8, comm=None):
    """Transport ``prompt`` (or each prompt of a list) through the layers of ``model``:

        d/dt rho + div(rho v_t[rho]) = 0,  t in [0, 1],  rho(0) = the prompt,

    on ``disc`` (pf.DG: the density on a mesh; pf.Particles: tokens moved by the same
    velocity).

    Parameters
    ----------
    model : pf.Transformer
    prompt : a prompt object, or a list of them
    disc : pf.DG or pf.Particles
    frames_per_layer : int
        Frames per layer besides t = 0 (the frames of the solution).
    backend : str
        How the attention is summed: "direct", "laplace" or "auto".
    tol : float
        The accuracy of a laplace table.
    comm : MPI communicator
        The communicator the mesh is partitioned over (default MPI.COMM_WORLD).

    Returns
    -------
    Solution, or a list of them for a list of prompts
        Arrays over the frames.
    """
    prompts, one = _prompt_list(prompt)
    problem, solver = _solver(model, prompts, disc, None, comm, False, frames_per_layer=frames_per_layer,
                              backend=backend, tol=tol)
    solutions = solve_problem(problem, solver)
    out = [solutions[i] for i in range(len(prompts))]
    return out[0] if one else out


def solve_problem(problem, solver, trackers=(), every_frame: bool = True) -> dict[int, "Solution"]:
    """Run ``solver`` (a ForwardSolver or ParticleSolver of ``problem``) on the prompts of
    this rank's group, through a gradient's steps (plans frozen per frame), with
    ``trackers`` (the files a run writes, which stream the frames) before the solutions'
    own record. Returns {prompt index: Solution} of the group's prompts; with
    ``every_frame`` false a solution keeps the last frame's state only (its diagnostics
    of every frame), as a batch run needs. What :func:`solve` and ``pdeformer forward``
    and ``particles`` run."""
    if isinstance(solver, ForwardSolver):
        solver.freeze_plans()          # a gradient's steps: one discrete map with value_and_grad
    record = _Frames(every_frame)
    pictures = None
    if every_frame:
        pictures = TokenSnapshots(None) if isinstance(solver, ParticleSolver) else FieldSnapshots(None)
    solver.run([*trackers, record] + ([pictures] if pictures else []))
    return {i: Solution(problem, solver, record, pictures, i) for i in sorted(record.rows)}


def gradient_of(problem, solver):
    """The risk of ``problem``'s objective over its prompts and its exact gradient
    (:class:`pdeformer.model.params.Gradient`) through ``solver``'s steps: the adjoint
    sweep on the mesh, the particle adjoint for particles. What :func:`value_and_grad`
    and ``pdeformer gradient`` and ``particles --gradient`` compute."""
    if isinstance(solver, ParticleSolver):
        return ParticleAdjoint(solver, problem.objective, problem.targets).gradient()
    return adjoint_of(problem, solver).gradient()


def adjoint_of(problem, solver) -> AdjointSolver:
    """The adjoint of ``problem``'s objective through ``solver`` (a ForwardSolver)."""
    return AdjointSolver(solver, problem.objective, problem.targets, problem.opts.objective.quadrature_degree)


class Solution:
    """One prompt's solution over its frames (t = 0, then every frame end): every array
    is the same on every rank.

    Attributes
    ----------
    t : (F,) array
        Depth of each frame.
    mass : (F,) array
        The mass on the mesh (1 for particles).
    outflow : (F,) array
        The mass that has left the mesh.
    mean, cov : (F, d) and (F, d, d) arrays
        Moments of the normalised density.
    name : str
        The prompt's name.
    """

    def __init__(self, problem, solver, record: _Frames, pictures, index: int):
        self.problem, self.solver, self.index = problem, solver, index
        self._record, self._frames, self._pictures = record, record.frames.get(index, []), pictures
        rows = record.rows[index]
        self.name = problem.prompts[index][0]
        self.t = np.array([r["t"] for r in rows])
        self.mass = np.array([r["mass"] for r in rows])
        self.outflow = np.array([r["outflow"] for r in rows])
        self.mean = np.array([r["mean"] for r in rows])
        self.cov = np.array([r["cov"] for r in rows])
        self._cells = None

    def final_state(self):
        """This rank's part of the state at t = 1: the density's coefficients (DG), or
        (tokens, weights) (particles)."""
        f = self._frames[-1]
        return (f.coeffs, f.extra["weights"]) if "weights" in f.extra else f.coeffs

    def density(self, frame: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """(points, values) at ``frame``: the cells' centroids and the density's cell means
        (DG, cells in centroid order, whatever the partition), or the tokens and their
        weights (particles), gathered on every rank (a collective call)."""
        if not self._record.every and frame not in (-1, len(self.t) - 1):
            raise ValueError("this solution keeps the last frame only")
        f = self._frames[-1 if not self._record.every else frame]
        comm = self.solver.comm
        if isinstance(self.solver, ParticleSolver):
            x = np.concatenate(comm.allgather(f.coeffs))
            w = np.concatenate(comm.allgather(f.extra["weights"]))
            return x, w
        tr = self.solver.transport
        if self._cells is None:
            self._cells = MeshCells(self.problem.mesh, comm, self.problem.geometry)
        means = self._cells.gather(np.einsum("ck,ck->c", tr.mean_weights, f.coeffs[tr.cell_dofs]))
        centroids = self._cells.centroids if comm.rank == 0 else None
        return comm.bcast((centroids, means), root=0)

    def plot(self, filename: str) -> str | None:
        """The densities picture a run draws (rows: the solve's first 12 prompts; columns:
        frames over depth) into ``filename`` (.png or .svg), by rank 0 (a collective
        call); the file name, or None without matplotlib."""
        from ..tools.figures import density_figure
        from ..tools.output import save_figure
        if self._pictures is None:
            raise ValueError("this solution keeps no pictures (solve_problem(every_frame=False))")
        arrays = self._pictures.arrays(self.problem)
        if self.solver.comm.rank != 0:
            return None
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig = density_figure(arrays)
        save_figure(filename, fig)
        plt.close(fig)
        return filename

    def write_vtk(self, folder: str) -> list[str]:
        """The density over depth as a ParaView series in ``folder`` (created):
        ``density_<name>.pvd`` (DG), ``tokens_<name>.pvd`` (particles); a collective call.
        The files written."""
        if self.solver.comm.rank == 0:
            os.makedirs(folder, exist_ok=True)
        self.solver.comm.Barrier()
        out = TokenOutput(folder) if isinstance(self.solver, ParticleSolver) else FieldOutput(folder, "vtk", False)
        if not self._record.every:
            raise ValueError("this solution keeps the last frame only")
        out.start(self.solver)
        for f in self._frames:
            out.frame(self.solver, f)
        out.finish(self.solver)
        return list(out.files)


def value_and_grad(objective: Objective, model: Transformer, prompts, disc, *, frames_per_layer: int = 1,
                   backend: str = "auto", tol: float = 1e-8, comm=None) -> tuple[float, dict]:
    """The risk R = (1/S) sum_s F_s(rho_1^s) over ``prompts`` and its exact derivative
    with respect to every parameter of ``model`` (the adjoint sweep of docs/training.md).
    The steps are those :func:`solve` takes with the same ``frames_per_layer`` (a step
    plan per frame): its solutions are the densities whose risk this is.

    Returns
    -------
    risk : float
    grad : dict
        A tree shaped like ``model.params``: ``grad["attention"]["Q"]`` (L, H, k, d),
        ``"K"``, ``"V"`` (L, H, d, d), the same on every rank.
    """
    prompts, _ = _prompt_list(prompts)
    problem, solver = _solver(model, prompts, disc, objective, comm, True, frames_per_layer=frames_per_layer,
                              backend=backend, tol=tol)
    g = gradient_of(problem, solver)
    return g.risk, g.params
