"""Runs as the CLI launches them: build, solve, track, write the summary.

``run_forward(cfg)`` is ``pdeformer forward RUN.toml`` without the command line.
Every run writes into ``[output] dir``: ``diagnostics.csv``, the field series,
``pdeformer.log`` and ``summary.json`` (resolved config, versions, ranks, git commit,
wall time per phase, final diagnostics).
"""

from __future__ import annotations

import logging
import os

from mpi4py import MPI

from . import _dolfinx as dfx
from .errors import ConfigError, InputError, SolverBreakdown
from .forward import ForwardSolver, build_problem
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


def run_forward(cfg: dict, comm=None) -> dict:
    """Forward pass of every prompt; returns the summary (also written to summary.json).

    After a breakdown (NaN, overflow) the diagnostics so far and a summary with
    ``"status": "breakdown"`` and the error are still written, then the error is raised."""
    comm = comm or MPI.COMM_WORLD
    timer = Timer()
    out = cfg["output"]
    if out["fields"] and out["format"] == "vtx" and not dfx.has_vtx():
        raise ConfigError("output.format", f"'vtx' needs dolfinx built with ADIOS2 "
                          f"(this is dolfinx {dfx.VERSION_STRING} without it); use 'vtk'")
    # inputs first (mesh, heads, prompts): bad input fails before anything is written
    with timer.phase("setup"):
        problem = build_problem(cfg, comm)
    solver = ForwardSolver(problem, timer)
    outdir = out["dir"]
    on_root(comm, _make_outdir, outdir)
    log_file = add_log_file(comm, os.path.join(outdir, "pdeformer.log"))
    info = provenance(comm) if comm.rank == 0 else {}
    log.info("pdeformer forward %s on %d rank(s), output in %s", cfg["config_file"], comm.size, outdir)
    if dfx.untested_version_warning() and comm.rank == 0:
        log.warning(dfx.untested_version_warning())
    table = DiagnosticsTable(os.path.join(outdir, "diagnostics.csv"))
    trackers = [ProgressLog(), table]
    fields = FieldOutput(outdir, out["format"], out["velocity"]) if out["fields"] else None
    if fields:
        trackers.append(fields)
    status, error = "completed", None
    try:
        with timer.phase("forward"):
            solver.run(trackers)
    except SolverBreakdown as e:
        status, error = "breakdown", e
    try:
        timings = timer.report(comm)
        summary = {
            "command": "forward",
            "status": status,
            "error": str(error) if error else None,
            "config": cfg,
            "provenance": info,
            "ranks": comm.size,
            "mesh": {"dim": problem.dim, "cells": dfx.global_cells(problem.mesh),
                     "cell_type": dfx.cell_type_name(problem.mesh),
                     "density_dofs": solver.transport.V.dofmap.index_map.size_global,
                     "velocity_nodes": solver.transport.W.dofmap.index_map.size_global,
                     "attention_sources": int(solver.transport.source_points.shape[0])},
            "model": {"layers": problem.heads.layers, "heads": problem.heads.heads,
                      "key_dim": problem.heads.key_dim},
            "prompts": solver.prompt_info,
            "stats": solver.stats,
            "timings": timings,
            "final_diagnostics": table.final(),
            "files": {"diagnostics": "diagnostics.csv", "log": "pdeformer.log",
                      "fields": [os.path.relpath(f, outdir) for f in (fields.files if fields else [])]},
        }
        if comm.rank == 0:
            write_json(os.path.join(outdir, "summary.json"), summary)
        if error is not None:
            raise error
        log.info("done in %.1f s (setup %.1f s, velocity %.1f s, transport %.1f s, output %.1f s)",
                 timings["total"], timings.get("setup", 0), timings.get("velocity", 0),
                 timings.get("transport", 0), timings.get("output", 0))
        return summary
    finally:
        remove_log_file(log_file)
