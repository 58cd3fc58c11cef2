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
from .errors import ConfigError, InputError
from .forward import ForwardSolver, build_problem
from .output import provenance, write_json
from .parallel import Timer, add_log_file, on_root
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


def prepare_output(cfg: dict, comm) -> str:
    outdir = cfg["output"]["dir"]
    on_root(comm, _make_outdir, outdir)
    add_log_file(comm, os.path.join(outdir, "pdeformer.log"))
    return outdir


def run_forward(cfg: dict, comm=None) -> dict:
    """Forward pass of every prompt; returns the summary (also written to summary.json)."""
    comm = comm or MPI.COMM_WORLD
    timer = Timer()
    out = cfg["output"]
    if out["fields"] and out["format"] == "vtx" and not dfx.has_vtx():
        raise ConfigError("output.format", f"'vtx' needs dolfinx >= 0.8 built with ADIOS2 "
                          f"(this is dolfinx {dfx.VERSION_STRING}); use 'vtk'")
    # inputs first (mesh, heads, prompts): bad input fails before anything is written
    with timer.phase("setup"):
        problem = build_problem(cfg, comm)
    solver = ForwardSolver(problem, timer)
    outdir = prepare_output(cfg, comm)
    info = provenance(comm) if comm.rank == 0 else {}
    log.info("pdeformer forward %s on %d rank(s), output in %s", cfg["config_file"], comm.size, outdir)
    table = DiagnosticsTable(os.path.join(outdir, "diagnostics.csv"))
    trackers = [ProgressLog(), table]
    fields = None
    if out["fields"]:
        fields = FieldOutput(outdir, out["format"], out["velocity"])
        trackers.append(fields)
    with timer.phase("forward"):
        prompts = solver.run(trackers)
    timings = timer.report(comm)

    summary = {
        "command": "forward",
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
        "prompts": prompts,
        "stats": solver.stats,
        "timings": timings,
        "final_diagnostics": table.final(),
        "files": {"diagnostics": "diagnostics.csv", "log": "pdeformer.log",
                  "fields": [os.path.relpath(f, outdir) for f in (fields.files if fields else [])]},
    }
    if comm.rank == 0:
        write_json(os.path.join(outdir, "summary.json"), summary)
    log.info("done in %.1f s (setup %.1f s, velocity %.1f s, transport %.1f s, output %.1f s)",
             timings["total"], timings.get("setup", 0), timings.get("velocity", 0),
             timings.get("transport", 0), timings.get("output", 0))
    return summary
