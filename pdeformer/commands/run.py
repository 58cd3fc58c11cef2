"""Runs as the CLI launches them: build, solve, track, write the summary.

``run_forward``, ``run_gradient`` and ``run_train`` are ``pdeformer forward|gradient|train
RUN.toml`` without the command line. Every run writes into ``[output] dir``
``pdeformer.log`` and ``summary.json`` (status, resolved config, versions, ranks, git
commit, wall time per phase, results) besides its own files:

* forward:  diagnostics.csv, density/velocity field series (and the risk, with an objective)
* gradient: gradient.npz (dR/dtheta of the discrete risk: "d" + each parameter array's key)
* train:    history.csv, params_XXXX.npz, heads_XXXX.vtu + heads.pvd, checkpoint.npz
* ntk:      ntk.json (both injectivity tests), ntk.png (their spectra)

and, unless ``[output] plots = false``, the pictures of pdeformer.commands.plot (drawn by
rank 0 from the files the run wrote, as ``pdeformer plot DIR`` draws them), the compact
field file ``fields.npz`` they draw densities from (forward, train: at the trained
heads, particles) and ``paraview.py`` where field series were written.

Prompt groups (``[parallel] prompt_groups``, ``--prompt-groups``; see
pdeformer.tools.parallel.PromptGroups): every group builds the mesh on its own communicator and
solves its block of the prompts; the groups meet (agree on failure, then combine) after
the set-up, after the forward pass (diagnostics rows, risks, field file names), inside
every gradient (risks, the world-wide sum of the parameters' cotangents) and in the summary (prompt info,
stats summed over groups, timings, the ``parallel`` accounting). World rank 0 logs and
writes the tables and JSON files; each prompt's field series is written by its group.
``converge`` and ``ntk`` run as one group (prompt_groups > 1 is refused there).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from ..fem import _dolfinx as dfx
from ..attention.costs import costs_record
from ..tools.blas import describe_choice
from ..solvers.budget import check_memory, room_for_tape
from ..tools.machine import peak_memory
from ..model.config import input_files
from ..tools.errors import ConfigError, PdeformerError, SolverBreakdown, status_of
from ..model import params as tree
from ..api.solve import adjoint_of, gradient_of, solve_problem
from ..api.train import trainer_for
from ..solvers.forward import ForwardSolver
from ..solvers.problem import build_problem, teacher_pass
from ..tools.outdir import TRAINING_STATE, OutputFolder
from ..tools.output import provenance, write_json, write_npz
from ..tools.parallel import (Meter, PromptGroups, Timer, add_log_file, describe_parallel, metered, on_root,
                       parallel_report, remove_log_file)
from ..solvers.snapshots import FieldSnapshots, TokenSnapshots
from ..solvers.trackers import DiagnosticsTable, FieldOutput, ProgressLog, log_other_groups

log = logging.getLogger("pdeformer")


@contextmanager
def output_session(command: str, outdir: str, comm, announce: str, on_error, on_bug=None, keep=(),
                   reads=()):
    """The inside of a command in its output folder: the folder created and locked,
    earlier files moved aside (but those matching ``keep``; ``reads``: [(key, path)] of
    the files the run reads, which may not be among them: see pdeformer.tools.outdir),
    the log file open and ``announce`` logged. Yields ``begin``, which the command calls
    (on every rank) when its work starts. A PdeformerError raised inside (on every rank)
    calls ``on_error(e)`` (which writes the summary; a second error there, e.g. a disk
    still full, is dropped: the first one's line says what happened), except bad input
    (exit status 2) before ``begin``: the command is refused and the folder put back as
    it was; anything else calls ``on_bug(e)`` on the failing rank. The lock and log are
    released either way."""
    folder = OutputFolder(outdir, command, keep, reads)
    on_root(comm, folder.open)
    handler, refused, started = None, False, []
    try:
        handler = add_log_file(comm, os.path.join(outdir, "pdeformer.log"))
        log.info("%s", announce)
        blas_line = describe_choice()
        if blas_line:
            log.info("%s", blas_line)
        if comm.rank == 0:
            folder.report()
            if dfx.untested_version_warning():
                log.warning(dfx.untested_version_warning())
        yield lambda: started.append(True)
    except PdeformerError as e:
        refused = e.exit_status == 2 and not started
        if not refused:
            try:
                on_error(e)
            except PdeformerError:
                pass
        raise
    except BaseException as e:
        if on_bug is not None:
            on_bug(e)
        raise
    finally:
        remove_log_file(handler)
        if comm.rank == 0:
            folder.close(restore=refused)


class Run:
    """What every command shares: inputs checked first (nothing is written for bad
    input found then), then the session: output folder (locked, earlier files moved
    aside), log file, provenance and the summary -- written whatever ends the run.

    ``comm`` is the world of the run; it is wrapped in a MeteredComm (``self.comm``) and
    split into prompt groups (``self.groups``); the problem and solver live on this
    rank's group communicator (``self.problem.comm``)."""

    def __init__(self, command: str, cfg: dict, comm, differentiable: bool = False,
                 solver=ForwardSolver, check=None, groups: bool = True):
        self.command, self.cfg = command, cfg
        self.comm = metered(comm, Meter())     # this run's own count
        self.timer = Timer(self.comm.meter)
        out = cfg["output"]
        if command == "forward" and out["fields"] and out["format"] == "vtx" and not dfx.has_vtx():
            raise ConfigError("output.format", f"'vtx' needs dolfinx built with ADIOS2 "
                              f"(this is dolfinx {dfx.VERSION_STRING} without it); use 'vtk'")
        G = cfg["parallel"]["prompt_groups"]
        if not groups and G > 1:
            raise ConfigError("parallel.prompt_groups", f"{command} runs as one group of all ranks: "
                              f"prompt groups are not supported (set 1, got {G})")
        # bad G is bad input on every rank alike (no collective before this)
        self.groups = PromptGroups(self.comm, G, [p["name"] for p in cfg["prompts"]])
        self.memory = check_memory(cfg, command, self.groups.comm, self.comm,   # before anything big
                                   differentiable)
        with self.groups.combined():   # a group's failing set-up ends every group
            with self.timer.phase("setup"):
                self.problem = build_problem(cfg, self.comm, differentiable and solver is ForwardSolver,
                                             groups=self.groups, defer_teacher=True)
                if check is not None:   # the command's own input checks
                    check(self.problem)
            self.solver = solver(self.problem, self.timer) if solver else None
        if differentiable and isinstance(self.solver, ForwardSolver):   # a tape past it is a breakdown
            self.solver.tape_limit = room_for_tape(self.memory, cfg, self.comm)
        self.outdir = out["dir"]
        self.info = provenance(self.comm, dfx.versions()) if self.comm.rank == 0 else {}
        self.summarised = False

    def path(self, name: str) -> str:
        return os.path.join(self.outdir, name)

    def snapshots(self, kind=FieldSnapshots, caption: str = ""):
        """The tracker of fields.npz (a :class:`~pdeformer.solvers.snapshots.Snapshots`
        of ``kind``), or None with ``[output] plots = false``."""
        return kind(self.path("fields.npz"), caption) if self.cfg["output"]["plots"] else None

    def draw(self, snapshots=None) -> dict:
        """Write fields.npz (``snapshots``: a combination point), then rank 0 draws the
        pictures and writes paraview.py from the run's files; their names, as the
        summary's ``files`` lists them ({} with ``[output] plots = false``). A picture
        that cannot be drawn is a warning, not a failure of the run."""
        if not self.cfg["output"]["plots"]:
            return {}
        with self.timer.phase("plots"):
            files = {}
            if snapshots is not None:
                snapshots.write(self.problem)
                files["snapshots"] = "fields.npz"
            return {**files, **on_root(self.comm, _draw_quietly, self.outdir,
                                       self.cfg["output"]["plot_format"], self.groups.names)}

    def write_gradient(self, g) -> None:
        """gradient.npz: dR/dtheta ("d" + each array's key in the params files) and the
        risk (rank 0 writes; a failed write ends every rank)."""
        on_root(self.comm, write_npz, self.path("gradient.npz"), **tree.to_files(g.params, "d"),
                risk=np.array(g.risk))

    @contextmanager
    def session(self, keep=()):
        """The run's inside, in its output folder (:func:`output_session`), after a
        teacher's target pass: a PdeformerError raised inside (on every rank) still
        writes summary.json with its status, unless the command wrote one; anything else
        makes the failing rank write a summary with status "failed" before the job is
        aborted."""
        def on_error(e):
            if not self.summarised:
                self.summary(status_of(e), e)
        announce = (f"pdeformer {self.command} {self.cfg['config_file']} on {self.comm.size} "
                    f"rank(s), output in {self.outdir}")
        with output_session(self.command, self.outdir, self.comm, announce, on_error, self._failed, keep,
                            input_files(self.cfg)) as begin:
            if self.problem.teacher is not None:   # its breakdown is this run's, recorded here
                with self.timer.phase("teacher"):
                    teacher_pass(self.problem)
            begin()
            yield

    def _failed(self, error: BaseException) -> None:
        """summary.json of a run that a bug or an interrupt ended, written by the rank it
        happened on (no collectives: the other ranks may be anywhere)."""
        try:
            write_json(self.path("summary.json"), {
                "command": self.command, "status": status_of(error), "rank": self.comm.rank,
                "error": f"{type(error).__name__}: {error}", "config": self.cfg,
                "provenance": self.info, "ranks": self.comm.size,
                "timings": {"total": self.timer.elapsed()}})
        except Exception:
            pass

    def summary(self, status: str, error, **results) -> dict:
        """summary.json (written by rank 0) and the closing log lines; a combination
        point (every rank of every group calls it)."""
        meter = self.comm.meter.snapshot()   # before the summary's own collectives
        p, groups = self.problem, self.groups
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
            sv = self.solver
            summary.update(prompts=self.prompt_info(),
                           stats=groups.sum_stats(sv.stats),
                           attention={"backend": self.cfg["attention"]["backend"],
                                      "tol": self.cfg["attention"]["tol"],
                                      **groups.sum_stats(sv.velocity_field.stats),
                                      # the costs its choices were made from
                                      "costs_s": costs_record(p.context.costs)})
        summary["parallel"] = parallel_report(self.comm, groups, meter, self.timer)
        peak = self.comm.allreduce(peak_memory(), op=MPI.MAX)
        summary["memory"] = {"estimate_per_rank_gb": self.memory["total"] / 2**30,
                             "estimate_parts_gb": {k: v / 2**30 for k, v in self.memory.items() if k != "total"},
                             "peak_per_rank_gb": peak / 2**30}
        self.summarised = True
        on_root(self.comm, write_json, self.path("summary.json"), summary)
        log.info("%s done in %.1f s (setup %.1f s, velocity %.1f s, transport %.1f s)",
                 self.command, timings["total"], timings.get("setup", 0),
                 timings.get("velocity", 0), timings.get("transport", 0))
        if self.comm.rank == 0:
            log.info(describe_parallel(summary["parallel"]))
        return summary

    def prompt_info(self) -> list:
        """The solver's per-prompt info of every group, in prompt order (a combination
        point)."""
        info = self.solver.prompt_info
        return self.groups.gather_prompts({i: info[i] for i in self.groups.owned})


def _draw_quietly(folder: str, fmt: str, prompts: list[str]) -> dict:
    """pdeformer.commands.plot.draw_run, with whatever stops it logged as a warning."""
    from .plot import draw_run
    try:
        return draw_run(folder, fmt, prompts=prompts)
    except Exception as e:   # the run's results stand without its pictures
        log.warning("warning: the pictures were not drawn (%s: %s); `pdeformer plot %s` tries "
                    "again", type(e).__name__, e, folder)
        return {}


def _risk_of(solver: ForwardSolver, problem, solutions: dict) -> dict | None:
    """The objective at the final densities of a forward run (None without one);
    ``solutions``: {prompt index: Solution} of this group's prompts. A combination
    point."""
    if problem.objective is None:
        return None
    adj = adjoint_of(problem, solver)
    groups = problem.groups
    with groups.combined():
        local = {s: adj.objective_at(s, sol.final_state())[0] for s, sol in solutions.items()}
    risks = groups.gather_prompts(local)
    return {**risk_split(problem, risks), "risks": dict(zip(groups.names, risks))}


def risk_split(problem, risks: list) -> dict:
    """The risk over the training prompts, and over the held-out ones where there are
    (``risks``: F_s of every prompt, in prompt order)."""
    out = {"risk": float(np.mean([risks[s] for s in problem.training]))}
    if problem.held_out:
        out["test_risk"] = float(np.mean([risks[s] for s in problem.held_out]))
    return out


def run_forward(cfg: dict, comm=None) -> dict:
    """Forward pass of every prompt; returns the summary (also written to summary.json).

    The steps are a gradient's (a step plan frozen per frame, decided by the CFL condition
    at its start): the risk a forward run reports is the one ``pdeformer gradient``
    differentiates. After a breakdown (NaN, overflow) the diagnostics so far and a summary
    with ``"status": "breakdown"`` and the error are still written, then the error is raised."""
    run = Run("forward", cfg, comm or MPI.COMM_WORLD,   # the objective's risk comes at the end
              check=lambda p: p.check_on_mesh())
    out = cfg["output"]
    table = DiagnosticsTable(run.path("diagnostics.csv"))
    trackers = [ProgressLog(), table]
    fields = FieldOutput(run.outdir, out["format"], out["velocity"]) if out["fields"] else None
    if fields:
        trackers.append(fields)
    snapshots = run.snapshots()
    trackers += [snapshots] if snapshots else []
    with run.session():
        status, error, solutions = "completed", None, {}
        try:
            with run.groups.combined():   # each group solves its prompts; then they meet
                with run.timer.phase("forward"):
                    solutions = solve_problem(run.problem, run.solver, trackers, every_frame=False)
        except SolverBreakdown as e:
            status, error = "breakdown", e
        table.write(run.groups)
        prompt_info = run.prompt_info()
        if run.groups.count > 1:
            log_other_groups(run.groups, table.rows, prompt_info, run.problem.heads.layers)
        risk = _risk_of(run.solver, run.problem, solutions) if error is None else None
        if risk:
            log.info("risk R = %.12e%s", risk["risk"], f" (training prompts), test risk {risk['test_risk']:.12e}"
                     if "test_risk" in risk else "")
        field_files = run.groups.gather_lists(fields.files if fields else [])
        drawn = run.draw(snapshots)
        summary = run.summary(
            status, error, final_diagnostics=table.final(), objective=risk,
            files={"diagnostics": "diagnostics.csv", "log": "pdeformer.log",
                   "fields": [os.path.relpath(f, run.outdir) for f in field_files], **drawn})
        if error is not None:
            raise error
    return summary


def run_gradient(cfg: dict, comm=None) -> dict:
    """Risk and its exact derivatives dR/dtheta -> gradient.npz, summary.json."""
    run = Run("gradient", cfg, comm or MPI.COMM_WORLD, differentiable=True)
    p = run.problem
    with run.session():
        with run.timer.phase("gradient"):
            g = gradient_of(p, run.solver)
        log.info("risk R = %.12e, |dR/dtheta| = %.6e", g.risk, g.norm())
        tape_bytes = run.comm.allreduce(g.tape_bytes, op=MPI.MAX)
        run.write_gradient(g)
        drawn = run.draw()
        return run.summary("completed", None, risk=g.risk,
                           risks={p.prompts[s][0]: r for s, r in zip(g.prompts, g.risks)},
                           gradient_norm=g.norm(), tape_bytes_per_rank=tape_bytes,
                           step_counts=_counts(run.solver),
                           files={"gradient": "gradient.npz", "log": "pdeformer.log", **drawn})


def _counts(solver) -> dict:
    """Steps per layer used (frozen plan or steps_per_layer), per prompt (a combination
    point: every group counts its own prompts)."""
    if solver.disc.steps_per_layer is not None:
        return {"steps_per_layer": solver.disc.steps_per_layer}
    local = {}
    for (s, layer, _), plan in sorted(solver.step_counts.items()):
        local.setdefault(s, [0] * solver.problem.heads.layers)[layer] += plan.steps
    groups = solver.problem.groups
    counts = groups.gather_prompts(local)
    return {name: c for name, c in zip(groups.names, counts) if c is not None}


def run_train(cfg: dict, comm=None, restart: bool = False, walltime: float | None = None) -> dict:
    """Gradient-flow training (see pdeformer.solvers.train); returns the summary. With
    ``walltime`` (seconds) training stops, with a checkpoint, before a step that would
    end past it (status "walltime"; continue with restart)."""
    run = Run("train", cfg, comm or MPI.COMM_WORLD, differentiable=True)
    trainer = trainer_for(run.problem, run.solver, run.outdir, walltime, started=run.timer.start)   # set-up counts
    if restart:   # read and checked before the folder is touched: a refused restart changes nothing
        trainer.restart()
    with run.session(keep=TRAINING_STATE if restart else ()):
        if restart:
            log.info("restart from %s at step %d", trainer.checkpoint_file, trainer.start)
        status, error = "completed", None
        try:
            with run.timer.phase("train"):
                history = trainer.run()
            status = trainer.status
        except SolverBreakdown as e:
            status, error, history = "breakdown", e, trainer.history
        snapshots = _trained_densities(run, trainer) if status == "completed" else None
        drawn = run.draw(snapshots)
        summary = run.summary(
            status, error, history=history,
            initial_risk=history[0]["risk"] if history else None,
            final_risk=history[-1]["risk"] if history else None,
            **{f"{when}_{c}": history[i].get(c) for c in ("train_risk", "test_risk")
               for when, i in (("initial", 0), ("final", -1)) if history and c in trainer.columns},
            restarted_at=trainer.start if restart else None,
            files={"history": "history.csv", "checkpoint": "checkpoint.npz",
                   "heads": "heads.pvd", "log": "pdeformer.log", **drawn})
        if error is not None:
            raise error
    return summary


def _trained_densities(run: Run, trainer):
    """fields.npz's frames at the trained heads: one more forward pass (it replays the
    step plans made at these heads by the last gradient and risk evaluations: the
    densities of the last risk). None with ``[output] plots = false``, or where the walltime guard would stop
    the pass (it takes about half a training step). Its steps and evaluations are left
    out of the summary's counts; its time is the phase "snapshots" (the velocity and
    transport phases include it)."""
    snapshots = run.snapshots(caption=f"trained heads, step {trainer.history[-1]['step']}"
                              if trainer.history else "")
    if snapshots is None or not trainer.history:
        return None
    if trainer.walltime is not None:
        step = trainer.history[-1]["wall_time"] / max(1, len(trainer.history))
        late = run.timer.elapsed() + step > trainer.walltime
        if run.comm.bcast(late if run.comm.rank == 0 else None, root=0):
            log.warning("warning: no densities at the trained heads (the walltime is near)")
            return None
    counted = [run.solver.stats, run.solver.velocity_field.stats]
    before = [dict(c) for c in counted]
    with run.groups.combined():
        with run.timer.phase("snapshots"):
            run.solver.run([snapshots])
    for c, b in zip(counted, before):   # the summary's counts are the training's
        c.clear()
        c.update(b)
    return snapshots


def run_ntk(cfg: dict, comm=None) -> dict:
    """The NTK injectivity tests of the run's prompts (see pdeformer.commands.ntk): ntk.json,
    ntk.png, summary.json. With ``[ntk] depth`` the prompts first go through a forward
    run (point clouds through the particle model) to that depth."""
    from .ntk import check_inputs, plot_spectra, prompt_measures, run_analysis
    run = Run("ntk", cfg, comm or MPI.COMM_WORLD, solver=None, check=check_inputs, groups=False)
    p = run.problem
    names = [n for n, _ in p.prompts]
    with run.session():
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
            on_root(run.comm, write_json, run.path("ntk.json"),
                    {"config": cfg["ntk"], "provenance": run.info, **result})
            files["ntk"] = "ntk.json"
            if on_root(run.comm, plot_spectra, run.path("ntk.png"), result):
                files["plot"] = "ntk.png"
        summary = run.summary(status, error, ntk=result, files=files)
        if error is not None:
            raise error
    return summary


def run_gram(cfg: dict, comm=None) -> dict:
    """The model's Gram matrix G = J D J^T on the training prompts and the gd convergence it
    predicts (see pdeformer.commands.gram): gram.json, gram.npz (J, G, y, y*), gram.png,
    summary.json."""
    from .gram import check_inputs, column_weights, gram_analysis, gram_matrix, plot_gram
    check_inputs(cfg)
    run = Run("gram", cfg, comm or MPI.COMM_WORLD, differentiable=True)
    p = run.problem
    adj = adjoint_of(p, run.solver)
    train = p.opts.train
    with run.session():
        with run.timer.phase("jacobian"):
            y, ystar, J = adj.output_jacobian()
        weights, (layers, width) = column_weights(run.solver.velocity_field.params)
        result = gram_analysis(y, ystar, J, len(p.training), layers, width, train.lr, train.steps,
                               p.opts.ntk.tol, weights)
        result["prompts_used"] = [p.prompts[s][0] for s in p.training]
        result["output_names"] = p.objective.output_names(p.dim)
        if train.optimizer != "gd" or train.weight_decay or train.temperature or \
                (train.batch_size or len(p.training)) < len(p.training):
            log.warning("warning: the prediction is that of plain full-batch gd (no adam, minibatches, "
                        "weight decay or noise)")
        log.info("Gram %d x %d: lambda_min/lambda_max = %.3e (%s), %d lost direction(s)",
                 result["outputs"], result["outputs"], result["ratio"],
                 "injective" if result["injective"] else "not injective", result["lost_directions"])
        log.info("gd at lr %g: a lambda_max = %.3g (%s), slowest rate %.4g per step, risk %.6e -> "
                 "plateau %.3e", train.lr, result["step_factor"] * result["eigenvalues"][0],
                 "stable" if result["stable"] else "UNSTABLE", result["slowest_rate"], result["risk"],
                 result["plateau"])
        on_root(run.comm, write_json, run.path("gram.json"), {"provenance": run.info, **result})
        on_root(run.comm, write_npz, run.path("gram.npz"), J=J, G=gram_matrix(J, weights), y=y, ystar=ystar,
                eigenvalues=np.asarray(result["eigenvalues"]))
        files = {"gram": "gram.json", "arrays": "gram.npz", "log": "pdeformer.log"}
        if cfg["output"]["plots"] and on_root(run.comm, plot_gram, run.path("gram.png"), result):
            files["plot"] = "gram.png"
        return run.summary("completed", None, gram={k: v for k, v in result.items()
                                                     if k not in ("predicted_risk", "residual_components",
                                                                  "mode_rates")}, files=files)


def _particle_risk(run: Run, adjoint, local: dict, gradient: bool, results: dict) -> None:
    """The particle risk from this group's prompts' ``local`` risks (nothing without an
    objective) and, with ``gradient``, its gradient (gradient.npz), into the summary
    entries ``results`` as they are found (a breakdown of the gradient keeps the risk)."""
    if adjoint is None:
        return
    risks = run.groups.gather_prompts(local)
    results["objective"] = {**risk_split(run.problem, risks), "risks": dict(zip(run.groups.names, risks))}
    log.info("risk R = %.12e", results["objective"]["risk"])
    if gradient:
        with run.timer.phase("gradient"):
            g = adjoint.gradient()
        run.write_gradient(g)
        results.update(risk=g.risk, gradient_norm=g.norm(),
                       tape_bytes_per_rank=run.comm.allreduce(g.tape_bytes, op=MPI.MAX))
        log.info("|dR/dtheta| = %.6e", g.norm())


def _particle_trackers(run: Run, points: bool) -> tuple:
    """(diagnostics table, token files or None, snapshots or None, all of them as the
    march's trackers, the progress log first) of a particle run; the token files
    (tokens_<prompt>.pvd) only with ``points``."""
    from ..model.particles import TokenOutput
    table = DiagnosticsTable(run.path("diagnostics.csv"))
    trackers = [ProgressLog(), table]
    tokens = TokenOutput(run.outdir) if points else None
    if tokens:
        trackers.append(tokens)
    snapshots = run.snapshots(TokenSnapshots)
    trackers += [snapshots] if snapshots else []
    return table, tokens, snapshots, trackers


def run_particles(cfg: dict, comm=None, gradient: bool = False) -> dict:
    """The particle model: tokens of every prompt through the layers (diagnostics.csv,
    tokens_<prompt>.pvd); with an [objective] its risk, and with ``gradient`` the exact
    gradient of the particle risk (gradient.npz; through the configured attention backend)."""
    from ..model.particles import ParticleAdjoint, ParticleSolver

    run = Run("particles", cfg, comm or MPI.COMM_WORLD, solver=ParticleSolver, differentiable=gradient)
    p = run.problem
    if gradient and p.objective is None:
        raise ConfigError("objective.kind", "missing: --gradient needs an [objective]")
    if p.objective is not None:   # before the folder is touched
        ParticleAdjoint.check(run.solver, p.objective)
    table, tokens, snapshots, trackers = _particle_trackers(run, cfg["particles"]["points"])
    with run.session():
        adjoint = ParticleAdjoint(run.solver, p.objective, p.targets) if p.objective else None
        status, error, results = "completed", None, {}
        try:
            with run.groups.combined():   # each group moves its prompts' tokens; then they meet
                with run.timer.phase("particles"):
                    solutions = solve_problem(p, run.solver, trackers, every_frame=False)
                local = {s: adjoint.objective.particle_value_and_gradient(*sol.final_state(), adjoint.targets[s],
                                                                          p.comm)[0]
                         for s, sol in solutions.items()} if adjoint is not None else {}
            table.write(run.groups)
            if run.groups.count > 1:
                log_other_groups(run.groups, table.rows, run.prompt_info(), p.heads.layers)
            _particle_risk(run, adjoint, local, gradient, results)
        except SolverBreakdown as e:
            status, error = "breakdown", e
            if not table.written:   # the breakdown came from the tokens' run
                table.write(run.groups)
        drawn = run.draw(snapshots)
        summary = run.summary(
            status, error, final_diagnostics=table.final(), **results,
            files={"diagnostics": "diagnostics.csv", "log": "pdeformer.log",
                   "tokens": run.groups.gather_lists(tokens.files if tokens else []),
                   **({"gradient": "gradient.npz"} if gradient else {}), **drawn})
        if error is not None:
            raise error
    return summary
