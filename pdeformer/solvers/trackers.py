"""Trackers: what watches a forward run (progress log, diagnostics table, fields).

Each is plugged into :meth:`ForwardSolver.run`; none is threaded through the solver.
Diagnostics of a frame are computed once and shared (``frame.extra``).

With prompt groups every group's trackers see only that group's prompts: field series
are written by the group that owns the prompt (collectively on its communicator), the
diagnostics rows of all groups are gathered once the groups have met
(:meth:`DiagnosticsTable.write`), and rank 0 then logs the other groups' progress
(:func:`log_other_groups`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import dolfinx.fem

from ..fem import _dolfinx as dfx
from .forward import Frame, ForwardSolver, Tracker
from ..tools.output import diagnostics_header, diagnostics_row, write_csv
from ..tools.errors import OutputError
from ..tools.parallel import any_rank, on_root, scatter_forward

log = logging.getLogger("pdeformer")


def frame_diagnostics(solver: ForwardSolver, frame: Frame) -> dict:
    if "diagnostics" not in frame.extra:
        frame.extra["diagnostics"] = solver.diagnostics(frame)
    return frame.extra["diagnostics"]


class ProgressLog(Tracker):
    """Rank 0 logs each layer boundary: layer, t, steps, dt, mass, outflow, min rho, wall time."""

    def start(self, solver):
        self.t0 = time.perf_counter()
        p = solver.problem
        g = p.groups
        ranks = f"{g.world.size} rank(s)" if g.count == 1 else \
            f"{g.world.size} rank(s) in {g.count} prompt groups of {g.size}"
        log.info("%d prompt(s), L = %d layers, H = %d heads, d = %d, %s, %s, %s",
                 len(p.prompts), p.heads.layers, p.heads.heads, p.dim, solver.describe(),
                 solver.scheme.name, ranks)
        if g.count > 1:
            log.info("group 0 (this log) holds %s; the other groups' progress is logged "
                     "when the groups meet", ", ".join(g.names[i] for i in g.owned))

    def frame(self, solver, frame):
        if not frame.layer_boundary:
            return
        dg = frame_diagnostics(solver, frame)
        L = solver.problem.heads.layers
        log.info("%-10s layer %2d/%d  t=%.4f  steps %5d  dt=%.3e  mass=%.12f  outflow=%.3e  "
                 "min rho=% .3e  %7.1f s", frame.prompt, frame.layer + 1, L, frame.t, frame.steps,
                 frame.dt, dg["mass"], dg["outflow"], dg["min_rho"], time.perf_counter() - self.t0)


class DiagnosticsTable(Tracker):
    """diagnostics.csv: one row per prompt at t = 0 and at every frame end (every layer
    boundary, and ``[output] frames_per_layer`` - 1 times inside each layer).

    Rows are collected while the solver runs; :meth:`write` (a combination point: every
    rank of every group calls it) gathers the groups' rows in prompt order and rank 0
    writes the file."""

    def __init__(self, filename: str):
        self.filename = filename
        self.rows: list[dict] = []
        self.dim = None
        self.written = False

    def frame(self, solver, frame):
        self.rows.append(frame_diagnostics(solver, frame))

    def finish(self, solver):
        self.dim = solver.problem.dim

    def write(self, groups) -> None:
        """Gather the rows of all groups (prompt order, then t) and write the file (rank 0)."""
        order = {n: i for i, n in enumerate(groups.names)}
        self.rows = sorted(groups.gather_lists(self.rows), key=lambda r: order[r["prompt"]])
        self.written = True
        if self.dim is not None:
            extras = (self.rows[0].get("extras") or {}) if self.rows else {}
            on_root(groups.world, write_csv, self.filename, diagnostics_header(self.dim, extras),
                    [diagnostics_row(r) for r in self.rows])

    def final(self) -> list[dict]:
        """The last row of every prompt."""
        last = {}
        for r in self.rows:
            last[r["prompt"]] = r
        return list(last.values())


class FieldOutput(Tracker):
    """Density (and velocity) of every prompt over depth: ``density_<prompt>.pvd`` and
    ``velocity_<prompt>.pvd`` (or ``.bp`` with format "vtx"), one frame per output time."""

    def __init__(self, folder: str, fmt: str = "vtk", velocity: bool = True):
        self.folder = folder
        self.fmt = fmt
        self.needs_velocity = velocity
        self.files: list[str] = []
        self._series = None
        self._prompt = None

    def start(self, solver):
        tr = solver.transport
        self.rho = dolfinx.fem.Function(tr.V, name="density")
        self.vel = dolfinx.fem.Function(tr.W, name="velocity")

    def _open(self, solver, prompt):
        self._close()
        ext = ".bp" if self.fmt == "vtx" else ".pvd"
        comm = solver.comm
        names = [os.path.join(self.folder, f"density_{prompt}{ext}")]
        self._series = [dfx.FieldSeries(comm, names[0], self.rho, self.fmt)]
        if self.needs_velocity:
            names.append(os.path.join(self.folder, f"velocity_{prompt}{ext}"))
            self._series.append(dfx.FieldSeries(comm, names[1], self.vel, self.fmt))
        self.files += names
        self._prompt = prompt

    def _close(self) -> bool:
        """Close the open series; whether that worked (the .pvd is written at the end)."""
        return _close_all(self._series or ())

    def frame(self, solver, frame):
        if frame.prompt != self._prompt:
            self._open(solver, frame.prompt)
        n = solver.transport.n_owned
        self.rho.x.array[:n] = frame.coeffs
        scatter_forward(self.rho, solver.comm)
        if self.needs_velocity:
            self.vel.x.array[:frame.velocity.size] = frame.velocity.ravel()
            scatter_forward(self.vel, solver.comm)
        try:
            for s in self._series:
                s.write(frame.t)
            ok = all(s.complete() for s in self._series)
        except (RuntimeError, OSError):
            ok = False
        self._check(solver, ok)

    def finish(self, solver):
        ok = self._close()
        self._check(solver, ok)
        self._series = None

    def _check(self, solver, ok: bool) -> None:
        """A write that failed on some rank ends the group: the current prompt's series
        are removed (they are cut) and an OutputError (exit 3) is raised on every rank."""
        if not any_rank(solver.comm, not ok):
            return
        series, prompt = self._series or [], self._prompt
        self._series, self._prompt = None, None
        self.files = [f for f in self.files if f not in {s.filename for s in series}]
        _close_all(series)
        solver.comm.Barrier()
        if solver.comm.rank == 0:
            for s in series:
                for name in s.files():
                    shutil.rmtree(name, ignore_errors=True) if os.path.isdir(name) else _remove(name)
        solver.comm.Barrier()
        free = shutil.disk_usage(self.folder).free
        raise OutputError(f"output: cannot write the fields of prompt {prompt!r} into "
                          f"{self.folder} ({'no space left on the device' if free < 2**20 else 'written incompletely'}); "
                          "its partial series were removed")


def _close_all(series) -> bool:
    """Close field series; whether every one closed (dolfinx raises "Could not write
    VTKFile" when the .pvd it writes then fails)."""
    ok = True
    for s in series:
        try:
            s.close()
        except RuntimeError:
            ok = False
    return ok


def _remove(name: str) -> None:
    try:
        os.remove(name)
    except OSError:
        pass


def log_other_groups(groups, rows: list[dict], prompt_info: list, layers: int) -> None:
    """Rank 0 logs the layer-boundary rows of the prompts other groups solved (after
    :meth:`DiagnosticsTable.write` gathered them): the group 0 prompts were logged live."""
    index = {name: i for i, name in enumerate(groups.names)}
    for r in rows:
        i = index[r["prompt"]]
        if groups.owner[i] == 0:
            continue
        info = prompt_info[i] or {}
        log.info("%-10s layer %2d/%d  t=%.4f  steps %5s  mass=%.12f  outflow=%.3e  min rho=% .3e  "
                 "(group %d)", r["prompt"], round(r["t"] * layers), layers, r["t"],
                 info.get("steps", "-") if r["t"] == 1.0 else "-", r["mass"], r["outflow"],
                 r["min_rho"], groups.owner[i])
