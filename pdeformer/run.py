"""Runs as the CLI launches them: build, solve, track, write the summary.

``run_forward``, ``run_gradient`` and ``run_train`` are ``pdeformer forward|gradient|train
RUN.toml`` without the command line. Every run writes into ``[output] dir``
``pdeformer.log`` and ``summary.json`` (status, resolved config, versions, ranks, git
commit, wall time per phase, results) besides its own files:

* forward:  diagnostics.csv, density/velocity field series (and the risk, with an objective)
* gradient: gradient.npz (dQ, dK, dV: derivatives of the discrete risk)
* train:    history.csv, params_XXXX.npz, heads_XXXX.vtu + heads.pvd, checkpoint.npz
* ntk:      ntk.json (both injectivity tests), ntk.png (their spectra)
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from . import _dolfinx as dfx
from .errors import ConfigError, InputError, SolverBreakdown
from .forward import ForwardSolver, Tracker, build_problem
from .output import provenance, write_json
from .parallel import Timer, add_log_file, on_root, remove_log_file
from .trackers import DiagnosticsTable, FieldOutput, ProgressLog

log = logging.getLogger("pdeformer")


def _make_outdir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise InputError(f"output.dir: cannot write to {path} ({e.strerror})") from None


class Run:
    """What every command shares: inputs checked first (nothing is written for bad
    input), then the output folder, the log file, provenance and the summary."""

    def __init__(self, command: str, cfg: dict, comm, differentiable: bool = False,
                 solver=ForwardSolver, check=None):
        self.command, self.cfg, self.comm = command, cfg, comm
        self.timer = Timer()
        out = cfg["output"]
        if command == "forward" and out["fields"] and out["format"] == "vtx" and not dfx.has_vtx():
            raise ConfigError("output.format", f"'vtx' needs dolfinx built with ADIOS2 "
                              f"(this is dolfinx {dfx.VERSION_STRING} without it); use 'vtk'")
        with self.timer.phase("setup"):
            self.problem = build_problem(cfg, comm, differentiable and solver is ForwardSolver)
            if check is not None:   # the command's own input checks
                check(self.problem)
        self.solver = solver(self.problem, self.timer) if solver else None
        self.outdir = out["dir"]
        on_root(comm, _make_outdir, self.outdir)
        self.info = provenance(comm) if comm.rank == 0 else {}

    def path(self, name: str) -> str:
        return os.path.join(self.outdir, name)

    @contextmanager
    def logged(self):
        handler = add_log_file(self.comm, self.path("pdeformer.log"))
        try:
            log.info("pdeformer %s %s on %d rank(s), output in %s", self.command,
                     self.cfg["config_file"], self.comm.size, self.outdir)
            if dfx.untested_version_warning() and self.comm.rank == 0:
                log.warning(dfx.untested_version_warning())
            yield
        finally:
            remove_log_file(handler)

    def summary(self, status: str, error, **results) -> dict:
        p = self.problem
        timings = self.timer.report(self.comm)
        mesh = {"dim": p.dim, "cells": dfx.global_cells(p.mesh), "cell_type": dfx.cell_type_name(p.mesh)}
        tr = getattr(self.solver, "transport", None)
        if tr is not None:
            mesh.update(density_dofs=tr.V.dofmap.index_map.size_global,
                        velocity_nodes=tr.W.dofmap.index_map.size_global,
                        attention_sources=int(tr.n_sources))
        summary = {
            "command": self.command, "status": status, "error": str(error) if error else None,
            "config": self.cfg, "provenance": self.info, "ranks": self.comm.size, "mesh": mesh,
            "model": {"layers": p.heads.layers, "heads": p.heads.heads, "key_dim": p.heads.key_dim},
            "timings": timings, **results}
        if self.solver is not None:
            summary.update(prompts=self.solver.prompt_info, stats=self.solver.stats,
                           attention={"backend": self.cfg["attention"]["backend"],
                                      "tol": self.cfg["attention"]["tol"],
                                      **self.solver.velocity_field.stats})
        if self.comm.rank == 0:
            write_json(self.path("summary.json"), summary)
        log.info("%s done in %.1f s (setup %.1f s, velocity %.1f s, transport %.1f s)",
                 self.command, timings["total"], timings.get("setup", 0),
                 timings.get("velocity", 0), timings.get("transport", 0))
        return summary


def _risk_of(solver: ForwardSolver, problem, coeffs: list) -> dict | None:
    """The objective at the final densities of a forward run (None without one)."""
    if problem.objective is None:
        return None
    from .adjoint import AdjointSolver
    adj = AdjointSolver(solver, problem.objective, problem.targets,
                        problem.cfg["objective"]["quadrature_degree"])
    risks = [adj.objective_at(s, c)[0] for s, c in enumerate(coeffs)]
    return {"risk": float(np.mean(risks)), "risks": dict(zip([n for n, _ in problem.prompts], risks))}


def run_forward(cfg: dict, comm=None) -> dict:
    """Forward pass of every prompt; returns the summary (also written to summary.json).

    After a breakdown (NaN, overflow) the diagnostics so far and a summary with
    ``"status": "breakdown"`` and the error are still written, then the error is raised."""
    run = Run("forward", cfg, comm or MPI.COMM_WORLD)
    out = cfg["output"]
    table = DiagnosticsTable(run.path("diagnostics.csv"))
    trackers = [ProgressLog(), table]
    fields = FieldOutput(run.outdir, out["format"], out["velocity"]) if out["fields"] else None
    if fields:
        trackers.append(fields)
    finals = FinalStates()
    trackers.append(finals)
    with run.logged():
        status, error = "completed", None
        try:
            with run.timer.phase("forward"):
                run.solver.run(trackers)
        except SolverBreakdown as e:
            status, error = "breakdown", e
        risk = _risk_of(run.solver, run.problem, finals.coeffs) if error is None else None
        if risk:
            log.info("risk R = %.12e", risk["risk"])
        summary = run.summary(
            status, error, final_diagnostics=table.final(), objective=risk,
            files={"diagnostics": "diagnostics.csv", "log": "pdeformer.log",
                   "fields": [os.path.relpath(f, run.outdir) for f in (fields.files if fields else [])]})
        if error is not None:
            raise error
    return summary


class FinalStates(Tracker):
    """Keeps the density (or the tokens and weights) of every prompt at t = 1."""

    def __init__(self):
        self.coeffs = []
        self.tokens = []

    def frame(self, solver, frame):
        if frame.layer_boundary and frame.t == 1.0:
            self.coeffs.append(frame.coeffs)
            if "weights" in frame.extra:
                self.tokens.append((frame.coeffs, frame.extra["weights"]))


def run_gradient(cfg: dict, comm=None) -> dict:
    """Risk and its exact derivatives dR/dQ, dR/dK, dR/dV -> gradient.npz, summary.json."""
    from .adjoint import AdjointSolver
    run = Run("gradient", cfg, comm or MPI.COMM_WORLD, differentiable=True)
    p = run.problem
    adj = AdjointSolver(run.solver, p.objective, p.targets, cfg["objective"]["quadrature_degree"])
    with run.logged():
        with run.timer.phase("gradient"):
            g = adj.gradient()
        log.info("risk R = %.12e, |dR/dtheta| = %.6e", g.risk, g.norm())
        if run.comm.rank == 0:
            with open(run.path("gradient.npz.tmp"), "wb") as f:
                np.savez(f, dQ=g.dQ, dK=g.dK, dV=g.dV, risk=np.array(g.risk))
            os.replace(run.path("gradient.npz.tmp"), run.path("gradient.npz"))
        return run.summary("completed", None, risk=g.risk,
                           risks=dict(zip([n for n, _ in p.prompts], g.risks)),
                           gradient_norm=g.norm(), tape_bytes_per_rank=g.tape_bytes,
                           step_counts=_counts(run.solver),
                           files={"gradient": "gradient.npz", "log": "pdeformer.log"})


def _counts(solver) -> dict:
    """Steps per layer used (frozen plan or steps_per_layer), per prompt."""
    if solver.disc["steps_per_layer"] is not None:
        return {"steps_per_layer": solver.disc["steps_per_layer"]}
    out = {}
    for (s, layer, _), n in sorted(solver.step_counts.items()):
        name = solver.problem.prompts[s][0]
        out.setdefault(name, [0] * solver.problem.heads.layers)[layer] += n
    return out


def run_train(cfg: dict, comm=None, restart: bool = False, walltime: float | None = None) -> dict:
    """Gradient-flow training (see pdeformer.train); returns the summary. With
    ``walltime`` (seconds) training stops, with a checkpoint, before a step that would
    end past it (status "walltime"; continue with restart)."""
    from .adjoint import AdjointSolver
    from .train import Trainer
    run = Run("train", cfg, comm or MPI.COMM_WORLD, differentiable=True)
    p = run.problem
    adj = AdjointSolver(run.solver, p.objective, p.targets, cfg["objective"]["quadrature_degree"])
    trainer = Trainer(adj, cfg, run.outdir, walltime)
    with run.logged():
        if restart:
            trainer.restart()
        status, error = "completed", None
        try:
            with run.timer.phase("train"):
                history = trainer.run()
            status = trainer.status
        except SolverBreakdown as e:
            status, error, history = "breakdown", e, trainer.history
        summary = run.summary(
            status, error, history=history,
            initial_risk=history[0]["risk"] if history else None,
            final_risk=history[-1]["risk"] if history else None,
            restarted_at=trainer.start if restart else None,
            files={"history": "history.csv", "checkpoint": "checkpoint.npz",
                   "heads": "heads.pvd", "log": "pdeformer.log"})
        if error is not None:
            raise error
    return summary


def run_ntk(cfg: dict, comm=None) -> dict:
    """The NTK injectivity tests of the run's prompts (see pdeformer.ntk): ntk.json,
    ntk.png, summary.json. With ``[ntk] depth`` the prompts first go through a forward
    run (point clouds through the particle model) to that depth."""
    from .ntk import check_inputs, plot_spectra, prompt_measures, run_analysis
    run = Run("ntk", cfg, comm or MPI.COMM_WORLD, solver=None, check=check_inputs)
    p = run.problem
    names = [n for n, _ in p.prompts]
    with run.logged():
        status, error, result = "completed", None, None
        try:
            measures, how = prompt_measures(p, run.timer)
            with run.timer.phase("ntk"):
                result = run_analysis(names, measures, p)
        except SolverBreakdown as e:
            status, error = "breakdown", e
        files = {"log": "pdeformer.log"}
        if result is not None:
            result["prompts"] = [{"name": n, "kind": m.kind, "measure": h}
                                 for (n, m), h in zip(p.prompts, how)]
            lse, gram = result["lse"], result["ntk"]
            log.info("LSE test: sigma_min/sigma_max = %.3e (%s at tol %g)", lse["ratio"],
                     "independent" if lse["independent"] else "dependent", result["tol"])
            log.info("NTK Gram (%s, %d x %d): lambda_min/lambda_max = %.3e (%s at tol^2)",
                     gram["params"], gram["size"], gram["size"], gram["ratio"],
                     "injective" if gram["injective"] else "not injective")
            if lse["independent"] != gram["injective"]:
                log.warning("warning: the LSE test and the NTK Gram disagree (see docs/ntk.md)")
            if run.comm.rank == 0:
                write_json(run.path("ntk.json"), {"config": cfg["ntk"], "provenance": run.info, **result})
                files["ntk"] = "ntk.json"
                if plot_spectra(run.path("ntk.png"), result):
                    files["plot"] = "ntk.png"
        summary = run.summary(status, error, ntk=result, files=files)
        if error is not None:
            raise error
    return summary


def run_particles(cfg: dict, comm=None, gradient: bool = False) -> dict:
    """The particle model: tokens of every prompt through the layers (diagnostics.csv,
    tokens_<prompt>.pvd); with an [objective] its risk, and with ``gradient`` the exact
    gradient of the particle risk (gradient.npz; through the configured attention backend)."""
    from .particles import ParticleAdjoint, ParticleSolver, TokenOutput

    run = Run("particles", cfg, comm or MPI.COMM_WORLD, solver=ParticleSolver)
    p = run.problem
    if gradient and p.objective is None:
        raise ConfigError("objective.kind", "missing: --gradient needs an [objective]")
    adjoint = ParticleAdjoint(run.solver, p.objective, p.targets) if p.objective else None
    table = DiagnosticsTable(run.path("diagnostics.csv"))
    trackers = [ProgressLog(), table]
    tokens = TokenOutput(run.outdir) if cfg["particles"]["points"] else None
    if tokens:
        trackers.append(tokens)
    finals = FinalStates()
    trackers.append(finals)
    with run.logged():
        status, error, results = "completed", None, {}
        try:
            with run.timer.phase("particles"):
                run.solver.run(trackers)
            if adjoint is not None:
                risks = [adjoint.objective.particle_value_and_gradient(
                    x, w, adjoint.targets[s], run.comm)[0] for s, (x, w) in enumerate(finals.tokens)]
                results["objective"] = {"risk": float(np.mean(risks)),
                                        "risks": dict(zip([n for n, _ in p.prompts], risks))}
                log.info("risk R = %.12e", results["objective"]["risk"])
            if gradient:
                with run.timer.phase("gradient"):
                    g = adjoint.gradient()
                if run.comm.rank == 0:
                    with open(run.path("gradient.npz.tmp"), "wb") as f:
                        np.savez(f, dQ=g.dQ, dK=g.dK, dV=g.dV, risk=np.array(g.risk))
                    os.replace(run.path("gradient.npz.tmp"), run.path("gradient.npz"))
                results.update(risk=g.risk, gradient_norm=g.norm())
                log.info("|dR/dtheta| = %.6e", g.norm())
        except SolverBreakdown as e:
            status, error = "breakdown", e
        summary = run.summary(
            status, error, final_diagnostics=table.final(), **results,
            files={"diagnostics": "diagnostics.csv", "log": "pdeformer.log",
                   "tokens": tokens.files if tokens else [],
                   **({"gradient": "gradient.npz"} if gradient else {})})
        if error is not None:
            raise error
    return summary
